"""Memory model: per-GPU bytes of the training step for FLUX.1-dev and SD3.5-Medium, DDP against FSDP (--parallel).

    python benchmarks/bench_memory.py            # the table of docs/results.md ("Memory per GPU: DDP against FSDP")

Parameter counts are exact: the diffusers transformer is built on the meta device from the published config
(FLUX.1-dev: FluxTransformer2DModel's defaults with guidance_embeds; SD3.5-M: its transformer/config.json), and a LoRA
counts r (in + out) per adapted Linear. Per GPU, with P weights in the transformer, T of them trained, N GPUs:

    DDP   weights  full: 4P (fp32 masters)            LoRA: 2P (bf16 base) + 4T
          grads    4T, and 4T more in DDP's buckets (gradient_as_bucket_view=False, the default)
          Adam     8T (two fp32 moments)
          autocast full fine-tuning: a bf16 copy of every weight, 2P, kept for the backward
    FSDP  weights  (the same) / N + two gathered bf16 blocks (the one computing, the one prefetched)
          grads    4T / N + one block's unsharded fp32 gradient before its reduce-scatter; with gradient
                   accumulation (set_grad_sync skips the sync) the UNSHARDED 4T while accumulating
          Adam     8T / N
          offload  weights, grads and Adam live in host memory; the GPU keeps the gathered blocks
    KL reference of full fine-tuning: a frozen bf16 copy, 2P (DDP) or 2P / N (FSDP).

Activations are COMPUTED from the same meta-device model: one training forward at the documented setting (512 px,
bf16, the scripts' default all-linear LoRA r 32 or full fine-tuning), with a saved-tensor hook that adds up what
autograd keeps for the backward (parameters excluded, a view counted once with its base). Attention is counted as
flash / memory-efficient SDPA keeps it (q, k, v, the output and a float32 logsumexp per query row; the meta device
would run the math fallback, which saves the L x L probabilities). On real tensors the same hook gives exactly the
same bytes for the tiny SD3 and FLUX (tests/test_memory_model.py). With --gradient-checkpointing a block keeps only
its inputs and one block's activations are rebuilt at a time: what is saved outside the blocks + every block's
inputs + the largest block. Checked against the H200 peaks of docs/results.md (compute table: SD3.5-M attention LoRA
at micro-batch 8 with CFG, 47.9 GiB; FLUX.1-dev at micro-batch 2, 41.6 GiB): `--check` prints both. Under DDP, full
fine-tuning computes under autocast, which keeps a bf16 copy of every fp32 weight for the backward (2P more). The
parameter, gradient and Adam terms are checked against per-rank bytes measured on the tiny models under DDP and FSDP
on 2 ranks (tests/test_parallel.py). Not counted: the text encoders and the VAE (bf16: about 11 GB for SD3.5, 10 GB
for FLUX, docs/results.md), the backward's transient buffers, the CUDA context, the allocator's fragmentation.
"""

from __future__ import annotations

import argparse
import contextlib
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
    "SD3.5-M": (
        "sd3",
        dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        ),
    ),
}
# The documented training step (docs/flowgrpo.md, docs/g2rpo.md): 512 px; SD3 with CFG (2 rows per transition) and
# 77 CLIP + 128 T5 text tokens; FLUX with 512 T5 tokens (our default) and its guidance input (1 row).
SETTING = {
    "FLUX.1-dev": dict(image_tokens=1024, text_tokens=512, rows_per_sample=1),
    "SD3.5-M": dict(image_tokens=1024, text_tokens=205, rows_per_sample=2),
}


def build(kind: str, config: dict, device="meta", dtype=None):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    with torch.device(device):
        model = (FluxTransformer2DModel if kind == "flux" else SD3Transformer2DModel)(**config)
    return model if dtype is None else model.to(dtype)


def lora_count(model, rank: int) -> int:
    """Trained weights of an all-linear LoRA (--lora-target all-linear): r (in + out) per Linear."""
    return sum(
        rank * (m.in_features + m.out_features)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )


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
    return dict(
        P=P,
        T_lora=lora_count(model, lora_rank),
        block_max=max(blk),
        lora_block_max=lora_blk,
        width=width,
        blocks=kinds,
        kind=kind,
    )


