"""The main loop's bookkeeping: every block of an iteration that is not the algorithm, as one named
call (`Harness.start` makes the Run; docs/design.md shows the loop it serves). Nothing here changes
what a run samples or learns (tests/test_run.py). Every file it writes is written atomically, a
failed write is one line, and SIGINT and SIGTERM stop a run with one line. Counters, cumulative over
all ranks (metrics.jsonl and the checkpoint): `trajectories` (images the policy sampled to the end),
`scored_images` (every image a reward scored for training, completions included), `nfe/<phase>`
(transformer forwards, a CFG pair counted once; `training_nfe` sums the training ones)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from common.plumbing.checkpoint import (
    continue_hint,
    rng_state,
    save_checkpoint,
    trainer_state,
    write_failed,
    writing,
)
from common.plumbing.checks import ConfigError
from common.plumbing.evaluation import evaluate
from common.plumbing.parallel import is_sharded, weights_digest
from common.plumbing.report import run_pictures, summary_line
from common.plumbing.run_folder import release_run_folder
from common.plumbing.signals import _setup_state, stop_training_on_signals
from common.plumbing.tracking import start_wandb, to_wandb
from common.plumbing.utils import atomic_file, atomic_write, read_metrics_lines
from common.policy import ema_weights

COUNTERS = (
    "trajectories",
    "scored_images",
    "nfe/rollout",
    "nfe/completion",
    "nfe/train_forward",
    "nfe/train_backward",
    "nfe/eval",
)
PHASES = ("rollout", "reward", "train", "eval")  # time/{phase}_s; train: the rest of the iteration
# fp16 steps the loss scaler may skip in a row before the run stops (Run.check_gradient)
MAX_SKIPS_IN_A_ROW = 20
# per-step metrics of the training section (Stats names) that become steps/{name}/{step} columns
PER_STEP = ("ratio", "clipfrac", "kl", "abs_adv", "kept")
# Stats names logged under another name; the others are logged under their own
LOGGED_AS = {
    "ratio": "ratio/mean",
    "old_deviation": "train/old_deviation",  # DiffusionNFT's
    "ema_kl": "train/ema_kl",  # AWM's
    "matching_loss": "train/matching_loss",
}


class Timer:
    """`with timer("rollout"):` adds the block's seconds to timer.times["rollout"] (on a GPU after
    a synchronize, so the GPU's work is timed, not its queueing)."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        start = time.perf_counter()
        yield  # a block that raises stops the run: its time is not needed
        sync()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


class Stats:
    """The training section's metrics of one iteration, reduced over the ranks when the row is
    written (Run.log): `add` weighted means by name, overall and per trained step, with their
    extremes over the rows of weight > 0; `count` totals; `first` this rank's first value of a
    name. `defaults`: the means the section logs, at their value when nothing was trained. Every
    rank adds the same names (they are reduced by name)."""

    def __init__(self, num_steps: int, **defaults: float):
        self.num_steps, self.defaults = num_steps, defaults
        self.sums, self.extremes, self.totals, self.firsts = {}, {}, {}, {}

    def add(self, weight: torch.Tensor, step_index: torch.Tensor, **values: torch.Tensor) -> None:
        w = weight.detach().double()
        for name, v in values.items():
            v = v.detach().double()
            zeros = torch.zeros(2, self.num_steps, dtype=torch.float64, device=w.device)
            sums = self.sums.setdefault(name, zeros)  # [sum of w v, sum of w] per step
            sums.index_add_(1, step_index, torch.stack([w * v, w]))
            low = torch.full((2,), -math.inf, dtype=torch.float64, device=w.device)
            kept = v[w > 0]  # [max v, -min v]
            high = torch.stack([kept.max(), -kept.min()]) if len(kept) else low
            self.extremes[name] = torch.maximum(self.extremes.get(name, low), high)

    def count(self, **values: float) -> None:
        self.totals.update({k: self.totals.get(k, 0.0) + float(v) for k, v in values.items()})

    def first(self, **values: torch.Tensor) -> None:
        self.firsts.update({k: float(v) for k, v in values.items() if k not in self.firsts})

    def reduce(self, world_size: int, device) -> dict:
        """{name, name/per_step: {step: mean}, name/weight, /max, /min, total}, over all ranks."""
        names, counted = sorted(self.sums), sorted(self.totals)
        totals = torch.tensor([self.totals[k] for k in counted], dtype=torch.float64)
        flat = torch.cat([self.sums[k].flatten() for k in names] + [totals]).to(device)
        high = torch.stack([self.extremes[k] for k in names]).to(device) if names else None
        if world_size > 1:
            dist.all_reduce(flat)
            if names:
                dist.all_reduce(high, op=dist.ReduceOp.MAX)
        out = dict(zip(counted, flat[flat.numel() - len(counted) :].tolist()))
        for i, k in enumerate(names):
            s, w = flat[2 * i * self.num_steps : 2 * (i + 1) * self.num_steps].view(2, -1)
            out[k] = (s.sum() / w.sum()).item() if w.sum() > 0 else self.defaults.get(k, 0.0)
            out[f"{k}/per_step"] = {j: (s[j] / w[j]).item() for j in range(len(w)) if w[j] > 0}
            out[f"{k}/weight"], out[f"{k}/max"], out[f"{k}/min"] = w.sum().item(), *high[i].tolist()
            out[f"{k}/min"] = -out[f"{k}/min"]
        return out


