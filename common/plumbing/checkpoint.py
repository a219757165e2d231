"""Checkpoints that survive a crash at any point of a save, and a --resume that knows what it
resumes.

Layout (as diffusers' training scripts: rotated folders, the newest K kept):

    {run_dir}/checkpoint-{iteration}/
        pytorch_lora_weights.safetensors   the user's weights: `pipe.load_lora_weights(folder)` (or
                                           transformer/ with --full-finetune)
        trainer_state.pt                   params, optimizer, EMA, iteration, NFE, every rank's RNG,
                                           args
        trainer_state.dcp/                 --parallel fsdp: params, optimizer and EMA instead,
                                           sharded: one file per rank
                                           (torch.distributed.checkpoint); trainer_state.pt keeps
                                           the rest
        COMPLETE.json                      written LAST: size and sha256 of every file above, the
                                           iteration, the script and its arguments. No marker, or a
                                           file that does not match it, means the checkpoint is not
                                           complete.

A save writes everything into a hidden temporary folder `.checkpoint-{iteration}.tmp`, fsyncs the
files, writes the marker, then renames the folder into place (one atomic rename on POSIX); only then
are checkpoints beyond the newest K deleted. A SIGKILL at any instant therefore leaves either the
previous set of complete checkpoints, or that set plus the new one: tests/test_faults.py kills a
saving process at random points and checks exactly that. Under FSDP every rank writes its own shard
into the same temporary folder and rank 0 alone checksums and renames, so the same holds (the run
folder must then be on a file system that every node sees, as for any torch.distributed.checkpoint).

On --resume, `resolve_run_dir` (before any model is loaded) finds the checkpoint (a run folder: its
latest complete one; a checkpoint folder: that one), verifies it against its marker, and compares
the arguments that define the experiment with the ones it was written under. Anything not in
MAY_CHANGE_ON_RESUME is experiment-defining, so a flag added later is protected by default. A
difference stops the run in one line, unless --resume-override, which starts a NEW run folder from
the checkpoint's weights and records where it came from (args.json: `resumed_from`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import hashlib
import json
import math
import os
import random
import re
import shutil
import time

import numpy as np
import torch

from common.plumbing.checks import ConfigError, kind_of, pickled_global, read_json

MARKER = "COMPLETE.json"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "trainer_state.dcp"  # --parallel fsdp: the sharded part of the trainer state
PREFIX = "checkpoint-"
# checkpoint-{iteration} as save_checkpoint names it: no leading zeros, so that one iteration has one
# name (a checkpoint-02 beside checkpoint-2 is refused by resume_source, never guessed between)
_CKPT_RE = re.compile(r"^checkpoint-(0|[1-9]\d*)$")
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


# ---------------------------------------------------------------------------------------- RNG
# Every RNG state as plain values (tuples of ints, tensors, numbers), so that trainer_state.pt loads
# with torch.load(weights_only=True): numpy's state is an ndarray, which only pickle restores.
def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return dict(
        python=random.getstate(),
        numpy=dict(
            kind=str(kind),
            keys=torch.from_numpy(keys.astype(np.int64)),
            pos=int(pos),
            has_gauss=int(has_gauss),
            cached_gaussian=float(cached),
        ),
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )


def set_rng_state(s: dict) -> None:
    n = s["numpy"]
    random.setstate(s["python"])
    np.random.set_state(
        (
            n["kind"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ---------------------------------------------------------------------------------------- save
def checkpoint_dir(run_dir: str, iteration: int) -> str:
    return os.path.join(run_dir, f"{PREFIX}{iteration}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    """Flush a file (or a folder's entries) to the disk: a rename is only as durable as what it
    renames."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
    )


def list_checkpoints(run_dir: str, interrupted: bool = False) -> list[tuple[int, str]]:
    """(iteration, folder) of every checkpoint-N folder of a run, oldest first (complete or not).

    interrupted: also a hidden .checkpoint-N.tmp (or .old) folder that holds a marker while
    checkpoint-N is missing: a save killed between its last renames, whose files are complete (a
    resume can use it; a later save removes it).
    """
    if not os.path.isdir(run_dir):
        return []
    names = os.listdir(run_dir)
    found = {int(m.group(1)): os.path.join(run_dir, n) for n in names if (m := _CKPT_RE.match(n))}
    if interrupted:
        for suffix in (".tmp", ".old"):  # the new copy first
            for n in names:
                m = re.match(rf"^\.{PREFIX}(\d+){re.escape(suffix)}$", n)
                if (
                    m
                    and int(m.group(1)) not in found
                    and os.path.isfile(os.path.join(run_dir, n, MARKER))
                ):
                    found[int(m.group(1))] = os.path.join(run_dir, n)
    return sorted(found.items())


