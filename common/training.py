"""Bookkeeping of the training sections: the transitions contract, the micro-batch plan, metrics,
and the checks around the optimizer step.

Every script keeps the algorithm of its training section inline (velocity with gradient, log-prob
of the stored action, ratio, clipped loss, KL, their mean, backward, clip, optimizer step). What is
here is the plumbing around it, which must behave the same in every script and is tested on its own
(tests/test_training.py):

- `check_transitions`: the hand-over from rollout to training, checked (fields,
  shapes, dtypes, order).
- `plan_updates`: which transitions go into which micro-batch and optimizer step, with equal shapes
  on every rank.
- `Stats`: named weighted means (overall and per trained step), reduced over the ranks in one
  all-reduce.
- `GradShare`: the diagnostic that splits an iteration's gradient by trained step
  (--grad-share-every).
- `TrainStats`: the section's metrics and diagnostic in two calls (`add`, `step`).
- `check_finite_update`, `check_finite_rewards`: a non-finite gradient or reward stops the run in
  one line that names what exists to go on from (`stop_nonfinite`).
- `Rollout`: what a rollout hands the training section.
What is trained (LoRA or full weights, the KL reference, the EMA) lives in common/policy.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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


def check_transitions(
    tr: dict,
    sigmas: torch.Tensor,
    n_prompts: int,
    device=None,
    run_dir: str = "",
) -> dict:
    """Check what the training section relies on, at the hand-over from rollout to training
    (docs/design.md): a broken contract raises TransitionsError, non-finite values stop the run in
    one line (NonFiniteUpdate).

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
    Returns the dict, moved to `device` when one is given. `run_dir` is for the message.
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
        if kind == "float" and not torch.isfinite(t).all():  # a NaN rollout: one line
            raise stop_nonfinite(f"rollout ('{k}')", None, run_dir)
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
    return tr if device is None else {k: v.to(device) for k, v in tr.items()}


# ----------------------------------------------------------------------------- the micro-batch plan
@dataclass
class MicroBatch:
    # row of one representative transition per state (the training forward runs on these)
    states: torch.Tensor
    rows: torch.Tensor  # every transition of those states
    # position in `states` of each row's state: v[expand] gives every row its state's v
    expand: torch.Tensor
    weight: torch.Tensor  # 1 for kept transitions, 0 for dropped ones and for padding
    # last micro-batch of its optimizer step: its backward all-reduces the gradients, then the step
    sync: bool
    # kept transitions of its optimizer step over all ranks / world_size (see plan_updates)
    divisor: float = 1.0


def plan_updates(
    keep: torch.Tensor,
    states_per_batch: int,
    optimizer_steps: int,
    world_size: int = 1,
    state_index: torch.Tensor | None = None,
    update_block: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    epochs: int = 1,
) -> list[MicroBatch]:
    """Split `epochs` passes over the transitions into micro-batches, in order, grouped into
    optimizer steps: the last micro-batch of each step has `sync` (each pass shuffled anew).

    keep [N] bool: transitions that carry loss (advantage != 0 with --drop-zero-advantage). States
    (state_index; by default every transition is its own state) with at least one kept transition
    are shuffled and cut into `optimizer_steps` equal parts, each into micro-batches of
    `states_per_batch` states. Every backward under DDP is a collective, so every rank must run the
    same number of micro-batches: a rank with fewer kept states pads with weight-0 copies of a
    state, which cost compute and no gradient. The loss of a micro-batch is
    sum(weight * loss) / mb.divisor with divisor = (kept transitions of its optimizer step on all
    ranks) / world_size: DDP averages the ranks' gradients, so each step's gradient is the mean over
    all its kept transitions. update_block [N] (optional): blocks in increasing order, each with its
    own `optimizer_steps` steps (G²RPO's one update per branch step). A step with no kept transition
    on any rank is left out (its divisor would be 0). Collectives: one all_gather of the kept-state
    counts and one all_reduce of the per-step counts per block.
    """
    return [
        step
        for _ in range(epochs)
        for step in _plan_pass(
            keep,
            states_per_batch,
            optimizer_steps,
            world_size,
            state_index,
            update_block,
            generator,
        )
    ]


