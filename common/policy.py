"""The policy being trained: which weights (a LoRA or the whole transformer), its KL reference,
the EMA of its weights, and the files users load.

- `Trainable`: sets the transformer up for training and owns `params`, the trained tensors (the
  optimizer's, the EMA's, the checkpoint's); `reference` is the KL reference policy;
  `save_weights` writes a LoRA or a transformer folder that stock diffusers pipelines load.
- `EMA`, `ema_weights`: Flow-GRPO's moving average of the trained weights, and the block in which
  evaluation and saving see it.
Tested in tests/test_training.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


# ---------------------------------------------------------------------------------- trained weights
class Trainable:
    """What is trained: a LoRA on the transformer (default) or every transformer weight
    (full_finetune).

    LoRA: Gaussian init of A and zeros for B, so the adapter starts as an exact no-op (Flow-GRPO's
    choice), and the KL reference is the same network with the adapter switched off (no second copy
    in memory). Full fine-tuning keeps a frozen copy as the reference, only when the KL needs one.
    Trained weights are fp32 master weights even when the frozen base runs in bf16. `params` maps
    names to the trained tensors (the optimizer's, the EMA's, the checkpoint's); under --parallel
    fsdp, common/plumbing/parallel.py re-points it at the shards (DTensors) after fully_shard.
    """

    def __init__(
        self,
        backbone,
        full_finetune: bool,
        lora_rank: int,
        lora_alpha: float,
        lora_targets: list[str],
        need_reference: bool,
    ):
        self.backbone, self.full_finetune, self.ref_model = backbone, full_finetune, None
        transformer = backbone.transformer
        if full_finetune:
            transformer.requires_grad_(True)
            if need_reference:
                import copy

                self.ref_model = copy.deepcopy(transformer).requires_grad_(False)
        else:
            from peft import LoraConfig

            transformer.requires_grad_(False)
            transformer.add_adapter(
                LoraConfig(
                    r=lora_rank,
                    lora_alpha=lora_alpha,
                    init_lora_weights="gaussian",
                    target_modules=lora_targets,
                )
            )
        self.params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
        for p in self.params.values():
            p.data = p.data.float()
        # A fully trained transformer is now fp32 while its inputs are in the backbone's bf16/fp16:
        # compute under autocast (a LoRA needs none: peft casts its input to the adapter's dtype and
        # the output back).
        backbone.autocast = full_finetune and backbone.dtype != torch.float32

    def reference(self, *args, **kwargs):
        """The KL reference policy's transformer, called as the transformer is
        (`backbone.velocity(..., model= trainable.reference)`): the frozen copy, or the
        LoRA-carrying network with its adapter off; never with gradient."""
        with torch.no_grad():
            if self.ref_model is not None:
                return self.ref_model(*args, **kwargs)
            self.backbone.transformer.disable_adapters()
            try:
                return self.backbone.transformer(*args, **kwargs)
            finally:
                self.backbone.transformer.enable_adapters()

    def save_weights(self, folder: str) -> None:
        """Weights for users: a LoRA that a stock pipeline loads with `load_lora_weights(folder)`,
        or (full fine-tuning) a transformer folder that `from_pretrained` loads. FSDP: every rank
        must call it; the weights are gathered one tensor at a time into rank 0's host memory (never
        the whole model on one GPU) and rank 0 writes the same files as DDP (diffusers' layout and
        shard size for a full model)."""
        import os

        from common.plumbing.parallel import gather_state_dict, is_sharded, save_pretrained_gathered

        transformer, state = self.backbone.transformer, None
        if is_sharded(self.params):
            state = gather_state_dict(transformer, trained_only=not self.full_finetune)
            if state is None:  # not rank 0
                return
        if self.full_finetune:
            out = os.path.join(folder, "transformer")
            transformer.save_pretrained(out) if state is None else save_pretrained_gathered(
                transformer, state, out
            )
        else:
            from peft.utils import get_peft_model_state_dict

            type(self.backbone.pipe).save_lora_weights(
                folder,
                transformer_lora_layers=get_peft_model_state_dict(transformer, state_dict=state),
            )


# ------------------------------------------------------------------------------------------ EMA
class EMA:
    """Flow-GRPO's EMA of the trained weights (flow_grpo/ema.py): after optimizer step s (0-based),

        if (s + 1) % interval == 0:   ema += (1 - d_s) (p - ema),
                                      d_s = min((1 + s) / (10 + s), decay)  (warm-up)

    so the average starts close to the live weights and settles at `decay` (0.9 every 8 steps: a
    horizon of about 8 / (1 - 0.9) = 80 optimizer steps). warmup=False uses d_s = decay from the
    start; interval=1, warmup=False is a plain per-step EMA. The released train_sd3.py calls its EMA
    step after every accumulation micro-step with the optimizer-step counter, which blends once per
    micro-step inside an update step; this class blends once per optimizer step, what the wrapper's
    interface describes.
    """

    def __init__(
        self, params: dict[str, torch.Tensor], decay: float, interval: int = 1, warmup: bool = True
    ):
        self.params, self.decay, self.interval, self.warmup = params, decay, interval, warmup
        self.shadow = {n: p.detach().clone() for n, p in params.items()}
        self.steps = 0  # optimizer steps seen

    def current_decay(self, s: int) -> float:
        return min((1 + s) / (10 + s), self.decay) if self.warmup else self.decay

    @torch.no_grad()
    def update(self) -> None:
        s, self.steps = self.steps, self.steps + 1
        if (s + 1) % self.interval == 0:
            d = self.current_decay(s)
            for n, p in self.params.items():
                self.shadow[n].lerp_(p.detach(), 1 - d)

    @contextmanager
    def swapped(self):
        """Inside the block the trained parameters hold the EMA weights (evaluation, saving)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self):
        for n, p in self.params.items():
            tmp = p.data.clone()
            p.data.copy_(self.shadow[n])
            self.shadow[n].copy_(tmp)

    def state_dict(self) -> dict:
        return {"shadow": {n: t.cpu() for n, t in self.shadow.items()}, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Every shadow tensor must be present with its weight's shape, checked before any is
        copied (copy_ would broadcast a (1,) tensor into a whole weight without a word)."""
        saved = state["shadow"]
        for n, t in self.shadow.items():
            got = saved.get(n)
            if got is None or tuple(got.shape) != tuple(t.shape):
                shown = "missing" if got is None else f"of shape {tuple(got.shape)}"
                raise ValueError(f"EMA weight {n} is {shown}, the weight has {tuple(t.shape)}")
        for n in self.shadow:
            self.shadow[n].copy_(saved[n])
        self.steps = state["steps"]


@contextmanager
def ema_weights(ema: EMA | None):
    """`with ema_weights(ema):` evaluates / saves the EMA weights when there is an EMA, the live
    ones otherwise."""
    if ema is None:
        yield
    else:
        with ema.swapped():
            yield