def _remove(path: str) -> None:
    """Rename to a .del name first (atomic), then delete: a kill mid-delete leaves a hidden .del
    folder, never a half-deleted checkpoint or temporary folder that still looks complete."""
    trash = path if path.endswith(".del") else path + ".del"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _tidy(run_dir: str) -> None:
    """Finish or remove what killed saves left: a complete .checkpoint-N.tmp (or .old) whose
    checkpoint-N is missing (killed before or between its renames) is renamed into place; every
    other hidden leftover is deleted."""
    if not os.path.isdir(run_dir):
        return
    left = [
        (int(m.group(1)), m.group(2) != ".tmp", n)
        for n in os.listdir(run_dir)
        if (m := re.match(rf"^\.{PREFIX}(\d+)(\.tmp|\.old)?(\.del)?$", n))
        and (m.group(2) or m.group(3))
    ]
    for i, _, name in sorted(left):  # for one N, the new copy (.tmp) before the old one
        path, final = os.path.join(run_dir, name), checkpoint_dir(run_dir, i)
        if (
            not name.endswith(".del")
            and not os.path.exists(final)
            and verify_checkpoint(path, quick=True) is None
        ):
            os.replace(path, final)
        else:
            _remove(path)


def trainer_state(params: dict, optimizer, ema, model=None, extras: dict | None = None) -> dict:
    """The trained weights, the optimizer and the EMA as a checkpoint stores them (the caller adds
    iteration, counts, RNG, args). DDP: whole CPU copies, which rank 0 writes into trainer_state.pt.
    FSDP (`params` are DTensors; `model` the sharded transformer): under "sharded", this rank's
    shards, named by parameter (get_state_dict, so that the optimizer state is keyed by name, not by
    position), which every rank writes into trainer_state.dcp/. `extras` ({name: an EMA-like
    object}): a script's own copies of the weights (DiffusionNFT's old policy), stored as the EMA."""
    from common.plumbing.parallel import is_sharded

    if not is_sharded(params):
        return {
            "params": {k: p.detach().cpu() for k, p in params.items()},
            "optimizer": optimizer.state_dict(),
            "ema": ema.state_dict() if ema is not None else None,
            "extras": {k: x.state_dict() for k, x in (extras or {}).items()},
        }
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(ignore_frozen_params=True)
    )
    return {
        "sharded": {
            "model": model_sd,
            "optimizer": optim_sd,
            "ema": dict(ema.shadow) if ema is not None else {},
            "extras": {k: dict(x.shadow) for k, x in (extras or {}).items()},
        },
        "ema": {"steps": ema.steps} if ema is not None else None,
        "extras": {k: {"steps": x.steps} for k, x in (extras or {}).items()},
    }


def _on_every_rank(fn, sharded: bool) -> None:
    """fn(), and under FSDP every rank learns whether any rank's fn failed (then all raise the first
    one's OSError): a rank that stopped alone would leave the others waiting in the save's next
    collective."""
    err = None
    try:
        fn()
    except OSError as e:
        err = e
    except Exception as e:
        # torch.distributed.checkpoint wraps a rank's write error (CheckpointException)
        if not sharded or e.__class__.__name__ != "CheckpointException":
            raise
        err = OSError(errno.EIO, str(e).splitlines()[0] if str(e) else e.__class__.__name__)
    if sharded:
        import torch.distributed as dist

        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, None if err is None else (err.errno, err.strerror or str(err)))
        first = next((e for e in errs if e is not None), None)
        if err is None and first is not None:
            err = OSError(*first)
    if err is not None:
        raise err


