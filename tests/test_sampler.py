"""Tests for common/sampler.py: each one recomputes the math independently, so a wrong formula fails."""

import math
import pathlib
import sys

import numpy as np
import pytest
import torch

# repo root, for `import common`
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402

from common.sampler import (  # noqa: E402
    dpm2_step,
    gaussian_kl,
    ode_along_paths,
    ode_step,
    ratio_norm,
    sde_step_with_logprob,
    sigma_schedule,
    static_shift_schedule,
    x0_prediction,
)

SHAPE = (3, 4, 5, 6)  # [B, C, H, W]
DIMS = (1, 2, 3)


def _inputs(seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)  # velocity, sample


def _reference_step(v, x, sigma, sigma_next, a):
    """Flow-GRPO mean and std written out from the formulas, for sigma < 1, broadcast per sample."""
    s = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1, 1, 1)
    sn = torch.as_tensor(sigma_next, dtype=torch.float32).reshape(-1, 1, 1, 1)
    a = torch.as_tensor(a, dtype=torch.float32).reshape(-1, 1, 1, 1)
    dt = sn - s
    std_dev_t = a * torch.sqrt(s / (1 - s))
    mean = x + v * dt + std_dev_t**2 / (2 * s) * (x + (1 - s) * v) * dt
    return mean, std_dev_t, std_dev_t * torch.sqrt(-dt)


# --------------------------------------------------------------------------- SDE step


def test_log_prob_matches_torch_normal():
    v, x = _inputs()
    sigma, sigma_next, a = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.45, 0.1]), 0.7
    mean_ref, std_ref, step_std = _reference_step(v, x, sigma, sigma_next, a)

    prev, log_prob, mean, std_dev_t = sde_step_with_logprob(v, x, sigma, sigma_next, a)
    assert log_prob.shape == (3,)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std_dev_t, std_ref)
    expected = torch.distributions.Normal(mean_ref, step_std).log_prob(prev).mean(DIMS)
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-5)

    # Scoring a given next sample (what training does) uses that sample, not a fresh draw.
    other = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    prev2, log_prob2, _, _ = sde_step_with_logprob(v, x, sigma, sigma_next, a, prev_sample=other)
    assert torch.equal(prev2, other)
    expected2 = torch.distributions.Normal(mean_ref, step_std).log_prob(other).mean(DIMS)
    torch.testing.assert_close(log_prob2, expected2, rtol=1e-5, atol=1e-5)


def test_sampling_uses_generator_and_step_std():
    v, x = _inputs()
    sigma, sigma_next, a = 0.6, 0.5, 0.7
    mean_ref, _, step_std = _reference_step(v, x, sigma, sigma_next, a)
    prev, _, _, _ = sde_step_with_logprob(
        v, x, sigma, sigma_next, a, generator=torch.Generator().manual_seed(3)
    )
    eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(prev, mean_ref + step_std * eps, rtol=1e-5, atol=1e-6)

    # A list of generators seeds each sample on its own, as diffusers' randn_tensor does.
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    prev, _, _, _ = sde_step_with_logprob(v, x, sigma, sigma_next, a, generator=gens)
    for i in range(3):
        eps_i = torch.randn((1, *SHAPE[1:]), generator=torch.Generator().manual_seed(10 + i))
        torch.testing.assert_close(
            prev[i : i + 1], mean_ref[i : i + 1] + step_std * eps_i, rtol=1e-5, atol=1e-6
        )


def test_gradient_flows_through_mean_only():
    """prev_sample is treated as data: d log_prob / dv comes from the mean alone, even when just sampled."""
    v, x = _inputs()
    v.requires_grad_(True)
    prev, log_prob, _, _ = sde_step_with_logprob(
        v, x, 0.7, 0.6, 0.7, generator=torch.Generator().manual_seed(0)
    )
    (grad,) = torch.autograd.grad(log_prob.sum(), v)
    mean_ref, _, step_std = _reference_step(v, x, 0.7, 0.6, 0.7)
    expected_lp = torch.distributions.Normal(mean_ref, step_std).log_prob(prev.detach()).mean(DIMS)
    (expected,) = torch.autograd.grad(expected_lp.sum(), v)
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "sigma, sigma_next, sigma_max",
    [(0.7, 0.6, None), (1.0, 0.96, None), (1.0, 0.96, 0.96), (0.01, 0.0, None), (0.0, 0.0, None)],
)
def test_noise_zero_is_exact_euler(sigma, sigma_next, sigma_max):
    v, x = _inputs()
    dt = torch.tensor(sigma_next, dtype=torch.float32) - torch.tensor(sigma, dtype=torch.float32)
    euler = x + dt * v
    prev, log_prob, mean, std_dev_t = sde_step_with_logprob(
        v,
        x,
        sigma,
        sigma_next,
        0.0,
        generator=torch.Generator().manual_seed(0),
        sigma_max=sigma_max,
    )
    for t in (prev, log_prob, mean, std_dev_t):
        assert torch.isfinite(t).all()
    assert torch.equal(prev, euler) and torch.equal(mean, euler)
    assert torch.equal(prev, ode_step(v, x, sigma, sigma_next))
    assert torch.equal(log_prob, torch.zeros(3)) and torch.all(std_dev_t == 0)


