"""--mixed-precision (issue #55): fp16 with dynamic loss scaling, bf16 and fp32, honoured on the CPU so that the
paths a GPU run takes are tested here.

The fp16 presets (Flow-GRPO, DenseGRPO, DiffusionNFT on SD3.5-M, as released) need loss scaling: at 512 px a
Flow-GRPO loss is a mean over ~650 transitions of log-probs that each sum 16 x 64 x 64 latent entries, so the
gradient that reaches the transformer's fp16 activations is ~1e-8 per element, below fp16's smallest number. The
released code scales the loss with a GradScaler; the scripts do the same with torch.amp's (`scaler = ...` after the
optimizer, `scaler.scale(loss).backward()`, `scaler.unscale_`, `scaler.step`, `scaler.update`).

CI runs this file twice (.ci/run): on the CPU's own kernels, and with oneDNN capped at AVX2 and ATen's scalar kernels,
which round bf16 and fp16 otherwise (docs/data/cpu_paths_2026-12-06). So a precision is compared with another on the
same inputs: two rollouts, each sampled in its own precision, can rank a group's rewards differently on one CPU and
not on another, and flip advantages (issue #67).
"""

import json
import os

import pytest
import torch
from helpers import read_metrics, run_main, tiny_flags, write_prompts

from common.backbones import LORA_TARGETS, load_backbone
from common.policy import Trainable
from common.sampler import sde_step_with_logprob

SCRIPT = "flowgrpo_baseline.py"
# The SD3.5-M paper preset's loss divisor: 48 groups x 24 images x 9 trained steps over 2 optimizer steps and
# 8 ranks = 648 kept transitions per rank and optimizer step (docs/flowgrpo.md, "Paper preset").
PRESET_DIVISOR = 48 * 24 * 9 / 2 / 8
PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]


@pytest.fixture(scope="module")
def sd35_16ch(tmp_path_factory):
    """A tiny SD3.5-shaped pipeline with SD3's 16 latent channels; its VAE halves the side, so 128 px gives the
    paper's 512-px latents, 16 x 64 x 64."""
    from common.plumbing.tiny import build_sd3

    path = str(tmp_path_factory.mktemp("sd35-16ch"))
    build_sd3(path, seed=3, sd35=True, latent_channels=16)
    return path


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def preset_scale_gradient(path: str, precision: str, scaled: bool) -> torch.Tensor:
    """The LoRA gradient of one micro-batch of Flow-GRPO's loss at the SD3.5-M preset's scale, through the project's
    own load_backbone, Trainable and sde_step_with_logprob: 4 transitions at steps 0, 3, 6, 8 of the 10-step schedule,
    16 x 64 x 64 latents, CFG 4.5, a = 0.7, advantages +-1, divided by the preset's 648 transitions. Each precision
    samples its actions with its own model, as its rollout would, from the same latents and the same noise; the
    LoRA's B is set to small seeded values, as after some training (at B = 0 the A matrices have no gradient)."""
    bb = load_backbone(path, "cpu", precision=precision, max_sequence_length=8)
    torch.manual_seed(0)  # the LoRA's A is drawn from the global generator (peft's gaussian init)
    trainable = Trainable(bb, False, 4, 8, LORA_TARGETS["attention"], need_reference=False)
    gb = torch.Generator().manual_seed(1)
    for name, p in trainable.params.items():
        if "lora_B" in name:
            p.data = 0.02 * torch.randn(p.shape, generator=gb)
    sigmas = bb.schedule(10, 128, 128)
    g = torch.Generator().manual_seed(0)
    steps = torch.tensor([0, 3, 6, 8])
    x = torch.randn(len(steps), 16, 64, 64, generator=g)
    sigma, sigma_next = sigmas[steps], sigmas[steps + 1]
    emb = bb.encode([PROMPTS[i % 2] for i in range(len(steps))])
    with torch.no_grad():  # the rollout: the action and its log-prob under the sampling policy
        v = bb.velocity(x, sigma, emb, 4.5)
        x_next, old, *_ = sde_step_with_logprob(
            v, x, sigma, sigma_next, 0.7, generator=g, sigma_max=sigmas[1]
        )
    v = bb.velocity(x, sigma, emb, 4.5)  # the training forward, with gradient
    log_prob = sde_step_with_logprob(
        v, x, sigma, sigma_next, 0.7, prev_sample=x_next, sigma_max=sigmas[1]
    )[1]
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss = (-adv * torch.exp(log_prob - old)).sum() / PRESET_DIVISOR
    params = list(trainable.params.values())
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    scaler.scale(loss).backward()
    scaler.unscale_(torch.optim.SGD(params, lr=0.0))
    return torch.cat([p.grad.flatten() for p in params])


