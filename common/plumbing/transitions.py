"""The hand-over from rollout to training, checked, and the training section's diagnostic.

- `check_transitions`: the contract of the transitions a GRPO rollout hands its training section
  (fields, shapes, dtypes, order; docs/design.md), checked on a run's first iteration.
- `GradShare`: the diagnostic that splits an iteration's gradient by trained step
  (--grad-share-every).
- `Rollout`: what a rollout hands the training section.
Tested in tests/test_training.py. What is trained (LoRA or full weights, the KL reference, the EMA)
lives in common/policy.py; the metrics and the optimizer step's checks in common/plumbing/run.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REQUIRED = {  # field -> (dtype kind, shape after the first dim is [N])
    "latents": "float",
    "next_latents": "float",
    "log_prob": "float",
    "sigma": "float",
    "sigma_next": "float",
    "noise_level": "float",
    "advantage": "float",
    "prompt_index": "long",
    "step_index": "long",
}
# optional fields; mean: the rollout step's Gaussian mean, [N, ...] like latents (--ratio-norm
# needs it)
OPTIONAL = {
    "trajectory": "long",
    "state_index": "long",
    "update_block": "long",
    "mean": "float",
}


# ------------------------------------------------------------------------------------- the contract
class TransitionsError(ValueError):
    """A rollout broke the transitions contract (a bug in the rollout, e.g. of a new variant)."""


def require(condition, message: str) -> None:
    """The contract's checks raise, whatever `python -O` does to asserts."""
    if not condition:
        raise TransitionsError(message)


def check_transitions(tr: dict, sigmas: torch.Tensor, n_prompts: int) -> None:
    """Check what the training section relies on, at the hand-over from rollout to training
    (docs/design.md): a broken contract raises TransitionsError. It is the rollout's code, the same
    every iteration, so the scripts check it on a run's first iteration (their finite check,
    common/plumbing/run.py::check_finite, runs on every one).

    Every field is [N, ...] with one row per transition (one SDE step the policy took). Besides the
    types:
    - sigma / sigma_next are the schedule's values at step_index / step_index + 1 (so the rows are
      in step order);
    - prompt_index points into this rank's prompt embeddings (0 <= i < n_prompts);
    - trajectory (optional; one id per sampled chain): a trajectory keeps its prompt, and where it
      has steps j and j + 1, next_latents of the first is latents of the second (catches rows of two
      fields stacked in two orders);
    - state_index (optional; transitions that start from one shared state, G²RPO's branches): rows
      of one state have the same latents, sigma, sigma_next, noise_level and prompt, so one forward
      serves them all.
    """
    missing = sorted(set(REQUIRED) - set(tr))
    unknown = sorted(set(tr) - set(REQUIRED) - set(OPTIONAL))
    require(not missing and not unknown, f"missing fields {missing}, unknown fields {unknown}")
    n = len(tr["advantage"])
    for k, kind in {**REQUIRED, **OPTIONAL}.items():
        if k not in tr:
            continue
        t = tr[k]
        require(len(t) == n, f"transitions['{k}'] has {len(t)} rows, expected {n}")
        dtype = torch.long if kind == "long" else torch.float32
        require(t.dtype == dtype, f"transitions['{k}'] has dtype {t.dtype}, expected {dtype}")
        if k not in ("latents", "next_latents", "mean"):
            require(t.ndim == 1, f"transitions['{k}'] must be [N], got {tuple(t.shape)}")
    shapes = tr["latents"].shape, tr["next_latents"].shape, tr.get("mean", tr["latents"]).shape
    require(len(set(shapes)) == 1, f"latents, next_latents and mean differ in shape: {shapes}")
    j, s = tr["step_index"].cpu(), sigmas.cpu()
    require(bool(((j >= 0) & (j < len(s) - 1)).all()), "step_index outside the schedule")
    require(
        torch.equal(tr["sigma"].cpu(), s[j]) and torch.equal(tr["sigma_next"].cpu(), s[j + 1]),
        "sigma / sigma_next are not the schedule's values at step_index (rows out of step order?)",
    )
    p = tr["prompt_index"].cpu()
    require(bool(((p >= 0) & (p < n_prompts)).all()), f"prompt_index outside 0..{n_prompts - 1}")
    if "trajectory" in tr:
        traj = tr["trajectory"].cpu()
        key = {(int(a), int(b)): i for i, (a, b) in enumerate(zip(traj, j))}
        for (a, b), i in key.items():
            nxt = key.get((a, b + 1))
            if nxt is not None:
                require(p[i] == p[nxt], f"trajectory {a} changes prompt between steps {b}, {b + 1}")
                require(
                    torch.equal(tr["next_latents"][i], tr["latents"][nxt]),
                    f"trajectory {a}: next_latents of step {b} is not latents of step {b + 1}",
                )
    if "state_index" in tr:
        st = tr["state_index"].cpu()
        first = torch.full((int(st.max()) + 1,), -1, dtype=torch.long)
        first[st.flip(0)] = torch.arange(n - 1, -1, -1)  # the first row of every state
        rep = first[st]
        for k in ("latents", "sigma", "sigma_next", "noise_level", "prompt_index"):
            require(
                torch.equal(tr[k], tr[k][rep.to(tr[k].device)]),
                f"rows of one state differ in '{k}'",
            )


