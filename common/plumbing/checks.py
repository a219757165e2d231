"""Checks of user input before any model is loaded, and their one-line error, ConfigError.

Each script's check_args calls `check_ranges(args)` first (so that its batch arithmetic never
divides by 0), then `check_flag` on its own flags. Floats must be finite: tyro reads "nan", "inf".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass


class ConfigError(SystemExit):
    """Bad user input: printed as one line (no traceback) and the process exits with status 1."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


@dataclass(frozen=True)
class Rule:
    """lo <= value <= hi (strict where lo_open / hi_open); None is allowed when optional."""

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
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"in {left}{self.lo:g}, {self.hi:g}{right}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"

    def ok(self, v) -> bool:
        if v is None:
            return self.optional
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            return False
        if math.isnan(v) or (math.isinf(v) and not self.allow_inf):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))


def _int(lo: int, why: str = "", optional: bool = False, hi: int | None = None) -> Rule:
    return Rule(lo, hi, integer=True, optional=optional, why=why)


# Rows one call may hold: more than the largest evaluation accepted (MAX_EVAL_IMAGES) is a typo,
# and past 2**63 torch cannot even split a tensor by it (a traceback after the model loaded).
MAX_BATCH = 1_000_000
MAX_STEPS = 1000  # the schedulers are trained on 1000 timesteps; 10**20 cannot be allocated


