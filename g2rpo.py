"""G²RPO: Granular GRPO for flow-matching text-to-image models (Zhou et al. 2025, arXiv 2510.01982, CVPR 2026).

1. Singular Stochastic Sampling: one noise and one deterministic ODE "anchor" trajectory per prompt; at each branch
   step k the G members of the group take ONE SDE step from the shared anchor state, then finish with the ODE. The
   rewards of a group differ only through step k, so that step alone gets the advantage (dense credit).
2. Multi-Granularity Advantage Integration (MGAI): every branch is finished on every λ-th step of the remaining
   schedule for each λ in Λ; the rewards are normalised per (k, λ) within the group, then summed over λ.
3. Flow-GRPO's PPO-clipped objective on the branch steps only, no KL (the training section is the baseline's).
Docs: docs/g2rpo.md.  Run: `python g2rpo.py` (toy world, CPU, minutes, no downloads) or
`torchrun --nproc_per_node 8 g2rpo.py --model-path DIR ...` (see the docs for the paper preset).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

from common import toyworld
from common.backbones import LORA_TARGETS, ConfigError, check_model_path, check_resolution, load_backbone
from common.evaluation import evaluate
from common.rewards import advantage_mix, build_reward, parse_model_paths, parse_reward_spec
from common.sampler import gaussian_kl, ode_along_paths, ode_step, sde_step_with_logprob
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
    """images per group, G: the SDE branches of one step k of one prompt (paper: 12)"""
    groups_per_iteration: int = 3
    """prompts per iteration over all ranks (paper: 16, one per GPU). Toy default 3, not the baseline's 8: a prompt
    costs |M| x |Λ| x G = 120 completions (541 NFE) instead of 8 trajectories (80 NFE), so 3 make a CPU iteration
    about as long as the baseline's (docs/g2rpo.md); use a multiple of the number of ranks"""
    rollout_batch_size: int = 64
    """images per transformer call while sampling, per rank (here: latents of the anchor and the completions)"""

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
    branch_steps: tuple[int, ...] | None = None
    """M: schedule indices k whose SDE step is branched and trained (0 = the first, noisiest step; default: the first
    half, range(num_steps // 2), as the paper's M = {16, ..., 9} of T = 16, the code's --eta_step_list 0..7)"""
    granularities: tuple[int, ...] = (1, 2, 3)
    """Λ: every branch is also finished on every λ-th step of the rest of the schedule (paper: 1 2 3; scripts: 1 2)"""
    official_coarse_schedule: bool = False
    """fidelity: finish branches as the released code does (one fine step, then every λ-th index, and the image is the
    x0-prediction at the last model call, i.e. from a non-zero sigma when λ does not divide the rest); default:
    every λ-th step from the branch's sigma and always a last Euler step to sigma = 0. Same NFE either way"""
    update_schedule: Literal["accumulate", "per-k"] = "accumulate"
    """one optimizer step over all branch steps (the paper's (1/|M|) sum, default) or one per k (the released hps
    script; the shared training section honours transitions["update_group"])"""
    clip_range: float = 1e-4
    """PPO clip epsilon on the ratio (tiny because the log-prob is a per-element mean)"""
    adv_clip_max: float = 5.0
    """the MGAI sum is clipped to [-adv_clip_max, adv_clip_max] (paper: 5)"""
    beta: float = 0.0
    """KL weight to the LoRA-off model (G²RPO: 0, no reference model; kept for ablations)"""
    std_eps: float = 1e-8
    """added to each (k, λ) group's unbiased std (official code: 1e-8); groups of equal rewards get exactly 0"""
    drop_zero_advantage: bool = True
    """skip transitions whose advantage is 0 (groups whose rewards are all equal teach nothing)"""

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
    prompts_per_rank: int = 0
    """groups_per_iteration / world_size: a prompt's groups never span ranks (as the official code)"""
    images_per_iteration: int = 0
    """images scored per iteration: groups_per_iteration * |M| * |Λ| * group_size"""
    images_per_rank: int = 0
    """images_per_iteration / world_size"""
    trained_steps: int = 0
    """|M|: branch steps per prompt, each carrying G trained transitions"""