# ------------------------------------------------------------------------------------- diagnostic
class GradShare:
    """Diagnostic (--grad-share-every): where the iteration's update comes from, step by step.

    The iteration's gradient (before clipping) is a sum over its transitions, so it splits exactly
    by trained step: g = sum_j g_j, g_j the gradient of the loss of step j's transitions alone. Step
    j's share is its projection on the whole, share_j = g_j . g / |g|^2: the shares sum to 1, a step
    pulling against the others has a negative share, and a step that carries the update has a share
    near 1. `add(row_loss, step_index)`, called with the micro-batch's per-transition loss before
    its backward, takes one extra backward per step present in the micro-batch (autograd.grad, which
    leaves .grad alone: the update is unchanged), so a measured iteration trains at a few times the
    cost (the scripts make one on the iterations measured only). One process only: the per-step
    gradients are this rank's.
    """

    def __init__(self, params: dict, num_slots: int):
        self.params, self.grads = list(params.values()), [None] * num_slots

    def add(self, row_loss: torch.Tensor, step_index: torch.Tensor) -> None:
        """Each step's part of this micro-batch's gradient, added up."""
        for j in step_index.unique().tolist():
            grads = torch.autograd.grad(
                row_loss[step_index == j].sum(), self.params, retain_graph=True, allow_unused=True
            )
            flat = torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).flatten().double()
                    for g, p in zip(grads, self.params)
                ]
            )
            self.grads[j] = flat if self.grads[j] is None else self.grads[j] + flat

    def shares(self) -> dict[int, float]:
        """{step: share} of the steps that had a gradient (empty when nothing was trained
        or g = 0)."""
        steps = [j for j, g in enumerate(self.grads) if g is not None]
        if not steps:
            return {}
        total = sum(self.grads[j] for j in steps)
        norm2 = float(total @ total)
        return {j: float(self.grads[j] @ total) / norm2 for j in steps} if norm2 > 0 else {}

    def norms(self) -> dict[int, float]:
        """{step: |g_j|}."""
        return {j: float(g.norm()) for j, g in enumerate(self.grads) if g is not None}


# --------------------------------------------------------------------------- the rollout's result
@dataclass
class Rollout:
    """What a rollout hands the training section (and the metrics row): nothing else crosses."""

    transitions: dict  # the contract above, one row per SDE step the policy took
    emb: object  # this rank's prompts' text embeddings, indexed by transitions["prompt_index"]
    prompts: list  # this rank's prompts
    counts: dict  # trajectories, scored_images, nfe/rollout, nfe/completion (this rank's)
    metrics: dict  # the rollout's train/... metrics of the iteration
