"""Memory model: the peak bytes per GPU of a training run on SD3.5-Medium or FLUX.1-dev, component by component, and
every paper preset's peak against the GPU it names.

    python benchmarks/bench_memory.py                 # docs/results.md: the preset table, then DDP against FSDP
    python benchmarks/bench_memory.py --check         # only the model against the measured H200 peaks
    python benchmarks/bench_memory.py --decode-check  # the decode term against a real CPU decode (about 15 s)

Every model is built on the meta device (shapes, no memory) from its published config: the transformers (FLUX.1-dev:
FluxTransformer2DModel's defaults with guidance_embeds; SD3.5-M: its transformer/config.json), the text encoders
(CLIP-L = openai/clip-vit-large-patch14's text tower, CLIP-G = laion CLIP-ViT-bigG-14's, T5-XXL = google/t5-v1_1-xxl's
encoder: SD3.5-M's text_encoder, _2, _3 and FLUX.1-dev's text_encoder, _2 config.json), the VAE (the 16-channel
AutoencoderKL of both) and the reward models (PickScore_v1 = CLIP ViT-H/14, laion/CLIP-ViT-H-14-laion2B-s32B-b79K's
config; HPSv2 = open_clip's ViT-H-14, counted with the same config: open_clip's ViT-H-14 has the same widths, depths,
patch, context and vocabulary, so the same parameters; clipscore = its default, CLIP ViT-L/14). A run's own model
folder gives its own configs instead (`from_folder`: the GPU job's random-weight folders).

A run's peak per GPU is what stays for the whole run plus the largest transient of one phase (`estimate`):

  resident      text encoders in the run's dtype (fp16: T5's `wo` layers stay fp32, transformers'
                _keep_in_fp32_modules); the VAE in fp32; the reward models in fp32; the transformer and what training
                keeps beside it (`per_gpu`: weights, Adam, fp32 copies of the trained weights for the EMA and for
                DiffusionNFT's old policy and AWM's fast EMA, DDP's gradient buckets)
  + the largest of these phases:
    encode      the text encoders' forward on the most prompts encoded at once (a rank's rollout prompts, or one
                evaluation batch); SD3 keeps every CLIP layer's output (diffusers asks for the hidden states)
    rollout     what the rollout keeps and holds (latents, decoded images: `held_by_rollout`) + the largest of the
                no-grad transformer forward at --rollout-batch-size (CFG: 2 rows; DenseGRPO's completions at
                --completion-batch-size), one VAE decode of --decode-batch-size images, one reward batch
    train       what the rollout keeps + the trained weights' gradients + the activations one micro-batch saves for
                its backward (+ with a KL reference or AWM's fast EMA, one no-grad forward, which runs while they are
                kept; + under DDP full fine-tuning, autocast's bf16 copies of the weights)
    eval        the no-grad forward at --eval-batch-size (CFG: 2 rows), one decode, one reward batch, + the images
    step        the optimizer step: what the rollout keeps + the trained weights' gradients (sharded under FSDP) +
                foreach AdamW's temporaries (`adamw_step_bytes`: torch's _multi_tensor_adam makes one fp32 tensor
                per trained weight, the square root of the second moment, 4 bytes per trained entry, counted by
                running one step on the meta device; the default on CUDA). No activations are alive then.

Per GPU, with P weights in the transformer, T of them trained, N GPUs (`per_gpu`):

    DDP   weights  full: 4P (fp32 masters)            LoRA: 2P (bf16 base) + 4T
          grads    4T (train and step phases), and 4T in DDP's buckets (gradient_as_bucket_view=False; N > 1 only)
          step     4T of foreach AdamW's temporaries (step phase)
          Adam     8T (two fp32 moments); copies 4T each (EMA, old policy)
          autocast full fine-tuning: a bf16 copy of every weight, 2P, kept for the backward (train phase)
    FSDP  weights  (the same) / N + two gathered blocks in their stored dtype (the one computing, the one prefetched:
                   bf16 for full fine-tuning, which gathers in the compute dtype; bf16 base + fp32 LoRA)
          grads    4T / N + one block's unsharded gradient before its reduce-scatter (every micro-batch
                   reduce-scatters: nothing accumulates unsharded); 4T / N in the step phase
          step     4T / N of foreach AdamW's temporaries (each rank steps its shards)
          Adam     8T / N; copies 4T / N each
          offload  weights, grads and Adam live in host memory, and the step runs there; the GPU keeps the
                   gathered blocks
    KL reference of full fine-tuning: a frozen bf16 copy, 2P (DDP) or 2P / N (FSDP).

Training activations are COMPUTED: one training forward of the meta-device model at the run's setting (tokens from
--resolution and --max-sequence-length, rows from the micro-batch and CFG, the LoRA or full fine-tuning), with a
saved-tensor hook that adds up what autograd keeps for the backward (parameters excluded, a view counted once with its
base). Attention is counted as flash / memory-efficient SDPA keeps it (q, k, v, the output and a float32 logsumexp per
query row; the meta device would run the math fallback, which saves the L x L probabilities). On real tensors the same
hook gives exactly the same bytes for the tiny SD3 and FLUX (tests/test_memory_model.py). With
--gradient-checkpointing a block keeps only its inputs and one block's activations are rebuilt at a time: what is
saved outside the blocks + every block's inputs + the largest block.

Transients of no-grad forwards (text encoders, rollout and evaluation forwards, VAE decode, reward) are COMPUTED the
same way: the forward runs on the meta device under `PeakLive`, a dispatch mode that adds up the bytes of every tensor
made inside the forward while it is alive (a weak reference to its storage says when it is freed) and keeps the
largest sum. A transformer (or text encoder, or reward) runs two of its blocks of each kind, which stand for the
rest (`distinct_blocks`: exact, and several times faster). Checked against a real decode on CPU (`--decode-check`, tests/test_memory_model.py): the same count on
real tensors, and the process's peak resident memory. The VAE decode's peak is 3 tensors of 256 channels at the full
resolution in fp32 (the last up-block's first resnet: its input, the group norm's output, the SiLU's output):
3 x 256 x H x W x 4 bytes per image, 0.75 GiB at 512 px, 1.48 GiB at 720 px.

Checked against measured H200 peaks (`--check`: docs/results.md's compute table, 2026-11-29, small text encoders).
Not counted: the backward's transient buffers, the cuDNN / cuBLAS workspaces, the CUDA context (outside PyTorch's
allocator), the allocator's fragmentation: the fit test leaves 10 % of the card for them (`fits`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import weakref
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GB, GiB = 1e9, 2**30

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
MODEL_OF_KIND = {"sd3": "SD3.5-M", "flux": "FLUX.1-dev"}
# The DDP-against-FSDP table's step (docs/results.md): 512 px; SD3 with CFG (2 rows per transition) and 77 CLIP +
# 128 T5 text tokens; FLUX with 512 T5 tokens (our default) and its guidance input (1 row).
SETTING = {
    "FLUX.1-dev": dict(image_tokens=1024, text_tokens=512, rows_per_sample=1),
    "SD3.5-M": dict(image_tokens=1024, text_tokens=205, rows_per_sample=2),
}

# The text encoders' published configs (the fields that set the parameter count and the activations; the rest are
# the classes' defaults). SD3.5-M: text_encoder CLIP-L and text_encoder_2 CLIP-G (CLIPTextModelWithProjection),
# text_encoder_3 T5-XXL's encoder; FLUX.1-dev: text_encoder CLIP-L (CLIPTextModel), text_encoder_2 T5-XXL's encoder.
CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
)
CLIP_G = dict(
    vocab_size=49408,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    max_position_embeddings=77,
    projection_dim=1280,
    hidden_act="gelu",
)
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    use_cache=False,
)
TEXT_ENCODERS = {
    "sd3": (
        ("CLIP-L", "CLIPTextModelWithProjection", CLIP_L),
        ("CLIP-G", "CLIPTextModelWithProjection", CLIP_G),
        ("T5-XXL", "T5EncoderModel", T5_XXL),
    ),
    "flux": (("CLIP-L", "CLIPTextModel", CLIP_L), ("T5-XXL", "T5EncoderModel", T5_XXL)),
}
# The 16-channel AutoencoderKL of SD3.5 and FLUX.1 (their vae/config.json; common/plumbing/tiny.py's tiny_vae builds it).
VAE = dict(
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    norm_groups=32,
    mid_attention=True,
)
# The reward models (CLIPModel configs): PickScore_v1 (and, assumed the same architecture, HPSv2's open_clip
# ViT-H-14) = laion/CLIP-ViT-H-14-laion2B-s32B-b79K; clipscore's default openai/clip-vit-large-patch14.
CLIP_H = dict(
    text_config=dict(
        vocab_size=49408,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        max_position_embeddings=77,
        hidden_act="gelu",
    ),
    vision_config=dict(
        hidden_size=1280,
        intermediate_size=5120,
        num_hidden_layers=32,
        num_attention_heads=16,
        patch_size=14,
        image_size=224,
        hidden_act="gelu",
    ),
    projection_dim=1024,
)
CLIP_L_FULL = dict(
    text_config=CLIP_L,
    vision_config=dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        patch_size=14,
        image_size=224,
        hidden_act="quick_gelu",
    ),
    projection_dim=768,
)
REWARD_MODELS = {"pickscore": CLIP_H, "hpsv2": CLIP_H, "clipscore": CLIP_L_FULL}
NO_WEIGHTS = ("toyworld", "toyworld_coverage", "jpeg_compressibility", "jpeg_incompressibility")
REWARD_BATCH = 32  # common/rewards.py build_reward: images per reward call
# GPU memory as PyTorch can allocate it (torch.cuda.mem_get_info's total): an "80 GB" H100 has 81,559 MiB, a
# "141 GB" H200 143,771 MiB (nvidia-smi).
GPUS = {"80 GB": 81559 * 2**20, "141 GB": 143771 * 2**20}
HEADROOM = (
    0.10  # left free by the fit test: cuDNN/cuBLAS workspaces, the CUDA context, fragmentation
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------------ the transformer
def build(kind: str, config: dict, device="meta", dtype=None):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    with torch.device(device):
        model = (FluxTransformer2DModel if kind == "flux" else SD3Transformer2DModel).from_config(
            config
        )
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
    reference: bool = False,
    copies: int = 0,
) -> dict:
    """Bytes per GPU of the weights, gradients, Adam state and `copies` fp32 copies of the trained weights (the EMA,
    DiffusionNFT's old policy), without activations (the module docstring). `grads` and `autocast` exist only
    during the training phase, `step` (the gradients and foreach AdamW's temporaries) during the optimizer step;
    `buckets` (DDP) for the whole run. m: describe()'s dict, with T the trained count."""
    P, T = m["P"], (m["P"] if full else m["T"])
    weights = 4 * P if full else 2 * P + 4 * T
    ref = 2 * P if full and reference else 0
    if parallel == "ddp":
        return dict(
            weights=weights + ref,
            grads=4 * T,
            buckets=4 * T if n > 1 else 0,
            adam=8 * T,
            copies=4 * T * copies,
            autocast=2 * P if full else 0,
            step=4 * T + adamw_step_bytes(T),
        )
    # the gathered blocks: full fine-tuning gathers in the bf16 compute dtype; a LoRA block holds its bf16 base and
    # its fp32 LoRA
    block = 2 * m["block_max"] if full else 2 * m["block_max"] + 4 * m["lora_block_max"]
    gathered = 2 * block * (2 if reference else 1)
    block_grad = 4 * (m["block_max"] if full else m["lora_block_max"])
    out = dict(
        weights=(weights + ref) / n + gathered,
        grads=4 * T / n + block_grad,
        buckets=0,
        adam=8 * T / n,
        copies=4 * T * copies / n,
        autocast=0,
        step=4 * T / n + adamw_step_bytes(T) / n,
    )
    if (
        offload
    ):  # the shards in host memory; the gathered blocks and the block gradient stay on the GPU
        out.update(weights=gathered, grads=block_grad, adam=0, copies=0, step=0)
    return out


@functools.lru_cache(maxsize=None)
def adamw_step_bytes(trained: int) -> int:
    """Bytes torch.optim.AdamW (foreach, the default on CUDA) allocates inside one step for `trained` fp32 entries,
    beyond its state: one step on the meta device under PeakLive, after a first step that made the state (exp_avg and
    exp_avg_sq, the resident 8T). tests/test_memory_model.py checks it on real CPU tensors."""
    if trained <= 0:
        return 0
    weight = torch.nn.Parameter(torch.empty(trained, device="meta"))
    weight.grad = torch.empty_like(weight)
    optimizer = torch.optim.AdamW([weight], lr=1e-4, weight_decay=1e-4, foreach=True)
    optimizer.step()  # the state
    with PeakLive() as p:
        optimizer.step()
    return p.peak


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
    its base): total, the largest block's share, and the blocks' inputs (what checkpointing keeps instead); and the
    last two per block, in the order the blocks ran."""
    params, seen, total, per_block, block_inputs = (
        {id(p) for p in model.parameters()},
        set(),
        [0],
        [],
        [],
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
        block_inputs.append(
            sum(
                a.numel() * a.element_size()
                for a in (*args, *kwargs.values())
                if isinstance(a, torch.Tensor) and a.is_floating_point()
            )
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
        block_inputs=sum(block_inputs),
        per_block=per_block,
        per_block_inputs=block_inputs,
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
    """The model as the scripts train it (common.policy.Trainable): a LoRA with fp32 weights on the frozen model,
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
    """Bytes saved for the backward by one training micro-batch of the DDP-against-FSDP table's step (SETTING),
    computed on the meta device."""
    kind, config = CONFIGS[name]
    s = SETTING[name]
    model = meta_policy(_freeze(config), kind, "bf16", None if full else lora_target, 32)
    return training_activations(
        model,
        kind,
        micro_batch * s["rows_per_sample"],
        s["image_tokens"],
        s["text_tokens"],
        checkpointing,
        torch.bfloat16,
    )


@contextlib.contextmanager
def distinct_blocks(model):
    """Inside the block, `model` runs only two blocks of each kind (the same class and parameter shapes: SD3.5's
    dual-attention blocks, its plain ones, its last one; FLUX's double and single blocks) and the rest are left
    out; yields how many blocks each kept one stands for, in the order they run (the second of a kind stands for
    itself and every left-out one). A forward of the blocks kept costs a few blocks' time and gives what the whole
    forward gives (`extrapolate`, and the same peak of a no-grad forward: only the hidden states pass between
    blocks, and equal blocks make equal transients), checked against the whole model in tests/test_memory_model.py.
    """
    names = set(model._no_split_modules)
    lists = [
        (parent, attr, module)
        for parent in model.modules()
        for attr, module in parent.named_children()
        if isinstance(module, torch.nn.ModuleList)
        and module
        and all(type(b).__name__ in names for b in module)
    ]
    counts = []
    for parent, attr, module in lists:
        kept, count, seen = [], [], {}
        for b in module:
            sig = (type(b).__name__, tuple((n, tuple(p.shape)) for n, p in b.named_parameters()))
            if seen.get(sig, 0) < 2:
                kept.append(b)
                count.append(1)
                seen[sig] = seen.get(sig, 0) + 1
                index = len(kept) - 1
                seen[sig, "last"] = index
            else:
                count[seen[sig, "last"]] += 1
        setattr(parent, attr, torch.nn.ModuleList(kept))
        counts += count
    try:
        yield counts
    finally:
        for parent, attr, module in lists:
            setattr(parent, attr, module)


def extrapolate(saved: dict, counts: list[int]) -> dict:
    """saved_for_backward's counts of a forward with distinct_blocks, for the whole model: each kept block's share
    (and inputs) times the blocks it stands for."""
    per_block = [b * c for b, c in zip(saved["per_block"], counts)]
    inputs = [b * c for b, c in zip(saved["per_block_inputs"], counts)]
    return dict(
        saved,
        total=saved["total"] - saved["blocks"] + sum(per_block),
        blocks=sum(per_block),
        block_inputs=sum(inputs),
    )


def training_activations(
    model, kind, rows, image_tokens, text_tokens, checkpointing, dtype
) -> float:
    """Bytes one training forward of `rows` rows keeps for its backward (with checkpointing: outside the blocks +
    the blocks' inputs + the largest block)."""
    with flash_attention_shapes(), distinct_blocks(model) as counts:
        b = extrapolate(
            saved_for_backward(
                model, forward_inputs(model, kind, rows, image_tokens, text_tokens, dtype=dtype)
            ),
            counts,
        )
    if checkpointing:
        return b["total"] - b["blocks"] + b["block_inputs"] + b["block_max"]
    return b["total"]


# ------------------------------------------------------------------------------------- transients of no-grad calls
class PeakLive:
    """`with PeakLive() as p: f()`: p.peak is the largest sum of the bytes of the tensors made inside the block that
    were alive at the same time (a dispatch mode sees every tensor an op makes; a weak reference to its storage says
    when it is freed). Tensors made before the block (weights, inputs) are not counted, and a view is its base."""

    def __init__(self):
        self.live, self.peak, self.refs = 0, 0, {}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {
                    id(t.untyped_storage())
                    for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)
                }
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        tracker.add(t.untyped_storage(), inputs)
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def add(self, storage, inputs: set) -> None:
        key = id(storage)
        if key in inputs or (key in self.refs and self.refs[key]() is storage):
            return  # a view of an input, an in-place op, or a storage already counted
        n = storage.nbytes()

        def free(_, key=key, n=n):
            self.refs.pop(key, None)
            self.live -= n

        self.refs[key] = weakref.ref(storage, free)
        self.live += n
        self.peak = max(self.peak, self.live)

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def transient_peak(fn) -> int:
    """Peak bytes of the tensors `fn()` makes (PeakLive), its result included while alive."""
    with torch.no_grad(), PeakLive() as p:
        fn()
    return p.peak


