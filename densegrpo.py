"""DenseGRPO: Flow-GRPO with a step-wise dense reward (Deng et al. 2026, arXiv 2601.20218, ICLR 2026).

1. Dense reward: from every latent x_t of an SDE trajectory run the deterministic ODE to a clean image and score it
   (R_t, Eq. 8-9); the step x_t -> x_{t-1} earns DeltaR_t = R_{t-1} - R_t (Eq. 7). All completions of all
   trajectories run batched together ("staircase"), one step per transformer call with per-sample sigmas.
2. Per-timestep GRPO advantages: normalise DeltaR over each group separately at each timestep (Eq. 10), then the
   Flow-GRPO clipped loss + KL, unchanged.
3. Before training, calibrate a per-timestep noise level psi(t) so that positive and negative DeltaR stay balanced
   (Algorithm 1, Eq. 11); psi is saved as psi.json and reused with --psi-file.
Docs: docs/densegrpo.md.  Run: `python densegrpo.py` (toy world, CPU, minutes, no downloads) or
`torchrun --nproc_per_node 8 densegrpo.py --model-path DIR ...` (see the docs for the paper presets).
"""

from __future__ import annotations

import json
import itertools
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable, Literal

import numpy as np
import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

from common import toyworld
from common.backbones import LORA_TARGETS, ConfigError, check_model_path, check_resolution, load_backbone
from common.evaluation import evaluate
from common.rewards import advantage_mix, build_reward, parse_model_paths, parse_reward_spec
from common.sampler import gaussian_kl, ode_along_paths, sde_step_with_logprob
from common.utils import (RunLogger, Timer, all_gather_cat, all_reduce, line_plot, rng_state,
                          save_checkpoint, seed_everything, set_rng_state, setup_distributed, truncate_metrics)

HERE = os.path.dirname(os.path.abspath(__file__))
TOY_MODEL = os.path.join(HERE, "common", "toyworld", "model")


@dataclass
class Args:
    # ---- experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment: prompts, noise, LoRA init"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "flow-rl"
    """the wandb project"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{run_name}/"""
    run_name: str | None = None
    """the run folder's name (default: {exp_name}__{seed}__{unix time})"""
    resume: str | None = None
    """a checkpoint folder ({output_dir}/{run_name}/checkpoint) to continue from, exactly"""
    save_every: int = 10
    """save a checkpoint every N iterations (and at the end)"""

    # ---- backbone
    model_path: str = TOY_MODEL
    """local diffusers folder of SD3/SD3.5/FLUX.1 (default: the toy-world model shipped in the repo)"""
    resolution: int = 32
    """image height and width in pixels (paper: 512 for SD3.5-M)"""
    max_sequence_length: int | None = None
    """T5 tokens in the text context (default: 128 for SD3, 512 for FLUX, 1 without T5)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (saves memory, costs ~30% time)"""
    full_finetune: bool = False
    """train every transformer weight instead of a LoRA (the KL reference is then a frozen copy)"""
    lora_rank: int = 16
    """LoRA rank r (paper: 32)"""
    lora_alpha: float = 32.0
    """LoRA alpha (paper: 64)"""
    lora_target: Literal["attention", "all-linear"] = "all-linear"
    """which layers get a LoRA: Flow-GRPO's attention projections, or every linear layer"""

    # ---- rollout
    prompts_file: str = str(toyworld.TRAIN_MIX_FILE)
    """training prompts, one per line, drawn uniformly over lines (toy world: each category equally often)"""
    num_steps: int = 10
    """denoising steps of a rollout (paper: 10, against 40 at evaluation)"""
    shift: float | None = None
    """timestep shift of the schedule (default: the model's scheduler config)"""
    guidance_scale: float = 1.0
    """classifier-free guidance at rollout and in the training forward (SD3; paper 4.5) or FLUX guidance input"""
    noise_level: float = 0.7
    """a in std_dev_t = a*sqrt(sigma/(1-sigma)) (paper: 0.7)"""
    group_size: int = 8
    """images per prompt, G (paper: 24)"""
    groups_per_iteration: int = 2
    """prompts per iteration over all ranks (paper: 48). Toy default 2 x 8 images, a quarter of the baseline's 64: each
    image also costs sum_t n_t = 55 completion NFE and 10 more decodes, so 16 cost about what the baseline's 64 do"""
    rollout_batch_size: int = 16
    """images per transformer call while sampling, per rank (toy: all at once; real models: what fits, e.g. 6)"""

    # ---- reward
    reward: str = "toyworld"
    """reward name or weighted mix, e.g. "pickscore" or "pickscore:1.0,clipscore:0.5" (see common/rewards.py)"""
    reward_mix: Literal["score", "advantage"] = "score"
    """mix several rewards before (score) or after (advantage, as G2RPO) the group normalisation"""
    reward_model_paths: str = ""
    """where reward weights live, e.g. "pickscore=/models/PickScore_v1,clipscore=/models/clip" """
    guard_rewards: str = ""
    """extra rewards logged at evaluation only, to expose reward hacking, e.g. "aesthetic,clipscore" """

    # ---- algorithm (ALGO LOGIC)
    clip_range: float = 1e-4
    """PPO clip epsilon on the ratio (tiny because the log-prob is a per-element mean)"""
    adv_clip_max: float = 5.0
    """advantages are clipped to [-adv_clip_max, adv_clip_max]"""
    beta: float = 0.0
    """KL weight to the LoRA-off model (paper: 0.04, 0.01 for PickScore; 0 = no reference forward)"""
    global_std: bool = False
    """per timestep, divide by the std of all DeltaR of the iteration instead of each group's std (Eq. 10: group)"""
    std_eps: float = 1e-4
    """added to the std before dividing"""
    timestep_fraction: float = 0.99
    """train on the first int(num_steps * fraction) steps: 0.99 drops the last, near-deterministic step"""
    drop_zero_advantage: bool = True
    """skip transitions whose advantage is 0 (a timestep at which the whole group's DeltaR is equal teaches nothing)"""
    completion_steps: int | None = None
    """ODE steps n of each completion (Eq. 8): None = t, the rest of the rollout schedule (paper); 1 or 2 = a
    coarser grid to sigma = 0 (paper Fig. 6c: n = 1 is worse than Flow-GRPO)"""
    completion_batch_size: int = 64
    """completions advanced per transformer call in the staircase, per rank"""
    psi_scale: Literal["multiplier", "raw"] = "multiplier"
    """psi(t) replaces a in std_dev_t = psi(t) sqrt(sigma/(1-sigma)) (multiplier), or is std_dev_t itself (raw, Eq. 11
    read literally; it starts at the baseline's std_dev_t and --calibration-step / --psi-bounds are scaled by
    sqrt(sigma/(1-sigma)) at each t, so both scales calibrate the same noise and differ only in the unit of psi)"""
    psi_file: str | None = None
    """a psi.json from an earlier run: use its psi(t) and skip the calibration"""
    calibration_iterations: int = 12
    """iterations K of Algorithm 1 (0 = no calibration: psi(t) = noise_level at every step). Toy default 12 x 16
    trajectories, under 2 CPU minutes; the paper gives no K (see docs: the precision this buys)"""
    calibration_trajectories: int = 16
    """trajectories N per calibration iteration, over all ranks, each with its own random prompt"""
    calibration_step: float | None = None
    """epsilon_2, the largest move of psi(t) per iteration (default: 0.2 for share; 0.01, the paper's, otherwise)"""
    balance_test: Literal["share", "literal", "ratio", "fraction"] = "share"
    """the update rule of Algorithm 1: share psi += eps2 (#pos - #neg) / (#pos + #neg), which settles at #pos = #neg
    (balance); or the paper's psi += eps2 if balanced else -= eps2 with the test literal |#pos - #neg| < e (paper,
    e = 2), ratio max(#pos, #neg) < e min(#pos, #neg) (e = 2) or fraction |#pos - #neg| < e N (e = 1/3). A timestep
    whose DeltaR are all 0 holds its psi (literal: counts as balanced, as the paper). See docs"""
    balance_threshold: float | None = None
    """e of the balance test (default: 2 for literal and ratio, 1/3 for fraction; share has none)"""
    psi_bounds: tuple[float, float] = (0.0, 1.5)
    """psi(t) is clamped to [low, high] after every calibration update, in units of the multiplier a (raw: times
    sqrt(sigma/(1-sigma))); must contain --noise-level, the start"""
    calibration_average: int = 6
    """the calibrated psi(t) is the mean of the last this-many iterates (the iterates jitter by ~epsilon_2)"""

    # ---- optimisation
    num_iterations: int = 60
    """rollout + update iterations (0 = only evaluate the starting model)"""
    learning_rate: float = 3e-4
    """AdamW learning rate (paper: 3e-4 with LoRA)"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    train_batch_size: int | None = None
    """transitions per training forward, per rank (default: rollout_batch_size, which keeps ratio == 1 exact)"""
    optimizer_steps_per_iteration: int = 1
    """optimizer steps per iteration: the micro-batches are accumulated into this many steps (paper: 2)"""
    num_inner_epochs: int = 1
    """passes over the iteration's transitions"""
    ema_decay: float = 0.0
    """EMA of the trained weights for evaluation and saving (0 = off; Flow-GRPO: 0.9)"""

    # ---- evaluation and logging
    eval_prompts: str = str(toyworld.TEST_FILE)
    """evaluation prompts, one per line (never trained on)"""
    eval_every: int = 10
    """evaluate every N iterations (and at the start and the end)"""
    eval_num_steps: int = 20
    """ODE steps at evaluation (paper: 40)"""
    eval_guidance_scale: float | None = None
    """guidance at evaluation (default: guidance_scale)"""
    eval_seeds_per_prompt: int = 2
    """images per evaluation prompt, each from a fixed seed"""
    eval_batch_size: int = 64
    """images per transformer call at evaluation"""

    # ---- filled in at runtime
    world_size: int = 0
    """number of processes (torchrun ranks)"""
    images_per_iteration: int = 0
    """groups_per_iteration * group_size"""
    images_per_rank: int = 0
    """images_per_iteration / world_size"""
    trained_steps: int = 0
    """int(num_steps * timestep_fraction)"""