def test_mixed_per_sample_noise_at_sigma_one():
    """Sample 0 is deterministic (noise 0), sample 1 noisy; both start at sigma = 1."""
    v, x = _inputs(shape=(2, 4, 5, 6))
    sched = sigma_schedule(10, 3.0)
    prev, log_prob, _, std_dev_t = sde_step_with_logprob(
        v,
        x,
        1.0,
        sched[1],
        torch.tensor([0.0, 0.7]),
        sigma_max=sched[1],
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.isfinite(prev).all() and torch.isfinite(log_prob).all()
    assert torch.equal(prev[0], ode_step(v, x, 1.0, sched[1])[0])
    assert log_prob[0] == 0 and log_prob[1] != 0
    assert std_dev_t.flatten()[0] == 0 and std_dev_t.flatten()[1] > 0


def test_sigma_one_uses_sigma_max():
    v, x = _inputs()
    sched = sigma_schedule(10, 3.0)
    sigma_max = sched[1].item()
    assert sigma_max == pytest.approx(0.9601, abs=1e-4)
    _, _, _, std_dev_t = sde_step_with_logprob(v, x, 1.0, sigma_max, 0.7, sigma_max=sigma_max)
    assert torch.isfinite(std_dev_t).all()
    assert std_dev_t.item() == pytest.approx(0.7 * math.sqrt(1 / (1 - sigma_max)), rel=1e-5)
    assert std_dev_t.item() == pytest.approx(3.51, abs=0.01)
    # This choice makes the first step's std exactly noise_level: std_dev_t * sqrt(1 - sigma_max) = 0.7.
    assert (std_dev_t * math.sqrt(1 - sigma_max)).item() == pytest.approx(0.7, rel=1e-5)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step_with_logprob(v, x, 1.0, sigma_max, 0.7)


def test_bf16_inputs_give_fp32_outputs():
    v, x = _inputs()
    v16, x16 = v.bfloat16(), x.bfloat16()
    gen = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    out16 = sde_step_with_logprob(v16, x16, 0.8, 0.7, 0.7, generator=gen())
    out32 = sde_step_with_logprob(v, x, 0.8, 0.7, 0.7, generator=gen())
    exact = sde_step_with_logprob(v16.float(), x16.float(), 0.8, 0.7, 0.7, generator=gen())
    for a, b, c in zip(out16, out32, exact):
        assert a.dtype == torch.float32
        assert torch.equal(a, c)  # the math itself runs in fp32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert ode_step(v16, x16, 0.8, 0.7).dtype == torch.float32
    assert x0_prediction(v16, x16, 0.8).dtype == torch.float32


def test_per_sample_tensors_equal_loop_over_floats():
    v, x = _inputs()
    other = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    sched = sigma_schedule(10, 3.0)
    sigma, sigma_next, a = sched[[0, 4, 8]], sched[[1, 5, 9]], torch.tensor([0.7, 0.0, 0.9])
    _, log_prob, mean, std_dev_t = sde_step_with_logprob(
        v, x, sigma, sigma_next, a, prev_sample=other, sigma_max=sched[1]
    )
    ode, x0 = ode_step(v, x, sigma, sigma_next), x0_prediction(v, x, sigma)
    for i in range(3):
        sl = slice(i, i + 1)
        _, lp_i, mean_i, std_i = sde_step_with_logprob(
            v[sl],
            x[sl],
            sigma[i].item(),
            sigma_next[i].item(),
            a[i].item(),
            prev_sample=other[sl],
            sigma_max=sched[1].item(),
        )
        torch.testing.assert_close(log_prob[sl], lp_i)
        torch.testing.assert_close(mean[sl], mean_i)
        torch.testing.assert_close(std_dev_t.flatten()[i], std_i.flatten()[0])
        torch.testing.assert_close(
            ode[sl], ode_step(v[sl], x[sl], sigma[i].item(), sigma_next[i].item())
        )
        torch.testing.assert_close(x0[sl], x0_prediction(v[sl], x[sl], sigma[i].item()))
    # 0-dim tensors behave like floats.
    out0 = sde_step_with_logprob(
        v, x, torch.tensor(0.5), torch.tensor(0.4), torch.tensor(0.7), prev_sample=other
    )
    outf = sde_step_with_logprob(v, x, 0.5, 0.4, 0.7, prev_sample=other)
    for a0, af in zip(out0, outf):
        torch.testing.assert_close(a0, af)


def test_x0_prediction_recovers_data():
    g = torch.Generator().manual_seed(0)
    x0, eps, sigma = (
        torch.randn(SHAPE, generator=g),
        torch.randn(SHAPE, generator=g),
        torch.tensor([0.1, 0.5, 0.9]),
    )
    s = sigma.reshape(-1, 1, 1, 1)
    torch.testing.assert_close(
        x0_prediction(eps - x0, (1 - s) * x0 + s * eps, sigma), x0, rtol=1e-5, atol=1e-5
    )


# --------------------------------------------------------------------------- CPS step (E6)


def _reference_cps(v, x, sigma, sigma_next, a):
    """CPS mean and std written out, with sqrt(sigma_next^2 - s^2) = sigma_next cos(a pi / 2)."""
    s = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1, 1, 1)
    sn = torch.as_tensor(sigma_next, dtype=torch.float32).reshape(-1, 1, 1, 1)
    a = torch.as_tensor(a, dtype=torch.float32).reshape(-1, 1, 1, 1)
    x0, x1 = x - s * v, x + (1 - s) * v
    return (1 - sn) * x0 + sn * torch.cos(a * math.pi / 2) * x1, sn * torch.sin(a * math.pi / 2)


