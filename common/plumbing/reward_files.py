"""Reward weights from local files or hub ids, each failure one line naming what was expected, and
optional packages imported with their pip command. Nothing here unpickles a file: weights load with
torch.load(weights_only=True)."""

from __future__ import annotations

import importlib
import math
import os
import pickle
import re

import torch

from common.plumbing.checks import pickled_global

# reward -> (module, package, its pip install arguments (torchvision pinned to torch 2.13))
OPTIONAL = {"hpsv2": ("open_clip", "open_clip_torch", "open_clip_torch==3.3.0 torchvision==0.28.0")}


class RewardLoadError(ValueError):
    """A reward's weights could not be found or loaded; the message says what was expected."""


class MissingRewardPackage(ImportError):
    """An optional package a reward needs is not installed; the message gives the pip command."""


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _is_hub_id(path: str) -> bool:
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) is not None and not path.startswith(".")


def _require(name: str):
    """Import an optional package, or fail with one line naming it and its pip command."""
    module, package, pins = OPTIONAL[name]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingRewardPackage(
            f"{name}: needs the optional package '{package}' ({_first_line(e)}); install it "
            f"with `pip install {pins}` (see requirements-optional.txt)"
        ) from None


def _find_file(name: str, path: str, filename: str, hint: str) -> str:
    """`path` is the file, a folder holding `filename`, or a hub repo id (fetched to the HF cache)."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, filename)):
            return os.path.join(path, filename)
        raise RewardLoadError(f"{name}: no {filename} in '{path}': expected {hint}")
    if not _is_hub_id(path):
        raise RewardLoadError(f"{name}: '{path}' does not exist: expected {hint}")
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(path, filename)
    except Exception as e:  # offline, unknown repo, missing file: all end here
        raise RewardLoadError(
            f"{name}: could not get {filename} from hub repo '{path}' ({_first_line(e)}): expected "
            f"{hint}"
        ) from None


def _from_pretrained(name: str, cls, path: str, hint: str):
    """`cls.from_pretrained(path)` (local folder or hub id) with one clear line on failure."""
    if not os.path.isdir(path) and not _is_hub_id(path):
        raise RewardLoadError(f"{name}: '{path}' does not exist: expected {hint}")
    try:
        return cls.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise RewardLoadError(
            f"{name}: could not load '{path}': expected {hint} ({_first_line(e)})"
        ) from None


def _torch_load(path: str, name: str):
    """A reward's weight file, tensors and plain values only (weights_only=True). A file that needs
    pickle is refused, never loaded: unpickling a file someone else made can run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    # UnpicklingError: it needs pickle, or is malformed; the rest: a truncated or corrupt file
    except (pickle.UnpicklingError, OSError, RuntimeError, EOFError, ValueError) as e:
        if isinstance(e, pickle.UnpicklingError) and pickled_global(e) is not None:
            raise RewardLoadError(_needs_pickle(name, path)) from None
        raise RewardLoadError(
            f"{name}: '{path}' is not a weight file torch can read ({_first_line(e)})"
        ) from None


def _needs_pickle(name: str, path: str) -> str:
    return (
        f"{name}: '{path}' holds Python objects besides tensors, which only pickle loads, and "
        "unpickling can run code, so it was not loaded; if you trust where it came from, re-save "
        "its tensors once: python -c \"import torch; p = '" + path.replace("'", "\\'") + "'; "
        "s = torch.load(p, weights_only=False); s = s.get('state_dict', s) if isinstance(s, dict) "
        'else s.state_dict(); torch.save({k: v for k, v in s.items() if torch.is_tensor(v)}, p)"'
    )


def _hub_hint(what: str, hub_id: str, key: str, files: str = "") -> str:
    return (
        f"{what} (e.g. the hub id {hub_id} downloaded with `hf download {hub_id}{files}`; "
        f"set with --reward-model-paths {key}=PATH)"
    )


# BLIP's timm-style ViT -> transformers' BlipVisionModel (transformers 4 convert_blip_*.py rules)
_BLIP_VIT_RENAMES = (
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^norm\.", "post_layernorm."),
    (r"^blocks\.(\d+)\.", r"encoder.layers.\1."),
    (r"\.attn\.proj\.", ".self_attn.projection."),
    (r"\.attn\.qkv\.", ".self_attn.qkv."),  # fused q|k|v in both, same layout
    (r"\.norm([12])\.", r".layer_norm\1."),
)


def _imagereward_state_dicts(state: dict) -> dict[str, dict]:
    """ImageReward.pt's flat state dict -> the "vision", "text" and "mlp" state dicts of
    BlipVisionModel (renamed by _BLIP_VIT_RENAMES), BlipTextModel (BLIP's med.py BERT, whose names
    it kept; position_ids is rebuilt) and AestheticMLP. BLIP's contrastive heads are dropped."""
    out: dict[str, dict] = {"vision": {}, "text": {}, "mlp": {}}
    for key, value in state.items():
        part, _, rest = key.partition(".")
        if part == "mlp":
            out["mlp"][rest] = value
        elif part == "blip" and rest.startswith("visual_encoder."):
            rest = rest.removeprefix("visual_encoder.")
            for pattern, repl in _BLIP_VIT_RENAMES:
                rest = re.sub(pattern, repl, rest)
            out["vision"][rest] = value
        elif part == "blip" and rest.startswith("text_encoder."):
            if not rest.endswith("position_ids"):
                out["text"][rest.removeprefix("text_encoder.")] = value
    return out


def _blip_configs(vit: dict, med: dict):
    """BlipVisionConfig from the ViT's weights (BLIP's ViTs: 64-wide heads, timm's LayerNorm eps
    1e-6) and BlipTextConfig from med_config.json (cross-attention from every layer to the image
    tokens, as BLIP's med.py in 'multimodal' mode)."""
    from transformers import BlipTextConfig, BlipVisionConfig

    width = vit["embeddings.class_embedding"].shape[-1]
    patch = vit["embeddings.patch_embedding.weight"].shape[-1]
    vision = BlipVisionConfig(
        hidden_size=width,
        intermediate_size=vit["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=len({k.split(".")[2] for k in vit if k.startswith("encoder.layers.")}),
        num_attention_heads=max(1, width // 64),
        patch_size=patch,
        layer_norm_eps=1e-6,
        image_size=math.isqrt(vit["embeddings.position_embedding"].shape[1] - 1) * patch,
    )
    required = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads"
    optional = {"hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0}
    text = BlipTextConfig(
        **{k: med[k] for k in (*required.split(), "max_position_embeddings")},
        **{k: med.get(k, default) for k, default in optional.items()},
        # unused here; BLIP's defaults overflow tiny vocabs
        **dict.fromkeys(("bos_token_id", "eos_token_id", "sep_token_id")),
        encoder_hidden_size=width,
        is_decoder=True,  # build the cross-attention layers
    )
    return vision, text