def _plan_pass(
    keep, states_per_batch, optimizer_steps, world_size, state_index, update_block, generator
):
    """One pass of plan_updates."""
    n = len(keep)
    device = keep.device
    state = torch.arange(n, device=device) if state_index is None else state_index.to(device)
    block = (
        torch.zeros(n, dtype=torch.long, device=device)
        if update_block is None
        else update_block.to(device)
    )
    n_blocks = int(block.max()) + 1 if n else 0
    if world_size > 1:  # blocks agree across ranks (a rank may lack the last one)
        nb = torch.tensor([n_blocks], device=device)
        dist.all_reduce(nb, op=dist.ReduceOp.MAX)
        n_blocks = int(nb)
    plan = []
    for b in range(n_blocks):
        in_block = block == b
        st = torch.unique(state[in_block])
        kept_per_state = torch.zeros(int(state.max()) + 1 if n else 0, device=device).index_add_(
            0, state, (keep & in_block).float()
        )
        kept_states = st[kept_per_state[st] > 0]
        kept_states = kept_states[torch.randperm(len(kept_states), generator=generator).to(device)]
        counts = _gather_counts(len(kept_states), world_size, device)
        # states every rank runs this block, padded up to the largest rank's count
        n_rows = max(counts)
        if n_rows == 0:
            continue
        pad_state = st[0] if len(st) else state[0]
        order = torch.cat([kept_states, pad_state.repeat(n_rows - len(kept_states))])
        real = torch.arange(n_rows, device=device) < len(kept_states)
        parts = [
            p
            for p in torch.arange(n_rows, device=device).tensor_split(min(optimizer_steps, n_rows))
        ]
        steps, local_kept = [], []
        for part in parts:
            mbs, kept_here = [], 0.0
            chunks = part.split(states_per_batch)
            for c, chunk in enumerate(chunks):
                states = order[chunk]
                rows_of = [(state == s_) & in_block for s_ in states]
                rows = torch.cat([r.nonzero().squeeze(1) for r in rows_of])
                expand = torch.cat(
                    [torch.full((int(r.sum()),), i, device=device) for i, r in enumerate(rows_of)]
                )
                weight = (keep[rows] & real[chunk][expand]).float()
                kept_here += float(weight.sum())
                first = torch.stack([r.nonzero()[0, 0] for r in rows_of])
                mbs.append(MicroBatch(first, rows, expand, weight, c == len(chunks) - 1))
            steps.append(mbs)
            local_kept.append(kept_here)
        total = torch.tensor(local_kept, device=device, dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(total)
        for mbs, t in zip(steps, total.tolist()):
            if t > 0:
                plan += [dataclasses.replace(mb, divisor=float(t) / world_size) for mb in mbs]
    return plan


def _gather_counts(k: int, world_size: int, device) -> list[int]:
    if world_size == 1:
        return [k]
    out = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([k], device=device))
    return [int(t) for t in out]


