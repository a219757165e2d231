"""AWM, Advantage Weighted Matching: the policy gradient through the pretraining loss (Xue et al.,
ICML 2026, arXiv 2509.25050; released code scxue/advantage_weighted_matching,
scripts/train_sd3_awm.py).

1. The CURRENT policy samples G images per prompt with any solver (released: SA-Solver, noise only
   where a step lands in t in [0.3, 0.9]; here Flow-GRPO's SDE step with the same noise window, or
   the Euler ODE); only the clean latent x_0 and its reward are kept: no trajectory, no log-prob.
2. Advantage A = (reward - group mean) / global std, clipped to [-5, 5] and divided by 5: one signed
   weight per image in [-1, 1].
3. Training on the forward process at timesteps stratified over the rollout grid's indices:
   x_t = (1 - t) x_0 + t eps with fresh eps, and the flow-matching loss of v_theta against
   eps - x_0, weighted by -A: good images are fitted, bad ones pushed away. Plus a velocity KL to
   the base model (LoRA off) and one to a fast EMA of the policy, which follows theta once per
   iteration.

The equations, numbered E1-E12 as in docs/awm.md (its table quotes the released line of each):
  (E1) x_t = (1 - t) x_0 + t eps, fresh eps per (timestep, image)
  (E2) x_0 = the rollout's final latent (the policy, no gradient, any solver)
  (E3) l = mean over elements (v_theta - (eps - x_0))^2, in float64; "log-prob" lp = -l
  (E4) the time weighting: ghuber lp = -t ((l + 1e-10)^p - (1e-10)^p) / p, p = 0.25 (released
       default); Uniform lp = -l; t: -t l; t**2: -t^2 l; huber: -t (sqrt(l + 1e-10) - 1e-5)
  (E5) A = (R - mean_group R) / (std_all R + 1e-4)
  (E6) A_hat = clip(A, -5, 5) / 5 * advantage_max   (advantage_max = 1)
  (E7-E9) the released PPO form: rho = exp(lp - lp_old), lp_old = lp.detach(): rho = 1, the clip
       is inert, the gradient is -A_hat grad lp (below, beside the loss)
  (E10) + kl_weight mean (v_theta - v_base)^2, v_base = the model with its LoRA off (released: beta)
  (E11) + ema_kl_weight mean (v_theta - v_ema)^2, v_ema = the fast EMA's velocity at the same x_t
        (released: ema_beta)
  (E12) after each iteration's update: ema <- d ema + (1 - d) theta, d = min(0.3, 0.001 step)

No transitions: as DiffusionNFT, AWM keeps one row per image, so it shares the GRPO scripts' rollout
plumbing (prompts, groups, seeds, rewards, group advantages) but not their training section.
Docs: docs/awm.md. Run: `python awm.py` (toy world, CPU, minutes, no downloads) or
`torchrun --nproc_per_node 8 awm.py --model-path DIR ...` (the docs give the released presets).
The shared flags and the set-up are in common/plumbing/harness.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from common.plumbing.checks import ConfigError, Rule, check_flag, check_ranges
from common.plumbing.harness import Harness, HarnessArgs, derived, setup, split_batch
from common.plumbing.parallel import check_parallel
from common.plumbing.run import Stats, check_finite
from common.plumbing.transitions import Rollout
from common.policy import EMA
from common.rewards import all_gather_cat, group_advantages, group_reward_metrics
from common.sampler import sde_step_with_logprob


@dataclass
class Args(HarnessArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # ---- rollout
    num_steps: int = 10
    """denoising steps T of the rollout's sigma schedule"""
    noise_level: float = 0.4
    """tau, the rollout's stochasticity where a step lands in --noise-window (0 = the Euler ODE)"""
    noise_window: tuple[float, float] = (0.3, 0.9)
    """LO HI: a step is stochastic when the sigma it lands on is in [LO, HI], else an Euler step"""
    group_size: int = 8
    """G, images per prompt whose rewards are compared"""
    groups_per_iteration: int = 32
    """prompts per iteration, over all ranks"""
    # ---- reward and advantage
    global_std: bool = True
    """divide by the std of all the iteration's rewards, not each group's"""
    std_eps: float = 1e-4
    """added to the std before dividing by it"""
    adv_clip_max: float = 5.0
    """advantages are clipped to [-max, max], then divided by max"""
    advantage_max: float = 1.0
    """the clipped advantage's scale: A_hat = clip(A) / adv_clip_max * advantage_max"""
    # ---- the AWM loss
    train_timesteps: int = 6
    """timestep strata; each micro-batch trains one grid index per stratum, shared by its images"""
    timestep_fraction: float = 0.9
    """the strata cover the grid's indices below int(num_steps * fraction)"""
    time_type: Literal["discrete_wo_init", "discrete"] = "discrete_wo_init"
    """strata from grid index 1 (sigma = 1 never trained), or from index 0"""
    weighting: Literal["ghuber", "Uniform", "t", "t**2", "huber"] = "ghuber"
    """time and robust weighting of each row's matching loss"""
    ghuber_power: float = 0.25
    """p of the ghuber weighting: t (l^p - 1e-10^p) / p"""
    kl_weight: float = 0.001
    """weight of |v_theta - v_ref|^2, v_ref the model without LoRA (0 = no reference forward)"""
    ema_kl_weight: float = 1.0
    """weight of |v_theta - v_ema|^2, v_ema the fast EMA of theta (0 = no EMA forward)"""
    kl_ema_decay: float = 0.3
    """the fast EMA's largest decay: d = min(this, 0.001 * optimizer steps)"""
    burn_in_iterations: int = 0
    """iterations that neither sample nor train at the start (the released code: 2)"""
    # ---- optimizer
    num_iterations: int = 18
    """rollout + update iterations (0 = only evaluate the starting model)"""
    learning_rate: float = 1e-3
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
    """timesteps trained per image: train_timesteps"""

    def wants_reference(self) -> bool:
        return self.kl_weight > 0  # the base KL's reference forward (E10)


