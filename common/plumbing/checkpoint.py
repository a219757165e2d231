"""Checkpoints that survive a crash at any point of a save: {run_dir}/checkpoint-{iteration}/ holds
the user's weights, trainer_state.pt (plus trainer_state.dcp/, one shard per rank, under FSDP) and
COMPLETE.json, written LAST (size and sha256 of every file, iteration, script, args). A save fills
.checkpoint-{iteration}.tmp, fsyncs, writes the marker, renames it into place, and only then deletes
checkpoints beyond the newest K: a SIGKILL at any instant leaves the previous complete set, or that
set plus the new one (tests/test_faults.py)."""

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
import torch.distributed as dist

from common.plumbing.checks import kind_of, read_json
from common.plumbing.parallel import is_sharded

MARKER = "COMPLETE.json"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "trainer_state.dcp"  # --parallel fsdp: the sharded part of the trainer state
PREFIX = "checkpoint-"
# no leading zeros: one iteration has one name (checkpoint-02 is refused by resume_source)
_CKPT_RE = re.compile(r"^checkpoint-(0|[1-9]\d*)$")
# what a killed save leaves: .checkpoint-N.tmp (new), .old (replaced), and .del (being deleted)
_HIDDEN_RE = re.compile(rf"^\.{PREFIX}(\d+)(\.tmp|\.old)?(\.del)?$")


def _first_line(e: BaseException, limit: int | None = 160, empty: str = "") -> str:
    return (str(e).strip().splitlines() or [empty])[0][:limit]


# RNG states as plain values (numpy's keys as a tensor): trainer_state.pt loads with
# torch.load(weights_only=True), and a pickled ndarray would need free unpickling.
def _plain_numpy_state(state) -> dict:
    kind, keys, pos, has_gauss, cached = state
    return dict(
        kind=str(kind),
        keys=torch.from_numpy(np.asarray(keys).astype(np.int64)),
        pos=int(pos),
        has_gauss=int(has_gauss),
        cached_gaussian=float(cached),
    )


def rng_state() -> dict:
    return dict(
        python=random.getstate(),
        numpy=_plain_numpy_state(np.random.get_state()),
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )


def set_rng_state(s: dict) -> None:
    n = s["numpy"]
    random.setstate(s["python"])
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ---------------------------------------------------------------------------------------- save
def checkpoint_dir(run_dir: str, iteration: int) -> str:
    return os.path.join(run_dir, f"{PREFIX}{iteration}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()  # read in blocks (hashlib.file_digest needs Python 3.11)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    """A file's (or a folder's entries') flush to disk: a rename is only as durable as its source."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listdir(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []


def list_checkpoints(run_dir: str, interrupted: bool = False) -> list[tuple[int, str]]:
    """(iteration, folder) of every checkpoint-N of a run, oldest first, complete or not;
    interrupted: also a marked .checkpoint-N.tmp/.old whose checkpoint-N is missing (a save killed
    between its last renames)."""
    names = _listdir(run_dir)
    found = {int(m.group(1)): os.path.join(run_dir, n) for n in names if (m := _CKPT_RE.match(n))}
    for i, n in _leftovers(run_dir) if interrupted else []:
        path = os.path.join(run_dir, n)
        if i not in found and not n.endswith(".del") and os.path.isfile(os.path.join(path, MARKER)):
            found[i] = path
    return sorted(found.items())


def _leftovers(run_dir: str) -> list[tuple[int, str]]:
    """(N, name) of what killed saves left in run_dir, for one N the new copy (.tmp) first."""
    found = [
        (int(m.group(1)), m.group(2) != ".tmp", n)
        for n in _listdir(run_dir)
        if (m := _HIDDEN_RE.match(n)) and (m.group(2) or m.group(3))
    ]
    return [(i, n) for i, _, n in sorted(found)]


def _complete(run_dir: str, quick: bool = False) -> list[tuple[int, str]]:
    return [(i, c) for i, c in list_checkpoints(run_dir) if verify_checkpoint(c, quick) is None]


def _remove(path: str) -> None:
    """Rename to a hidden .del name (atomic), then delete: a kill mid-delete leaves no half-deleted
    folder that still looks complete, and the next save's `_tidy` deletes what it left."""
    head, name = os.path.split(path)
    trash = path if name.endswith(".del") else os.path.join(head, f".{name.lstrip('.')}.del")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _tidy(run_dir: str) -> None:
    """A complete .checkpoint-N.tmp (or .old) whose checkpoint-N is missing is renamed into place;
    every other leftover of a killed save is deleted."""
    for i, name in _leftovers(run_dir):
        path, final = os.path.join(run_dir, name), checkpoint_dir(run_dir, i)
        orphan = not name.endswith(".del") and not os.path.exists(final)
        if orphan and verify_checkpoint(path, quick=True) is None:
            os.replace(path, final)
        else:
            _remove(path)


def trainer_state(params: dict, optimizer, ema, model=None, extras: dict | None = None) -> dict:
    """Weights, optimizer, EMA and `extras` (other EMA-like copies: DiffusionNFT's old policy) as a
    checkpoint stores them: CPU copies, or under FSDP this rank's shards in "sharded", the optimizer
    keyed by parameter name (get_state_dict)."""
    extras = extras or {}
    if not is_sharded(params):
        return {
            "params": {k: p.detach().cpu() for k, p in params.items()},
            "optimizer": optimizer.state_dict(),
            "ema": ema.state_dict() if ema is not None else None,
            "extras": {k: x.state_dict() for k, x in extras.items()},
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
            "extras": {k: dict(x.shadow) for k, x in extras.items()},
        },
        "ema": {"steps": ema.steps} if ema is not None else None,
        "extras": {k: {"steps": x.steps} for k, x in extras.items()},
    }