# ------------------------------------------------------------------------------------------ metrics
@dataclass
class Stats:
    """Weighted means by name, overall and per trained step, reduced over the ranks once per
    iteration.

    add(weight, by=step_index, name=values, ...) accumulates sum(weight * values) per step slot;
    extremes (ratio min / max) are kept apart; `keep_first` keeps the first value given for a name
    (this rank's, not reduced). Every rank must add the same names (they are reduced by name, in
    sorted order).
    """

    num_slots: int
    sums: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    maxima: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)

    def keep_first(self, **values: torch.Tensor) -> None:
        """E.g. the ratio's deviation from 1 in the first micro-batch, before any update: it must
        be 0 on-policy."""
        for name, v in values.items():
            if name not in self.first:
                self.first[name] = float(v)

    def add(self, weight: torch.Tensor, by: torch.Tensor, **values: torch.Tensor) -> None:
        w = weight.detach().double()
        slot = by.long()
        for name, v in values.items():
            s = self.sums.setdefault(
                name, torch.zeros(self.num_slots, dtype=torch.float64, device=w.device)
            )
            s.index_add_(0, slot, w * v.detach().double())
            c = self.weights.setdefault(
                name, torch.zeros(self.num_slots, dtype=torch.float64, device=w.device)
            )
            c.index_add_(0, slot, w)

    def add_extremes(self, weight: torch.Tensor, **values: torch.Tensor) -> None:
        for name, v in values.items():
            v = v.detach().double()[weight > 0]
            cur = self.maxima.get(
                name, torch.full((2,), -math.inf, dtype=torch.float64, device=weight.device)
            )
            if len(v):
                cur = torch.maximum(cur, torch.stack([v.max(), -v.min()]))
            self.maxima[name] = cur

    def count(self, **values: float) -> None:
        """Plain totals (e.g. NFE of the training phase), summed over the ranks."""
        for name, v in values.items():
            self.totals[name] = self.totals.get(name, 0.0) + float(v)

    def reduce(self, world_size: int, device) -> dict:
        """Means overall and per step, totals, and extremes, summed (maxed) over the ranks."""
        summed = _all_reduce_by_name(
            {(k, "sum"): v for k, v in self.sums.items()}
            | {(k, "weight"): v for k, v in self.weights.items()}
            | {
                (k, "total"): torch.tensor([v], dtype=torch.float64) for k, v in self.totals.items()
            },
            world_size,
            device,
        )
        maxed = _all_reduce_by_name(self.maxima, world_size, device, dist.ReduceOp.MAX)
        out = {}
        for k in sorted(self.sums):
            s, w = summed[k, "sum"], summed[k, "weight"]
            out[k] = (s.sum() / w.sum()).item() if w.sum() > 0 else 0.0
            out[f"{k}/per_step"] = {j: (s[j] / w[j]).item() for j in range(len(w)) if w[j] > 0}
            out[f"{k}/weight"] = w.sum().item()
        for k in sorted(self.totals):
            out[k] = summed[k, "total"].item()
        for k in sorted(self.maxima):
            out[f"{k}/max"], out[f"{k}/min"] = maxed[k][0].item(), -maxed[k][1].item()
        return out


def _all_reduce_by_name(tensors: dict, world_size: int, device, op=None) -> dict:
    """All-reduce a dict of float64 tensors in one collective: laid out in sorted-key order (the
    same on every rank, since every rank has the same keys) and split back by key."""
    keys = sorted(tensors)
    if not keys:
        return {}
    flat = torch.cat([tensors[k].reshape(-1) for k in keys]).to(device)
    if world_size > 1:
        dist.all_reduce(flat, op=op or dist.ReduceOp.SUM)
    return dict(zip(keys, flat.split([tensors[k].numel() for k in keys])))


class GradShare:
    """Diagnostic (--grad-share-every): where the iteration's update comes from, step by step.

    The iteration's gradient (before clipping) is a sum over its transitions, so it splits exactly
    by trained step: g = sum_j g_j, g_j the gradient of the loss of step j's transitions alone. Step
    j's share is its projection on the whole, share_j = g_j . g / |g|^2: the shares sum to 1, a step
    pulling against the others has a negative share, and a step that carries the update has a share
    near 1. `add(row_loss, step_index)`, called with the micro-batch's per-transition loss before
    its backward, takes one extra backward per step present in the micro-batch (autograd.grad, which
    leaves .grad alone: the update is unchanged), so a measured iteration trains at a few times the
    cost; an inactive one (active=False, the iterations not measured) costs nothing. One process
    only: the per-step gradients are this rank's.
    """

    def __init__(self, params: dict, num_slots: int, active: bool = True):
        self.params, self.grads, self.active = list(params.values()), [None] * num_slots, active

    def add(self, row_loss: torch.Tensor, step_index: torch.Tensor) -> None:
        """Each step's part of this micro-batch's gradient, added up (nothing when not active)."""
        if not self.active:
            return
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