def test_fp16_gradient_at_the_presets_scale_needs_loss_scaling(sd35_16ch):
    """With fp16 weights and activations and loss scaling, the LoRA gradient has cosine >= 0.99 to fp32's; bf16
    (fp32's exponent range) needs no scaling; fp16 without scaling loses most of the gradient to underflow (this
    is what the fp16 presets did before 2026-12-05: the check fails if the scaler stops doing its work)."""
    fp32 = preset_scale_gradient(sd35_16ch, "fp32", scaled=False)
    fp16 = preset_scale_gradient(sd35_16ch, "fp16", scaled=True)
    bf16 = preset_scale_gradient(sd35_16ch, "bf16", scaled=False)
    fp16_unscaled = preset_scale_gradient(sd35_16ch, "fp16", scaled=False)
    zeros = {
        k: float((t == 0).double().mean())
        for k, t in [("fp32", fp32), ("fp16", fp16), ("raw", fp16_unscaled)]
    }
    # fp32 has its structural zeros: the last block's context projections feed nothing (SD3's context_pre_only)
    assert zeros["fp32"] < 0.1 and abs(zeros["fp16"] - zeros["fp32"]) < 1e-3, zeros
    assert cosine(fp16, fp32) >= 0.99, cosine(fp16, fp32)
    assert cosine(bf16, fp32) >= 0.99, cosine(bf16, fp32)
    # the underflow the scaler prevents: most entries exactly 0, the direction lost
    assert zeros["raw"] > 0.5 and cosine(fp16_unscaled, fp32) < 0.9, (
        zeros,
        cosine(fp16_unscaled, fp32),
    )


# ============================================================ the scripts under fp16, on the CPU
TOY_PROMPTS = [
    "a photo of three red squares",
    "a photo of three blue squares",
    "a photo of three green triangles",
    "a photo of three red triangles",
]


def test_fp16_learns_on_the_toy_world(tmp_path):
    """flowgrpo_baseline.py with --mixed-precision fp16 on the shipped toy model (the learning test of
    tests/test_flowgrpo_baseline.py, JPEG compressibility, in 2 iterations at twice its learning rate: fp16 trains
    about 4x slower than fp32 on a CPU): the held-out reward rises by more than 0.1 (-1.146 -> -0.929), the loss
    scale is logged, no step is skipped and, once the LoRA's B has moved off zero, no gradient entry is lost to
    underflow. With the advantages' sign flipped (after the clamp in the rollout) it falls: -1.146 -> -1.211
    (2026-12-05), so this fails when fp16 learning is broken."""
    prompts = write_prompts(tmp_path / "p.txt", TOY_PROMPTS)
    run_main(
        SCRIPT,
        *("--prompts-file", prompts, "--eval-prompts", prompts, "--eval-seeds-per-prompt", "2"),
        *("--groups-per-iteration", "2", "--group-size", "8", "--rollout-batch-size", "16"),
        *("--num-iterations", "2", "--eval-every", "2", "--num-steps", "6"),
        *("--eval-num-steps", "10", "--learning-rate", "2e-3", "--reward", "jpeg_compressibility"),
        *("--mixed-precision", "fp16", "--output-dir", str(tmp_path), "--run-name", "fp16"),
    )
    m = read_metrics(tmp_path / "fp16")
    train = [r for r in m if "train/loss_scale" in r]
    assert len(train) == 2 and sum(r["train/skipped_steps"] for r in train) == 0, train
    # at B = 0 (iteration 0) the A matrices have no gradient in any precision; after, every entry has one
    assert train[-1]["train/grad_zero_fraction"] < 0.01, [
        r["train/grad_zero_fraction"] for r in train
    ]
    with open(tmp_path / "fp16" / "args.json") as f:
        assert json.load(f)["mixed_precision"] == "fp16"
    assert m[-1]["eval/reward_mean"] > m[0]["eval/reward_mean"] + 0.1, (m[0], m[-1])