# The shared table: flag (Args field) -> rule. A field a script does not have is skipped.
RANGES: dict[str, Rule] = {
    "seed": Rule(0, 2**32 - 1, integer=True, why="numpy's seeds are 32-bit"),
    # sampler
    "noise_level": Rule(
        0, why="a scales the SDE's standard deviation; 0 = the deterministic ODE, no exploration"
    ),
    "num_steps": _int(1, "denoising steps of a rollout", hi=MAX_STEPS),
    "eval_num_steps": _int(1, "ODE steps at evaluation", hi=MAX_STEPS),
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
    "rollout_batch_size": _int(1, "images per transformer call", hi=MAX_BATCH),
    "train_batch_size": _int(
        1,
        "transitions per training forward; unset = --rollout-batch-size",
        optional=True,
        hi=MAX_BATCH,
    ),
    "eval_batch_size": _int(1, "images per transformer call at evaluation", hi=MAX_BATCH),
    "decode_batch_size": _int(1, "images per VAE decode call"),  # and at most a batch
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


def _default(args, name: str, missing=dataclasses.MISSING):
    """The default of `args`' field `name` (a dataclass; argparse's namespace has none)."""
    fields = dataclasses.fields(args) if dataclasses.is_dataclass(args) else ()
    return next((f.default for f in fields if f.name == name), missing)


def check_flag(args, name: str, rule: Rule) -> None:
    """One flag against one rule (a tuple flag: each element), or ConfigError naming the given, the
    allowed and the default value."""
    value = getattr(args, name)
    values = value if isinstance(value, (tuple, list)) else (value,)
    if all(rule.ok(v) for v in values):  # None: Rule.ok says whether it is optional
        return
    default = _default(args, name)
    usual = "" if default is dataclasses.MISSING else f"; the default is {_show(default)}"
    kind = "an integer " if rule.integer else "a finite number " if not rule.allow_inf else ""
    why = f" ({rule.why})" if rule.why else ""
    each = "each value " if isinstance(value, (tuple, list)) else ""
    raise ConfigError(
        f"{_flag(name)} {_show(value)}: {each}must be {kind}{rule.allowed()}{why}{usual}"
    )


def check_ranges(args, table: dict[str, Rule] | None = None) -> None:
    """Every flag of `table` (default RANGES) that `args` has; with RANGES, --decode-batch-size is
    also at most the larger of the batches a VAE decode call gets (rollout, evaluation), or its
    default: a larger value decodes the same."""
    for name, rule in (table or RANGES).items():
        if hasattr(args, name):
            check_flag(args, name, rule)
    if table is not None or not hasattr(args, "decode_batch_size"):
        return
    batches = {n: getattr(args, n, 1) for n in ("rollout_batch_size", "eval_batch_size")}
    default = _default(args, "decode_batch_size", 1)
    most = max(*batches.values(), default)
    if args.decode_batch_size > most:
        given = ", ".join(f"{_flag(n)} {v}" for n, v in batches.items())
        raise ConfigError(
            f"--decode-batch-size {args.decode_batch_size}: a VAE decode call here gets at most "
            f"{max(batches.values())} images ({given}), so a larger value decodes the same: pass "
            f"at most {most} (the default is {default})"
        )


def check_sde_type(args, trains_last_step: bool, which: str) -> None:
    """--sde-type cps (common/sampler.py, E6) and its limits; `which` names the flags that decide
    the trained steps."""
    if getattr(args, "ratio_norm", "off") != "off" and args.sde_type != "sde":
        raise ConfigError(
            f"--ratio-norm {args.ratio_norm} with --sde-type {args.sde_type}: GRPO-Guard's "
            "RatioNorm (E7) is defined for the SDE step, whose log-prob has the 1 / (2 s^2) and "
            "the sqrt|dt| it undoes; use --sde-type sde, or --ratio-norm off"
        )
    if args.sde_type == "cps" and args.noise_level > 1:
        raise ConfigError(
            f"--noise-level {args.noise_level} with --sde-type cps: must be in [0, 1] (the CPS std "
            "sigma_next sin(a pi / 2) is largest at a = 1 and falls again above it); the released "
            "CPS configs use 0.8"
        )
    if args.sde_type == "cps" and trains_last_step:
        raise ConfigError(
            f"--sde-type cps with {which}: the last step is trained, but it lands on sigma = 0, "
            "where the CPS std sigma_next sin(a pi / 2) is 0 (no action to learn, and the KL "
            "divides by 0); train fewer steps"
        )


MAX_NAME_BYTES = 255  # a run folder's name is one directory entry: most file systems take 255


def check_run_name(args) -> None:
    """--run-name is one plain folder name: not '.', '..', a path, empty, a control character, or
    longer than a file system takes."""
    name = args.run_name
    if name is None:
        return
    if name in ("", ".", "..") or os.sep in name or (os.altsep or os.sep) in name:
        raise ConfigError(
            f"--run-name {name!r}: give one plain folder name (no '/', not '.' or '..'); the run "
            "folder is {output_dir}/{run_name}, so use --output-dir for where it goes"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or len(name.encode()) > MAX_NAME_BYTES:
        raise ConfigError(
            f"--run-name {name[:80]!r}{'...' if len(name) > 80 else ''}: give one plain folder "
            f"name of printable characters (no newline or other control character), at most "
            f"{MAX_NAME_BYTES} bytes"
        )


# A prompt longer than this is not a prompt: the text encoders read at most 512 T5 tokens (about
# 2,500 characters) and cut the rest, and an evaluation grid captions every prompt.
MAX_PROMPT_CHARS = 4096
MAX_PROMPT_FILE_BYTES = 64 * 2**20


def read_prompt_file(path: str, flag: str, digests: dict | None = None) -> list[str]:
    """The prompts of a --prompts-file / --eval-prompts file, or one line naming the flag. Read once
    (it may be a pipe): `digests` gets the sha256 of the bytes read, which checkpoints record."""
    from common import toyworld

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{flag} '{path}' {what}: give a text file with one prompt per line")

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROMPT_FILE_BYTES + 1)
        if len(raw) > MAX_PROMPT_FILE_BYTES:
            raise bad(f"is larger than {MAX_PROMPT_FILE_BYTES // 2**20} MiB")
        prompts = toyworld.prompts_from_text(raw.decode("utf-8-sig"), path)
    except FileNotFoundError:
        raise bad("does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise bad(f"cannot be read ({e.__class__.__name__}: {reason})") from None
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None
    for k, p in enumerate(prompts):
        if len(p) > MAX_PROMPT_CHARS:
            raise ConfigError(
                f"{flag} '{path}': prompt {k + 1} is {len(p):,} characters long, at most "
                f"{MAX_PROMPT_CHARS} (the text encoders read about 2,500 characters and cut the "
                "rest): one prompt per line"
            )
    if digests is not None:  # by the flag's field name, as a checkpoint's fingerprints are
        digests[flag.lstrip("-").replace("-", "_")] = hashlib.sha256(raw).hexdigest()
    return prompts


# One evaluation's images: its job list is built up front (and every image is scored), so a size
# past this is a typo, not an experiment (GenEval: 553 prompts x 4 seeds).
MAX_EVAL_IMAGES = 1_000_000


def check_eval_size(args, eval_prompts: list[str]) -> None:
    """len(eval prompts) x seeds per prompt, at every evaluation and the final one, is bounded."""
    for name in ("eval_seeds_per_prompt", "final_eval_seeds_per_prompt"):
        seeds = getattr(args, name, None) or 0
        if len(eval_prompts) * seeds > MAX_EVAL_IMAGES:
            raise ConfigError(
                f"{_flag(name)} {seeds}: {len(eval_prompts)} evaluation prompts x {seeds} seeds = "
                f"{len(eval_prompts) * seeds:,} images per evaluation, at most {MAX_EVAL_IMAGES:,}; "
                f"pass at most {max(1, MAX_EVAL_IMAGES // len(eval_prompts))}"
            )


# ------------------------------------------------------------------------------- files read back
# The JSON the project reads back is a few levels deep; deeper is not one of its files, and Python's
# parser would run out of stack on it (RecursionError) long before it ran out of memory.
MAX_JSON_DEPTH = 32


def kind_of(value) -> str:
    """'an object', 'a list', 'a number', ... : what a JSON value is, for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a number")


def _depth(value) -> int:
    """How deep a parsed JSON value nests (iterative: the value may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((x, d + 1) for x in children)
    return deepest


def parse_json(text: str, expect: type = dict):
    """A JSON text that is an `expect` (dict or list) at most MAX_JSON_DEPTH deep, or ValueError
    saying what it is instead (json.JSONDecodeError, a ValueError, says where the text breaks)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(value, expect):
        raise ValueError(f"{kind_of(value)}, not {kind_of(expect())}")
    if _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json(path: str, expect: type = dict):
    """A JSON file (see parse_json); every bad file raises ValueError too, but a missing one stays
    FileNotFoundError (callers say what to do about that)."""
    if os.path.isdir(path):
        raise ValueError("a folder, not a file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", e)
        raise ValueError(f"unreadable ({e.__class__.__name__}: {reason})") from None
    return parse_json(text, expect)


def pickled_global(e: BaseException) -> str | None:
    """The Python object a torch.load(weights_only=True) refused to rebuild, or None when the error
    is of another kind (a file that is not a checkpoint at all)."""
    found = re.search(r"GLOBAL (\S+)", str(e))
    return found.group(1) if found else None
