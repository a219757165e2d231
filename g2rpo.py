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

import math
import os
from dataclasses import asdict, dataclass
from typing import Literal

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
from common.checks import ConfigError, check_ranges, check_sde_type, read_prompt_file
from common.parallel import check_parallel, parallelize, set_grad_sync
from common.policy import EMA, Trainable, ema_weights
from common.rewards import advantage_mix, check_rewards, load_rewards
from common.run import Run
from common.sampler import gaussian_kl, ode_along_paths, ode_step, ratio_norm, sde_step_with_logprob
from common.training import GradShare, Stats, check_transitions, optimizer_step, plan_updates
from common.utils import (
    RunLogger,
    all_gather_cat,
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
    sigma_grid: Literal["pipeline", "official"] = "pipeline"
    """the sigma grid of rollouts and training: the stock pipeline's (FLUX: dynamic shift,
    sigma_7 = 0.741 at T = 16, 720 px) or the released G2RPO code's static shift on
    linspace(1, 0, T+1) (sigma_7 = 0.794). Evaluation always uses the pipeline's grid, as the
    released code evaluates with a stock FluxPipeline"""
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
    groups_per_iteration: int = 12
    """prompts per iteration over all ranks; each prompt's samples form its group(s). More prompts
    give each optimizer step a steadier gradient; each script's toy default was chosen by
    measurement at the same CPU budget (docs/results.md)"""
    rollout_batch_size: int = 64
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
    branch_steps: tuple[int, ...] = (0, 1, 2)
    """M: schedule indices k whose SDE step is branched and trained (0 = the first, noisiest step).
    Toy default 0 1 2, the first 3 of 10 steps: 1.45x the iterations of the first half for a CPU
    second, and it learned more per image (docs/results.md); paper: the first half,
    the 8 steps M = {16, ..., 9} of T = 16, i.e. --branch-steps 0 1 2 3 4 5 6 7 (the released code's
    --eta_step_list)"""
    granularities: tuple[int, ...] = (1, 2, 3)
    """Λ: every branch is also finished on every λ-th step of the rest of the schedule
    (paper: 1 2 3; scripts: 1 2)"""
    official_coarse_schedule: bool = False
    """fidelity: finish branches as the released code does (one fine step, then every λ-th index,
    and the image is the x0-prediction at the last model call, i.e. from a non-zero sigma
    when λ does not divide the rest); default: every λ-th step from the branch's sigma and always a
    last Euler step to sigma = 0. Same NFE either way"""
    update_schedule: Literal["accumulate", "per-k"] = "accumulate"
    """one optimizer step over all branch steps (the paper's (1/|M|) sum, default) or one per k (the
    released hps script; the shared training section honours transitions["update_block"])"""
    clip_range: float = 1e-4
    """PPO clip epsilon on the ratio (tiny because the log-prob is a per-element mean)"""
    adv_clip_max: float = 5.0
    """each transition's advantage, any sum over rewards or granularities included, is clipped to
    [-adv_clip_max, adv_clip_max]: it bounds the pull of a single sample"""
    beta: float = 0.0
    """weight of the KL penalty to the reference policy (the model with its LoRA off, or a frozen
    copy with --full-finetune); 0 = no KL and no reference forward"""
    std_eps: float = 1e-8
    """added to the std before the centred rewards are divided by it: bounds the advantages of a
    group whose rewards nearly agree (a group of exactly equal rewards gets 0 at any eps)"""
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

    # ---- optimisation
    num_iterations: int = 39
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
    prompts_per_rank: int = 0
    """groups_per_iteration / world_size: a prompt's groups never span ranks (as the official
    code)"""
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
    args.train_batch_size = args.train_batch_size or args.rollout_batch_size
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
    if args.shift is not None and args.shift <= 0:
        raise ConfigError(
            f"--shift {args.shift}: the timestep shift must be positive (the released code: 3)"
        )
    args.prompts_per_rank = args.groups_per_iteration // world_size
    args.images_per_rank = (
        args.prompts_per_rank * args.trained_steps * len(args.granularities) * args.group_size
    )
    args.images_per_iteration = args.images_per_rank * world_size


# ALGO LOGIC: which sigmas a branch born at step k walks through to its image, at granularity λ.
def completion_schedule(k: int, lam: int, num_steps: int, official: bool = False) -> list[int]:
    """Schedule indices from k+1 (where the SDE step of step k lands) to num_steps (sigma = 0),
    every λ-th one.

    Default: k+1, k+1+λ, k+1+2λ, ... and a last, shorter Euler step to num_steps when λ does not
    divide the rest, so every image is a finished ODE solution. official=True copies the released
    code: one fine step k+1 -> k+2, then every λ-th index from k+2; its image is
    x0_hat = x - sigma v at the last model call, which is an Euler step straight to sigma = 0, so we
    replace the last index by num_steps. Both take ceil((T - k - 1) / λ) model calls.
    """
    if official:
        idx = [k + 1] + list(range(k + 2, num_steps + 1, lam))
        return idx[:-1] + [num_steps] if len(idx) > 1 else idx
    idx = list(range(k + 1, num_steps + 1, lam))
    return idx if idx[-1] == num_steps else idx + [num_steps]


def rollout_nfe(num_steps: int, branch_steps, group_size: int, granularities) -> int:
    """Closed-form velocity evaluations of one group's rollout (per prompt; a CFG pair counts as
    one, as the baseline):

        NFE = (max M + 1) + G * sum_{k in M} sum_{λ in Λ} ceil((T - k - 1) / λ)

    The anchor evaluates v at its states 0..max M; the branch step at k reuses the anchor's v at k
    (so the shared state costs no extra call: the official code spends G calls there); each
    completion costs its schedule's steps. Paper setting (T=16, M=0..7, G=12, Λ={1,2,3}):
    8 + 12 * 173 = 2084 (the official code: 16 + 12 * 181 = 2188). Training adds |M| forwards and
    |M| backwards per prompt, one per shared state x_k, in both (docs/g2rpo.md).
    """
    comp = sum(math.ceil((num_steps - k - 1) / lam) for k in branch_steps for lam in granularities)
    return max(branch_steps) + 1 + group_size * comp


@torch.no_grad()
def anchor_trajectory(velocity, x, sigmas, last: int, batch: int):
    """The deterministic ODE (E1) from the shared x_T to x_last: states[j] and the velocity
    v(states[j], sigma_j).

    velocity(x, sigma, prompt_index) -> v. One row per prompt: the whole group shares this
    trajectory, so the velocity at a branch state is computed once per prompt here, not once per
    member.
    """
    states, vels, rows = [], [], torch.arange(len(x))
    for j in range(last + 1):
        v = torch.cat(
            [
                velocity(x[b : b + batch], sigmas[j], rows[b : b + batch])
                for b in range(0, len(x), batch)
            ]
        )
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
    shared noise).

    For each k in M: G SDE steps (E3; --sde-type cps: E6) from the anchor state x_k, with the
    anchor's velocity at x_k; then every branch is finished by the ODE at every granularity. Returns
      latents [K, P, ...]        the shared state before each branch step (the transitions' latents)
      next_latents [K, P, G, ...] and log_prob [K, P, G]: the SDE steps, the only ones that carry
                                 the loss
      final [P, K, L, G, ...]    the clean latents to decode and score (K = |M|, L = |Λ|)
      nfe                        velocity evaluations counted while running (P * rollout_nfe(...);
                                 G = 1 at noise 0)
    """
    P, K, L, G, T = len(x_T), len(branch_steps), len(granularities), group_size, len(sigmas) - 1
    # At noise_level 0 the G branches are one deterministic computation: run it once and copy it.
    # Batched kernels do not promise equal outputs for equal rows (a row's result can depend on its
    # place in the batch), and a z-score would blow such 1e-7 differences up into O(1) advantages.
    n = G if noise_level > 0 else 1
    states, vels = anchor_trajectory(velocity, x_T, sigmas, max(branch_steps), batch)
    nfe = P * (max(branch_steps) + 1)
    latents, next_latents, log_prob, means = [], [], [], []
    for k in branch_steps:  # every k branches from the same anchor (not from another k's branch)
        x, v = states[k].repeat_interleave(n, 0), vels[k].repeat_interleave(n, 0)
        y, lp, mu, _ = sde_step_with_logprob(
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
        next_latents.append(y.view(P, n, *y.shape[1:]))
        log_prob.append(lp.view(P, n))
        means.append(mu.view(P, n, *mu.shape[1:]))
    next_latents = torch.stack(next_latents)  # [K, P, n, ...]
    # One completion job per (prompt, k, λ, member), in that order (prompt outermost, so a
    # rank-major gather of the rewards lists prompts in global order).
    start = next_latents.transpose(0, 1).unsqueeze(2).expand(P, K, L, n, *next_latents.shape[3:])
    paths = [
        sigmas[completion_schedule(k, lam, T, official)]
        for k in branch_steps
        for lam in granularities
    ]
    paths = [p for _ in range(P) for p in paths for _ in range(n)]
    prompt_index = torch.arange(P).repeat_interleave(K * L * n)
    # Euler ODE (E1) of every row along its own path, staircase-batched (common/sampler.py)
    final, nfe_ode, _ = ode_along_paths(
        lambda x, s, rows: velocity(x, s, prompt_index[rows]),
        start.reshape(P * K * L * n, *start.shape[4:]),
        paths,
        batch,
    )
    final = final.view(P, K, L, n, *final.shape[1:])
    return {
        "latents": torch.stack(latents),
        "next_latents": next_latents.expand(K, P, G, *next_latents.shape[3:]),
        "log_prob": torch.stack(log_prob).expand(K, P, G),
        "mean": torch.stack(means).expand(K, P, G, *next_latents.shape[3:]),
        "final": final.expand(P, K, L, G, *final.shape[4:]),
        "nfe": nfe + nfe_ode,
    }


# ALGO LOGIC: MGAI (paper Eqs. 10-12), the advantage of each branch step from its rewards at every
# granularity.
def mgai_advantages(rewards: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """rewards [..., K, L, G, R] (branch step, granularity, member, reward model) -> advantages
    [..., K, G].

    A_k^i = sum_m w_m sum_λ (r - mean_G r) / (std_G r + eps), std unbiased (torch's default,
    as the official code), one normalisation per (k, λ, reward). Computed in float64, where the std
    of G equal float32 rewards is exactly 0 (in float32 the rounding of their mean, divided by its
    own ~1e-8 std, gives a tied group advantages up to ~0.9).
    """
    r = rewards.double()
    std = r.std(-2, keepdim=True)
    # equal rewards: 0, also at eps = 0
    z = torch.where(std > 0, (r - r.mean(-2, keepdim=True)) / (std + eps), 0.0)
    z = z.sum(-3)  # sum over granularities -> [..., K, G, R]
    return advantage_mix(z.reshape(-1, z.shape[-1]), weights).view(z.shape[:-1])


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

    def save_weights(folder):
        with ema_weights(ema):
            trainable.save_weights(folder)

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

    sigmas = backbone.schedule(
        args.num_steps, args.resolution, args.resolution, args.shift, grid=args.sigma_grid
    )

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
        # ALGO LOGIC. G²RPO keeps each group on one rank (as the official code, one prompt per GPU):
        # all ranks draw the same prompts (a generator seeded by the iteration) and rank r keeps
        # slice r. The noise is seeded by (seed, iteration, rank), so a resumed run samples exactly
        # what the uninterrupted run would have.
        with run.timer("rollout"):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
            prompt_ids = torch.randint(
                len(train_prompts), (args.groups_per_iteration,), generator=g
            )
            mine = slice(rank * args.prompts_per_rank, (rank + 1) * args.prompts_per_rank)
            my_prompts = [train_prompts[i] for i in prompt_ids[mine]]
            emb = backbone.encode(my_prompts)
            gen = torch.Generator(device).manual_seed(
                args.seed * 1_000_003 + iteration * 1009 + rank
            )
            M, Lam, G = args.branch_steps, args.granularities, args.group_size
            # 1/group
            x_T = backbone.initial_noise(
                len(my_prompts), args.resolution, args.resolution, generator=gen
            )
            roll = singular_stochastic_rollout(
                lambda x, s, p: backbone.velocity(x, s, emb[p], args.guidance_scale),  # noqa: B023 (called right here)
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
            # the anchor's calls; the rest are completions
            anchor_nfe = len(my_prompts) * (max(M) + 1)
            # nfe/rollout + nfe/completion = prompts_per_rank * rollout_nfe(...)
            rollout_counts = {
                # a group: G branches at each k, scored at each λ
                "trajectories": len(my_prompts) * G,
                "scored_images": args.images_per_rank,
                "nfe/rollout": anchor_nfe,
                "nfe/completion": roll["nfe"] - anchor_nfe,
            }
        with run.timer("reward"):
            # clean latents, one image per (prompt, k, λ, member)
            clean = roll.pop("final").flatten(0, 3)
            job_prompts = [p for p in my_prompts for _ in range(len(M) * len(Lam) * G)]
            bs = args.rollout_batch_size
            # [n, R] raw scores, one column per reward
            scores = torch.cat(
                [
                    reward_model(
                        backbone.decode(clean[b : b + bs], args.resolution, args.resolution),
                        job_prompts[b : b + bs],
                    )
                    for b in range(0, len(clean), bs)
                ]
            )
            # rank-major = global prompt order
            all_scores = all_gather_cat(scores.to(device), world_size).cpu()
            if not torch.isfinite(all_scores).all():
                raise SystemExit(
                    f"error: non-finite reward at iteration {iteration}; stopping before any "
                    f"update (the last checkpoint-N in {run_dir} is intact: --resume {run_dir})"
                )
            # [prompt, k, λ, member, R]
            table = all_scores.view(args.groups_per_iteration, len(M), len(Lam), G, -1)
            mixed = reward_model.mix(all_scores).view(table.shape[:-1])
            if args.reward_mix == "score":  # mix the raw scores, then MGAI on the mix
                advantages = mgai_advantages(mixed.unsqueeze(-1), torch.ones(1), args.std_eps)
            else:  # MGAI per reward model, then the weighted sum (the official A_HPS + A_CLIP)
                advantages = mgai_advantages(table, reward_model.weights, args.std_eps)
            # [prompt, k, member]
            advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)
            # Transitions: only the SDE step of each branch, ordered (k, prompt, member), with its
            # MGAI advantage. The G members of (k, prompt) start from one state x_k: state_index
            # names it, and training runs one forward per state (so --train-batch-size counts
            # states), every member keeping its own log-prob, ratio and loss.
            n_prompts, n_trans = len(my_prompts), len(M) * len(my_prompts) * G
            step_index = torch.tensor(M).repeat_interleave(n_prompts * G)
            transitions = {
                # the shared state x_k
                "latents": roll["latents"].repeat_interleave(G, 1).flatten(0, 1),
                "next_latents": roll["next_latents"].flatten(0, 2),
                "log_prob": roll["log_prob"].flatten(),
                "mean": roll["mean"].flatten(0, 2),
                "sigma": sigmas[step_index],
                "sigma_next": sigmas[step_index + 1],
                "noise_level": torch.full((n_trans,), args.noise_level),
                "advantage": advantages[mine].transpose(0, 1).flatten(),
                "prompt_index": torch.arange(n_prompts).repeat_interleave(G).repeat(len(M)),
                "step_index": step_index,
                "state_index": torch.arange(len(M) * n_prompts).repeat_interleave(G),
            }
            if args.update_schedule == "per-k":
                # one optimizer step per branch step, k in order (released hps script)
                transitions["update_block"] = torch.arange(len(M)).repeat_interleave(n_prompts * G)
            # Logged rewards are those of the finest granularity (full-schedule images, comparable
            # to the baseline's); the group std per k shows the diversity one SDE step buys (it
            # collapses at low-noise k).
            fine = mixed[:, :, 0]  # [prompt, k, member]
            # [prompt, k]; float64: ties give exactly 0
            group_std = fine.double().std(-1, unbiased=False)
            metrics.update(
                {
                    "train/reward_mean": fine.mean().item(),
                    "train/reward_std": fine.std().item(),
                    "train/group_std_mean": group_std.mean().item(),
                    # groups tied at every λ teach nothing:
                    "train/zero_std_frac": (advantages == 0).all(-1).float().mean().item(),
                }
            )
            metrics.update(
                {f"train/group_std_k{k}": group_std[:, j].mean().item() for j, k in enumerate(M)}
            )
            metrics.update(
                {
                    f"train/reward_mean_lam{lam}": mixed[:, :, j].mean().item()
                    for j, lam in enumerate(Lam)
                }
            )
        del roll, clean
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
