"""SD3/SD3.5 and FLUX.1 behind one small interface, loaded from a local diffusers folder.

The training scripts never touch a pipeline's `__call__`: they run their own sampler
(common/sampler.py) and need only five things from a backbone, all here:
    encode(prompts)                  -> PromptEmbeds  (no grad: text encoders stay frozen)
    initial_noise(n, generator)      -> x_1           (SD3: [B,C,h,w]; FLUX: packed [B, h*w/4, 4C])
    velocity(x, sigma, embeds, ...)  -> v             (CFG for SD3, guidance embedding for
                                                       FLUX.1-dev)
    decode(x)                        -> images in [0,1], [B,3,H,W] float32
    schedule(num_steps)              -> sigmas        (static shift for SD3, dynamic for FLUX)
Everything else (tokenizers, model classes, the VAE, latent packing) is diffusers' own code.
tests/test_backbones.py checks that our sampler at zero noise reproduces the stock pipelines.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

from common.plumbing.checks import ConfigError
from common.sampler import ode_step, sigma_schedule, static_shift_schedule

PIPELINES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
HUB_HINT = (
    "e.g. `huggingface-cli download stabilityai/stable-diffusion-3.5-medium --local-dir DIR` or "
    "black-forest-labs/FLUX.1-dev, or the shipped toy model common/toyworld/model"
)

# LoRA targets. peft matches a name in the list when a module's full name equals it or ends in
# "." + it, so "attn.to_q" matches "transformer_blocks.0.attn.to_q" but NOT SD3.5's second attention
# "transformer_blocks.0.attn2.to_q" ("...attn2.to_q" does not end in ".attn.to_q"). "attention" is
# Flow-GRPO's SD3 set (train_sd3.py): on SD3.5 it leaves attn2 untrained, as the official code does.
# FLUX has the same names in its double blocks; its single blocks have attn.to_q/k/v (and no to_out:
# their proj_out is not matched). "attention-ff" is Flow-GRPO's FLUX set
# (train_flux.py, r 64 / alpha 128): the attention list plus the double blocks' feed-forward layers.
# tests/test_backbones.py checks which modules each set reaches on tiny SD3.5 and FLUX models.
ATTENTION = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]
LORA_TARGETS = {
    "attention": ATTENTION,
    "attention-ff": ATTENTION
    + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"],
    "all-linear": "all-linear",
}


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch of prompts (rows align with the prompts)."""

    embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, P]
    neg_embeds: torch.Tensor | None = None  # [1, L, D]: the "" prompt, SD3 classifier-free guidance
    neg_pooled: torch.Tensor | None = None  # [1, P]
    text_ids: torch.Tensor | None = None  # [L, 3]: FLUX text position ids

    def __getitem__(self, idx) -> "PromptEmbeds":
        return replace(self, embeds=self.embeds[idx], pooled=self.pooled[idx])


def read_model_index(path: str) -> dict:
    """model_index.json of a diffusers SD3/FLUX folder; fails fast, in one line, when `path` is not
    one."""
    index = os.path.join(path, "model_index.json")
    if not os.path.isdir(path):
        raise ConfigError(
            f"--model-path '{path}' is not a folder: expected a diffusers SD3/SD3.5/FLUX.1 "
            f"folder with model_index.json ({HUB_HINT})"
        )
    if not os.path.isfile(index):
        raise ConfigError(
            f"--model-path '{path}' has no model_index.json: expected a diffusers-layout pipeline "
            f"folder ({HUB_HINT})"
        )
    try:
        with open(index) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--model-path '{path}': model_index.json is unreadable ({e}); re-download it "
            f"({HUB_HINT})"
        ) from None
    name = info.get("_class_name")
    if name not in PIPELINES:
        raise ConfigError(
            f"--model-path '{path}' holds a {name}; expected one of {sorted(PIPELINES)} "
            f"({HUB_HINT})"
        )
    return info