def check_args(args: Args, world_size: int) -> None:
    """Batch arithmetic, checked before any model is loaded. Every message says what to change."""
    args.world_size = world_size
    args.train_batch_size = args.train_batch_size or args.rollout_batch_size
    if args.branch_steps is None:
        args.branch_steps = tuple(range(args.num_steps // 2))
    args.branch_steps = tuple(sorted(set(args.branch_steps)))
    args.granularities = tuple(sorted(set(args.granularities)))
    args.trained_steps = len(args.branch_steps)
    if args.group_size < 2:
        raise ConfigError(f"--group-size {args.group_size}: the unbiased std of a group needs at least 2 images "
                          "(paper: 12)")
    if args.groups_per_iteration % world_size:
        raise ConfigError(f"--groups-per-iteration {args.groups_per_iteration} cannot be split over {world_size} "
                          f"ranks (each rank samples whole groups); make it a multiple of {world_size}")
    if not args.branch_steps or not all(0 <= k < args.num_steps for k in args.branch_steps):
        raise ConfigError(f"--branch-steps {list(args.branch_steps)}: give at least one step index in "
                          f"0..{args.num_steps - 1} (0 is the noisiest step)")
    if not args.granularities or min(args.granularities) < 1:
        raise ConfigError(f"--granularities {list(args.granularities)}: give positive step strides, e.g. 1 2 3")
    if args.rollout_batch_size < 1:
        raise ConfigError(f"--rollout-batch-size {args.rollout_batch_size}: must be at least 1")
    args.prompts_per_rank = args.groups_per_iteration // world_size
    args.images_per_rank = args.prompts_per_rank * args.trained_steps * len(args.granularities) * args.group_size
    args.images_per_iteration = args.images_per_rank * world_size


# ALGO LOGIC: which sigmas a branch born at step k walks through to its image, at granularity λ.
def completion_schedule(k: int, lam: int, num_steps: int, official: bool = False) -> list[int]:
    """Schedule indices from k+1 (where the SDE step of step k lands) to num_steps (sigma = 0), every λ-th one.

    Default: k+1, k+1+λ, k+1+2λ, ... and a last, shorter Euler step to num_steps when λ does not divide the rest,
    so every image is a finished ODE solution. official=True copies the released code: one fine step k+1 -> k+2,
    then every λ-th index from k+2; its image is x0_hat = x - sigma v at the last model call, which is an Euler step
    straight to sigma = 0, so we replace the last index by num_steps. Both take ceil((T - k - 1) / λ) model calls.
    """
    if official:
        idx = [k + 1] + list(range(k + 2, num_steps + 1, lam))
        return idx[:-1] + [num_steps] if len(idx) > 1 else idx
    idx = list(range(k + 1, num_steps + 1, lam))
    return idx if idx[-1] == num_steps else idx + [num_steps]


def rollout_nfe(num_steps: int, branch_steps, group_size: int, granularities) -> int:
    """Closed-form velocity evaluations of one group's rollout (per prompt; a CFG pair counts as one, as the baseline):

        NFE = (max M + 1) + G * sum_{k in M} sum_{λ in Λ} ceil((T - k - 1) / λ)

    The anchor evaluates v at its states 0..max M; the branch step at k reuses the anchor's v at k (so the shared
    state costs no extra call: the official code spends G calls there); each completion costs its schedule's steps.
    Paper setting (T=16, M=0..7, G=12, Λ={1,2,3}): 8 + 12 * 173 = 2084 (the official code: 16 + 12 * 181 = 2188).
    """
    comp = sum(math.ceil((num_steps - k - 1) / lam) for k in branch_steps for lam in granularities)
    return max(branch_steps) + 1 + group_size * comp


@torch.no_grad()
def anchor_trajectory(velocity, x, sigmas, last: int, batch: int):
    """The deterministic ODE (E1) from the shared x_T to x_last: states[j] and the velocity v(states[j], sigma_j).

    velocity(x, sigma, prompt_index) -> v. One row per prompt: the whole group shares this trajectory, so the velocity
    at a branch state is computed once per prompt here, not once per member.
    """
    states, vels, rows = [], [], torch.arange(len(x))
    for j in range(last + 1):
        v = torch.cat([velocity(x[b:b + batch], sigmas[j], rows[b:b + batch]) for b in range(0, len(x), batch)])
        states.append(x)
        vels.append(v)
        x = ode_step(v, x, sigmas[j], sigmas[j + 1])
    return states, vels


@torch.no_grad()
def singular_stochastic_rollout(velocity, x_T, sigmas, branch_steps, granularities, group_size: int,
                                noise_level: float, generator=None, batch: int = 64, official: bool = False) -> dict:
    """Singular Stochastic Sampling + MGAI completions for P prompts (rows of x_T, each group's shared noise).

    For each k in M: G SDE steps (E3) from the anchor state x_k, with the anchor's velocity at x_k; then every branch
    is finished by the ODE at every granularity. Returns
      latents [K, P, ...]        the shared state before each branch step (the transitions' latents)
      next_latents [K, P, G, ...] and log_prob [K, P, G]: the SDE steps, the only ones that carry the loss
      final [P, K, L, G, ...]    the clean latents to decode and score (K = |M|, L = |Λ|)
      nfe                        velocity evaluations counted while running (P * rollout_nfe(...); G = 1 at noise 0)
    """
    P, K, L, G, T = len(x_T), len(branch_steps), len(granularities), group_size, len(sigmas) - 1
    # At noise_level 0 the G branches are one deterministic computation: run it once and copy it. Batched kernels do
    # not promise equal outputs for equal rows (a row's result can depend on its place in the batch), and a z-score
    # would blow such 1e-7 differences up into O(1) advantages.
    n = G if noise_level > 0 else 1
    states, vels = anchor_trajectory(velocity, x_T, sigmas, max(branch_steps), batch)
    nfe = P * (max(branch_steps) + 1)
    latents, next_latents, log_prob = [], [], []
    for k in branch_steps:  # every k branches from the same anchor (not from another k's branch)
        x, v = states[k].repeat_interleave(n, 0), vels[k].repeat_interleave(n, 0)
        y, lp, _, _ = sde_step_with_logprob(v, x, sigmas[k], sigmas[k + 1], noise_level, generator=generator,
                                            sigma_max=sigmas[1])
        latents.append(states[k])
        next_latents.append(y.view(P, n, *y.shape[1:]))
        log_prob.append(lp.view(P, n))
    next_latents = torch.stack(next_latents)  # [K, P, n, ...]
    # One completion job per (prompt, k, λ, member), in that order (prompt outermost, so a rank-major gather of the
    # rewards lists prompts in global order).
    start = next_latents.transpose(0, 1).unsqueeze(2).expand(P, K, L, n, *next_latents.shape[3:])
    paths = [sigmas[completion_schedule(k, lam, T, official)] for k in branch_steps for lam in granularities]
    paths = [p for _ in range(P) for p in paths for _ in range(n)]
    prompt_index = torch.arange(P).repeat_interleave(K * L * n)
    # Euler ODE (E1) of every row along its own path, staircase-batched (common/sampler.py)
    final, nfe_ode, _ = ode_along_paths(lambda x, s, rows: velocity(x, s, prompt_index[rows]),
                                        start.reshape(P * K * L * n, *start.shape[4:]), paths, batch)
    final = final.view(P, K, L, n, *final.shape[1:])
    return {"latents": torch.stack(latents), "next_latents": next_latents.expand(K, P, G, *next_latents.shape[3:]),
            "log_prob": torch.stack(log_prob).expand(K, P, G), "final": final.expand(P, K, L, G, *final.shape[4:]),
            "nfe": nfe + nfe_ode}


# ALGO LOGIC: MGAI (paper Eqs. 10-12), the advantage of each branch step from its rewards at every granularity.
def mgai_advantages(rewards: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """rewards [..., K, L, G, R] (branch step, granularity, member, reward model) -> advantages [..., K, G].

    A_k^i = sum_m w_m sum_λ (r - mean_G r) / (std_G r + eps), std unbiased (torch's default, as the official code),
    one normalisation per (k, λ, reward). Computed in float64, where the std of G equal float32 rewards is exactly 0
    (in float32 the rounding of their mean, divided by its own ~1e-8 std, gives a tied group advantages up to ~0.9).
    """
    r = rewards.double()
    std = r.std(-2, keepdim=True)
    z = torch.where(std > 0, (r - r.mean(-2, keepdim=True)) / (std + eps), 0.0)  # equal rewards: 0, also at eps = 0
    z = z.sum(-3)  # sum over granularities -> [..., K, G, R]
    return advantage_mix(z.reshape(-1, z.shape[-1]), weights).view(z.shape[:-1])


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
        # ALGO LOGIC. G²RPO keeps each group on one rank (as the official code, one prompt per GPU): all ranks draw the
        # same prompts (a generator seeded by the iteration) and rank r keeps slice r. The noise is seeded by
        # (seed, iteration, rank), so a resumed run samples exactly what the uninterrupted run would have.
        with timer("rollout"):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
            prompt_ids = torch.randint(len(train_prompts), (args.groups_per_iteration,), generator=g)
            mine = slice(rank * args.prompts_per_rank, (rank + 1) * args.prompts_per_rank)
            my_prompts = [train_prompts[i] for i in prompt_ids[mine]]
            emb = backbone.encode(my_prompts)
            gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + iteration * 1009 + rank)
            M, Lam, G = args.branch_steps, args.granularities, args.group_size
            x_T = backbone.initial_noise(len(my_prompts), args.resolution, args.resolution, generator=gen)  # 1/group
            roll = singular_stochastic_rollout(
                lambda x, s, p: backbone.velocity(x, s, emb[p], args.guidance_scale), x_T, sigmas, M, Lam, G,
                args.noise_level, generator=gen, batch=args.rollout_batch_size, official=args.official_coarse_schedule)
            nfe_rollout = roll["nfe"]  # = prompts_per_rank * rollout_nfe(num_steps, M, G, Λ)
        with timer("reward"):
            final = roll.pop("final").flatten(0, 3)  # one image per (prompt, k, λ, member)
            job_prompts = [p for p in my_prompts for _ in range(len(M) * len(Lam) * G)]
            bs = args.rollout_batch_size
            scores = torch.cat([reward_model(backbone.decode(final[b:b + bs], args.resolution, args.resolution),
                                             job_prompts[b:b + bs]) for b in range(0, len(final), bs)])  # [n, R] raw
            all_scores = all_gather_cat(scores.to(device), world_size).cpu()  # rank-major = global prompt order
            if not torch.isfinite(all_scores).all():
                raise SystemExit(f"error: non-finite reward at iteration {iteration}; stopping before any update "
                                 f"(last checkpoint in {run_dir}/checkpoint is intact)")
            table = all_scores.view(args.groups_per_iteration, len(M), len(Lam), G, -1)  # [prompt, k, λ, member, R]
            mixed = reward_model.mix(all_scores).view(table.shape[:-1])
            if args.reward_mix == "score":  # mix the raw scores, then MGAI on the mix
                advantages = mgai_advantages(mixed.unsqueeze(-1), torch.ones(1), args.std_eps)
            else:  # MGAI per reward model, then the weighted sum (the official A_HPS + A_CLIP)
                advantages = mgai_advantages(table, reward_model.weights, args.std_eps)
            advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)  # [prompt, k, member]
            # Transitions: only the SDE step of each branch, ordered (k, prompt, member), with its MGAI advantage.
            n_prompts, n_trans = len(my_prompts), len(M) * len(my_prompts) * G
            transitions = {
                "latents": roll["latents"].repeat_interleave(G, 1).flatten(0, 1),  # the shared state x_k
                "next_latents": roll["next_latents"].flatten(0, 2),
                "log_prob": roll["log_prob"].flatten(),
                "sigma": sigmas[list(M)].repeat_interleave(n_prompts * G),
                "sigma_next": sigmas[[k + 1 for k in M]].repeat_interleave(n_prompts * G),
                "noise_level": torch.full((n_trans,), args.noise_level),
                "advantage": advantages[mine].transpose(0, 1).flatten(),
                "prompt_index": torch.arange(n_prompts).repeat_interleave(G).repeat(len(M)),
            }
            if args.update_schedule == "per-k":  # one optimizer step per branch step, k in order (released hps script)
                transitions["update_group"] = torch.arange(len(M)).repeat_interleave(n_prompts * G)
            # Logged rewards are those of the finest granularity (full-schedule images, comparable to the baseline's);
            # the group std per k shows the diversity one SDE step buys (it collapses at low-noise k).
            fine = mixed[:, :, 0]  # [prompt, k, member]
            group_std = fine.double().std(-1, unbiased=False)  # [prompt, k]; float64: ties give exactly 0
            metrics.update({"train/reward_mean": fine.mean().item(), "train/reward_std": fine.std().item(),
                            "train/group_std_mean": group_std.mean().item(),  # groups tied at every λ teach nothing:
                            "train/zero_std_frac": (advantages == 0).all(-1).float().mean().item()})
            metrics.update({f"train/group_std_k{k}": group_std[:, j].mean().item() for j, k in enumerate(M)})
            metrics.update({f"train/reward_mean_lam{lam}": mixed[:, :, j].mean().item() for j, lam in enumerate(Lam)})
        del roll, final
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
