"""The reward flags: their spelling, what can be checked before any model loads, and the RewardModel
they build (common/rewards.py has the rewards themselves).

    --reward pickscore                         one reward
    --reward "pickscore:1.0,clipscore:0.5"     a weighted mix (weights multiply the scores)
    --reward-mix score | advantage             Flow-GRPO: A = norm(scores @ w); G²RPO: A = norm(s_k) @ w
    --guard-rewards "pickscore,aesthetic"      same registry, logged beside the target at evaluation
    --reward-model-paths "pickscore=/ckpt/PickScore_v1,aesthetic=/ckpt/aesthetic"
    --reward "toyworld,remote:geneval@http://127.0.0.1:8000:0.5"   a reward scored by a server

Weights (--reward-model-paths KEY=PATH, PATH a local folder or file or a hub id; defaults in
DEFAULT_PATHS): pickscore, clipscore: a transformers CLIP folder, its processor from <name>_processor,
else that folder, else a hub default; aesthetic: a folder holding sac+logos+ava1-l14-linearMSE.pth,
its CLIP from aesthetic_clip, else that folder, else openai/clip-vit-large-patch14; hpsv2:
HPS_v2.1_compressed.pt, its folder, or xswu/HPSv2; imagereward: a folder holding ImageReward.pt and
med_config.json (THUDM/ImageReward), scored with transformers' BLIP classes, its tokenizer from
imagereward_tokenizer, else that folder, else bert-base-uncased. A remote reward (remote_reward.py)
mixes, weighs, guards and evaluates like any other, scoring the 8-bit image ((x * 255).round()).
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from common.plumbing.checks import ConfigError
from common.plumbing.remote_reward import RemoteReward, is_remote, load_metadata, parse_remote
from common.plumbing.reward_files import OPTIONAL, _require
from common.rewards import DEFAULT_PATHS, LOADERS, RewardModel

REWARD_NAMES: tuple[str, ...] = tuple(LOADERS)  # every in-process reward, by its --reward name
_CACHE: dict[tuple, object] = {}
PATH_KEYS = tuple(
    "aesthetic aesthetic_clip pickscore pickscore_processor clipscore clipscore_processor hpsv2 "
    "imagereward imagereward_tokenizer".split()
)


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """'pickscore:1.0,clipscore:0.5' or 'pickscore' (weight 1) -> [(name, weight), ...]; a remote
    reward's name is its item without the weight ('remote:geneval@http://h:8000'). No imports."""
    choices = (
        f"choose from {', '.join(REWARD_NAMES)}, or remote:NAME@http://HOST:PORT (a reward "
        "server); or a weighted mix like 'pickscore:1.0,clipscore:0.5'"
    )
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError(f"empty reward spec {spec!r}: {choices}")
    out: list[tuple[str, float]] = []
    for item in items:
        if is_remote(item):  # its name: the item as spelled, without the weight
            remote, weight = parse_remote(item)
            name, given = remote.text, weight is not None
        else:
            name, given, weight = (p.strip() for p in item.partition(":"))
            if name not in REWARD_NAMES:
                raise ValueError(f"unknown reward '{name}': {choices}")
        if reward_name(name) in (reward_name(n) for n, _ in out):
            raise ValueError(f"reward '{reward_name(name)}' appears twice in {spec!r}")
        try:
            w = float(weight) if given else 1.0
        except ValueError:
            w = float("nan")
        with np.errstate(over="ignore"):
            # weights are float32 tensors: 1e39 is finite here, infinite there
            finite = np.isfinite(np.float32(w))
        if not finite:
            raise ValueError(
                f"bad weight '{weight}' for reward '{name}' in {spec!r}: expected a finite float32 "
                "number (|w| < 3.4e38), e.g. 'pickscore:1.0'"
            )
        if w == 0:  # trains nothing: a silent no-op
            raise ValueError(
                f"weight 0 for reward '{name}' in {spec!r} trains nothing on it: drop it, or log it "
                "at evaluation with --guard-rewards"
            )
        out.append((name, w))
    return out


def reward_name(name: str) -> str:
    """A reward's name in metrics and RewardModel.names: a remote one's is 'remote:NAME'."""
    return name.partition("@")[0]


def _path_key(key: str) -> bool:
    return key in PATH_KEYS or re.fullmatch(r"remote:[\w.-]+", key) is not None


