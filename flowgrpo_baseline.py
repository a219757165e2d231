"""Flow-GRPO: online RL for flow-matching text-to-image models (Liu et al. 2025, arXiv 2505.05470).

1. Sample with an SDE that has the ODE's marginals, so each denoising step is a Gaussian policy
   with a log-prob (common/sampler.py, Eq. E2-E3).
2. Sample a group of G images per prompt; every step of image i gets the advantage
   (r_i - mean_G) / std.
3. Update the PPO-clipped objective on those steps, plus a KL to the same network with its LoRA
   switched off.
Docs: docs/flowgrpo.md.  Run: `python flowgrpo_baseline.py` (toy world, CPU, minutes, no downloads)
or `torchrun --nproc_per_node 8 flowgrpo_baseline.py --model-path DIR ...` (see the docs for the
paper presets). The shared flags and the set-up are in common/plumbing/harness.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from itertools import product
from typing import Literal

import torch
import tyro

from common.plumbing.checks import ConfigError, Rule, check_flag, check_ranges, check_sde_type
from common.plumbing.harness import GRPOArgs, Harness, derived, setup, split_batch
from common.plumbing.parallel import check_parallel
from common.plumbing.run import Stats, check_finite, max_over_ranks, sum_over_ranks
from common.plumbing.transitions import GradShare, Rollout, check_transitions
from common.rewards import advantage_mix, all_gather_cat, group_advantages, group_reward_metrics
from common.sampler import gaussian_kl, ratio_norm, sde_step_with_logprob


@dataclass
class Args(GRPOArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # ---- rollout
    num_steps: int = 10
    """denoising steps T of the rollout's sigma schedule"""
    noise_level: float = 0.7
    """a, the SDE's noise: std_dev_t = a sqrt(sigma / (1 - sigma))"""
    group_size: int = 8
    """G, images per prompt whose rewards are compared"""
    groups_per_iteration: int = 32
    """prompts per iteration, over all ranks"""
    timestep_fraction: float | None = None
    """train the first int(num_steps * fraction) steps (default 0.5)"""
    sde_window_size: int = 0
    """Flow-GRPO-Fast: noise and training on a random window of this many steps (0 = off)"""
    sde_window_range: tuple[int, int] | None = None
    """START END of the window's steps (default: 0 and num_steps // 2)"""
    # ---- reward and advantage
    reward_mix: Literal["score", "advantage"] = "score"
    """mix several rewards before (score) or after (advantage) the group normalisation"""
    global_std: bool = True
    """divide by the std of all the iteration's rewards, not each group's"""
    std_eps: float = 1e-4
    """added to the std before dividing by it"""
    adv_clip_max: float = 5.0
    """advantages are clipped to [-max, max]"""
    # ---- optimizer
    num_iterations: int = 30
    """rollout + update iterations (0 = only evaluate the starting model)"""
    learning_rate: float = 3e-4
    """AdamW learning rate"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    weight_decay: float = 1e-4
    """AdamW decoupled weight decay"""
    # ---- filled in by check_args (not flags)
    images_per_iteration: int = derived()
    """images sampled per iteration over all ranks: groups_per_iteration * group_size"""
    images_per_rank: int = derived()
    """images_per_iteration / world_size"""
    trained_steps: int = derived()
    """steps trained per trajectory"""


def check_args(args: Args, world_size: int) -> None:
    """Flag ranges and batch arithmetic, checked before any model is loaded. Every message says what
    to change."""
    check_ranges(args)  # common/plumbing/checks.py: the numeric flags the scripts share
    check_parallel(args, world_size)  # common/plumbing/parallel.py: --parallel fsdp needs torchrun
    split_batch(args, world_size)  # common/plumbing/harness.py: images per iteration and per rank
    # (A_i - mean) / (std + eps) is 0 / 0 for a group of equal rewards without eps (the shared table
    # allows 0 for G²RPO)
    check_flag(args, "std_eps", Rule(0, lo_open=True, why="a group of equal rewards has std 0"))
    check_flag(
        args, "sde_window_size", Rule(0, integer=True, why="steps in the SDE window; 0 = no window")
    )
    if args.sde_window_size:
        # Flow-GRPO-Fast: the window replaces --timestep-fraction (the released code ignores it)
        if args.timestep_fraction is not None:
            raise ConfigError(
                f"--timestep-fraction {args.timestep_fraction} and --sde-window-size "
                f"{args.sde_window_size} both choose the trained steps; pass one (the window "
                "trains its own steps)"
            )
        lo, hi = args.sde_window_range = args.sde_window_range or (0, args.num_steps // 2)
        if not (0 <= lo and lo + args.sde_window_size <= hi <= args.num_steps):
            raise ConfigError(
                f"--sde-window-range {lo} {hi} with --sde-window-size {args.sde_window_size}: need "
                f"0 <= START, START + size <= END <= --num-steps {args.num_steps} (the window's "
                f"steps lie in START..END - 1); the default is 0 {args.num_steps // 2}"
            )
        args.trained_steps = args.sde_window_size
        check_sde_type(args, hi == args.num_steps, f"--sde-window-range {lo} {hi}")
        return
    if args.sde_window_range is not None:
        raise ConfigError(
            f"--sde-window-range {' '.join(map(str, args.sde_window_range))} needs "
            "--sde-window-size > 0 (the default 0 puts noise at every step)"
        )
    args.timestep_fraction = 0.5 if args.timestep_fraction is None else args.timestep_fraction
    args.trained_steps = int(args.num_steps * args.timestep_fraction)
    if not 1 <= args.trained_steps <= args.num_steps:
        raise ConfigError(
            f"--timestep-fraction {args.timestep_fraction} trains {args.trained_steps} of "
            f"{args.num_steps} steps; it must train at least one"
        )
    check_sde_type(
        args, args.trained_steps == args.num_steps, f"--timestep-fraction {args.timestep_fraction}"
    )


# ALGO LOGIC: the rollout. Flow-GRPO spreads each group over the ranks.
def rollout(h: Harness, args: Args, sigmas: torch.Tensor, iteration: int, timer) -> Rollout:
    """Sample G images per prompt with the SDE, score them, and make every trained step of image i a
    transition with image i's advantage. Every rank draws the same prompts and shuffle, seeded by
    the iteration (so a resumed run samples what the uninterrupted one would), and keeps its
    slice."""
    with timer("rollout"):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
        prompt_ids = torch.randint(len(h.train_prompts), (args.groups_per_iteration,), generator=g)
        group = torch.arange(args.groups_per_iteration).repeat_interleave(args.group_size)
        group = group[torch.randperm(len(group), generator=g)]  # group of every image, global order
        # trained: the first steps, or Flow-GRPO-Fast's window (from g: the same on every rank)
        lo, hi = args.sde_window_range or (0, 0)
        w0 = 0
        if args.sde_window_size:
            w0 = int(torch.randint(lo, hi - args.sde_window_size + 1, (1,), generator=g))
        trained = range(w0, w0 + args.trained_steps)
        mine = slice(h.rank * args.images_per_rank, (h.rank + 1) * args.images_per_rank)
        prompts = [h.train_prompts[prompt_ids[k]] for k in group[mine]]
        emb = h.backbone.encode(prompts)
        seed = args.seed * 1_000_003 + iteration * 1009 + h.rank  # the rank's own noise
        gen = torch.Generator(h.device).manual_seed(seed)
        steps, pending = [], []  # per rollout batch: trained (x, x_next, log_prob, mean), scoring
        with torch.no_grad():
            for b in range(0, args.images_per_rank, args.rollout_batch_size):
                x = h.backbone.initial_noise(
                    args.rollout_batch_size, args.resolution, args.resolution, generator=gen
                )
                chain = []
                for j in range(args.num_steps):
                    v = h.backbone.velocity(
                        x, sigmas[j], emb[b : b + args.rollout_batch_size], args.guidance_scale
                    )
                    # outside a window, noise 0: the exact Euler step of the ODE (E1)
                    a = args.noise_level if j in trained or not args.sde_window_size else 0.0
                    x_next, log_prob, mean, _ = sde_step_with_logprob(
                        v,
                        x,
                        sigmas[j],
                        sigmas[j + 1],
                        a,
                        generator=gen,
                        sigma_max=sigmas[1],
                        sde_type=args.sde_type,
                    )
                    if j in trained:
                        chain.append((x, x_next, log_prob, mean))
                    x = x_next
                steps.append([torch.stack(f) for f in zip(*chain)])  # each [trained steps, B, ...]
                # a remote reward scores this batch while the next one samples
                image = h.backbone.decode(x, args.resolution, args.resolution)
                pending.append(h.reward_model.submit(image, prompts[b : b + len(x)]))
    with timer("reward"):
        scores = h.reward_model.gather(pending)  # [n, R]: one column per reward
        all_scores = all_gather_cat(scores.to(h.device), h.world_size).cpu()  # rank-major = global
        check_finite("reward", iteration, all_scores)
        # A_i = (r_i - mean of i's group) / (std of all rewards + eps) (common/rewards.py)
        adv = partial(group_advantages, group=group, global_std=args.global_std, eps=args.std_eps)
        if args.reward_mix == "score":
            advantages = adv(h.reward_model.mix(all_scores))
        else:  # normalise each reward within its groups, then mix the advantages (G²RPO's rule)
            per_reward = torch.stack([adv(column) for column in all_scores.T], 1)
            advantages = advantage_mix(per_reward, h.reward_model.weights)
        advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)
        # Transitions, step-major: row j * n + i is step j of trajectory i (check_transitions)
        L, n = args.trained_steps, args.images_per_rank
        step_index = torch.arange(w0, w0 + L).repeat_interleave(n)  # the step of each row
        trajectory = torch.arange(n).repeat(L)  # the trajectory of each row
        latents, next_latents, log_probs, means = (
            torch.cat(f, 1).flatten(0, 1) for f in zip(*steps)
        )
        transitions = {
            "latents": latents,
            "next_latents": next_latents,
            "log_prob": log_probs,
            "mean": means,
            "sigma": sigmas[step_index],
            "sigma_next": sigmas[step_index + 1],
            "noise_level": torch.full((L * n,), args.noise_level),
            "advantage": advantages[mine][trajectory],
            "prompt_index": trajectory,
            "step_index": step_index,
            "trajectory": trajectory,
        }
    mixed = h.reward_model.mix(all_scores)
    groups = torch.stack([mixed[group == k] for k in range(args.groups_per_iteration)])
    metrics = group_reward_metrics(groups)  # [groups, G] rewards
    if args.sde_window_size:
        metrics["train/sde_window_start"] = w0
    counts = {"trajectories": n, "scored_images": n, "nfe/rollout": n * args.num_steps}
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
    sigmas = h.backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)

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
