"""DiffusionNFT: online RL on the forward process (Zheng et al. 2025, arXiv 2509.16117, ICLR 2026;
released code NVlabs/DiffusionNFT, scripts/train_nft_sd3.py).

1. The OLD policy theta_old samples G images per prompt with any deterministic solver (the released
   one: a second-order multistep solver, common/sampler.py E8); only the clean latent x_0 and its
   reward are kept: no trajectory, no log-prob, no ratio.
2. Advantage A = (reward - group mean) / global std, clipped to [-A_max, A_max], mapped to an
   optimality weight r = clip(A / (2 A_max) + 1/2, 0, 1) (r = 1/2: an average image).
3. Training on the forward process at the sampler's timesteps: x_t = (1 - t) x_0 + t eps, and the
   flow-matching loss of two implicit policies built from v_theta and v_old, r on the positive one
   and 1 - r on the negative one, plus a small velocity KL to the LoRA-off model. Then theta_old
   follows theta by an EMA whose decay rises on a schedule.
The equations (labelled N1-N7 here, as common/sampler.py labels E1-E8; docs/diffusionnft.md sets
them beside the paper's and the released code's):
  (N1) x_0 ~ pi_old(. | c): a deterministic solver under the old weights (released: the "old"
       adapter, dpm2, 10 steps, no CFG)
  (N2) r = 1/2 + 1/2 clip(A / A_max, -1, 1),  A = (R - mean_group R) / (std_all R + eps)
  (N3) x_t = (1 - t) x_0 + t eps,  v* = eps - x_0  (fresh eps; t among the sampler's timesteps)
  (N4) v+ = beta v_theta + (1 - beta) v_old,   v- = (1 + beta) v_old - beta v_theta   ((v+ + v-)/2
       = v_old: the two policies are mirror images about the old one)
  (N5) the paper's form: L = r |v+ - v*|^2 + (1 - r) |v- - v*|^2   (means over elements, per image)
       released (--loss-form x0): x0+- = x_t - t v+-, each squared error divided by its
       stop-gradient mean |x0+- - x_0| (clipped at 1e-5), L = A_max (r L+ + (1 - r) L-) / beta
  (N6) + kl_weight |v_theta - v_ref|^2,  v_ref = the model with its LoRA off
  (N7) theta_old <- d theta_old + (1 - d) theta after each iteration's update, d = min(0.001 s,
       0.5) at optimizer step s (released); the OCR config delays it; d = 0 copies theta
No transitions: NFT keeps one row per image, so it shares the GRPO scripts' rollout plumbing
(prompts, groups, seeds, rewards, group advantages) but not their training section (no log-prob,
no ratio, no check_transitions). Docs: docs/diffusionnft.md.  Run: `python diffusionnft.py` (toy
world, CPU, minutes, no downloads) or `torchrun --nproc_per_node 8 diffusionnft.py --model-path
DIR ...` (see the docs for the paper preset). The shared flags and the set-up are in
common/plumbing/harness.py.
"""

from __future__ import annotations

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
from common.sampler import dpm2_step, ode_step