def one_iteration(path, tmp_path, monkeypatch, precision, rollout=None):
    """One Flow-GRPO iteration of flowgrpo_baseline.py at 512-px latents (16 x 64 x 64, the tiny SD3.5-shaped model
    at 128 px), CFG 4.5, 2 prompts x 2 images, 3 of 4 steps trained, no weight decay (so an entry moves only when its
    gradient is not zero), from seed 1. The script samples its own rollout; given `rollout`, the hand-over from
    rollout to training (check_transitions) takes those transitions instead, so two precisions train on the same
    states, actions, rollout log-probs and advantages. Returns the LoRA's update of B, the transitions it trained on
    and the iteration's metrics row."""
    from safetensors.torch import load_file

    import common.plumbing.transitions as transitions_module

    check = transitions_module.check_transitions
    trained = {}

    def hand_over(tr, *args, **kwargs):
        if rollout is not None:  # the script trains on the dict it handed over: replaced in place
            tr.update({k: v.clone() for k, v in rollout.items()})
        trained.update({k: v.clone() for k, v in tr.items()})
        return check(tr, *args, **kwargs)

    # the script imports the name when it runs, so it takes the patched one (it checks a run's first iteration)
    monkeypatch.setattr(transitions_module, "check_transitions", hand_over)
    prompts = write_prompts(tmp_path / "prompts.txt", PROMPTS)
    name = f"one-{precision}"
    flags = tiny_flags(path, tmp_path, prompts, name)
    flags[flags.index("--resolution") + 1] = "128"
    flags[flags.index("--num-steps") + 1] = "4"
    run_main(
        SCRIPT,
        *flags,
        *("--num-iterations", "1", "--eval-every", "100", "--eval-num-steps", "1"),
        *("--guidance-scale", "4.5", "--weight-decay", "0", "--learning-rate", "1e-3"),
        *("--lora-target", "attention", "--mixed-precision", precision),
    )
    after = load_file(
        os.path.join(tmp_path, name, "checkpoint-1", "pytorch_lora_weights.safetensors")
    )
    row = next(r for r in read_metrics(tmp_path / name) if "grad_norm" in r)
    # B starts at 0 (the adapter is a no-op), so one step's update of B is B itself; A has no gradient at B = 0
    return torch.cat([after[k].flatten() for k in sorted(after) if "lora_B" in k]), trained, row


