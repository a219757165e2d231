"""The run folder: where a run writes (a new folder, or the one --resume names), what a resume
continues from (its newest complete checkpoint) and with which flags (a flag that would change the
experiment is refused unless --resume-override starts a new folder from the checkpoint's weights),
and the lock that keeps two processes from writing one folder. Links in it are refused."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import fnmatch
import json
import os
import re
import runpy
import shutil
import time

import torch.distributed as dist

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
from common.plumbing.utils import read_metrics_lines

# Flags that may differ between a run and its resume: none changes the samples or the updates of
# the iterations still to come. Anything else is experiment-defining (a new flag is, by default).
MAY_CHANGE_ON_RESUME = {
    "num_iterations",
    "save_every",
    "keep_checkpoints",
    "eval_every",  # the evaluation protocol itself (prompts, steps, seeds, guidance) is compared
    "eval_batch_size",  # the same images
    "decode_batch_size",  # the same images to float rounding
    "guard_rewards",  # logged at evaluation only, never trained on
    "gradient_checkpointing",  # memory, not results
    "output_dir",
    "run_name",
    "exp_name",
    "resume",
    "resume_override",
    "resumed_from",
    "track",
    "wandb_project_name",
    "wandb_entity",
}
# Derived by check_args from compared flags: comparing them would repeat a difference already named.
DERIVED = {"images_per_iteration", "images_per_rank", "prompts_per_rank", "trained_steps"}
# They change the trained weights' shape: no checkpoint loads into another shape, override or not.
SHAPE_FLAGS = ("lora_rank", "lora_target", "full_finetune")
# Never taken from the run on a resume: the resume itself, and where a NEW run folder goes.
NOT_ADOPTED = {"resume", "resume_override", "run_name", "output_dir"}
LOCK_FILE = ".lock"  # {run_dir}/.lock: flock-ed by the one process that writes the run folder
# What a run writes into its folder: a folder holding any of these holds a run (a launcher's own
# files beside them, such as harness.json and stdout.log, are not a run).
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
_LINK_FIX = (
    "a run writes and deletes only its own files, never through a link: replace the link with a "
    "copy of what it points to (or remove it), then run again; nothing was written"
)
_held: dict[str, object] = {}  # run folder -> its open, flock-ed .lock file


def find_resume_checkpoint(path: str, log=print) -> str:
    """The verified checkpoint folder --resume PATH means (a run folder: its latest complete one,
    an unusable newer one named in a warning), else one ConfigError line naming what to pass."""
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
    if _CKPT_RE.match(os.path.basename(p)) or any(
        os.path.exists(os.path.join(p, f)) for f in (MARKER, STATE_FILE)
    ):
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
    n = len(problems) - 1
    more = f" (and {n} older checkpoint(s) are unusable too)" if n else ""
    raise ConfigError(
        f"--resume: {problems[0]}{more}; this run has no complete checkpoint: start a new run "
        "without --resume"
    )


def resume_source(path: str, log=print) -> tuple[str | None, dict, dict]:
    """(verified checkpoint, or None for a run that died before its first one; the run's flags; their
    path fingerprints) of --resume PATH."""
    p = os.path.abspath(path.rstrip("/") or "/")
    name = os.path.basename(p)
    run = p if not re.match(rf"^\.?{PREFIX}", name) else os.path.dirname(p)
    odd = sorted(n for n in _listdir(run) if re.match(rf"^\.?{PREFIX}0\d+", n))
    if odd:
        raise ConfigError(
            f"--resume '{path}': {os.path.join(run, odd[0])} is not a checkpoint name this code "
            "writes (checkpoint-N has no leading zeros), so which iteration it holds is ambiguous: "
            "rename it to checkpoint-N, or move it out of the run folder"
        )
    args_file = os.path.join(p, "args.json")
    no_checkpoint = not _CKPT_RE.match(name) and not list_checkpoints(p, interrupted=True)
    if no_checkpoint and os.path.lexists(args_file):  # (args.json exists: p is a folder)
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


def adopt_run_flags(args, saved: dict, fingerprints: dict, given: set[str]) -> None:
    """Every flag not given on the command line takes the run's own value (a path flag keeps this
    checkout's value when both name the same content, as in a second clone)."""
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