def check_model_path(path: str) -> str:
    """Fail fast when `path` is not a diffusers SD3/FLUX folder, or lacks a component its
    model_index.json lists (an interrupted download). Returns the backbone kind ("sd3" or
    "flux")."""
    info = read_model_index(path)
    for name, entry in info.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            # metadata, or a component the pipeline does without (null in model_index.json)
            continue
        # read before the load
        need = os.path.join(name, "config.json") if name in ("vae", "transformer") else name
        if not os.path.exists(os.path.join(path, need)):
            raise ConfigError(
                f"--model-path '{path}': model_index.json lists the {name} ({entry[1]}) but {need} "
                f"is missing: an incomplete download; fetch the folder again ({HUB_HINT})"
            )
    return PIPELINES[info["_class_name"]]


def check_resolution(path: str, kind: str, height: int, width: int) -> None:
    """Fail fast (from the config files alone) when the image size does not fit the VAE and the
    patching."""
    vae_factor = 2 ** (len(read_config(path, "vae").get("block_out_channels", [0] * 4)) - 1)
    transformer = read_config(path, "transformer")
    # FLUX packs 2x2 latents
    patch = transformer.get("patch_size", 1) * (2 if kind == "flux" else 1)
    unit = vae_factor * patch
    if height % unit or width % unit:
        raise ConfigError(
            f"resolution {height}x{width} is not a multiple of {unit} (VAE factor {vae_factor} x "
            f"patch {patch}); pick e.g. {max(unit, height // unit * unit)}"
        )
    # SD3's learned position table
    grid = transformer.get("pos_embed_max_size") if kind == "sd3" else None
    if grid and max(height, width) > grid * unit:
        raise ConfigError(
            f"resolution {height}x{width} is larger than this model's position embedding covers "
            f"({grid} patches of {unit} pixels: at most {grid * unit}x{grid * unit}); pick a "
            f"resolution up to {grid * unit}"
        )


def read_config(path: str, component: str) -> dict:
    """{component}/config.json of a model folder, or one line saying it is unreadable."""
    file = os.path.join(path, component, "config.json")
    try:
        with open(file) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        return config
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--model-path '{path}': {component}/config.json is unreadable ({e.__class__.__name__}: "
            f"{e}); fetch the folder again ({HUB_HINT})"
        ) from None


def check_model_flags(path: str, kind: str, args) -> None:
    """The flags bounded by the model, from its config files, before the load: the resolution
    (check_resolution), the T5 context length and the LoRA rank."""
    check_resolution(path, kind, args.resolution, args.resolution)
    index = read_model_index(path)
    has_t5 = kind == "flux" or (index.get("text_encoder_3") or [None])[0] is not None
    longest = 512  # T5's positions in SD3 and FLUX
    if has_t5:
        tok = os.path.join(path, "tokenizer_3" if kind == "sd3" else "tokenizer_2")
        try:
            with open(os.path.join(tok, "tokenizer_config.json")) as f:
                longest = min(longest, int(json.load(f).get("model_max_length", longest)))
        except (OSError, ValueError, TypeError):
            pass
    msl = args.max_sequence_length
    if msl is not None and msl > longest:
        raise ConfigError(
            f"--max-sequence-length {msl}: this model's text context holds at most {longest} T5 "
            f"tokens{'' if has_t5 else ' (it has no T5 encoder: 1 token of zeros is its default)'}; "
            "pass a smaller value or leave it unset"
        )
    config = read_config(path, "transformer")
    width = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
    if not args.full_finetune and width and args.lora_rank > width:
        raise ConfigError(
            f"--lora-rank {args.lora_rank}: the transformer's layers are {width} wide, and a LoRA's "
            f"rank cannot exceed them; pass at most {width} (or --full-finetune)"
        )