def test_cps_step_matches_formulas_and_released_log_prob():
    v, x = _inputs()
    sigma, sigma_next, a = torch.tensor([1.0, 0.5, 0.2]), torch.tensor([0.9, 0.45, 0.1]), 0.8
    mean_ref, std_ref = _reference_cps(v, x, sigma, sigma_next, a)
    prev, log_prob, mean, std = sde_step_with_logprob(
        v, x, sigma, sigma_next, a, sde_type="cps", generator=torch.Generator().manual_seed(3)
    )
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-6)
    # the step std itself: no sqrt|dt| factor, finite at sigma = 1
    torch.testing.assert_close(std, std_ref)
    eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(prev, mean_ref + std_ref * eps, rtol=1e-5, atol=1e-6)
    assert log_prob.shape == (3,) and torch.isfinite(log_prob).all()
    # released
    torch.testing.assert_close(log_prob, -((prev - mean_ref) ** 2).mean(DIMS), rtol=1e-5, atol=1e-6)
    # Scoring a stored step under another policy: the released log-ratio is 2 s^2 times the exact Gaussian one
    # (the dropped -log s - log sqrt(2 pi) cancels, the dropped 1 / (2 s^2) does not).
    v_new = v + 0.1 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(4))
    lp_new = sde_step_with_logprob(
        v_new, x, sigma, sigma_next, a, prev_sample=prev, sde_type="cps"
    )[1]
    mean_new, _ = _reference_cps(v_new, x, sigma, sigma_next, a)
    normal = lambda m: torch.distributions.Normal(m, std_ref).log_prob(prev).mean(DIMS)  # noqa: E731
    torch.testing.assert_close(
        lp_new - log_prob,
        2 * std_ref.flatten() ** 2 * (normal(mean_new) - normal(mean_ref)),
        rtol=1e-3,
        atol=1e-6,
    )
    # the same v scores its own sample to the same number: ratio exactly 1
    assert torch.equal(
        sde_step_with_logprob(v, x, sigma, sigma_next, a, prev_sample=prev, sde_type="cps")[1],
        log_prob,
    )
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(v, x, 0.5, 0.4, 0.8, sde_type="ddim")


@pytest.mark.parametrize("sigma, sigma_next", [(0.7, 0.6), (1.0, 0.96), (0.01, 0.0), (0.0, 0.0)])
def test_cps_noise_zero_is_exact_euler(sigma, sigma_next):
    v, x = _inputs()
    prev, log_prob, mean, std = sde_step_with_logprob(
        v, x, sigma, sigma_next, 0.0, sde_type="cps", generator=torch.Generator().manual_seed(0)
    )
    euler = ode_step(v, x, sigma, sigma_next)
    assert torch.equal(prev, euler) and torch.equal(mean, euler)
    assert torch.equal(log_prob, torch.zeros(3)) and torch.all(std == 0)


def test_cps_per_sample_noise_levels():
    """Rows with a = 0 (Euler), 0.8 and 1 (all of sigma_next fresh noise: mean = (1 - sigma_next) x0_hat), at sigma = 1."""
    v, x = _inputs()
    a = torch.tensor([0.0, 0.8, 1.0])
    prev, log_prob, mean, std = sde_step_with_logprob(
        v, x, 1.0, 0.9, a, sde_type="cps", generator=torch.Generator().manual_seed(0)
    )
    for t in (prev, log_prob, mean, std):
        assert torch.isfinite(t).all()
    assert (
        torch.equal(prev[0], ode_step(v, x, 1.0, 0.9)[0]) and log_prob[0] == 0 and log_prob[1] < 0
    )
    torch.testing.assert_close(mean[2], 0.1 * x0_prediction(v, x, 1.0)[2])
    torch.testing.assert_close(std.flatten(), 0.9 * torch.sin(a * math.pi / 2))


def test_cps_gradient_flows_through_mean_only():
    v, x = _inputs()
    v.requires_grad_(True)
    prev, log_prob, _, _ = sde_step_with_logprob(
        v, x, 0.7, 0.6, 0.8, sde_type="cps", generator=torch.Generator().manual_seed(0)
    )
    (grad,) = torch.autograd.grad(log_prob.sum(), v)
    mean_ref, _ = _reference_cps(v, x, 0.7, 0.6, 0.8)
    (expected,) = torch.autograd.grad(-((prev.detach() - mean_ref) ** 2).mean(DIMS).sum(), v)
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def test_gaussian_kl_is_exact_for_cps():
    """With CPS's std_dev_t (the step std), gaussian_kl is the per-element mean of the exact KL of the step Gaussians."""
    v, x = _inputs()
    v_ref = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9))
    sigma, sigma_next = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.45, 0.1])
    _, _, mean, std = sde_step_with_logprob(
        v, x, sigma, sigma_next, 0.8, sde_type="cps", prev_sample=x
    )
    _, _, mean_ref, _ = sde_step_with_logprob(
        v_ref, x, sigma, sigma_next, 0.8, sde_type="cps", prev_sample=x
    )
    p, q = torch.distributions.Normal(mean, std), torch.distributions.Normal(mean_ref, std)
    torch.testing.assert_close(
        gaussian_kl(mean, mean_ref, std), torch.distributions.kl_divergence(p, q).mean(DIMS)
    )


# --------------------------------------------------------------------------- KL


