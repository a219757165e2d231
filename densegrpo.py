"""DenseGRPO: Flow-GRPO with a step-wise dense reward (Deng et al. 2026, arXiv 2601.20218,
ICLR 2026).

1. Dense reward: from every latent x_t of an SDE trajectory run the deterministic ODE to a clean
   image and score it (R_t, Eq. 8-9); the step x_t -> x_{t-1} earns DeltaR_t = R_{t-1} - R_t
   (Eq. 7). All completions of all trajectories run batched together ("staircase"), one step per
   transformer call with per-sample sigmas.
2. Per-timestep GRPO advantages: normalise DeltaR over each group separately at each timestep
   (Eq. 10), then the Flow-GRPO clipped loss + KL, unchanged.
3. Before training, calibrate a per-timestep noise level psi(t) so that positive and negative DeltaR
   stay balanced (Algorithm 1, Eq. 11); psi is saved as psi.json (and in every checkpoint) and
   reused with --psi-file.
Docs: docs/densegrpo.md.  Run: `python densegrpo.py` (toy world, CPU, minutes, no downloads) or
`torchrun --nproc_per_node 8 densegrpo.py --model-path DIR ...` (see the docs for the paper
presets).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from itertools import product
from typing import Callable, Literal

import torch
import tyro

from common.plumbing.checks import (
    MAX_BATCH,
    ConfigError,
    Rule,
    check_flag,
    check_ranges,
    check_sde_type,
)
from common.plumbing.harness import GRPOArgs, Harness, derived, setup, split_batch
from common.plumbing.parallel import check_parallel
from common.plumbing.psi_file import load_psi, save_psi
from common.plumbing.run import Stats, check_finite, max_over_ranks, sum_over_ranks
from common.plumbing.transitions import GradShare, Rollout, check_transitions
from common.rewards import advantage_mix, all_gather_cat, group_advantages, group_reward_metrics
from common.sampler import gaussian_kl, ode_along_paths, ratio_norm, sde_step_with_logprob


@dataclass
class Args(GRPOArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # ---- rollout
    num_steps: int = 10
    """denoising steps T of the rollout's sigma schedule"""
    noise_level: float = 0.7
    """a: psi(t)'s starting value, and its value without calibration"""
    group_size: int = 8
    """G, images per prompt whose dense rewards are compared"""
    groups_per_iteration: int = 32
    """prompts per iteration, over all ranks"""
    rollout_batch_size: int = 16
    timestep_fraction: float = 0.5
    """train the first int(num_steps * fraction) steps"""
    completion_steps: int | None = 2
    """ODE steps n of each completion (Eq. 8); None = t, the rest of the schedule"""
    completion_batch_size: int = 64
    """completions advanced per transformer call, per rank"""
    # ---- reward and advantage
    reward_mix: Literal["score", "advantage"] = "score"
    """mix several rewards before (score) or after (advantage) the normalisation"""
    global_std: bool = False
    """per timestep, divide by the std of all the iteration's DeltaR, not each group's"""
    std_eps: float = 1e-4
    """added to the std before dividing by it"""
    adv_clip_max: float = 5.0
    """advantages are clipped to [-max, max]"""
    # ---- psi(t), the calibrated noise of each step (Algorithm 1)
    psi_scale: Literal["multiplier", "raw"] = "multiplier"
    """psi(t) is the multiplier a of each step, or its std_dev_t (raw, Eq. 11)"""
    psi_file: str | None = None
    """a psi.json of an earlier run: use its psi(t), skip the calibration"""
    calibration_iterations: int = 12
    """iterations K of Algorithm 1 (0 = psi(t) = --noise-level)"""
    calibration_trajectories: int = 16
    """trajectories N per calibration iteration, over all ranks"""
    calibration_step: float | None = None
    """epsilon_2, psi's largest move per iteration (default: 0.2 share; 0.01 otherwise)"""
    balance_test: Literal["share", "literal", "ratio", "fraction"] = "share"
    """Algorithm 1's update rule (docs/densegrpo.md; literal = the paper's)"""
    balance_threshold: float | None = None
    """e of the balance test (default: 2 literal and ratio, 1/3 fraction)"""
    psi_bounds: tuple[float, float] | None = None
    """psi(t) is clamped to [low, high], in units of a (default: 0 1.5; cps: 0 1)"""
    calibration_average: int = 6
    """psi(t) is the mean of the last this-many calibration iterates"""
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
    """trajectories sampled per iteration over all ranks: groups_per_iteration * group_size"""
    images_per_rank: int = derived()
    """images_per_iteration / world_size"""
    trained_steps: int = derived()
    """L, steps trained per trajectory"""


