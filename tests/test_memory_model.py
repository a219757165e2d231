"""The memory model's activation count (benchmarks/bench_memory.py): computed on the meta device from a config, it must
give exactly the bytes autograd saves on real tensors, for the tiny SD3 and FLUX, LoRA and full fine-tuning."""

import os

import pytest
import torch

from benchmarks import bench_memory as bm


@pytest.mark.parametrize(
    "fixture,kind,text_tokens", [("tiny_sd3", "sd3", 77), ("tiny_flux", "flux", 16)]
)
@pytest.mark.parametrize("lora", [None, ["to_q", "to_k", "to_v", "to_out.0"]])
def test_meta_count_equals_the_bytes_saved_on_real_tensors(
    request, fixture, kind, text_tokens, lora
):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = SD3Transformer2DModel if kind == "sd3" else FluxTransformer2DModel
    config = cls.load_config(os.path.join(request.getfixturevalue(fixture), "transformer"))
    counts = []
    for device in (
        "cpu",
        "meta",
    ):  # CPU: PyTorch's flash kernel for CPU; meta: the shapes of what it keeps
        with torch.device(device):
            model = bm.trainable(cls.from_config(config), lora, rank=4)
        inputs = bm.forward_inputs(model, kind, 3, 64, text_tokens, device, torch.float32)
        with bm.flash_attention_shapes() if device == "meta" else torch.enable_grad():
            counts.append(bm.saved_for_backward(model, inputs))
    assert counts[0] == counts[1]
    c = counts[0]
    assert 0 < c["block_max"] < c["blocks"] <= c["total"] and c["block_inputs"] > 0