def per_gpu(
    m: dict,
    full: bool,
    parallel: str,
    n: int,
    offload: bool = False,
    accumulate: bool = False,
    reference: bool = False,
) -> dict:
    """Bytes per GPU of the weights, gradients and Adam state (see the module docstring), without activations."""
    P, T = m["P"], (m["P"] if full else m["T_lora"])
    weights = 4 * P if full else 2 * P + 4 * T
    ref = 2 * P if full and reference else 0
    if parallel == "ddp":
        return dict(weights=weights + ref + (2 * P if full else 0), grads=8 * T, adam=8 * T)
    gathered = 2 * 2 * m["block_max"] * (2 if reference else 1)
    block_grad = 4 * (m["block_max"] if full else m["lora_block_max"])
    out = dict(
        weights=(weights + ref) / n + gathered,
        grads=4 * T / n + block_grad + (4 * T if accumulate else 0),
        adam=8 * T / n,
    )
    if (
        offload
    ):  # the shards in host memory; the gathered blocks and the block gradient stay on the GPU
        out = dict(weights=gathered, grads=block_grad + (4 * T if accumulate else 0), adam=0.0)
    return out


# ---------------------------------------------------------------------------------------------------- activations
class _FlashAttentionSaves(torch.autograd.Function):
    """Shapes only: what flash / memory-efficient SDPA keeps for its backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        # + logsumexp
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out


@contextlib.contextmanager
def flash_attention_shapes():
    F, orig = torch.nn.functional, torch.nn.functional.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda query, key, value, *a, **kw: _FlashAttentionSaves.apply(
        query, key, value
    )
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


def saved_for_backward(model, inputs: dict) -> dict:
    """Bytes autograd keeps for the backward of one forward of `model` (parameters excluded; a view counts once, with
    its base): total, the largest block's share, and the blocks' inputs (what checkpointing keeps instead)."""
    params, seen, total, per_block, block_inputs = (
        {id(p) for p in model.parameters()},
        set(),
        [0],
        [],
        [0],
    )

    def pack(t):
        while t._base is not None:
            t = t._base
        key = id(t) if t.device.type == "meta" else t.untyped_storage().data_ptr()
        if id(t) not in params and key not in seen:
            seen.add(key)
            kept.append(t)  # alive until the end, so no id or address is reused
            total[0] += t.numel() * t.element_size()
        return t

    def pre(module, args, kwargs):
        per_block.append(-total[0])
        block_inputs[0] += sum(
            a.numel() * a.element_size()
            for a in (*args, *kwargs.values())
            if isinstance(a, torch.Tensor) and a.is_floating_point()
        )

    kept, hooks = [], []
    for b in blocks(model):
        hooks += [
            b.register_forward_pre_hook(pre, with_kwargs=True),
            b.register_forward_hook(
                lambda m, a, o: per_block.__setitem__(-1, per_block[-1] + total[0])
            ),
        ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs, return_dict=False)
    finally:
        for h in hooks:
            h.remove()
    return dict(
        total=total[0],
        block_max=max(per_block),
        blocks=sum(per_block),
        block_inputs=block_inputs[0],
    )


def forward_inputs(
    model,
    kind: str,
    rows: int,
    image_tokens: int,
    text_tokens: int,
    device="meta",
    dtype=torch.bfloat16,
) -> dict:
    """The transformer's inputs for `rows` rows at the given token counts (SD3: a square latent of that many patches)."""
    c, kw = model.config, dict(device=device, dtype=dtype)
    common = dict(
        encoder_hidden_states=torch.randn(rows, text_tokens, c.joint_attention_dim, **kw),
        pooled_projections=torch.randn(rows, c.pooled_projection_dim, **kw),
    )
    if kind == "sd3":
        side = round(image_tokens**0.5) * c.patch_size
        return dict(
            hidden_states=torch.randn(rows, c.in_channels, side, side, **kw),
            timestep=torch.full((rows,), 500.0, device=device),
            **common,
        )
    return dict(
        hidden_states=torch.randn(rows, image_tokens, c.in_channels, **kw),
        **common,
        timestep=torch.full((rows,), 0.5, device=device),
        img_ids=torch.zeros(image_tokens, 3, device=device),
        txt_ids=torch.zeros(text_tokens, 3, device=device),
        guidance=torch.full((rows,), 3.5, device=device) if c.guidance_embeds else None,
    )


def trainable(model, lora_targets, rank: int = 32):
    """The model as the scripts train it (common.training.Trainable): a LoRA with fp32 weights on the frozen model,
    or every weight trained (lora_targets None)."""
    from types import SimpleNamespace

    from common.policy import Trainable

    Trainable(
        SimpleNamespace(transformer=model, dtype=next(model.parameters()).dtype),
        lora_targets is None,
        rank,
        rank,
        lora_targets,
        need_reference=False,
    )
    return model