def test_gaussian_kl():
    g = torch.Generator().manual_seed(0)
    mean, mean_ref = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    std = torch.tensor([0.5, 1.0, 2.0])
    assert torch.equal(gaussian_kl(mean, mean, std), torch.zeros(3))
    expected = ((mean - mean_ref) ** 2).mean(DIMS) / (2 * std**2)
    torch.testing.assert_close(gaussian_kl(mean, mean_ref, std), expected)
    # as returned
    torch.testing.assert_close(gaussian_kl(mean, mean_ref, std.reshape(-1, 1, 1, 1)), expected)
    torch.testing.assert_close(
        gaussian_kl(mean, mean_ref, 0.5), ((mean - mean_ref) ** 2).mean(DIMS) / 0.5
    )
    # It is the per-element average of the exact Gaussian KL with std std_dev_t (the code's convention).
    p = torch.distributions.Normal(mean, std.reshape(-1, 1, 1, 1))
    q = torch.distributions.Normal(mean_ref, std.reshape(-1, 1, 1, 1))
    torch.testing.assert_close(
        gaussian_kl(mean, mean_ref, std), torch.distributions.kl_divergence(p, q).mean(DIMS)
    )


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("num_steps", [1, 2, 10, 16, 28, 40])
@pytest.mark.parametrize("shift", [1.0, 2.5, 3.0, 5.0])
def test_sigma_schedule_matches_diffusers_sd3(num_steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)  # what StableDiffusion3Pipeline does (no sigmas, no mu)
    ours = sigma_schedule(num_steps, shift)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert ours[0] == 1 and ours[-1] == 0
    assert torch.allclose(ours, scheduler.sigmas, atol=1e-6, rtol=0)


@pytest.mark.parametrize("num_steps", [1, 4, 16, 28, 50])
@pytest.mark.parametrize("image_seq_len", [64, 256, 1024, 4096, 6400])
def test_sigma_schedule_matches_diffusers_flux(num_steps, image_seq_len):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    mu = calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)
    # what FluxPipeline passes
    scheduler.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    ours = sigma_schedule(num_steps, image_seq_len=image_seq_len)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,) and ours[-1] == 0
    assert torch.allclose(ours, scheduler.sigmas, atol=1e-6, rtol=0)


# The released G2RPO / DanceGRPO grid, T = 16, shift 3, by hand: sigma_i = 3 s / (1 + 2 s) with s = 1 - i/16, e.g.
# sigma_7 = (27/16) / (34/16) = 27/34 (the reference's table: 1.0, .9783, .9545, ..., .3, .1667, 0).
OFFICIAL_16 = [
    1,
    45 / 46,
    42 / 44,
    39 / 42,
    36 / 40,
    33 / 38,
    30 / 36,
    27 / 34,
    24 / 32,
    21 / 30,
    18 / 28,
    15 / 26,
    12 / 24,
    9 / 22,
    6 / 20,
    3 / 18,
    0,
]


def test_static_shift_schedule_is_the_released_g2rpo_grid():
    ours = static_shift_schedule(16, 3.0)
    assert ours.dtype == torch.float32 and ours.shape == (17,)
    torch.testing.assert_close(
        ours, torch.tensor(OFFICIAL_16, dtype=torch.float32), atol=1e-7, rtol=0
    )
    assert round(float(ours[7]), 3) == 0.794
    # not the pipeline grids: FLUX at 720 px (45 x 45 packed tokens) and SD3's shifted-twice linspace
    assert round(float(sigma_schedule(16, image_seq_len=45 * 45)[7]), 3) == 0.741
    assert not torch.allclose(sigma_schedule(16, 3.0), ours, atol=1e-3)
    # no shift
    torch.testing.assert_close(static_shift_schedule(4, 1.0), torch.tensor([1, 0.75, 0.5, 0.25, 0]))
    with pytest.raises(ValueError, match="positive"):
        static_shift_schedule(16, 0.0)


# --------------------------------------------------------------------------- marginal preservation
#
# Data x0 ~ N(M, S^2) in 1-D, eps ~ N(0, 1), x_t = (1 - t) x0 + t eps. Then x_t ~ N(mu_t, V_t) with
# mu_t = (1 - t) M, V_t = (1 - t)^2 S^2 + t^2, Cov(x0, x_t) = (1 - t) S^2, Cov(eps, x_t) = t, so by
# Gaussian conditioning
#   E[x0 | x_t]  = M + (1 - t) S^2 / V_t (x_t - mu_t),   E[eps | x_t] = t / V_t (x_t - mu_t),
#   v*(x_t, t)   = E[eps - x0 | x_t] = -M + (t - (1 - t) S^2) / V_t (x_t - mu_t).
# With this exact velocity both the ODE and the SDE must carry N(0, 1) at t = 1 to N(M, S^2) at t = 0.

M, S, N = 1.5, 0.5, 20_000


def _true_velocity(x, t):
    var = (1 - t) ** 2 * S**2 + t**2
    return -M + (t - (1 - t) * S**2) / var * (x - (1 - t) * M)


def _run_chain(step, num_steps, shift, seed=0):
    g = torch.Generator().manual_seed(seed)
    sched = sigma_schedule(num_steps, shift)
    x = torch.randn(N, 1, generator=g)
    for i in range(num_steps):
        s, s_next = sched[i].item(), sched[i + 1].item()
        x = step(_true_velocity(x, s), x, s, s_next, sched[1].item(), g)
    return x.mean().item(), x.var().item()


def _sde(v, x, s, s_next, sigma_max, g):
    return sde_step_with_logprob(v, x, s, s_next, 0.7, generator=g, sigma_max=sigma_max)[0]


def _ode(v, x, s, s_next, sigma_max, g):
    return ode_step(v, x, s, s_next)