def check_args(args: Args, world_size: int) -> None:
    """Flag ranges and batch arithmetic, checked before any model is loaded. Every message says what
    to change."""
    check_ranges(args)  # common/plumbing/checks.py: the numeric flags the scripts share
    check_parallel(args, world_size)  # common/plumbing/parallel.py: --parallel fsdp needs torchrun
    split_batch(args, world_size)  # common/plumbing/harness.py: images per iteration and per rank
    args.trained_steps = int(args.num_steps * args.timestep_fraction)
    # (A_i - mean) / (std + eps) is 0 / 0 for a group of equal rewards without eps (the shared table
    # allows 0 for G²RPO)
    check_flag(args, "std_eps", Rule(0, lo_open=True, why="a group of equal rewards has std 0"))
    if not 1 <= args.trained_steps <= args.num_steps:
        raise ConfigError(
            f"--timestep-fraction {args.timestep_fraction} trains {args.trained_steps} of "
            f"{args.num_steps} steps; it must train at least one"
        )
    check_flag(
        args,
        "completion_steps",
        Rule(
            1,
            integer=True,
            optional=True,
            why=(
                "a completion needs at least one ODE step; unset = t, the paper's choice; 1 or 2 = "
                "the cheap variants"
            ),
        ),
    )
    check_flag(
        args, "completion_batch_size", Rule(1, integer=True, why="completions per transformer call")
    )
    if args.balance_threshold is None:
        # paper: epsilon_1 = 2
        args.balance_threshold = 1 / 3 if args.balance_test == "fraction" else 2.0
    if args.calibration_step is None:
        # paper: epsilon_2 = 0.01
        args.calibration_step = 0.2 if args.balance_test == "share" else 0.01
    lo, hi = args.psi_bounds = args.psi_bounds or (0.0, 1.0 if args.sde_type == "cps" else 1.5)
    check_sde_type(
        args, args.trained_steps == args.num_steps, f"--timestep-fraction {args.timestep_fraction}"
    )
    if args.sde_type == "cps" and (hi > 1 or args.psi_scale == "raw"):
        raise ConfigError(
            f"--sde-type cps with --psi-bounds {lo} {hi} and --psi-scale {args.psi_scale}: psi is "
            "CPS's a in sin(a pi / 2) (bounds at most 1, --psi-scale multiplier); raw reads it as "
            "the SDE's std_dev_t"
        )
    if not 0 <= lo <= hi:
        raise ConfigError(
            f"--psi-bounds {lo} {hi}: need 0 <= low <= high (psi enters the SDE squared)"
        )
    if not lo <= args.noise_level <= hi:
        raise ConfigError(
            f"--psi-bounds {lo} {hi} do not contain the start --noise-level {args.noise_level} "
            "(bounds are in units of the multiplier a, also with --psi-scale raw); widen them or "
            "move the start"
        )
    if args.calibration_average < 1:
        raise ConfigError(
            f"--calibration-average {args.calibration_average}: average at least the last iterate"
        )
    calibration = {
        "calibration_iterations": Rule(
            0, integer=True, why="0: no calibration, psi = --noise-level"
        ),
        # sampled together: past MAX_BATCH a typo (10**20 was a traceback after the model loaded)
        "calibration_trajectories": Rule(
            1, MAX_BATCH, integer=True, why="trajectories per calibration iteration"
        ),
        "calibration_step": Rule(
            0, lo_open=True, why="epsilon_2, the largest move of psi per iteration"
        ),
        "balance_threshold": Rule(0, lo_open=True, why="epsilon_1 of the balance test"),
    }
    for name, rule in calibration.items():
        check_flag(args, name, rule)
    if args.psi_file is not None and not os.path.isfile(args.psi_file):
        what = "is a folder" if os.path.isdir(args.psi_file) else "does not exist"
        raise ConfigError(
            f"--psi-file '{args.psi_file}' {what}: pass the psi.json of an earlier run"
        )
    if args.psi_file is not None:
        # its contents, before the model load
        load_psi(args.psi_file, args.num_steps, args.psi_scale, args.sde_type)
    if (
        args.psi_file is None
        and args.calibration_iterations
        and args.calibration_trajectories % world_size
    ):
        raise ConfigError(
            f"--calibration-trajectories {args.calibration_trajectories} cannot be split evenly "
            f"over {world_size} ranks; make it a multiple of {world_size}"
        )