def changed_flags(
    saved: dict, now: dict, fingerprints: dict | None = None, digests: dict | None = None
) -> list[tuple[str, object, object]]:
    """(flag, value in the checkpoint, value now) for every experiment-defining flag that differs;
    path flags by content (`same_path_meaning`). A prompt file this process read (`digests`:
    {flag: sha256 of the bytes}) is compared by those bytes whatever its path: the same path may
    hold other prompts now, and a pipe (`<(...)`) has one name and cannot be read twice."""
    saved, now = (json.loads(json.dumps(d, default=str)) for d in (saved, now))  # as the marker
    fingerprints, digests, missing = fingerprints or {}, digests or {}, "(absent)"
    out = []
    for k in sorted((set(saved) | set(now)) - set(MAY_CHANGE_ON_RESUME) - DERIVED):
        a, b = saved.get(k, missing), now.get(k, missing)
        if k in digests and fingerprints.get(k):
            if digests[k] != fingerprints[k]:
                out.append((k, a, f"{b} (other content)" if a == b else b))
        elif a != b and not (k in PATH_FLAGS and same_path_meaning(a, b, fingerprints.get(k))):
            out.append((k, a, b))
    return out


def _describe(changes) -> str:
    def show(v):
        if isinstance(v, list):
            return " ".join(map(str, v))
        return repr(v) if isinstance(v, str) and v != "(absent)" else str(v)

    return ", ".join(f"--{k.replace('_', '-')} {show(a)} -> {show(b)}" for k, a, b in changes)