def _sde_without_correction(v, x, s, s_next, sigma_max, g):
    """The common mistake: Euler drift v plus noise, without the score term that compensates the noise."""
    std_dev_t = sde_step_with_logprob(v, x, s, s_next, 0.7, sigma_max=sigma_max, prev_sample=x)[3]
    return ode_step(v, x, s, s_next) + std_dev_t * math.sqrt(s - s_next) * torch.randn(
        x.shape, generator=g
    )


def _sde_double_correction(v, x, s, s_next, sigma_max, g):
    """Score term twice as strong: shrinks the distribution."""
    _, _, mean, std_dev_t = sde_step_with_logprob(
        v, x, s, s_next, 0.7, sigma_max=sigma_max, prev_sample=x
    )
    mean = 2 * mean - ode_step(v, x, s, s_next)
    return mean + std_dev_t * math.sqrt(s - s_next) * torch.randn(x.shape, generator=g)


# Euler(-Maruyama) is first order: with these step counts the variance bias is < 0.01 (measured with
# 400k particles: ODE 0.243 / SDE 0.250 at (100, 1.0); 0.243 / 0.246 at (200, 3.0)).
TOL_MEAN = 4 * S / math.sqrt(N) + 0.005
TOL_VAR = 4 * S**2 * math.sqrt(2 / N) + 0.01


@pytest.mark.parametrize("num_steps, shift", [(100, 1.0), (200, 3.0)])
@pytest.mark.parametrize("step", [_sde, _ode], ids=["sde", "ode"])
def test_marginals_preserved(step, num_steps, shift):
    mean, var = _run_chain(step, num_steps, shift)
    assert abs(mean - M) < TOL_MEAN, mean
    assert abs(var - S**2) < TOL_VAR, var


@pytest.mark.parametrize("wrong_step", [_sde_without_correction, _sde_double_correction])
def test_marginal_check_detects_wrong_drift(wrong_step):
    _, var = _run_chain(wrong_step, 100, 1.0)
    assert abs(var - S**2) > 5 * TOL_VAR, var


# CPS (E6) keeps something else than the SDE: the coefficients of the forward process given x0. Write the state as
# x = (1 - sigma) x0 + sigma r. With the oracle velocity v = (x - x0) / sigma (x0 known, as for one training image),
# (E6) gives r' = [sqrt(sigma'^2 - s^2) r + s z] / sigma': Var r' = Var r = 1 and r' independent of x0, at every step
# count and noise level, and the last step (sigma' = 0, s = 0) lands on x0 exactly. The SDE step (E3) keeps this only
# to first order in dt: at 10 steps its r has variance 1.66 at sigma' = 0.278 and its image keeps noise of std 0.06
# around x0 (a = 0.7), the excess noise the CPS paper is about.
N_ORACLE = 20_000
TOL_R = 4 * math.sqrt(2 / N_ORACLE) + 0.01


def _oracle_chain(step, a, num_steps=10, shift=3.0, seed=0):
    """Per step (sigma', Var r, corr(r, x0)) and the final |x - x0| of the chain driven by the oracle velocity."""
    g = torch.Generator().manual_seed(seed)
    sched = sigma_schedule(num_steps, shift)
    x0 = M + S * torch.randn(N_ORACLE, 1, generator=g)
    x, out = torch.randn(N_ORACLE, 1, generator=g), []
    for i in range(num_steps):
        s, s_next = sched[i].item(), sched[i + 1].item()
        x = step((x - x0) / s, x, s, s_next, a, sched[1].item(), g)
        if s_next > 0:
            r = (x - (1 - s_next) * x0) / s_next
            out.append(
                (s_next, r.var().item(), torch.corrcoef(torch.cat([r, x0], 1).T)[0, 1].item())
            )
    return out, (x - x0).abs().max().item()


def _cps_step(v, x, s, s_next, a, sigma_max, g):
    return sde_step_with_logprob(v, x, s, s_next, a, generator=g, sde_type="cps")[0]


def _cps_wrong_coefficient(v, x, s, s_next, a, sigma_max, g):
    """sqrt(sigma'^2 - s^2) written as sigma': the DDIM step plus fresh noise on top, s^2 too much at every step."""
    std = s_next * math.sin(a * math.pi / 2)
    return (
        (1 - s_next) * (x - s * v)
        + s_next * (x + (1 - s) * v)
        + std * torch.randn(x.shape, generator=g)
    )


def _sde_step(v, x, s, s_next, a, sigma_max, g):
    return sde_step_with_logprob(v, x, s, s_next, a, generator=g, sigma_max=sigma_max)[0]


@pytest.mark.parametrize("a", [0.3, 0.8, 1.0])
def test_cps_preserves_the_forward_coefficients(a):
    steps, final_err = _oracle_chain(_cps_step, a)
    for s_next, var, corr in steps:
        assert abs(var - 1) < TOL_R and abs(corr) < 0.04, (a, s_next, var, corr)
    assert final_err < 1e-5  # the last step (s = 0) is x0_hat = x0


@pytest.mark.parametrize(
    "wrong, a", [(_cps_wrong_coefficient, 0.8), (_sde_step, 0.7)], ids=["cps-wrong", "sde"]
)
def test_coefficient_check_detects_excess_noise(wrong, a):
    steps, final_err = _oracle_chain(wrong, a)
    assert max(abs(var - 1) for _, var, _ in steps) > 5 * TOL_R, steps
    if wrong is _sde_step:  # the SDE's image keeps noise around x0 (std 0.06 at a = 0.7)
        assert final_err > 0.1


