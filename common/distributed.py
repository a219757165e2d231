"""The collectives an algorithm calls: the group advantages need every rank's rewards, and every
rank must run as many micro-batches (each forward and backward is a collective under DDP and FSDP).

With one process (`python script.py`) each is the identity; under torchrun they work on the
run's device (NCCL takes no CPU tensor; common/plumbing/utils.py makes the process group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_cat(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """Concatenate a tensor from every rank along dim 0, rank-major (rank 0's rows first)."""
    if world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


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