def _new_run_dir(args) -> str:
    """{output_dir}/{run_name}, the default name (it holds the time) as rank 0 has it."""
    box = [args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return os.path.join(args.output_dir, box[0])


def _claim(folder: str, flag: str = "--output-dir") -> None:
    """Create `folder`, probe it for writing (an unwritable or full folder is one line, up front),
    and hold it (`hold_run_folder`)."""
    probe = os.path.join(folder, f".write_test_{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        if os.path.lexists(probe):  # a leftover of an earlier process (a link is not followed)
            os.remove(probe)
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
    hold_run_folder(folder)


def hold_run_folder(run_dir: str) -> None:
    """One owner per run folder: a non-blocking exclusive flock on {run_dir}/.lock, which the kernel
    drops at any exit (no stale lock after a SIGKILL). A second process stops here in one line."""
    if run_dir in _held:
        return
    refuse_links(run_dir)
    path = os.path.join(run_dir, LOCK_FILE)
    try:  # O_NOFOLLOW: a .lock link planted after the check above is refused, never truncated
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        fix = "remove it, or fix its permissions (a run creates its lock as a plain file)"
        if e.errno == errno.ELOOP:
            fix = _LINK_FIX
        raise ConfigError(
            f"cannot open the run folder's lock {path} ({e.__class__.__name__}: "
            f"{e.strerror or e}): {fix}"
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


def refuse_links(run_dir: str) -> None:
    """No symbolic link where a run writes or deletes (its top level, samples/, its checkpoint
    folders): the run would write outside the folder, truncate what it points to, or delete
    through it. A link to the run folder itself is the user's choice; wandb/ is not looked at."""
    for name in sorted(_listdir(run_dir)):
        path = os.path.join(run_dir, name)
        found = path if os.path.islink(path) else None
        if not found and (name == "samples" or name.startswith((PREFIX, "." + PREFIX))):
            inside = (os.path.join(d, n) for d, dirs, files in os.walk(path) for n in dirs + files)
            found = next((p for p in inside if os.path.islink(p)), None)
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
    return sorted(n for n in _listdir(run_dir) if any(fnmatch.fnmatch(n, p) for p in RUN_OUTPUTS))


def resolve_run_dir(
    args,
    script_file: str,
    is_main: bool = True,
    source=None,
    given: frozenset = frozenset(),
    digests: dict | None = None,
) -> tuple[str, str | None]:
    """(run folder, checkpoint to resume or None), checked before any model is loaded: a new
    folder, or the resumed run's, or with --resume-override a NEW one (args.resumed_from). Differing
    experiment-defining flags are one line. Rank 0 holds the folder it will write from here on."""
    if not args.resume:
        run_dir = _new_run_dir(args)
        if is_main:
            _claim(run_dir)
            found = run_outputs(run_dir)
            if found:
                release_run_folder(run_dir)
                raise ConfigError(
                    f"the run folder {run_dir} already holds a run ({', '.join(found[:4])}"
                    f"{', ...' if len(found) > 4 else ''}): continue it with --resume {run_dir}, "
                    "or pass another --run-name; nothing in it was changed"
                )
        return run_dir, None
    ckpt, saved, fingerprints = source or resume_source(
        args.resume, print if is_main else (lambda *_: None)
    )
    source_folder = os.path.dirname(ckpt) if ckpt else os.path.abspath(args.resume.rstrip("/"))
    renamed = "run_name" in given and args.run_name != os.path.basename(source_folder)
    if renamed and not args.resume_override:
        raise ConfigError(
            f"--run-name {args.run_name} names a new run folder, which only --resume-override "
            f"starts: drop --run-name to continue {source_folder} in place"
        )
    script = os.path.basename(script_file)
    saved = dict(saved)
    written_by = saved.pop("script", None)  # args.json names its script (since 2026-12-05)
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(args)})
    if ckpt is None and (written_by not in (None, script) or unknown):
        # known by the script its args.json names, else (older folders) by the one with its flags
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
    iteration, source_run = marker["iteration"], os.path.dirname(ckpt)
    if "world_size" in {c[0] for c in changes}:
        raise ConfigError(
            f"--resume {ckpt} was trained by {saved.get('world_size')} process(es), this is "
            f"{args.world_size}: resume it under `torchrun --nproc_per_node "
            f"{saved.get('world_size')}` (or python alone for 1), or add --resume-override to start "
            "a new run folder from its weights"
        )
    if marker.get("script") and marker["script"] != script:
        raise ConfigError(
            f"--resume {ckpt} was written by {marker['script']}, not {script}: resume it with "
            f"`python {marker['script']} --resume ...`"
        )
    shape = [c for c in changes if c[0] in SHAPE_FLAGS]
    if shape:
        raise ConfigError(
            f"--resume {ckpt}: {_describe(shape)} changes the shape of the trained weights, which "
            "cannot be loaded into it (not even with --resume-override): pass the checkpoint's "
            "value, or start a new run without --resume"
        )
    if changes and not args.resume_override:
        raise ConfigError(
            f"--resume {ckpt} was trained with other experiment-defining flags: "
            f"{_describe(changes)}; drop them to continue that run with its own values, or add "
            "--resume-override to start a new run folder from its weights"
        )
    # a run killed after its last save may still owe its final evaluation: the resume runs only it
    owes_final = args.num_iterations == iteration and not _has_final_row(source_run, iteration)
    if args.num_iterations <= iteration and not args.resume_override and not owes_final:
        raise ConfigError(
            f"--resume {ckpt} is at iteration {iteration} and --num-iterations "
            f"{args.num_iterations} asks for no more: pass --num-iterations above "
            f"{iteration} to train on; nothing was changed"
        )
    args.resumed_from = ckpt
    if not args.resume_override:
        if is_main:
            _claim(source_run, "--resume")  # a read-only copy of a run: one line, now
            _note_deletions(args, saved, source_run)
        return source_run, ckpt
    run_dir = _new_run_dir(args)
    if os.path.abspath(run_dir) == source_run:
        raise ConfigError(
            f"--resume-override starts a new run folder, but {run_dir} is the run being resumed: "
            "pass another --run-name"
        )
    if is_main:
        if _listdir(run_dir):
            raise ConfigError(
                f"--resume-override: the new run folder {run_dir} already exists and is not empty: "
                "pass another --run-name"
            )
        _claim(run_dir)
        print(
            f"resuming {ckpt} (iteration {iteration}) as a NEW run in {run_dir} "
            f"({_describe(changes) if changes else 'no flag changed'}); {source_run} is left as it is"
        )
    return run_dir, ckpt


def _has_final_row(run_dir: str, iteration: int) -> bool:
    rows, _ = read_metrics_lines(os.path.join(run_dir, "metrics.jsonl"))
    return any(r.get("final") and r.get("iteration") == iteration for r in rows)


def _script_with_flags(folder: str, names: list[str]) -> str | None:
    """The training script in `folder` whose Args have every one of `names`, if exactly one does."""
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
    """--resume of a run that died before its first checkpoint: it starts again in its own folder
    from iteration 0 with its own flags and seeds, so the rows it rewrites are the ones it had."""
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
        _claim(run_dir, "--resume")  # refuses links: what is deleted below is the run's own
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
    """One line when this resume's --keep-checkpoints will delete checkpoints the run kept."""
    keep = args.keep_checkpoints
    kept = saved.get("keep_checkpoints", keep)
    have = [c for _, c in list_checkpoints(run_dir)]
    if keep and keep != kept and len(have) >= keep:
        print(
            f"note: --keep-checkpoints {keep} (the run kept {kept or 'all'}): "
            f"{', '.join(os.path.basename(c) for c in have[: len(have) - keep + 1])} will be "
            "deleted as new checkpoints complete"
        )