def _on_every_rank(fn, sharded: bool) -> None:
    """fn(); under FSDP every rank learns whether any rank's fn failed (then all raise the first
    OSError): a rank that stopped alone would leave the others waiting in the next collective."""
    err = None
    try:
        fn()
    except OSError as e:
        err = e
    except Exception as e:
        # torch.distributed.checkpoint wraps a rank's write error (CheckpointException)
        if not sharded or e.__class__.__name__ != "CheckpointException":
            raise
        err = OSError(errno.EIO, _first_line(e, None, e.__class__.__name__))
    if sharded:
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, None if err is None else (err.errno, err.strerror or str(err)))
        first = next((e for e in errs if e is not None), None)
        if err is None and first is not None:
            err = OSError(*first)
    if err is not None:
        raise err


def save_checkpoint(run_dir: str, state: dict, save_weights, keep: int = 2) -> str:
    """Write checkpoint-{state["iteration"]} completely or not at all, then keep the newest `keep`
    (0 = all). An OSError (a full disk) stops the run in one line, earlier checkpoints intact. With
    state["sharded"] every rank calls this; rank 0 alone checksums and renames."""
    state = dict(state)
    sharded = state.pop("sharded", None)
    digests = state.pop("prompt_digests", None) or {}
    if sharded is not None:
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
        for path in sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs):
            _fsync(path)
            rel = os.path.relpath(path, tmp)
            files[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
        marker = {
            "iteration": iteration,
            "script": state.get("script"),
            "saved_at": time.time(),
            "args": json.loads(json.dumps(state.get("args", {}), default=str)),
            # what each path flag pointed to (same_path_meaning, for a clone whose old paths are
            # gone), and the prompt files as this process read them (a pipe cannot be read again)
            "path_fingerprints": {**path_fingerprints(state.get("args", {})), **digests},
            "files": files,
        }
        with open(os.path.join(tmp, MARKER), "w") as f:  # LAST: every file above is complete
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        if os.path.exists(final):  # the same iteration saved again (resumed from an older one)
            old = os.path.join(run_dir, f".{PREFIX}{iteration}.old")
            os.replace(final, old)
            os.replace(tmp, final)  # a kill between these renames: the .tmp copy is used
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
        failed = _failure(e, full)
    if failed:
        gc.collect()  # raised outside the except: the error's frames (an open file) go with it
        done = _complete(run_dir)
        last = "no complete checkpoint exists yet"
        if done:
            last = f"the last complete checkpoint, {done[-1][1]}, is intact"
        raise SystemExit(
            f"error: could not write {final} ({failed}); {last}: free space or fix the folder's "
            f"permissions, then --resume {run_dir}"
        )
    if keep > 0 and main:  # rotation only after the new checkpoint is complete and in place
        oldest_kept = _complete(run_dir, quick=True)[-keep:][0][0]
        for i, c in list_checkpoints(run_dir):
            if i < oldest_kept:  # complete or not (an incomplete one is of no use)
                _remove(c)
    return final


@contextlib.contextmanager
def writing(run_dir: str):
    """Around a run's (atomic) writes: a failure (full disk, no permission) is one line."""
    try:
        yield
    except Exception as e:
        if not (isinstance(e, OSError) or _out_of_space(e, run_dir)):
            raise
        raise write_failed(e, run_dir) from None


def write_failed(e: BaseException, run_dir: str) -> SystemExit:
    """The one line a failed write stops the run with (`writing`'s)."""
    path = re.sub(r"\.tmp\d+(?=\.\w+$|$)", "", str(getattr(e, "filename", None) or run_dir))
    return SystemExit(
        f"error: could not write {path} ({_failure(e, _out_of_space(e, run_dir))}); "
        f"{continue_hint(run_dir)} once there is space (or the folder's permissions are fixed)"
    )


def _failure(e: BaseException, full: bool) -> str:
    why = getattr(e, "strerror", None) or _first_line(e)
    return f"{e.__class__.__name__}: {why}{'; the disk is full' if full else ''}"


def _out_of_space(e: BaseException, folder: str) -> bool:
    """A full disk, whatever raised it: ENOSPC/EDQUOT, safetensors' "os error 28", or torch.save's
    RuntimeError, which names no cause, so the free space decides."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(e) or "os error 28" in str(e):
        return True
    try:
        return shutil.disk_usage(folder).free < 2**16
    except OSError:
        return False


# ---------------------------------------------------------------------------------- verify and find
def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_marker(folder: str) -> dict:
    """A checkpoint's COMPLETE.json, checked field by field: ValueError saying what is wrong."""
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
        sized = isinstance(info, dict) and _is_count(info.get("size"))
        if not (sized and isinstance(info.get("sha256"), str)):
            raise ValueError(f"its entry for {rel!r} is {kind_of(info)}, not {{size, sha256}}")
    for field, kind in (("args", dict), ("path_fingerprints", dict), ("script", str)):
        if marker.get(field) is not None and not isinstance(marker[field], kind):
            raise wrong(field, kind_of(kind()))
    return marker


def verify_checkpoint(folder: str, quick: bool = False) -> str | None:
    """None when `folder` is a complete checkpoint, else what is wrong. quick: sizes only."""
    marker_path = os.path.join(folder, MARKER)
    if not os.path.isdir(folder):
        return f"{folder} does not exist"
    if not os.path.isfile(marker_path):
        return (
            f"{folder} has no {MARKER}: its save never finished (the process stopped while writing "
            "it, or it was written before checkpoints were checksummed)"
        )
    try:
        marker = read_marker(folder)
    except (OSError, ValueError) as e:
        return f"{marker_path} is unreadable ({e.__class__.__name__}: {e})"
    if STATE_FILE not in marker["files"]:
        return f"{marker_path} lists no {STATE_FILE}"
    named = re.match(rf"^\.?{PREFIX}(\d+)", os.path.basename(folder.rstrip("/")))
    if named and int(named.group(1)) != marker["iteration"]:
        return (
            f"{marker_path} is of iteration {marker['iteration']}, not the folder's "
            f"{int(named.group(1))}"
        )
    for rel, info in marker["files"].items():
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


def continue_hint(run_dir: str) -> str:
    """How to go on after a stop, naming only what exists: the last complete checkpoint, or none."""
    done = _complete(run_dir, quick=True)
    if done:
        return f"the last complete checkpoint is {done[-1][1]}: continue with --resume {run_dir}"
    return f"no checkpoint was saved yet: restart it in place with --resume {run_dir}"


# Flags that name a file or a folder: compared by what they point to, not by their spelling.
PATH_FLAGS = ("model_path", "prompts_file", "eval_prompts", "psi_file")


def path_fingerprint(path: str) -> str | None:
    """A file's sha256; for a folder, its (relative name, size) list and its .json files' content
    (a model's configs: hashing 10 GB of weights would be too slow); None if it does not exist."""
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
    """{path flag: fingerprint} of the path flags that name something that exists."""
    return {
        k: fp
        for k in PATH_FLAGS
        if isinstance(args.get(k), str) and (fp := path_fingerprint(args[k])) is not None
    }


def same_path_meaning(a, b, saved_fingerprint: str | None = None) -> bool:
    """Two values of a path flag name the same thing: equal, the same file once resolved, or the
    same content (a second clone); a gone `a` is known by the checkpoint's recorded fingerprint."""
    if a == b:
        return True
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    fa = path_fingerprint(a) or saved_fingerprint
    return fa is not None and fa == path_fingerprint(b)
