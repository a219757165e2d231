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
from dataclasses import asdict, dataclass
from typing import Callable, Literal

import numpy as np
import torch
import tyro

from common import toyworld
from common.backbones import (
    LORA_TARGETS,
    check_model_path,
    check_resolution,
    load_backbone,
)
from common.checkpoint import resolve_run_dir, restore_checkpoint
from common.checks import (
    ConfigError,
    Rule,
    check_flag,
    check_ranges,
    check_sde_type,
    read_prompt_file,
)
from common.parallel import check_parallel, parallelize, set_grad_sync
from common.plots import line_plot
from common.policy import EMA, Trainable, ema_weights
from common.rewards import advantage_mix, check_rewards, load_rewards
from common.run import Run
from common.sampler import gaussian_kl, ode_along_paths, ratio_norm, sde_step_with_logprob
from common.training import GradShare, Stats, check_transitions, optimizer_step, plan_updates
from common.utils import (
    RunLogger,
    all_gather_cat,
    atomic_write,
    seed_everything,
    setup_distributed,
    truncate_metrics,
)

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
    """continue exactly from a run folder ({output_dir}/{run_name}: its latest complete checkpoint)
    or from one of its checkpoint-N folders; flags that define the experiment must match
    (docs/design.md)"""
    resume_override: bool = False
    """with --resume and changed experiment-defining flags: start a NEW run folder from the
    checkpoint's weights"""
    save_every: int = 10
    """save a checkpoint every N iterations (and at the end), as {run_dir}/checkpoint-{iteration}"""
    keep_checkpoints: int = 2
    """keep the newest K checkpoint-N folders (0 = all); older ones are deleted after a new one is
    complete"""

    # ---- backbone
    model_path: str = TOY_MODEL
    """local diffusers folder of SD3/SD3.5/FLUX.1 (default: the toy-world model shipped in the
    repo)"""
    resolution: int = 32
    """image height and width in pixels of every sampled image (rollout and evaluation); the latent
    tokens, and with them the cost of each transformer call, grow with its square"""
    max_sequence_length: int | None = None
    """T5 tokens in the text context (default: 128 for SD3, 512 for FLUX, 1 without T5)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (saves memory, costs ~30% time)"""
    mixed_precision: Literal["bf16", "fp16"] = "bf16"
    """dtype of the frozen weights and activations on CUDA (CPU: always fp32); trained weights stay
    fp32 masters and the VAE decodes in fp32. Flow-GRPO's SD3 code: fp16 (its FAQ: smaller log-prob
    error than bf16); FLUX: bf16"""
    full_finetune: bool = False
    """train every transformer weight instead of a LoRA (the KL reference is then a frozen copy)"""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """under torchrun: "ddp", every rank holds the whole model, its gradients and optimizer state;
    "fsdp" (FSDP2), each of N ranks holds 1/N of them, frozen weights too (full fine-tuning of
    FLUX.1-dev; docs/design.md, Sharding)"""
    fsdp_offload: bool = False
    """with --parallel fsdp: the shards, their gradients and the optimizer step live in host memory,
    not on the GPU"""
    lora_rank: int = 16
    """LoRA rank r: the width of the low-rank update trained on each targeted layer (its trained
    parameters and optimizer state grow with r); unused with --full-finetune"""
    lora_alpha: float = 32.0
    """LoRA alpha: the low-rank update is scaled by alpha / r, and with it (under Adam) the size of
    each step of the adapter; unused with --full-finetune"""
    lora_target: Literal["attention", "attention-ff", "all-linear"] = "all-linear"
    """which layers get a LoRA: the attention projections (Flow-GRPO's SD3 set), those and the
    feed-forward layers (Flow-GRPO's FLUX set), or every linear layer"""

    # ---- rollout
    prompts_file: str = str(toyworld.TRAIN_MIX_FILE)
    """training prompts, one per line, drawn uniformly over lines (toy world: each category equally
    often)"""
    num_steps: int = 10
    """denoising steps T of the rollout's sigma schedule, on which the trained steps lie (fewer:
    cheaper rollouts, coarser SDE steps); evaluation has its own, --eval-num-steps"""
    shift: float | None = None
    """timestep shift s of the sigma schedule, sigma -> s sigma / (1 + (s - 1) sigma): a larger s
    spends more steps at high noise (default: the model's scheduler config, 3 for SD3.5 and
    FLUX.1-dev). FLUX's pipeline grid ignores it (its shift is dynamic, set by the image size)
    unless a static grid is chosen (g2rpo.py: --sigma-grid official)"""
    guidance_scale: float = 1.0
    """guidance at rollout and in the training forward: SD3's classifier-free guidance w,
    v = v_u + w (v_c - v_u) (<= 1: no CFG, half the transformer work), or FLUX.1-dev's distilled
    guidance input (no CFG). Evaluation: --eval-guidance-scale"""
    detach_uncond: bool = False
    """stop the gradient through CFG's unconditional branch in the training forward. Off (the paper,
    and the released code except for a few days around commit ac4c86e): v = v_u + w (v_c - v_u) is
    differentiated whole, so the gradient is w dv_c - (w - 1) dv_u, that of log pi of the policy
    that sampled. On: only w dv_c (a different objective)"""
    noise_level: float = 0.7
    """a, the noise of the stochastic steps: std_dev_t = a*sqrt(sigma/(1-sigma)) (--sde-type cps:
    std sigma_next sin(a pi / 2)). Too little makes a group's samples alike, too much degrades them;
    where the script calibrates the noise per step (densegrpo.py: psi(t)), its starting value"""
    sde_type: Literal["sde", "cps"] = "sde"
    """the stochastic step: "sde", Flow-GRPO's SDE (common/sampler.py, E2-E3), or "cps",
    coefficients-preserving sampling (Wang & Yu 2025, arXiv 2509.05952; E6): std sigma_next
    sin(a pi / 2), a = --noise-level in [0, 1]. The released Flow-GRPO code runs CPS at a = 0.8
    (docs/flowgrpo.md, CPS)"""
    group_size: int = 8
    """G, the size of a group: samples of one prompt whose rewards are normalised against each other
    into advantages (a larger G steadies the group's mean and std)"""
    groups_per_iteration: int = 32
    """prompts per iteration over all ranks; each prompt's samples form its group(s). More prompts
    give each optimizer step a steadier gradient; each script's toy default was chosen by
    measurement at the same CPU budget (docs/results.md)"""
    rollout_batch_size: int = 16
    """latents per transformer call while sampling, per rank: speed against memory (toy: all at
    once; real models: what fits, e.g. 6); also the default of --train-batch-size"""

    # ---- reward
    reward: str = "toyworld"
    """reward name or weighted mix, e.g. "pickscore" or "pickscore:1.0,clipscore:0.5"
    (see common/rewards.py)"""
    reward_mix: Literal["score", "advantage"] = "score"
    """mix several rewards before (score) or after (advantage, as G2RPO) the group normalisation"""
    reward_model_paths: str = ""
    """where reward weights live, e.g. "pickscore=/models/PickScore_v1,clipscore=/models/clip" """
    guard_rewards: str = ""
    """extra rewards logged at evaluation only, to expose reward hacking, e.g.
    "aesthetic,clipscore" """

    # ---- algorithm (ALGO LOGIC)
    clip_range: float = 1e-4
    """PPO clip epsilon on the ratio (tiny because the log-prob is a per-element mean)"""
    adv_clip_max: float = 5.0
    """each transition's advantage, any sum over rewards or granularities included, is clipped to
    [-adv_clip_max, adv_clip_max]: it bounds the pull of a single sample"""
    beta: float = 0.0
    """weight of the KL penalty to the reference policy (the model with its LoRA off, or a frozen
    copy with --full-finetune); 0 = no KL and no reference forward"""
    global_std: bool = False
    """per timestep, divide by the std of all DeltaR of the iteration instead of each group's std
    (Eq. 10: group)"""
    std_eps: float = 1e-4
    """added to the std before the centred rewards are divided by it: bounds the advantages of a
    group whose rewards nearly agree (a group of exactly equal rewards gets 0 at any eps)"""
    timestep_fraction: float = 0.5
    """train on the first int(num_steps * fraction) steps (Flow-GRPO's code, which DenseGRPO builds
    on: 0.99, all but the last, near-deterministic step). Toy default 0.5, steps 0-4: trained on 9,
    the late low-noise steps, where the dense reward is 0 for 79-91 % of trajectories, make 95 % of
    the update (docs/densegrpo.md, "Where the update comes from")"""
    ratio_norm: Literal["off", "ratio", "guard"] = "off"
    """GRPO-Guard (Wang et al. 2025, arXiv 2510.22319): "ratio" clips a normalised log-ratio instead
    of the raw one (common/sampler.py, E7: its mean shift removed, its spread made independent of
    the step's noise); "guard" also divides each step's loss by |dt|, its gradient re-weighting, as
    the released scripts/train_sd3_GRPO_Guard.py. Needs --sde-type sde. On-policy (one optimizer
    step per iteration) the ratio is 1 either way and only the gradient's per-step weight changes
    (docs/flowgrpo.md, GRPO-Guard)"""
    drop_zero_advantage: bool = True
    """skip transitions whose advantage is exactly 0 (e.g. a group whose rewards all agree): their
    clipped policy term has no gradient, so they would cost a training forward and backward for
    nothing but their KL term (--beta > 0)"""
    completion_steps: int | None = 2
    """ODE steps n of each completion (Eq. 8): None = t, the rest of the rollout schedule (paper,
    `--completion-steps None`); 1 or 2 = a coarser grid to sigma = 0 (paper Fig. 6c: n = 2 is
    behind n = t and ahead of Flow-GRPO, n = 1 behind Flow-GRPO). Toy default 2: a fifth of t's
    completion NFE, for a reward about as predictive of the final one (docs/results.md)"""
    completion_batch_size: int = 64
    """completions advanced per transformer call in the staircase, per rank"""
    psi_scale: Literal["multiplier", "raw"] = "multiplier"
    """psi(t) replaces a in std_dev_t = psi(t) sqrt(sigma/(1-sigma)) (multiplier), or is std_dev_t
    itself (raw, Eq. 11 read literally; it starts at the baseline's std_dev_t and
    --calibration-step / --psi-bounds are scaled by sqrt(sigma/(1-sigma)) at each t, so both scales
    calibrate the same noise and differ only in the unit of psi)"""
    psi_file: str | None = None
    """a psi.json from an earlier run: use its psi(t) and skip the calibration"""
    calibration_iterations: int = 12
    """iterations K of Algorithm 1 (0 = no calibration: psi(t) = noise_level at every step). Toy
    default 12 x 16 trajectories, under 2 CPU minutes; the paper gives no K (see docs: the precision
    this buys)"""
    calibration_trajectories: int = 16
    """trajectories N per calibration iteration, over all ranks, each with its own random prompt"""
    calibration_step: float | None = None
    """epsilon_2, the largest move of psi(t) per iteration (default: 0.2 for share; 0.01, the
    paper's, otherwise)"""
    balance_test: Literal["share", "literal", "ratio", "fraction"] = "share"
    """the update rule of Algorithm 1: share psi += eps2 (#pos - #neg) / (#pos + #neg), which
    settles at #pos = #neg (balance); or the paper's psi += eps2 if balanced else -= eps2 with the
    test literal |#pos - #neg| < e (paper, e = 2), ratio max(#pos, #neg) < e min(#pos, #neg) (e = 2)
    or fraction |#pos - #neg| < e N (e = 1/3). A timestep whose DeltaR are all 0 holds its psi
    (literal: counts as balanced, as the paper). See docs"""
    balance_threshold: float | None = None
    """e of the balance test (default: 2 for literal and ratio, 1/3 for fraction; share has none)"""
    psi_bounds: tuple[float, float] | None = None
    """psi(t) is clamped to [low, high] after every calibration update, in units of the multiplier a
    (raw: times sqrt(sigma/(1-sigma))); must contain --noise-level, the start
    (default 0 1.5; 0 1 with --sde-type cps, whose a enters as sin(a pi / 2): past 1 more psi would
    mean less noise)"""
    calibration_average: int = 6
    """the calibrated psi(t) is the mean of the last this-many iterates (the iterates jitter by
    ~epsilon_2)"""

    # ---- optimisation
    num_iterations: int = 30
    """rollout + update iterations (0 = only evaluate the starting model). The toy defaults train
    for 1,200 to 1,500 CPU seconds on 2 cores (the README's table)"""
    learning_rate: float = 3e-4
    """AdamW learning rate (a LoRA needs a far larger one than a full fine-tune)"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    weight_decay: float = 1e-4
    """AdamW's decoupled weight decay of the trained weights"""
    max_grad_norm: float = 1.0
    """the gradient of each optimizer step is clipped to this global L2 norm before the step"""
    train_batch_size: int | None = None
    """stored states per training forward, per rank, each with every transition sampled from it
    (G²RPO: a group's G share one state x_k). Default: --rollout-batch-size (a batch shape unlike
    the rollout's can move the ratio off 1 in bf16)"""
    optimizer_steps_per_iteration: int = 1
    """optimizer steps per iteration: the micro-batches are accumulated into this many steps (in
    each update block where the rollout marks blocks: g2rpo.py --update-schedule per-k). Every step
    after the first is off-policy (ratio != 1), where --clip-range matters"""
    num_inner_epochs: int = 1
    """passes over the iteration's transitions"""
    ema_decay: float = 0.0
    """largest EMA decay of the trained weights, used for evaluation and saving
    (0 = off; Flow-GRPO: 0.9)"""
    ema_update_interval: int = 8
    """blend the EMA every N optimizer steps (Flow-GRPO: 8, so 0.9 averages over ~80 steps)"""
    ema_warmup: bool = True
    """EMA decay min((1 + s) / (10 + s), ema_decay) at optimizer step s, as Flow-GRPO; off:
    ema_decay throughout"""

    # ---- evaluation and logging
    eval_prompts: str = str(toyworld.TEST_FILE)
    """evaluation prompts, one per line (never trained on)"""
    eval_every: int = 10
    """evaluate every N iterations (and at the start and the end)"""
    grad_share_every: int = 0
    """diagnostic: every N iterations, split the update's gradient by trained step and log each
    step's share, g_j . g / |g|^2 (steps/grad_share/{step}, summing to 1; common/training.py
    GradShare). The update is unchanged; a measured iteration trains at a few times the cost; one
    process only. 0 = off"""
    eval_num_steps: int = 20
    """ODE steps at evaluation: a grid of its own, often finer than the rollouts' --num-steps"""
    eval_guidance_scale: float | None = None
    """guidance at evaluation (default: guidance_scale)"""
    eval_seeds_per_prompt: int = 2
    """images per evaluation prompt, each from a fixed seed"""
    eval_batch_size: int = 64
    """images per transformer call at evaluation"""
    final_eval_seeds_per_prompt: int | None = None
    """images per evaluation prompt at the final evaluation only (default: eval_seeds_per_prompt);
    more seeds give a smaller standard error where it matters (8 seeds x 100 prompts:
    SE <= 0.018)"""
    cpu_budget_s: float = 0.0
    """stop at the first iteration that starts after this many CPU seconds of the process (all
    threads), then run the final evaluation (0 = no budget; the comparison benchmark gives every
    algorithm the same budget)"""

    # ---- filled in at runtime
    world_size: int = 0
    """number of processes (torchrun ranks)"""
    resumed_from: str | None = None
    """the checkpoint folder this run was resumed from"""
    images_per_iteration: int = 0
    """the rollout's final images per iteration, over all ranks (groups_per_iteration * group_size;
    G²RPO: times |M| * |Λ|)"""
    images_per_rank: int = 0
    """images_per_iteration / world_size"""
    trained_steps: int = 0
    """steps of the schedule that are trained: int(num_steps * timestep_fraction), or
    sde_window_size (Flow-GRPO-Fast), or |M| (G²RPO's branch steps)"""


