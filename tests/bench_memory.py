"""Memory model: per-GPU bytes of the training step for FLUX.1-dev and SD3.5-Medium, DDP against FSDP (--parallel).

    python tests/bench_memory.py            # the table of docs/results.md ("Memory per GPU: DDP against FSDP")

Parameter counts are exact: the diffusers transformer is built on the meta device from the published config
(FLUX.1-dev: FluxTransformer2DModel's defaults with guidance_embeds; SD3.5-M: its transformer/config.json), and a LoRA
counts r (in + out) per adapted Linear. Per GPU, with P weights in the transformer, T of them trained, N GPUs:

    DDP   weights  full: 4P (fp32 masters)            LoRA: 2P (bf16 base) + 4T
          grads    4T, and 4T more in DDP's buckets (gradient_as_bucket_view=False, the default)
          Adam     8T (two fp32 moments)
    FSDP  weights  (the same) / N + two gathered bf16 blocks (the one computing, the one prefetched)
          grads    4T / N + one block's unsharded fp32 gradient before its reduce-scatter; with gradient
                   accumulation (grad_sync skips the sync) the UNSHARDED 4T while accumulating
          Adam     8T / N
          offload  weights, grads and Adam live in host memory; the GPU keeps the gathered blocks
    KL reference of full fine-tuning: a frozen bf16 copy, 2P (DDP) or 2P / N (FSDP).

Activations per transition (one row of the training micro-batch, LoRA, no checkpointing) are MEASURED, not modelled:
the H200 peaks of docs/results.md (compute table, 512 px, bf16): SD3.5-M at micro-batch 8 with CFG and beta 0.04,
47.9 GiB; FLUX.1-dev at micro-batch 2, 41.6 GiB; minus the bf16 weights and LoRA state of this model, divided by the
micro-batch. Full fine-tuning saves about the same activations (the inputs of every Linear). With
--gradient-checkpointing each block keeps only its bf16 input (image and text streams: 2 bytes x tokens x width)
and one block's activations are rebuilt at a time (the measured per-transition figure / blocks). The parameter,
gradient and Adam terms are checked against per-rank bytes measured on the tiny models under DDP and FSDP on 2 ranks
(tests/test_parallel.py). Not counted: the text encoders and the VAE (bf16: about 11 GB for SD3.5, 10 GB for FLUX,
docs/results.md), the CUDA context, the allocator's fragmentation.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GB = 1e9

# The published transformers: FLUX.1-dev (black-forest-labs/FLUX.1-dev transformer/config.json = the class defaults
# with guidance_embeds) and SD3.5-Medium (stabilityai/stable-diffusion-3.5-medium transformer/config.json).
CONFIGS = {
    "FLUX.1-dev": ("flux", dict(guidance_embeds=True)),
    "SD3.5-M": ("sd3", dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")),
}
# The documented training step (docs/flowgrpo.md, docs/g2rpo.md): 512 px; SD3 with CFG (2 rows per transition) and
# 77 CLIP + 128 T5 text tokens; FLUX with 512 T5 tokens (our default) and its guidance input (1 row).
SETTING = {"FLUX.1-dev": dict(image_tokens=1024, text_tokens=512, rows_per_sample=1),
           "SD3.5-M": dict(image_tokens=1024, text_tokens=205, rows_per_sample=2)}


def build(kind: str, config: dict, device="meta"):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    with torch.device(device):
        return (FluxTransformer2DModel if kind == "flux" else SD3Transformer2DModel)(**config)


def lora_count(model, rank: int) -> int:
    """Trained weights of an all-linear LoRA (--lora-target all-linear): r (in + out) per Linear."""
    return sum(rank * (m.in_features + m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))


def blocks(model) -> list:
    names = set(model._no_split_modules)
    return [m for m in model.modules() if type(m).__name__ in names]


def describe(name: str, lora_rank: int = 32) -> dict:
    kind, config = CONFIGS[name]
    model = build(kind, config)
    P = sum(p.numel() for p in model.parameters())
    blk = [sum(p.numel() for p in b.parameters()) for b in blocks(model)]
    lora_blk = max(lora_count(b, lora_rank) for b in blocks(model))
    width = model.config.num_attention_heads * model.config.attention_head_dim
    kinds = {}
    for b in blocks(model):
        kinds[type(b).__name__] = kinds.get(type(b).__name__, 0) + 1
    return dict(P=P, T_lora=lora_count(model, lora_rank), block_max=max(blk), lora_block_max=lora_blk, width=width,
                blocks=kinds, kind=kind)


def per_gpu(m: dict, full: bool, parallel: str, n: int, offload: bool = False, accumulate: bool = False,
            reference: bool = False) -> dict:
    """Bytes per GPU of the weights, gradients and Adam state (see the module docstring), without activations."""
    P, T = m["P"], (m["P"] if full else m["T_lora"])
    weights = 4 * P if full else 2 * P + 4 * T
    ref = 2 * P if full and reference else 0
    if parallel == "ddp":
        return dict(weights=weights + ref, grads=8 * T, adam=8 * T)
    gathered = 2 * 2 * m["block_max"] * (2 if reference else 1)
    block_grad = 4 * (m["block_max"] if full else m["lora_block_max"])
    out = dict(weights=(weights + ref) / n + gathered, grads=4 * T / n + block_grad + (4 * T if accumulate else 0),
               adam=8 * T / n)
    if offload:  # the shards in host memory; the gathered blocks and the block gradient stay on the GPU
        out = dict(weights=gathered, grads=block_grad + (4 * T if accumulate else 0), adam=0.0)
    return out


# Measured H200 peaks (docs/results.md, compute table): (peak bytes, micro-batch), LoRA r 32, 512 px.
MEASURED_PEAK = {"FLUX.1-dev": (41.6 * 2**30, 2), "SD3.5-M": (47.9 * 2**30, 8)}


def activations(m: dict, name: str, micro_batch: int, checkpointing: bool) -> float:
    peak, mb = MEASURED_PEAK[name]
    per_transition = (peak - sum(per_gpu(m, False, "ddp", 1).values())) / mb
    if not checkpointing:
        return per_transition * micro_batch
    s, n_blocks = SETTING[name], sum(m["blocks"].values())
    tokens, rows = s["image_tokens"] + s["text_tokens"], micro_batch * s["rows_per_sample"]
    return (2 * tokens * m["width"] * n_blocks * rows) + per_transition * micro_batch / n_blocks


def table() -> str:
    rows = ["| model | training | parallel | GPUs | weights | grads | Adam | total without activations | "
            "+ activations, micro-batch 1 (with --gradient-checkpointing) |", "|---|---|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        m = describe(name)
        act, act_ck = activations(m, name, 1, False), activations(m, name, 1, True)
        for full in (True, False):
            for parallel, offload, counts in (("ddp", False, ("any",)), ("fsdp", False, (1, 2, 4, 8)),
                                              ("fsdp", True, (1, 8))):
                for n in counts:
                    b = per_gpu(m, full, parallel, 1 if n == "any" else n, offload)
                    fixed = sum(b.values())
                    rows.append(f"| {name} | {'full' if full else 'LoRA r 32'} | "
                                f"{parallel}{' + offload' if offload else ''} | {n} | {b['weights'] / GB:.1f} | "
                                f"{b['grads'] / GB:.1f} | {b['adam'] / GB:.1f} | {fixed / GB:.1f} | "
                                f"{(fixed + act) / GB:.1f} ({(fixed + act_ck) / GB:.1f}) |")
    return "\n".join(rows)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for name in CONFIGS:
        m = describe(name)
        print(f"{name}: {m['P'] / 1e9:.2f} B weights, LoRA r 32 all-linear {m['T_lora'] / 1e6:.1f} M, largest block "
              f"{m['block_max'] / 1e6:.0f} M, width {m['width']}, blocks {m['blocks']}; activations per transition "
              f"{activations(m, name, 1, False) / GB:.2f} GB ({activations(m, name, 1, True) / GB:.2f} GB with "
              "checkpointing)")
    print(table())