def test_fp16_training_on_the_fp32_rollout_at_512px_latents_moves_the_lora_as_fp32_does(
    sd35_16ch, tmp_path, monkeypatch
):
    """The training section of flowgrpo_baseline.py under fp16 (with the script's loss scaling) against fp32, both
    on fp32's rollout (the same transitions and advantages, sampled once): Adam's first update moves as many entries
    (Adam moves an entry exactly when its gradient is not zero) and points the same way (cosine >= 0.99), and the
    gradient's norm after unscaling is fp32's within 2 %. Measured 2026-12-06 on an AMD EPYC (avx512_bf16, no
    avx512_fp16), with its native kernels and with them capped (.ci/run's second run): cosine 0.9985 / 0.9986, norm
    ratio 0.998 / 0.997; with the script's scaler at scale 1 (the loss not scaled) 464 / 468 of fp32's 1,792 entries
    moved, cosine 0.26 / 0.25. Before issue #67 each precision sampled its own rollout: fp16 kernels that round
    differently (another CPU's) can reorder a group's rewards, flip advantages and halve the cosine (0.51 seen)."""
    fp32, rollout, row32 = one_iteration(sd35_16ch, tmp_path, monkeypatch, "fp32")
    fp16, trained, row16 = one_iteration(sd35_16ch, tmp_path, monkeypatch, "fp16", rollout)
    # the script trained on the shared transitions (the hand-over took them)
    assert trained.keys() == rollout.keys() and all(
        torch.equal(trained[k], rollout[k]) for k in rollout
    )
    # fp16's policy gives fp32's actions log-probs within 2e-5 of fp32's (1.2e-5 measured): no ratio reaches the
    # 1e-4 clip, so both gradients are the unclipped policy gradient of the same transitions
    assert row32["clipfrac"] == row16["clipfrac"] == 0, (row32["clipfrac"], row16["clipfrac"])
    moved32, moved16 = int((fp32 != 0).sum()), int((fp16 != 0).sum())
    assert moved32 > 0.9 * fp32.numel(), (moved32, fp32.numel())
    assert abs(moved16 - moved32) <= 0.01 * moved32, (moved16, moved32)
    assert cosine(fp16, fp32) >= 0.99, cosine(fp16, fp32)
    assert abs(row16["grad_norm"] / row32["grad_norm"] - 1) < 0.02, (row16, row32)
    assert row16["train/loss_scale"] > 1 and row16["train/skipped_steps"] == 0, row16


def test_fp16_resume_is_exact_with_the_loss_scale(tiny_sd3, tmp_path, prompts_file):
    """1 + 1 = 2 iterations of an fp16 run bit-exact; the loss scaler's state (its scale and growth tracker) and its
    count of skips in a row are in every checkpoint and come back on --resume (a growth interval of 1 step makes the
    scale change every step, so a resume that lost it would not be exact)."""
    from helpers import assert_resume_is_exact

    import common.plumbing.harness

    real_start = common.plumbing.harness.Harness.start

    def start(self, optimizer, scaler=None, **kw):  # the scale doubles after every clean step
        if scaler is not None and scaler.is_enabled():
            scaler._growth_interval = 1
        return real_start(self, optimizer, scaler, **kw)

    common.plumbing.harness.Harness.start = start
    try:
        assert_resume_is_exact(
            SCRIPT,
            lambda name: tiny_flags(tiny_sd3, tmp_path, prompts_file, name),
            2,
            ["--learning-rate", "1e-2", "--eval-every", "100", "--mixed-precision", "fp16"],
        )
    finally:
        common.plumbing.harness.Harness.start = real_start
    scales = [
        torch.load(tmp_path / run / "checkpoint-2" / "trainer_state.pt", weights_only=False)[
            "loss_scaling"
        ]
        for run in ("straight", "split")
    ]
    assert scales[0] == scales[1] and scales[0]["scaler"]["scale"] == 2.0**18, (
        scales
    )  # doubled twice
    rows = [read_metrics(tmp_path / run) for run in ("straight", "split")]
    assert [r.get("train/loss_scale") for r in rows[0]] == [
        r.get("train/loss_scale") for r in rows[1]
    ]


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path / "prompts.txt", PROMPTS)


