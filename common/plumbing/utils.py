"""Plumbing that must behave identically in all the training scripts: distributed set-up (with a
collective timeout), seeding, atomic writes and the metrics file. None of it is algorithm."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import random
import re
import sys

import numpy as np
import torch
import torch.distributed as dist

from common.plumbing.checks import ConfigError, kind_of, parse_json

TIMEOUT_ENV = "FLOW_RL_DIST_TIMEOUT"
# PyTorch's gloo default and PyTorch Lightning's; a long rank-0 checkpoint save must fit
DEFAULT_TIMEOUT_S = 1800.0
BACKEND_ENV = "FLOW_RL_DIST_BACKEND"


def collective_timeout() -> datetime.timedelta:
    """How long a rank waits in a collective for the others: $FLOW_RL_DIST_TIMEOUT seconds."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(
            f"{TIMEOUT_ENV}={raw!r}: give the collective timeout in seconds, > 0 (default "
            f"{DEFAULT_TIMEOUT_S:g})"
        )
    return datetime.timedelta(seconds=seconds)


def _install_collective_failure_hook(rank: int, timeout: datetime.timedelta) -> None:
    """An uncaught collective failure becomes one line, then the process exits at once: tearing
    the process group down normally would wait on the lost peer again."""
    previous = sys.excepthook

    def hook(kind, e, tb):
        # a collective that failed because a peer died, hung or was stopped (gloo / NCCL / c10d)
        failed = isinstance(e, dist.DistError) or (
            isinstance(e, RuntimeError) and any(s in str(e) for s in ("gloo", "NCCL", "c10d"))
        )
        if not failed:
            return previous(kind, e, tb)
        # gloo: "[.../pair.cc:537] Read error [127.0.0.1]:20902: Connection reset by peer. This is
        # typically ...": keep its first sentence, without the source location
        last = (str(e).strip().splitlines() or [kind.__name__])[-1]
        first = re.sub(r"^\[[^\]]*\]\s*", "", last).split(". ")[0][:160]
        print(
            f"error: rank {rank}: a collective operation failed ({first}): another rank died, hung "
            f"or was stopped (collective timeout {timeout.total_seconds():g} s, set by "
            f"{TIMEOUT_ENV}); look at the other ranks' output, then continue from the run's last "
            "complete checkpoint with --resume RUN_FOLDER",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    sys.excepthook = hook


def process_group_backend(cuda: bool) -> str:
    """On GPUs NCCL for CUDA tensors and gloo for CPU ones: NCCL takes no CPU tensor, and CPU
    tensors do reach collectives (flags all ranks agree on, --fsdp-offload's shards). torch advises
    this pair for CPU offload. $FLOW_RL_DIST_BACKEND=gloo: gloo for both (where NCCL won't start)."""
    chosen = os.environ.get(BACKEND_ENV, "")
    if chosen not in ("", "gloo"):
        raise ConfigError(
            f"{BACKEND_ENV}={chosen!r}: the only choice is 'gloo' (unset: NCCL for CUDA tensors "
            "and gloo for CPU ones)"
        )
    return "cpu:gloo,cuda:nccl" if cuda and not chosen else "gloo"


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device), for `python script.py` and `torchrun ... script.py` alike
    (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous). A rank whose peer died or hangs
    exits with one line after $FLOW_RL_DIST_TIMEOUT seconds instead of waiting forever."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = collective_timeout()
    cuda = torch.cuda.is_available()
    backend = process_group_backend(cuda)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, device_id=device if cuda else None, timeout=timeout)
    _install_collective_failure_hook(dist.get_rank(), timeout)
    return dist.get_rank(), dist.get_world_size(), device


def set_tf32(device: torch.device, enabled: bool) -> None:
    """On CUDA, fp32 matmuls and convolutions in TF32 or in full fp32 (the CPU has no TF32)."""
    if device.type == "cuda":
        precision = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


def seed_everything(seed: int, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def atomic_file(path: str, write) -> None:
    """Write `path` so that a kill or a full disk at any instant leaves the old file or the new one,
    whole: `write(tmp)` fills a temporary file beside it (same extension, for savers that go by it),
    which is fsynced and renamed over the old one. A failure removes it and raises."""
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp{os.getpid()}{ext}"
    try:
        if os.path.lexists(tmp):  # an earlier process's leftover, or a link: removed, not followed
            os.remove(tmp)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and not e.filename:  # name the file a write's error does not
            raise OSError(e.errno, e.strerror, path) from e
        raise


def atomic_write(path: str, text: str) -> None:
    """A text file, written whole or not at all (`atomic_file`)."""
    atomic_file(path, lambda tmp: pathlib.Path(tmp).write_text(text))


def read_metrics_lines(path: str) -> tuple[list[dict], int]:
    """(the rows of a metrics.jsonl, how many lines could not be read: a line cut mid-append by a
    kill or a full disk). A line that is JSON but not a row, or a path that is not a file, was not
    written by a run: ConfigError naming the file, the line and what to do."""
    rows, bad = [], 0
    if not os.path.lexists(path):
        return rows, bad
    if os.path.islink(path) or not os.path.isfile(path):
        raise ConfigError(
            f"{path} is {'a symbolic link' if os.path.islink(path) else 'not a file'}: a run's "
            "metrics.jsonl is a file of one JSON row per line; move it out of the run folder"
        )
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = parse_json(line, object)
            except ValueError:
                bad += 1  # cut mid-write (or not JSON at all): not a row, dropped
                continue
            it = row.get("iteration") if isinstance(row, dict) else None
            if not isinstance(it, int) or isinstance(it, bool):
                raise ConfigError(
                    f"{path}: line {number} is {kind_of(row)} without an integer 'iteration', not "
                    "a metrics row (a JSON object with an integer 'iteration'); remove that line "
                    "(or restore the file), then run again"
                )
            rows.append(row)
    return rows, bad


def truncate_metrics(run_dir: str, iteration: int) -> None:
    """On resume, drop the metrics rows of iterations >= the checkpoint's (they will be produced
    again) and a cut line; the file is replaced atomically, so a kill never loses earlier rows."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    rows, bad = read_metrics_lines(path)
    if bad:
        print(
            f"{path}: dropped {bad} unreadable line(s), cut by a kill or a full disk mid-write",
            flush=True,
        )
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows if r["iteration"] < iteration))