class NonFiniteUpdate(SystemExit):
    """A non-finite reward, rollout, gradient or weight: the run stops before it is saved or
    trained on, in one line (a SystemExit, no traceback)."""


def stop_nonfinite(what: str, iteration: int | None) -> NonFiniteUpdate:
    """The one line a non-finite number stops the run with, naming what exists to go on from."""
    hint = continue_hint_of_this_run() or "nothing was saved"
    return NonFiniteUpdate(
        f"error: non-finite {what}{'' if iteration is None else f' at iteration {iteration}'}; "
        f"stopping before anything non-finite is saved ({hint})"
    )


def continue_hint_of_this_run() -> str:
    """How to go on from the run this process set up (its folder, as `setup` made it), or ''."""
    run_dir = _setup_state["run_dir"]
    return continue_hint(run_dir) if run_dir else ""


# ---------------------------------------------------------------------- the ranks agree on a count
# The GRPO training section's: every forward and backward is a collective under DDP and FSDP, so every rank runs as
# many micro-batches, and an optimizer step's loss is the mean over all ranks' kept rows. Tensors on the run's
# device: NCCL takes no CPU tensor.
def sum_over_ranks(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """The elementwise sum of `t` over the ranks (a copy; `t` is left as it was)."""
    t = t.clone()
    if world_size > 1:
        dist.all_reduce(t)
    return t


def max_over_ranks(n: int, world_size: int, device) -> int:
    """The largest of every rank's `n`."""
    if world_size == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def check_finite(what: str, iteration: int, values) -> None:
    """Stop the run in one line if any float of `values` (a tensor, or a dict of them, named in the
    line) is NaN or infinite. Every rank checks the same all-gathered rewards, so all stop."""
    for name, t in values.items() if isinstance(values, dict) else [(None, values)]:
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise stop_nonfinite(what if name is None else f"{what} ('{name}')", iteration)


def gradient_zeros(params) -> tuple[int, int]:
    """(exact zeros, entries) of the gradient this rank holds (an FSDP shard): fp16 without loss
    scaling underflows to zeros (issue #55). A weight without a gradient counts as zeros."""
    zeros = entries = 0
    for p in params:
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        zeros += int((grad == 0).sum())
        entries += grad.numel()
    return zeros, entries


def training_nfe(counts: dict) -> int:
    """metrics.jsonl's `nfe`: the transformer forwards of training (rollout, completions, training
    and KL-reference forwards; a CFG pair is one). Backward passes and evaluation are counted apart."""
    return sum(counts[f"nfe/{k}"] for k in ("rollout", "completion", "train_forward"))


def restored_counts(saved: dict | None) -> dict:
    """The counters of a checkpoint, completed with zeros. A checkpoint written before 2026-12-03
    has one `images` counter instead of `trajectories` and `scored_images`: refused in one line."""
    saved = dict(saved or {})
    if "images" in saved:
        raise ConfigError(
            "this checkpoint was written before 2026-12-03 (one 'images' counter, not "
            "'trajectories' and 'scored_images'), which this code no longer resumes: start a new "
            "run, or resume it with a checkout of that time"
        )
    counts = dict.fromkeys(COUNTERS, 0)
    counts.update({k: v for k, v in saved.items() if k in counts})
    return counts


# ---------------------------------------------------------------------------------------- the rows


class RunLogger:
    """metrics.jsonl (one JSON object per iteration) and, with --track, the same numbers to wandb.
    Rank 0 only."""

    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        track: bool,
        config: dict,
        project: str,
        entity,
        name: str,
    ):
        self.enabled, self.wandb = enabled, None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        args_file, wandb_dir = os.path.join(run_dir, "args.json"), os.path.join(run_dir, "wandb")
        new = [p for p in (args_file, wandb_dir) if not os.path.lexists(p)]
        atomic_write(args_file, json.dumps(config, indent=1, default=str))
        if track:  # a failed start leaves no run behind (a resumed run's own files stay)
            self.wandb = start_wandb(run_dir, config, project, entity, name, new)

    def log(self, metrics: dict, images: dict | None = None) -> None:
        if not self.enabled:
            return
        append_line(self.path, json.dumps(metrics) + "\n")
        if self.wandb is not None:
            to_wandb(self.wandb, metrics, images or {})

    def history(self) -> list[dict]:
        return read_metrics_lines(self.path)[0]

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