class TrainStats:
    """The training section's metrics and its diagnostic, in two calls: `add` once per micro-batch
    (before its backward: the diagnostic differentiates its loss) and `step` once per optimizer
    step. Run.log reduces them over the ranks into the iteration's metrics row."""

    ratio_metrics, own_names = True, ()  # a ratio to log; no metrics of a script's own

    def __init__(self, args, params: dict, tr: dict, keep: torch.Tensor, iteration: int):
        self.args = args
        self.stats = Stats(num_slots=args.num_steps)
        # the share of transitions kept, per step
        self.stats.add(torch.ones_like(tr["advantage"]), tr["step_index"], kept=keep.float())
        measured = args.grad_share_every > 0 and iteration % args.grad_share_every == 0
        self.grad_share = GradShare(params, args.num_steps, active=measured)

    def add(self, mb, step_index, ratio, log_ratio, adv, policy_loss, kl) -> None:
        """One micro-batch: its ratio, clip fraction, KL, advantages and loss per trained step, its
        forwards and backwards, and (on a measured iteration) each step's part of its gradient."""
        a, s = self.args, self.stats
        self.grad_share.add((policy_loss + a.beta * kl) * mb.weight / mb.divisor, step_index)
        # on-policy, the ratio is 1 before any update
        s.keep_first(ratio_dev=(ratio.detach() - 1).abs().max())
        s.add(
            mb.weight,
            step_index,
            ratio=ratio,
            ratio_sq=ratio**2,
            kl=kl,
            abs_adv=adv.abs(),
            clipfrac=((ratio - 1).abs() > a.clip_range).float(),
            policy_loss=policy_loss,
            approx_kl_k2=0.5 * log_ratio**2,
        )
        s.add_extremes(mb.weight, ratio=ratio)
        n = len(mb.states)  # one forward per state (twice with the KL reference), one backward
        s.count(**{"nfe/train_forward": n * (2 if a.beta > 0 else 1), "nfe/train_backward": n})

    def step(self, grad_norm: float | None) -> None:
        count_step(self.stats, grad_norm, self.grad_share.params)


def count_step(stats: Stats, grad_norm: float | None, params) -> None:
    """An optimizer step in the metrics: its gradient norm, and how many entries of the trained
    weights' gradient are exactly zero (fp16 without loss scaling shows as zeros: issue #55); or,
    grad_norm None, a step the fp16 loss scaler skipped. A weight without a gradient counts as
    zeros; each rank counts what it holds (a shard under FSDP), and Stats sums over the ranks."""
    if grad_norm is None:
        stats.count(skipped_steps=1)
        return

    def local(t):  # an FSDP DTensor: this rank's shard
        return t.to_local() if hasattr(t, "to_local") else t

    zeros = entries = 0
    for p in params:
        n = local(p).numel()
        zeros += n if p.grad is None else int((local(p.grad) == 0).sum())
        entries += n
    stats.count(grad_norm=grad_norm, optimizer_steps=1, grad_zeros=zeros, grad_entries=entries)


# ------------------------------------------------------------------------------- the optimizer step
class NonFiniteUpdate(SystemExit):
    """A non-finite loss or gradient: the run stops before the update, in one line (a
    SystemExit, no traceback)."""


def stop_nonfinite(what: str, iteration: int | None, run_dir: str) -> NonFiniteUpdate:
    """The one line a non-finite number stops the run with, naming what exists to go on from."""
    from common.checkpoint import continue_hint

    hint = continue_hint(run_dir) if run_dir else "nothing was saved"
    return NonFiniteUpdate(
        f"error: non-finite {what}{'' if iteration is None else f' at iteration {iteration}'}; "
        f"stopping before anything non-finite is saved ({hint})"
    )


def check_finite_update(grad_norm: torch.Tensor, iteration: int, run_dir: str) -> float:
    """The gradient norm, as a float, if it is finite; else the run stops before the update with
    one line that says how to go on. Under DDP the gradients are already all-reduced, so every rank
    sees the same norm and stops together (no extra collective)."""
    if not torch.isfinite(grad_norm):
        raise stop_nonfinite("loss or gradient", iteration, run_dir)
    return float(grad_norm)


def check_finite_rewards(scores: torch.Tensor, iteration: int, run_dir: str) -> torch.Tensor:
    """The iteration's rewards (all ranks' scores), if every one is finite; else one line."""
    if not torch.isfinite(scores).all():
        raise stop_nonfinite("reward", iteration, run_dir)
    return scores


# --------------------------------------------------------------------------- the rollout's result
@dataclass
class Rollout:
    """What a rollout hands the training section (and the metrics row): nothing else crosses."""

    transitions: dict  # the contract above, one row per SDE step the policy took
    emb: object  # this rank's prompts' text embeddings, indexed by transitions["prompt_index"]
    prompts: list  # this rank's prompts
    counts: dict  # trajectories, scored_images, nfe/rollout, nfe/completion (this rank's)
    metrics: dict  # the rollout's train/... metrics of the iteration