# ALGO LOGIC: psi(t), the noise level of each step (Eq. 11). On the multiplier scale psi is the
# sampler's `noise_level` of that step (std_dev_t = psi sqrt(sigma / (1 - sigma))); on the raw scale
# psi IS std_dev_t, converted back here.
def psi_factor(sigmas: torch.Tensor) -> torch.Tensor:
    """sqrt(sigma / (1 - sigma)) per step; at sigma = 1 the sampler puts sigma_1 in the
    denominator."""
    s = sigmas[:-1]
    return torch.sqrt(s / (1 - torch.where(s == 1, sigmas[1], s)))


def step_noise_levels(psi: torch.Tensor, sigmas: torch.Tensor, scale: str) -> torch.Tensor:
    """The sampler's noise_level of each of the T steps."""
    return psi.float() if scale == "multiplier" else psi.float() / psi_factor(sigmas)


def sample_trajectories(backbone, emb, sigmas, noise_levels, n: int, args, gen):
    """SDE rollout exactly as the baseline's (same generator draws in the same order, so
    psi == noise_level gives the baseline's trajectories), with a noise level per step. Returns
    latents [T+1, n, ...] (index 0 = x_T, pure noise; index T = the SDE's image x_0), the rollout
    policy's log-probs [T, n] and the velocities v(latents[k], sigma_k) [T, n, ...] (kept: each is
    also the first Euler step of the completion from latents[k]) and the steps' means [T, n, ...]
    (the rollout policy's, for --ratio-norm)."""
    fields = ("latents", "log_prob", "velocity", "mean")
    batches = []  # per rollout batch: the four fields, each stacked over the steps
    for b in range(0, n, args.rollout_batch_size):
        m = min(args.rollout_batch_size, n - b)
        x = backbone.initial_noise(m, args.resolution, args.resolution, generator=gen)
        chain = {"latents": [x], "log_prob": [], "velocity": [], "mean": []}
        for j in range(len(sigmas) - 1):
            v = backbone.velocity(x, sigmas[j], emb[b : b + m], args.guidance_scale)
            x, log_prob, mean, _ = sde_step_with_logprob(
                v,
                x,
                sigmas[j],
                sigmas[j + 1],
                float(noise_levels[j]),
                generator=gen,
                sigma_max=sigmas[1],
                sde_type=args.sde_type,
            )
            for name, value in zip(fields, (x, log_prob, v, mean)):
                chain[name].append(value)
        batches.append({name: torch.stack(chain[name]) for name in fields})
    return tuple(torch.cat([c[name] for c in batches], 1) for name in fields)