def check_args(args: Args, world_size: int) -> None:
    """Flag ranges and batch arithmetic, checked before any model is loaded. Every message says what
    to change."""
    check_ranges(args)  # common/checks.py: the numeric flags the scripts share
    check_parallel(args, world_size)  # common/parallel.py: --parallel fsdp needs torchrun
    args.world_size = world_size
    args.images_per_iteration = args.groups_per_iteration * args.group_size
    args.train_batch_size = args.train_batch_size or args.rollout_batch_size
    args.trained_steps = int(args.num_steps * args.timestep_fraction)
    # (A_i - mean) / (std + eps) is 0 / 0 for a group of equal rewards without eps (the shared table
    # allows 0 for G²RPO)
    check_flag(args, "std_eps", Rule(0, lo_open=True, why="a group of equal rewards has std 0"))
    if args.images_per_iteration % world_size:
        raise ConfigError(
            f"groups_per_iteration * group_size = {args.images_per_iteration} images cannot be "
            f"split evenly over {world_size} ranks; make it a multiple of {world_size}"
        )
    args.images_per_rank = args.images_per_iteration // world_size
    if args.images_per_rank % args.rollout_batch_size:
        raise ConfigError(
            f"each rank samples {args.images_per_rank} images, not a multiple of "
            f"--rollout-batch-size {args.rollout_batch_size}; pick a divisor of "
            f"{args.images_per_rank}"
        )
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
        "calibration_trajectories": Rule(
            1, integer=True, why="trajectories per calibration iteration"
        ),
        "calibration_step": Rule(
            0, lo_open=True, why="epsilon_2, the largest move of psi per iteration"
        ),
        "balance_threshold": Rule(0, lo_open=True, why="epsilon_1 of the balance test"),
    }
    for name, rule in calibration.items():
        check_flag(args, name, rule)
    if args.psi_file is not None and not os.path.isfile(args.psi_file):
        raise ConfigError(
            f"--psi-file '{args.psi_file}' does not exist: pass the psi.json of an earlier run"
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


# ALGO LOGIC: group-relative advantages (GRPO), Flow-GRPO's PerPromptStatTracker in a few lines.
def group_advantages(
    rewards: torch.Tensor, group: torch.Tensor, global_std: bool, eps: float
) -> torch.Tensor:
    """A_i = (r_i - mean of i's group) / std, std over all rewards (global_std) or over i's group.

    In float64, as the official stat tracker (numpy): in float32 the mean of a group tied at 0.3 or
    2/3 is rounded, and its members get advantages of 1e-7 to 3e-4 instead of 0. A tied group
    (max == min) gets exactly 0, so --drop-zero-advantage drops it. Returns float32."""
    r, n = rewards.double(), int(group.max()) + 1
    size = torch.bincount(group, minlength=n).double()
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, group, r) / size
    if global_std:
        std = r.std(unbiased=False).expand(n)  # population std, as np.std in Flow-GRPO
    else:
        std = (
            torch.zeros(n, dtype=torch.float64).index_add_(0, group, (r - mean[group]) ** 2) / size
        ).sqrt()
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, group, r, "amin")
    hi = torch.full((n,), -float("inf"), dtype=torch.float64).scatter_reduce(0, group, r, "amax")
    adv = torch.where((hi == lo)[group], 0.0, (r - mean[group]) / (std[group] + eps))
    return adv.float()


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


