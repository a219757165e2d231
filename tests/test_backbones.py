"""The SD3 / FLUX adapters: our sampler + our velocity must reproduce the stock diffusers pipelines."""

import json
import os

import pytest
import torch

from common.backbones import check_resolution, load_backbone
from common.plumbing.checks import ConfigError
from common.sampler import ode_step, sde_step_with_logprob

PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]
H = W = 64


def our_sample(bb, steps, guidance, seed, noise_level=0.0):
    sigmas = bb.schedule(steps, H, W)
    x = bb.initial_noise(len(PROMPTS), H, W, generator=torch.Generator().manual_seed(seed))
    emb = bb.encode(PROMPTS)
    for i in range(steps):
        v = bb.velocity(x, sigmas[i], emb, guidance)
        if noise_level == 0:
            x = ode_step(v, x, sigmas[i], sigmas[i + 1])
        else:
            x = sde_step_with_logprob(
                v, x, sigmas[i], sigmas[i + 1], noise_level, sigma_max=sigmas[1]
            )[0]
    return bb.decode(x, H, W)


@pytest.mark.parametrize(
    "fixture,guidance",
    [("tiny_sd3", 1.0), ("tiny_sd3", 4.5), ("tiny_sd35", 4.5), ("tiny_flux", 3.5)],
)
def test_adapter_reproduces_stock_pipeline(request, fixture, guidance):
    path = request.getfixturevalue(fixture)
    bb = load_backbone(path, "cpu", max_sequence_length=16)
    steps = 6
    kw = dict(
        height=H,
        width=W,
        num_inference_steps=steps,
        guidance_scale=guidance,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(3),
        output_type="pt",
    )
    if bb.kind == "sd3":
        kw["negative_prompt"] = ""
    stock = bb.pipe(PROMPTS, **kw).images.float()
    ours = our_sample(bb, steps, guidance, seed=3)
    assert ours.shape == stock.shape == (2, 3, H, W)
    assert torch.allclose(ours, stock, atol=1e-4), (ours - stock).abs().max()
    # and the comparison is not vacuous: another seed gives another image
    assert not torch.allclose(our_sample(bb, steps, guidance, seed=4), stock, atol=1e-3)


def test_sde_sampling_runs_and_differs_from_ode(tiny_sd3):
    bb = load_backbone(tiny_sd3, "cpu", max_sequence_length=16)
    torch.manual_seed(0)
    ode, sde = our_sample(bb, 4, 1.0, 0), our_sample(bb, 4, 1.0, 0, noise_level=0.7)
    assert torch.isfinite(sde).all() and not torch.allclose(ode, sde)


def test_resolution_check(tiny_sd3, tiny_flux):
    check_resolution(tiny_sd3, "sd3", 64, 64)
    with pytest.raises(ConfigError, match="not a multiple of 4"):
        check_resolution(tiny_sd3, "sd3", 66, 64)
    with pytest.raises(ConfigError, match="not a multiple of 4"):  # FLUX: VAE 2 x 2x2 packing
        check_resolution(tiny_flux, "flux", 64, 62)


def test_bad_model_path_is_one_clear_line(tmp_path, capsys):
    for bad, expect in [
        (tmp_path / "missing", "is not a folder"),
        (tmp_path, "has no model_index.json"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_backbone(str(bad))
        msg = str(e.value.code)
        assert expect in msg and "huggingface-cli download" in msg and "\n" not in msg
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline"})
    )
    with pytest.raises(ConfigError, match="expected one of"):
        load_backbone(str(tmp_path))
    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        load_backbone(str(tmp_path))
    # a folder with a valid index but no weights fails at load time, still in one line
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_backbone(str(tmp_path))


def test_bad_path_from_the_command_line_has_no_traceback(tmp_path):
    import subprocess
    import sys

    code = f"from common.backbones import load_backbone; load_backbone({str(tmp_path / 'nope')!r})"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode != 0
    assert r.stderr.strip().startswith("error: --model-path") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def lora_modules(transformer, target):
    """Names of the modules that get a LoRA for LORA_TARGETS[target] (peft's own matching, as the scripts use it)."""
    from peft import LoraConfig

    from common.backbones import LORA_TARGETS

    transformer.add_adapter(
        LoraConfig(
            r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS[target]
        )
    )
    return {n.rsplit(".lora_A", 1)[0] for n, _ in transformer.named_parameters() if ".lora_A" in n}


def test_attention_lora_targets_skip_sd35_attn2():
    """peft matches ".attn.to_q" as a name suffix: SD3.5's second attention (attn2) gets no LoRA, as in Flow-GRPO's
    train_sd3.py; "attention-ff" adds the feed-forward layers (its train_flux.py set) and nothing else."""
    from common.plumbing.tiny import build_sd3

    names = {
        n
        for n, m in build_sd3(sd35=True).transformer.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    # the tiny SD3.5 does have a dual-attention block
    assert "transformer_blocks.0.attn2.to_q" in names
    attn = lora_modules(build_sd3(sd35=True).transformer, "attention")
    assert (
        "transformer_blocks.0.attn.to_q" in attn and "transformer_blocks.0.attn.to_add_out" in attn
    )
    assert not any(".attn2." in n for n in attn)
    assert all(".attn." in n for n in attn)
    ff = lora_modules(build_sd3(sd35=True).transformer, "attention-ff")
    assert {n for n in ff - attn} == {
        n for n in names if ".ff.net." in n or ".ff_context.net." in n
    }
    assert not any(".attn2." in n for n in ff)


def test_flux_lora_targets():
    """FLUX: "attention" reaches the double blocks' projections and the single blocks' to_q/k/v; "attention-ff" is
    Flow-GRPO's FLUX set, which adds the double blocks' ff / ff_context (single blocks have none)."""
    from common.plumbing.tiny import build_flux

    attn = lora_modules(build_flux().transformer, "attention")
    assert {n for n in attn if n.startswith("single_")} == {
        f"single_transformer_blocks.0.attn.to_{x}" for x in "qkv"
    }
    assert (
        "transformer_blocks.0.attn.add_q_proj" in attn
        and "transformer_blocks.0.attn.to_out.0" in attn
    )
    ff = lora_modules(build_flux().transformer, "attention-ff")
    assert ff - attn == {
        "transformer_blocks.0.ff.net.0.proj",
        "transformer_blocks.0.ff.net.2",
        "transformer_blocks.0.ff_context.net.0.proj",
        "transformer_blocks.0.ff_context.net.2",
    }
