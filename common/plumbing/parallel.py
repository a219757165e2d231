"""--parallel ddp or fsdp behind one interface, so the scripts' training section is the same text
for both and for one process (docs/design.md, "Sharding"). DDP: each rank holds the whole model;
FSDP2 (fully_shard): each of N ranks holds 1/N of every weight, gradient and optimizer state.

Under FSDP every transformer forward is a collective, so all ranks must run the same number of
forwards, with or without gradients. FSDP2 ignores the scripts' `require_backward_grad_sync` and
reduce-scatters every micro-batch: deferring it would hold the UNSHARDED fp32 gradient (44 GiB per
GPU for FLUX.1-dev's full fine-tuning; docs/results.md, memory model).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed as dist

from common.plumbing.checks import ConfigError

PARALLEL = ("ddp", "fsdp")


def check_parallel(args, world_size: int) -> None:
    """--parallel / --fsdp-offload, for the scripts' check_args. FSDP over ONE rank is allowed: with
    --fsdp-offload it is how a model larger than the GPU trains on one GPU."""
    if args.parallel not in PARALLEL:
        raise ConfigError(f"--parallel {args.parallel}: expected one of {', '.join(PARALLEL)}")
    if args.parallel == "fsdp" and world_size == 1 and "RANK" not in os.environ:
        raise ConfigError(
            "--parallel fsdp shards the model over the ranks of a process group, and `python "
            "script.py` starts none: launch it with `torchrun --nproc-per-node N script.py "
            "--parallel fsdp ...` (N = 1 works: FSDP over one rank, with --fsdp-offload to hold "
            "the model in host memory)"
        )
    if getattr(args, "grad_share_every", 0) and world_size > 1:
        raise ConfigError(
            f"--grad-share-every {args.grad_share_every} is a diagnostic for one process (it "
            "splits this rank's gradient by step): run it without torchrun, or pass "
            "--grad-share-every 0"
        )
    if args.fsdp_offload and args.parallel != "fsdp":
        raise ConfigError(
            "--fsdp-offload keeps FSDP's shards in host memory: it needs --parallel fsdp (got "
            f"--parallel {args.parallel}, which has no shards to offload)"
        )


def is_sharded(params: dict) -> bool:
    """True when the trained parameters are FSDP shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params.values())


def weights_digest(params: dict) -> str:
    """sha256 of the whole trained weights in the order of `params`, equal on every rank under DDP
    and FSDP; gathered one tensor at a time, so the whole model is never on one GPU."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for p in params.values():
        whole = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()  # a collective
        h.update(whole.cpu().numpy().tobytes())
    return h.hexdigest()


def gather_state_dict(module: torch.nn.Module, trained_only: bool) -> dict | None:
    """The whole state dict of a sharded module in rank 0's host memory (None on the other ranks),
    gathered one tensor at a time. trained_only: without the frozen weights (a LoRA's base)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=trained_only
    )
    state = get_model_state_dict(module, options=options)
    return state if dist.get_rank() == 0 else None


def save_pretrained_gathered(model: torch.nn.Module, state: dict, folder: str) -> None:
    """What diffusers' save_pretrained writes, from a gathered state dict (save_pretrained would
    read the shards). The config names the model's class, not fully_shard's FSDP{class}."""
    from huggingface_hub import save_torch_state_dict
    from torch.distributed.fsdp import FSDPModule

    config = json.loads(model.to_json_string())
    base = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config["_class_name"] = base.__name__
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    pattern = "diffusion_pytorch_model{suffix}.safetensors"
    save_torch_state_dict(state, folder, max_shard_size="10GB", filename_pattern=pattern)


def shard(module, world_size: int, device, param_dtype, offload: bool) -> torch.nn.Module:
    """fully_shard every block (diffusers' `_no_split_modules`), then the module, over all ranks:
    weights gathered in `param_dtype` (None: their own), gradients reduced in fp32, inputs not cast
    (SD3's timestep, 1000 sigma, stays fp32). The root reshards after its forward too: the scripts
    run forwards without a backward, and a gathered root shows the state dict unsharded tensors."""
    from torch.distributed import fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    mp = fsdp.MixedPrecisionPolicy(
        param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    pin = device.type == "cuda"
    placement = fsdp.CPUOffloadPolicy(pin_memory=pin) if offload else fsdp.OffloadPolicy()
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=placement)
    names = set(getattr(module, "_no_split_modules", None) or ())
    for block in [m for m in module.modules() if m is not module and type(m).__name__ in names]:
        fsdp.fully_shard(block, **kw)
    fsdp.fully_shard(module, reshard_after_forward=True, **kw)
    return module


def parallelize(trainable, kind: str, world_size: int, offload: bool = False) -> torch.nn.Module:
    """The module the training forward calls. ddp: the transformer (in DistributedDataParallel over
    ranks). fsdp: it and the frozen KL reference (full fine-tuning) sharded in place, a LoRA's base
    with its block; trainable.params is rebuilt (DTensors): build the optimizer and EMA after it."""
    backbone = trainable.backbone
    transformer = backbone.transformer
    if kind == "ddp":
        if world_size > 1:
            return torch.nn.parallel.DistributedDataParallel(transformer)
        return transformer
    # A LoRA computes in fp32 as under DDP (param_dtype None). Full fine-tuning gathers its fp32
    # masters in the compute dtype, halving the gathered blocks (DDP computes under autocast; the
    # norms' weights round differently: tests/test_parallel.py measures it).
    low_precision = trainable.full_finetune and backbone.dtype != torch.float32
    param_dtype = backbone.dtype if low_precision else None
    for module in (transformer, trainable.ref_model):
        if module is not None:
            shard(module, world_size, backbone.device, param_dtype, offload)
    trainable.params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    return transformer