def sample_trajectories(
    backbone,
    emb,
    sigmas,
    noise_levels,
    n,
    batch_size,
    resolution,
    guidance_scale,
    gen,
    sde_type="sde",
):
    """SDE rollout exactly as the baseline's (same generator draws in the same order, so
    psi == noise_level gives the baseline's trajectories), with a noise level per step. Returns
    latents [T+1, n, ...] (index 0 = x_T, pure noise; index T = the SDE's image x_0), the rollout
    policy's log-probs [T, n] and the velocities v(latents[k], sigma_k) [T, n, ...] (kept: each is
    also the first Euler step of the completion from latents[k]) and the steps' means [T, n, ...]
    (the rollout policy's, for --ratio-norm)."""
    lat, lps, vels, mus = [], [], [], []
    for b in range(0, n, batch_size):
        m = min(batch_size, n - b)
        x = backbone.initial_noise(m, resolution, resolution, generator=gen)
        xs, lp, vs, ms = [x], [], [], []
        for j in range(len(sigmas) - 1):
            v = backbone.velocity(x, sigmas[j], emb[b : b + m], guidance_scale)
            x, log_prob, mean, _ = sde_step_with_logprob(
                v,
                x,
                sigmas[j],
                sigmas[j + 1],
                float(noise_levels[j]),
                generator=gen,
                sigma_max=sigmas[1],
                sde_type=sde_type,
            )
            xs.append(x)
            lp.append(log_prob)
            vs.append(v)
            ms.append(mean)
        lat.append(torch.stack(xs))
        lps.append(torch.stack(lp))
        vels.append(torch.stack(vs))
        mus.append(torch.stack(ms))
    return torch.cat(lat, 1), torch.cat(lps, 1), torch.cat(vels, 1), torch.cat(mus, 1)


