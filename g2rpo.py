"""G²RPO: Granular GRPO for flow-matching text-to-image models (Zhou et al. 2025, arXiv 2510.01982,
CVPR 2026).

1. Singular Stochastic Sampling: one noise and one deterministic ODE "anchor" trajectory per prompt;
   at each branch step k the G members of the group take ONE SDE step from the shared anchor state,
   then finish with the ODE. The rewards of a group differ only through step k, so that step alone
   gets the advantage (dense credit).
2. Multi-Granularity Advantage Integration (MGAI): every branch is finished on every λ-th step of
   the remaining schedule for each λ in Λ; the rewards are normalised per (k, λ) within the group,
   then summed over λ.
3. Flow-GRPO's PPO-clipped objective on the branch steps only, no KL (the training section is the
   baseline's).
Docs: docs/g2rpo.md.  Run: `python g2rpo.py` (toy world, CPU, minutes, no downloads) or
`torchrun --nproc_per_node 8 g2rpo.py --model-path DIR ...` (see the docs for the paper preset).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import product
from typing import Literal

import torch
import tyro

from common.plumbing.checks import ConfigError, check_ranges, check_sde_type
from common.plumbing.harness import GRPOArgs, Harness, derived, setup
from common.plumbing.parallel import check_parallel
from common.plumbing.run import Stats, check_finite, max_over_ranks, sum_over_ranks
from common.plumbing.transitions import GradShare, Rollout, check_transitions
from common.rewards import advantage_mix, all_gather_cat, group_reward_metrics
from common.sampler import gaussian_kl, ode_along_paths, ode_step, ratio_norm, sde_step_with_logprob


@dataclass
class Args(GRPOArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # ---- rollout
    num_steps: int = 10
    """denoising steps T of the rollout's sigma schedule"""
    sigma_grid: Literal["pipeline", "official"] = "pipeline"
    """the rollout's sigma grid: the stock pipeline's, or the released code's static shift"""
    noise_level: float = 0.7
    """a, the SDE's noise at the branch step: std_dev_t = a sqrt(sigma / (1 - sigma))"""
    group_size: int = 8
    """G, branches per prompt and branch step whose rewards are compared"""
    groups_per_iteration: int = 12
    """prompts per iteration, over all ranks (each prompt's groups stay on one rank)"""
    branch_steps: tuple[int, ...] = (0, 1, 2)
    """M: the steps k that are branched and trained (0 = the noisiest)"""
    granularities: tuple[int, ...] = (1, 2, 3)
    """Λ: each branch is also finished on every λ-th step of the rest"""
    official_coarse_schedule: bool = False
    """finish branches as the released code does (docs/g2rpo.md)"""
    # ---- reward and advantage
    reward_mix: Literal["score", "advantage"] = "score"
    """mix several rewards before (score) or after (advantage) MGAI's normalisation"""
    std_eps: float = 1e-8
    """added to each group's std before dividing by it"""
    adv_clip_max: float = 5.0
    """advantages, summed over granularities, are clipped to [-max, max]"""
    # ---- optimizer
    update_schedule: Literal["accumulate", "per-k"] = "accumulate"
    """one optimizer step over all branch steps, or one per branch step k"""
    num_iterations: int = 39
    """rollout + update iterations (0 = only evaluate the starting model)"""
    learning_rate: float = 3e-4
    """AdamW learning rate"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    weight_decay: float = 1e-4
    """AdamW decoupled weight decay"""
    # ---- filled in by check_args (not flags)
    prompts_per_rank: int = derived()
    """groups_per_iteration / world_size: a prompt's groups never span ranks"""
    images_per_iteration: int = derived()
    """images scored per iteration over all ranks: prompts * |M| * |Λ| * G"""
    images_per_rank: int = derived()
    """images_per_iteration / world_size"""
    trained_steps: int = derived()
    """|M|, the branch steps"""