def save_checkpoint(run_dir: str, state: dict, save_weights, keep: int = 2) -> str:
    """Write checkpoint-{state["iteration"]} completely or not at all, then keep the newest `keep`
    (0 = all).

    save_weights(folder) writes the user's weights; state is the trainer state (it must hold
    "iteration" and "args"; "script" is recorded when present). Returns the checkpoint folder. A
    disk that fills up (or any OSError) stops the run with one line; the checkpoints written before
    stay complete. state["sharded"] (trainer_state under FSDP): every rank calls this; rank 0 makes
    the temporary folder, every rank writes its shards into it (torch.distributed.checkpoint) and
    takes part in save_weights (which gathers), then rank 0 checksums every rank's files, writes the
    marker and renames, as without sharding.
    """
    state = dict(state)
    sharded = state.pop("sharded", None)
    digests = state.pop("prompt_digests", None) or {}
    if sharded is not None:
        import torch.distributed as dist

        state["sharded_state"] = SHARDED_DIR
    main = sharded is None or dist.get_rank() == 0
    iteration = int(state["iteration"])
    final = checkpoint_dir(run_dir, iteration)
    tmp = os.path.join(run_dir, f".{PREFIX}{iteration}.tmp")

    def start():
        if main:
            _tidy(run_dir)
            os.makedirs(tmp)

    def write():
        save_weights(tmp)
        if sharded is not None:
            import torch.distributed.checkpoint as dcp

            dcp.save(sharded, checkpoint_id=os.path.join(tmp, SHARDED_DIR))
        if main:
            torch.save(state, os.path.join(tmp, STATE_FILE))

    def seal():
        if not main:
            return
        files = {}
        for rel in _files(tmp):
            path = os.path.join(tmp, rel)
            _fsync(path)
            files[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
        marker = {
            "iteration": iteration,
            "script": state.get("script"),
            "saved_at": time.time(),
            "args": json.loads(json.dumps(state.get("args", {}), default=str)),
            # what each path flag pointed to: a resume from a clone whose old paths are gone
            # compares against these (same_path_meaning)
            # (the prompt files as this process read them: a pipe cannot be read again)
            "path_fingerprints": {**path_fingerprints(state.get("args", {})), **digests},
            "files": files,
        }
        with open(os.path.join(tmp, MARKER), "w") as f:
            # LAST: its presence means every file above is complete
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        if os.path.exists(final):
            # the same iteration saved again (a resume from an older checkpoint)
            old = os.path.join(run_dir, f".{PREFIX}{iteration}.old")
            os.replace(final, old)
            # a kill between these two renames: a resume (or the next save) uses the .tmp copy
            os.replace(tmp, final)
            _remove(old)
        else:
            os.replace(tmp, final)
        _fsync(run_dir)

    failed = None
    try:
        for phase in (start, write, seal):
            _on_every_rank(phase, sharded is not None)
    except Exception as e:
        full = _out_of_space(e, run_dir)  # before the cleanup below frees the space again
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave half a checkpoint on a full disk
        if not (isinstance(e, OSError) or full):
            raise
        why = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [""])[0][:160]
        failed = f"{e.__class__.__name__}: {why}{'; the disk is full' if full else ''}"
    if failed:
        # raised outside the except: the error's frames (and a writer's open file) go with it
        gc.collect()
        done = [c for _, c in list_checkpoints(run_dir) if verify_checkpoint(c) is None]
        last = (
            f"the last complete checkpoint, {done[-1]}, is intact"
            if done
            else "no complete checkpoint exists yet"
        )
        raise SystemExit(
            f"error: could not write {final} ({failed}); {last}: free space or fix the folder's "
            f"permissions, then --resume {run_dir}"
        )
    if keep > 0 and main:  # rotation only after the new checkpoint is complete and in place
        found = list_checkpoints(run_dir)
        kept = [i for i, c in found if verify_checkpoint(c, quick=True) is None][-keep:]
        for i, c in found:
            if i < kept[0]:
                # older than the K kept ones, complete or not (an incomplete one is of no use)
                _remove(c)
    return final


@contextlib.contextmanager
def writing(run_dir: str):
    """Around a run's writes (metrics rows, pictures, args.json, side files): a write that fails
    (a full disk, no permission) stops the run in the one line a checkpoint's failure gives,
    naming what exists to go on from. Each write is atomic (common/plumbing/utils.py), so nothing
    partial is left behind."""
    try:
        yield
    except Exception as e:
        if not (isinstance(e, OSError) or _out_of_space(e, run_dir)):
            raise
        raise write_failed(e, run_dir) from None


def write_failed(e: BaseException, run_dir: str) -> SystemExit:
    """The one line a failed write stops the run with (`writing`'s)."""
    full = _out_of_space(e, run_dir)
    path = re.sub(r"\.tmp\d+(?=\.\w+$|$)", "", str(getattr(e, "filename", None) or run_dir))
    why = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [""])[0][:160]
    failed = f"{e.__class__.__name__}: {why}{'; the disk is full' if full else ''}"
    return SystemExit(
        f"error: could not write {path} ({failed}); {continue_hint(run_dir)} once there is "
        "space (or the folder's permissions are fixed)"
    )


