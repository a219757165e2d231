"""The run folder: where a run writes (a new folder, or the one --resume names), what a resume
continues from (its newest complete checkpoint) and with which flags (a flag that would change the
experiment is refused unless --resume-override starts a new folder from the checkpoint's weights),
and the lock that keeps two processes from writing one folder. Links in it are refused. The
checkpoints themselves: common/plumbing/checkpoint.py; loading one back: resume.py."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import time

from common.plumbing.checkpoint import (
    _CKPT_RE,
    MARKER,
    PATH_FLAGS,
    PREFIX,
    STATE_FILE,
    _listdir,
    list_checkpoints,
    read_marker,
    same_path_meaning,
    verify_checkpoint,
)
from common.plumbing.checks import ConfigError, read_json

_NONCANONICAL_RE = re.compile(rf"^\.?{PREFIX}0\d+")

# Flags that may differ between a run and its resume: how long, how often to evaluate/log/save,
# where outputs go, what the run is called, and tracking. Each changes neither the samples nor the
# updates of the iterations still to come.
MAY_CHANGE_ON_RESUME = {
    "num_iterations": "train longer (or stop sooner)",
    "save_every": "checkpoint cadence",
    "keep_checkpoints": "how many checkpoints are kept",
    "eval_every": (
        "evaluation cadence (the protocol itself, prompts, steps, seeds, guidance, is compared)"
    ),
    "eval_batch_size": "how many evaluation images share a transformer call (same images)",
    "decode_batch_size": "how many images share a VAE decode call (the same images to float rounding)",
    "guard_rewards": "rewards logged at evaluation only, never trained on",
    "gradient_checkpointing": (
        "recomputes the same activations in the backward pass (memory, not results)"
    ),
    "output_dir": "where new run folders go",
    "run_name": "the name of a new run folder (--resume-override)",
    "exp_name": "part of the default run name",
    "resume": "the checkpoint being resumed",
    "resume_override": "this switch itself",
    "resumed_from": "filled in by the resume",
    "track": "wandb logging",
    "wandb_project_name": "wandb logging",
    "wandb_entity": "wandb logging",
}
# Filled in by check_args from flags that are compared (and world_size, which is): comparing them
# would only repeat a difference already named.
DERIVED = {"images_per_iteration", "images_per_rank", "prompts_per_rank", "trained_steps"}
# Flags that change the shape of the trained weights: a checkpoint cannot be loaded into another
# shape, override or not.
SHAPE_FLAGS = ("lora_rank", "lora_target", "full_finetune")


def find_resume_checkpoint(path: str, log=print) -> str:
    """The checkpoint folder --resume PATH means, verified; one ConfigError line when there is none
    to use.

    PATH a run folder: its latest complete checkpoint (an unusable newer one is named in one warning
    line). PATH a checkpoint folder: that one; if it is unusable, the error names the older complete
    one to pass instead.
    """
    p = os.path.abspath(path.rstrip("/") or "/")
    if not os.path.exists(p):
        raise ConfigError(
            f"--resume '{path}' does not exist: pass a run folder ({{output_dir}}/{{run_name}}) or "
            "one of its checkpoint-N folders"
        )
    if not os.path.isdir(p):
        raise ConfigError(
            f"--resume '{path}' is a file: pass a run folder or one of its checkpoint-N folders"
        )
    is_ckpt = bool(_CKPT_RE.match(os.path.basename(p))) or any(
        os.path.exists(os.path.join(p, f)) for f in (MARKER, STATE_FILE)
    )
    if is_ckpt:
        problem = verify_checkpoint(p)
        if problem is None:
            return p
        run = os.path.dirname(p)
        older = [
            c
            for _, c in reversed(list_checkpoints(run, interrupted=True))
            if c != p and verify_checkpoint(c) is None
        ]
        hint = (
            f"pass the older complete checkpoint instead: --resume {older[0]} (or the run folder "
            f"{run})"
            if older
            else "this run has no other complete checkpoint: start a new run without --resume"
        )
        raise ConfigError(f"--resume: {problem}; {hint}")
    found = list_checkpoints(p, interrupted=True)
    if not found:
        raise ConfigError(
            f"--resume '{path}' holds no checkpoint-N folder: pass a run folder a training script "
            "wrote (with at least one saved checkpoint) or one of its checkpoint-N folders"
        )
    problems = []
    for _, c in reversed(found):
        problem = verify_checkpoint(c)
        if problem is None:
            if problems:
                log(
                    f"warning: {problems[0]}; resuming from {c}, the latest complete checkpoint, "
                    "instead"
                )
            return c
        problems.append(problem)
    more = (
        f" (and {len(problems) - 1} older checkpoint(s) are unusable too)"
        if len(problems) > 1
        else ""
    )
    raise ConfigError(
        f"--resume: {problems[0]}{more}; this run has no complete checkpoint: start a new run "
        "without --resume"
    )


def resume_source(path: str, log=print) -> tuple[str | None, dict, dict]:
    """What --resume PATH continues: (its verified checkpoint, or None for a run folder that died
    before its first checkpoint, which restarts in place; the run's flags; their path fingerprints).
    A run folder without a checkpoint is known by its args.json."""
    p = os.path.abspath(path.rstrip("/") or "/")
    args_file = os.path.join(p, "args.json")
    run = p if not re.match(rf"^\.?{PREFIX}", os.path.basename(p)) else os.path.dirname(p)
    odd = sorted(n for n in _listdir(run) if _NONCANONICAL_RE.match(n))
    if odd:
        raise ConfigError(
            f"--resume '{path}': {os.path.join(run, odd[0])} is not a checkpoint name this code "
            "writes (checkpoint-N has no leading zeros), so which iteration it holds is ambiguous: "
            "rename it to checkpoint-N, or move it out of the run folder"
        )
    if (
        os.path.isdir(p)
        and not _CKPT_RE.match(os.path.basename(p))
        and not list_checkpoints(p, interrupted=True)
        and os.path.lexists(args_file)
    ):
        try:
            return None, read_json(args_file), {}
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--resume '{path}' holds no checkpoint and its args.json cannot be read "
                f"({e.__class__.__name__}: {e}): start a new run without --resume"
            ) from None
    ckpt = find_resume_checkpoint(path, log)
    marker = read_marker(ckpt)
    return ckpt, marker.get("args", {}), marker.get("path_fingerprints") or {}


# Flags a resume never takes from the run: the resume itself, and where a NEW run folder goes
# (--resume-override); the program's derived fields are recomputed.
NOT_ADOPTED = {"resume", "resume_override", "run_name", "output_dir"}


def adopt_run_flags(args, saved: dict, fingerprints: dict, given: set[str]) -> None:
    """A resume continues the run as it was: every flag not given on the command line takes the
    run's own value (a path flag keeps this checkout's value when both name the same content, as in
    a second clone). Flags given that differ from the run's are named by resolve_run_dir."""
    for f in dataclasses.fields(args):
        if not f.init or f.name in NOT_ADOPTED or f.name not in saved:
            continue
        value, now = saved[f.name], getattr(args, f.name)
        if isinstance(value, list) and "tuple" in str(f.type):
            value = tuple(value)
        if f.name in given or (
            f.name in PATH_FLAGS and same_path_meaning(value, now, fingerprints.get(f.name))
        ):
            continue
        setattr(args, f.name, value)


