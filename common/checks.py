"""Checks of user input before any model is loaded, and their one-line error, ConfigError.

The numeric flags the three scripts share have their ranges in one table (RANGES).

Each script's check_args calls `check_ranges(args)` first (so the batch arithmetic after it never
divides by 0), then checks its own flags with `check_flag`. A violation is one line, raised as
ConfigError:

    error: --noise-level -1.0: must be >= 0 (a scales the SDE's standard deviation; 0 = the
    deterministic ODE); the default is 0.7

i.e. what was given, what is allowed and why, and the usual value (the script's own default, read
from its Args, so the message is right in every script). Floats must also be finite: tyro turns
"nan" and "inf" into floats.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass


class ConfigError(SystemExit):
    """Bad user input: printed as one line (no traceback) and the process exits with status 1."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")
        self.code_message = message


@dataclass(frozen=True)
class Rule:
    """lo <= value (lo < value when lo_open), value <= hi (< hi when hi_open); None allowed when
    optional."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False
    allow_inf: bool = False
    why: str = ""

    def allowed(self) -> str:
        if self.lo is not None and self.hi is not None:
            return (
                f"in {'(' if self.lo_open else '['}{self.lo:g}, "
                f"{self.hi:g}{')' if self.hi_open else ']'}"
            )
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"

    def ok(self, v) -> bool:
        if v is None:
            return self.optional
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (self.integer and not isinstance(v, int))
        ):
            return False
        if math.isnan(v) or (math.isinf(v) and not self.allow_inf):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))


def _int(lo: int, why: str = "", optional: bool = False) -> Rule:
    return Rule(lo, integer=True, optional=optional, why=why)


# The shared table: flag (Args field) -> rule. A field a script does not have is skipped.
RANGES: dict[str, Rule] = {
    "seed": Rule(0, 2**32 - 1, integer=True, why="numpy's seeds are 32-bit"),
    # sampler
    "noise_level": Rule(
        0, why="a scales the SDE's standard deviation; 0 = the deterministic ODE, no exploration"
    ),
    "num_steps": _int(1, "denoising steps of a rollout"),
    "eval_num_steps": _int(1, "ODE steps at evaluation"),
    "shift": Rule(
        0, lo_open=True, optional=True, why="timestep shift of the schedule; unset = the model's"
    ),
    "guidance_scale": Rule(0, why="classifier-free guidance scale (1 = off for SD3)"),
    "eval_guidance_scale": Rule(
        0, optional=True, why="guidance at evaluation; unset = --guidance-scale"
    ),
    "resolution": _int(1, "image side in pixels"),
    "max_sequence_length": _int(1, "T5 tokens; unset = the model's default", optional=True),
    # group shape and batches
    "group_size": _int(
        2, "a group needs at least 2 images to have a mean and a std to compare against"
    ),
    "groups_per_iteration": _int(1, "prompts per iteration"),
    "rollout_batch_size": _int(1, "images per transformer call"),
    "train_batch_size": _int(
        1, "transitions per training forward; unset = --rollout-batch-size", optional=True
    ),
    "eval_batch_size": _int(1, "images per transformer call at evaluation"),
    "decode_batch_size": _int(1, "images per VAE decode call"),
    "eval_seeds_per_prompt": _int(1, "images per evaluation prompt"),
    "optimizer_steps_per_iteration": _int(1, "optimizer steps per iteration"),
    "num_inner_epochs": _int(1, "passes over an iteration's transitions"),
    # loop cadence
    "num_iterations": _int(0, "0 = only evaluate the starting model"),
    "eval_every": _int(1, "evaluate every N iterations"),
    "save_every": _int(1, "save a checkpoint every N iterations"),
    "keep_checkpoints": _int(0, "0 keeps every checkpoint"),
    "grad_share_every": _int(
        0, "measure each trained step's share of the gradient every N iterations; 0 = never"
    ),
    # objective
    "clip_range": Rule(
        0, 1, lo_open=True, hi_open=True, why="the ratio is clipped to [1 - eps, 1 + eps]"
    ),
    "adv_clip_max": Rule(0, lo_open=True, why="advantages are clipped to [-max, max]"),
    "beta": Rule(0, why="KL weight; 0 = no KL"),
    "std_eps": Rule(0, why="added to the std before dividing by it"),
    "timestep_fraction": Rule(
        0, 1, lo_open=True, optional=True, why="the fraction of the steps that are trained"
    ),
    # optimiser
    "learning_rate": Rule(0, lo_open=True, why="AdamW step size"),
    "adam_betas": Rule(0, 1, hi_open=True, why="each of AdamW's two moment decays"),
    "weight_decay": Rule(0, why="AdamW decoupled weight decay"),
    "max_grad_norm": Rule(0, lo_open=True, allow_inf=True, why="gradient-norm clip; inf = no clip"),
    "ema_decay": Rule(0, 1, hi_open=True, why="weight of the old average; 0 = no EMA"),
    "ema_update_interval": _int(1, "blend the EMA every N optimizer steps"),
    "final_eval_seeds_per_prompt": _int(
        1,
        "images per prompt at the final evaluation; unset = --eval-seeds-per-prompt",
        optional=True,
    ),
    "cpu_budget_s": Rule(0, why="CPU seconds before the run stops and evaluates; 0 = no budget"),
    # LoRA
    "lora_rank": _int(1, "LoRA rank r"),
    "lora_alpha": Rule(0, lo_open=True, why="LoRA scale alpha / r"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(v) -> str:
    return " ".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def check_flag(args, name: str, rule: Rule) -> None:
    """One flag against one rule (a tuple flag: each element); ConfigError with the given, allowed
    and usual value."""
    value = getattr(args, name)
    values = value if isinstance(value, (tuple, list)) else (value,)
    if all(rule.ok(v) for v in values) and (value is not None or rule.optional):
        return
    default = next(
        (f.default for f in dataclasses.fields(args) if f.name == name), dataclasses.MISSING
    )
    usual = "" if default is dataclasses.MISSING else f"; the default is {_show(default)}"
    kind = "an integer " if rule.integer else "a finite number " if not rule.allow_inf else ""
    why = f" ({rule.why})" if rule.why else ""
    each = "each value " if isinstance(value, (tuple, list)) else ""
    raise ConfigError(
        f"{_flag(name)} {_show(value)}: {each}must be {kind}{rule.allowed()}{why}{usual}"
    )


def check_ranges(args, table: dict[str, Rule] | None = None) -> None:
    """Every flag of `table` (default RANGES) that `args` has."""
    for name, rule in (table or RANGES).items():
        if hasattr(args, name):
            check_flag(args, name, rule)


def check_sde_type(args, trains_last_step: bool, which: str) -> None:
    """--sde-type cps (common/sampler.py, E6) and its two limits, for the three scripts' check_args.
    `which` names the flags that decide the trained steps, for the message."""
    if getattr(args, "ratio_norm", "off") != "off" and args.sde_type != "sde":
        raise ConfigError(
            f"--ratio-norm {args.ratio_norm} with --sde-type {args.sde_type}: GRPO-Guard's "
            "RatioNorm (E7) is defined for the SDE step, whose log-prob has the 1 / (2 s^2) and "
            "the sqrt|dt| it undoes; use --sde-type sde, or --ratio-norm off"
        )
    if args.sde_type != "cps":
        return
    if args.noise_level > 1:
        raise ConfigError(
            f"--noise-level {args.noise_level} with --sde-type cps: must be in [0, 1] (the CPS std "
            "sigma_next sin(a pi / 2) is largest at a = 1 and falls again above it); the released "
            "CPS configs use 0.8"
        )
    if trains_last_step:
        raise ConfigError(
            f"--sde-type cps with {which}: the last step is trained, but it lands on sigma = 0, "
            "where the CPS std sigma_next sin(a pi / 2) is 0 (no action to learn, and the KL "
            "divides by 0); train fewer steps"
        )


def check_run_name(args) -> None:
    """--run-name is one plain folder name inside --output-dir (not '.', '..', a path or empty)."""
    name = args.run_name
    if name is not None and (
        name in ("", ".", "..") or os.sep in name or (os.altsep or os.sep) in name
    ):
        raise ConfigError(
            f"--run-name {name!r}: give one plain folder name (no '/', not '.' or '..'); the run "
            "folder is {output_dir}/{run_name}, so use --output-dir for where it goes"
        )


def read_prompt_file(path: str, flag: str) -> list[str]:
    """The prompts of a --prompts-file / --eval-prompts file; a missing, unreadable or empty one
    names its flag."""
    from common import toyworld

    try:
        return toyworld.load_prompts(path)
    except FileNotFoundError:
        raise ConfigError(
            f"{flag} '{path}' does not exist: give a text file with one prompt per line"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{flag} '{path}' cannot be read ({e.__class__.__name__}: {e}): give a text file with "
            "one prompt per line"
        ) from None
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None