def _out_of_space(e: BaseException, folder: str) -> bool:
    """A full disk, whatever raised it: OSError ENOSPC/EDQUOT, safetensors' SafetensorError ("os
    error 28"), or torch.save's RuntimeError ("unexpected pos ..."), which names no cause, so the
    free space decides."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(e) or "os error 28" in str(e):
        return True
    try:
        return shutil.disk_usage(folder).free < 2**16
    except OSError:
        return False


# ---------------------------------------------------------------------------------- verify and find
def read_marker(folder: str) -> dict:
    """A checkpoint's COMPLETE.json, checked field by field (it may come with a run folder from
    someone else): ValueError saying what is wrong, which verify_checkpoint reports as the
    checkpoint's problem (a resume of the run then falls back to the previous one)."""
    marker = read_json(os.path.join(folder, MARKER))

    def wrong(field, what):
        got = kind_of(marker.get(field)) if field in marker else "missing"
        return ValueError(f"its '{field}' is {got}, not {what}")

    if not _is_count(marker.get("iteration")):
        raise wrong("iteration", "an integer >= 0")
    if not isinstance(marker.get("files"), dict):
        raise wrong("files", "an object of file: {size, sha256}")
    for rel, info in marker["files"].items():
        # a relative path inside the folder: a marker names nothing outside its checkpoint
        if os.path.isabs(rel) or ".." in rel.split("/") or not rel.strip("/"):
            raise ValueError(f"it lists {rel!r}, not a file inside the checkpoint")
        if not (
            isinstance(info, dict)
            and _is_count(info.get("size"))
            and isinstance(info.get("sha256"), str)
        ):
            raise ValueError(f"its entry for {rel!r} is {kind_of(info)}, not {{size, sha256}}")
    for field, kind in (("args", dict), ("path_fingerprints", dict), ("script", str)):
        if marker.get(field) is not None and not isinstance(marker[field], kind):
            raise wrong(field, kind_of(kind()))
    return marker


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def verify_checkpoint(folder: str, quick: bool = False) -> str | None:
    """None when `folder` is a complete checkpoint, else what is wrong with it (naming the file).
    quick: sizes only."""
    if not os.path.isdir(folder):
        return f"{folder} does not exist"
    if not os.path.isfile(os.path.join(folder, MARKER)):
        return (
            f"{folder} has no {MARKER}: its save never finished (the process stopped while writing "
            "it, or it was written before checkpoints were checksummed)"
        )
    try:
        marker = read_marker(folder)
    except (OSError, ValueError) as e:
        return f"{os.path.join(folder, MARKER)} is unreadable ({e.__class__.__name__}: {e})"
    files = marker["files"]
    if STATE_FILE not in files:
        return f"{os.path.join(folder, MARKER)} lists no {STATE_FILE}"
    named = re.match(rf"^\.?{PREFIX}(\d+)", os.path.basename(folder.rstrip("/")))
    if named and int(named.group(1)) != marker["iteration"]:
        return (
            f"{os.path.join(folder, MARKER)} is of iteration {marker['iteration']}, not the "
            f"folder's {int(named.group(1))}"
        )
    for rel, info in files.items():
        path = os.path.join(folder, rel)
        if os.path.islink(path):
            return f"{path} is a symbolic link, not a file of the checkpoint"
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size < info["size"]:
            return f"{path} is truncated ({size} of {info['size']} bytes)"
        if size != info["size"]:
            return f"{path} has {size} bytes, {info['size']} were written"
        if not quick and _sha256(path) != info["sha256"]:
            return f"{path} is corrupt (its sha256 differs from the one recorded in {MARKER})"
    return None


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


def _listdir(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []


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


def continue_hint(run_dir: str) -> str:
    """How to go on after a stop, naming only what exists: the last complete checkpoint, or none."""
    done = [c for _, c in list_checkpoints(run_dir) if verify_checkpoint(c, quick=True) is None]
    if done:
        return f"the last complete checkpoint is {done[-1]}: continue with --resume {run_dir}"
    return f"no checkpoint was saved yet: restart it in place with --resume {run_dir}"


def _json(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))  # tuples -> lists, as the marker stores them


# Flags that name a file or a folder: compared by what they point to, not by how the path is
# spelled.
PATH_FLAGS = ("model_path", "prompts_file", "eval_prompts", "psi_file")