def _json(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))  # tuples -> lists, as the marker stores them


def changed_flags(
    saved: dict, now: dict, fingerprints: dict | None = None, digests: dict | None = None
) -> list[tuple[str, object, object]]:
    """(flag, value in the checkpoint, value now) for every experiment-defining argument that
    differs; path flags differ only when they point to different content (`same_path_meaning`,
    with the checkpoint's recorded `fingerprints` for paths that are gone). A prompt file read by
    this process (`digests`: {flag: sha256 of the bytes read}) is compared by those bytes with
    the recorded fingerprint whatever its path: the same path may now hold other prompts, and a
    pipe (`<(...)`) has the same name every time and cannot be read twice."""
    saved, now, missing, fingerprints = _json(saved), _json(now), "(absent)", fingerprints or {}
    digests = digests or {}
    keys = sorted((set(saved) | set(now)) - set(MAY_CHANGE_ON_RESUME) - DERIVED)
    out = []
    for k in keys:
        a, b = saved.get(k, missing), now.get(k, missing)
        if k in digests and fingerprints.get(k):
            if digests[k] != fingerprints[k]:
                out.append((k, a, f"{b} (other content)" if a == b else b))
        elif a != b and not (k in PATH_FLAGS and same_path_meaning(a, b, fingerprints.get(k))):
            out.append((k, a, b))
    return out


def _describe(changes) -> str:
    def show(v):
        return (
            repr(v)
            if isinstance(v, str) and v != "(absent)"
            else " ".join(map(str, v))
            if isinstance(v, list)
            else str(v)
        )

    return ", ".join(f"--{k.replace('_', '-')} {show(a)} -> {show(b)}" for k, a, b in changes)