def check_args(args: Args, world_size: int) -> None:
    """Flag ranges and batch arithmetic, checked before any model is loaded. Every message says what
    to change. --train-batch-size counts images here (each trains at --train-timesteps rows)."""
    check_ranges(args)  # common/plumbing/checks.py: the numeric flags the scripts share
    check_parallel(args, world_size)  # common/plumbing/parallel.py: --parallel fsdp needs torchrun
    split_batch(args, world_size)  # common/plumbing/harness.py: images per iteration and per rank
    check_flag(args, "std_eps", Rule(0, lo_open=True, why="a group of equal rewards has std 0"))
    check_flag(args, "advantage_max", Rule(0, lo_open=True, why="the clipped advantage's scale"))
    check_flag(args, "train_timesteps", Rule(1, integer=True, why="timestep strata per image"))
    check_flag(args, "ghuber_power", Rule(0, 1, lo_open=True, why="ghuber's l^p: 0 < p <= 1"))
    check_flag(args, "kl_weight", Rule(0, why="weight of the KL to the base model; 0 = none"))
    check_flag(args, "ema_kl_weight", Rule(0, why="weight of the KL to the fast EMA; 0 = none"))
    check_flag(args, "kl_ema_decay", Rule(0, 1, hi_open=True, why="the fast EMA's largest decay"))
    check_flag(args, "burn_in_iterations", Rule(0, integer=True, why="iterations that skip all"))
    lo, hi = args.noise_window
    if not 0 <= lo <= hi <= 1:
        raise ConfigError(
            f"--noise-window {lo} {hi}: need 0 <= LO <= HI <= 1 (sigmas of the steps that get "
            "noise); the released window is 0.3 0.9"
        )
    top = int(args.num_steps * args.timestep_fraction)  # the strata's grid indices lie below it
    if top <= (args.time_type == "discrete_wo_init"):
        raise ConfigError(
            f"--timestep-fraction {args.timestep_fraction} of --num-steps {args.num_steps} leaves "
            f"no grid index to train (int(num_steps * fraction) = {top}; --time-type "
            f"{args.time_type} needs it above {int(args.time_type == 'discrete_wo_init')}); "
            "raise either"
        )
    args.trained_steps = args.train_timesteps
    if args.optimizer_steps_per_iteration > args.images_per_rank:
        raise ConfigError(
            f"--optimizer-steps-per-iteration {args.optimizer_steps_per_iteration}: each rank "
            f"trains {args.images_per_rank} images per iteration, too few for that many steps; "
            f"use at most {args.images_per_rank}"
        )