def check_args(args: Args, world_size: int) -> None:
    """Flag ranges and batch arithmetic, checked before any model is loaded. Every message says what
    to change."""
    check_ranges(args)  # common/plumbing/checks.py: the numeric flags the scripts share
    check_parallel(args, world_size)  # common/plumbing/parallel.py: --parallel fsdp needs torchrun
    for flag, values in (
        ("--branch-steps", args.branch_steps),
        ("--granularities", args.granularities),
    ):
        if len(set(values)) < len(values):
            # a step or a granularity listed twice would not count twice
            raise ConfigError(
                f"{flag} {' '.join(map(str, values))} lists a value twice; list each once"
            )
    args.branch_steps = tuple(sorted(args.branch_steps))
    args.granularities = tuple(sorted(args.granularities))
    args.trained_steps = len(args.branch_steps)
    if args.groups_per_iteration % world_size:
        raise ConfigError(
            f"--groups-per-iteration {args.groups_per_iteration} cannot be split over {world_size} "
            f"ranks (each rank samples whole groups); make it a multiple of {world_size}"
        )
    if not args.branch_steps or not all(0 <= k < args.num_steps for k in args.branch_steps):
        raise ConfigError(
            f"--branch-steps {' '.join(map(str, args.branch_steps))}: give at least one step index "
            f"in 0..{args.num_steps - 1} (0 is the noisiest step); the default is 0 1 2 (toy), and "
            "the paper branches the first half (0 1 2 3 4 5 6 7 of its 16 steps)"
        )
    if not args.granularities or min(args.granularities) < 1:
        raise ConfigError(
            f"--granularities {' '.join(map(str, args.granularities))}: give positive step strides "
            "λ >= 1; the default is 1 2 3 (paper)"
        )
    # the branch step is one sde_step_with_logprob call, either type; CPS cannot branch the last
    # step (its std is 0)
    check_sde_type(
        args,
        args.num_steps - 1 in args.branch_steps,
        f"--branch-steps ending at {max(args.branch_steps)}",
    )
    args.prompts_per_rank = args.groups_per_iteration // world_size
    args.images_per_rank = (
        args.prompts_per_rank * args.trained_steps * len(args.granularities) * args.group_size
    )
    args.images_per_iteration = args.images_per_rank * world_size


# ALGO LOGIC: which sigmas a branch born at step k walks through to its image, at granularity λ.
def completion_schedule(k: int, lam: int, num_steps: int, official: bool = False) -> list[int]:
    """Every λ-th schedule index from k+1 (where step k's SDE step lands) to num_steps (sigma = 0):
    k+1, k+1+λ, ..., and a last, shorter Euler step to num_steps when λ does not divide the rest, so
    every image is a finished ODE solution. official=True copies the released code: one fine step
    k+1 -> k+2, then every λ-th index from k+2, its image x0_hat = x - sigma v at the last call (an
    Euler step to sigma = 0: the last index becomes num_steps). Both: ceil((T-k-1)/λ) calls."""
    if official:
        idx = [k + 1] + list(range(k + 2, num_steps + 1, lam))
        return idx[:-1] + [num_steps] if len(idx) > 1 else idx
    idx = list(range(k + 1, num_steps + 1, lam))
    return idx if idx[-1] == num_steps else idx + [num_steps]


@torch.no_grad()
def anchor_trajectory(velocity, x, sigmas, last: int, batch: int):
    """The ODE (E1) from the shared x_T to x_last: states[j] and v(states[j], sigma_j), with
    velocity(x, sigma, prompt_index) -> v. One row per prompt: the group shares this trajectory, so
    a branch state's velocity is computed once per prompt, not once per member."""
    states, vels, rows = [], [], torch.arange(len(x))
    for j in range(last + 1):
        chunks = range(0, len(x), batch)
        v = torch.cat([velocity(x[b : b + batch], sigmas[j], rows[b : b + batch]) for b in chunks])
        states.append(x)
        vels.append(v)
        x = ode_step(v, x, sigmas[j], sigmas[j + 1])
    return states, vels


