"""Plumbing shared by the three training scripts: distributed set-up (with a collective timeout),
run logging (pictures: common/plumbing/plots.py, checkpoints: common/plumbing/checkpoint.py).

None of this is algorithm: a reader can follow flowgrpo_baseline.py / g2rpo.py / densegrpo.py
without opening this file. It lives here because it must behave identically in all three (CleanRL
keeps the same kind of code in cleanrl_utils).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

# -------------------------------------------------------------------------------------- distributed
TIMEOUT_ENV = "FLOW_RL_DIST_TIMEOUT"
# PyTorch's gloo default and PyTorch Lightning's; a long rank-0 checkpoint save must fit
DEFAULT_TIMEOUT_S = 1800.0


def collective_timeout() -> datetime.timedelta:
    """How long a rank waits in a collective for the others before it gives up:
    $FLOW_RL_DIST_TIMEOUT seconds."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
        if not seconds > 0:
            raise ValueError(raw)
    except ValueError:
        from common.plumbing.checks import ConfigError

        raise ConfigError(
            f"{TIMEOUT_ENV}={raw!r}: give the collective timeout in seconds, > 0 (default "
            f"{DEFAULT_TIMEOUT_S:g})"
        ) from None
    return datetime.timedelta(seconds=seconds)


def is_collective_failure(e: BaseException) -> bool:
    """A collective that failed because a peer died, hung or was stopped
    (gloo / NCCL / c10d errors)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in ("gloo", "NCCL", "c10d"))


def _install_collective_failure_hook(rank: int, timeout: datetime.timedelta) -> None:
    """Turn an uncaught collective failure into one line (instead of a C++-flavoured traceback),
    then exit at once: tearing the process group down normally would wait on the lost peer again."""
    previous = sys.excepthook

    def hook(kind, e, tb):
        if not is_collective_failure(e):
            return previous(kind, e, tb)
        # gloo: "[.../pair.cc:537] Read error [127.0.0.1]:20902: Connection reset by peer. This is
        # typically ...": keep its first sentence, without the source location
        first = re.sub(
            r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [kind.__name__])[-1]
        ).split(". ")[0][:160]
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


BACKEND_ENV = "FLOW_RL_DIST_BACKEND"


def process_group_backend(cuda: bool) -> str:
    """The process group's backends, by device type. On GPUs NCCL moves the CUDA tensors, and gloo
    the CPU ones: NCCL takes no CPU tensor ("No backend type associated with device type cpu"), and
    CPU tensors do reach collectives (a flag that all ranks must agree on; --fsdp-offload's shards,
    whose gradient norm and fp16 overflow check reduce in host memory). torch's own advice for CPU
    offload is this pair. $FLOW_RL_DIST_BACKEND=gloo runs gloo on GPUs too, for a machine where
    NCCL will not start (slower; the tests run DDP and FSDP2 on gloo with CPU tensors only)."""
    chosen = os.environ.get(BACKEND_ENV, "")
    if chosen not in ("", "gloo"):
        from common.plumbing.checks import ConfigError

        raise ConfigError(
            f"{BACKEND_ENV}={chosen!r}: the only choice is 'gloo' (unset: NCCL for CUDA tensors "
            "and gloo for CPU ones)"
        )
    return "cpu:gloo,cuda:nccl" if cuda and not chosen else "gloo"


def setup_distributed() -> tuple[int, int, torch.device]:
    """One code path for `python script.py` and `torchrun --nproc_per_node N script.py`.

    torchrun sets RANK/WORLD_SIZE/LOCAL_RANK and the rendezvous variables (also across nodes); we
    only pick the backend: NCCL between GPUs, gloo between CPU processes. Returns
    (rank, world_size, device). Every collective gives up after $FLOW_RL_DIST_TIMEOUT seconds
    (default 1800): a rank whose peer died or hangs exits with one line instead of waiting forever
    (under torchrun the agent also stops the survivors of a dead rank).
    """
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = collective_timeout()
    backend = process_group_backend(torch.cuda.is_available())
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group(backend, device_id=device, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
        device = torch.device("cpu")
    _install_collective_failure_hook(dist.get_rank(), timeout)
    return dist.get_rank(), dist.get_world_size(), device


def set_tf32(device: torch.device, enabled: bool) -> None:
    """On CUDA, fp32 matmuls (the LoRA branches, an fp32 reward model or VAE) and convolutions in
    TF32 (10-bit mantissa, fp32 range) or in full fp32. The CPU has no TF32: nothing changes there."""
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
    """Write the file at `path` so that a kill or a full disk at any instant leaves either the old
    file or the new one, whole: `write(tmp)` fills a temporary file beside it (same extension, so
    savers that read it see the right format), which is flushed to the disk and renamed over the
    old one (one atomic rename on POSIX). A failure removes the temporary file and raises."""
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

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    atomic_file(path, write)


def read_metrics_lines(path: str) -> tuple[list[dict], int]:
    """(the rows of a metrics.jsonl, how many lines could not be read): a kill or a full disk in the
    middle of an append leaves a cut last line, which is not a row. A line that is JSON but not a
    row (an object with an integer "iteration"), or a metrics.jsonl that is not a file, was not
    written by a run: ConfigError naming the file, the line and what to do."""
    from common.plumbing.checks import ConfigError, kind_of, parse_json

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
                what = f"{kind_of(row)} without an integer 'iteration'"
                raise ConfigError(
                    f"{path}: line {number} is {what}, not a metrics row (a JSON object with an "
                    "integer 'iteration'); remove that line (or restore the file), then run again"
                )
            rows.append(row)
    return rows, bad


def truncate_metrics(run_dir: str, iteration: int) -> None:
    """On resume, drop metric lines of iterations >= the checkpoint's (they will be produced again),
    and a line cut by a kill or a full disk; the file is replaced atomically, so a kill during this
    never loses the earlier rows."""
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


class Timer:
    """`with timer("rollout"):` accumulates seconds per phase into timer.times."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.times[name] = timer.times.get(name, 0.0) + time.perf_counter() - self.t

        return _Ctx()
