"""Flow-GRPO: online RL for flow-matching text-to-image models (Liu et al. 2025, arXiv 2505.05470).

1. Sample with an SDE that has the ODE's marginals, so each denoising step is a Gaussian policy
   with a log-prob (common/sampler.py, Eq. E2-E3).
2. Sample a group of G images per prompt; every step of image i gets the advantage
   (r_i - mean_G) / std.
3. Update the PPO-clipped objective on those steps, plus a KL to the same network with its LoRA
   switched off.
Docs: docs/flowgrpo.md.  Run: `python flowgrpo_baseline.py` (toy world, CPU, minutes, no downloads)
or `torchrun --nproc_per_node 8 flowgrpo_baseline.py --model-path DIR ...` (see the docs for the
paper presets).
"""

from __future__ import annotations

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
from common.checks import (
    ConfigError,
    Rule,
    check_flag,
    check_ranges,
    check_sde_type,
    read_prompt_file,
)
from common.parallel import check_parallel, parallelize, set_grad_sync
from common.policy import EMA, Trainable, ema_weights
from common.rewards import advantage_mix, check_rewards, load_rewards
from common.run import Run
from common.sampler import gaussian_kl, ratio_norm, sde_step_with_logprob
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
    clip_range: float = 1e-4
    """PPO clip epsilon on the ratio (tiny because the log-prob is a per-element mean)"""
    adv_clip_max: float = 5.0
    """each transition's advantage, any sum over rewards or granularities included, is clipped to
    [-adv_clip_max, adv_clip_max]: it bounds the pull of a single sample"""
    beta: float = 0.0
    """weight of the KL penalty to the reference policy (the model with its LoRA off, or a frozen
    copy with --full-finetune); 0 = no KL and no reference forward"""
    global_std: bool = True
    """divide advantages by the std of all rewards of the iteration instead of each group's std"""
    std_eps: float = 1e-4
    """added to the std before the centred rewards are divided by it: bounds the advantages of a
    group whose rewards nearly agree (a group of exactly equal rewards gets 0 at any eps)"""
    timestep_fraction: float | None = None
    """train on the first int(num_steps * fraction) steps (default 0.5; paper 0.99: all but the
    last, near-deterministic one; toy default 0.5: the early steps that place the objects, measured
    better in docs/results.md). Not with --sde-window-size, whose window is the trained steps"""
    sde_window_size: int = 0
    """Flow-GRPO-Fast: SDE noise and training only on a window of this many consecutive steps, drawn
    anew every iteration inside --sde-window-range; exact Euler (ODE) steps before and after it.
    0 = off: noise at every step, the first int(num_steps * timestep_fraction) trained. The released
    fast configs: 3"""
    sde_window_range: tuple[int, int] | None = None
    """START END of the window (needs --sde-window-size): its first step is uniform in
    START..END - size, so its steps lie in START..END - 1, as Flow-GRPO-Fast's randint
    (default: 0 and num_steps // 2, the released fast configs)"""
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

    sigmas = backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)

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
        # would have.
        with run.timer("rollout"):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
            prompt_ids = torch.randint(
                len(train_prompts), (args.groups_per_iteration,), generator=g
            )
            group = torch.arange(args.groups_per_iteration).repeat_interleave(args.group_size)
            # group id of every image, global order
            group = group[torch.randperm(len(group), generator=g)]
            # Flow-GRPO-Fast's window, drawn from g after the prompts: every rank and a resumed run
            # draw the same one, and without a window g is consumed exactly as before. `trained`:
            # the window, or the first trained steps.
            lo, hi = args.sde_window_range or (0, 0)
            w0 = (
                int(torch.randint(lo, hi - args.sde_window_size + 1, (1,), generator=g))
                if args.sde_window_size
                else 0
            )
            trained = range(w0, w0 + args.trained_steps)
            mine = slice(rank * args.images_per_rank, (rank + 1) * args.images_per_rank)
            my_prompts = [train_prompts[prompt_ids[k]] for k in group[mine]]
            emb = backbone.encode(my_prompts)
            gen = torch.Generator(device).manual_seed(
                args.seed * 1_000_003 + iteration * 1009 + rank
            )
            # per rollout batch: (latents, next_latents, log_prob, mean), [trained steps, B, ..]
            chains, images = [], []
            with torch.no_grad():
                for b in range(0, args.images_per_rank, args.rollout_batch_size):
                    idx = slice(b, b + args.rollout_batch_size)
                    x = backbone.initial_noise(
                        args.rollout_batch_size, args.resolution, args.resolution, generator=gen
                    )
                    traj = []
                    for j in range(args.num_steps):
                        v = backbone.velocity(x, sigmas[j], emb[idx], args.guidance_scale)
                        # outside a window noise 0: the sampler's exact Euler step (E1),
                        # deterministic
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
                        traj.append((x, x_next, log_prob, mean))
                        x = x_next
                    chains.append(
                        [torch.stack(t) for t in zip(*traj[trained.start : trained.stop])]
                    )
                    images.append(backbone.decode(x, args.resolution, args.resolution))
            n = args.images_per_rank  # one trajectory per image, each image scored once
            rollout_counts = {
                "trajectories": n,
                "scored_images": n,
                "nfe/rollout": n * args.num_steps,
            }
        with run.timer("reward"):
            images = torch.cat(images)
            scores = reward_model(images, my_prompts)  # [n, K] raw scores, one column per reward
            # rank-major = global order
            all_scores = all_gather_cat(scores.to(device), world_size).cpu()
            if not torch.isfinite(all_scores).all():
                raise SystemExit(
                    f"error: non-finite reward at iteration {iteration}; stopping before any "
                    f"update (the last checkpoint-N in {run_dir} is intact: --resume {run_dir})"
                )
            if args.reward_mix == "score":
                advantages = group_advantages(
                    reward_model.mix(all_scores), group, args.global_std, args.std_eps
                )
            else:
                # normalise each reward within its groups, then mix the advantages (G2RPO's
                # multi-reward rule)
                per_reward = torch.stack(
                    [
                        group_advantages(all_scores[:, k], group, args.global_std, args.std_eps)
                        for k in range(all_scores.shape[1])
                    ],
                    1,
                )
                advantages = advantage_mix(per_reward, reward_model.weights)
            advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)
            mixed = reward_model.mix(all_scores).double()  # float64: a tied group has std exactly 0
            group_std = torch.stack(
                [mixed[group == k].std(unbiased=False) for k in range(args.groups_per_iteration)]
            )
            # Transitions, step-major: row j * n + i is step j of trajectory i. Per-step fields are
            # indexed by step_index, per-trajectory fields by trajectory (check_transitions verifies
            # the order).
            T, n = args.trained_steps, args.images_per_rank
            step_index, trajectory = (
                torch.arange(w0, w0 + T).repeat_interleave(n),
                torch.arange(n).repeat(T),
            )
            latents, next_latents, log_probs, means = (
                torch.cat(f, 1).flatten(0, 1) for f in zip(*chains)
            )
            transitions = {
                "latents": latents,
                "next_latents": next_latents,
                "log_prob": log_probs,
                "mean": means,
                "sigma": sigmas[step_index],
                "sigma_next": sigmas[step_index + 1],
                "noise_level": torch.full((T * n,), args.noise_level),
                "advantage": advantages[mine][trajectory],
                "prompt_index": trajectory,
                "step_index": step_index,
                "trajectory": trajectory,
            }
            metrics.update(
                {
                    "train/reward_mean": mixed.mean().item(),
                    "train/reward_std": mixed.std().item(),
                    "train/group_std_mean": group_std.mean().item(),
                    "train/zero_std_frac": (group_std == 0).float().mean().item(),
                    **({"train/sde_window_start": w0} if args.sde_window_size else {}),
                }
            )
        del chains, images
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