@torch.no_grad()
def singular_stochastic_rollout(
    velocity,
    x_T,
    sigmas,
    branch_steps,
    granularities,
    group_size: int,
    noise_level: float,
    generator=None,
    batch: int = 64,
    official: bool = False,
    sde_type: str = "sde",
) -> dict:
    """Singular Stochastic Sampling + MGAI completions for P prompts (rows of x_T, each group's
    shared noise): for each k in M, G SDE steps (E3; --sde-type cps: E6) from the anchor's x_k with
    its velocity there, each branch then finished by the ODE at every granularity. Returns
      latents [K, P, ...]         the shared state before each branch step
      next_latents [K, P, G, ...], log_prob [K, P, G]: the SDE steps, the only ones with a loss
      final [P, K, J, G, ...]     the clean latents to score (K = |M|, J = |Λ|), and nfe"""
    P, K, J, G, T = len(x_T), len(branch_steps), len(granularities), group_size, len(sigmas) - 1
    # At noise_level 0 the G branches are one deterministic computation: run it once and copy it.
    # Batched kernels do not promise equal outputs for equal rows (a row's result can depend on its
    # place in the batch), and a z-score would blow such 1e-7 differences up into O(1) advantages.
    n = G if noise_level > 0 else 1
    states, vels = anchor_trajectory(velocity, x_T, sigmas, max(branch_steps), batch)
    nfe = P * (max(branch_steps) + 1)
    latents, next_latents, log_prob, means = [], [], [], []
    for k in branch_steps:  # every k branches from the same anchor (not from another k's branch)
        x, v = states[k].repeat_interleave(n, 0), vels[k].repeat_interleave(n, 0)
        x_next, log_prob_k, mean_k, _ = sde_step_with_logprob(
            v,
            x,
            sigmas[k],
            sigmas[k + 1],
            noise_level,
            generator=generator,
            sigma_max=sigmas[1],
            sde_type=sde_type,
        )
        latents.append(states[k])
        next_latents.append(x_next.view(P, n, *x_next.shape[1:]))
        log_prob.append(log_prob_k.view(P, n))
        means.append(mean_k.view(P, n, *mean_k.shape[1:]))
    next_latents = torch.stack(next_latents)  # [K, P, n, ...]
    # One completion job per (prompt, k, λ, member), in that order (prompt outermost, so a
    # rank-major gather of the rewards lists prompts in global order).
    start = next_latents.transpose(0, 1).unsqueeze(2).expand(P, K, J, n, *next_latents.shape[3:])
    schedules = product(branch_steps, granularities)  # (k, λ), λ fastest
    paths = [sigmas[completion_schedule(k, lam, T, official)] for k, lam in schedules]
    paths = [p for _ in range(P) for p in paths for _ in range(n)]
    prompt_index = torch.arange(P).repeat_interleave(K * J * n)
    # Euler ODE (E1) of every row along its own path, staircase-batched (common/sampler.py)
    final, nfe_ode, _ = ode_along_paths(
        lambda x, s, rows: velocity(x, s, prompt_index[rows]),
        start.reshape(P * K * J * n, *start.shape[4:]),
        paths,
        batch,
    )
    final = final.view(P, K, J, n, *final.shape[1:])
    return {
        "latents": torch.stack(latents),
        "next_latents": next_latents.expand(K, P, G, *next_latents.shape[3:]),
        "log_prob": torch.stack(log_prob).expand(K, P, G),
        "mean": torch.stack(means).expand(K, P, G, *next_latents.shape[3:]),
        "final": final.expand(P, K, J, G, *final.shape[4:]),
        "nfe": nfe + nfe_ode,
    }