@dataclass
class Args(HarnessArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # ---- rollout
    num_steps: int = 10
    """denoising steps T of the rollout's sigma schedule"""
    solver: Literal["dpm2", "euler"] = "dpm2"
    """deterministic rollout sampler: second-order multistep (dpm2), or the Euler ODE"""
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
    """A_max: advantages are clipped to [-A_max, A_max], then mapped to r in [0, 1]"""
    # ---- the NFT loss
    timestep_fraction: float = 0.5
    """each image trains on int(num_steps * fraction) of the sampler's timesteps, drawn anew"""
    nft_beta: float = 1.0
    """beta: how far the implicit policies v+ and v- reach from v_old towards v_theta"""
    loss_form: Literal["velocity", "x0"] = "x0"
    """the paper's velocity loss, or the released x0 loss with adaptive weights"""
    kl_weight: float = 0.0
    """weight of |v_theta - v_ref|^2, v_ref the model without LoRA (0 = no reference forward)"""
    old_decay_schedule: Literal["released", "delayed", "copy"] = "released"
    """decay d of the old policy's EMA: the released rising schedule, the delayed one, or 0"""
    # ---- optimizer
    num_iterations: int = 20
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
    """L, timesteps trained per image"""

    def wants_reference(self) -> bool:
        return self.kl_weight > 0  # the KL term's reference forward (N6)


def check_args(args: Args, world_size: int) -> None:
    """Flag ranges and batch arithmetic, checked before any model is loaded. Every message says what
    to change."""
    check_ranges(args)  # common/plumbing/checks.py: the numeric flags the scripts share
    check_parallel(args, world_size)  # common/plumbing/parallel.py: --parallel fsdp needs torchrun
    split_batch(args, world_size)  # common/plumbing/harness.py: images per iteration and per rank
    check_flag(args, "std_eps", Rule(0, lo_open=True, why="a group of equal rewards has std 0"))
    check_flag(
        args,
        "nft_beta",
        Rule(0, lo_open=True, why="beta = 0 makes v+ = v- = v_old: no gradient (x0 form: / 0)"),
    )
    check_flag(args, "kl_weight", Rule(0, why="weight of the velocity KL; 0 = none"))
    args.trained_steps = int(args.num_steps * args.timestep_fraction)
    if args.trained_steps < 1:
        raise ConfigError(
            f"--timestep-fraction {args.timestep_fraction} trains {args.trained_steps} of "
            f"{args.num_steps} timesteps per image; it must train at least one"
        )
    rows = args.images_per_rank * args.trained_steps
    if args.optimizer_steps_per_iteration > rows:
        raise ConfigError(
            f"--optimizer-steps-per-iteration {args.optimizer_steps_per_iteration}: each rank "
            f"trains {rows} (image, timestep) rows per iteration, too few for that many steps; "
            f"use at most {rows}"
        )


def optimality_weight(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """(N2) r = clip(A, -A_max, A_max) / (2 A_max) + 1/2, in [0, 1]: the weight of the positive
    policy's term (1 - r: the negative's). r = 1/2 for an image at its group's mean."""
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (advantages / (2 * adv_clip_max) + 0.5).clamp(0, 1)


# ALGO LOGIC: the old policy theta_old, which samples and gives v_old (N1, N4, N7)
class OldPolicy(EMA):
    """theta_old: a copy of the trained weights that follows them after each iteration's update,
    old <- d old + (1 - d) theta (N7; the released code keeps it as a second LoRA adapter, "old").
    `swapped()` (EMA's) puts it into the trained parameters for a block: the rollout and v_old."""

    def __init__(self, params: dict):
        super().__init__(params, decay=0.0, interval=1, warmup=False)  # starts as a copy of theta

    def follow(self, d: float) -> None:
        self.decay = d
        self.update()  # shadow <- shadow + (1 - d) (theta - shadow)


def old_decay(schedule: str, step: int) -> float:
    """d after `step` optimizer steps in all (N7): the released return_decay's decay types 1
    ("released", the paper's configs), 2 ("delayed", the OCR config) and 0 ("copy")."""
    if schedule == "copy":
        return 0.0
    flat, rate, cap = (0, 0.001, 0.5) if schedule == "released" else (75, 0.0075, 0.999)
    return 0.0 if step < flat else min((step - flat) * rate, cap)


# ALGO LOGIC: the rollout. As flowgrpo_baseline.py's (groups spread over the ranks, seeded by the
# iteration), with a deterministic solver under the old weights, and only x_0 and r kept.
def rollout(h: Harness, args: Args, sigmas, iteration: int, timer, old: OldPolicy) -> Rollout:
    """Sample G images per prompt with the old policy's ODE (N1), score them, and give each its
    optimality weight r (N2). The Rollout's `transitions` holds NFT's rows, one per image (x0, r,
    prompt_index): NFT has no step, log-prob or ratio, so check_transitions does not apply."""
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
        latents, pending = [], []
        with torch.no_grad(), old.swapped():  # (N1): the old policy samples
            for b in range(0, args.images_per_rank, args.rollout_batch_size):
                x = h.backbone.initial_noise(
                    args.rollout_batch_size, args.resolution, args.resolution, generator=gen
                )
                x0_hat = None  # dpm2's previous prediction of the clean latent
                for j in range(args.num_steps):
                    v = h.backbone.velocity(
                        x, sigmas[j], emb[b : b + args.rollout_batch_size], args.guidance_scale
                    )
                    if args.solver == "dpm2":  # the released solver (E8)
                        x, x0_hat = dpm2_step(v, x, sigmas, j, x0_hat)
                    else:  # the Euler ODE (E1)
                        x = ode_step(v, x, sigmas[j], sigmas[j + 1])
                latents.append(x)
                # a remote reward scores this batch while the next one samples
                image = h.backbone.decode(x, args.resolution, args.resolution)
                pending.append(h.reward_model.submit(image, prompts[b : b + len(x)]))
    with timer("reward"):
        scores = h.reward_model.gather(pending)  # [n, R]: one column per reward
        all_scores = all_gather_cat(scores.to(h.device), h.world_size).cpu()  # rank-major = global
        check_finite("reward", iteration, all_scores)
        mixed = h.reward_model.mix(all_scores)
        advantages = group_advantages(mixed, group, args.global_std, args.std_eps)
        r = optimality_weight(advantages, args.adv_clip_max)  # (N2)
        n = args.images_per_rank
        samples = {"x0": torch.cat(latents), "r": r[mine], "prompt_index": torch.arange(n)}
    groups = torch.stack([mixed[group == k] for k in range(args.groups_per_iteration)])
    metrics = group_reward_metrics(groups)  # [groups, G] rewards
    metrics["train/r_mean"] = r.mean().item()
    metrics["train/r_abs_dev"] = (r - 0.5).abs().mean().item()
    counts = {"trajectories": n, "scored_images": n, "nfe/rollout": n * args.num_steps}
    return Rollout(samples, emb, prompts, counts, metrics)


# ALGO LOGIC: the NFT loss of a batch of (image, timestep) rows
def implicit_policies(v, v_old, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(N4) v+ and v-: v_old moved by beta (v_theta - v_old) towards v_theta, and as far away from
    it. Their mean is v_old for every beta (exactly, up to rounding)."""
    v_pos = beta * v + (1 - beta) * v_old  # implicit positive policy
    v_neg = (1 + beta) * v_old - beta * v  # implicit negative policy
    return v_pos, v_neg


def nft_loss(v, v_old, x0, eps, t, r, args) -> torch.Tensor:
    """The policy loss of each row [B] (N5), to be minimised. v: v_theta (with gradient), v_old:
    the old policy's velocity (no gradient), at x_t = (1 - t) x0 + t eps; t broadcasts against x0
    ([B, 1, ...]); r [B]. The KL term (N6) is added by the caller."""
    dims = tuple(range(1, x0.ndim))
    v_pos, v_neg = implicit_policies(v, v_old, args.nft_beta)
    if args.loss_form == "velocity":  # (N5) the paper's: regress both on v* = eps - x0
        v_target = eps - x0
        loss_pos = ((v_pos - v_target) ** 2).mean(dims)
        loss_neg = ((v_neg - v_target) ** 2).mean(dims)
        return r * loss_pos + (1 - r) * loss_neg
    # (N5) the released code's: the same regression in x_0 space, x0+- = x_t - t v+-, each term
    # divided by its stop-gradient mean absolute error (adaptive weighting, in float64 as released);
    # then / beta and * A_max
    x_t = (1 - t) * x0 + t * eps
    loss = []
    for v_pm in (v_pos, v_neg):
        x0_pm = x_t - t * v_pm
        with torch.no_grad():
            w = (x0_pm.double() - x0.double()).abs().mean(dims, keepdim=True).clip(min=1e-5)
        loss.append(((x0_pm - x0) ** 2 / w).mean(dims))
    return args.adv_clip_max * (r * loss[0] + (1 - r) * loss[1]) / args.nft_beta


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
    old = OldPolicy(h.params)  # (N7) theta_old = theta at the start
    # fp16: dynamic loss scaling (torch.amp), as the released code's GradScaler; otherwise a no-op
    scaler = torch.amp.GradScaler(h.device.type, enabled=h.backbone.dtype == torch.float16)
    # the EMA; with --resume, the saved weights, optimizer, scale, RNG, counters and old policy
    run = h.start(optimizer, scaler, extra_state={"old_policy": old})
    sigmas = h.backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)

    for iteration in range(run.start_iteration, args.num_iterations + 1):
        metrics = {"iteration": iteration}
        last = run.is_last(iteration)  # --num-iterations reached, or the CPU budget spent
        if iteration % args.eval_every == 0 or last:
            metrics.update(run.evaluate(iteration, last))  # held-out accuracy, sample grid
        if last:
            run.log_final(metrics)
            break

        # sample with the old policy, score, r
        ro = rollout(h, args, sigmas, iteration, run.timer, old)

        # ============================ TRAINING on the forward process (NFT: no transitions) =======
        # ALGO LOGIC: every image trains at L of the sampler's timesteps, fresh noise at each (N3);
        # v_old under the old weights, v_theta with gradient; the NFT loss (N4-N5) and the KL (N6),
        # their mean over the optimizer step's rows; backward, clip, step. Then theta_old follows
        # theta (N7).
        samples = {k: v.to(h.device) for k, v in ro.transitions.items()}  # x0, r, prompt_index
        n, L = args.images_per_rank, args.trained_steps
        sigma_of = sigmas.to(h.device)
        train_seed = args.seed * 1_000_003 + iteration * 1009 + h.rank + 500  # the rollout's + 500
        gen = torch.Generator(h.device).manual_seed(train_seed)  # the training noise's own stream
        # each image trains at L of the T timesteps, drawn without replacement (a random order)
        order = torch.rand(n, args.num_steps, generator=gen, device=h.device).argsort(1)
        step_index = order[:, :L].flatten()  # row i * L + k: image i's k-th timestep
        image = torch.arange(n, device=h.device).repeat_interleave(L)
        # the iteration's metrics, per trained timestep; the means it logs, at their value untrained
        stats = Stats(args.num_steps, kl=0, policy_loss=0, old_deviation=0)
        # the rows in a random order, cut into the optimizer steps (CleanRL's minibatches): every
        # rank has n * L rows, so each runs as many micro-batches and the ranks' means weigh alike
        shuffled = torch.randperm(n * L).to(h.device)
        for step_rows in shuffled.tensor_split(args.optimizer_steps_per_iteration):
            micro = step_rows.split(args.train_batch_size)
            for k, rows in enumerate(micro):
                i, j = image[rows], step_index[rows]
                x0, r = samples["x0"][i], samples["r"][i]
                emb = ro.emb[samples["prompt_index"][i]]
                sigma = sigma_of[j]
                t = sigma.view(-1, *[1] * (x0.ndim - 1))
                eps = torch.randn(x0.shape, generator=gen, device=h.device)
                x_t = (1 - t) * x0 + t * eps  # (N3) the forward process
                # DDP: only the step's last micro-batch all-reduces the gradient (nanoGPT's line)
                h.policy.require_backward_grad_sync = k == len(micro) - 1
                with torch.no_grad(), old.swapped():  # (N4) v_old, under the old weights
                    v_old = h.backbone.velocity(x_t, sigma, emb, args.guidance_scale)
                v = h.backbone.velocity(x_t, sigma, emb, args.guidance_scale, model=h.policy)
                policy_loss = nft_loss(v, v_old, x0, eps, t, r, args)  # (N4-N5)
                kl = torch.zeros_like(policy_loss)  # kl_weight = 0: no KL, no reference forward
                if args.kl_weight > 0:  # (N6) the velocity KL to the LoRA-off model
                    with torch.no_grad():
                        v_ref = h.backbone.velocity(
                            x_t, sigma, emb, args.guidance_scale, model=h.trainable.reference
                        )
                    kl = ((v - v_ref) ** 2).mean(tuple(range(1, v.ndim)))
                # the mean over the optimizer step's rows
                loss = (policy_loss + args.kl_weight * kl).sum() / len(step_rows)
                # NFT's own diagnostic: how far theta has moved from the policy that sampled
                deviation = ((v.detach() - v_old) ** 2).mean(tuple(range(1, v.ndim)))
                w = torch.ones_like(policy_loss)
                stats.add(w, j, policy_loss=policy_loss, kl=kl, old_deviation=deviation)
                forwards = len(rows) * (3 if args.kl_weight > 0 else 2)  # v, v_old (and v_ref)
                stats.count(**{"nfe/train_forward": forwards, "nfe/train_backward": len(rows)})
                scaler.scale(loss).backward()  # fp16: scaled up, so the gradient does not underflow
            # the torch.amp recipe: unscale, clip, step (skipped on an fp16 overflow), update
            scaler.unscale_(optimizer)  # fp16: the true gradient, before the clip sees it
            grad_norm = torch.nn.utils.clip_grad_norm_(h.params.values(), args.max_grad_norm)
            run.check_gradient(grad_norm, stats)  # non-finite: an fp16 skip, else a stop here
            scaler.step(optimizer)  # no update when fp16's scaled gradient overflowed
            scaler.update()  # fp16: the scale halves after an overflow, grows when clean
            optimizer.zero_grad(set_to_none=True)
            run.after_step(grad_norm)  # every weight finite; the EMA follows a step taken
        # (N7) theta_old follows theta, with the decay of the optimizer steps taken so far
        steps_so_far = (iteration + 1) * args.optimizer_steps_per_iteration
        old.follow(old_decay(args.old_decay_schedule, steps_so_far))
        # ============================================ END OF TRAINING =============================

        run.log(metrics, stats, ro)  # one metrics.jsonl row: the rollout's and the training's
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.num_iterations:
            run.checkpoint(iteration + 1)  # with the old policy

    run.finish()
