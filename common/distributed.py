"""The collectives the training section calls: every rank must run as many micro-batches (each
forward and backward is a collective under DDP and FSDP), and a step's loss is the mean over all
ranks' kept rows. (The rollouts' gather of every rank's rewards is common/rewards.py's
all_gather_cat.)

With one process (`python script.py`) each is the identity; under torchrun they work on the
run's device (NCCL takes no CPU tensor; common/plumbing/utils.py makes the process group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def sum_over_ranks(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """The elementwise sum of `t` over the ranks (a copy; `t` is left as it was)."""
    t = t.clone()
    if world_size > 1:
        dist.all_reduce(t)
    return t


def max_over_ranks(n: int, world_size: int, device) -> int:
    """The largest of every rank's `n`."""
    if world_size == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
