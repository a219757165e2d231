"""The evaluation protocol of every training script, in one place so that their numbers compare:
each prompt with `seeds_per_prompt` fixed seeds by the deterministic ODE; the reward's and the guard
rewards' means and, for toy-grammar prompts, GenEval-style accuracy per category, its mean and that
mean's standard error. Its grid shows the same fixed subset (`panel_jobs`) at every evaluation."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from common import toyworld
from common.backbones import sample_ode
from common.plumbing.plots import _to_cell, accuracy_line, captioned_grid
from common.plumbing.utils import atomic_file


@dataclass
class Panel:
    """The fixed subset of one evaluation that its grid shows: uint8 images [N, H, W, 3], their
    prompts, seeds, rewards, strict verdicts (None outside the toy grammar) and the metrics."""

    images: np.ndarray
    prompts: list[str]
    seeds: list[int]
    rewards: list[float]
    verdicts: list[bool] | None
    metrics: dict
    iteration: int | None = None

    def grid(self) -> "object":
        """PIL image: one row per category (toy world), prompt and reward under every image."""
        when = "" if self.iteration is None else f"iteration {self.iteration}: "
        header = when + accuracy_line(self.metrics)
        return captioned_grid(self.images, self.prompts, self.verdicts, self.rewards, 4, header)

    def captioned(self) -> list[tuple[object, str]]:
        """(PIL image, caption) per image, for wandb's captioned gallery."""
        out = []
        for k, p in enumerate(self.prompts):
            verdict = (
                "" if self.verdicts is None else (", correct" if self.verdicts[k] else ", wrong")
            )
            w = self.images[k].shape[1]  # toy images: 32 -> 128 px, pixels repeated
            im = _to_cell(self.images[k], w * max(1, 128 // w))
            caption = f"{p} (seed {self.seeds[k]}): reward {self.rewards[k]:.2f}{verdict}"
            out.append((im, caption))
        return out

    def save(self, path: str) -> None:
        """As .npz (16 toy images are 50 KB), so that a resumed run still has its first panel."""
        meta = json.dumps({k: v for k, v in vars(self).items() if k != "images"})
        atomic_file(path, lambda tmp: np.savez_compressed(tmp, images=self.images, meta=meta))

    @classmethod
    def load(cls, path: str) -> "Panel":
        from common.plumbing.checks import parse_json

        # allow_pickle=False: an object array (which only pickle restores) is refused, not loaded
        with np.load(path, allow_pickle=False) as z:
            return cls(images=z["images"], **parse_json(str(z["meta"])))


def panel_jobs(prompts: list[str], per_category: int = 4, other: int = 16) -> list[int]:
    """Indices of the prompts the grid shows (seed index 0): the first `per_category` of every toy
    category, in CATEGORIES order (a grid row each); outside the toy grammar the first `other`."""
    if not all(map(toyworld.in_grammar, prompts)):
        return list(range(min(other, len(prompts))))
    cats = [toyworld.category_of(p) for p in prompts]
    by_cat = {c: [i for i, x in enumerate(cats) if x == c] for c in toyworld.CATEGORIES}
    return [i for c in toyworld.CATEGORIES for i in by_cat[c][:per_category]]


def accuracy_se(per_category: dict[str, list[float]]) -> float:
    """Standard error of the category-mean accuracy A = (1/C) sum_c p_c: binomial se(p_c) per
    category, independent categories, so se(A) = sqrt(sum_c se(p_c)^2) / C. Images of one prompt are
    correlated, so it is the spread over seeds, a lower bound on the spread over prompt sets."""
    ses = [np.mean(v) * (1 - np.mean(v)) / len(v) for v in per_category.values()]
    return float(np.sqrt(np.sum(ses)) / len(ses))


@torch.no_grad()
def evaluate(
    backbone,
    reward_model,
    guard_model,
    prompts: list[str],
    num_steps: int,
    shift: float | None,
    guidance_scale: float,
    seeds_per_prompt: int,
    batch_size: int,
    resolution: int,
    rank: int = 0,
    world_size: int = 1,
    return_panel: bool = False,
    iteration: int | None = None,
):
    """-> (metrics, PIL grid of `panel_jobs`), and the `Panel` with return_panel=True. Under DDP
    every rank must call it (it gathers) and gets the same metrics, grid and panel."""
    jobs = [(p, 10_000 * s + i) for i, p in enumerate(prompts) for s in range(seeds_per_prompt)]
    shown = {i * seeds_per_prompt: k for k, i in enumerate(panel_jobs(prompts))}  # job -> slot
    mine = list(range(len(jobs)))[rank::world_size]
    toy = all(map(toyworld.in_grammar, prompts))  # then also report GenEval-style accuracy
    out, panel_part = [], []
    # Under FSDP every transformer call is a collective: every rank runs as many batches as the rank
    # with the most jobs, a rank short of jobs sampling a throwaway image in its last one.
    per_rank = -(-len(jobs) // world_size)  # ceil division
    for b in range(0, per_rank, batch_size):
        ids = mine[b : b + batch_size]
        ps, seeds = map(list, zip(*(jobs[j] for j in ids or [0])))
        imgs = sample_ode(
            backbone, ps, seeds, num_steps, resolution, resolution, guidance_scale, shift
        )
        if not ids:
            continue  # the throwaway image of a rank short of jobs
        row = {"reward": reward_model.mix(reward_model(imgs, ps)).tolist()}
        if toy:
            row["correct"] = toyworld.score(imgs, ps)[1].astype(float).tolist()
            row["category"] = [toyworld.category_of(p) for p in ps]
        if guard_model is not None:
            g = guard_model(imgs, ps)
            for k, name in enumerate(guard_model.names):
                row[f"guard/{name}"] = g[:, k].tolist()
        out.append(row)
        u8 = toyworld.to_uint8(imgs)
        for n, j in enumerate(ids):
            if j in shown:
                verdict = bool(row["correct"][n]) if toy else None
                panel_part.append((shown[j], u8[n], row["reward"][n], verdict))
    rows, parts = [out], [panel_part]
    if world_size > 1:
        rows, parts = [None] * world_size, [None] * world_size
        dist.all_gather_object(rows, out)
        dist.all_gather_object(parts, panel_part)
    keys = next(r for rr in rows for r in rr)  # a rank may have had no job
    merged = {k: sum((r[k] for rr in rows for r in rr), []) for k in keys}
    guards = {f"eval/{k}": float(np.mean(v)) for k, v in merged.items() if k.startswith("guard/")}
    metrics = {"eval/reward_mean": float(np.mean(merged["reward"])), **guards}
    if toy:
        per_cat = {}
        for c, ok in zip(merged["category"], merged["correct"]):
            per_cat.setdefault(c, []).append(ok)
        for c, v in per_cat.items():
            metrics[f"eval/accuracy_{c}"] = float(np.mean(v))
        metrics["eval/accuracy"] = float(np.mean([np.mean(v) for v in per_cat.values()]))
        metrics["eval/accuracy_se"] = accuracy_se(per_cat)
    shown_rows = sorted((p for pp in parts for p in pp), key=lambda t: t[0])
    order = sorted(shown, key=shown.get)
    panel = Panel(
        images=np.stack([t[1] for t in shown_rows]),
        prompts=[jobs[j][0] for j in order],
        seeds=[jobs[j][1] for j in order],
        rewards=[float(t[2]) for t in shown_rows],
        verdicts=[t[3] for t in shown_rows] if toy else None,
        metrics=dict(metrics),
        iteration=iteration,
    )
    grid = panel.grid()
    return (metrics, grid, panel) if return_panel else (metrics, grid)
