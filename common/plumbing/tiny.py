"""Random-weight SD3 / SD3.5 / FLUX.1 pipelines in diffusers layout, built offline (tokenizers from
a word list) and loaded by `common.backbones.load_backbone(path)` as real weights are.

Shape rules (see ../shared/reference/offline.md §2):
- SD3: the two CLIP hidden states are concatenated and padded to the T5 width, so
  `joint_attention_dim == t5_dim >= 2 * clip_dim`; `pooled_projection_dim == 2 * clip_dim`.
- FLUX: CLIP pooled output -> `pooled_projection_dim`; T5 width -> `joint_attention_dim`;
  the transformer sees 2x2-packed latents, so `in_channels == 4 * latent_channels`.
- CLIP pools at the first eos token only when the config's eos id equals the tokenizer's (1 here).
"""

from __future__ import annotations

import os
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

# A small vocabulary: every word is one token; unknown words still tokenize (into pieces).
WORDS = (
    "a an the of in on with and photo picture red green blue yellow magenta cyan black white "
    "circle circles square squares triangle triangles two three four left right above below "
    "cat dog house tree car sky sun flower"
).split()


def make_clip_tokenizer(words=WORDS, model_max_length: int = 16) -> CLIPTokenizer:
    """Byte-level BPE whose merges turn every listed word into one token: they are learned as BPE
    learns them (merge the most frequent adjacent pair, repeatedly); unknown words fall back to
    pieces."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in bytes_to_unicode().values():
            vocab.setdefault(c + suffix, len(vocab))
    symbols = [list(w[:-1]) + [w[-1] + "</w>"] for w in dict.fromkeys(words)]
    merges = []
    while any(len(s) > 1 for s in symbols):
        counts = Counter(pair for s in symbols for pair in zip(s, s[1:]))
        best = max(counts, key=lambda p: (counts[p], p))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        for s in symbols:  # merge every occurrence, left to right, in place
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i : i + 2] = [s[i] + s[i + 1]]
                i += 1
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def make_t5_tokenizer(words=WORDS, model_max_length: int = 512) -> T5Tokenizer:
    """Unigram tokenizer: <pad>=0, </s>=1, <unk>=2, one piece per word, then single characters."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -3.0) for w in dict.fromkeys(words)]
    seen = dict(pieces)
    chars = [p for c in map(chr, range(33, 127)) for p in (c, "\u2581" + c) if p not in seen]
    pieces += [(p, -8.0) for p in chars]
    # extra_ids=0: no 100 sentinel tokens, which would dwarf the tiny vocabulary.
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def clip_text_config(vocab_size, hidden=32, layers=2, heads=4, max_len=16) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_len,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def t5_config(vocab_size, d_model=64, layers=1, heads=4) -> T5Config:
    return T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * min(d_model, 64),
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="relu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def tiny_vae(
    latent_channels=4,
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_groups=4,
    scaling_factor=1.5035,
    shift_factor=0.0609,
    mid_attention=False,
):
    """AutoencoderKL with vae_scale_factor = 2 ** (len(block_out_channels) - 1). With
    latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_groups=32,
    mid_attention=True it is the SD3 / FLUX autoencoder's architecture."""
    from diffusers import AutoencoderKL

    n = len(block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(block_out_channels),
        layers_per_block=layers_per_block,
        latent_channels=latent_channels,
        norm_num_groups=norm_groups,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        mid_block_add_attention=mid_attention,
    )


def _text_encoders(seed, words, max_len, clip_cls, n_clip, clip_dim, clip_layers, t5_dim) -> dict:
    """Seeds torch, then the pipeline's tokenizers and random text encoders: `n_clip` CLIPs, then
    T5 (None for both when `t5_dim` is None), named as the diffusers pipelines name them."""
    torch.manual_seed(seed)
    parts = {}
    for suffix in ("", "_2")[:n_clip]:
        tok = make_clip_tokenizer(words, max_len)
        config = clip_text_config(len(tok), clip_dim, clip_layers, max_len=max_len)
        parts.update({f"tokenizer{suffix}": tok, f"text_encoder{suffix}": clip_cls(config)})
    t5 = ("", "_2", "_3")[n_clip]
    tok = make_t5_tokenizer(words) if t5_dim is not None else None
    model = T5EncoderModel(t5_config(len(tok), t5_dim)) if tok is not None else None
    parts.update({f"tokenizer{t5}": tok, f"text_encoder{t5}": model})
    return parts


def build_sd3(
    path: str | None = None,
    seed: int = 0,
    sd35: bool = False,
    latent_channels: int = 4,
    num_layers: int = 2,
    heads: int = 4,
    head_dim: int = 8,
    patch_size: int = 2,
    clip_dim: int = 32,
    clip_layers: int = 2,
    t5_dim: int | None = 64,
    max_len: int = 16,
    vae=None,
    words=WORDS,
    transformer_kwargs: dict | None = None,
):
    """A StableDiffusion3Pipeline with random weights, saved to `path` if given. `sd35`: SD3.5's
    dual attention in the first layer and RMS qk-norm. `t5_dim=None`: no T5 (the pipeline feeds
    zeros in its place)."""
    import diffusers

    joint = t5_dim if t5_dim is not None else 2 * clip_dim
    if joint < 2 * clip_dim:
        raise ValueError("SD3 pads the two CLIP states to the T5 width: t5_dim >= 2 * clip_dim")
    encoders = _text_encoders(
        seed, words, max_len, CLIPTextModelWithProjection, 2, clip_dim, clip_layers, t5_dim
    )
    vae = vae if vae is not None else tiny_vae(latent_channels)
    extra = dict(dual_attention_layers=(0,), qk_norm="rms_norm") if sd35 else {}
    transformer = diffusers.SD3Transformer2DModel(
        **{
            "sample_size": 32,
            "patch_size": patch_size,
            "in_channels": latent_channels,
            "out_channels": latent_channels,
            "num_layers": num_layers,
            "attention_head_dim": head_dim,
            "num_attention_heads": heads,
            "caption_projection_dim": heads * head_dim,
            "joint_attention_dim": joint,
            "pooled_projection_dim": 2 * clip_dim,
            "pos_embed_max_size": 64,
            **extra,
            **(transformer_kwargs or {}),
        }
    )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, **encoders
    )
    if path is not None:
        pipe.save_pretrained(path)
    return pipe


def build_flux(
    path: str | None = None,
    seed: int = 0,
    guidance_embeds: bool = True,
    latent_channels: int = 4,
    num_layers: int = 1,
    num_single_layers: int = 1,
    max_len: int = 16,
    vae=None,
):
    """A FluxPipeline with random weights (FLUX.1-dev style when `guidance_embeds`), saved to `path`
    if given."""
    import diffusers

    encoders = _text_encoders(seed, WORDS, max_len, CLIPTextModel, 1, 32, 2, 32)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # the T5 width
        pooled_projection_dim=32,  # the CLIP width
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8),  # they must sum to the head dim
    )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    vae = vae if vae is not None else tiny_vae(latent_channels)  # after the transformer: its seed
    pipe = diffusers.FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, **encoders)
    if path is not None:
        pipe.save_pretrained(path)
    return pipe