def _cps_chain_exact(a, num_steps, shift):
    """Mean and variance of the CPS chain on the 1-D Gaussian data above, propagated in closed form: every step is
    affine in x under the exact velocity, x' = A x + B + noise of variance C. Independent of sde_step_with_logprob."""
    sched = sigma_schedule(num_steps, shift).double().tolist()
    mu, var = 0.0, 1.0
    for t, tn in zip(sched[:-1], sched[1:]):
        k = (t - (1 - t) * S**2) / ((1 - t) ** 2 * S**2 + t**2)
        vA, vB = k, -M - k * (1 - t) * M  # v = vA x + vB
        s = tn * math.sin(a * math.pi / 2)
        c = math.sqrt(max(tn**2 - s**2, 0.0))
        A, B, C = (
            (1 - tn) * (1 - t * vA) + c * (1 + (1 - t) * vA),
            -(1 - tn) * t * vB + c * (1 - t) * vB,
            s**2,
        )
        mu, var = A * mu + B, A * A * var + C
    return mu, var


@pytest.mark.parametrize("num_steps, shift", [(10, 3.0), (100, 1.0)])
def test_cps_with_the_exact_velocity_shrinks_the_marginal(num_steps, shift):
    """Unlike the SDE (test_marginals_preserved), CPS does not carry N(0, 1) to the data N(M, S^2) under the exact
    velocity: it plugs the posterior mean x0_hat into a step that, at fixed a, redraws a fixed share of the noise at
    every step however small, and x0_hat has less spread than x0. The variance shrinks, more with more steps (closed
    form, a = 0.8: 0.095 at 10 steps and shift 3, 0.156 at 100 steps, 0.162 at 1000, against 0.129 / 0.243 / 0.249 for
    the Euler ODE and S^2 = 0.25); the mean stays M. The sampled chain matches that closed form."""
    mean, var = _run_chain(
        lambda v, x, s, sn, smax, g: _cps_step(v, x, s, sn, 0.8, smax, g), num_steps, shift
    )
    mu_exact, var_exact = _cps_chain_exact(0.8, num_steps, shift)
    assert abs(mean - M) < TOL_MEAN and abs(mu_exact - M) < 1e-9
    assert abs(var - var_exact) < TOL_VAR, (var, var_exact)
    assert var_exact < S**2 - 0.08


# --------------------------------------------------------------------------- ODE along per-row paths


def _row_velocity(calls):
    """A fake model whose output depends nonlinearly on the row's state, its sigma and its row id; counts rows."""

    def velocity(x, sigma, rows):
        calls.append(len(x))
        s = sigma.reshape(-1, 1, 1, 1)
        return torch.tanh(x) * (1 + s) + 0.1 * rows.to(torch.float32).reshape(-1, 1, 1, 1) * s**2

    return velocity


def _paths(seed=0, n=11):
    """Rows with paths of 1 (nothing to do) to 6 points: sub-grids of a 10-step schedule, ending at 0."""
    g = torch.Generator().manual_seed(seed)
    grid = sigma_schedule(10, 3.0)
    out = []
    for _ in range(n):
        k = int(torch.randint(0, 11, (1,), generator=g))
        idx = sorted(set([k, 10] + torch.randint(k, 11, (4,), generator=g).tolist()))
        out.append(grid[idx])
    return out