class Backbone:
    """A loaded pipeline plus the few operations the RL scripts need. Use `load_backbone`."""

    def __init__(
        self,
        pipe,
        kind: str,
        device: torch.device,
        dtype: torch.dtype,
        max_sequence_length: int,
        decode_batch_size: int = 8,
    ):
        self.pipe, self.kind, self.device, self.dtype = pipe, kind, device, dtype
        self.max_sequence_length, self.decode_batch_size = max_sequence_length, decode_batch_size
        # Set by Trainable for full fine-tuning in bf16/fp16: the transformer then holds fp32 master
        # weights, and its calls run under autocast in self.dtype (what accelerate's mixed precision
        # does in the released code).
        self.autocast = False
        self.transformer = pipe.transformer
        self.vae_scale_factor = pipe.vae_scale_factor
        for module in (
            pipe.vae,
            pipe.text_encoder,
            getattr(pipe, "text_encoder_2", None),
            getattr(pipe, "text_encoder_3", None),
        ):
            if module is not None:
                # frozen: only the transformer (or its LoRA) is trained
                module.requires_grad_(False)

    # ---- shapes and schedule ---------------------------------------------------------------------
    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def schedule(
        self,
        num_steps: int,
        height: int,
        width: int,
        shift: float | None = None,
        grid: str = "pipeline",
    ) -> torch.Tensor:
        """σ_0=1 > ... > σ_T=0. grid "pipeline": exactly as the stock pipeline would use (FLUX:
        dynamic shift from the image length, `shift` unused). grid "official": the static shift on
        linspace(1, 0, T+1) of the DanceGRPO / G²RPO code, for both backbones
        (`static_shift_schedule`); `shift` None = the scheduler config's (3 for SD3.5 and
        FLUX.1-dev, the value of the released G²RPO scripts)."""
        cfg = self.pipe.scheduler.config
        shift = cfg.shift if shift is None else shift
        if grid == "official":
            return static_shift_schedule(num_steps, shift)
        if grid != "pipeline":
            raise ValueError(f"sigma grid '{grid}': expected 'pipeline' or 'official'")
        if self.kind == "flux" and cfg.use_dynamic_shifting:
            h, w = self.latent_hw(height, width)
            return sigma_schedule(num_steps, shift, image_seq_len=(h // 2) * (w // 2))
        return sigma_schedule(num_steps, shift)

    # ---- text ------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Prompt embeddings, without a graph (one would break multi-timestep backward passes)."""
        if self.kind == "flux":
            return self._encode_flux(prompts)
        # SD3; Flow-GRPO's negative prompt is the empty string, encoded once and broadcast
        (emb, pooled), (neg, neg_pooled) = (self._encode_sd3(p) for p in (prompts, [""]))
        return PromptEmbeds(emb, pooled, neg, neg_pooled)

    def _encode_flux(self, prompts: list[str]) -> PromptEmbeds:
        emb, pooled, text_ids = self.pipe.encode_prompt(
            prompts, None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return PromptEmbeds(emb.to(self.dtype), pooled.to(self.dtype), text_ids=text_ids)

    def _encode_sd3(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        emb, _, pooled, _ = self.pipe.encode_prompt(
            prompts,
            None,
            None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return emb.to(self.dtype), pooled.to(self.dtype)

    # ---- latents ---------------------------------------------------------------------------------
    def initial_noise(self, n: int, height: int, width: int, generator=None) -> torch.Tensor:
        """x_1 ~ N(0, I) in float32, drawn as the stock pipeline draws it (generator, shape)."""
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self.latent_hw(height, width)
        c = self.pipe.vae.config.latent_channels
        x = randn_tensor((n, c, h, w), generator=generator, device=self.device, dtype=torch.float32)
        if self.kind == "flux":
            self.set_image_size(height, width)
        return self.pipe._pack_latents(x, n, c, h, w) if self.kind == "flux" else x

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] in [0, 1], float32, `decode_batch_size` per VAE call (the
        fp32 VAE needs ~0.75 GiB per image at 512 px; each image is decoded on its own)."""
        vae = self.pipe.vae
        if self.kind == "flux":
            latents = self.pipe._unpack_latents(latents, height, width, self.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        chunks = latents.split(self.decode_batch_size)
        images = torch.cat([vae.decode(c.to(vae.dtype), return_dict=False)[0] for c in chunks])
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # ---- the policy network ----------------------------------------------------------------------
    def velocity(
        self, latents, sigma, emb: PromptEmbeds, guidance_scale=1.0, model=None, detach_uncond=False
    ) -> torch.Tensor:
        """v_θ(x_σ, σ, c), float32; `sigma` a float or [B]. SD3: CFG v = v_u + w (v_c - v_u) with
        the "" prompt, in one batch as the pipeline (`detach_uncond`: the gradient through v_c only,
        as Flow-GRPO's training forward); FLUX.1-dev: w is an input. `model`: e.g. DDP's wrapper."""
        model = self.transformer if model is None else model
        sigma = torch.as_tensor(sigma, device=self.device, dtype=torch.float32).expand(len(latents))
        x = latents.to(self.dtype)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            if self.kind == "flux":
                return self._flux_velocity(model, x, sigma, emb, guidance_scale)
            return self._sd3_velocity(model, x, sigma, emb, guidance_scale, detach_uncond)

    def _sd3_velocity(self, model, x, sigma, emb: PromptEmbeds, guidance_scale, detach_uncond):
        embeds, pooled, b = emb.embeds, emb.pooled, len(x)
        if guidance_scale > 1.0:  # CFG: the "" prompt's branch and the prompt's in one batch
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
            embeds = torch.cat([emb.neg_embeds.expand(b, -1, -1), embeds])
            pooled = torch.cat([emb.neg_pooled.expand(b, -1), pooled])
        v = model(
            hidden_states=x,
            timestep=sigma * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0].float()
        if guidance_scale <= 1.0:
            return v
        v_u, v_c = v.chunk(2)
        if detach_uncond:
            v_u = v_u.detach()
        return v_u + guidance_scale * (v_c - v_u)

    def _flux_velocity(self, model, x, sigma, emb: PromptEmbeds, guidance_scale):
        b, guidance = len(x), None
        if self.transformer.config.guidance_embeds:  # FLUX.1-dev: the guidance is an input
            guidance = torch.full((b,), float(guidance_scale), device=self.device)
        gh, gw = self._packed_grid(x.shape[1])
        img_ids = self.pipe._prepare_latent_image_ids(b, gh, gw, self.device, self.dtype)
        v = model(
            hidden_states=x,
            timestep=(sigma * 1000).to(self.dtype) / 1000,
            guidance=guidance,
            pooled_projections=emb.pooled,
            encoder_hidden_states=emb.embeds,
            txt_ids=emb.text_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return v.float()

    def set_image_size(self, height: int, width: int) -> None:
        """Remember the packed FLUX grid (needed for the position ids of non-square images)."""
        h, w = self.latent_hw(height, width)
        self._flux_grid = (h // 2, w // 2)

    def _packed_grid(self, seq_len: int) -> tuple[int, int]:
        grid = getattr(self, "_flux_grid", None)
        if grid and grid[0] * grid[1] == seq_len:
            return grid
        side = int(round(seq_len**0.5))
        if side * side != seq_len:
            raise ValueError("non-square FLUX latents: call backbone.set_image_size(height, width)")
        return side, side


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """--mixed-precision as it runs: "auto" is bf16 on CUDA and fp32 elsewhere (a CPU computes bf16
    slowly); an explicit fp32, bf16 or fp16 is honoured on every device, so the fp16 and bf16 paths
    run where the tests run."""
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ConfigError(f"--mixed-precision {precision}: expected auto, {', '.join(PRECISIONS)}")
    return precision


def load_backbone(
    path: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_sequence_length: int | None = None,
    gradient_checkpointing: bool = False,
    precision: str = "auto",
    shard: bool = False,
    decode_batch_size: int = 8,
) -> Backbone:
    """Load an SD3/SD3.5/FLUX.1 diffusers folder. Bad paths stop with one clear line before any
    heavy work.

    precision (`resolve_precision`) is the dtype of the frozen weights and the activations; the VAE
    is kept in fp32 whatever it is, as Flow-GRPO's code decodes (a fp16 VAE overflows on SD3), and
    decodes `decode_batch_size` images per call. shard (--parallel fsdp): the transformer stays in
    host memory; common/plumbing/parallel.py moves each rank's shard of it to the GPU, block by
    block, so the whole model (and its fp32 masters) never has to fit on one GPU."""
    index = read_model_index(path)
    kind = PIPELINES[index["_class_name"]]
    device = torch.device(device)
    if dtype is None:
        dtype = PRECISIONS[resolve_precision(precision, device)]
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = StableDiffusion3Pipeline if kind == "sd3" else FluxPipeline
    # A pipeline saved without a T5 encoder (the toy model) records it as null; diffusers then wants
    # it passed.
    absent = {
        k: None
        for k in ("text_encoder_3", "tokenizer_3")
        if kind == "sd3" and index.get(k, [None])[0] is None
    }
    try:
        # the VAE decodes in fp32 whatever the model dtype (a no-op on CPU)
        pipe = cls.from_pretrained(
            path, dtype={"default": dtype, "vae": torch.float32}, local_files_only=True, **absent
        )
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--model-path '{path}' could not be loaded as a {cls.__name__}: {first} ({HUB_HINT})"
        ) from None
    if shard:
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and name != "transformer":
                module.to(device)
    else:
        from diffusers.utils import logging as diffusers_logging

        # diffusers warns that an fp16 pipeline "will fail" on a CPU: ours runs, slowly (the tests
        # take the fp16 path there); its other warnings stay
        quiet = dtype == torch.float16 and device.type == "cpu"
        level = diffusers_logging.get_verbosity()
        if quiet:
            diffusers_logging.set_verbosity_error()
        try:
            pipe.to(device)
        finally:
            diffusers_logging.set_verbosity(level)
    if max_sequence_length is None:
        # T5 tokens in the context. Flow-GRPO uses 128 for SD3.5; FLUX was trained with 512.
        # Without a T5 encoder (the toy model) SD3 feeds zeros, so one such token is enough.
        has_t5 = getattr(pipe, "text_encoder_3", None) is not None or kind == "flux"
        max_sequence_length = (128 if kind == "sd3" else 512) if has_t5 else 1
        tok = getattr(pipe, "tokenizer_3", None) if kind == "sd3" else pipe.tokenizer_2
        if tok is not None and tok.model_max_length < max_sequence_length:
            max_sequence_length = tok.model_max_length
    if gradient_checkpointing:
        pipe.transformer.enable_gradient_checkpointing()
    if kind == "flux" and device.type == "cuda":
        # A FLUX.1-dev LoRA backward crashed (CUBLAS_STATUS_EXECUTION_FAILED / illegal memory
        # access) on an H200 with the cuDNN SDPA backend and ran fine without it
        # (../shared/reference/gpu_anchor.md).
        torch.backends.cuda.enable_cudnn_sdp(False)
    return Backbone(pipe, kind, device, dtype, max_sequence_length, decode_batch_size)


@torch.no_grad()
def sample_ode(
    backbone: Backbone,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    height: int,
    width: int,
    guidance_scale: float = 1.0,
    shift: float | None = None,
) -> torch.Tensor:
    """The sampler of every evaluation (scripts through common/plumbing/evaluation.py, pretraining,
    benchmarks): deterministic Euler ODE from one fixed seed per image -> images in [0, 1]."""
    sigmas = backbone.schedule(steps, height, width, shift)
    gens = [torch.Generator(backbone.device).manual_seed(s) for s in seeds]
    x = backbone.initial_noise(len(prompts), height, width, generator=gens)
    emb = backbone.encode(prompts)
    for i in range(steps):
        x = ode_step(
            backbone.velocity(x, sigmas[i], emb, guidance_scale), x, sigmas[i], sigmas[i + 1]
        )
    return backbone.decode(x, height, width)