def _freeze(d) -> str:
    """A config as a hashable value (for the caches below): its JSON."""
    return json.dumps(d, sort_keys=True, default=list)


def _thaw(t: str):
    return json.loads(t)


@dataclass(frozen=True)
class ModelSpec:
    """What a model folder holds, as configs: the backbone kind, the transformer's config, the text encoders
    ((name, transformers class, config), ...) and the VAE's AutoencoderKL config (each as JSON: hashable)."""

    kind: str
    transformer: str
    text_encoders: str
    vae: str


def published(kind: str) -> ModelSpec:
    """SD3.5-Medium ("sd3") or FLUX.1-dev ("flux") as published."""
    from common.plumbing.tiny import tiny_vae

    with torch.device("meta"):
        vae = dict(tiny_vae(**VAE).config)
    return ModelSpec(
        kind,
        _freeze(CONFIGS[MODEL_OF_KIND[kind]][1]),
        _freeze([(n, c, cfg) for n, c, cfg in TEXT_ENCODERS[kind]]),
        _freeze(vae),
    )


def from_folder(path: str) -> ModelSpec:
    """A diffusers SD3/FLUX folder's own configs (e.g. the GPU job's random-weight folders)."""
    from common.backbones import PIPELINES

    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)

    def config(component):
        with open(os.path.join(path, component, "config.json")) as f:
            return json.load(f)

    encoders = [
        (name, index[name][1], config(name))
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
        if (index.get(name) or [None])[0] is not None
    ]
    return ModelSpec(
        PIPELINES[index["_class_name"]],
        _freeze(config("transformer")),
        _freeze(encoders),
        _freeze(config("vae")),
    )


