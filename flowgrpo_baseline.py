"""Flow-GRPO: online RL for flow-matching text-to-image models (Liu et al. 2025, arXiv 2505.05470).

1. Sample with an SDE that has the ODE's marginals, so each denoising step is a Gaussian policy with a
   log-prob (common/sampler.py, Eq. E2-E3).
2. Sample a group of G images per prompt; every step of image i gets the advantage (r_i - mean_G) / std.
3. Update the PPO-clipped objective on those steps, plus a KL to the same network with its LoRA switched off.
Docs: docs/flowgrpo.md.  Run: `python flowgrpo_baseline.py` (toy world, CPU, minutes, no downloads) or
`torchrun --nproc_per_node 8 flowgrpo_baseline.py --model-path DIR ...` (see the docs for the paper presets).
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
from common.plots import line_plot
from common.rewards import advantage_mix, build_reward, parse_model_paths, parse_reward_spec
from common.sampler import gaussian_kl, sde_step_with_logprob
from common.utils import (RunLogger, Timer, all_gather_cat, all_reduce, rng_state,
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
    groups_per_iteration: int = 8
    """prompts per iteration over all ranks (paper: 48)"""
    rollout_batch_size: int = 64
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
    global_std: bool = True
    """divide advantages by the std of all rewards of the iteration instead of each group's std"""
    std_eps: float = 1e-4
    """added to the std before dividing"""
    timestep_fraction: float = 0.5
    """train on the first int(num_steps * fraction) steps (paper 0.99: all but the last, near-deterministic one;
    toy default 0.5: the early steps that place the objects, measured better in docs/results.md)"""
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
        # ALGO LOGIC. Flow-GRPO spreads each group over the ranks: all ranks draw the same prompts and the same
        # shuffle (a generator seeded by the iteration), and rank r keeps slice r. Seeding by iteration also makes
        # a resumed run sample exactly what the uninterrupted run would have.
        with timer("rollout"):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
            prompt_ids = torch.randint(len(train_prompts), (args.groups_per_iteration,), generator=g)
            group = torch.arange(args.groups_per_iteration).repeat_interleave(args.group_size)
            group = group[torch.randperm(len(group), generator=g)]  # group id of every image, global order
            mine = slice(rank * args.images_per_rank, (rank + 1) * args.images_per_rank)
            my_prompts = [train_prompts[prompt_ids[k]] for k in group[mine]]
            emb = backbone.encode(my_prompts)
            gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + iteration * 1009 + rank)
            steps = []  # per step j: (latents, next_latents, log_prob) for the whole rank
            images = []
            with torch.no_grad():
                for b in range(0, args.images_per_rank, args.rollout_batch_size):
                    idx = slice(b, b + args.rollout_batch_size)
                    x = backbone.initial_noise(args.rollout_batch_size, args.resolution, args.resolution, generator=gen)
                    traj = []
                    for j in range(args.num_steps):
                        v = backbone.velocity(x, sigmas[j], emb[idx], args.guidance_scale)
                        x_next, log_prob, _, _ = sde_step_with_logprob(v, x, sigmas[j], sigmas[j + 1], args.noise_level,
                                                                       generator=gen, sigma_max=sigmas[1])
                        traj.append((x, x_next, log_prob))
                        x = x_next
                    steps.append(traj[: args.trained_steps])
                    images.append(backbone.decode(x, args.resolution, args.resolution))
            nfe_rollout = args.images_per_rank * args.num_steps
        with timer("reward"):
            images = torch.cat(images)
            scores = reward_model(images, my_prompts)  # [n, K] raw scores, one column per reward
            all_scores = all_gather_cat(scores.to(device), world_size).cpu()  # rank-major = global order
            if not torch.isfinite(all_scores).all():
                raise SystemExit(f"error: non-finite reward at iteration {iteration}; stopping before any update "
                                 f"(last checkpoint in {run_dir}/checkpoint is intact)")
            if args.reward_mix == "score":
                advantages = group_advantages(reward_model.mix(all_scores), group, args.global_std, args.std_eps)
            else:  # normalise each reward within its groups, then mix the advantages (G2RPO's multi-reward rule)
                per_reward = torch.stack([group_advantages(all_scores[:, k], group, args.global_std, args.std_eps)
                                          for k in range(all_scores.shape[1])], 1)
                advantages = advantage_mix(per_reward, reward_model.weights)
            advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)
            mixed = reward_model.mix(all_scores)
            group_std = torch.stack([mixed[group == k].std(unbiased=False) for k in range(args.groups_per_iteration)])
            # Transitions: every trained step of every trajectory, each carrying its trajectory's advantage.
            n_traj = args.images_per_rank
            transitions = {
                "latents": torch.cat([torch.cat([s[j][0] for s in steps]) for j in range(args.trained_steps)]),
                "next_latents": torch.cat([torch.cat([s[j][1] for s in steps]) for j in range(args.trained_steps)]),
                "log_prob": torch.cat([torch.cat([s[j][2] for s in steps]) for j in range(args.trained_steps)]),
                "sigma": sigmas[:args.trained_steps].repeat_interleave(n_traj),
                "sigma_next": sigmas[1:args.trained_steps + 1].repeat_interleave(n_traj),
                "noise_level": torch.full((n_traj * args.trained_steps,), args.noise_level),
                "advantage": advantages[mine].repeat(args.trained_steps),
                "prompt_index": torch.arange(n_traj).repeat(args.trained_steps),
            }
            metrics.update({"train/reward_mean": mixed.mean().item(), "train/reward_std": mixed.std().item(),
                            "train/group_std_mean": group_std.mean().item(),
                            "train/zero_std_frac": (group_std == 0).float().mean().item()})
        del steps, images
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