def _has_final_row(run_dir: str, iteration: int) -> bool:
    """The run's metrics.jsonl holds its final evaluation at `iteration`."""
    from common.plumbing.utils import read_metrics_lines

    rows, _ = read_metrics_lines(os.path.join(run_dir, "metrics.jsonl"))
    return any(r.get("final") and r.get("iteration") == iteration for r in rows)


def default_run_name(args) -> str:
    return f"{args.exp_name}__{args.seed}__{int(time.time())}"


def _same_on_all_ranks(name: str) -> str:
    """Rank 0's value (a default run name holds the time, which ranks could read a second apart)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        box = [name]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return name


def check_writable(folder: str, flag: str = "--output-dir") -> None:
    """Create `folder` and write a probe file in it: an unwritable or full output folder is one
    line, up front."""
    probe = os.path.join(folder, f".write_test_{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(probe)  # a leftover of an earlier process (a link is removed, not followed)
        # O_EXCL: a file of our own, never one a link points to
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        os.write(fd, b"ok")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        fix = (
            "make it writable, or copy the run folder to a place you can write and resume the copy"
            if flag == "--resume"
            else "choose a folder you can write to, or free space"
        )
        raise ConfigError(
            f"{flag}: cannot write the run folder {folder} ({e.__class__.__name__}: "
            f"{e.strerror or e}): {fix}"
        ) from None


LOCK_FILE = ".lock"  # {run_dir}/.lock: flock-ed by the one process that writes the run folder
# What a run writes into its folder: a folder holding any of these holds a run. (A launcher's own
# files beside them, such as the comparison harness's harness.json and stdout.log, are not a run.)
RUN_OUTPUTS = (
    "args.json",
    "metrics.jsonl",
    "samples",
    "wandb",
    "checkpoint-*",
    ".checkpoint-*",
    "learning_curve.png",
    "steps_heatmap.png",
    "before_after.png",
)
# run folder -> its open, locked .lock file (this process owns the folder)
_held: dict[str, object] = {}


def hold_run_folder(run_dir: str) -> None:
    """One owner per run folder: an exclusive, non-blocking flock on {run_dir}/.lock, held until
    `release_run_folder` or the end of the process (the kernel drops it at any exit, SIGKILL
    included, so a crash leaves no stale lock). A second process on the same folder stops here, in
    one line, before it has written anything. Needs a file system whose flock works across the
    processes that share it (local disks; NFS with its lock service)."""
    import fcntl

    if run_dir in _held:
        return
    refuse_links(run_dir)
    path = os.path.join(run_dir, LOCK_FILE)
    try:  # O_NOFOLLOW: a .lock link planted after the check above is refused, never truncated
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(
            f"cannot open the run folder's lock {path} ({e.__class__.__name__}: "
            f"{e.strerror or e}): {_LINK_FIX if e.errno == errno.ELOOP else 'remove it, or fix its permissions (a run creates its lock as a plain file)'}"
        ) from None
    f = os.fdopen(fd, "r+")  # held open for the life of the run
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "?"
        f.close()
        raise ConfigError(
            f"the run folder {run_dir} is being written by another process (pid {owner}): wait for "
            "it to end, or pass another --run-name (or --output-dir); nothing was written"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held[run_dir] = f


_LINK_FIX = (
    "a run writes and deletes only its own files, never through a link: replace the link with a "
    "copy of what it points to (or remove it), then run again; nothing was written"
)


def refuse_links(run_dir: str) -> None:
    """A run folder holds no symbolic link where the run writes or deletes: its top level, samples/
    and its checkpoint folders. A link there (in a folder someone else made) would make the run
    write outside the folder, truncate the file it points to, or delete through it: one line,
    before anything is written. (A link to the run folder itself, e.g. a runs/ folder on another
    disk, is the user's choice and fine; wandb's own links inside wandb/ are not looked at.)"""
    for name in sorted(_listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            found = path
        elif name == "samples" or name.startswith((PREFIX, "." + PREFIX)):
            found = next(
                (
                    os.path.join(d, n)
                    for d, dirs, files in os.walk(path)
                    for n in dirs + files
                    if os.path.islink(os.path.join(d, n))
                ),
                None,
            )
        else:
            continue
        if found:
            raise ConfigError(
                f"{found} is a symbolic link (to {os.readlink(found)}) inside the run folder "
                f"{run_dir}: {_LINK_FIX}"
            )


def release_run_folder(run_dir: str) -> None:
    f = _held.pop(run_dir, None)
    if f is not None:
        f.close()  # closing the file drops the flock


def run_outputs(run_dir: str) -> list[str]:
    """The names in `run_dir` that a run wrote (RUN_OUTPUTS), sorted."""
    import fnmatch

    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    return sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in RUN_OUTPUTS))


def resolve_run_dir(
    args,
    script_file: str,
    is_main: bool = True,
    source=None,
    given: frozenset = frozenset(),
    digests: dict | None = None,
) -> tuple[str, str | None]:
    """(run folder, checkpoint folder to resume or None), checked before any model is loaded.

    Without --resume: {output_dir}/{run_name}, created and probed for writing; a folder that already
    holds a run is refused (continue it with --resume). With --resume: the verified checkpoint, and
    its run folder, unless the experiment-defining arguments differ: then one ConfigError line, or,
    with --resume-override, a NEW run folder (args.resumed_from records the checkpoint; the old run
    is untouched). Rank 0 holds the folder it will write (`hold_run_folder`) from here on: a second
    process on it stops in one line. `digests` ({path flag: sha256 of the bytes the set-up read}):
    the prompt files as read, compared with what the run recorded whatever their path (a pipe).
    """
    if not args.resume:
        run_dir = os.path.join(
            args.output_dir, _same_on_all_ranks(args.run_name or default_run_name(args))
        )
        if is_main:
            check_writable(run_dir)
            hold_run_folder(run_dir)
            found = run_outputs(run_dir)
            if found:
                release_run_folder(run_dir)
                raise ConfigError(
                    f"the run folder {run_dir} already holds a run ({', '.join(found[:4])}"
                    f"{', ...' if len(found) > 4 else ''}): continue it with --resume {run_dir}, "
                    "or pass another --run-name; nothing in it was changed"
                )
        return run_dir, None
    log = print if is_main else (lambda *_: None)
    ckpt, saved, fingerprints = source or resume_source(args.resume, log)
    source_folder = os.path.dirname(ckpt) if ckpt else os.path.abspath(args.resume.rstrip("/"))
    if (
        "run_name" in given
        and not args.resume_override
        and args.run_name != os.path.basename(source_folder)
    ):
        raise ConfigError(
            f"--run-name {args.run_name} names a new run folder, which only --resume-override "
            f"starts: drop --run-name to continue {source_folder} in place"
        )
    script = os.path.basename(script_file)
    saved = dict(saved)
    written_by = saved.pop("script", None)  # args.json names its script (since 2026-12-05)
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(args)})
    if ckpt is None and (written_by not in (None, script) or unknown):
        # a folder without a checkpoint is known by its args.json: by the script it names, else
        # by the script whose flags it holds (folders written before args.json named it)
        written_by = written_by or _script_with_flags(os.path.dirname(script_file), unknown)
        if written_by is None:
            raise ConfigError(
                f"--resume {source_folder}: its args.json has flags {script} does not have "
                f"({', '.join('--' + u.replace('_', '-') for u in unknown[:5])}): resume it with the "
                "script that wrote it, or start a new run"
            )
        raise ConfigError(
            f"--resume {source_folder} was written by {written_by}, not {script}: resume it with "
            f"`python {written_by} --resume {source_folder}`"
        )
    changes = changed_flags(saved, dataclasses.asdict(args), fingerprints, digests)
    if ckpt is None:
        return _restart_in_place(args, changes, is_main)
    marker = read_marker(ckpt)
    if "world_size" in {c[0] for c in changes}:
        raise ConfigError(
            f"--resume {ckpt} was trained by {saved.get('world_size')} process(es), this is "
            f"{args.world_size}: resume it under `torchrun --nproc_per_node "
            f"{saved.get('world_size')}` (or python alone for 1), or add --resume-override to start "
            "a new run folder from its weights"
        )
    saved_script = marker.get("script")
    if saved_script and saved_script != script:
        raise ConfigError(
            f"--resume {ckpt} was written by {saved_script}, not {script}: resume it with "
            f"`python {saved_script} --resume ...`"
        )
    shape = [c for c in changes if c[0] in SHAPE_FLAGS]
    if shape:
        raise ConfigError(
            f"--resume {ckpt}: {_describe(shape)} changes the shape of the trained weights, which "
            "cannot be loaded into it (not even with --resume-override): pass the checkpoint's "
            "value, or start a new run without --resume"
        )
    source_run = os.path.dirname(ckpt)
    if changes and not args.resume_override:
        raise ConfigError(
            f"--resume {ckpt} was trained with other experiment-defining flags: "
            f"{_describe(changes)}; drop them to continue that run with its own values, or add "
            "--resume-override to start a new run folder from its weights"
        )
    # (a new folder loses nothing). At the checkpoint's own iteration a run may still owe its final
    # evaluation (killed after its last save): then the resume runs only that.
    owes_final = args.num_iterations == marker["iteration"] and not _has_final_row(
        source_run, marker["iteration"]
    )
    if args.num_iterations <= marker["iteration"] and not args.resume_override and not owes_final:
        raise ConfigError(
            f"--resume {ckpt} is at iteration {marker['iteration']} and --num-iterations "
            f"{args.num_iterations} asks for no more: pass --num-iterations above "
            f"{marker['iteration']} to train on; nothing was changed"
        )
    args.resumed_from = ckpt
    if not args.resume_override:
        if is_main:
            check_writable(source_run, "--resume")  # a read-only copy of a run: one line, now
            hold_run_folder(source_run)
            _note_deletions(args, saved, source_run)
        return source_run, ckpt
    run_dir = os.path.join(
        args.output_dir, _same_on_all_ranks(args.run_name or default_run_name(args))
    )
    if os.path.abspath(run_dir) == source_run:
        raise ConfigError(
            f"--resume-override starts a new run folder, but {run_dir} is the run being resumed: "
            "pass another --run-name"
        )
    if is_main:
        if os.path.isdir(run_dir) and os.listdir(run_dir):
            raise ConfigError(
                f"--resume-override: the new run folder {run_dir} already exists and is not empty: "
                "pass another --run-name"
            )
        check_writable(run_dir)
        hold_run_folder(run_dir)
        what = _describe(changes) if changes else "no flag changed"
        print(
            f"resuming {ckpt} (iteration {marker['iteration']}) as a NEW run in {run_dir} "
            f"({what}); {source_run} is left as it is"
        )
    return run_dir, ckpt


def _script_with_flags(folder: str, names: list[str]) -> str | None:
    """The training script beside this one (the project's own files, in `folder`) whose Args have
    every one of `names`, if exactly one does."""
    import runpy

    found = []
    for entry in sorted(_listdir(folder)):
        path = os.path.join(folder, entry)
        if not entry.endswith(".py") or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            if "\nclass Args(" not in f.read():
                continue
        args_class = runpy.run_path(path, run_name="not_main").get("Args")
        fields = {f.name for f in dataclasses.fields(args_class)} if args_class else set()
        if set(names) <= fields:
            found.append(entry)
    return found[0] if len(found) == 1 else None


def _restart_in_place(args, changes, is_main: bool) -> tuple[str, None]:
    """--resume of a run folder that died before its first checkpoint: the run starts again in its
    own folder from iteration 0 with its own flags. It samples what it sampled before (the seeds
    are the run's), so the rows it rewrites are the ones it had."""
    run_dir = os.path.abspath(args.resume.rstrip("/"))
    if args.resume_override:
        raise ConfigError(
            f"--resume-override {run_dir}: the run has no checkpoint to start a new run from; drop "
            "--resume-override to restart it in place, or start a new run without --resume"
        )
    if changes:
        raise ConfigError(
            f"--resume {run_dir} (no checkpoint yet) restarts the run with its own flags, and "
            f"{_describe(changes)} would change them: drop them, or start a new run without --resume"
        )
    if is_main:
        check_writable(run_dir, "--resume")
        hold_run_folder(run_dir)  # refuses links: what is deleted below is the run's own
        restarted = [n for n in run_outputs(run_dir) if n not in ("args.json", "wandb")]
        for name in restarted:
            path = os.path.join(run_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        print(
            f"{run_dir} holds no checkpoint: restarting the run in place from iteration 0 with its "
            f"own flags (args.json){'; replaced ' + ', '.join(restarted) if restarted else ''}"
        )
    return run_dir, None


def _note_deletions(args, saved: dict, run_dir: str) -> None:
    """One line when a --keep-checkpoints given to this resume will delete checkpoints the run kept."""
    keep = args.keep_checkpoints
    kept = saved.get("keep_checkpoints", keep)
    have = [c for _, c in list_checkpoints(run_dir)]
    if keep and keep != kept and len(have) >= keep:
        print(
            f"note: --keep-checkpoints {keep} (the run kept {kept or 'all'}): "
            f"{', '.join(os.path.basename(c) for c in have[: len(have) - keep + 1])} will be "
            "deleted as new checkpoints complete"
        )