# ALGO LOGIC: the rollout's noise (E2), the advantage (E5-E6), the timesteps (E1), the loss (E3-E4)
def step_noise(sigmas: torch.Tensor, tau: float, window: tuple[float, float]) -> list[float]:
    """Flow-GRPO's noise level a of each rollout step: sqrt(2) tau where the step lands in the
    window, 0 (the Euler step) elsewhere. Why sqrt(2): the released SA-Solver's tau scales the
    reverse-time SDE's diffusion, g = sqrt(2 sigma / (1 - sigma)) for x = (1 - sigma) x_0 + sigma
    eps (tau = 1: the reverse SDE, tau = 0: the ODE), and common/sampler.py's SDE has std_dev_t = a
    sqrt(sigma / (1 - sigma)): the same SDE at a = sqrt(2) tau (tests/test_awm.py checks the
    per-step variances agree). Released: `lambda t: noise_level if 0.3 <= t <= 0.9 else 0`, t the
    time the step lands on."""
    lo, hi = window
    return [math.sqrt(2) * tau if lo <= float(s) <= hi else 0.0 for s in sigmas[1:]]


def advantage_weight(advantages: torch.Tensor, adv_clip_max: float, advantage_max: float):
    """(E6) A_hat = clip(A, -A_max, A_max) / A_max * advantage_max: one signed linear weight per
    image, in [-1, 1] as released (no exp, no separate branches for good and bad images)."""
    return advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max


def timestep_strata(args: Args, u: torch.Tensor) -> torch.Tensor:
    """The grid index of each of the train_timesteps strata, from u [strata] uniform in [0, 1): one
    draw per stratum, shared by every image of a micro-batch (released `discrete_wo_init` /
    `discrete`): the boundaries linspace(first, int(num_steps * fraction), strata + 1) cut to
    integers, and in each stratum [lower, upper) the index lower + int(u (upper - lower)). 14 steps,
    fraction 0.9, from index 1: boundaries 1, 2, 4, 6, 8, 10, 12, so {1}, {2, 3}, {4, 5}, {6, 7},
    {8, 9}, {10, 11}: sigma = 1 and the last two steps are never trained. With fewer indices than
    strata, strata repeat an index (as released)."""
    first = 1 if args.time_type == "discrete_wo_init" else 0
    top = int(args.num_steps * args.timestep_fraction)
    boundaries = torch.linspace(first, top, args.train_timesteps + 1, device=u.device)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    return lower + (u * (upper - lower)).long()


def matching_logprob(v, x0, eps, t, weighting: str, power: float) -> torch.Tensor:
    """(E3-E4) AWM's log-likelihood surrogate of each row [N], in float64 as released: minus the
    per-row mean squared error of v_theta against the flow-matching target eps - x_0, weighted.
    ghuber (released default) down-weights large errors (its gradient is t l^(p - 1) grad l) and
    weights late, noisy timesteps (large t) more. t broadcasts against x0 ([N, 1, ...])."""
    dims = tuple(range(1, x0.ndim))
    err = ((v.double() - (eps.double() - x0.double())) ** 2).mean(dims)  # l (E3)
    t = t.reshape(-1)  # as released, t keeps its dtype (float32: t**2 is rounded there)
    if weighting == "Uniform":
        return -err
    if weighting == "t":
        return -err * t
    if weighting == "t**2":
        return -err * t**2
    if weighting == "huber":  # 1e-5 = sqrt(1e-10): 0 at l = 0
        return -(torch.sqrt(err + 1e-10) - 1e-5) * t
    return -((err + 1e-10) ** power - 1e-10**power) * t / power  # ghuber


def velocity_kl(v, v_other) -> torch.Tensor:
    """(E10, E11) the released "Uniform" KL of each row [N]: mean over elements (v - v_other)^2,
    float64. v_other is computed without gradient."""
    return ((v.double() - v_other.double()) ** 2).mean(tuple(range(1, v.ndim)))