# ALGO LOGIC: MGAI (paper Eqs. 10-12), the advantage of each branch step from its rewards at every
# granularity.
def mgai_advantages(rewards: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """rewards [..., K, J, G, R] (branch step, granularity, member, reward) -> advantages [..., K,
    G]: A_k^i = sum_m w_m sum_λ (r - mean_G r) / (std_G r + eps), std unbiased as the official code,
    one normalisation per (k, λ, reward). In float64, where G equal float32 rewards have std exactly
    0 (in float32 their rounded mean over a ~1e-8 std gives a tied group advantages up to ~0.9)."""
    r = rewards.double()
    std = r.std(-2, keepdim=True)
    # equal rewards: 0, also at eps = 0
    z = torch.where(std > 0, (r - r.mean(-2, keepdim=True)) / (std + eps), 0.0)
    z = z.sum(-3)  # sum over granularities -> [..., K, G, R]
    return advantage_mix(z.reshape(-1, z.shape[-1]), weights).view(z.shape[:-1])


# ALGO LOGIC: the rollout. G²RPO keeps each group on one rank (as the official code).
def rollout(h: Harness, args: Args, sigmas: torch.Tensor, iteration: int, timer) -> Rollout:
    """Singular Stochastic Sampling and MGAI for this rank's prompts: the branch step of each k is a
    transition with its MGAI advantage. All ranks draw the same prompts (a generator seeded by the
    iteration) and rank r keeps slice r; the noise is seeded by (seed, iteration, rank), so a
    resumed run samples exactly what the uninterrupted run would have."""
    M, Lam, G = args.branch_steps, args.granularities, args.group_size
    with timer("rollout"):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
        prompt_ids = torch.randint(len(h.train_prompts), (args.groups_per_iteration,), generator=g)
        mine = slice(h.rank * args.prompts_per_rank, (h.rank + 1) * args.prompts_per_rank)
        prompts = [h.train_prompts[i] for i in prompt_ids[mine]]
        emb = h.backbone.encode(prompts)
        seed = args.seed * 1_000_003 + iteration * 1009 + h.rank  # the rank's own noise
        gen = torch.Generator(h.device).manual_seed(seed)
        size = (args.resolution, args.resolution)
        x_T = h.backbone.initial_noise(len(prompts), *size, generator=gen)
        branches = singular_stochastic_rollout(
            lambda x, s, p: h.backbone.velocity(x, s, emb[p], args.guidance_scale),
            x_T,
            sigmas,
            M,
            Lam,
            G,
            args.noise_level,
            generator=gen,
            batch=args.rollout_batch_size,
            official=args.official_coarse_schedule,
            sde_type=args.sde_type,
        )
    with timer("reward"):
        clean = branches["final"].flatten(0, 3)  # one clean latent per (prompt, k, λ, member)
        job_prompts = [p for p in prompts for _ in range(len(M) * len(Lam) * G)]
        bs = args.rollout_batch_size
        pending = []  # chunk by chunk: a remote reward scores one while the next decodes
        for b in range(0, len(clean), bs):
            image = h.backbone.decode(clean[b : b + bs], args.resolution, args.resolution)
            pending.append(h.reward_model.submit(image, job_prompts[b : b + bs]))
        scores = h.reward_model.gather(pending)  # [n, R]: one column per reward
        all_scores = all_gather_cat(scores.to(h.device), h.world_size).cpu()  # global prompt order
        check_finite("reward", iteration, all_scores)
        # [prompt, k, λ, member, reward]
        table = all_scores.view(args.groups_per_iteration, len(M), len(Lam), G, -1)
        mixed = h.reward_model.mix(all_scores).view(table.shape[:-1])
        if args.reward_mix == "score":  # mix the raw scores, then MGAI on the mix
            advantages = mgai_advantages(mixed.unsqueeze(-1), torch.ones(1), args.std_eps)
        else:  # MGAI per reward model, then the weighted sum (the official A_HPS + A_CLIP)
            advantages = mgai_advantages(table, h.reward_model.weights, args.std_eps)
        advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)  # [prompt, k, member]
        # Transitions: only the SDE step of each branch, ordered (k, prompt, member), with its MGAI
        # advantage. The G members of (k, prompt) start from one state x_k: state_index names it,
        # and training runs one forward per state (so --train-batch-size counts states), every
        # member keeping its own log-prob, ratio and loss.
        n_prompts, n = len(prompts), len(M) * len(prompts) * G
        step_index = torch.tensor(M).repeat_interleave(n_prompts * G)
        transitions = {
            "latents": branches["latents"].repeat_interleave(G, 1).flatten(0, 1),  # the shared x_k
            "next_latents": branches["next_latents"].flatten(0, 2),
            "log_prob": branches["log_prob"].flatten(),
            "mean": branches["mean"].flatten(0, 2),
            "sigma": sigmas[step_index],
            "sigma_next": sigmas[step_index + 1],
            "noise_level": torch.full((n,), args.noise_level),
            "advantage": advantages[mine].transpose(0, 1).flatten(),
            "prompt_index": torch.arange(n_prompts).repeat_interleave(G).repeat(len(M)),
            "step_index": step_index,
            "state_index": torch.arange(len(M) * n_prompts).repeat_interleave(G),
        }
        if args.update_schedule == "per-k":  # one optimizer step per branch step, k in order
            transitions["update_block"] = torch.arange(len(M)).repeat_interleave(n_prompts * G)
    # Logged rewards are the finest granularity's (full-schedule images, comparable to the
    # baseline's); the group std per k shows the diversity one SDE step buys.
    fine = mixed[:, :, 0]  # [prompt, k, member]
    metrics = group_reward_metrics(fine.flatten(0, 1))
    group_std = fine.double().std(-1, unbiased=False)  # [prompt, k]
    for j, k in enumerate(M):
        metrics[f"train/group_std_k{k}"] = group_std[:, j].mean().item()
    for j, lam in enumerate(Lam):
        metrics[f"train/reward_mean_lam{lam}"] = mixed[:, :, j].mean().item()
    anchor_nfe = len(prompts) * (max(M) + 1)  # the anchor's calls; the rest are completions
    counts = {
        "trajectories": len(prompts) * G,  # a group: G branches at each k, scored at each λ
        "scored_images": args.images_per_rank,
        "nfe/rollout": anchor_nfe,
        "nfe/completion": branches["nfe"] - anchor_nfe,
    }
    return Rollout(transitions, emb, prompts, counts, metrics)