def completion_grid(num_steps: int, k: int, n: int | None) -> list[int]:
    """Schedule indices of the ODE completion of the latent at index k (paper timestep t = T - k)
    down to sigma = 0 (Eq. 8). n None: all t remaining steps of the rollout grid
    (paper default n = t). n < t: the paper's sub-grid x_t -> ... -> x_{t, floor(t/n)} -> x_{t, 0},
    i.e. paper timesteps t, (n-1)s, ..., 2s, s, 0 with s = floor(t/n) (the first jump takes the
    remainder); n = 1 is the one-step x0 prediction. Index of paper timestep u: T - u."""
    t = num_steps - k
    m = t if n is None else min(n, t)
    return [k] + [num_steps - j * (t // m) for j in range(m - 1, -1, -1)]


@torch.no_grad()
def dense_rollout(
    backbone,
    reward_model,
    prompts: list[str],
    emb,
    sigmas,
    noise_levels,
    args,
    gen,
    upto: int | None = None,
) -> dict:
    """Sample one SDE trajectory per prompt and score every latent of it (Eq. 8-9).

    R[:, k] = R(ODE completion of latents[k]) for k < T, and R[:, T] = R(the SDE's own image):
    x_hat_{0,0} = x_0 needs no completion. Index k is the paper's timestep t = T - k, so R[:, 0]
    (the paper's R_T) is the reward of the plain ODE sample from the trajectory's initial noise.
    `upto` L: only the first L steps are trained, so only latents 0..L (and the SDE image, the last
    column) are scored: scores [n, >= L+2, K]. Returns latents, log_probs, scores [n, T+1, K]
    (upto None), and the NFE and sequential transformer calls of sampling and of the completions:
    nfe / calls = {"rollout": .., "completion": ..} (a CFG pair is one). Completion NFE per
    trajectory: sum_k (len(grid_k) - 1) - T (first steps reused)."""
    n, T = len(prompts), len(sigmas) - 1
    latents, log_probs, vels, means = sample_trajectories(
        backbone,
        emb,
        sigmas,
        noise_levels,
        n,
        args.rollout_batch_size,
        args.resolution,
        args.guidance_scale,
        gen,
        args.sde_type,
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
    run = [k for k in need[:-1] if not same[k]]
    # job m = r * n + i
    paths = [sigmas[grids[k]].to(latents.device) for k in run for _ in range(n)]
    prompt_of = torch.arange(n).repeat(len(run))
    # Staircase-batched Euler ODE (common/sampler.py); the first step of each reuses the SDE step's
    # v(x_k, sigma_k).
    clean, nfe, calls = ode_along_paths(
        lambda x, sig, rows: backbone.velocity(x, sig, emb[prompt_of[rows]], args.guidance_scale),
        latents[run].flatten(0, 1),
        paths,
        args.completion_batch_size,
        first_velocity=vels[run].flatten(0, 1),
    )
    # last: the SDE image (index T)
    clean = torch.cat([clean.view(len(run), *latents.shape[1:]), latents[T:]])
    images = torch.cat(
        [
            backbone.decode(c, args.resolution, args.resolution)
            for c in clean.flatten(0, 1).split(args.rollout_batch_size)
        ]
    )
    # k-major
    scores = reward_model(images, list(prompts) * (len(run) + 1)).view(len(run) + 1, n, -1)
    row = {T: len(run)}  # row of scores holding R_k
    for k in reversed(need[:-1]):
        row[k] = row[k + 1] if same[k] else run.index(k)
    return {
        "latents": latents,
        "log_probs": log_probs,
        "means": means,
        "scores": scores[[row[k] for k in need]].transpose(0, 1),  # [n, len(need), K]
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


def per_step_advantages(
    dR: torch.Tensor, group: torch.Tensor, global_std: bool, eps: float
) -> torch.Tensor:
    """Eq. 10: GRPO normalisation at each timestep separately, [N, T] -> [N, T] (column j over the
    groups)."""
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


def load_psi(path: str, num_steps: int, psi_scale: str, sde_type: str = "sde") -> dict:
    """A psi.json written by save_psi, checked against this run's schedule and step type (psi means
    another noise)."""
    try:
        with open(path) as f:
            info = json.load(f)
        psi = [float(p) for p in info["psi"]]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"--psi-file '{path}' is not a psi.json ({e.__class__.__name__}: {e}): expected JSON "
            "with a list 'psi' of one noise level per step, as a DenseGRPO run writes it; pass "
            "that file, or calibrate"
        ) from None
    if not all(math.isfinite(p) and p >= 0 for p in psi) or (sde_type == "cps" and max(psi) > 1):
        raise ConfigError(
            f"--psi-file '{path}': psi {psi} must be finite and >= 0 (at most 1 for --sde-type "
            "cps, where it is a in sin(a pi / 2)); pass a psi.json written by a DenseGRPO run, or "
            "calibrate"
        )
    have = len(psi), info.get("psi_scale"), info.get("sde_type", "sde")  # files before CPS: the SDE
    if have != (num_steps, psi_scale, sde_type):
        raise ConfigError(
            f"--psi-file '{path}' holds {have[0]} steps on the {have[1]} scale for --sde-type "
            f"{have[2]}; this run has --num-steps {num_steps}, --psi-scale {psi_scale} and "
            f"--sde-type {sde_type}: recalibrate or match"
        )
    return info


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
    # a resume takes the checkpoint's own copy (checkpoints before 2026-12-03 had none: the run
    # folder's psi.json)
    if resume_dir and not (args.resume_override and args.psi_file):
        saved = [
            os.path.join(resume_dir, "psi.json"),
            os.path.join(os.path.dirname(resume_dir), "psi.json"),
        ]
        psi_file = next((p for p in saved if os.path.isfile(p)), None)
        if psi_file is None:
            raise ConfigError(
                f"--resume {resume_dir}: neither the checkpoint nor its run folder holds psi.json "
                "(the calibrated psi(t)); add --resume-override --psi-file <the run's psi.json>"
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


def save_psi(run_dir: str, info: dict, psi0: torch.Tensor, average: int) -> None:
    """psi.json (reused with --psi-file) and psi.png: psi(t) and the fraction of positive DeltaR_t
    in calibration."""
    atomic_write(os.path.join(run_dir, "psi.json"), json.dumps(info, indent=1))  # never half a file
    T, last = len(info["psi"]), info["history"][-average:]
    ts = list(range(T, 0, -1))  # paper timestep of code step j
    series = {"psi(t) calibrated": (ts, info["psi"]), "psi(t) initial": (ts, psi0.tolist())}
    if last:
        # positive share of the nonzero DeltaR_t over the averaged iterations (None: none was
        # nonzero)
        counts = [
            np.sum([[h["pos"][j], h["pos"][j] + h["neg"][j]] for h in last], 0) for j in range(T)
        ]
        frac = [float(p / n) if n else None for p, n in counts]
        series["positive fraction of nonzero dR"] = (ts, frac)
    line_plot(
        series,
        os.path.join(run_dir, "psi.png"),
        "paper timestep t (T = first step)",
        "psi / fraction",
        f"calibration, rule {info.get('balance_test')}",
    )


# ============================ SHARED: the log-prob of a stored step (same in all three scripts) ===
def step_log_prob(backbone, model, tr: dict, mb, emb, sigmas: torch.Tensor, args):
    """log pi(x_next | x_t, c) of the micro-batch's stored SDE steps under `model` (E2-E3), with the
    step Gaussian's mean and std_dev_t: the policy's (with gradient) or, with
    model=trainable.reference, the KL reference's. As CleanRL's get_action_and_value: one forward
    per state (`mb.states`), its velocity handed to every transition that starts from that state
    (`mb.rows`; G²RPO's G branches share one), and the stored action scored, not drawn."""
    s, r = mb.states, mb.rows
    # CFG inside the training forward; --detach-uncond stops the gradient of the unconditional
    # branch
    v = backbone.velocity(
        tr["latents"][s],
        tr["sigma"][s],
        emb[tr["prompt_index"][s]],
        args.guidance_scale,
        model=model,
        detach_uncond=args.detach_uncond,
    )[mb.expand]
    _, log_prob, mean, std_dev_t = sde_step_with_logprob(
        v,
        tr["latents"][r],
        tr["sigma"][r],
        tr["sigma_next"][r],
        tr["noise_level"][r],
        prev_sample=tr["next_latents"][r],
        sigma_max=sigmas[1],
        sde_type=args.sde_type,
    )
    return log_prob, mean, std_dev_t


# ================================================= END OF SHARED ==================================


if __name__ == "__main__":
    args = tyro.cli(Args)
    # ---- cheap checks first: bad input costs one line, not a model load
    train_prompts = read_prompt_file(args.prompts_file, "--prompts-file")
    eval_prompts = read_prompt_file(args.eval_prompts, "--eval-prompts")
    prompt_files = {"--prompts-file": train_prompts, "--eval-prompts": eval_prompts}
    # names, paths, prompts
    check_rewards(args.reward, args.guard_rewards, args.reward_model_paths, prompt_files)
    check_resolution(
        args.model_path, check_model_path(args.model_path), args.resolution, args.resolution
    )
    rank, world_size, device = setup_distributed()
    check_args(args, world_size)
    is_main = rank == 0
    seed_everything(args.seed, args.torch_deterministic)
    # --resume: checkpoint verified, flags compared
    run_dir, resume_dir = resolve_run_dir(args, __file__, is_main)
    if is_main:
        print(
            "batch arithmetic: "
            + ", ".join(
                f"{k}={getattr(args, k)}"
                for k in (
                    "world_size",
                    "groups_per_iteration",
                    "group_size",
                    "images_per_iteration",
                    "images_per_rank",
                    "rollout_batch_size",
                    "train_batch_size",
                    "trained_steps",
                    "optimizer_steps_per_iteration",
                )
            )
        )

    # ---- the rewards first: a missing weight file costs seconds, not a model load
    reward_model, guard_model = load_rewards(
        args.reward, args.guard_rewards, args.reward_model_paths, device
    )

    # ---- backbone, trained weights (common/policy.py: LoRA or full, and the KL reference),
    #      optimizer, EMA
    backbone = load_backbone(
        args.model_path,
        device,
        max_sequence_length=args.max_sequence_length,
        gradient_checkpointing=args.gradient_checkpointing,
        precision=args.mixed_precision,
        shard=args.parallel == "fsdp",
    )
    trainable = Trainable(
        backbone,
        args.full_finetune,
        args.lora_rank,
        args.lora_alpha,
        LORA_TARGETS[args.lora_target],
        need_reference=args.beta > 0,
    )
    # DDP or FSDP2: common/parallel.py
    policy = parallelize(trainable, args.parallel, world_size, args.fsdp_offload)
    params = trainable.params
    optimizer = torch.optim.AdamW(
        params.values(),
        lr=args.learning_rate,
        betas=args.adam_betas,
        weight_decay=args.weight_decay,
        eps=1e-8,
    )
    ema = (
        EMA(params, args.ema_decay, args.ema_update_interval, args.ema_warmup)
        if args.ema_decay > 0
        else None
    )

    logger = RunLogger(
        run_dir,
        is_main,
        args.track,
        asdict(args),
        args.wandb_project_name,
        args.wandb_entity,
        os.path.basename(run_dir),
    )
    start_iteration, counts = 0, None  # counts: cumulative over all ranks (common/run.py)
    if resume_dir:
        # the weights, the optimizer, the EMA and this rank's RNG, as they were saved
        start_iteration, counts = restore_checkpoint(
            resume_dir, rank, params, optimizer, ema, policy
        )
        if is_main:
            truncate_metrics(run_dir, start_iteration)

    sigmas = backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)

    # ---- ALGO LOGIC: psi(t) once, then frozen: Algorithm 1 with the starting model, or from
    #      --psi-file / the checkpoint
    info, calib_metrics = calibrate_or_load_psi(
        args, backbone, reward_model, train_prompts, sigmas, resume_dir, rank, world_size, device
    )
    psi = torch.tensor(info["psi"], dtype=torch.float32)
    # the sampler's noise_level of each step
    noise_levels = step_noise_levels(psi, sigmas, args.psi_scale)
    if is_main:
        save_psi(
            run_dir,
            info,
            args.noise_level * psi_unit(sigmas, args.psi_scale),
            args.calibration_average,
        )

    def save_weights(folder):
        # into each checkpoint: the trained weights, and psi(t), so a resume needs nothing else
        with ema_weights(ema):
            trainable.save_weights(folder)
        if is_main:
            atomic_write(os.path.join(folder, "psi.json"), json.dumps(info, indent=1))

    run = Run(args, run_dir, rank, world_size, device, logger, counts, start_iteration, __file__)
    for iteration in range(start_iteration, args.num_iterations + 1):
        metrics = {"iteration": iteration}
        last = run.is_last(iteration)  # --num-iterations reached, or the CPU budget spent
        if iteration % args.eval_every == 0 or last:
            metrics.update(
                run.evaluate(
                    iteration, last, backbone, reward_model, guard_model, eval_prompts, ema
                )
            )
        if last:
            run.log_final(metrics)
            break

        # ================================ ROLLOUT: sample groups and build transitions ============
        # ALGO LOGIC. Flow-GRPO spreads each group over the ranks: all ranks draw the same prompts
        # and the same shuffle (a generator seeded by the iteration), and rank r keeps slice r.
        # Seeding by iteration also makes a resumed run sample exactly what the uninterrupted run
        # would have. DenseGRPO keeps that: each rank scores its own trajectories at every timestep,
        # and the per-timestep rewards [N, T+1] are gathered for the groups.
        with run.timer("rollout"):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
            prompt_ids = torch.randint(
                len(train_prompts), (args.groups_per_iteration,), generator=g
            )
            group = torch.arange(args.groups_per_iteration).repeat_interleave(args.group_size)
            # group id of every image, global order
            group = group[torch.randperm(len(group), generator=g)]
            mine = slice(rank * args.images_per_rank, (rank + 1) * args.images_per_rank)
            my_prompts = [train_prompts[prompt_ids[k]] for k in group[mine]]
            emb = backbone.encode(my_prompts)
            gen = torch.Generator(device).manual_seed(
                args.seed * 1_000_003 + iteration * 1009 + rank
            )
            # SDE trajectories with psi(t), T ODE completions each (staircase-batched), T+1 rewards
            # each (Eq. 8-9): R of latents 0..L (+ the SDE image's)
            out = dense_rollout(
                backbone,
                reward_model,
                my_prompts,
                emb,
                sigmas,
                noise_levels,
                args,
                gen,
                upto=args.trained_steps,
            )
            rollout_counts = {
                "trajectories": len(my_prompts),  # every needed latent of a trajectory is scored:
                "scored_images": len(my_prompts) * out["scores"].shape[1],
                "nfe/rollout": out["nfe"]["rollout"],
                "nfe/completion": out["nfe"]["completion"],
            }
        with run.timer("reward"):
            # [N, L+2 or T+1, K], global
            all_scores = all_gather_cat(out["scores"].to(device), world_size).cpu()
            if not torch.isfinite(all_scores).all():
                raise SystemExit(
                    f"error: non-finite reward at iteration {iteration}; stopping before any "
                    f"update (the last checkpoint-N in {run_dir} is intact: --resume {run_dir})"
                )
            mixed = reward_model.mix(all_scores)  # column 0: the ODE image, last: the SDE image
            L = args.trained_steps
            dR = dense_step_rewards(mixed[:, : L + 1])  # [N, L], Eq. 7: the trained steps
            if args.reward_mix == "score":
                advantages = per_step_advantages(dR, group, args.global_std, args.std_eps)  # Eq. 10
            else:
                # normalise each reward's DeltaR within its groups per timestep, then mix the
                # advantages
                dR_k = dense_step_rewards(all_scores[:, : L + 1])  # [N, L, K]
                per_reward = torch.stack(
                    [
                        per_step_advantages(dR_k[..., k], group, args.global_std, args.std_eps)
                        for k in range(all_scores.shape[2])
                    ],
                    2,
                )
                advantages = advantage_mix(per_reward.flatten(0, 1), reward_model.weights).view(
                    dR.shape
                )
            advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)
            # a noise-free step is no action (log-prob 0 whatever theta)
            advantages[:, noise_levels[:L] == 0] = 0
            sde_reward = mixed[:, -1]  # R of the SDE image, the trajectory's own
            group_std = torch.stack(
                [
                    sde_reward[group == k].std(unbiased=False)
                    for k in range(args.groups_per_iteration)
                ]
            )
            # Transitions: every trained step of every trajectory, each with its own timestep's
            # advantage. Samples whose advantages are all 0 have only zero-advantage transitions,
            # which the training section drops.
            n_traj = args.images_per_rank
            step_index, trajectory = (
                torch.arange(L).repeat_interleave(n_traj),
                torch.arange(n_traj).repeat(L),
            )
            transitions = {  # step-major: row j * n + i is step j of trajectory i
                "latents": out["latents"][:L].flatten(0, 1),
                "next_latents": out["latents"][1 : L + 1].flatten(0, 1),
                "log_prob": out["log_probs"][:L].flatten(),
                "mean": out["means"][:L].flatten(0, 1),
                "sigma": sigmas[step_index],
                "sigma_next": sigmas[step_index + 1],
                "noise_level": noise_levels[step_index],
                "advantage": advantages[mine][trajectory, step_index],
                "prompt_index": trajectory,
                "step_index": step_index,
                "trajectory": trajectory,
            }
            metrics.update(
                {
                    "train/reward_mean": sde_reward.mean().item(),
                    "train/reward_std": sde_reward.std().item(),
                    "train/group_std_mean": group_std.mean().item(),
                    "train/zero_std_frac": (group_std == 0).float().mean().item(),
                    # R_T: the ODE image, same noise
                    "train/reward_ode_mean": mixed[:, 0].mean().item(),
                    "train/dR_abs_mean": dR.abs().mean().item(),
                    "train/dR_zero_frac": (dR == 0).float().mean().item(),
                    "train/zero_adv_sample_frac": (advantages[:, :L] == 0)
                    .all(1)
                    .float()
                    .mean()
                    .item(),
                    "rollout/completion_nfe": out["nfe"]["completion"],
                    "rollout/completion_calls": out["calls"]["completion"],
                    "rollout/transformer_calls": sum(out["calls"].values()),
                }
            )
            for j in range(L):
                # the dense reward of each trained step: its size, how often it is 0, its sign
                # balance
                metrics[f"steps/dR_abs/{j}"] = dR[:, j].abs().mean().item()
                metrics[f"steps/dR_zero/{j}"] = (dR[:, j] == 0).float().mean().item()
                pos, neg = int((dR[:, j] > 0).sum()), int((dR[:, j] < 0).sum())
                if pos + neg:
                    metrics[f"train/dR_pos_frac/t{args.num_steps - j}"] = pos / (pos + neg)
            if iteration == start_iteration:
                metrics.update(calib_metrics)
        del out
        # ============================== END OF ROLLOUT (the scripts differ only above) ============

        # ============================ TRAINING on transitions (same in all three scripts) =========
        # ALGO LOGIC: the PPO-clipped GRPO objective (Flow-GRPO §4) on single SDE steps, found as in
        # CleanRL's update: log-prob of the stored step under the current policy, ratio, clipped
        # loss, KL. The contract of `transitions` (fields, shapes, order) is checked here and listed
        # in docs/design.md; the micro-batch plan and the metric sums are plumbing in
        # common/training.py.
        with run.timer("train"):
            tr = {
                k: v.to(device)
                for k, v in check_transitions(transitions, sigmas, len(my_prompts)).items()
            }
            keep = (
                tr["advantage"] != 0
                if args.drop_zero_advantage
                else torch.ones_like(tr["advantage"], dtype=bool)
            )
            stats = Stats(num_slots=args.num_steps)
            # share kept, per step
            stats.add(torch.ones_like(tr["advantage"]), tr["step_index"], kept=keep.float())
            plan = plan_updates(
                keep,
                args.train_batch_size,
                args.optimizer_steps_per_iteration,
                world_size,
                tr.get("state_index"),
                tr.get("update_block"),
                epochs=args.num_inner_epochs,
            )
            # the diagnostic, if asked
            measured = args.grad_share_every > 0 and iteration % args.grad_share_every == 0
            grad_share = GradShare(params, args.num_steps, active=measured)
            for mb in plan:
                # micro-batches in order; the last one of each optimizer step has mb.sync
                r = mb.rows  # the micro-batch's transitions; every one gets its own loss
                # only the last micro-batch of an optimizer step syncs gradients
                set_grad_sync(policy, mb.sync)
                log_prob, mean, std_dev_t = step_log_prob(
                    backbone, policy, tr, mb, emb, sigmas, args
                )
                log_ratio = log_prob - tr["log_prob"][r]  # new over rollout policy, one step
                if args.ratio_norm != "off":
                    # GRPO-Guard: re-centred, noise-independent log-ratio (E7)
                    log_ratio = ratio_norm(
                        log_ratio,
                        mean,
                        tr["mean"][r],
                        std_dev_t,
                        tr["sigma"][r],
                        tr["sigma_next"][r],
                    )
                ratio = torch.exp(log_ratio)
                adv = tr["advantage"][r]
                clipped = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                policy_loss = torch.maximum(-adv * ratio, -adv * clipped)
                if args.ratio_norm == "guard":
                    # and its gradient re-weighting: every step's loss / |dt|
                    policy_loss = policy_loss / (tr["sigma"][r] - tr["sigma_next"][r])
                # KL to the reference policy on the step's Gaussian means (sampler E5); beta = 0: no
                # reference forward
                kl = (
                    gaussian_kl(
                        mean,
                        step_log_prob(backbone, trainable.reference, tr, mb, emb, sigmas, args)[1],
                        std_dev_t,
                    )
                    if args.beta > 0
                    else torch.zeros_like(policy_loss)
                )
                loss = ((policy_loss + args.beta * kl) * mb.weight).sum() / mb.divisor
                # --grad-share-every: each trained step's part of this gradient (on the measured
                # iterations only)
                grad_share.add(
                    (policy_loss + args.beta * kl) * mb.weight / mb.divisor, tr["step_index"][r]
                )
                loss.backward()
                # on-policy: ratio == 1 before any update
                stats.keep_first(ratio_dev=(ratio.detach() - 1).abs().max())
                stats.add(
                    mb.weight,
                    tr["step_index"][r],
                    ratio=ratio,
                    ratio_sq=ratio**2,
                    kl=kl,
                    abs_adv=adv.abs(),
                    clipfrac=((ratio - 1).abs() > args.clip_range).float(),
                    policy_loss=policy_loss,
                    approx_kl_k2=0.5 * (log_prob - tr["log_prob"][r]) ** 2,
                )
                stats.add_extremes(mb.weight, ratio=ratio)
                stats.count(
                    **{
                        "nfe/train_forward": len(mb.states) * (2 if args.beta > 0 else 1),
                        "nfe/train_backward": len(mb.states),
                    }
                )
                if mb.sync:
                    # its gradient is complete: clip, step (a non-finite one stops the run in one
                    # line)
                    grad_norm = optimizer_step(
                        params, optimizer, args.max_grad_norm, ema, iteration, run_dir
                    )
                    stats.count(grad_norm=grad_norm, optimizer_steps=1)
        # ============================================ END OF TRAINING =============================

        run.log(metrics, stats, rollout_counts, grad_share)
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.num_iterations:
            run.checkpoint(iteration + 1, params, optimizer, ema, policy, save_weights)

    run.finish(params)
