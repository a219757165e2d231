"""Plumbing shared by the three training scripts: distributed set-up, run logging, checkpoints (pictures: plots.py).

None of this is algorithm: a reader can follow flowgrpo_baseline.py / g2rpo.py / densegrpo.py without
opening this file. It lives here because it must behave identically in all three (CleanRL keeps the same
kind of code in cleanrl_utils).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------------------- distributed
def setup_distributed() -> tuple[int, int, torch.device]:
    """One code path for `python script.py` and `torchrun --nproc_per_node N script.py`.

    torchrun sets RANK/WORLD_SIZE/LOCAL_RANK and the rendezvous variables (also across nodes); we only pick
    the backend: NCCL between GPUs, gloo between CPU processes. Returns (rank, world_size, device).
    """
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def all_gather_cat(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """Concatenate a tensor from every rank along dim 0, rank-major (rank 0's rows first)."""
    if world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def all_reduce(t: torch.Tensor, world_size: int, op=None) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def seed_everything(seed: int, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


# ---------------------------------------------------------------------------------------- logging
class RunLogger:
    """metrics.jsonl (one JSON object per iteration) and, with --track, the same numbers to wandb. Rank 0 only."""

    def __init__(self, run_dir: str, enabled: bool, track: bool, config: dict, project: str, entity, name: str):
        self.enabled, self.wandb = enabled, None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(config, f, indent=1, default=str)
        if track:
            import wandb  # lazy: only runs that ask for wandb pay for it (WANDB_MODE=offline works)

            self.wandb = wandb.init(project=project, entity=entity, name=name, config=config, dir=run_dir)

    def log(self, metrics: dict, images: dict | None = None) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            import wandb

            # an image, or a list of (image, caption) pairs (wandb shows them as one captioned gallery)
            extra = {k: [wandb.Image(im, caption=c) for im, c in v] if isinstance(v, list) else wandb.Image(v)
                     for k, v in (images or {}).items()}
            self.wandb.log({**metrics, **extra}, step=metrics["iteration"])

    def history(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


def truncate_metrics(run_dir: str, iteration: int) -> None:
    """On resume, drop metric lines of iterations >= the checkpoint's (they will be produced again)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line)["iteration"] < iteration]
        with open(path, "w") as f:
            f.writelines(keep)


# ---------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(ckpt_dir: str, state: dict, save_weights) -> None:
    """Write everything into a temporary folder, then rename it into place: a crash mid-save never leaves a
    half-written checkpoint, and the previous one stays intact until the new one is complete."""
    tmp = ckpt_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_weights(tmp)
    torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    old = ckpt_dir.rstrip("/") + ".old"
    if os.path.exists(ckpt_dir):
        os.replace(ckpt_dir, old)
    os.replace(tmp, ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict:
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


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