def awm_loss(v, x0, eps, t, adv, v_ref, v_ema, args: Args):
    """The loss of each (timestep, image) row [N] and its parts: (total, policy, kl, ema_kl).
    v: v_theta (with gradient) at x_t = (1 - t) x0 + t eps; v_ref, v_ema: the base model's and the
    fast EMA's velocities at the same x_t (no gradient; None when their weight is 0); adv: A_hat
    [N]; t broadcasts against x0 ([N, 1, ...])."""
    lp = matching_logprob(v, x0, eps, t, args.weighting, args.ghuber_power)  # (E3-E4)
    # (E7-E9) The released loss is PPO's max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) with
    # rho = exp(lp - lp_old) and lp_old = lp.detach() taken from this same forward (on-policy: one
    # optimizer step per epoch, no pass before it). So rho is exactly 1 and inside every clip range:
    # both branches are -A rho, the clip never bites (released clip_range = 1: "currently not work
    # (on policy)"), and the gradient is -A grad lp. We write that gradient's loss directly, with no
    # ratio.
    policy_loss = -adv * lp
    zero = torch.zeros_like(policy_loss)
    kl = zero if v_ref is None else velocity_kl(v, v_ref)  # (E10)
    ema_kl = zero if v_ema is None else velocity_kl(v, v_ema)  # (E11)
    return policy_loss + args.kl_weight * kl + args.ema_kl_weight * ema_kl, policy_loss, kl, ema_kl


def anchor_decay(step: int, cap: float) -> float:
    """(E12) d of the fast EMA after `step` optimizer steps in all: min(cap, 0.001 step), 0 -> 0.3
    over the first 300 steps, so the anchor stays within a few steps of theta ("mimic TRPO"). The
    released kl_ema_decay_type "linear"."""
    return min(cap, 0.001 * step)


# ALGO LOGIC: the rollout. As diffusionnft.py's (groups spread over the ranks, seeded by the
# iteration), sampled by the current policy with the noise window, and only x_0 and A_hat kept.
def rollout(h: Harness, args: Args, sigmas: torch.Tensor, iteration: int, timer) -> Rollout:
    """Sample G images per prompt with the current policy (E2), score them, and give each its
    clipped, scaled advantage (E5-E6). Returns a Rollout whose `transitions` holds AWM's rows, one
    per image (x0 [n, ...], adv [n], prompt_index [n]): AWM has no transitions (no step, log-prob
    or ratio), so check_transitions does not apply."""
    with timer("rollout"):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
        prompt_ids = torch.randint(len(h.train_prompts), (args.groups_per_iteration,), generator=g)
        group = torch.arange(args.groups_per_iteration).repeat_interleave(args.group_size)
        group = group[torch.randperm(len(group), generator=g)]  # group of every image, global order
        mine = slice(h.rank * args.images_per_rank, (h.rank + 1) * args.images_per_rank)
        prompts = [h.train_prompts[prompt_ids[k]] for k in group[mine]]
        emb = h.backbone.encode(prompts)
        seed = args.seed * 1_000_003 + iteration * 1009 + h.rank  # the rank's own noise
        gen = torch.Generator(h.device).manual_seed(seed)
        noise = step_noise(sigmas, args.noise_level, args.noise_window)
        latents, pending = [], []
        with torch.no_grad():  # (E2): the policy itself samples (on-policy)
            for b in range(0, args.images_per_rank, args.rollout_batch_size):
                x = h.backbone.initial_noise(
                    args.rollout_batch_size, args.resolution, args.resolution, generator=gen
                )
                for j in range(args.num_steps):
                    v = h.backbone.velocity(
                        x, sigmas[j], emb[b : b + args.rollout_batch_size], args.guidance_scale
                    )
                    # noise 0 outside the window: the exact Euler step of the ODE (sampler E1)
                    x, *_ = sde_step_with_logprob(
                        v, x, sigmas[j], sigmas[j + 1], noise[j], generator=gen, sigma_max=sigmas[1]
                    )
                latents.append(x)
                # a remote reward scores this batch while the next one samples
                image = h.backbone.decode(x, args.resolution, args.resolution)
                pending.append(h.reward_model.submit(image, prompts[b : b + len(x)]))
    with timer("reward"):
        scores = h.reward_model.gather(pending)  # [n, R]: one column per reward
        all_scores = all_gather_cat(scores.to(h.device), h.world_size).cpu()  # rank-major = global
        check_finite("reward", iteration, all_scores)
        mixed = h.reward_model.mix(all_scores)
        advantages = group_advantages(mixed, group, args.global_std, args.std_eps)  # (E5)
        adv = advantage_weight(advantages, args.adv_clip_max, args.advantage_max)  # (E6)
        n = args.images_per_rank
        samples = {"x0": torch.cat(latents), "adv": adv[mine], "prompt_index": torch.arange(n)}
    groups = torch.stack([mixed[group == k] for k in range(args.groups_per_iteration)])
    metrics = group_reward_metrics(groups)  # [groups, G] rewards
    metrics.update(
        {
            "train/adv_abs_mean": adv.abs().mean().item(),
            "train/adv_clipped_frac": (advantages.abs() > args.adv_clip_max).float().mean().item(),
        }
    )
    counts = {"trajectories": n, "scored_images": n, "nfe/rollout": n * args.num_steps}
    return Rollout(samples, emb, prompts, counts, metrics)