@pytest.mark.parametrize("batch_size", [1, 4, 64])
@pytest.mark.parametrize("reuse", [False, True])
def test_ode_along_paths_equals_rows_one_by_one(batch_size, reuse):
    paths = _paths()
    # the edge cases are in there
    assert min(len(p) for p in paths) == 1 and max(len(p) for p in paths) >= 5
    x = torch.randn(len(paths), 2, 3, 3, generator=torch.Generator().manual_seed(1))
    first = (
        _row_velocity([])(x, torch.stack([p[0] for p in paths]), torch.arange(len(paths)))
        if reuse
        else None
    )
    calls = []
    out, nfe, n_calls = ode_along_paths(
        _row_velocity(calls), x, paths, batch_size, first_velocity=first
    )
    for m, p in enumerate(
        paths
    ):  # the reference: row m alone, scalar sigmas, plain Euler steps (E1)
        y = x[m : m + 1]
        for a, b in zip(p[:-1], p[1:]):
            y = y + (b - a) * _row_velocity([])(y, a.reshape(1), torch.tensor([m]))
        torch.testing.assert_close(out[m : m + 1], y, rtol=1e-6, atol=1e-6)
    steps = sum(len(p) - 1 for p in paths)
    reused = sum(len(p) > 1 for p in paths) if reuse else 0
    assert nfe == sum(calls) == steps - reused  # a reused first step costs no evaluation
    assert n_calls == len(calls) and max(calls) <= batch_size
    # the staircase keeps calls full
    assert n_calls <= -(-nfe // batch_size) + max(len(p) for p in paths)


def test_ode_along_paths_fills_calls_longest_first():
    """16 rows of 1, 2, 3 and 4 steps (in that order) in batches of 8: longest first makes 5 full calls; in row
    order the short rows would go first and the last 4-step rows would run alone (6 calls)."""
    grid = sigma_schedule(4, 3.0)
    paths = [grid[k:] for k in (3, 2, 1, 0) for _ in range(4)]
    calls = []
    ode_along_paths(_row_velocity(calls), torch.zeros(16, 1, 1, 1), paths, 8)
    assert sum(calls) == 40 and calls == [8, 8, 8, 8, 8]


# ---- GRPO-Guard's RatioNorm (E7)
def _step(
    mu_shift: float,
    sigma: float,
    sigma_next: float,
    a: float = 0.7,
    n: int = 4096,
    d: int = 64,
    seed: int = 0,
):
    """A stored SDE action from the rollout policy (velocity v_old) scored by a policy whose velocity moved by
    mu_shift / |dt| (so its step mean moved by about mu_shift). Returns (log r, mean, old mean, std_dev_t)."""
    g = torch.Generator().manual_seed(seed)
    x, v_old = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    x_next, lp_old, mu_old, _ = sde_step_with_logprob(
        v_old, x, sigma, sigma_next, a, generator=g, sigma_max=0.96
    )
    v_new = v_old + mu_shift / (sigma - sigma_next) * torch.randn(n, d, generator=g)
    _, lp_new, mu_new, std = sde_step_with_logprob(
        v_new, x, sigma, sigma_next, a, prev_sample=x_next, sigma_max=0.96
    )
    return lp_new - lp_old, mu_new, mu_old, std


def test_ratio_norm_is_one_on_policy_and_scales_the_gradient_by_the_step_std():
    """On-policy (the policy that sampled) the normalised ratio is exactly 1 and so the clipped loss -A r equals the
    unnormalised one; its gradient is s = std_dev_t sqrt|dt| times the raw log-ratio's (the bias has zero gradient
    at dmu = 0)."""
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(8, 4, 6, 6, generator=g), torch.randn(8, 4, 6, 6, generator=g)
    sigma, sigma_next = torch.full((8,), 0.79), torch.full((8,), 0.71)
    x_next, lp_old, mu_old, _ = sde_step_with_logprob(
        v, x, sigma, sigma_next, 0.7, generator=g, sigma_max=0.96
    )
    w = torch.ones(1, requires_grad=True)  # a stand-in parameter: the policy's velocity is w * v
    _, lp, mu, std = sde_step_with_logprob(
        w * v, x, sigma, sigma_next, 0.7, prev_sample=x_next, sigma_max=0.96
    )
    raw = lp - lp_old
    normed = ratio_norm(raw, mu, mu_old, std, sigma, sigma_next)
    # ratio exactly 1
    assert torch.equal(raw, torch.zeros(8)) and torch.equal(normed, torch.zeros(8))
    adv = torch.randn(8, generator=g)
    # the loss at ratio 1 is the same
    assert torch.equal(-adv * torch.exp(normed), -adv * torch.exp(raw))
    (g_raw,) = torch.autograd.grad(raw.sum(), w, retain_graph=True)
    (g_norm,) = torch.autograd.grad(normed.sum(), w)
    s = (std.reshape(-1) * torch.sqrt(sigma - sigma_next))[0]
    assert torch.allclose(g_norm, s * g_raw, rtol=1e-5)


def test_ratio_norm_recentres_the_ratio_and_equalises_its_spread_across_steps():
    """Off-policy, the raw log-ratio of a step has mean -<dmu^2> / (2 s^2) < 0 and a spread that grows as the step's
    std s shrinks; the normalised one is zero-mean with the same spread at a noisy and a quiet step (the paper's
    Fig. 2 diagnosis and its fix). Monte Carlo over 4,096 samples; the shifts are chosen so the raw effect is large."""
    out = {}
    for name, (sig, sig_next) in {"noisy": (0.96, 0.91), "quiet": (0.28, 0.009)}.items():
        raw, mu, mu_old, std = _step(0.2, sig, sig_next)
        normed = ratio_norm(raw, mu, mu_old, std, torch.tensor(sig), torch.tensor(sig_next))
        s = float(std.reshape(-1)[0]) * (sig - sig_next) ** 0.5
        # se: MC error of a mean
        bias, se = (
            ((mu - mu_old) ** 2).mean(1) / (2 * s**2),
            raw.std() / len(raw) ** 0.5,
        )
        # the raw mean shift, as derived
        assert bias.mean() > 10 * se and abs(raw.mean() + bias.mean()) < 4 * se
        # zero-mean within MC error
        assert abs(normed.mean()) < 4 * normed.std() / len(normed) ** 0.5
        out[name] = (raw.std().item(), normed.std().item())
    # raw: the quiet step's log-ratio spreads much more
    assert out["quiet"][0] > 2 * out["noisy"][0]
    assert abs(out["quiet"][1] / out["noisy"][1] - 1) < 0.1  # normalised: the same spread


def test_ratio_norm_leaves_a_noise_free_step_at_ratio_one():
    x, v = torch.randn(3, 8), torch.randn(3, 8)
    x_next, lp_old, mu_old, _ = sde_step_with_logprob(v, x, 0.5, 0.4, 0.0)
    _, lp, mu, std = sde_step_with_logprob(v + 1, x, 0.5, 0.4, 0.0, prev_sample=x_next)
    out = ratio_norm(lp - lp_old, mu, mu_old, std, torch.full((3,), 0.5), torch.full((3,), 0.4))
    assert torch.equal(out, torch.zeros(3))


# ---- the deterministic second-order multistep solver (E8, DiffusionNFT's rollout sampler)
def _released_dpm2(v_fn, z, sigmas):
    """NVlabs/DiffusionNFT flow_grpo/diffusers_patch/solver.py, run_sampling(solver="dpm2",
    determistic=True) with dpm_step (order 2), transcribed: x0 = x - sigma v in float32 on the float32
    schedule; step 0 and the last step by ddim_update (eta 0); every other step by
    multistep_dpm_solver_second_order_update, in float64, where log(1 - 1) = -inf makes the step after
    sigma = 1 first order."""
    s64, outputs, lower_order_nums, n = sigmas.to(torch.float64), [None, None], 0, len(sigmas) - 1

    def lam(s):
        return torch.log(1 - s) - torch.log(s)

    for i in range(n):
        sample = z.float()
        x0 = sample - sigmas[i] * v_fn(z, sigmas[i]).float()
        outputs = [outputs[1], x0]
        if lower_order_nums < 1 or i == n - 1:  # ddim_update(eta=0)
            t, s = s64[i + 1], s64[i]
            z = (1 - t) * x0 + torch.sqrt(t**2) * ((sample - (1 - s) * x0) / s)
        else:
            t, s0, s1 = s64[i + 1], s64[i], s64[i - 1]
            h, h_0 = lam(t) - lam(s0), lam(s0) - lam(s1)
            d0, d1 = outputs[-1], (1.0 / (h_0 / h)) * (outputs[-1] - outputs[-2])
            c = (1 - t) * (torch.exp(-h) - 1.0)
            z = (t / s0) * sample - c * d0 - 0.5 * c * d1
        lower_order_nums = min(lower_order_nums + 1, 2)
        z = z.float()
    return z


def _smooth_velocity(x, sigma):
    s = float(sigma)
    return torch.tanh(x) * (1.3 - s) + math.sin(3 * s) * x - 0.5


def _dpm2_chain(v_fn, x, sigmas):
    x0_hat = None
    for j in range(len(sigmas) - 1):
        x, x0_hat = dpm2_step(v_fn(x, sigmas[j]), x, sigmas, j, x0_hat)
    return x


@pytest.mark.parametrize(
    "sigmas",
    [
        sigma_schedule(10, 3.0),
        sigma_schedule(4, 3.0),
        sigma_schedule(3, 1.0),
        sigma_schedule(1, 3.0),
        torch.linspace(0.9, 0.0, 8),  # not starting at 1: step 1 is second order
    ],
    ids=["T10", "T4", "T3", "T1", "from-0.9"],
)
def test_dpm2_is_the_released_solver(sigmas):
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        _dpm2_chain(_smooth_velocity, x, sigmas),
        _released_dpm2(_smooth_velocity, x, sigmas),
        rtol=0,
        atol=2e-6,
    )