def check_args(args: Args, world_size: int) -> None:
    """Batch arithmetic, checked before any model is loaded. Every message says what to change."""
    args.world_size = world_size
    args.images_per_iteration = args.groups_per_iteration * args.group_size
    args.train_batch_size = args.train_batch_size or args.rollout_batch_size
    args.trained_steps = int(args.num_steps * args.timestep_fraction)
    if args.group_size < 2:
        raise ConfigError(f"--group-size {args.group_size}: a group needs at least 2 images to have a mean to "
                          "compare against (paper: 24)")
    if args.images_per_iteration % world_size:
        raise ConfigError(f"groups_per_iteration * group_size = {args.images_per_iteration} images cannot be "
                          f"split evenly over {world_size} ranks; make it a multiple of {world_size}")
    args.images_per_rank = args.images_per_iteration // world_size
    if args.images_per_rank % args.rollout_batch_size:
        raise ConfigError(f"each rank samples {args.images_per_rank} images, not a multiple of --rollout-batch-size "
                          f"{args.rollout_batch_size}; pick a divisor of {args.images_per_rank}")
    if not 1 <= args.trained_steps <= args.num_steps:
        raise ConfigError(f"--timestep-fraction {args.timestep_fraction} trains {args.trained_steps} of "
                          f"{args.num_steps} steps; it must train at least one")
    if args.completion_steps is not None and args.completion_steps < 1:
        raise ConfigError(f"--completion-steps {args.completion_steps}: a completion needs at least one ODE step "
                          "(None = t, the paper's choice; 1 or 2 = the cheap variants)")
    if args.balance_threshold is None:
        args.balance_threshold = 1 / 3 if args.balance_test == "fraction" else 2.0  # paper: epsilon_1 = 2
    if args.calibration_step is None:
        args.calibration_step = 0.2 if args.balance_test == "share" else 0.01  # paper: epsilon_2 = 0.01
    lo, hi = args.psi_bounds
    if not 0 <= lo <= hi:
        raise ConfigError(f"--psi-bounds {lo} {hi}: need 0 <= low <= high (psi enters the SDE squared)")
    if not lo <= args.noise_level <= hi:
        raise ConfigError(f"--psi-bounds {lo} {hi} do not contain the start --noise-level {args.noise_level} (bounds "
                          "are in units of the multiplier a, also with --psi-scale raw); widen them or move the start")
    if args.calibration_average < 1:
        raise ConfigError(f"--calibration-average {args.calibration_average}: average at least the last iterate")
    if args.psi_file is not None and not os.path.isfile(args.psi_file):
        raise ConfigError(f"--psi-file '{args.psi_file}' does not exist: pass the psi.json of an earlier run")
    if args.psi_file is None and args.calibration_iterations and args.calibration_trajectories % world_size:
        raise ConfigError(f"--calibration-trajectories {args.calibration_trajectories} cannot be split evenly over "
                          f"{world_size} ranks; make it a multiple of {world_size}")


