"""The hand-over from rollout to training: its contract (`check_transitions`), what a rollout
hands over (`Rollout`) and the --grad-share-every diagnostic (`GradShare`). Tested in
tests/test_training.py; what is trained lives in common/policy.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# field -> dtype kind; every field is [N] but latents, next_latents and mean ([N, ...]). mean (the
# rollout step's Gaussian mean, optional) is what --ratio-norm needs.
_FLOATS = ("latents", "next_latents", "log_prob", "sigma", "sigma_next", "noise_level", "advantage")
REQUIRED = {**dict.fromkeys(_FLOATS, "float"), "prompt_index": "long", "step_index": "long"}
OPTIONAL = {**dict.fromkeys(("trajectory", "state_index", "update_block"), "long"), "mean": "float"}


class TransitionsError(ValueError):
    """A rollout broke the transitions contract (a bug in the rollout, e.g. of a new variant)."""


def require(condition, message: str) -> None:
    """The contract's checks raise, whatever `python -O` does to asserts."""
    if not condition:
        raise TransitionsError(message)


def check_transitions(tr: dict, sigmas: torch.Tensor, n_prompts: int) -> None:
    """Raise TransitionsError where the rollout broke what the training section relies on
    (docs/design.md); the scripts check a run's first iteration (the rollout's code is the same
    every iteration). One row per transition (an SDE step the policy took); besides the types:
    - sigma / sigma_next are the schedule's values at step_index / step_index + 1 (step order);
    - prompt_index points into this rank's prompt embeddings (0 <= i < n_prompts);
    - trajectory (one id per chain) keeps its prompt, and next_latents of its step j is latents of
      its step j + 1 (catches fields stacked in two orders);
    - rows of one state_index (G²RPO's branches from a shared state) share latents, sigmas,
      noise_level and prompt, so one forward serves them all.
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
            same = torch.equal(tr[k], tr[k][rep.to(tr[k].device)])
            require(same, f"rows of one state differ in '{k}'")


class GradShare:
    """Diagnostic (--grad-share-every): where the iteration's update comes from, step by step.

    The gradient (before clipping) is a sum over transitions, so it splits exactly by trained step:
    g = sum_j g_j. Step j's share is g_j . g / |g|^2: the shares sum to 1, a step pulling against the
    others has a negative share. `add` takes one extra backward per step of the micro-batch
    (autograd.grad leaves .grad, hence the update, alone). One process only: the gradients are this
    rank's.
    """

    def __init__(self, params: dict, num_slots: int):
        self.params, self.grads = list(params.values()), [None] * num_slots

    def add(self, row_loss: torch.Tensor, step_index: torch.Tensor) -> None:
        """Each step's part of this micro-batch's gradient, added up."""
        for j in step_index.unique().tolist():
            loss = row_loss[step_index == j].sum()
            # materialize_grads: a parameter this step does not reach gets zeros, not None
            grads = torch.autograd.grad(
                loss, self.params, retain_graph=True, materialize_grads=True
            )
            flat = torch.cat([g.flatten().double() for g in grads])
            self.grads[j] = flat if self.grads[j] is None else self.grads[j] + flat

    def shares(self) -> dict[int, float]:
        """{step: share} of the steps with a gradient (empty when nothing was trained or g = 0)."""
        steps = [j for j, g in enumerate(self.grads) if g is not None]
        if not steps:
            return {}
        total = sum(self.grads[j] for j in steps)
        norm2 = float(total @ total)
        return {j: float(self.grads[j] @ total) / norm2 for j in steps} if norm2 > 0 else {}

    def norms(self) -> dict[int, float]:
        """{step: |g_j|}."""
        return {j: float(g.norm()) for j, g in enumerate(self.grads) if g is not None}


@dataclass
class Rollout:
    """What a rollout hands the training section (and the metrics row): nothing else crosses."""

    transitions: dict  # the contract above, one row per SDE step the policy took
    emb: object  # this rank's prompts' text embeddings, indexed by transitions["prompt_index"]
    prompts: list  # this rank's prompts
    counts: dict  # trajectories, scored_images, nfe/rollout, nfe/completion (this rank's)
    metrics: dict  # the rollout's train/... metrics of the iteration