def _meta_model(library: str, cls_name: str, config: dict):
    """A transformers or diffusers model built from a config on the meta device."""
    import diffusers
    import transformers

    with torch.device("meta"):
        if library == "transformers":
            cls = getattr(transformers, cls_name)
            cfg_cls = cls.config_class
            model = cls(cfg_cls(**{k: v for k, v in config.items() if not k.startswith("_")}))
        else:
            model = getattr(diffusers, cls_name).from_config(config)
    return model.eval()  # as from_pretrained gives it: no dropout


def weight_bytes(model, dtype: torch.dtype) -> int:
    """Bytes of `model`'s weights loaded in `dtype` (fp32 stays fp32), with transformers' _keep_in_fp32_modules in
    fp32 under fp16, as from_pretrained loads them (T5's `wo`)."""
    keep = (
        tuple(getattr(model, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else ()
    )
    total = 0
    for name, p in model.named_parameters():
        fp32 = any(f".{k}." in f".{name}" for k in keep)
        total += p.numel() * (4 if fp32 else torch.empty((), dtype=dtype).element_size())
    return total


def _text_tokens(kind: str, msl: int) -> int:
    return (
        77 + msl if kind == "sd3" else msl
    )  # SD3: the CLIP states and the T5 states, concatenated


@functools.lru_cache(maxsize=None)
def text_encoders(spec: ModelSpec, precision: str, prompts: int, msl: int) -> tuple[int, int]:
    """(weights, the encode transient) of the folder's text encoders: `prompts` prompts encoded at once with `msl` T5
    tokens, as diffusers' encode_prompt calls them (SD3: the CLIPs with every layer's hidden state returned)."""
    dtype = DTYPES[precision]
    models = [
        _meta_model("transformers", cls_name, config).to(dtype)
        for _, cls_name, config in _thaw(spec.text_encoders)
    ]
    weights = sum(weight_bytes(m, dtype) for m in models)
    outputs, left_out = [], 0  # outputs kept: encode_prompt uses each after the next encoder ran
    with contextlib.ExitStack() as stack:
        for model in models:
            counts = stack.enter_context(distinct_blocks(model))
            if spec.kind == "sd3" and type(model).__name__.startswith("CLIP"):
                # every layer's hidden state is returned and kept: the layers left out would have added theirs
                # (an upper bound: exact when the peak comes after the CLIPs' last layers)
                c = model.config
                states = prompts * min(77, c.max_position_embeddings) * c.hidden_size
                left_out += (sum(counts) - len(counts)) * states * dtype.itemsize
        with PeakLive() as p, torch.no_grad():
            for model in models:
                clip = type(model).__name__.startswith("CLIP")
                length = min(77, model.config.max_position_embeddings) if clip else msl
                ids = torch.zeros(prompts, length, dtype=torch.long, device="meta")
                hidden = dict(output_hidden_states=spec.kind == "sd3") if clip else {}
                outputs.append(model(ids, **hidden))
    return weights, p.peak + left_out


@functools.lru_cache(maxsize=None)
def vae(spec: ModelSpec, images: int, resolution: int) -> tuple[int, int]:
    """(fp32 weights, the transient of one decode of `images` images) of the folder's VAE, as Backbone.decode calls
    it (attention as flash / memory-efficient SDPA keeps it: PyTorch's fp32 kernels on CUDA keep no L x L matrix)."""
    model = _meta_model("diffusers", "AutoencoderKL", _thaw(spec.vae))
    c = model.config
    z = torch.zeros(images, c.latent_channels, resolution // 8, resolution // 8, device="meta")

    def decode():
        x = model.decode(z / c.scaling_factor + (c.shift_factor or 0), return_dict=False)[0]
        return (x.float() / 2 + 0.5).clamp(0, 1)

    with flash_attention_shapes():
        return weight_bytes(model, torch.float32), transient_peak(decode)


@functools.lru_cache(maxsize=None)
def reward(name: str, batch: int = REWARD_BATCH, config: str | None = None) -> tuple[int, int]:
    """(fp32 weights, the transient of one scoring call of `batch` images) of a reward model; rewards without
    weights (toyworld, JPEG) are 0. config: a CLIPModel config (JSON) instead of the published one (a run's own
    reward folder)."""
    if name in NO_WEIGHTS or name.startswith(
        "remote:"
    ):  # a served reward's weights are on its server
        return 0, 0
    if name not in REWARD_MODELS:
        raise ValueError(
            f"reward '{name}': the memory model knows {', '.join(REWARD_MODELS)} and {', '.join(NO_WEIGHTS)}"
        )
    config = REWARD_MODELS[name] if config is None else _thaw(config)
    model = _meta_model("transformers", "CLIPModel", config)
    size = model.config.vision_config.image_size

    def score():
        pixels = torch.zeros(batch, 3, size, size, device="meta")
        ids = torch.zeros(batch, 77, dtype=torch.long, device="meta")
        return model.get_image_features(pixel_values=pixels), model.get_text_features(ids)

    weights = weight_bytes(model, torch.float32)
    with flash_attention_shapes(), distinct_blocks(model):
        return weights, transient_peak(score)


@functools.lru_cache(maxsize=4)
def meta_policy(transformer: str, kind: str, precision: str, lora_target, rank: int):
    """The transformer as the scripts train it, on the meta device: the base in the compute dtype with an fp32 LoRA
    (lora_target a LORA_TARGETS key), or (None) every weight trained, computing in the compute dtype."""
    from common.backbones import LORA_TARGETS

    dtype = DTYPES[precision]
    model = build(kind, _thaw(transformer), dtype=dtype)
    trainable(model, None if lora_target is None else LORA_TARGETS[lora_target], rank)
    if (
        lora_target is None
    ):  # the fp32 masters compute in bf16/fp16 (FSDP's param_dtype, DDP's autocast)
        model.to(dtype)
    return model


def _stats(model, full: bool) -> dict:
    """describe()'s numbers for a built policy: P weights, T trained, the largest block, its LoRA weights."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    blk = blocks(model)
    return dict(
        P=sum(p.numel() for p in model.parameters() if full or id(p) not in trained),
        T=sum(p.numel() for p in model.parameters() if id(p) in trained),
        block_max=max(
            sum(p.numel() for p in b.parameters() if full or id(p) not in trained) for b in blk
        ),
        lora_block_max=max(sum(p.numel() for p in b.parameters() if id(p) in trained) for b in blk),
    )


@functools.lru_cache(maxsize=None)
def transformer_terms(
    spec: ModelSpec,
    precision: str,
    lora_target,
    rank: int,
    train_rows: int,
    forward_rows: tuple,
    tokens: tuple,
    checkpointing: bool,
) -> dict:
    """The policy's numbers (P, T, blocks), the activations a training micro-batch of `train_rows` rows saves, and
    the transient of a no-grad forward at each of `forward_rows` (rows -> bytes)."""
    kind = spec.kind
    model = meta_policy(spec.transformer, kind, precision, lora_target, rank)
    dtype = DTYPES[precision]
    image_tokens, text_tokens = tokens
    out = _stats(model, lora_target is None)
    out["activations"] = training_activations(
        model, kind, train_rows, image_tokens, text_tokens, checkpointing, dtype
    )
    out["forward"] = {}
    with flash_attention_shapes(), distinct_blocks(model):
        for rows in forward_rows:
            inputs = forward_inputs(model, kind, rows, image_tokens, text_tokens, dtype=dtype)
            out["forward"][rows] = transient_peak(
                lambda inputs=inputs: model(**inputs, return_dict=False)
            )
    return out


# ------------------------------------------------------------------------------------------------ a run's settings
@dataclass(frozen=True)
class Setting:
    """What a run's memory depends on, read from its script's parsed Args (`setting`)."""

    script: str
    precision: str  # the compute dtype on CUDA: bf16 / fp16 (auto: bf16)
    resolution: int
    msl: int  # T5 tokens
    full: bool
    lora_target: str | None
    rank: int
    checkpointing: bool
    parallel: str
    world_size: int
    offload: bool
    cfg: int  # rows per sample in rollout and training (SD3 with guidance > 1: 2)
    eval_cfg: int
    train_rows: int  # rows of one training forward
    rollout_rows: tuple  # rows of the rollout's no-grad forwards (DenseGRPO: its completions too)
    eval_rows: int
    decode_batch: int
    prompts_at_once: int  # the most prompts one encode call sees
    reference: bool  # a KL reference forward in training
    anchor: bool  # AWM's no-grad forward of its fast EMA in training (beside or instead of the reference's)
    copies: int  # fp32 copies of the trained weights: the EMA, DiffusionNFT's old policy, AWM's fast EMA
    rewards: tuple
    kept: int  # bytes the rollout keeps until training (held_by_rollout)
    rollout_held: int  # bytes it holds besides them at its fullest


def held_by_rollout(script: str, args, latent: int, image: int) -> tuple[int, int]:
    """(bytes a rank's rollout keeps until its training, bytes it holds besides them at its fullest), with fp32
    latents of `latent` bytes and images of `image` bytes, read off each script's rollout:
    - flowgrpo_baseline.py: keeps the latents, next latents and means of every trained step; holds them twice while
      they are concatenated, and the decoded images, in a list and concatenated for the reward.
    - densegrpo.py: keeps every latent of the trajectories and the means (the transitions are views of them); holds
      the velocities, the ODE completions' clean latents (and their concatenation) and every decoded image (each
      trained step's completion and the SDE image), in a list and concatenated for the reward.
    - g2rpo.py: keeps the branch states and next latents; holds each branch's final latent (images are decoded and
      scored one rollout batch at a time).
    - diffusionnft.py, awm.py: keep x0 of every image; hold the decoded images, in a list and concatenated."""
    n = args.images_per_rank
    if script == "flowgrpo_baseline.py":
        kept = 3 * args.trained_steps * n * latent
        return kept, kept + 2 * n * image
    if script == "densegrpo.py":
        T = args.num_steps
        return (2 * T + 1) * n * latent, T * n * latent + 2 * (T + 1) * n * (latent + image)
    if script == "g2rpo.py":
        return 2 * n * latent, n * latent
    if script in ("diffusionnft.py", "awm.py"):
        return n * latent, 2 * n * image
    raise ValueError(f"{script}: no rollout accounting in the memory model")


def setting(
    script: str, args, world_size: int, kind: str, eval_images: int | None = None
) -> Setting:
    """The memory-relevant settings of a parsed run (benchmarks/presets.py parse_args) on a `kind` backbone: the
    flags, the batch arithmetic its check_args derived, and the script's own structure (which phases keep what).
    eval_images: the images one rank evaluates (default: at least a whole --eval-batch-size)."""
    from common.plumbing.reward_flags import parse_reward_spec

    precision = {"auto": "bf16"}.get(args.mixed_precision, args.mixed_precision)
    msl = args.max_sequence_length or (128 if kind == "sd3" else 512)
    eval_guidance = (
        args.guidance_scale if args.eval_guidance_scale is None else args.eval_guidance_scale
    )
    cfg = 2 if kind == "sd3" and args.guidance_scale > 1 else 1
    eval_cfg = 2 if kind == "sd3" and eval_guidance > 1 else 1
    rollout_rows = [args.rollout_batch_size * cfg]
    if script == "densegrpo.py":
        rollout_rows.append(args.completion_batch_size * cfg)
    prompts = args.prompts_per_rank if script == "g2rpo.py" else args.images_per_rank
    eval_batch = min(args.eval_batch_size, eval_images or args.eval_batch_size)
    side = args.resolution // 8
    latent, image = 16 * side * side * 4, 3 * args.resolution**2 * 4
    kept, rollout_held = held_by_rollout(script, args, latent, image)
    rewards = [n for n, _ in parse_reward_spec(args.reward)]
    if args.guard_rewards:
        rewards += [n for n, _ in parse_reward_spec(args.guard_rewards)]
    return Setting(
        script=script,
        precision=precision,
        resolution=args.resolution,
        msl=msl,
        full=args.full_finetune,
        lora_target=None if args.full_finetune else args.lora_target,
        rank=args.lora_rank,
        checkpointing=args.gradient_checkpointing,
        parallel=args.parallel,
        world_size=world_size,
        offload=args.fsdp_offload,
        cfg=cfg,
        eval_cfg=eval_cfg,
        # AWM's --train-batch-size counts images, each trained at --train-timesteps rows in one forward
        train_rows=args.train_batch_size
        * cfg
        * (args.train_timesteps if script == "awm.py" else 1),
        rollout_rows=tuple(rollout_rows),
        eval_rows=eval_batch * eval_cfg,
        decode_batch=args.decode_batch_size,
        prompts_at_once=max(prompts, eval_batch),
        reference=args.wants_reference(),
        anchor=script == "awm.py" and args.ema_kl_weight > 0,
        # the EMA; DiffusionNFT's old policy, AWM's fast EMA
        copies=int(args.ema_decay > 0) + int(script in ("diffusionnft.py", "awm.py")),
        rewards=tuple(dict.fromkeys(rewards)),
        kept=kept,
        rollout_held=rollout_held,
    )


def estimate(
    spec: ModelSpec, s: Setting, vae_dtype_bytes: int = 4, reward_configs: dict | None = None
) -> dict:
    """The peak bytes per GPU of a run (the module docstring), by component: resident terms, each phase's
    transient, and `peak` = the resident sum + the largest phase (`phase` names it). reward_configs: {name: its
    CLIPModel config} of a run's own reward folders."""
    tokens = ((s.resolution // 16) ** 2, _text_tokens(spec.kind, s.msl))
    t = transformer_terms(
        spec,
        s.precision,
        s.lora_target,
        s.rank,
        s.train_rows,
        tuple(sorted({*s.rollout_rows, s.eval_rows, s.train_rows})),
        tokens,
        s.checkpointing,
    )
    g = per_gpu(t, s.full, s.parallel, s.world_size, s.offload, s.reference and s.full, s.copies)
    te_weights, encode = text_encoders(spec, s.precision, s.prompts_at_once, s.msl)
    vae_weights, decode = vae(spec, s.decode_batch, s.resolution)
    vae_weights = vae_weights * vae_dtype_bytes // 4
    decode = decode * vae_dtype_bytes // 4
    own = {n: _freeze(c) for n, c in (reward_configs or {}).items()}
    scored = [reward(n, REWARD_BATCH, own.get(n)) for n in s.rewards]
    reward_weights = sum(w for w, _ in scored)
    scoring = max((x for _, x in scored), default=0)
    image = 3 * s.resolution**2 * 4
    resident = dict(
        text_encoders=te_weights,
        vae=vae_weights,
        reward=reward_weights,
        transformer=g["weights"],
        optimizer=g["adam"] + g["copies"] + g["buckets"],
    )
    rollout_forward = max(t["forward"][r] for r in s.rollout_rows)
    phases = dict(
        encode=encode,
        rollout=s.kept + s.rollout_held + max(rollout_forward, decode, scoring),
        train=s.kept
        + g["grads"]
        + g["autocast"]
        + t["activations"]
        + (t["forward"][s.train_rows] if s.reference or s.anchor else 0),
        eval=max(t["forward"][s.eval_rows], decode, scoring) + s.eval_rows // s.eval_cfg * image,
        step=s.kept + g["step"],
    )
    phase = max(phases, key=phases.get)
    return dict(
        resident=resident,
        phases=phases,
        phase=phase,
        peak=sum(resident.values()) + phases[phase],
        P=t["P"],
        T=t["T"],
        activations=t["activations"],
        decode=decode,
    )


def fits(peak: float, gpu: str) -> bool:
    """The fit test's rule: the estimated peak leaves at least HEADROOM of the card free."""
    return peak <= (1 - HEADROOM) * GPUS[gpu]


# ------------------------------------------------------------------------------------------------ the paper presets
# The GPU each preset names in its docs ("## Paper preset"): G²RPO's paper trained on 16 H200s (docs/g2rpo.md,
# reference/g2rpo.md §3.3); the others name none, so an 80 GB card (the A100 / H100 / H800 class).
PRESET_GPU = {"g2rpo.py": "141 GB"}
TITLES = {
    "flowgrpo_baseline.py": "Flow-GRPO",
    "g2rpo.py": "G²RPO",
    "densegrpo.py": "DenseGRPO",
    "diffusionnft.py": "DiffusionNFT",
    "awm.py": "AWM",
}


def preset_kind(args) -> str:
    """The backbone of a preset from its --model-path (the docs name the published folders)."""
    return "flux" if "flux" in args.model_path.lower() else "sd3"


def preset_estimates() -> list[dict]:
    """Every paper preset (benchmarks/presets.py): its setting, its estimate on the published models, the GPU it
    names and whether it fits there."""
    from benchmarks.presets import presets

    rows = []
    for _, script, args, world_size in presets():
        kind = preset_kind(args)
        s = setting(script, args, world_size, kind)
        e = estimate(published(kind), s)
        gpu = PRESET_GPU.get(script, "80 GB")
        name = f"{TITLES[script]}, {MODEL_OF_KIND[kind]}"
        rows.append(dict(name=name, script=script, kind=kind, setting=s, gpu=gpu, **e))
    return rows


COMPONENTS = ("text_encoders", "vae", "reward", "transformer", "optimizer")


def preset_table(rows: list[dict], short: bool = False) -> str:
    """The preset table of docs/results.md (short: docs/usage.md's), GiB per GPU: the components, the largest phase,
    the peak, and the share of each card it leaves free (the GPU the preset names in bold)."""
    cards = " | ".join(f"{g} ({GPUS[g] / GiB:.1f} GiB)" for g in GPUS)
    parts = (
        ""
        if short
        else "text encoders | VAE | reward | transformer | Adam, copies, buckets | largest phase | "
    )
    out = [
        f"| preset | setting | GPUs | {parts}estimated peak | {cards} |",
        "|---|---|---|" + "---|" * (len(GPUS) + 1 + (0 if short else 6)),
    ]
    for r in rows:
        s = r["setting"]
        train = "full" if s.full else f"LoRA r {s.rank} {s.lora_target}"
        what = (
            f"{s.resolution} px {s.precision}, {train}"
            f"{', ckpt' if s.checkpointing else ''}, micro-batch {s.train_rows // s.cfg}"
        )
        free = []
        for g in GPUS:
            cell = f"{'fits' if fits(r['peak'], g) else 'does not fit'}, {1 - r['peak'] / GPUS[g]:.0%} free"
            free.append(f"**{cell}**" if g == r["gpu"] else cell)
        comp = (
            ""
            if short
            else (
                " | ".join(f"{r['resident'][c] / GiB:.1f}" for c in COMPONENTS)
                + f" | {r['phase']} {r['phases'][r['phase']] / GiB:.1f} | "
            )
        )
        out.append(
            f"| {r['name']} | {what} | {s.world_size}, {s.parallel} | {comp}{r['peak'] / GiB:.1f} | "
            + " | ".join(free)
            + " |"
        )
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- the measured H200 runs
# docs/results.md's compute table (2026-11-29, H200, torch 2.11): the runs of benchmarks/bench_gpu_throughput.py
# (retired 2026-12-05 for gpu_first_run.py; `git show a217521:benchmarks/bench_gpu_throughput.py`), one
# process, peak of torch.cuda.max_memory_allocated. Its folders had the real transformer and VAE and
# small text encoders of the real widths (CLIP: 2 layers, 4 heads; T5: 1 layer, 4 heads, d_kv 8, d_ff 128; tiny
# vocabularies), a bf16 VAE (the fp32 VAE came later), the JPEG reward (no model), one evaluation image.
MEASURED = {
    "SD3.5-M flowgrpo": (
        "flowgrpo_baseline.py",
        "sd3",
        47.9,
        "--resolution 512 --reward jpeg_compressibility --num-steps 10 --lora-target attention --lora-rank 32 "
        "--lora-alpha 64 --guidance-scale 4.5 --max-sequence-length 256 --timestep-fraction 0.99 --group-size 8 "
        "--groups-per-iteration 2 --rollout-batch-size 8 --beta 0.04",
    ),
    "FLUX.1-dev flowgrpo": (
        "flowgrpo_baseline.py",
        "flux",
        41.6,
        "--resolution 512 --reward jpeg_compressibility --num-steps 10 --lora-target attention --lora-rank 32 "
        "--lora-alpha 64 --guidance-scale 3.5 --max-sequence-length 512 --timestep-fraction 0.99 --group-size 4 "
        "--groups-per-iteration 1 --rollout-batch-size 4 --train-batch-size 2",
    ),
}


@functools.lru_cache(maxsize=None)
def measured_spec(kind: str) -> ModelSpec:
    """The 2026-11-29 folders: the published transformer and VAE, the small text encoders of common/plumbing/tiny.py's
    builders at the real widths (the sizes the retired bench_gpu_throughput.py passed)."""
    from common.plumbing.tiny import (
        clip_text_config,
        make_clip_tokenizer,
        make_t5_tokenizer,
        t5_config,
    )

    clip_dim = 1024 if kind == "sd3" else 768
    clip = clip_text_config(len(make_clip_tokenizer(model_max_length=77)), clip_dim, 2, max_len=77)
    t5 = t5_config(len(make_t5_tokenizer()), 4096)
    clips = [("CLIP", "CLIPTextModelWithProjection" if kind == "sd3" else "CLIPTextModel", clip)]
    encoders = clips * (2 if kind == "sd3" else 1) + [("T5", "T5EncoderModel", t5)]
    p = published(kind)
    return ModelSpec(
        kind, p.transformer, _freeze([(n, c, cfg.to_dict()) for n, c, cfg in encoders]), p.vae
    )


def check() -> list[dict]:
    """The model at the measured runs' settings against their peaks."""
    from benchmarks.presets import parse_args

    out = []
    for name, (script, kind, peak, flags) in MEASURED.items():
        args = parse_args(script, flags.split(), 1)
        s = setting(script, args, 1, kind, eval_images=1)
        e = estimate(measured_spec(kind), s, vae_dtype_bytes=2)
        out.append(dict(name=name, measured=peak * GiB, **e))
    return out


def check_lines(rows: list[dict]) -> str:
    return "\n".join(
        f"{r['name']}: resident {sum(r['resident'].values()) / GiB:.1f} GiB + {r['phase']} "
        f"{r['phases'][r['phase']] / GiB:.1f} GiB (activations {r['activations'] / GiB:.1f}) = "
        f"{r['peak'] / GiB:.1f} GiB computed, {r['measured'] / GiB:.1f} GiB measured "
        f"({r['peak'] / r['measured'] - 1:+.0%})"
        for r in rows
    )


# ------------------------------------------------------------------------------- the decode term, measured on CPU
DECODE_PROBE = r"""
import json, sys, torch
sys.path.insert(0, {root!r})
from benchmarks.bench_memory import PeakLive
from common.plumbing.tiny import tiny_vae
torch.manual_seed(0)
vae = tiny_vae(**{vae!r}).eval()
z = torch.randn({images}, 16, {side}, {side})
def status(key):
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])
with torch.no_grad():
    if {warm}:
        vae.decode(z)  # a warm-up decode: the kernels' one-time buffers are not the decode's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident memory, to the current
    before = status("VmRSS")
    with PeakLive() as p:
        vae.decode(z)
    print(json.dumps(dict(rss=status("VmHWM") - before, counted=p.peak)))
"""


def decode_measured(resolution: int, images: int, warm: bool = True) -> dict:
    """A real fp32 decode on CPU in a fresh process: the bytes PeakLive counts on real tensors, and the peak
    resident memory it adds (Linux's VmHWM, reset before the decode; glibc's mmap threshold fixed at 64 KiB, so a
    freed tensor goes back to the system at once and the peak is the allocations' own)."""
    import subprocess

    code = DECODE_PROBE.format(root=ROOT, vae=VAE, images=images, side=resolution // 8, warm=warm)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_check(resolution: int = 128, images: int = 2, warm: bool = True) -> dict:
    """The decode term three ways, in bytes: the model's (meta device), the closed form 3 x 256 x H x W x 4 per image,
    and a real CPU decode's counted and resident peaks (decode_measured)."""
    _, meta = vae(published("sd3"), images, resolution)
    real = decode_measured(resolution, images, warm)
    formula = 3 * 256 * resolution**2 * 4 * images
    return dict(meta=meta, formula=formula, cpu_counted=real["counted"], rss=real["rss"])


# ------------------------------------------------------------------------------------- DDP against FSDP (one step)
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
                ("ddp", False, ("2+",)),
                ("fsdp", False, (1, 2, 4, 8)),
                ("fsdp", True, (1, 8)),
            ):
                for n in counts:
                    b = per_gpu(
                        dict(m, T=m["T_lora"]), full, parallel, 2 if n == "2+" else n, offload
                    )
                    weights = b["weights"] + b["autocast"]
                    grads = b["grads"] + b["buckets"]
                    fixed = weights + grads + b["adam"]
                    rows.append(
                        f"| {name} | {'full' if full else 'LoRA r 32'} | "
                        f"{parallel}{' + offload' if offload else ''} | {n} | {weights / GB:.1f} | "
                        f"{grads / GB:.1f} | {b['adam'] / GB:.1f} | {fixed / GB:.1f} | "
                        f"{(fixed + act) / GB:.1f} ({(fixed + act_ck) / GB:.1f}) |"
                    )
    return "\n".join(rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="only the model against the measured H200 peaks"
    )
    ap.add_argument(
        "--decode-check", action="store_true", help="only the decode term against a CPU decode"
    )
    a = ap.parse_args()
    if a.decode_check:
        d = decode_check()
        print(
            "VAE decode, 2 images at 128 px, fp32: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in d.items())
        )
    elif a.check:
        print(check_lines(check()))
    else:
        rows = preset_estimates()
        print(preset_table(rows))
        print()
        print(preset_table(rows, short=True))
        print()
        print(check_lines(check()))
        print()
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