# ALGO LOGIC: group-relative advantages (GRPO), Flow-GRPO's PerPromptStatTracker in three lines.
def group_advantages(rewards: torch.Tensor, group: torch.Tensor, global_std: bool, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean of i's group) / std, std over all rewards (global_std) or over i's group."""
    n = int(group.max()) + 1
    mean = torch.zeros(n).index_add_(0, group, rewards) / torch.bincount(group, minlength=n)
    if global_std:
        std = rewards.std(unbiased=False).expand(n)  # population std, as np.std in Flow-GRPO
    else:
        var = torch.zeros(n).index_add_(0, group, (rewards - mean[group]) ** 2) / torch.bincount(group, minlength=n)
        std = var.sqrt()
    return (rewards - mean[group]) / (std[group] + eps)


# ALGO LOGIC: psi(t), the noise level of each step (Eq. 11). On the multiplier scale psi is the sampler's `noise_level`
# of that step (std_dev_t = psi sqrt(sigma / (1 - sigma))); on the raw scale psi IS std_dev_t, converted back here.
def psi_factor(sigmas: torch.Tensor) -> torch.Tensor:
    """sqrt(sigma / (1 - sigma)) per step; at sigma = 1 the sampler puts sigma_1 in the denominator."""
    s = sigmas[:-1]
    return torch.sqrt(s / (1 - torch.where(s == 1, sigmas[1], s)))


def step_noise_levels(psi: torch.Tensor, sigmas: torch.Tensor, scale: str) -> torch.Tensor:
    """The sampler's noise_level of each of the T steps."""
    return psi.float() if scale == "multiplier" else psi.float() / psi_factor(sigmas)


def sample_trajectories(backbone, emb, sigmas, noise_levels, n, batch_size, resolution, guidance_scale, gen):
    """SDE rollout exactly as the baseline's (same generator draws in the same order, so psi == noise_level gives the
    baseline's trajectories), with a noise level per step. Returns latents [T+1, n, ...] (index 0 = x_T, pure noise;
    index T = the SDE's image x_0), the rollout policy's log-probs [T, n] and the velocities v(latents[k], sigma_k)
    [T, n, ...] (kept: each is also the first Euler step of the completion from latents[k])."""
    lat, lps, vels = [], [], []
    for b in range(0, n, batch_size):
        m = min(batch_size, n - b)
        x = backbone.initial_noise(m, resolution, resolution, generator=gen)
        xs, lp, vs = [x], [], []
        for j in range(len(sigmas) - 1):
            v = backbone.velocity(x, sigmas[j], emb[b:b + m], guidance_scale)
            x, log_prob, _, _ = sde_step_with_logprob(v, x, sigmas[j], sigmas[j + 1], float(noise_levels[j]),
                                                      generator=gen, sigma_max=sigmas[1])
            xs.append(x)
            lp.append(log_prob)
            vs.append(v)
        lat.append(torch.stack(xs))
        lps.append(torch.stack(lp))
        vels.append(torch.stack(vs))
    return torch.cat(lat, 1), torch.cat(lps, 1), torch.cat(vels, 1)


def completion_grid(num_steps: int, k: int, n: int | None) -> list[int]:
    """Schedule indices of the ODE completion of the latent at index k (paper timestep t = T - k) down to sigma = 0
    (Eq. 8). n None: all t remaining steps of the rollout grid (paper default n = t). n < t: the paper's sub-grid
    x_t -> ... -> x_{t, floor(t/n)} -> x_{t, 0}, i.e. paper timesteps t, (n-1)s, ..., 2s, s, 0 with s = floor(t/n)
    (the first jump takes the remainder); n = 1 is the one-step x0 prediction. Index of paper timestep u: T - u."""
    t = num_steps - k
    m = t if n is None else min(n, t)
    return [k] + [num_steps - j * (t // m) for j in range(m - 1, -1, -1)]


@torch.no_grad()
def dense_rollout(backbone, reward_model, prompts: list[str], emb, sigmas, noise_levels, args, gen) -> dict:
    """Sample one SDE trajectory per prompt and score every latent of it (Eq. 8-9).

    R[:, k] = R(ODE completion of latents[k]) for k < T, and R[:, T] = R(the SDE's own image): x_hat_{0,0} = x_0 needs
    no completion. Index k is the paper's timestep t = T - k, so R[:, 0] (the paper's R_T) is the reward of the plain
    ODE sample from the trajectory's initial noise. Returns latents, log_probs, scores [n, T+1, K], and the NFE and
    sequential transformer calls of sampling and of the completions: nfe / calls = {"rollout": .., "completion": ..}
    (a CFG pair is one). Completion NFE per trajectory: sum_k (len(grid_k) - 1) - T (first steps reused)."""
    n, T = len(prompts), len(sigmas) - 1
    latents, log_probs, vels = sample_trajectories(backbone, emb, sigmas, noise_levels, n, args.rollout_batch_size,
                                                   args.resolution, args.guidance_scale, gen)
    grids = [completion_grid(T, k, args.completion_steps) for k in range(T)] + [[T]]  # [T]: the SDE image
    # A step with psi = 0 is the Euler step (E1) with v(latents[k]), the first step of latents[k]'s completion. Where
    # that completion then goes on along latents[k+1]'s own grid (always for n = t), both are one computation:
    # R_k = R_{k+1}, DeltaR = 0 by definition, and running it again could only add float noise. Not run.
    same = [bool(noise_levels[k] == 0) and grids[k][1:] == grids[k + 1] for k in range(T)]
    run = [k for k in range(T) if not same[k]]
    paths = [sigmas[grids[k]].to(latents.device) for k in run for _ in range(n)]  # job m = r * n + i
    prompt_of = torch.arange(n).repeat(len(run))
    # Staircase-batched Euler ODE (common/sampler.py); the first step of each reuses the SDE step's v(x_k, sigma_k).
    clean, nfe, calls = ode_along_paths(
        lambda x, sig, rows: backbone.velocity(x, sig, emb[prompt_of[rows]], args.guidance_scale),
        latents[run].flatten(0, 1), paths, args.completion_batch_size, first_velocity=vels[run].flatten(0, 1))
    clean = torch.cat([clean.view(len(run), *latents.shape[1:]), latents[T:]])  # last: the SDE image (index T)
    images = torch.cat([backbone.decode(c, args.resolution, args.resolution)
                        for c in clean.flatten(0, 1).split(args.rollout_batch_size)])
    scores = reward_model(images, list(prompts) * (len(run) + 1)).view(len(run) + 1, n, -1)  # k-major
    row = [len(run)] * (T + 1)  # row of scores holding R_k
    for k in reversed(range(T)):
        row[k] = row[k + 1] if same[k] else run.index(k)
    return {"latents": latents, "log_probs": log_probs, "scores": scores[row].transpose(0, 1),  # [n, T+1, K]
            "nfe": {"rollout": n * T, "completion": nfe},
            "calls": {"rollout": T * math.ceil(n / args.rollout_batch_size), "completion": calls}}


# ALGO LOGIC: dense reward (Eq. 7) and per-timestep advantages (Eq. 10).
def dense_step_rewards(R: torch.Tensor) -> torch.Tensor:
    """[N, T+1, ...] latent rewards -> [N, T, ...] step rewards. The step x_t -> x_{t-1} (code step j = T - t, from
    index j to j+1) earns DeltaR_t = R_{t-1} - R_t = R[:, j+1] - R[:, j]. They telescope: the sum over the steps of a
    trajectory is R(its SDE image) - R(the ODE image from its initial noise)."""
    return R[:, 1:] - R[:, :-1]


def per_step_advantages(dR: torch.Tensor, group: torch.Tensor, global_std: bool, eps: float) -> torch.Tensor:
    """Eq. 10: GRPO normalisation at each timestep separately, [N, T] -> [N, T] (column j over the groups)."""
    return torch.stack([group_advantages(dR[:, j], group, global_std, eps) for j in range(dR.shape[1])], 1)


# ALGO LOGIC: reward-aware calibration of psi(t) (Algorithm 1). A rule maps the signs of DeltaR_t over the N calibration
# trajectories (#pos, #neg, N) to a move of psi(t) in units of the step epsilon_2: +1 up, -1 down, 0 hold.
CALIBRATION_RULES = {
    # default: the lead of one sign among the nonzero DeltaR_t. Expected move 2q - 1 with q = P(DeltaR_t > 0 | != 0):
    # zero exactly at balance, q = 1/2; up while positives lead (the noise still helps as often as it hurts: room to
    # explore), down while negatives do (the paper's "excess noise"). No nonzero DeltaR_t: no evidence, hold.
    "share": lambda pos, neg, n, e: (pos - neg) / (pos + neg) if pos + neg else 0.0,
    # the paper's rule, literally (epsilon_1 = 2): up if |#pos - #neg| < e, else down (an all-zero timestep: up).
    # With random signs it passes with probability 0.27 at N = 8, 0.16 at N = 24: psi falls even at balance.
    "literal": lambda pos, neg, n, e: 1.0 if abs(pos - neg) < e else -1.0,
    # up/down by a scale-free test, max(#pos, #neg) < e min(...) (e = 2), or |#pos - #neg| < e N (e = 1/3). Their
    # fixed point is where the test passes half the time (ratio, 8 nonzero DeltaR: a positive share ~1/3), not balance.
    "ratio": lambda pos, neg, n, e: 0.0 if pos + neg == 0 else 1.0 if max(pos, neg) < e * min(pos, neg) else -1.0,
    "fraction": lambda pos, neg, n, e: 0.0 if pos + neg == 0 else 1.0 if abs(pos - neg) < e * n else -1.0,
}


def calibrate_psi(psi: torch.Tensor, sample_dR: Callable, iterations: int, step: float, bounds: tuple[float, float],
                  rule: Callable, average: int, unit: torch.Tensor | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Algorithm 1. sample_dR(psi, iteration) -> DeltaR [N, T] of N fresh trajectories sampled with noise psi. At each
    timestep: psi += step * unit * rule(#pos, #neg, N), clamped to [low, high] * unit. unit [T] is psi's own scale
    (ones on the multiplier scale; sqrt(sigma / (1 - sigma)) on the raw one, so step and bounds mean the same noise
    at every t on both). A stochastic approximation (Robbins-Monro): psi settles where the rule's expected move is 0
    (for "share": where #pos = #neg in expectation), jittering around it by ~step; the result is the mean of the last
    `average` iterates. Returns it and the history."""
    unit = torch.ones_like(psi) if unit is None else unit
    history = []
    for it in range(iterations):
        dR = sample_dR(psi, it)
        pos, neg = (dR > 0).sum(0).tolist(), (dR < 0).sum(0).tolist()
        move = torch.tensor([float(rule(p, q, len(dR))) for p, q in zip(pos, neg)])
        history.append({"iteration": it, "psi": psi.tolist(), "pos": pos, "neg": neg, "n": len(dR),
                        "move": move.tolist()})
        psi = torch.minimum(torch.maximum(psi + step * unit * move, bounds[0] * unit), bounds[1] * unit)
        history[-1]["psi_next"] = psi.tolist()
    if history:
        psi = torch.tensor([h["psi_next"] for h in history[-average:]]).mean(0)
    return psi, history


def load_psi(path: str, num_steps: int, psi_scale: str) -> dict:
    """A psi.json written by save_psi, checked against this run's schedule."""
    with open(path) as f:
        info = json.load(f)
    if len(info["psi"]) != num_steps or info.get("psi_scale") != psi_scale:
        raise ConfigError(f"--psi-file '{path}' holds {len(info['psi'])} steps on the {info.get('psi_scale')} scale; "
                          f"this run has --num-steps {num_steps} and --psi-scale {psi_scale}: recalibrate or match")
    return info


def save_psi(run_dir: str, info: dict, psi0: torch.Tensor, average: int) -> None:
    """psi.json (reused with --psi-file) and psi.png: psi(t) and the fraction of positive DeltaR_t in calibration."""
    with open(os.path.join(run_dir, "psi.json"), "w") as f:
        json.dump(info, f, indent=1)
    T, last = len(info["psi"]), info["history"][-average:]
    ts = list(range(T, 0, -1))  # paper timestep of code step j
    series = {"psi(t) calibrated": (ts, info["psi"]), "psi(t) initial": (ts, psi0.tolist())}
    if last:  # positive share of the nonzero DeltaR_t over the averaged iterations (None: none was nonzero)
        counts = [np.sum([[h["pos"][j], h["pos"][j] + h["neg"][j]] for h in last], 0) for j in range(T)]
        frac = [float(p / n) if n else None for p, n in counts]
        series["positive fraction of nonzero dR"] = (ts, frac)
    line_plot(series, os.path.join(run_dir, "psi.png"), "paper timestep t (T = first step)", "psi / fraction",
              f"calibration, rule {info.get('balance_test')}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    # ---- cheap checks first: bad input costs one line, not a model load
    try:
        parse_reward_spec(args.reward)
        guard_names = [n for n, _ in parse_reward_spec(args.guard_rewards)] if args.guard_rewards else []
        train_prompts = toyworld.load_prompts(args.prompts_file)
        eval_prompts = toyworld.load_prompts(args.eval_prompts)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e))
    check_resolution(args.model_path, check_model_path(args.model_path), args.resolution, args.resolution)
    rank, world_size, device = setup_distributed()
    check_args(args, world_size)
    is_main = rank == 0
    seed_everything(args.seed, args.torch_deterministic)
    if args.resume:
        run_dir = os.path.dirname(os.path.abspath(args.resume.rstrip("/")))
    else:
        run_dir = os.path.join(args.output_dir, args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}")
    if is_main:
        print("batch arithmetic: " + ", ".join(f"{k}={getattr(args, k)}" for k in (
            "world_size", "groups_per_iteration", "group_size", "images_per_iteration", "images_per_rank",
            "rollout_batch_size", "train_batch_size", "trained_steps", "optimizer_steps_per_iteration")))

    # ---- backbone, trainable weights, optimizer
    backbone = load_backbone(args.model_path, device, max_sequence_length=args.max_sequence_length,
                             gradient_checkpointing=args.gradient_checkpointing)
    transformer = backbone.transformer
    ref_model = None
    if args.full_finetune:
        transformer.requires_grad_(True)
        if args.beta > 0:  # no adapter to switch off: keep a frozen copy as the KL reference
            import copy

            ref_model = copy.deepcopy(transformer).requires_grad_(False)
    else:
        from peft import LoraConfig
        from peft.utils import get_peft_model_state_dict

        transformer.requires_grad_(False)
        # Gaussian init of A, zeros for B: the LoRA starts as an exact no-op (Flow-GRPO's choice).
        transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, init_lora_weights="gaussian",
                                           target_modules=LORA_TARGETS[args.lora_target]))
    params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    for p in params.values():
        p.data = p.data.float()  # master weights in fp32 even when the frozen base runs in bf16
    optimizer = torch.optim.AdamW(params.values(), lr=args.learning_rate, betas=args.adam_betas,
                                  weight_decay=args.weight_decay, eps=1e-8)
    ema = {n: p.detach().clone() for n, p in params.items()} if args.ema_decay > 0 else None
    policy = torch.nn.parallel.DistributedDataParallel(transformer) if world_size > 1 else transformer

    def swap_ema():
        """Exchange the live weights and the EMA weights (called in pairs around evaluation and saving)."""
        if ema is not None:
            for n, p in params.items():
                tmp = p.data.clone()
                p.data.copy_(ema[n])
                ema[n].copy_(tmp)

    def reference_velocity(x, sigma, emb):
        """v of the reference policy: the same network with the LoRA switched off (no second copy in memory)."""
        if ref_model is not None:
            return backbone.velocity(x, sigma, emb, args.guidance_scale, model=ref_model)
        transformer.disable_adapters()
        try:
            return backbone.velocity(x, sigma, emb, args.guidance_scale)
        finally:
            transformer.enable_adapters()

    def save_weights(folder):
        """Weights for users: a LoRA that a stock pipeline loads with `load_lora_weights(folder)`."""
        swap_ema()
        if args.full_finetune:
            transformer.save_pretrained(os.path.join(folder, "transformer"))
        else:
            type(backbone.pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(transformer))
        swap_ema()

    reward_model = build_reward(args.reward, device, parse_model_paths(args.reward_model_paths))
    guard_model = build_reward(args.guard_rewards, device, parse_model_paths(args.reward_model_paths)) \
        if guard_names else None
    logger = RunLogger(run_dir, is_main, args.track, asdict(args), args.wandb_project_name, args.wandb_entity,
                       os.path.basename(run_dir))
    start_iteration, nfe = 0, 0
    if args.resume:
        state = torch.load(os.path.join(args.resume, "trainer_state.pt"), weights_only=False)
        for n, p in params.items():
            p.data.copy_(state["params"][n])
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None:
            for n in ema:
                ema[n].copy_(state["ema"][n])
        start_iteration, nfe = state["iteration"], state["nfe"]
        set_rng_state(state["rng"][rank])
        if is_main:
            truncate_metrics(run_dir, start_iteration)

    sigmas = backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)
    eval_cfg = args.guidance_scale if args.eval_guidance_scale is None else args.eval_guidance_scale

    # ---- ALGO LOGIC: psi(t) by Algorithm 1, once, with the starting model (the LoRA starts as a no-op), then frozen
    # psi's own scale: a (multiplier) or std_dev_t = a sqrt(sigma / (1 - sigma)) (raw); both start at Flow-GRPO's noise
    unit = psi_factor(sigmas) if args.psi_scale == "raw" else torch.ones(args.num_steps)
    psi0 = args.noise_level * unit
    psi_file = args.psi_file or (os.path.join(run_dir, "psi.json") if args.resume else None)
    calib_metrics = {}
    if psi_file:
        if not os.path.isfile(psi_file):
            raise ConfigError(f"resuming needs the run's psi.json ({psi_file}); pass --psi-file")
        info = load_psi(psi_file, args.num_steps, args.psi_scale)
    else:
        def sample_dR(psi, it):
            """DeltaR [N, T] of N calibration trajectories, each with its own random prompt, split over ranks."""
            g = torch.Generator().manual_seed(2**40 + args.seed * 1_000_003 + it)
            ids = torch.randint(len(train_prompts), (args.calibration_trajectories,), generator=g)
            prompts_c = [train_prompts[i] for i in ids.view(world_size, -1)[rank]]
            gen_c = torch.Generator(device).manual_seed(2**41 + args.seed * 1_000_003 + it * 1009 + rank)
            out = dense_rollout(backbone, reward_model, prompts_c, backbone.encode(prompts_c), sigmas,
                                step_noise_levels(psi, sigmas, args.psi_scale), args, gen_c)
            dR = dense_step_rewards(reward_model.mix(out["scores"]))
            return all_gather_cat(dR.to(device), world_size).cpu()

        t0, c0 = time.perf_counter(), time.process_time()
        psi, history = calibrate_psi(psi0, sample_dR, args.calibration_iterations, args.calibration_step,
                                     args.psi_bounds, lambda p, q, n: CALIBRATION_RULES[args.balance_test](
                                         p, q, n, args.balance_threshold), args.calibration_average, unit)
        calib_metrics.update({"time/calibration_s": time.perf_counter() - t0,
                              "time/calibration_cpu_s": time.process_time() - c0})  # this rank's CPU, all threads
        info = {"psi": psi.tolist(), "psi_scale": args.psi_scale, "model_path": args.model_path, "reward": args.reward,
                "balance_test": args.balance_test, "balance_threshold": args.balance_threshold,
                "calibration_step": args.calibration_step, "history": history}
    psi = torch.tensor(info["psi"], dtype=torch.float32)
    noise_levels = step_noise_levels(psi, sigmas, args.psi_scale)  # the sampler's noise_level of each step
    calib_metrics.update({f"psi/t{args.num_steps - j}": float(psi[j]) for j in range(args.num_steps)})
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        save_psi(run_dir, info, psi0, args.calibration_average)
        took = [calib_metrics[k] for k in ("time/calibration_s", "time/calibration_cpu_s") if k in calib_metrics]
        print("psi(t), t = T..1: " + " ".join(f"{p:.3f}" for p in psi.tolist())
              + (" (calibration: {:.0f} s, {:.0f} CPU s)".format(*took) if took else ""), flush=True)

    timer, t_start = Timer(), time.time()
    bar = tqdm(range(start_iteration, args.num_iterations + 1), disable=not is_main, initial=start_iteration,
               total=args.num_iterations + 1, desc=args.exp_name)
    for iteration in bar:
        metrics, grid_img = {"iteration": iteration}, None
        timer.times.clear()
        if iteration % args.eval_every == 0 or iteration == args.num_iterations:
            with timer("eval"):  # common/evaluation.py: ODE from fixed seeds, the same in all three scripts
                swap_ema()
                eval_metrics, grid_img = evaluate(backbone, reward_model, guard_model, eval_prompts, args.eval_num_steps,
                                                  args.shift, eval_cfg, args.eval_seeds_per_prompt,
                                                  args.eval_batch_size, args.resolution, rank, world_size)
                swap_ema()
            metrics.update(eval_metrics)
            if is_main:
                os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
                grid_img.save(os.path.join(run_dir, "samples", f"eval_{iteration:05d}.png"))
        if iteration == args.num_iterations:
            metrics.update({"nfe": nfe, "time/elapsed_s": time.time() - t_start})
            logger.log(metrics, {"eval/samples": grid_img} if grid_img else None)
            break

        # ================================ ROLLOUT: sample groups and build transitions ================================
        # ALGO LOGIC. Flow-GRPO spreads each group over the ranks: all ranks draw the same prompts and the same
        # shuffle (a generator seeded by the iteration), and rank r keeps slice r. Seeding by iteration also makes
        # a resumed run sample exactly what the uninterrupted run would have. DenseGRPO keeps that: each rank scores
        # its own trajectories at every timestep, and the per-timestep rewards [N, T+1] are gathered for the groups.
        with timer("rollout"):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
            prompt_ids = torch.randint(len(train_prompts), (args.groups_per_iteration,), generator=g)
            group = torch.arange(args.groups_per_iteration).repeat_interleave(args.group_size)
            group = group[torch.randperm(len(group), generator=g)]  # group id of every image, global order
            mine = slice(rank * args.images_per_rank, (rank + 1) * args.images_per_rank)
            my_prompts = [train_prompts[prompt_ids[k]] for k in group[mine]]
            emb = backbone.encode(my_prompts)
            gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + iteration * 1009 + rank)
            # SDE trajectories with psi(t), T ODE completions each (staircase-batched), T+1 rewards each (Eq. 8-9)
            out = dense_rollout(backbone, reward_model, my_prompts, emb, sigmas, noise_levels, args, gen)
            nfe_counts = dict(out["nfe"])  # {"rollout": sampling NFE, "completion": completion NFE}, this rank
            nfe_rollout = sum(nfe_counts.values())
        with timer("reward"):
            all_scores = all_gather_cat(out["scores"].to(device), world_size).cpu()  # [N, T+1, K], global order
            if not torch.isfinite(all_scores).all():
                raise SystemExit(f"error: non-finite reward at iteration {iteration}; stopping before any update "
                                 f"(last checkpoint in {run_dir}/checkpoint is intact)")
            mixed = reward_model.mix(all_scores)  # [N, T+1]: column T is the SDE image, column 0 the ODE image
            dR = dense_step_rewards(mixed)  # [N, T], Eq. 7
            if args.reward_mix == "score":
                advantages = per_step_advantages(dR, group, args.global_std, args.std_eps)  # Eq. 10
            else:  # normalise each reward's DeltaR within its groups per timestep, then mix the advantages
                dR_k = dense_step_rewards(all_scores)  # [N, T, K]
                per_reward = torch.stack([per_step_advantages(dR_k[..., k], group, args.global_std, args.std_eps)
                                          for k in range(all_scores.shape[2])], 2)
                advantages = advantage_mix(per_reward.flatten(0, 1), reward_model.weights).view(dR.shape)
            advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)
            advantages[:, noise_levels == 0] = 0  # a noise-free step is no action (log-prob 0 whatever theta)
            final = mixed[:, -1]
            group_std = torch.stack([final[group == k].std(unbiased=False) for k in range(args.groups_per_iteration)])
            # Transitions: every trained step of every trajectory, each with its own timestep's advantage. Samples
            # whose advantages are all 0 have only zero-advantage transitions, which the training section drops.
            n_traj, L = args.images_per_rank, args.trained_steps
            transitions = {
                "latents": out["latents"][:L].flatten(0, 1),
                "next_latents": out["latents"][1:L + 1].flatten(0, 1),
                "log_prob": out["log_probs"][:L].flatten(),
                "sigma": sigmas[:L].repeat_interleave(n_traj),
                "sigma_next": sigmas[1:L + 1].repeat_interleave(n_traj),
                "noise_level": noise_levels[:L].repeat_interleave(n_traj),
                "advantage": advantages[mine, :L].T.reshape(-1),
                "prompt_index": torch.arange(n_traj).repeat(L),
            }
            metrics.update({"train/reward_mean": final.mean().item(), "train/reward_std": final.std().item(),
                            "train/group_std_mean": group_std.mean().item(),
                            "train/zero_std_frac": (group_std == 0).float().mean().item(),
                            "train/reward_ode_mean": mixed[:, 0].mean().item(),  # R_T: the ODE image, same noise
                            "train/dR_abs_mean": dR.abs().mean().item(),
                            "train/dR_zero_frac": (dR == 0).float().mean().item(),
                            "train/zero_adv_sample_frac": (advantages[:, :L] == 0).all(1).float().mean().item(),
                            "rollout/completion_nfe": nfe_counts["completion"],
                            "rollout/completion_calls": out["calls"]["completion"],
                            "rollout/transformer_calls": sum(out["calls"].values())})
            for j in range(args.num_steps):  # sign balance per timestep, what Algorithm 1 watches
                pos, neg = int((dR[:, j] > 0).sum()), int((dR[:, j] < 0).sum())
                if pos + neg:
                    metrics[f"train/dR_pos_frac/t{args.num_steps - j}"] = pos / (pos + neg)
            if iteration == start_iteration:
                metrics.update(calib_metrics)
        del out
        # ============================== END OF ROLLOUT (the scripts differ only above) ==============================

        # =============================== TRAINING on transitions (same in all three scripts) ===============================
        with timer("train"):
            tr = {k: v.to(device) for k, v in transitions.items()}
            n = len(tr["advantage"])
            keep = tr["advantage"] != 0 if args.drop_zero_advantage else torch.ones(n, dtype=torch.bool, device=device)
            mb, n_opt = args.train_batch_size, args.optimizer_steps_per_iteration
            # Every backward pass is a DDP all-reduce, so all ranks must run the same number of them: ranks with fewer
            # kept transitions pad with weight-0 ones (they cost compute, not gradient).
            # Optional transitions["update_group"] (G²RPO's one-optimizer-step-per-branch-step): each group in turn
            # gets its own optimizer step(s); without the key, everything is one group.
            group_of = tr.get("update_group", torch.zeros(n, dtype=torch.long, device=device))
            n_groups = int(all_reduce(group_of.max().reshape(1) + 1, world_size,
                                      dist.ReduceOp.MAX if world_size > 1 else None))
            stats = {k: [] for k in ("ratio", "clipfrac", "kl", "approx_kl", "loss", "weight")}
            first_ratio_dev = None
            nfe_train = 0
            for epoch, u in itertools.product(range(args.num_inner_epochs), range(n_groups)):
                sel = keep & (group_of == u)
                n_micro = int(all_reduce(torch.tensor([math.ceil(int(sel.sum()) / mb)], device=device), world_size,
                                         dist.ReduceOp.MAX if world_size > 1 else None))
                if n_micro == 0:  # nothing kept in this group on any rank (e.g. every group's rewards tied)
                    continue
                nfe_train += n_micro * mb * (2 if args.beta > 0 else 1)
                kept, dropped = sel.nonzero().squeeze(1), (~sel).nonzero().squeeze(1)
                order = torch.cat([kept[torch.randperm(len(kept), device=device)], dropped])
                order = torch.cat([order, order.new_zeros(max(0, n_micro * mb - len(order)))])[: n_micro * mb]
                weight = torch.zeros(n_micro * mb, device=device)
                weight[: min(len(kept), n_micro * mb)] = 1.0
                # The loss is the mean over all kept transitions of one optimizer step, on all ranks: divide by that
                # global count (DDP then averages the ranks' gradients, hence the factor world_size).
                per_step = -(-n_micro // n_opt)
                chunk = weight.view(n_micro, mb).sum(1)
                chunk = torch.stack([chunk[s:s + per_step].sum() for s in range(0, n_micro, per_step)])
                chunk = all_reduce(chunk, world_size)
                for m in range(n_micro):
                    idx, w = order[m * mb:(m + 1) * mb], weight[m * mb:(m + 1) * mb]
                    step_id, sync = m // per_step, (m + 1) % per_step == 0 or m == n_micro - 1
                    with policy.no_sync() if world_size > 1 and not sync else nullcontext():
                        x, sig, sig_next = tr["latents"][idx], tr["sigma"][idx], tr["sigma_next"][idx]
                        e = emb[tr["prompt_index"][idx]]
                        # CFG inside the training forward, gradient through the conditional branch only (Flow-GRPO).
                        v = backbone.velocity(x, sig, e, args.guidance_scale, model=policy, detach_uncond=True)
                        _, log_prob, mean, std_dev_t = sde_step_with_logprob(
                            v, x, sig, sig_next, tr["noise_level"][idx], prev_sample=tr["next_latents"][idx],
                            sigma_max=sigmas[1])
                        # GRPO objective (Flow-GRPO §4): PPO-clipped ratio of the new to the rollout policy on one step.
                        ratio = torch.exp(log_prob - tr["log_prob"][idx])
                        adv = tr["advantage"][idx]
                        policy_loss = torch.maximum(-adv * ratio,
                                                    -adv * ratio.clamp(1 - args.clip_range, 1 + args.clip_range))
                        loss_i = policy_loss
                        if args.beta > 0:  # KL to the reference policy on the step's Gaussian means (sampler E5)
                            with torch.no_grad():
                                v_ref = reference_velocity(x, sig, e)
                                mean_ref = sde_step_with_logprob(v_ref, x, sig, sig_next, tr["noise_level"][idx],
                                                                 prev_sample=tr["next_latents"][idx],
                                                                 sigma_max=sigmas[1])[2]
                            kl = gaussian_kl(mean, mean_ref, std_dev_t)
                            loss_i = loss_i + args.beta * kl
                            stats["kl"].append((kl.detach() * w).sum())
                        loss = (loss_i * w).sum() * world_size / chunk[step_id].clamp_min(1)
                        finite = all_reduce(torch.isfinite(loss).float().reshape(1), world_size,
                                            dist.ReduceOp.MIN if world_size > 1 else None)
                        if not bool(finite):
                            raise SystemExit(f"error: non-finite loss at iteration {iteration}; stopping before the "
                                             f"update (last checkpoint in {run_dir}/checkpoint is intact)")
                        loss.backward()
                    if first_ratio_dev is None:  # before any update the policy IS the rollout policy: ratio == 1
                        first_ratio_dev = (ratio.detach() - 1).abs().max().item()
                    stats["ratio"].append(ratio.detach()[w > 0])
                    stats["clipfrac"].append(((ratio.detach() - 1).abs() > args.clip_range).float()[w > 0])
                    stats["approx_kl"].append((0.5 * (log_prob.detach() - tr["log_prob"][idx]) ** 2)[w > 0])
                    stats["loss"].append((policy_loss.detach() * w).sum())
                    stats["weight"].append(w.sum())
                    if sync:
                        grad_norm = torch.nn.utils.clip_grad_norm_(params.values(), args.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        if ema is not None:
                            for k, p in params.items():
                                ema[k].lerp_(p.detach(), 1 - args.ema_decay)
                        metrics["grad_norm"] = grad_norm.item()
        # ============================================ END OF TRAINING ============================================

        # ---- logging (global numbers: sums over ranks)
        ratio = torch.cat(stats["ratio"]) if stats["ratio"] else torch.ones(0, device=device)
        red = all_reduce(torch.stack([
            ratio.sum(), torch.tensor(float(len(ratio)), device=device),
            torch.cat(stats["clipfrac"]).sum() if stats["clipfrac"] else torch.zeros((), device=device),
            torch.cat(stats["approx_kl"]).sum() if stats["approx_kl"] else torch.zeros((), device=device),
            torch.stack(stats["kl"]).sum() if stats["kl"] else torch.zeros((), device=device),
            torch.stack(stats["loss"]).sum() if stats["loss"] else torch.zeros((), device=device),
            torch.tensor(float(nfe_rollout + nfe_train), device=device)]), world_size)
        ratio = ratio if len(ratio) else torch.ones(1, device=device)  # nothing trained: report 1
        rmin = all_reduce(ratio.min().reshape(1), world_size, dist.ReduceOp.MIN if world_size > 1 else None)
        rmax = all_reduce(ratio.max().reshape(1), world_size, dist.ReduceOp.MAX if world_size > 1 else None)
        count = red[1].clamp_min(1)
        nfe += int(red[6])
        metrics.update({
            "nfe": nfe, "ratio/mean": (red[0] / count).item(), "ratio/min": rmin.item(), "ratio/max": rmax.item(),
            "ratio/first_minibatch_max_dev": first_ratio_dev if first_ratio_dev is not None else 0.0,
            "clipfrac": (red[2] / count).item(), "approx_kl": (red[3] / count).item(), "kl": (red[4] / count).item(),
            "policy_loss": (red[5] / count).item(), "train/kept_transitions": int(red[1]),
            "time/rollout_s": timer.times.get("rollout", 0.0), "time/reward_s": timer.times.get("reward", 0.0),
            "time/train_s": timer.times.get("train", 0.0), "time/eval_s": timer.times.get("eval", 0.0),
            "time/elapsed_s": time.time() - t_start})
        if device.type == "cuda":
            metrics["mem/max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        logger.log(metrics, {"eval/samples": grid_img} if grid_img else None)
        bar.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}", acc=metrics.get("eval/accuracy", ""))

        # ---- checkpoint (rank 0 writes; every rank contributes its RNG state)
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.num_iterations:
            rngs = [None] * world_size
            if world_size > 1:
                dist.all_gather_object(rngs, rng_state())
            else:
                rngs = [rng_state()]
            if is_main:
                state = {"params": {k: p.detach().cpu() for k, p in params.items()}, "optimizer": optimizer.state_dict(),
                         "ema": {k: v.cpu() for k, v in ema.items()} if ema is not None else None,
                         "iteration": iteration + 1, "nfe": nfe, "rng": rngs, "args": asdict(args)}
                save_checkpoint(os.path.join(run_dir, "checkpoint"), state, save_weights)
            if world_size > 1:
                dist.barrier()

    # Every rank prints a checksum of its trained weights: under DDP they must be identical on all ranks.
    digest = __import__("hashlib").sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in params.values()))
    print(f"final weights: rank {rank} sha256 {digest.hexdigest()[:16]}", flush=True)
    if is_main:
        hist = logger.history()
        tr_pts = [(h["iteration"], h["train/reward_mean"]) for h in hist if "train/reward_mean" in h]
        ev_key = "eval/accuracy" if any("eval/accuracy" in h for h in hist) else "eval/reward_mean"
        ev_pts = [(h["iteration"], h[ev_key]) for h in hist if ev_key in h]
        series = {"train reward": tuple(map(list, zip(*tr_pts))) if tr_pts else ([], []),
                  ev_key: tuple(map(list, zip(*ev_pts))) if ev_pts else ([], [])}
        line_plot(series, os.path.join(run_dir, "learning_curve.png"), "iteration", "reward / accuracy", args.exp_name)
        print(f"run folder: {run_dir}")
    logger.close()
    if world_size > 1:
        dist.barrier()  # leave together: tearing gloo down while a peer still runs can abort that peer
        dist.destroy_process_group()