def awm_stats(args: Args) -> Stats:
    """The training section's metrics, per trained timestep: the policy loss (-A_hat lp), the base
    KL, the fast EMA's KL and the unweighted matching loss l (is the policy still fitting its own
    images?), at their value when nothing trained. AWM has no ratio to log."""
    return Stats(args.num_steps, kl=0, policy_loss=0, ema_kl=0, matching_loss=0)


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
    # (E11-E12) the fast EMA, the KL anchor: a copy of the trained weights that follows them once
    # per iteration (the released code keeps it as a second LoRA adapter, "ema"); swapped into the
    # trained parameters for v_ema. Kept (and saved) whatever --ema-kl-weight.
    anchor = EMA(h.params, decay=0.0, interval=1, warmup=False)  # starts as a copy of theta
    # fp16: dynamic loss scaling (torch.amp), as the released code's GradScaler; otherwise a no-op
    scaler = torch.amp.GradScaler(h.device.type, enabled=h.backbone.dtype == torch.float16)
    # the EMA; with --resume, the saved weights, optimizer, scale, RNG, counters and the anchor
    run = h.start(optimizer, scaler, extra_state={"kl_anchor": anchor})
    sigmas = h.backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)

    for iteration in range(run.start_iteration, args.num_iterations + 1):
        metrics = {"iteration": iteration}
        last = run.is_last(iteration)  # --num-iterations reached, or the CPU budget spent
        if iteration % args.eval_every == 0 or last:
            metrics.update(run.evaluate(iteration, last))  # held-out accuracy, sample grid
        if last:
            run.log_final(metrics)
            break
        if iteration < args.burn_in_iterations:
            # the released epochs 0 and 1 draw their prompts and skip sampling and training: "the
            # group size collected in the first two epochs has a bug, after two epochs, the
            # group_size stabilizes" (train_sd3_awm.py). Here every group has G images from the
            # start; the flag reproduces the released schedule, not a fix.
            run.log(metrics, awm_stats(args), Rollout({}, None, [], {}, {}))
            continue

        # sample with the current policy, score, A_hat
        ro = rollout(h, args, sigmas, iteration, run.timer)

        # ============================ TRAINING on the forward process (AWM: no transitions) =======
        # ALGO LOGIC: micro-batches of images; each draws one grid index per stratum, shared by its
        # images, and fresh noise per (timestep, image) (E1), reused by the policy, base and EMA
        # forwards; the weighted matching loss times -A_hat (E3-E4, E7-E9) and the two KLs
        # (E10-E11), their mean over the optimizer step's (timestep, image) rows; backward, clip,
        # step. Then the fast EMA follows theta (E12).
        samples = {k: v.to(h.device) for k, v in ro.transitions.items()}  # x0, adv, prompt_index
        T, sigma_of = args.train_timesteps, sigmas.to(h.device)
        train_seed = args.seed * 1_000_003 + iteration * 1009 + h.rank + 500  # the rollout's + 500
        gen = torch.Generator(h.device).manual_seed(train_seed)  # the training noise's own stream
        stats = awm_stats(args)
        # the images in a random order, cut into the optimizer steps (CleanRL's minibatches): every
        # rank has as many images, so each runs as many micro-batches and the ranks' means weigh
        # alike
        images_of_steps = (
            torch.randperm(args.images_per_rank)
            .to(h.device)
            .tensor_split(args.optimizer_steps_per_iteration)
        )
        for step_images in images_of_steps:
            micro = step_images.split(args.train_batch_size)
            for k, images in enumerate(micro):
                # T x B rows, timestep-major as released: row k * B + i is image i at stratum k
                B = len(images)
                u = torch.rand(T, generator=gen, device=h.device)  # one draw per stratum
                step_index = timestep_strata(args, u).repeat_interleave(B)
                i = images.repeat(T)
                x0, adv = samples["x0"][i], samples["adv"][i]
                emb = ro.emb[samples["prompt_index"][i]]
                sigma = sigma_of[step_index]
                t = sigma.view(-1, *[1] * (x0.ndim - 1))
                eps = torch.randn(x0.shape, generator=gen, device=h.device)
                x_t = (1 - t) * x0 + t * eps  # (E1) the forward process
                # DDP: only the step's last micro-batch all-reduces the gradient (nanoGPT's line)
                h.policy.require_backward_grad_sync = k == len(micro) - 1
                v = h.backbone.velocity(x_t, sigma, emb, args.guidance_scale, model=h.policy)
                v_ref = v_ema = None  # a weight of 0: no forward (the released code crashes)
                if args.kl_weight > 0:  # (E10) the base model: the LoRA off
                    with torch.no_grad():
                        v_ref = h.backbone.velocity(
                            x_t, sigma, emb, args.guidance_scale, model=h.trainable.reference
                        )
                # (E11) the fast EMA, at the same x_t (released: only if beta > 0)
                if args.ema_kl_weight > 0:
                    with torch.no_grad(), anchor.swapped():
                        v_ema = h.backbone.velocity(x_t, sigma, emb, args.guidance_scale)
                row_loss, policy_loss, kl, ema_kl = awm_loss(v, x0, eps, t, adv, v_ref, v_ema, args)
                # each image's mean over its T rows; their mean over the optimizer step's images:
                # the released mean over (timestep, image) rows
                loss = row_loss.view(T, B).mean(0).sum() / len(step_images)
                # l unweighted (E3): is the policy still fitting its own images?
                l_plain = -matching_logprob(v.detach(), x0, eps, t, "Uniform", args.ghuber_power)
                w = torch.ones_like(policy_loss)
                stats.add(
                    w,
                    step_index,
                    policy_loss=policy_loss,
                    kl=kl,
                    ema_kl=ema_kl,
                    matching_loss=l_plain,
                )
                forwards = T * B * (1 + (args.kl_weight > 0) + (args.ema_kl_weight > 0))
                stats.count(**{"nfe/train_forward": forwards, "nfe/train_backward": T * B})
                scaler.scale(loss).backward()  # fp16: scaled up, so the gradient does not underflow
            # the torch.amp recipe: unscale, clip, step (skipped on an fp16 overflow), update
            scaler.unscale_(optimizer)  # fp16: the true gradient, before the clip sees it
            grad_norm = torch.nn.utils.clip_grad_norm_(h.params.values(), args.max_grad_norm)
            run.check_gradient(grad_norm, stats)  # non-finite: an fp16 skip, else a stop here
            scaler.step(optimizer)  # no update when fp16's scaled gradient overflowed
            scaler.update()  # fp16: the scale halves after an overflow, grows when clean
            optimizer.zero_grad(set_to_none=True)
            run.after_step(grad_norm)  # every weight finite; the EMA follows a step taken
        # (E12) the fast EMA follows theta, once per iteration, with the decay of the optimizer
        # steps taken so far: anchor <- d anchor + (1 - d) theta
        trained = iteration + 1 - args.burn_in_iterations  # iterations that updated theta
        steps_so_far = trained * args.optimizer_steps_per_iteration
        anchor.decay = anchor_decay(steps_so_far, args.kl_ema_decay)
        anchor.update()
        # ============================================ END OF TRAINING =============================

        run.log(metrics, stats, ro)  # one metrics.jsonl row: the rollout's and the training's
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.num_iterations:
            run.checkpoint(iteration + 1)  # with the fast EMA

    run.finish()