# ============================================================ skipped steps and refusals, in-process
def test_a_skipped_fp16_step_is_counted_and_only_many_in_a_row_stop_the_run(tmp_path):
    """Run.check_gradient: a non-finite gradient norm under fp16 loss scaling is the scaler's overflow: the step is
    skipped and counted, and the 20th in a row stops the run in one line; a finite one resets the run of skips and
    is counted as a step. Without loss scaling a non-finite norm stops at once. Run.after_step: the EMA follows a
    step taken, never a skipped one."""
    from types import SimpleNamespace

    from common.plumbing.run import MAX_SKIPS_IN_A_ROW, NonFiniteUpdate, Run, Stats

    ema = SimpleNamespace(updates=0)
    ema.update = lambda: setattr(ema, "updates", ema.updates + 1)
    run = SimpleNamespace(
        scaler=torch.amp.GradScaler("cpu"), skips_in_a_row=0, params={}, iteration=3, ema=ema
    )
    inf, one = torch.tensor(float("inf")), torch.tensor(1.0)
    stats = Stats(1)
    for _ in range(MAX_SKIPS_IN_A_ROW - 1):
        Run.check_gradient(run, inf, stats)
        Run.after_step(run, inf)
    assert stats.totals == {"skipped_steps": MAX_SKIPS_IN_A_ROW - 1} and ema.updates == 0
    Run.check_gradient(run, one, stats)
    assert run.skips_in_a_row == 0 and stats.totals["optimizer_steps"] == 1
    for _ in range(MAX_SKIPS_IN_A_ROW - 1):
        Run.check_gradient(run, inf, stats)
    run.iteration = 4
    with pytest.raises(NonFiniteUpdate, match=r"non-finite gradient in 20 fp16 steps in a row"):
        Run.check_gradient(run, inf, stats)
    run.scaler, run.iteration = torch.amp.GradScaler("cpu", enabled=False), 5
    with pytest.raises(NonFiniteUpdate, match="non-finite loss or gradient at iteration 5"):
        Run.check_gradient(run, inf, stats)


def test_the_zero_fraction_counts_what_underflowed():
    """train/grad_zero_fraction's counts: exact zeros in the gradient, a weight without one counted whole."""
    from common.plumbing.run import gradient_zeros

    a, b = torch.zeros(4, requires_grad=True), torch.zeros(6, requires_grad=True)
    a.grad = torch.tensor([0.0, 1.0, 0.0, 2.0])
    assert gradient_zeros([a, b]) == (8, 10)


def test_fp16_without_a_loss_scaler_is_refused_before_training(tmp_path):
    """A fork that builds no GradScaler (or a disabled one) for an fp16 model is stopped by Harness.start in one
    line, before the first step: its gradients would underflow silently."""
    from types import SimpleNamespace

    from common.plumbing.checks import ConfigError
    from common.plumbing.harness import Harness

    h = SimpleNamespace(
        args=None, backbone=SimpleNamespace(dtype=torch.float16), device=torch.device("cpu")
    )
    for scaler in (None, torch.amp.GradScaler("cpu", enabled=False)):
        with pytest.raises(ConfigError, match="fp16 without loss scaling"):
            Harness.start(h, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), scaler)


@pytest.mark.parametrize(
    "precision,device,expect",
    [
        ("auto", "cpu", "fp32"),
        ("auto", "cuda", "bf16"),
        ("fp16", "cpu", "fp16"),
        ("bf16", "cpu", "bf16"),
    ],
)
def test_auto_precision_is_bf16_on_cuda_and_fp32_on_cpu_and_an_explicit_one_is_kept(
    precision, device, expect
):
    from common.backbones import resolve_precision

    assert resolve_precision(precision, torch.device(device)) == expect


def test_an_explicit_precision_is_honoured_on_the_cpu(tiny_sd3):
    """bf16 and fp16 on the CPU are real (slow, but the path a GPU run takes): the transformer and text encoders hold
    that dtype, the VAE stays fp32, and decoding in chunks gives the images of one call (to float rounding: a
    convolution's kernel may sum in another order at another batch size: 1.1e-6 seen on one thread; images out of
    order or a lost chunk would differ by tenths)."""
    for precision, dtype in (
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("fp32", torch.float32),
    ):
        bb = load_backbone(
            tiny_sd3, "cpu", precision=precision, max_sequence_length=8, decode_batch_size=2
        )
        assert bb.dtype == next(bb.transformer.parameters()).dtype == dtype
        assert next(bb.pipe.vae.parameters()).dtype == torch.float32
    latents = torch.randn(5, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    chunked = bb.decode(latents, 64, 64)
    bb.decode_batch_size = 5
    torch.testing.assert_close(chunked, bb.decode(latents, 64, 64), rtol=0, atol=1e-5)