def completion_grid(num_steps: int, k: int, n: int | None) -> list[int]:
    """Schedule indices of the ODE completion of latent k (paper timestep t = T - k) to sigma = 0
    (Eq. 8). n None: the rollout grid's t remaining steps (the paper's n = t); n < t: the paper's
    timesteps t, (n-1)s, ..., s, 0 with s = floor(t/n) (the first jump takes the remainder); n = 1:
    the one-step x0 prediction. Paper timestep u is index T - u."""
    t = num_steps - k
    m = t if n is None else min(n, t)
    return [k] + [num_steps - j * (t // m) for j in range(m - 1, -1, -1)]


@torch.no_grad()
def dense_rollout(backbone, reward_model, prompts, emb, sigmas, noise_levels, args, gen, upto=None):
    """Sample one SDE trajectory per prompt and score every latent of it (Eq. 8-9): R[:, k] = R(ODE
    completion of latents[k]) for k < T, R[:, T] = R(the SDE's own image). Index k is the paper's
    timestep t = T - k, so R[:, 0] (the paper's R_T) is the plain ODE sample's reward. `upto` L:
    only the first L steps are trained, so only latents 0..L and the SDE image are scored. Returns
    latents, log_prob, mean, scores [n, T+1 (upto None), R], and the NFE and sequential calls of
    sampling and of the completions, {"rollout": .., "completion": ..} (a CFG pair is one)."""
    n, T = len(prompts), len(sigmas) - 1
    latents, log_prob, velocity, mean = sample_trajectories(
        backbone, emb, sigmas, noise_levels, n, args, gen
    )
    # [T]: the SDE image
    grids = [completion_grid(T, k, args.completion_steps) for k in range(T)] + [[T]]
    # A step with psi = 0 is the Euler step (E1) with v(latents[k]), the first step of latents[k]'s
    # completion. Where that completion then goes on along latents[k+1]'s own grid
    # (always for n = t), both are one computation: R_k = R_{k+1}, DeltaR = 0 by definition, and
    # running it again could only add float noise. Not run.
    same = [bool(noise_levels[k] == 0) and grids[k][1:] == grids[k + 1] for k in range(T)]
    # the last latent whose R is needed (a noise-free one's is the next one's)
    last = T if upto is None else upto
    while last < T and same[last]:
        last += 1
    need = [*range(min(last + 1, T)), T]
    completed = [k for k in need[:-1] if not same[k]]  # the latents whose completion runs
    # job m = r * n + i
    paths = [sigmas[grids[k]].to(latents.device) for k in completed for _ in range(n)]
    prompt_of = torch.arange(n).repeat(len(completed))
    # Staircase-batched Euler ODE (common/sampler.py); the first step of each reuses the SDE step's
    # v(x_k, sigma_k).
    clean, nfe, calls = ode_along_paths(
        lambda x, sig, rows: backbone.velocity(x, sig, emb[prompt_of[rows]], args.guidance_scale),
        latents[completed].flatten(0, 1),
        paths,
        args.completion_batch_size,
        first_velocity=velocity[completed].flatten(0, 1),
    )
    # last: the SDE image (index T)
    clean = torch.cat([clean.view(len(completed), *latents.shape[1:]), latents[T:]])
    bs, job_prompts = args.rollout_batch_size, list(prompts) * (len(completed) + 1)  # k-major
    pending = []  # chunk by chunk: a remote reward scores one while the next decodes
    for i, chunk in zip(range(0, len(job_prompts), bs), clean.flatten(0, 1).split(bs)):
        image = backbone.decode(chunk, args.resolution, args.resolution)
        pending.append(reward_model.submit(image, job_prompts[i : i + bs]))
    scores = reward_model.gather(pending).view(len(completed) + 1, n, -1)
    row = {T: len(completed)}  # row of scores holding R_k
    for k in reversed(need[:-1]):
        row[k] = row[k + 1] if same[k] else completed.index(k)
    return {
        "latents": latents,
        "log_prob": log_prob,
        "mean": mean,
        "scores": scores[[row[k] for k in need]].transpose(0, 1),  # [n, len(need), R]
        "nfe": {"rollout": n * T, "completion": nfe},
        "calls": {"rollout": T * math.ceil(n / args.rollout_batch_size), "completion": calls},
    }


# ALGO LOGIC: dense reward (Eq. 7) and per-timestep advantages (Eq. 10).
def dense_step_rewards(R: torch.Tensor) -> torch.Tensor:
    """[N, T+1, ...] latent rewards -> [N, T, ...] step rewards. The step x_t -> x_{t-1} (code
    step j = T - t, from index j to j+1) earns DeltaR_t = R_{t-1} - R_t = R[:, j+1] - R[:, j]. They
    telescope: the sum over the steps of a trajectory is R(its SDE image) - R(the ODE image from its
    initial noise)."""
    return R[:, 1:] - R[:, :-1]


def per_step_advantages(dR: torch.Tensor, group: torch.Tensor, global_std: bool, eps: float):
    """Eq. 10: GRPO normalisation at each timestep on its own, [N, T] -> [N, T]."""
    return torch.stack(
        [group_advantages(dR[:, j], group, global_std, eps) for j in range(dR.shape[1])], 1
    )


# ALGO LOGIC: reward-aware calibration of psi(t) (Algorithm 1). A rule maps the signs of DeltaR_t
# over the N calibration trajectories (#pos, #neg, N) to a move of psi(t) in units of the step
# epsilon_2: +1 up, -1 down, 0 hold.
CALIBRATION_RULES = {
    # default: the lead of one sign among the nonzero DeltaR_t. Expected move
    # 2q - 1 with q = P(DeltaR_t > 0 | != 0): zero exactly at balance, q = 1/2; up while positives
    # lead (the noise still helps as often as it hurts: room to explore), down while negatives do
    # (the paper's "excess noise"). No nonzero DeltaR_t: no evidence, hold.
    "share": lambda pos, neg, n, e: (pos - neg) / (pos + neg) if pos + neg else 0.0,
    # the paper's rule, literally (epsilon_1 = 2): up if |#pos - #neg| < e, else down (an all-zero
    # timestep: up). With random signs it passes with probability 0.27 at N = 8, 0.16 at N = 24: psi
    # falls even at balance.
    "literal": lambda pos, neg, n, e: 1.0 if abs(pos - neg) < e else -1.0,
    # up/down by a scale-free test, max(#pos, #neg) < e min(...) (e = 2), or
    # |#pos - #neg| < e N (e = 1/3). Their fixed point is where the test passes half the time
    # (ratio, 8 nonzero DeltaR: a positive share ~1/3), not balance.
    "ratio": lambda pos, neg, n, e: (
        0.0 if pos + neg == 0 else 1.0 if max(pos, neg) < e * min(pos, neg) else -1.0
    ),
    "fraction": lambda pos, neg, n, e: (
        0.0 if pos + neg == 0 else 1.0 if abs(pos - neg) < e * n else -1.0
    ),
}


def calibrate_psi(
    psi: torch.Tensor,
    sample_dR: Callable,
    iterations: int,
    step: float,
    bounds: tuple[float, float],
    rule: Callable,
    average: int,
    unit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[dict]]:
    """Algorithm 1. sample_dR(psi, iteration) -> DeltaR [N, T] of N fresh trajectories sampled with
    noise psi. At each timestep: psi += step * unit * rule(#pos, #neg, N), clamped to
    [low, high] * unit. unit [T] is psi's own scale (ones on the multiplier scale;
    sqrt(sigma / (1 - sigma)) on the raw one, so step and bounds mean the same noise at every t on
    both). A stochastic approximation (Robbins-Monro): psi settles where the rule's expected move
    is 0 (for "share": where #pos = #neg in expectation), jittering around it by ~step; the result
    is the mean of the last `average` iterates. Returns it and the history."""
    unit = torch.ones_like(psi) if unit is None else unit
    history = []
    for it in range(iterations):
        dR = sample_dR(psi, it)
        pos, neg = (dR > 0).sum(0).tolist(), (dR < 0).sum(0).tolist()
        move = torch.tensor([float(rule(p, q, len(dR))) for p, q in zip(pos, neg)])
        history.append(
            {
                "iteration": it,
                "psi": psi.tolist(),
                "pos": pos,
                "neg": neg,
                "n": len(dR),
                "move": move.tolist(),
            }
        )
        psi = torch.minimum(
            torch.maximum(psi + step * unit * move, bounds[0] * unit), bounds[1] * unit
        )
        history[-1]["psi_next"] = psi.tolist()
    if history:
        psi = torch.tensor([h["psi_next"] for h in history[-average:]]).mean(0)
    return psi, history


def psi_unit(sigmas: torch.Tensor, scale: str) -> torch.Tensor:
    """psi's own scale per step: 1 (multiplier: psi is a) or sqrt(sigma / (1 - sigma)) (raw: psi is
    std_dev_t)."""
    return psi_factor(sigmas) if scale == "raw" else torch.ones(len(sigmas) - 1)


def calibrate_or_load_psi(
    args, backbone, reward_model, train_prompts, sigmas, resume_dir, rank, world_size, device
) -> tuple[dict, dict]:
    """psi(t) of this run, as psi.json holds it, and its metrics (psi per t; the calibration's
    seconds). From the resumed checkpoint's copy, or --psi-file, or else Algorithm 1 run once with
    the starting model (the LoRA starts as a no-op), each rank sampling its share of the calibration
    trajectories. Rank 0 prints psi(t)."""
    unit = psi_unit(sigmas, args.psi_scale)
    psi_file = args.psi_file
    # a resume takes the checkpoint's own copy of psi(t)
    if resume_dir and not (args.resume_override and args.psi_file):
        psi_file = os.path.join(resume_dir, "psi.json")
        if not os.path.isfile(psi_file):
            raise ConfigError(
                f"--resume {resume_dir}: the checkpoint holds no psi.json (the calibrated psi(t); "
                "checkpoints before 2026-12-03 kept it beside them): add --resume-override "
                "--psi-file <the run's psi.json>"
            )
    metrics = {}
    if psi_file:
        info = load_psi(psi_file, args.num_steps, args.psi_scale, args.sde_type)
    else:

        def sample_dR(psi, it):
            """DeltaR [N, T] of N calibration trajectories, each with its own random prompt, split
            over ranks."""
            g = torch.Generator().manual_seed(2**40 + args.seed * 1_000_003 + it)
            ids = torch.randint(len(train_prompts), (args.calibration_trajectories,), generator=g)
            prompts_c = [train_prompts[i] for i in ids.view(world_size, -1)[rank]]
            gen_c = torch.Generator(device).manual_seed(
                2**41 + args.seed * 1_000_003 + it * 1009 + rank
            )
            out = dense_rollout(
                backbone,
                reward_model,
                prompts_c,
                backbone.encode(prompts_c),
                sigmas,
                step_noise_levels(psi, sigmas, args.psi_scale),
                args,
                gen_c,
            )
            dR = dense_step_rewards(reward_model.mix(out["scores"]))
            return all_gather_cat(dR.to(device), world_size).cpu()

        t0, c0 = time.perf_counter(), time.process_time()
        psi, history = calibrate_psi(
            args.noise_level * unit,  # both scales start at Flow-GRPO's noise
            sample_dR,
            args.calibration_iterations,
            args.calibration_step,
            args.psi_bounds,
            lambda p, q, n: CALIBRATION_RULES[args.balance_test](p, q, n, args.balance_threshold),
            args.calibration_average,
            unit,
        )
        # the calibration's wall and CPU seconds (this rank's CPU, all threads)
        metrics.update(
            {
                "time/calibration_s": time.perf_counter() - t0,
                "time/calibration_cpu_s": time.process_time() - c0,
            }
        )
        info = {
            "psi": psi.tolist(),
            "psi_scale": args.psi_scale,
            "sde_type": args.sde_type,
            "model_path": args.model_path,
            "reward": args.reward,
            "balance_test": args.balance_test,
            "balance_threshold": args.balance_threshold,
            "calibration_step": args.calibration_step,
            "history": history,
        }
    psi = torch.tensor(info["psi"], dtype=torch.float32).tolist()  # as the sampler will use it
    metrics.update({f"psi/t{args.num_steps - j}": p for j, p in enumerate(psi)})
    if rank == 0:
        took = [
            metrics[k] for k in ("time/calibration_s", "time/calibration_cpu_s") if k in metrics
        ]
        print(
            "psi(t), t = T..1: "
            + " ".join(f"{p:.3f}" for p in psi)
            + (" (calibration: {:.0f} s, {:.0f} CPU s)".format(*took) if took else ""),
            flush=True,
        )
    return info, metrics


# ALGO LOGIC: the rollout. DenseGRPO spreads each group over the ranks, as Flow-GRPO.
def rollout(
    h: Harness, args: Args, sigmas: torch.Tensor, noise_levels, iteration: int, timer
) -> Rollout:
    """SDE trajectories with psi(t), an ODE completion from every latent, a reward per step
    (DeltaR_t, Eq. 7-9), per-timestep advantages (Eq. 10): every trained step of every trajectory is
    a transition with its own step's advantage. Prompts and shuffle as the baseline's (seeded by the
    iteration; rank r keeps slice r); each rank scores its own trajectories at every step, and the
    per-step rewards are gathered for the groups."""
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
        # SDE trajectories with psi(t), an ODE completion from each trained step's latent
        # (staircase-batched), a reward for each (Eq. 8-9): R of latents 0..L, and the SDE image's
        dense = dense_rollout(
            h.backbone,
            h.reward_model,
            prompts,
            emb,
            sigmas,
            noise_levels,
            args,
            gen,
            upto=args.trained_steps,
        )
    with timer("reward"):
        all_scores = all_gather_cat(dense["scores"].to(h.device), h.world_size).cpu()  # [N, L+2, R]
        check_finite("reward", iteration, all_scores)
        mixed = h.reward_model.mix(all_scores)  # column 0: the ODE image, last: the SDE image
        L = args.trained_steps
        dR = dense_step_rewards(mixed[:, : L + 1])  # [N, L], Eq. 7: the trained steps
        adv = partial(
            per_step_advantages, group=group, global_std=args.global_std, eps=args.std_eps
        )
        if args.reward_mix == "score":
            advantages = adv(dR)  # Eq. 10
        else:  # normalise each reward's DeltaR per timestep within its groups, then mix
            dR_k = dense_step_rewards(all_scores[:, : L + 1])  # [N, L, R]
            per_reward = torch.stack([adv(dR_k[..., k]) for k in range(dR_k.shape[2])], 2)
            advantages = advantage_mix(per_reward.flatten(0, 1), h.reward_model.weights)
            advantages = advantages.view(dR.shape)
        advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)
        advantages[:, noise_levels[:L] == 0] = 0  # a noise-free step is no action
        # Transitions: every trained step of every trajectory, step-major (row j * n + i is step j
        # of trajectory i), each with its own timestep's advantage
        n = args.images_per_rank
        step_index = torch.arange(L).repeat_interleave(n)  # the step of each row
        trajectory = torch.arange(n).repeat(L)  # the trajectory of each row
        transitions = {
            "latents": dense["latents"][:L].flatten(0, 1),
            "next_latents": dense["latents"][1 : L + 1].flatten(0, 1),
            "log_prob": dense["log_prob"][:L].flatten(),
            "mean": dense["mean"][:L].flatten(0, 1),
            "sigma": sigmas[step_index],
            "sigma_next": sigmas[step_index + 1],
            "noise_level": noise_levels[step_index],
            "advantage": advantages[mine][trajectory, step_index],
            "prompt_index": trajectory,
            "step_index": step_index,
            "trajectory": trajectory,
        }
    sde_reward = mixed[:, -1]  # R of the SDE image, the trajectory's own
    groups = torch.stack([sde_reward[group == k] for k in range(args.groups_per_iteration)])
    metrics = group_reward_metrics(groups)  # [groups, G] rewards
    metrics.update(
        {
            "train/reward_ode_mean": mixed[:, 0].mean().item(),  # R_T: the ODE image, same noise
            "train/dR_abs_mean": dR.abs().mean().item(),
            "train/dR_zero_frac": (dR == 0).float().mean().item(),
            "train/zero_adv_sample_frac": (advantages == 0).all(1).float().mean().item(),
            "rollout/completion_calls": dense["calls"]["completion"],
            "rollout/transformer_calls": sum(dense["calls"].values()),
        }
    )
    for j in range(L):  # the dense reward of each trained step: its size, how often 0, its sign
        metrics[f"steps/dR_abs/{j}"] = dR[:, j].abs().mean().item()
        metrics[f"steps/dR_zero/{j}"] = (dR[:, j] == 0).float().mean().item()
        pos, neg = int((dR[:, j] > 0).sum()), int((dR[:, j] < 0).sum())
        if pos + neg:
            metrics[f"train/dR_pos_frac/t{args.num_steps - j}"] = pos / (pos + neg)
    counts = {
        "trajectories": n,
        "scored_images": n * dense["scores"].shape[1],  # every latent a trained step needs
        "nfe/rollout": dense["nfe"]["rollout"],
        "nfe/completion": dense["nfe"]["completion"],
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
    sigmas = h.backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)
    # ALGO LOGIC: psi(t) once, then frozen: Algorithm 1 with the starting model, or from --psi-file
    # or the resumed checkpoint
    psi_info, calibration_metrics = calibrate_or_load_psi(
        args,
        h.backbone,
        h.reward_model,
        h.train_prompts,
        sigmas,
        h.resume_dir,
        h.rank,
        h.world_size,
        h.device,
    )
    psi = torch.tensor(psi_info["psi"], dtype=torch.float32)
    noise_levels = step_noise_levels(psi, sigmas, args.psi_scale)  # the sampler's a of each step
    if h.is_main:
        psi0 = args.noise_level * psi_unit(sigmas, args.psi_scale)
        save_psi(h.run_dir, psi_info, psi0, args.calibration_average)  # psi.json and psi.png
    # fp16: dynamic loss scaling (torch.amp), as the released code's GradScaler; otherwise a no-op
    scaler = torch.amp.GradScaler(h.device.type, enabled=h.backbone.dtype == torch.float16)
    # the EMA; with --resume, the saved weights, optimizer, scale, RNG, counters; psi(t) in every
    # checkpoint
    run = h.start(
        optimizer,
        scaler,
        side_files={"psi.json": json.dumps(psi_info, indent=1)},
        first_row=calibration_metrics,  # psi(t) and the calibration's cost, in iteration 0's row
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
        ro = rollout(h, args, sigmas, noise_levels, iteration, run.timer)

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
