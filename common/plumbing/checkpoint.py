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
import errno
import gc
import hashlib
import json
import os
import random
import re
import shutil
import time

import numpy as np
import torch

from common.plumbing.checks import kind_of, read_json

MARKER = "COMPLETE.json"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "trainer_state.dcp"  # --parallel fsdp: the sharded part of the trainer state
PREFIX = "checkpoint-"
# checkpoint-{iteration} as save_checkpoint names it: no leading zeros, so that one iteration has
# one name (a checkpoint-02 beside checkpoint-2 is refused by resume_source, never guessed between)
_CKPT_RE = re.compile(r"^checkpoint-(0|[1-9]\d*)$")


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


def _listdir(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []


def continue_hint(run_dir: str) -> str:
    """How to go on after a stop, naming only what exists: the last complete checkpoint, or none."""
    done = [c for _, c in list_checkpoints(run_dir) if verify_checkpoint(c, quick=True) is None]
    if done:
        return f"the last complete checkpoint is {done[-1]}: continue with --resume {run_dir}"
    return f"no checkpoint was saved yet: restart it in place with --resume {run_dir}"


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
