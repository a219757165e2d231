"""Yardstick (not an algorithm of the papers): reward-filtered self-training on the toy world, RAFT-style.

Each iteration samples groups of images exactly as flowgrpo_baseline.py's rollout does (same prompts, same
initial noise and SDE noise for the same seed and iteration, same sampler), keeps the good ones by the toy reward,
and fine-tunes the same LoRA on them with the plain flow-matching regression loss of pretraining:

    x_t = (1 - t) x0 + t eps,   loss = || v_theta(x_t, t, c) - (eps - x0) ||^2,   t = sigmoid(N(0, 1))   (logit-normal)

No log-probs, no ratios, no advantages: if this learns as fast per image as the policy-gradient scripts, their
estimator is not what limits them on this world; if it learns faster, it is. Same evaluation
(common/plumbing/evaluation.py), same metrics.jsonl keys and the same harness flags as the three scripts
(benchmarks/bench_compare.py --algos yardstick). Probe it comes from: ../shared/reference/toyworld_finetune_probe.md.

    python benchmarks/yardstick_raft.py --num-iterations 60             # toy world, CPU
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import toyworld  # noqa: E402
from common.backbones import LORA_TARGETS, check_model_path, load_backbone  # noqa: E402
from common.plumbing.checks import ConfigError  # noqa: E402
from common.plumbing.evaluation import evaluate  # noqa: E402
from common.plumbing.reward_flags import build_reward  # noqa: E402
from common.plumbing.run import RunLogger
from common.plumbing.utils import seed_everything  # noqa: E402
from common.sampler import sde_step_with_logprob  # noqa: E402

TOY_MODEL = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common", "toyworld", "model"
)


@dataclass
class Args:
    seed: int = 1
    """seed: prompts, noise, LoRA init (the same seed samples the baseline's images at iteration 0)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{run_name}/"""
    run_name: str | None = None
    """the run folder's name (default: yardstick_raft__{seed}__{unix time})"""
    model_path: str = TOY_MODEL
    """the toy-world model (a local diffusers folder in the toy grammar)"""
    prompts_file: str = str(toyworld.RL_TRAIN_FILE)
    """training prompts, drawn uniformly over lines (as the baseline)"""
    num_steps: int = 10
    """denoising steps of a rollout (baseline default)"""
    noise_level: float = 0.7
    """SDE noise level a of the rollout sampler (baseline default; 0 = the deterministic ODE)"""
    group_size: int = 8
    """images per prompt"""
    groups_per_iteration: int = 8
    """prompts per iteration"""
    keep: Literal["best", "correct", "above_mean"] = "best"
    """which images are trained on: the best of each group (groups with all-equal rewards skipped), every image
    the strict scorer calls correct, or every image whose reward is above its group's mean"""
    fm_draws: int = 1
    """(t, eps) draws per kept image in the regression batch"""
    learning_rate: float = 1e-4
    """AdamW learning rate (the probe's; its 3e-5 drifted down more slowly)"""
    lora_rank: int = 16
    """LoRA rank r (the scripts' toy default)"""
    lora_alpha: float = 32.0
    """LoRA alpha (the scripts' toy default)"""
    num_iterations: int = 60
    """rollout + update iterations (0 = only evaluate the starting model)"""
    cpu_budget_s: float = 0.0
    """stop at the first iteration boundary past this many process CPU seconds since the loop began (0 = none)"""
    save_every: int = 10
    """save the LoRA weights to {run}/lora.pt every N iterations (and at the end)"""
    eval_prompts: str = str(toyworld.TEST_FILE)
    """evaluation prompts (never trained on)"""
    eval_every: int = 10
    """evaluate every N iterations (and at the start and the end)"""
    eval_num_steps: int = 20
    """ODE steps at evaluation (the scripts' toy default)"""
    eval_seeds_per_prompt: int = 2
    """images per evaluation prompt at the periodic evaluations"""
    final_eval_seeds_per_prompt: int | None = None
    """images per evaluation prompt at the final evaluation (default: eval_seeds_per_prompt)"""
    eval_batch_size: int = 64
    """images per transformer call at evaluation"""


def select(
    rewards: torch.Tensor, correct: torch.Tensor, group: torch.Tensor, keep: str
) -> torch.Tensor:
    """Boolean mask of the images to regress on. `group[i]` is image i's group id (0 .. n_groups-1)."""
    if keep == "correct":
        return correct.bool()
    n = int(group.max()) + 1
    mean = torch.zeros(n).index_add_(0, group, rewards) / torch.bincount(group, minlength=n)
    if keep == "above_mean":
        return rewards > mean[group]
    mask = torch.zeros(len(rewards), dtype=torch.bool)
    for k in range(n):  # "best": the first highest-reward image of each group that has a spread
        idx = (group == k).nonzero().squeeze(1)
        if len(idx) and rewards[idx].max() > rewards[idx].min():
            mask[idx[rewards[idx].argmax()]] = True
    return mask


def accuracy_se(metrics: dict, prompts: list[str], seeds: int) -> float:
    """Binomial standard error of eval/accuracy, the mean over C categories of per-category means:
    SE = sqrt(sum_c p_c (1 - p_c) / n_c) / C, n_c = prompts of c x seeds."""
    counts = {}
    for p in prompts:
        counts[toyworld.category_of(p)] = counts.get(toyworld.category_of(p), 0) + seeds
    var = sum(
        metrics[f"eval/accuracy_{c}"] * (1 - metrics[f"eval/accuracy_{c}"]) / n
        for c, n in counts.items()
    )
    return math.sqrt(var) / len(counts)


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        train_prompts = toyworld.load_prompts(args.prompts_file)
        eval_prompts = toyworld.load_prompts(args.eval_prompts)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    if not all(map(toyworld.in_grammar, train_prompts + eval_prompts)):
        raise ConfigError(
            "the yardstick scores with the toy reward: every training and evaluation prompt must be in "
            "the toy grammar (common/toyworld/prompts.py)"
        )
    if args.group_size < 2 or args.fm_draws < 1:
        raise ConfigError(
            f"--group-size {args.group_size} / --fm-draws {args.fm_draws}: need a group of at least 2 "
            "and at least one draw per kept image"
        )
    check_model_path(args.model_path)
    final_seeds = args.final_eval_seeds_per_prompt or args.eval_seeds_per_prompt
    seed_everything(args.seed)
    run_dir = os.path.join(
        args.output_dir, args.run_name or f"yardstick_raft__{args.seed}__{int(time.time())}"
    )
    backbone = load_backbone(args.model_path, "cpu" if not torch.cuda.is_available() else "cuda")
    device, res = backbone.device, toyworld.RESOLUTION
    transformer = backbone.transformer
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer.requires_grad_(False)
    # as the scripts: a no-op at start
    transformer.add_adapter(
        LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha,
            init_lora_weights="gaussian",
            target_modules=LORA_TARGETS["all-linear"],
        )
    )
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(
        params, lr=args.learning_rate, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8
    )
    reward_model = build_reward("toyworld", device)
    logger = RunLogger(run_dir, True, False, asdict(args), "", None, os.path.basename(run_dir))
    sigmas = backbone.schedule(args.num_steps, res, res)
    n_img = args.groups_per_iteration * args.group_size
    count = {k: 0 for k in ("rollout", "completion", "train_forward", "train_backward", "eval")}
    images_seen, t0, cpu0 = 0, time.time(), time.process_time()

    for iteration in range(args.num_iterations + 1):
        cpu = time.process_time() - cpu0
        final = iteration == args.num_iterations or 0 < args.cpu_budget_s < cpu
        metrics = {"iteration": iteration}
        if final or iteration % args.eval_every == 0:
            seeds = final_seeds if final else args.eval_seeds_per_prompt
            m, grid = evaluate(
                backbone,
                reward_model,
                None,
                eval_prompts,
                args.eval_num_steps,
                None,
                1.0,
                seeds,
                args.eval_batch_size,
                res,
            )
            m.setdefault("eval/accuracy_se", accuracy_se(m, eval_prompts, seeds))
            count["eval"] += len(eval_prompts) * seeds * args.eval_num_steps
            metrics.update(m)
            os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
            grid.save(os.path.join(run_dir, "samples", f"eval_{iteration:05d}.png"))
        if not final:
            # ---- rollout: flowgrpo_baseline.py's prompts, group layout, seeds and SDE sampler (rank 0 of 1)
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
            prompt_ids = torch.randint(
                len(train_prompts), (args.groups_per_iteration,), generator=g
            )
            group = torch.arange(args.groups_per_iteration).repeat_interleave(args.group_size)
            group = group[torch.randperm(len(group), generator=g)]
            prompts = [train_prompts[prompt_ids[k]] for k in group]
            emb = backbone.encode(prompts)
            gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + iteration * 1009)
            with torch.no_grad():
                x = backbone.initial_noise(n_img, res, res, generator=gen)
                for j in range(args.num_steps):
                    v = backbone.velocity(x, sigmas[j], emb, 1.0)
                    x = sde_step_with_logprob(
                        v,
                        x,
                        sigmas[j],
                        sigmas[j + 1],
                        args.noise_level,
                        generator=gen,
                        sigma_max=sigmas[1],
                    )[0]
                images = backbone.decode(x, res, res)
            rewards, correct = map(torch.as_tensor, toyworld.score(images, prompts))
            rewards = rewards.float()
            count["rollout"] += n_img * args.num_steps
            images_seen += n_img
            # ---- fine-tune on the kept images: one optimizer step of flow-matching regression
            kept = (
                select(rewards, correct, group, args.keep)
                .nonzero()
                .squeeze(1)
                .repeat(args.fm_draws)
            )
            loss = torch.zeros(())
            if len(kept):
                x0 = x[kept]
                # logit-normal t, as SD3 pretraining
                t = torch.sigmoid(torch.randn(len(kept), device=device))
                eps = torch.randn_like(x0)
                tt = t.view(-1, *[1] * (x0.ndim - 1))
                v = backbone.velocity((1 - tt) * x0 + tt * eps, t, emb[kept], 1.0)
                loss = ((v - (eps - x0)) ** 2).mean()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                count["train_forward"] += len(kept)
                count["train_backward"] += len(kept)
            metrics.update(
                {
                    "train/reward_mean": rewards.mean().item(),
                    "train/correct_frac": correct.float().mean().item(),
                    "train/kept": int(len(kept)) // args.fm_draws,
                    "train/loss": loss.item(),
                }
            )
        metrics.update(
            {
                # as training_nfe
                "nfe": sum(count[k] for k in ("rollout", "completion", "train_forward")),
                **{f"nfe/{k}": v for k, v in count.items()},
                "trajectories": images_seen,
                "scored_images": images_seen,
                "time/cpu_s": time.process_time() - cpu0,
                "time/elapsed_s": time.time() - t0,
            }
        )
        if final:
            metrics["final"] = True
        if final or (iteration + 1) % args.save_every == 0:
            torch.save(get_peft_model_state_dict(transformer), os.path.join(run_dir, "lora.pt"))
        logger.log(metrics)
        print(
            {
                k: round(v, 4) if isinstance(v, float) else v
                for k, v in metrics.items()
                if k
                in ("iteration", "eval/accuracy", "train/reward_mean", "train/kept", "time/cpu_s")
            },
            flush=True,
        )
        if final:
            break
    print(f"run folder: {run_dir}")