def activations(
    name: str, micro_batch: int, full: bool, checkpointing: bool, lora_target: str = "all-linear"
) -> float:
    """Bytes saved for the backward by one training micro-batch (CFG: 2 rows per transition), computed on the meta
    device. Full fine-tuning counts a bf16 forward (FSDP's compute dtype; DDP's autocast copies are in per_gpu)."""
    from common.backbones import LORA_TARGETS

    kind, config = CONFIGS[name]
    s = SETTING[name]
    model = trainable(
        build(kind, config, dtype=torch.bfloat16), None if full else LORA_TARGETS[lora_target]
    )
    if full:  # the fp32 masters compute in bf16 (FSDP's param_dtype, DDP's autocast)
        model.to(torch.bfloat16)
    with flash_attention_shapes():
        b = saved_for_backward(
            model,
            forward_inputs(
                model, kind, micro_batch * s["rows_per_sample"], s["image_tokens"], s["text_tokens"]
            ),
        )
    return (
        b["total"] - b["blocks"] + b["block_inputs"] + b["block_max"]
        if checkpointing
        else b["total"]
    )


# Measured H200 peaks (docs/results.md, compute table): (peak bytes, micro-batch), LoRA r 32 on the attention, 512 px.
MEASURED_PEAK = {"SD3.5-M": (47.9 * 2**30, 8), "FLUX.1-dev": (41.6 * 2**30, 2)}


def check() -> str:
    """The model at the H200 runs' settings against their measured peaks (attention LoRA, one GPU, no checkpointing)."""
    from common.backbones import LORA_TARGETS

    lines = []
    for name, (peak, mb) in MEASURED_PEAK.items():
        kind, config = CONFIGS[name]
        model = trainable(build(kind, config, dtype=torch.bfloat16), LORA_TARGETS["attention"])
        T = sum(p.numel() for p in model.parameters() if p.requires_grad)
        P = sum(p.numel() for p in model.parameters()) - T
        # bf16 base, fp32 LoRA, its gradient, Adam (one GPU: no DDP buckets)
        fixed = 2 * P + 4 * T + 4 * T + 8 * T
        act = activations(name, mb, False, False, "attention")
        lines.append(
            f"{name}, attention LoRA ({T / 1e6:.1f} M), micro-batch {mb}: weights + LoRA state "
            f"{fixed / 2**30:.1f} GiB + activations {act / 2**30:.1f} GiB = {(fixed + act) / 2**30:.1f} GiB "
            f"computed, {peak / 2**30:.1f} GiB measured ({(fixed + act) / peak - 1:+.0%})"
        )
    return "\n".join(lines)


def table() -> str:
    rows = [
        "| model | training | parallel | GPUs | weights | grads | Adam | total without activations | "
        "+ activations, micro-batch 1 (with --gradient-checkpointing) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        m = describe(name)
        for full in (True, False):
            act, act_ck = activations(name, 1, full, False), activations(name, 1, full, True)
            for parallel, offload, counts in (
                ("ddp", False, ("any",)),
                ("fsdp", False, (1, 2, 4, 8)),
                ("fsdp", True, (1, 8)),
            ):
                for n in counts:
                    b = per_gpu(m, full, parallel, 1 if n == "any" else n, offload)
                    fixed = sum(b.values())
                    rows.append(
                        f"| {name} | {'full' if full else 'LoRA r 32'} | "
                        f"{parallel}{' + offload' if offload else ''} | {n} | {b['weights'] / GB:.1f} | "
                        f"{b['grads'] / GB:.1f} | {b['adam'] / GB:.1f} | {fixed / GB:.1f} | "
                        f"{(fixed + act) / GB:.1f} ({(fixed + act_ck) / GB:.1f}) |"
                    )
    return "\n".join(rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="only the model against the measured H200 peaks"
    )
    if not ap.parse_args().check:
        for name in CONFIGS:
            m = describe(name)
            acts = {
                (f, c): activations(name, 1, f, c) / GB
                for f in (False, True)
                for c in (False, True)
            }
            print(
                f"{name}: {m['P'] / 1e9:.2f} B weights, LoRA r 32 all-linear {m['T_lora'] / 1e6:.1f} M, largest "
                f"block {m['block_max'] / 1e6:.0f} M, width {m['width']}, blocks {m['blocks']}; activations per "
                f"transition (computed): LoRA {acts[False, False]:.2f} GB ({acts[False, True]:.2f} GB with "
                f"checkpointing), full {acts[True, False]:.2f} GB ({acts[True, True]:.2f} GB)"
            )
        print(table())
    print(check())
