"""The evaluation protocol of the three training scripts, in one place so that their numbers compare.

Every evaluation prompt is sampled with `seeds_per_prompt` fixed seeds (10_000 * s + prompt index) by the
deterministic ODE (`common.backbones.sample_ode`); the images are split over the ranks and the results gathered.
Reported: the reward's mean, each guard reward's mean and, when every prompt is in the toy grammar, the strict
GenEval-style accuracy per category and its mean over the categories (GenEval's overall score).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from common import toyworld
from common.backbones import sample_ode


@torch.no_grad()
def evaluate(backbone, reward_model, guard_model, prompts: list[str], num_steps: int, shift: float | None,
             guidance_scale: float, seeds_per_prompt: int, batch_size: int, resolution: int, rank: int = 0,
             world_size: int = 1) -> tuple[dict, object]:
    """-> (metrics, PIL grid of up to 64 of this rank's images). Under DDP every rank must call it (it gathers)."""
    jobs = [(p, 10_000 * s + i) for i, p in enumerate(prompts) for s in range(seeds_per_prompt)]
    mine = jobs[rank::world_size]
    toy = all(map(toyworld.in_grammar, prompts))  # then also report GenEval-style accuracy
    images, out = [], []
    for b in range(0, len(mine), batch_size):
        ps, seeds = map(list, zip(*mine[b:b + batch_size]))
        imgs = sample_ode(backbone, ps, seeds, num_steps, resolution, resolution, guidance_scale, shift)
        row = {"reward": reward_model.mix(reward_model(imgs, ps)).tolist()}
        if toy:
            row["correct"] = toyworld.score(imgs, ps)[1].astype(float).tolist()
            row["category"] = [toyworld.category_of(p) for p in ps]
        if guard_model is not None:
            g = guard_model(imgs, ps)
            for k, name in enumerate(guard_model.names):
                row[f"guard/{name}"] = g[:, k].tolist()
        out.append(row)
        if len(images) < 64:
            images.extend(imgs.cpu())
    rows = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(rows, out)
    else:
        rows = [out]
    merged = {k: sum((r[k] for rr in rows for r in rr), []) for k in out[0]}
    metrics = {"eval/reward_mean": float(np.mean(merged["reward"]))}
    for k in merged:
        if k.startswith("guard/"):
            metrics[f"eval/{k}"] = float(np.mean(merged[k]))
    if toy:
        per_cat = {}
        for c, ok in zip(merged["category"], merged["correct"]):
            per_cat.setdefault(c, []).append(ok)
        for c, v in per_cat.items():
            metrics[f"eval/accuracy_{c}"] = float(np.mean(v))
        metrics["eval/accuracy"] = float(np.mean([np.mean(v) for v in per_cat.values()]))  # mean of categories
    return metrics, toyworld.image_grid(torch.stack(images[:64]), nrow=8, scale=max(1, 128 // resolution))