def path_fingerprint(path: str) -> str | None:
    """What a path flag means, for comparing two spellings: a file's sha256; a folder's list of
    (relative name, size) and the content of its .json files (a model folder's configs: reading
    every weight of a 10 GB model would be too slow); None if the path does not exist."""
    if os.path.isfile(path):
        return _sha256(path)
    if not os.path.isdir(path):
        return None
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(f"{os.path.relpath(full, path)}:{os.path.getsize(full)}".encode())
            if name.endswith(".json"):
                with open(full, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def path_fingerprints(args: dict) -> dict:
    """{path flag: fingerprint} of the path flags that name something that exists, as a checkpoint
    records them."""
    return {
        k: fp
        for k in PATH_FLAGS
        if isinstance(args.get(k), str) and (fp := path_fingerprint(args[k])) is not None
    }


def same_path_meaning(a, b, saved_fingerprint: str | None = None) -> bool:
    """Two values of a path flag name the same thing: equal, the same file once resolved, or the
    same content (the same run resumed from a second clone of the repository). When `a` no longer
    exists (the first clone was deleted or moved), its content is the fingerprint the checkpoint
    recorded, if any."""
    if a == b:
        return True
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    fa = path_fingerprint(a) or saved_fingerprint
    return fa is not None and fa == path_fingerprint(b)


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


# ---------------------------------------------------------------------------------------- load
def load_checkpoint(folder: str) -> dict:
    """trainer_state.pt, loaded without running anything: torch.load(weights_only=True) rebuilds only
    tensors and plain values (dicts, lists, tuples, strings, numbers), never an object whose
    unpickling could run code, so a run folder from someone else is safe to --resume (its layout
    is checked by restore_checkpoint, `trainer_state_problem`)."""
    import pickle

    path = os.path.join(folder, STATE_FILE)
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if pickled_global(e) is None:  # not a checkpoint at all: below
            raise ConfigError(_unreadable(path, e)) from None
        # weights_only refused a global: a checkpoint written before 2026-12-05 (numpy's RNG state
        # was pickled as an ndarray), or a file built to run code; both are refused unloaded
        raise ConfigError(
            f"--resume: {path} holds Python objects ({pickled_global(e)}) "
            "that only pickle restores, and unpickling a file can run code, so it was not loaded; "
            "a checkpoint this project wrote before 2026-12-05 is like that: if you trust where it "
            f"came from, convert it once with `python -m common.plumbing.checkpoint --convert-trusted "
            f"{folder}`, else start a new run"
        ) from None
    except Exception as e:  # noqa: BLE001 - any unreadable zip is the same fault for the user
        raise ConfigError(_unreadable(path, e)) from None
    return state


def _unreadable(path: str, e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return (
        f"--resume: {path} is unreadable ({e.__class__.__name__}: {first}); resume from an older "
        "checkpoint-N folder"
    )


def _refuse_layout(folder: str, state) -> None:
    problem = trainer_state_problem(state)
    if problem:
        raise ConfigError(
            f"--resume: {os.path.join(folder, STATE_FILE)} is not a trainer state this code wrote "
            f"({problem}); resume from an older checkpoint-N folder, or start a new run"
        )


def _refuse_disagreement(folder: str, state: dict) -> None:
    """The numbers a resume trusts agree with the checkpoint's COMPLETE.json and folder name: the
    iteration it starts from (a trainer_state.pt re-sealed with iteration 10**18 in checkpoint-2
    would end the run at once, "finished" without training), the script and flags it records, and
    every counter and clock a plain count (finite, >= 0). One line, before anything is restored."""
    marker = read_marker(folder)
    named = re.fullmatch(rf"\.?{PREFIX}(\d+)", os.path.basename(folder.rstrip("/")))
    says = {"its COMPLETE.json": marker["iteration"]}
    if named:
        says["its folder's name"] = int(named.group(1))
    wrong = [f"{where} says {n}" for where, n in says.items() if n != state["iteration"]]
    for field in ("script", "args"):
        ours = json.dumps(state.get(field), default=str, sort_keys=True)
        if (
            field in state
            and marker.get(field) is not None
            and ours != json.dumps(marker[field], sort_keys=True)
        ):
            wrong.append(f"its '{field}' differs from its COMPLETE.json's")
    numbers = [*state.get("counts", {}).items(), *state.get("clocks", {}).items()]
    wrong += [
        f"its '{k}' is {v if abs(v) < 1e30 else 'out of range'}"
        for k, v in numbers
        if isinstance(v, bool) or v < 0 or not (isinstance(v, int) or math.isfinite(v))
    ]
    if wrong:
        iteration = state["iteration"]
        shown = iteration if iteration < 2**63 else f"an integer of {iteration.bit_length()} bits"
        raise ConfigError(
            f"--resume {folder}: its {STATE_FILE} (iteration {shown}) does not agree with its "
            f"checkpoint: {'; '.join(wrong)}; it was changed after it was saved: resume from "
            "another checkpoint-N folder, or start a new run"
        )


def trainer_state_problem(state) -> str | None:
    """What is wrong with the layout of a loaded trainer state (None: nothing): the types the
    restore relies on, before it relies on them. Shapes are checked against the model by
    `_check_tensors` during the restore."""
    if not isinstance(state, dict):
        return f"{type(state).__name__}, not a dict"
    if not _is_count(state.get("iteration")):
        return "its 'iteration' is not an integer >= 0"
    counts = state.get("counts", {})
    if not isinstance(counts, dict) or not all(
        isinstance(v, (int, float)) for v in counts.values()
    ):
        return "its 'counts' are not a dict of numbers"
    clocks = state.get("clocks", {})
    if not isinstance(clocks, dict) or not all(
        isinstance(v, (int, float)) for v in clocks.values()
    ):
        return "its 'clocks' are not a dict of numbers"
    rngs = state.get("rng")
    if not isinstance(rngs, list) or not rngs or not all(_rng_ok(r) for r in rngs):
        return "its 'rng' is not a list of RNG states (python, numpy, torch)"
    if "sharded_state" not in state:
        if not _tensor_dict(state.get("params")):
            return "its 'params' are not a dict of tensors"
        optim = state.get("optimizer")
        if not (
            isinstance(optim, dict)
            and isinstance(optim.get("state"), dict)
            and isinstance(optim.get("param_groups"), list)
            and all(isinstance(v, dict) for v in optim["state"].values())
            and all(
                isinstance(g, dict)
                and isinstance(g.get("params"), list)
                and all(_is_count(i) for i in g["params"])
                for g in optim["param_groups"]
            )
        ):
            return "its 'optimizer' is not an optimizer state_dict (state, param_groups)"
    for name, ema in [("ema", state.get("ema")), *(state.get("extras") or {}).items()]:
        if ema is None and name == "ema":
            continue
        if not (isinstance(ema, dict) and _is_count(ema.get("steps"))):
            return f"its '{name}' is not an EMA state (shadow, steps)"
        if "sharded_state" not in state and not _tensor_dict(ema.get("shadow")):
            return f"its '{name}' shadow is not a dict of tensors"
    if not isinstance(state.get("extras", {}), dict):
        return "its 'extras' are not a dict"
    return None


def _tensor_dict(d) -> bool:
    return isinstance(d, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items()
    )


def _rng_ok(r) -> bool:
    """One rank's RNG state as rng_state writes it (random.setstate and numpy check the values)."""
    n = r.get("numpy") if isinstance(r, dict) else None
    py = r.get("python") if isinstance(r, dict) else None
    return (
        isinstance(py, tuple)
        and len(py) == 3
        and isinstance(py[1], tuple)
        and isinstance(n, dict)
        and isinstance(n.get("keys"), torch.Tensor)
        and n["keys"].shape == (624,)
        and isinstance(r.get("torch"), torch.Tensor)
        and r["torch"].dtype == torch.uint8
    )


def _check_tensors(folder: str, what: str, saved: dict, expected: dict) -> None:
    """Every tensor of `expected` (name -> the model's tensor) is in `saved` with its shape: a
    missing name or another shape is one line (copy_ would broadcast a (1,) tensor into a whole
    weight without a word)."""
    for n, p in expected.items():
        got = saved.get(n)
        if got is None or tuple(got.shape) != tuple(p.shape):
            shown = "missing" if got is None else f"of shape {tuple(got.shape)}"
            raise ConfigError(
                f"--resume {folder}: {what} {n} is {shown} in the checkpoint, the model has "
                f"{tuple(p.shape)}: resume with the model and LoRA flags it was trained with"
            )


def _check_optimizer(folder: str, saved: dict, optimizer) -> None:
    """The optimizer state fits the optimizer: as many groups and parameters, and every per-
    parameter tensor (Adam's moments) of its parameter's shape (load_state_dict checks only the
    counts, with a traceback; a wrong moment shape was a traceback at the first step)."""
    now = optimizer.param_groups
    sizes = [len(g["params"]) for g in now]
    got = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in saved["param_groups"]]
    if got != sizes:
        raise ConfigError(
            f"--resume {folder}: its optimizer state has parameter groups of {got} parameters, "
            f"this optimizer {sizes}: resume with the flags it was trained with"
        )
    params = [p for g in now for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    for index, p in zip(ids, params):
        for key, v in (saved["state"].get(index) or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise ConfigError(
                    f"--resume {folder}: its optimizer's {key} of parameter {index} has shape "
                    f"{tuple(v.shape)}, the parameter {tuple(p.shape)}: resume with the flags it "
                    "was trained with"
                )


def convert_trusted(folder: str) -> None:
    """Rewrite the trainer_state.pt of a checkpoint written before 2026-12-05 (numpy's RNG state
    pickled as an ndarray) into the plain form `load_checkpoint` reads, and re-seal its marker.
    It unpickles the file: run it only on a file you trust (`python -m common.plumbing.checkpoint
    --convert-trusted FOLDER`). FOLDER is a run's checkpoint-N; the conversion holds the run's
    lock (a run writing the folder: one line, nothing converted), writes only inside the run
    folder (a link in it is refused, as a run refuses it), and leaves a checkpoint that already
    loads with weights_only=True as it is."""
    from common.plumbing.utils import atomic_file

    folder = os.path.normpath(os.path.abspath(folder))
    run_dir, name = os.path.split(folder)
    if not re.fullmatch(rf"{PREFIX}\d+", name):
        raise SystemExit(
            f"error: {folder} is not a checkpoint-N folder: --convert-trusted takes a run's "
            "checkpoint folder, e.g. runs/r/checkpoint-20; nothing was converted"
        )
    if not os.path.lexists(folder):
        raise SystemExit(f"error: {folder} does not exist; nothing was converted")
    hold_run_folder(run_dir)  # one line if a run holds it, or if it holds a link
    try:
        problem = verify_checkpoint(folder)
        if problem:
            raise SystemExit(f"error: {problem}; nothing was converted")
        path = os.path.join(folder, STATE_FILE)
        try:
            torch.load(path, weights_only=True, map_location="cpu")
            print(f"{path} already loads with weights_only=True: left as it is")
            return
        except Exception:  # noqa: BLE001 - the user trusts it: converted below, or refused there
            pass
        state = torch.load(path, weights_only=False, map_location="cpu")  # the user trusts it
        for r in state.get("rng") or []:
            n = r.get("numpy")
            if isinstance(n, tuple):  # (kind, keys ndarray, pos, has_gauss, cached)
                r["numpy"] = dict(
                    kind=str(n[0]),
                    keys=torch.from_numpy(np.asarray(n[1]).astype(np.int64)),
                    pos=int(n[2]),
                    has_gauss=int(n[3]),
                    cached_gaussian=float(n[4]),
                )
        atomic_file(path, lambda tmp: torch.save(state, tmp))
        marker = read_marker(folder)
        marker["files"][STATE_FILE] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
        atomic_file(
            os.path.join(folder, MARKER),
            lambda tmp: open(tmp, "w").write(json.dumps(marker, indent=1)),  # noqa: SIM115
        )
        load_checkpoint(folder)  # what a resume will do: it must load now
        print(f"converted {path}: it loads with weights_only=True")
    finally:
        release_run_folder(run_dir)


def restore_checkpoint(
    folder: str,
    rank: int,
    params: dict,
    optimizer,
    ema,
    model=None,
    extras: dict | None = None,
    scaler=None,
) -> tuple[int, dict]:
    """Load a checkpoint (verified by resolve_run_dir) into params / optimizer / EMA
    (common.plumbing.transitions.EMA) / fp16's loss scaler / this rank's RNG, in place. Returns (iteration, the
    run's cumulative counts: images and NFE per phase, its clocks time/cpu_s and time/elapsed_s,
    and the loss scaler's skips_in_a_row). A parameter
    whose name or shape differs is one line, not a tensor-size traceback. FSDP (`params` are
    DTensors, `model` the sharded transformer): every rank reads its own shards from
    trainer_state.dcp/ (a collective)."""
    from common.plumbing.parallel import is_sharded

    state = load_checkpoint(folder)
    if not isinstance(state, dict):
        _refuse_layout(folder, state)
    saved_as, now = (
        ("fsdp" if "sharded_state" in state else "ddp"),
        ("fsdp" if is_sharded(params) else "ddp"),
    )
    if saved_as != now:
        raise ConfigError(
            f"--resume {folder} was saved with --parallel {saved_as} and this run has --parallel "
            f"{now}; their trainer states are laid out differently: resume it with --parallel "
            f"{saved_as}"
        )
    extras = extras or {}
    missing = sorted(set(extras) - set(state.get("extras") or {}))
    if missing:
        raise ConfigError(
            f"--resume {folder} holds no {', '.join(missing)} (a checkpoint of another script or "
            "an older one): resume it with the script that wrote it, or start a new run"
        )
    _refuse_layout(folder, state)  # (a checkpoint of another script is named as such above)
    _refuse_disagreement(folder, state)
    scaling = loss_scaling_state(folder, state)  # checked before anything is copied in
    if now == "fsdp":
        _restore_sharded(folder, state, params, optimizer, ema, model, extras)
    else:
        _restore_whole(folder, state, params, optimizer, ema, extras)
    if scaler is not None and scaler.is_enabled() and scaling.get("scaler"):
        scaler.load_state_dict(scaling["scaler"])
    rngs = state["rng"]
    try:  # fewer ranks saved: only with --resume-override
        set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise ConfigError(
            f"--resume {folder}: its RNG state is not one this code wrote ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else ''}); resume from an older checkpoint"
        ) from None
    # the clocks apart from the counts: a resume replays the iterations after the checkpoint, so
    # only the counts are reproduced exactly; checkpoints before 2026-12-03 have no clocks
    skips = {"skips_in_a_row": int(scaling.get("skips_in_a_row", 0))}
    return state["iteration"], {**state["counts"], **state.get("clocks", {}), **skips}


def loss_scaling_state(folder: str, state: dict) -> dict:
    """fp16's loss scaler state and its skips in a row, checked (plain numbers only): {} for a
    checkpoint from before 2026-12-05, when no run scaled its loss."""
    scaling = state.get("loss_scaling") or {}
    scaler = scaling.get("scaler", {}) if isinstance(scaling, dict) else None
    skips = scaling.get("skips_in_a_row", 0) if isinstance(scaling, dict) else None
    numbers = isinstance(scaler, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for v in scaler.values()
    )
    if not numbers or not isinstance(skips, int) or isinstance(skips, bool) or skips < 0:
        raise ConfigError(
            f"--resume {folder}: its loss_scaling state is not one this code wrote (expected "
            "plain numbers: the scaler's scale and growth tracker, the skips in a row); resume "
            "from an older checkpoint"
        )
    return scaling


def _restore_whole(
    folder: str, state: dict, params: dict, optimizer, ema, extras: dict | None = None
) -> None:
    """Every saved state is checked against the model before any of it is copied in, so a
    refused checkpoint leaves the model as it was."""
    saved = state["params"]
    _check_tensors(folder, "trained weight", saved, params)
    _check_optimizer(folder, state["optimizer"], optimizer)
    if ema is not None and state.get("ema") is not None:
        _check_tensors(folder, "EMA weight", state["ema"]["shadow"], ema.shadow)
    for k, x in (extras or {}).items():
        _check_tensors(folder, f"{k} weight", state["extras"][k]["shadow"], x.shadow)
    for n, p in params.items():
        p.data.copy_(saved[n])
    optimizer.load_state_dict(state["optimizer"])
    for k, x in (extras or {}).items():
        x.load_state_dict(state["extras"][k])
    if ema is not None:
        if state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        else:
            # the EMA starts now (--resume-override of a run without one): from the resumed weights
            for n in ema.shadow:
                ema.shadow[n].copy_(saved[n])


def _restore_sharded(
    folder: str, state: dict, params: dict, optimizer, ema, model, extras: dict
) -> None:
    """dcp.load fills the given shards in place (loading each rank's part of every saved tensor),
    and set_state_dict hands the optimizer state back by parameter name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    had_ema = ema is not None and state.get("ema") is not None
    box = {
        "model": model_sd,
        "optimizer": optim_sd,
        "ema": dict(ema.shadow) if had_ema else {},
        "extras": {k: dict(x.shadow) for k, x in extras.items()},
    }
    check_sharded_metadata(os.path.join(folder, SHARDED_DIR))
    try:
        dcp.load(box, checkpoint_id=os.path.join(folder, SHARDED_DIR))
    except Exception as e:  # noqa: BLE001 - a missing key or shape is the same fault for the user
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0][:200]
        raise ConfigError(
            f"--resume {folder}: its sharded trainer state does not fit this model ({first}): "
            "resume with the model and LoRA flags it was trained with"
        ) from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=box["model"],
        optim_state_dict=box["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    for k, x in extras.items():  # dcp.load filled their shadows in place
        x.steps = state["extras"][k]["steps"]
    if ema is not None:
        if had_ema:
            ema.steps = state["ema"]["steps"]
        else:
            # the EMA starts now (--resume-override of a run without one): from the resumed weights
            for n, p in params.items():
                ema.shadow[n].copy_(p.detach())


# torch.distributed.checkpoint reads its .metadata with plain pickle.load, which would run whatever a
# received file asks for: it is first read here by an unpickler that builds only what a metadata
# file holds (the classes of torch.distributed.checkpoint's metadata, torch.Size, dtypes, paths).
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout")}
_DCP_GLOBALS |= {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath")}


def check_sharded_metadata(dcp_dir: str) -> None:
    """Every *.metadata file of a trainer_state.dcp/ folder unpickles with the allow-list above;
    anything else is refused in one line before torch.distributed.checkpoint opens it."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            obj = None
            if module in _DCP_MODULES or (module, name) in _DCP_GLOBALS or module == "torch":
                obj = super().find_class(module, name)
            allowed = (
                (module in _DCP_MODULES and isinstance(obj, type))
                or (module, name) in _DCP_GLOBALS
                or (module == "torch" and isinstance(obj, torch.dtype))
            )
            if not allowed:
                raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
            return obj

    for name in sorted(_listdir(dcp_dir)):
        if not name.endswith(".metadata"):
            continue
        path = os.path.join(dcp_dir, name)
        try:
            with open(path, "rb") as f:
                Restricted(f).load()
        except Exception as e:  # noqa: BLE001 - whatever it is, it is not loaded
            raise ConfigError(
                f"--resume: {path} is not a torch.distributed.checkpoint metadata file "
                f"({e.__class__.__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); it "
                "was not loaded (unpickling it could run code): resume from an older checkpoint"
            ) from None


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=convert_trusted.__doc__)
    ap.add_argument("--convert-trusted", metavar="CHECKPOINT_FOLDER", required=True)
    convert_trusted(ap.parse_args().convert_trusted)