# ============================ SHARED: the log-prob of a stored step (the three GRPO scripts) ====
def step_policy(backbone, model, tr: dict, mb, emb, sigmas: torch.Tensor, args):
    """log pi(x_next | x_t, c) of the micro-batch's stored SDE steps under `model` (the policy, or
    its KL reference), the step's mean and std_dev_t (E2-E3). As CleanRL's get_action_and_value, the
    stored action is scored, not drawn; one forward per state serves its rows (G²RPO's branches)."""
    rows, position, first = mb
    # CFG inside the training forward; --detach-uncond stops the unconditional branch's gradient
    v = backbone.velocity(
        tr["latents"][first],
        tr["sigma"][first],
        emb[tr["prompt_index"][first]],
        args.guidance_scale,
        model=model,
        detach_uncond=args.detach_uncond,
    )[position]
    _, log_prob, mean, std_dev_t = sde_step_with_logprob(
        v,
        tr["latents"][rows],
        tr["sigma"][rows],
        tr["sigma_next"][rows],
        tr["noise_level"][rows],
        prev_sample=tr["next_latents"][rows],
        sigma_max=sigmas[1],
        sde_type=args.sde_type,
    )
    return log_prob, mean, std_dev_t


def optimizer_steps(state: torch.Tensor, keep: torch.Tensor, block: torch.Tensor, args, world_size):
    """(states, kept transitions on all ranks) of each optimizer step: per pass and update block
    (G²RPO: one per branch step), the block's states (a row, or G²RPO's G branches of one latent)
    shuffled, kept first, cut into --optimizer-steps-per-iteration parts. A forward is a collective
    under DDP and FSDP: every rank trains as many as the rank keeping most (padding weighs 0)."""
    for _, b in product(range(args.num_inner_epochs), range(int(block.max()) + 1)):
        states = state[block == b].unique()
        has_kept = torch.zeros(int(state.max()) + 1, dtype=torch.bool, device=state.device)
        has_kept[state[(block == b) & keep]] = True
        kept = states[has_kept[states]]
        kept = kept[torch.randperm(len(kept)).to(kept.device)]
        n = max_over_ranks(len(kept), world_size, state.device)
        if n == 0:  # no rank keeps a transition of this block
            continue
        states = torch.cat([kept, states[~has_kept[states]]])[:n]
        steps = states.tensor_split(min(args.optimizer_steps_per_iteration, n))
        n_kept = torch.stack([keep[micro_batch(state, s)[0]].sum() for s in steps])
        yield from zip(steps, sum_over_ranks(n_kept, world_size).tolist())