def test_dpm2_is_euler_at_the_first_steps_and_the_last():
    """Steps 0 and 1 (the previous sigma is 1) and T - 1 are exactly ode_step; the others are not."""
    sigmas = sigma_schedule(6, 3.0)
    x, x0_hat = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)), None
    for j in range(6):
        v = _smooth_velocity(x, sigmas[j])
        x_next, x0_hat = dpm2_step(v, x, sigmas, j, x0_hat)
        euler = torch.equal(x_next, ode_step(v, x, sigmas[j], sigmas[j + 1]))
        assert euler == (j in (0, 1, 5)), j
        torch.testing.assert_close(x0_hat, x0_prediction(v, x, sigmas[j]))
        x = x_next


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_dpm2_converges_at_second_order(shift):
    """1-D Gaussian data with the exact velocity (the marginal tests' M, S): the ODE maps x_1 to
    M + S x_1 exactly. Doubling the steps from 40 to 80 divides dpm2's error by about 4 (measured
    4.6 at shift 1, 4.1 at shift 3) and Euler's by 2. (At 10 steps dpm2 is the less accurate of the
    two here: 0.73 against 0.31 at shift 1.)"""
    x1 = torch.randn(1000, 1, generator=torch.Generator().manual_seed(0))
    exact = M + S * x1

    def error(num_steps, solver):
        sigmas = sigma_schedule(num_steps, shift)
        x, x0_hat = x1.clone(), None
        for j in range(num_steps):
            v = _true_velocity(x, float(sigmas[j]))
            if solver == "dpm2":
                x, x0_hat = dpm2_step(v, x, sigmas, j, x0_hat)
            else:
                x = ode_step(v, x, sigmas[j], sigmas[j + 1])
        return (x - exact).abs().max().item()

    assert error(40, "dpm2") / error(80, "dpm2") > 3.5
    assert 1.8 < error(40, "euler") / error(80, "euler") < 2.2


def test_dpm2_matches_a_fine_euler_ode_on_a_tiny_model(tiny_sd3):
    """On tiny SD3 (random weights, 64 px, one prompt, one seed) dpm2 at 40 steps lands within 1 %
    of the latents' scale of a 200-step Euler ODE, and halving its step size divides its error by
    more than Euler's 2 (measured: 0.062 at 20 steps, 0.020 at 40; scale 4.2; the 200-step Euler is
    itself 0.004 from an 800-step one). At 10 and 20 steps dpm2 is further from it than Euler with
    as many steps (0.13 against 0.079 at 10)."""
    from common.backbones import load_backbone

    backbone = load_backbone(tiny_sd3, torch.device("cpu"), max_sequence_length=8)
    emb = backbone.encode(["a photo of a red circle"])
    x1 = backbone.initial_noise(1, 64, 64, generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def sample(num_steps, solver):
        sigmas = backbone.schedule(num_steps, 64, 64)
        x, x0_hat = x1.clone(), None
        for j in range(num_steps):
            v = backbone.velocity(x, sigmas[j], emb)
            if solver == "dpm2":
                x, x0_hat = dpm2_step(v, x, sigmas, j, x0_hat)
            else:
                x = ode_step(v, x, sigmas[j], sigmas[j + 1])
        return x

    fine = sample(200, "euler")
    err20, err40 = ((sample(t, "dpm2") - fine).abs().max().item() for t in (20, 40))
    assert err40 < 0.01 * fine.abs().max().item()
    assert err20 / err40 > 2.4, (err20, err40)