def append_line(path: str, line: str) -> None:
    """Append one line whole or not at all: a failed write (a full disk) cuts the file back to its
    old length. O_NOFOLLOW: a link (even a dangling one) is refused, never written through."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        if os.path.exists(path):
            os.truncate(path, size)
        if isinstance(e, OSError) and not e.filename:
            raise OSError(e.errno, e.strerror, path) from e
        raise


class Run:
    """The state the loop carries besides the model: counters, clocks, phase timers, the logger and
    progress bar."""

    def __init__(
        self,
        args,
        run_dir: str,
        rank: int,
        world_size: int,
        device,
        logger,
        counts: dict | None,
        start_iteration: int,
        script: str,
    ):
        self.args, self.dir, self.rank, self.world_size = args, run_dir, rank, world_size
        self.device = device
        self.is_main, self.logger, self.script = rank == 0, logger, os.path.basename(script)
        self.counts = restored_counts(counts)
        self.start_iteration = self.iteration = start_iteration
        self.first_row = {}  # metrics for iteration 0's row only (Harness.start)
        self.timer = Timer()
        self.iteration_start = time.perf_counter()
        # fp16's loss scaler (Harness.start hands the script's over); a no-op in fp32 and bf16
        self.scaler, self.skips_in_a_row = torch.amp.GradScaler(device.type, enabled=False), 0
        # a resumed run's clocks continue from its checkpoint's, so time/cpu_s and the CPU budget
        # (--cpu-budget-s) count the whole run, not the last process
        saved = counts or {}
        self.wall_start = time.time() - saved.get("time/elapsed_s", 0.0)
        self.cpu_start = time.process_time() - saved.get("time/cpu_s", 0.0)
        self.pictures = None  # this iteration's evaluation grid and panel, for wandb
        # {path flag: sha256 of the prompt file as the set-up read it}, recorded by each checkpoint
        self.prompt_digests: dict[str, str] = {}
        self.last_eval = ""
        self.bar = tqdm(  # on stdout: stderr carries nothing but a stop's one line
            file=sys.stdout,
            disable=not self.is_main,
            initial=start_iteration,
            total=args.num_iterations + 1,
            desc=args.exp_name,
        )

    def cpu_seconds(self) -> float:
        """Process CPU seconds (all threads) since the loop began: --cpu-budget-s's clock."""
        return time.process_time() - self.cpu_start

    def is_last(self, iteration: int) -> bool:
        """True at --num-iterations, or once the CPU budget is spent on any rank (one all-reduce)."""
        self.iteration = iteration  # where a stop by signal says the run stands
        self.iteration_start = time.perf_counter()  # the train phase: what the others leave
        over = self.args.cpu_budget_s > 0 and self.cpu_seconds() > self.args.cpu_budget_s
        over = max_over_ranks(int(over), self.world_size, self.device)
        return iteration == self.args.num_iterations or bool(over)

    def bind(
        self,
        backbone,
        reward_model,
        guard_model,
        eval_prompts: list[str],
        params: dict,
        optimizer,
        ema,
        policy,
        save_weights,
        side_files: dict[str, str] | None = None,
        extras: dict | None = None,
    ) -> None:
        """What evaluation and checkpoints use: the model and rewards, the evaluation prompts, the
        trained weights, their optimizer, EMA and parallel wrapper, the function that saves the
        weights, and the script's own files for every checkpoint ({name: text})."""
        self.backbone, self.reward_model, self.guard_model = backbone, reward_model, guard_model
        self.eval_prompts, self.params, self.optimizer = eval_prompts, params, optimizer
        self.ema, self.policy, self.save_weights = ema, policy, save_weights
        self.side_files, self.extras = dict(side_files or {}), dict(extras or {})

    def check_gradient(self, grad_norm: torch.Tensor, stats: Stats) -> None:
        """Before scaler.step: a non-finite norm is an fp16 overflow the scaler skips (the 20th in a
        row stops the run), or, without loss scaling, a stop on every rank before the update."""
        finite = bool(torch.isfinite(grad_norm))
        self.skips_in_a_row = 0 if finite else self.skips_in_a_row + 1
        if not finite and not self.scaler.is_enabled():
            raise stop_nonfinite("loss or gradient", self.iteration)
        if self.skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            scale = f"loss scale {self.scaler.get_scale():.3g}"
            what = f"gradient in {self.skips_in_a_row} fp16 steps in a row ({scale})"
            raise stop_nonfinite(what, self.iteration)
        if not finite:
            stats.count(skipped_steps=1)
            return
        zeros, entries = gradient_zeros(self.params.values())
        stats.count(grad_norm=grad_norm, optimizer_steps=1, grad_zeros=zeros, grad_entries=entries)

    def after_step(self, grad_norm: torch.Tensor) -> None:
        """After `scaler.step`: a step taken must leave every weight finite (a huge learning rate
        can overflow them), else the run stops in one line; then the EMA follows it (not a skip)."""
        if not torch.isfinite(grad_norm):
            return
        local = [getattr(p, "to_local", lambda p=p: p)() for p in self.params.values()]  # shards
        finite = int(all(bool(torch.isfinite(p).all()) for p in local))
        finite = -max_over_ranks(-finite, self.world_size, self.device)  # FSDP: every rank's shard
        if not finite:
            raise stop_nonfinite("trained weight after the optimizer step", self.iteration)
        if self.ema is not None:
            self.ema.update()

    def evaluate(self, iteration: int, last: bool) -> dict:
        """Held-out evaluation (common/plumbing/evaluation.py: ODE samples from fixed seeds) with
        the EMA weights if any; the sample grid and panel are saved as samples/eval_{iteration}.png
        / .npz. Returns the eval/ metrics."""
        a = self.args
        seeds = (
            a.final_eval_seeds_per_prompt
            if last and a.final_eval_seeds_per_prompt
            else a.eval_seeds_per_prompt
        )
        guidance = a.guidance_scale if a.eval_guidance_scale is None else a.eval_guidance_scale
        prompts = self.eval_prompts
        with self.timer("eval"), ema_weights(self.ema):
            metrics, grid, panel = evaluate(
                self.backbone,
                self.reward_model,
                self.guard_model,
                prompts,
                a.eval_num_steps,
                a.shift,
                guidance,
                seeds,
                a.eval_batch_size,
                a.resolution,
                self.rank,
                self.world_size,
                return_panel=True,
                iteration=iteration,
            )
        self.counts["nfe/eval"] += len(prompts) * seeds * a.eval_num_steps
        self.last_eval = (
            f"{metrics.get('eval/accuracy', metrics['eval/reward_mean']):.3f}@{iteration}"
        )
        self.pictures = {"eval/samples": grid, "eval/panel": panel.captioned()}
        if self.is_main:
            with writing(self.dir):  # atomic; a full disk: one line
                os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
                grid_path = os.path.join(self.dir, "samples", f"eval_{iteration:05d}.png")
                atomic_file(grid_path, grid.save)
                # for before_after.png
                panel.save(os.path.join(self.dir, "samples", f"eval_{iteration:05d}.npz"))
        return metrics

    def _clocks(self) -> dict:
        return {"time/elapsed_s": time.time() - self.wall_start, "time/cpu_s": self.cpu_seconds()}

    def _write(self, metrics: dict) -> None:
        try:  # the row whole or not at all
            self.logger.log(metrics, self.pictures)
        except OSError as e:  # a full disk, no permission: one line
            raise write_failed(e, self.dir) from None
        self.pictures = None
        self.timer.times.clear()

    def log_final(self, metrics: dict) -> None:
        """The last row: the final evaluation with the run's counters, marked `final: true`."""
        metrics.update(
            {**self.counts, "nfe": training_nfe(self.counts), "final": True, **self._clocks()}
        )
        self._write(metrics)

    def log(self, metrics: dict, stats: Stats, rollout, grad_share=None) -> dict:
        """One metrics.jsonl row of a training iteration: the rollout's metrics and counters, the
        training section's Stats over all ranks, seconds per phase (and any measured GradShare)."""
        stats.count(**rollout.counts)
        red = stats.reduce(self.world_size, self.device)
        self.counts.update({k: v + int(red.get(k, 0)) for k, v in self.counts.items()})
        metrics.update(rollout.metrics, **self.counts, nfe=training_nfe(self.counts))
        metrics.update(self.first_row if metrics["iteration"] == 0 else {})
        for k, default in stats.defaults.items():  # the means; those named in PER_STEP per step too
            metrics[LOGGED_AS.get(k, k)] = red.get(k, default)
        for k in PER_STEP:
            metrics.update({f"steps/{k}/{j}": v for j, v in red.get(f"{k}/per_step", {}).items()})
        if "ratio" in stats.defaults:  # GRPO's ratio (DiffusionNFT has none)
            for j, m in red.get("ratio/per_step", {}).items():  # std from the mean of squares
                metrics[f"steps/ratio_std/{j}"] = max(red["ratio_sq/per_step"][j] - m**2, 0) ** 0.5
            metrics.update({f"ratio/{e}": red.get(f"ratio/{e}", 1.0) for e in ("min", "max")})
            metrics["ratio/first_minibatch_max_dev"] = stats.firsts.get("ratio_dev", 0.0)
            metrics["train/kept_transitions"] = int(red.get("ratio/weight", 0))
        n = metrics["train/optimizer_steps"] = int(red.get("optimizer_steps", 0))
        metrics["train/skipped_steps"] = int(red.get("skipped_steps", 0))
        metrics["grad_norm"] = red["grad_norm"] / n if n else 0.0
        # fp16 underflow shows as exact zeros in the gradient (docs/usage.md)
        zeros, entries = red.get("grad_zeros", 0), red.get("grad_entries", 0)
        metrics["train/grad_zero_fraction"] = zeros / max(entries, 1)
        times = self.timer.times
        times["train"] = time.perf_counter() - self.iteration_start - sum(times.values())
        metrics.update({f"time/{k}_s": times.get(k, 0.0) for k in PHASES}, **self._clocks())
        if grad_share is not None:
            metrics.update({f"steps/grad_share/{j}": v for j, v in grad_share.shares().items()})
            metrics.update({f"steps/grad_norm/{j}": v for j, v in grad_share.norms().items()})
        if self.scaler.is_enabled():
            metrics["train/loss_scale"] = self.scaler.get_scale()
        if self.device.type == "cuda":
            metrics["mem/max_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._write(metrics)
        self.bar.update(1)
        reward = f"{metrics.get('train/reward_mean', float('nan')):.3f}"
        self.bar.set_postfix(reward=reward, eval=self.last_eval)
        return metrics

    def checkpoint(self, iteration: int) -> None:
        """checkpoint-{iteration} (common/plumbing/checkpoint.py: atomic, verified, rotated): every
        rank's RNG is gathered so a resume continues each rank's noise stream; rank 0 writes (FSDP:
        every rank writes its shards)."""
        rngs = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        if self.is_main or is_sharded(self.params):
            state = {
                **trainer_state(self.params, self.optimizer, self.ema, self.policy, self.extras),
                "prompt_digests": self.prompt_digests,  # recorded in the marker, not the state
                "iteration": iteration,
                "counts": self.counts,
                "clocks": self._clocks(),
                "rng": rngs,
                # fp16's loss scale and how many steps it skipped in a row: a resume goes on exactly
                "loss_scaling": {
                    "scaler": self.scaler.state_dict(),
                    "skips_in_a_row": self.skips_in_a_row,
                },
                "args": dataclasses.asdict(self.args),
                "script": self.script,
            }
            save_checkpoint(self.dir, state, self._save_files, self.args.keep_checkpoints)
        if self.world_size > 1:
            dist.barrier()

    def stop_on_signals(self) -> None:
        """SIGINT (Ctrl-C) and SIGTERM stop the run with one line from here on (signals.py)."""
        self._handlers = stop_training_on_signals(self)

    def _save_files(self, folder: str) -> None:
        """Into a checkpoint folder: the trained weights, and the script's own files."""
        self.save_weights(folder)
        if self.is_main:
            for name, text in self.side_files.items():
                atomic_write(os.path.join(folder, name), text)

    def finish(self) -> None:
        """Every rank prints a checksum of its trained weights (they must agree); rank 0 draws the
        run's pictures and prints the held-out metric at the first and last evaluation; then the
        ranks leave together."""
        print(
            f"final weights: rank {self.rank} sha256 {weights_digest(self.params)[:16]}", flush=True
        )
        if self.is_main:
            history = self.logger.history()
            # learning curve, per-step panels, before/after
            with writing(self.dir):
                run_pictures(self.dir, history, self.args.exp_name)
            print(f"{summary_line(history)}; run folder: {self.dir}")
        self.bar.close()
        self.logger.close()
        release_run_folder(self.dir)
        for sig, handler in getattr(self, "_handlers", {}).items():
            signal.signal(sig, handler)
        if self.world_size > 1:
            # leave together: tearing gloo down while a peer still runs can abort that peer
            dist.barrier()
            dist.destroy_process_group()