def micro_batch(state: torch.Tensor, states: torch.Tensor):
    """The rows of `states` state by state, each row's position among them (v[position] hands a
    row its state's velocity) and each state's first row (whose latent the forward reads)."""
    match = state == states[:, None]  # [states, rows]
    position, rows = match.nonzero(as_tuple=True)
    return rows, position, match.int().argmax(1)


# ================================================= END OF SHARED ==================================


if __name__ == "__main__":
    args = tyro.cli(Args)
    h = setup(args, __file__, check_args)  # checks, run folder, rewards, model, LoRA, DDP (harness)
    optimizer = torch.optim.AdamW(
        h.params.values(),
        lr=args.learning_rate,
        betas=args.adam_betas,
        weight_decay=args.weight_decay,
        eps=1e-8,
    )
    # fp16: dynamic loss scaling (torch.amp), as the released code's GradScaler; otherwise a no-op
    scaler = torch.amp.GradScaler(h.device.type, enabled=h.backbone.dtype == torch.float16)
    run = h.start(optimizer, scaler)  # the EMA; a resume's weights, optimizer, scale, RNG, counters
    sigmas = h.backbone.schedule(
        args.num_steps, args.resolution, args.resolution, args.shift, grid=args.sigma_grid
    )

    for iteration in range(run.start_iteration, args.num_iterations + 1):
        metrics = {"iteration": iteration}
        last = run.is_last(iteration)  # --num-iterations reached, or the CPU budget spent
        if iteration % args.eval_every == 0 or last:
            metrics.update(run.evaluate(iteration, last))  # held-out accuracy, sample grid
        if last:
            run.log_final(metrics)
            break

        # sample, score, advantages
        ro = rollout(h, args, sigmas, iteration, run.timer)

        # ============================ TRAINING on transitions (same in the three GRPO scripts) ====
        # ALGO LOGIC: the PPO-clipped GRPO objective (Flow-GRPO §4) on single SDE steps, found as in
        # CleanRL's update: the stored step's log-prob under the current policy, the ratio, the
        # clipped loss and the KL; their mean over the optimizer step's transitions; backward, clip,
        # step. The contract of `transitions` is listed in docs/design.md.
        tr = {k: v.to(h.device) for k, v in ro.transitions.items()}
        if iteration == run.start_iteration:  # the rollout's code is the same every iteration
            check_transitions(tr, sigmas, len(ro.prompts))
        check_finite("rollout", iteration, tr)
        # --drop-zero-advantage: a zero advantage has no policy gradient, so its row is left out
        keep = (tr["advantage"] != 0) | (not args.drop_zero_advantage)
        # G²RPO: its G branches of a state share one forward, and each branch step its own update
        state = tr.get("state_index", torch.arange(len(keep), device=h.device))
        block = tr.get("update_block", torch.zeros_like(state))
        # the iteration's metrics, per trained step; the means it logs, at their value untrained
        stats = Stats(args.num_steps, ratio=1, clipfrac=0, approx_kl_k2=0, kl=0, policy_loss=0)
        stats.add(torch.ones_like(tr["advantage"]), tr["step_index"], kept=keep.float())
        grad_share = None  # diagnostic: every --grad-share-every iterations, where g comes from
        if args.grad_share_every and iteration % args.grad_share_every == 0:
            grad_share = GradShare(h.params, args.num_steps)
        for step_states, n_kept in optimizer_steps(state, keep, block, args, h.world_size):
            micro = step_states.split(args.train_batch_size)
            for k, mb_states in enumerate(micro):
                mb = micro_batch(state, mb_states)
                r, weight = mb[0], keep[mb[0]].float()  # rows, and 0 for those not kept
                # DDP: only the step's last micro-batch all-reduces the gradient (nanoGPT's
                # line; FSDP2 reduce-scatters each, docs/design.md)
                h.policy.require_backward_grad_sync = k == len(micro) - 1
                log_prob, mean, std_dev_t = step_policy(
                    h.backbone, h.policy, tr, mb, ro.emb, sigmas, args
                )
                log_ratio = log_prob - tr["log_prob"][r]  # new over rollout policy, one step
                ratio = torch.exp(log_ratio)
                # GRPO-Guard: a re-centred, noise-free log-ratio (E7)
                if args.ratio_norm != "off":
                    ratio = torch.exp(
                        ratio_norm(
                            log_ratio,
                            mean,
                            tr["mean"][r],
                            std_dev_t,
                            tr["sigma"][r],
                            tr["sigma_next"][r],
                        )
                    )
                adv = tr["advantage"][r]
                clipped = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                policy_loss = torch.maximum(-adv * ratio, -adv * clipped)
                if args.ratio_norm == "guard":  # GRPO-Guard's re-weighting: each step's loss / |dt|
                    policy_loss = policy_loss / (tr["sigma"][r] - tr["sigma_next"][r])
                kl = torch.zeros_like(policy_loss)  # beta = 0: no KL, no reference forward
                if args.beta > 0:  # KL to the reference policy on the step's Gaussian means (E5)
                    _, ref_mean, _ = step_policy(
                        h.backbone, h.trainable.reference, tr, mb, ro.emb, sigmas, args
                    )
                    kl = gaussian_kl(mean, ref_mean, std_dev_t)
                # the step's mean over all ranks' kept transitions, summed over its micro-batches
                divisor = n_kept / h.world_size
                loss = ((policy_loss + args.beta * kl) * weight).sum() / divisor
                j = tr["step_index"][r]
                stats.first(ratio_dev=(ratio.detach() - 1).abs().max())  # on-policy: 0
                stats.add(
                    weight,
                    j,
                    ratio=ratio,
                    ratio_sq=ratio**2,
                    clipfrac=((ratio - 1).abs() > args.clip_range).float(),
                    approx_kl_k2=0.5 * log_ratio**2,  # the k2 estimator of the KL
                    kl=kl,
                    policy_loss=policy_loss,
                    abs_adv=adv.abs(),
                )
                forwards = len(mb[2]) * (2 if args.beta > 0 else 1)  # one per state (and ref)
                stats.count(**{"nfe/train_forward": forwards, "nfe/train_backward": len(mb[2])})
                if grad_share is not None:  # each trained step's part of this loss's gradient
                    grad_share.add((policy_loss + args.beta * kl) * weight / divisor, j)
                scaler.scale(loss).backward()  # fp16: scaled up, so the gradient does not underflow
            # the torch.amp recipe: unscale, clip, step (skipped on an fp16 overflow), update
            scaler.unscale_(optimizer)  # fp16: the true gradient, before the clip sees it
            grad_norm = torch.nn.utils.clip_grad_norm_(h.params.values(), args.max_grad_norm)
            run.check_gradient(grad_norm, stats)  # non-finite: an fp16 skip, else a stop here
            scaler.step(optimizer)  # no update when fp16's scaled gradient overflowed
            scaler.update()  # fp16: the scale halves after an overflow, grows when clean
            optimizer.zero_grad(set_to_none=True)
            run.after_step(grad_norm)  # every weight finite; the EMA follows a step taken
        # ============================================ END OF TRAINING =============================

        run.log(metrics, stats, ro, grad_share)  # one metrics.jsonl row: rollout's and training's
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.num_iterations:
            run.checkpoint(iteration + 1)

    run.finish()