def parse_model_paths(s: str) -> dict[str, str]:
    """'pickscore=/x/y,clipscore=/z' -> {'pickscore': '/x/y', 'clipscore': '/z'}; '' -> {}."""
    out = {}
    for item in (p.strip() for p in s.split(",")):
        if not item:
            continue
        key, eq, path = (p.strip() for p in item.partition("="))
        if not eq or not path or not _path_key(key):
            raise ValueError(
                f"bad model path '{item}': expected KEY=PATH with KEY one of {', '.join(PATH_KEYS)}, "
                "or remote:NAME (a remote reward's prompt metadata, JSON lines)"
            )
        out[key] = path
    return out


def check_rewards(
    spec: str, guard_spec: str, model_paths: str, prompt_files: dict[str, list[str]]
) -> None:
    """All that can be checked before any model loads, as one line (ConfigError): the specs, path
    keys and optional packages, that each reward server answers (and has every prompt's metadata, if
    given some), and that a toy-world reward parses every prompt of prompt_files ({flag: prompts})."""
    try:
        # --reward is required (an empty one trains on nothing); --guard-rewards may be empty
        specs = [spec, guard_spec] if guard_spec else [spec]
        names = [n for s in specs for n, _ in parse_reward_spec(s)]
        paths = parse_model_paths(model_paths)
        for name in (n for n in names if n in OPTIONAL):
            _require(name)
        remotes = [n for n in names if is_remote(n)]
        for key in (k for k in paths if k.startswith("remote:")):
            if key not in map(reward_name, remotes):
                raise ValueError(
                    f"--reward-model-paths {key}=...: no reward {key}@URL in --reward or "
                    "--guard-rewards to send this metadata to"
                )
        for name in dict.fromkeys(remotes):  # the servers answer, each once
            _remote(name, paths).check(prompt_files)
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None
    if {"toyworld", "toyworld_coverage"} & set(names):
        from common.toyworld.prompts import parse

        for flag, prompts in prompt_files.items():
            for i, prompt in enumerate(prompts, 1):
                try:
                    parse(prompt)
                except ValueError as e:
                    raise ConfigError(
                        f"{flag}, prompt {i}: {e}; the toy-world rewards score only prompts of "
                        "this grammar: give a toy-world prompt file "
                        "(common/toyworld/prompts_*.txt) or another --reward"
                    ) from None


def load_rewards(
    spec: str, guard_spec: str, model_paths: str, device
) -> tuple[RewardModel, RewardModel | None]:
    """The target and guard rewards (None without --guard-rewards); a weight file that is missing or
    unreadable is one line (ConfigError), costing seconds, not a backbone load."""
    try:
        paths = parse_model_paths(model_paths)
        target = build_reward(spec, device, paths)
        return target, build_reward(guard_spec, device, paths) if guard_spec else None
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None


def _load(name: str, device: torch.device, paths: dict):
    """Build a reward once per (name, device, its paths); later calls (guard rewards) reuse it."""
    mine = sorted((k, v) for k, v in paths.items() if k == name or k.startswith(name + "_"))
    key = (name, str(device), tuple(mine))
    if key not in _CACHE:
        _CACHE[key] = LOADERS[name](paths, device)
    return _CACHE[key]


def _remote(name: str, paths: dict) -> RemoteReward:
    """A remote reward's client, once per (spelling, metadata file): one thread per server."""
    spec, _ = parse_remote(name)
    metadata_path = paths.get(spec.name)
    key = (spec.text, metadata_path)
    if key not in _CACHE:
        metadata = load_metadata(metadata_path) if metadata_path else None
        _CACHE[key] = RemoteReward(spec, metadata)
    return _CACHE[key]


def build_reward(
    spec: str, device="cpu", model_paths: dict[str, str] | None = None, batch_size: int = 32
) -> RewardModel:
    """`spec` as in parse_reward_spec; `model_paths` as parse_model_paths returns (defaults:
    DEFAULT_PATHS)."""
    pairs = parse_reward_spec(spec)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    bad = {k for k in model_paths or {} if not _path_key(k)}
    if bad:
        raise ValueError(
            f"unknown model path keys {sorted(bad)}: expected some of {', '.join(PATH_KEYS)}"
        )
    paths = {**DEFAULT_PATHS, **{k: os.path.expanduser(v) for k, v in (model_paths or {}).items()}}
    device = torch.device(device)
    for name in (n for n, _ in pairs if n in OPTIONAL):
        _require(name)  # a missing optional package fails before any model is loaded
    fns = [_remote(n, paths) if is_remote(n) else _load(n, device, paths) for n, _ in pairs]
    return RewardModel(
        [reward_name(n) for n, _ in pairs],
        torch.tensor([w for _, w in pairs], dtype=torch.float32),
        fns,
        device,
        batch_size,
    )
