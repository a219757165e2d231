"""Data parallelism of the three scripts, --parallel ddp or fsdp, behind one interface
(docs/design.md, "Sharding").

DDP: every rank holds the whole transformer, its gradients and the optimizer state; the gradients
are all-reduced. FSDP2 (torch.distributed.fsdp.fully_shard): each of the N ranks holds 1/N of every
transformer weight (trained or frozen), of the gradients and of the optimizer state; a block's
weights are all-gathered just before it runs and freed after it, and the gradients are
reduce-scattered. What differs between the two lives here, so that the training section of the
scripts is the same text for both (and for one process):

    check_parallel(args, world_size)        the flags, one line each, before any model is loaded
    parallelize(trainable, kind, ...)       -> policy, the module the training forward calls
    is_sharded(params), full_tensor(t)      FSDP's parameters are DTensors (shards); the whole
                                            tensor, gathered
    weights_digest(params)                  sha256 of the whole trained weights (the same on every
                                            rank)
    gather_state_dict, save_pretrained_gathered   the user's weights from the shards
                                                  (common/policy.py)

Under FSDP every transformer forward is a collective (the all-gather of the weights), so every rank
must run the same number of forwards, with or without gradients: the rollouts do by construction
(equal images per rank), the GRPO scripts' optimizer_steps fills up the micro-batches, and
common/plumbing/evaluation.py pads the last evaluation batch. The scripts' DDP line,
`policy.require_backward_grad_sync = last micro-batch` (nanoGPT's), lets only an optimizer step's
last micro-batch all-reduce; FSDP2 ignores it and reduce-scatters every micro-batch: deferring that
(set_requires_gradient_sync(False)) would hold the UNSHARDED fp32 gradient of the trained weights
until the last micro-batch, 44 GiB per GPU for FLUX.1-dev's full fine-tuning (docs/results.md,
memory model).
"""

from __future__ import annotations

import hashlib
import os

import torch

from common.plumbing.checks import ConfigError

PARALLEL = ("ddp", "fsdp")


def check_parallel(args, world_size: int) -> None:
    """--parallel / --fsdp-offload, for the scripts' check_args. FSDP over ONE rank is allowed
    (torchrun --nproc-per-node 1): with --fsdp-offload it keeps the weights, gradients and optimizer
    state in host memory, which is how a model larger than the GPU trains on one GPU."""
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


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor is all-gathered (a collective: every rank calls it), a plain
    tensor is itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def weights_digest(params: dict) -> str:
    """sha256 of the trained weights, whole, in the order of `params`: equal on every rank under DDP
    and FSDP alike. One tensor is gathered at a time, so the whole model is never on one GPU."""
    h = hashlib.sha256()
    for p in params.values():
        h.update(full_tensor(p.detach()).cpu().numpy().tobytes())
    return h.hexdigest()


def gather_state_dict(module: torch.nn.Module, trained_only: bool) -> dict | None:
    """The whole state dict of a sharded module in rank 0's host memory (None on the other ranks),
    gathered one tensor at a time (get_model_state_dict with cpu_offload), so no GPU ever holds more
    than one whole tensor.
    trained_only: without the frozen weights (a LoRA's base model)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        module,
        options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trained_only
        ),
    )
    return state if dist.get_rank() == 0 else None


def save_pretrained_gathered(model: torch.nn.Module, state: dict, folder: str) -> None:
    """What diffusers' save_pretrained writes (config.json, safetensors in shards of at most 10 GB
    with their index), from a gathered state dict: save_pretrained itself would read the module's
    own parameters, i.e. the shards. The config names the model's class, not FSDP's FSDP{class}
    subclass that fully_shard swapped in."""
    import json

    from huggingface_hub import save_torch_state_dict
    from torch.distributed.fsdp import FSDPModule

    config = json.loads(model.to_json_string())
    config["_class_name"] = next(
        c for c in type(model).__mro__ if not issubclass(c, FSDPModule)
    ).__name__
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_torch_state_dict(
        state,
        folder,
        max_shard_size="10GB",
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
    )


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: diffusers names them in `_no_split_modules` (SD3:
    JointTransformerBlock; FLUX: FluxTransformerBlock and FluxSingleTransformerBlock), the unit that
    accelerate's FSDP auto-wrap uses too."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if m is not module and type(m).__name__ in names]


def shard(
    module: torch.nn.Module,
    world_size: int,
    device: torch.device,
    param_dtype: torch.dtype | None,
    offload: bool,
) -> torch.nn.Module:
    """fully_shard every block of `module`, then the module itself (its embedders, final norm and
    projection), over a 1-D mesh of all ranks. Returns the module (fully_shard turns it into an
    FSDPModule in place).

    - Mixed precision: weights are all-gathered and computed in `param_dtype` (full fine-tuning:
      the backbone's bf16 / fp16; None: each weight in its own dtype), gradients are
      reduce-scattered in fp32 and stored in the dtype of the sharded weight (the trained weights
      are fp32 masters). The forward
      inputs are not cast: the backbone already casts the latents and embeddings, and SD3's timestep
      (1000 sigma) must stay fp32, as under DDP (bf16 would round 734.5).
    - The root is resharded after its forward too (fully_shard's default keeps the root's weights
      gathered until the backward): the scripts run many forwards without a backward (rollout,
      evaluation, the KL reference), and a root left gathered then shows its unsharded tensors to
      named_parameters() and the state dict, not the shards the optimizer, the EMA and the
      checkpoint hold. It costs one all-gather of the root's few weights per backward.
    - offload: the shards, their gradients and the optimizer step live in host memory
      (CPUOffloadPolicy); the GPU holds only the block being computed.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(device.type, (world_size,))
    kw = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        ),
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if offload
        else OffloadPolicy(),
    )
    for block in _blocks(module):
        fully_shard(block, **kw)
    fully_shard(module, reshard_after_forward=True, **kw)
    return module


def parallelize(trainable, kind: str, world_size: int, offload: bool = False) -> torch.nn.Module:
    """The module the training forward calls, and trainable.params re-pointed at what the optimizer
    must step.

    ddp: the transformer wrapped in DistributedDataParallel (the transformer itself on one process).
    fsdp: the transformer sharded in place (see `shard`), and the frozen copy of the KL reference
    (full fine-tuning) sharded the same way. With a LoRA, every weight of a block is sharded, the
    frozen base weights too (that is where the memory is; FSDP2 allows trained and frozen weights in
    one shard group), and the KL reference stays the same network with the adapter switched off.
    fully_shard replaces the parameters by DTensors, so `params` is rebuilt after it: the optimizer
    and the EMA must be built on these (the scripts build them after this call).
    """
    backbone = trainable.backbone
    transformer = backbone.transformer
    if kind == "ddp":
        return (
            torch.nn.parallel.DistributedDataParallel(transformer)
            if world_size > 1
            else transformer
        )
    # A LoRA computes in fp32 as under DDP (param_dtype None: each weight is gathered in its own
    # dtype, the frozen base in the compute dtype it was loaded in, the adapter in fp32). Full
    # fine-tuning gathers its fp32 masters in the compute dtype: that halves the gathered blocks,
    # where DDP keeps fp32 masters and computes under autocast (the same matmuls; the norms'
    # weights are rounded here, not there: tests/test_parallel.py measures the difference).
    param_dtype = (
        backbone.dtype if trainable.full_finetune and backbone.dtype != torch.float32 else None
    )
    for module in (transformer, trainable.ref_model):
        if module is not None:
            shard(module, world_size, backbone.device, param_dtype, offload)
    trainable.params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    return transformer
