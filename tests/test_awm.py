"""awm.py against the released code: its formulas E3-E12 (docs/awm.md) written the released way in this file
(transcribed from scxue/advantage_weighted_matching at be51372, scripts/train_sd3_awm.py, flow_grpo/stat_tracking.py,
flow_grpo/diffusers_patch/sa_solver.py) and compared with the script's functions on fixed tensors; then the script end
to end on the tiny models (the KL weights at 0, the fast EMA's blend, exact resume, the burn-in, one-line errors) and a
learning test on the toy world."""

import math
import os

import numpy as np
import pytest
import torch
from helpers import (
    assert_resume_is_exact,
    exit_message,
    read_metrics,
    run_main,
    tiny_flags,
    toy_world_gain,
    write_prompts,
)

import awm
from common.rewards import group_advantages
from common.sampler import sde_step_with_logprob, sigma_schedule

SCRIPT = "awm.py"
PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]
WEIGHTINGS = ["ghuber", "Uniform", "t", "t**2", "huber"]


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path / "prompts.txt", PROMPTS)


# ---- the released formulas, transcribed (names and operations as in the released files)
def released_log_prob(noise_pred, random_noise, clean_latents, timestep, weighting, ghuber_power):
    """train_sd3_awm.py compute_log_prob_awm, after the transformer call (E3-E4)."""
    model_output = noise_pred.double()
    log_prob = -((model_output - (random_noise.double() - clean_latents.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if weighting == "t":
        log_prob = log_prob * timestep.view(-1)
    elif weighting == "t**2":
        log_prob = log_prob * timestep.view(-1) ** 2
    elif weighting == "Uniform":
        log_prob = log_prob
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * timestep.view(-1)
    elif weighting == "ghuber":
        log_prob = (
            -(
                torch.pow(-log_prob + 1e-10, ghuber_power)
                - torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), ghuber_power)
            )
            * timestep.view(-1)
            / ghuber_power
        )
    return log_prob, model_output


def released_advantages(prompts, rewards):
    """flow_grpo/stat_tracking.py PerPromptStatTracker(global_std=True).update (E5)."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        std = np.std(rewards, axis=0, keepdims=True) + 1e-4  # Use global std of all rewards
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


def released_clip(advantages, adv_clip_max=5, advantage_max=1):
    """train_sd3_awm.py, "grpo logic" (E6)."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    return advantages / adv_clip_max * advantage_max


def released_t_indices(num_steps, timestep_fraction, train_timesteps, rand_u, time_type):
    """train_sd3_awm.py, time_type 'discrete_wo_init' and 'discrete' (the strata of the rollout grid)."""
    start = 1 if time_type == "discrete_wo_init" else 0
    boundaries = torch.linspace(
        start, int(num_steps * timestep_fraction), steps=train_timesteps + 1
    )
    lower_bounds = boundaries[:-1].long()
    upper_bounds = boundaries[1:].long()
    return lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()


def released_loss(log_prob, advantages, out, out_ref, out_ema, T, B, beta, ema_beta, clip_range=1):
    """train_sd3_awm.py's training step for one micro-batch, on-policy, loss_type 'exp_first', kl_weight and
    kl_ema_weight 'Uniform' (E6-E11): log_prob [T * B] with its graph, advantages [B], model outputs [T * B, ...]."""
    old_log_probs = log_prob.reshape(T, B).detach()  # i < gradient_accumulation_steps
    log_probs = log_prob.reshape(T, B).view(-1)
    advantages = released_clip(advantages)
    ratio = torch.exp(log_probs - old_log_probs.view(-1).detach())
    advantages = advantages.unsqueeze(0).repeat(T, 1).view(-1)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    model_output = out.reshape(T, B, *out.shape[1:])
    model_output_ref = out_ref.reshape(T, B, *out.shape[1:])
    model_output_ema = out_ema.reshape(T, B, *out.shape[1:])
    kl_loss = ((model_output - model_output_ref) ** 2).mean(dim=(2, 3, 4), keepdim=True)
    kl_loss = kl_loss.mean(dim=0).mean()
    ema_kl_loss = ((model_output - model_output_ema) ** 2).mean(dim=(2, 3, 4), keepdim=True)
    ema_kl_loss = ema_kl_loss.mean(dim=0).mean()
    return policy_loss + beta * kl_loss + ema_beta * ema_kl_loss, kl_loss, ema_kl_loss


def released_sa_noise_std(t_prev, t, tau):
    """sa_solver.py, the data-prediction predictor's noise_part coefficient: sigma_t sqrt(1 - exp(-2 tau^2 h)),
    h = lambda_t - lambda_prev, lambda = log(1 - t) - log(t) (NoiseScheduleFlowMatching)."""
    lam = lambda s: math.log(1.0 - s) - math.log(s)  # noqa: E731
    h = lam(t) - lam(t_prev)
    return t * math.sqrt(1 - math.exp(-2 * tau**2 * h))


def fixed_rows(T=6, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (T * B, 4, 8, 8)
    v, x0, eps = (torch.randn(shape, generator=g) for _ in range(3))
    sigma = sigma_schedule(14, 3.0)[torch.tensor([1, 3, 4, 7, 9, 10][:T])].repeat_interleave(B)
    return v, x0, eps, sigma.view(-1, 1, 1, 1)


# ---- E3-E4: the weighting
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_the_weighting_is_the_released_formula(weighting):
    v, x0, eps, t = fixed_rows()
    ours = awm.matching_logprob(v, x0, eps, t, weighting, 0.25)
    theirs, _ = released_log_prob(v, eps, x0, t, weighting, 0.25)
    assert ours.dtype == torch.float64 and ours.shape == (18,)
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=0)
    if weighting == "ghuber":  # the power is read from the flag, not fixed at 0.25
        torch.testing.assert_close(
            awm.matching_logprob(v, x0, eps, t, weighting, 0.5),
            released_log_prob(v, eps, x0, t, weighting, 0.5)[0],
            rtol=1e-13,
            atol=0,
        )


def test_ghuber_down_weights_large_errors_and_weights_noisy_timesteps():
    """d lp / d l = -t l^(p - 1): at p = 0.25 a row with 16 times the error gets 1/8 of the gradient per unit of
    error, and at equal error the row at t = 0.9 gets 0.9 / 0.3 = 3 times the row at t = 0.3."""
    x0, eps = torch.zeros(4, 1, 2, 2), torch.zeros(4, 1, 2, 2)
    scale = torch.tensor([1.0, 4.0, 1.0, 1.0]).view(-1, 1, 1, 1)
    v = (scale * torch.ones(4, 1, 2, 2)).requires_grad_()  # l = 1, 16, 1, 1
    t = torch.tensor([0.5, 0.5, 0.9, 0.3]).view(-1, 1, 1, 1)
    lp = awm.matching_logprob(v, x0, eps, t, "ghuber", 0.25)
    (g,) = torch.autograd.grad(lp.sum(), v)
    per_unit = g.flatten(1)[:, 0] / (2 * v.flatten(1)[:, 0] / 4)  # d lp / d l, dl/dv = 2 v / 4
    assert float(per_unit[1] / per_unit[0]) == pytest.approx(1 / 8, rel=1e-6)
    assert float(per_unit[2] / per_unit[3]) == pytest.approx(3.0, rel=1e-6)


# ---- E5-E6: the advantage
def test_the_advantage_is_the_released_group_mean_global_std_clip_and_scale():
    g = torch.Generator().manual_seed(3)
    prompts = [f"p{k % 5}" for k in range(40)]  # 5 groups of 8
    rewards = torch.rand(40, generator=g).double()
    rewards[[k for k, p in enumerate(prompts) if p == "p4"]] = 0.5  # one tied group: A = 0
    rewards[7] = 40.0  # an outlier: |A| > 5, so the clip bites
    group = torch.tensor([int(p[1:]) for p in prompts])
    ours = awm.advantage_weight(group_advantages(rewards, group, True, 1e-4).double(), 5.0, 1.0)
    a = torch.as_tensor(released_advantages(prompts, rewards.numpy()))
    theirs = released_clip(a)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # group_advantages is float32
    assert theirs.abs().max() == 1 and (a.abs() > 5).sum() >= 1  # clipped to +-5, then / 5
    assert ours[group == 4].abs().max() == 0
    # one signed linear weight: a flipped advantage flips the weight, no separate branch
    torch.testing.assert_close(awm.advantage_weight(-a, 5.0, 1.0), -theirs)
    # Flow-Factory's clip at +-1 without the / 5: --adv-clip-max 1 --advantage-max 1, up to 5x larger
    ff = awm.advantage_weight(a, 1.0, 1.0)
    torch.testing.assert_close(ff, a.clamp(-1, 1))
    assert (ff.abs() / theirs.abs().clamp_min(1e-12))[a.abs() < 1].max() == pytest.approx(5.0)


# ---- the timesteps: strata of the rollout grid's indices
def strata_sets(args, draws=2000):
    g = torch.Generator().manual_seed(0)
    seen = [set() for _ in range(args.train_timesteps)]
    for _ in range(draws):
        u = torch.rand(args.train_timesteps, generator=g)
        idx = awm.timestep_strata(args, u)
        ref = released_t_indices(
            args.num_steps, args.timestep_fraction, args.train_timesteps, u, args.time_type
        )
        assert torch.equal(idx, ref), (idx, ref)
        for k, j in enumerate(idx.tolist()):
            seen[k].add(j)
    return [sorted(s) for s in seen]


def test_the_strata_of_the_14_step_grid_are_the_released_ones():
    """14 steps, fraction 0.9, six strata: the released draw (transcribed) on 2,000 draws, index for index, and the
    sets docs/awm.md lists; on SD3.5's 14-step grid (shift 3) sigma = 1 and t < 0.357 are never trained."""
    args = awm.Args(num_steps=14, timestep_fraction=0.9, train_timesteps=6)
    assert strata_sets(args) == [[1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    grid = sigma_schedule(14, 3.0)
    # the diffusers grid (FlowMatchEulerDiscreteScheduler(shift=3).set_timesteps(14) gives the same); the
    # reference reading printed 0.872 for sigma_4 = 0.87145
    expected = [1.000, 0.973, 0.943, 0.909, 0.871, 0.828, 0.779, 0.721, 0.654, 0.574, 0.477, 0.357]
    assert [round(float(s), 3) for s in grid[:12]] == expected
    assert [round(float(s), 3) for s in grid[12:14]] == [0.206, 0.009]
    trained = sorted({j for s in strata_sets(args) for j in s})
    assert float(grid[trained].max()) < 1 and float(grid[trained].min()) == pytest.approx(
        0.357, abs=5e-4
    )
    # PickScore's 'discrete': from index 0
    pick = awm.Args(num_steps=14, timestep_fraction=0.9, train_timesteps=6, time_type="discrete")
    assert strata_sets(pick) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    # the toy default (10 steps): {1}, {2}, {3, 4}, {5}, {6}, {7, 8}
    assert strata_sets(awm.Args()) == [[1], [2], [3, 4], [5], [6], [7, 8]]


# ---- E7-E11: the loss, the ratio and the KL terms
@pytest.mark.parametrize("weighting", ["ghuber", "Uniform"])
def test_the_loss_has_the_released_gradient_and_kl_terms(weighting):
    """One micro-batch of T = 6 timesteps x B = 3 images: the released PPO form with its ratio (identically 1) and
    both KL terms against awm_loss (no ratio), averaged over the rows as the training section does. The KL terms are
    equal and the gradients with respect to v_theta are equal (the values differ: the released policy loss reads
    -mean(A_hat) since rho = 1)."""
    T, B = 6, 3
    v, x0, eps, t = fixed_rows(T, B)
    g = torch.Generator().manual_seed(1)
    v_ref, v_ema = (
        v + 0.1 * torch.randn(v.shape, generator=g),
        v + 0.01 * torch.randn(v.shape, generator=g),
    )
    a = torch.tensor([2.0, -7.0, 0.3], dtype=torch.float64)  # A before the clip: one beyond 5
    args = awm.Args(weighting=weighting, kl_weight=0.001, ema_kl_weight=1.0)

    v1 = v.clone().requires_grad_()
    log_prob, out = released_log_prob(v1, eps, x0, t, weighting, 0.25)
    out_ref, out_ema = v_ref.double(), v_ema.double()
    theirs, kl_r, ema_kl_r = released_loss(log_prob, a, out, out_ref, out_ema, T, B, 0.001, 1.0)
    (g_theirs,) = torch.autograd.grad(theirs, v1)

    v2 = v.clone().requires_grad_()
    adv = awm.advantage_weight(a, 5.0, 1.0).repeat(T)  # row k * B + i: image i
    row_loss, policy_loss, kl, ema_kl = awm.awm_loss(v2, x0, eps, t, adv, v_ref, v_ema, args)
    ours = row_loss.view(T, B).mean(0).sum() / B
    (g_ours,) = torch.autograd.grad(ours, v2)

    torch.testing.assert_close(kl.mean(), kl_r, rtol=1e-12, atol=0)
    torch.testing.assert_close(ema_kl.mean(), ema_kl_r, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-6, atol=1e-12)
    assert g_ours.abs().max() > 0
    # the released value: rho = 1, so its policy loss is -mean(A_hat) whatever lp is
    torch.testing.assert_close(theirs - 0.001 * kl_r - ema_kl_r, -adv.double().mean())


def test_the_clip_is_inert_on_policy_for_any_clip_range():
    """The released clip ranges (1 in the AWM configs, 1e-4 in base_awm.py) give the same gradient: rho = 1 lies
    inside every [1 - eps, 1 + eps], so the clamp passes its gradient and both branches are one number."""
    T, B = 6, 3
    v, x0, eps, t = fixed_rows(T, B)
    a = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    grads = []
    for clip_range in (1.0, 1e-4):
        v1 = v.clone().requires_grad_()
        log_prob, out = released_log_prob(v1, eps, x0, t, "ghuber", 0.25)
        loss, _, _ = released_loss(log_prob, a, out, out, out, T, B, 0.0, 0.0, clip_range)
        grads.append(torch.autograd.grad(loss, v1)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_a_zero_weight_needs_no_forward():
    """--kl-weight 0 or --ema-kl-weight 0 (the released beta = 0 or ema_beta = 0 raise UnboundLocalError at
    log_prob_ref / model_output_ema): the term is 0 and its velocity is never read."""
    v, x0, eps, t = fixed_rows(2, 2)
    adv = torch.ones(4, dtype=torch.float64)
    for beta, ema_beta in ((0.0, 0.0), (0.0, 1.0), (1e-3, 0.0)):
        args = awm.Args(kl_weight=beta, ema_kl_weight=ema_beta)
        v_ref = v + 1 if beta else None
        v_ema = v - 1 if ema_beta else None
        row, policy, kl, ema_kl = awm.awm_loss(v, x0, eps, t, adv, v_ref, v_ema, args)
        assert (kl.abs().sum() > 0) == (beta > 0) and (ema_kl.abs().sum() > 0) == (ema_beta > 0)
        torch.testing.assert_close(row, policy + beta * kl + ema_beta * ema_kl)


# ---- E12: the fast EMA
def test_the_fast_emas_decay_is_the_released_schedule():
    for step in range(0, 1200, 3):
        assert awm.anchor_decay(step, 0.3) == min(0.3, 0.001 * step)  # kl_ema_decay_type 'linear'
    assert awm.anchor_decay(1, 0.3) == 0.001 and awm.anchor_decay(300, 0.3) == 0.3


# ---- the rollout's noise: the released SA-Solver's tau as common/sampler.py's noise level
def test_the_noise_window_and_the_sa_solver_noise_scale():
    """step_noise gives a = sqrt(2) tau where a step lands in [0.3, 0.9] (8 of SD3.5's 14 steps, landing on 0.872
    ... 0.357) and 0 elsewhere; with that a, sde_step_with_logprob's per-step std matches the released SA-Solver's
    sigma_t sqrt(1 - exp(-2 tau^2 h)) as the step shrinks (same SDE, other discretisation)."""
    grid = sigma_schedule(14, 3.0)
    a = awm.step_noise(grid, 0.4, (0.3, 0.9))
    noisy = [j for j, x in enumerate(a) if x > 0]
    assert noisy == list(range(3, 11)) and set(a) == {0.0, math.sqrt(2) * 0.4}
    assert awm.step_noise(grid, 0.0, (0.3, 0.9)) == [0.0] * 14
    x = torch.zeros(1, 4)
    for s in (0.35, 0.6, 0.85):
        for ds in (1e-3, 1e-5):
            _, _, _, std_dev_t = sde_step_with_logprob(x, x, s, s - ds, math.sqrt(2) * 0.4)
            ours = float(std_dev_t.flatten()[0]) * math.sqrt(ds)
            ratio = ours / released_sa_noise_std(s, s - ds, 0.4)
            assert abs(ratio - 1) < 2 * ds / (1 - s) + 1e-6, (s, ds, ratio)
    # at the 14 steps themselves the Euler-Maruyama step is noisier: 1.15x to 1.37x SA-Solver's per-step std
    ratios = []
    for j in noisy:
        s, s_next = float(grid[j]), float(grid[j + 1])
        _, _, _, std_dev_t = sde_step_with_logprob(x, x, s, s_next, a[j])
        ratios.append(
            float(std_dev_t.flatten()[0])
            * math.sqrt(s - s_next)
            / released_sa_noise_std(s, s_next, 0.4)
        )
    assert 1.14 < min(ratios) < 1.15 and 1.36 < max(ratios) < 1.37, ratios


# ---- the script end to end, on the tiny models
def two_iterations(model, tmp_path, prompts_file, *extra, iterations="2"):
    run_main(
        SCRIPT,
        *tiny_flags(model, tmp_path, prompts_file),
        *("--train-timesteps", "2", "--num-iterations", iterations, "--save-every", "1"),
        *("--eval-every", "100", "--learning-rate", "1e-2"),
        *extra,
    )
    return read_metrics(tmp_path / "run")


def saved(checkpoint, *path):
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    for key in path:
        state = state[key]
    return state


@pytest.mark.parametrize("beta,ema_beta", [(0.0, 0.0), (0.0, 1.0), (1e-3, 0.0), (1e-3, 1.0)])
def test_runs_with_either_kl_weight_at_zero(tiny_sd3, tmp_path, prompts_file, beta, ema_beta):
    """The released code crashes at beta = 0 or ema_beta = 0 (--kl-weight, --ema-kl-weight here); here each runs, each forward is counted only when its
    weight is > 0, and a term at weight 0 logs 0. Rows: 4 images x 2 strata."""
    m = two_iterations(
        tiny_sd3, tmp_path, prompts_file, "--kl-weight", str(beta), "--ema-kl-weight", str(ema_beta)
    )
    assert [x["iteration"] for x in m] == [0, 1, 2] and m[-1]["final"]
    per_row = 1 + (beta > 0) + (ema_beta > 0)
    for k, row in enumerate(m[:2]):
        assert row["nfe/train_forward"] == 8 * per_row * (k + 1)
        assert row["nfe/train_backward"] == 8 * (k + 1)
        assert row["train/optimizer_steps"] == 1 and row["grad_norm"] > 0
        assert math.isfinite(row["policy_loss"]) and row["train/matching_loss"] > 0
    assert (m[1]["kl"] > 0) == (beta > 0)
    # the anchor is theta_1 blended at d = 0.001 before iteration 1: v_ema != v_theta there
    assert (m[1]["train/ema_kl"] > 0) == (ema_beta > 0) and m[0]["train/ema_kl"] == 0


def test_the_fast_ema_follows_theta_once_per_iteration_in_a_run(tiny_sd3, tmp_path, prompts_file):
    """Checkpoints 1 and 2: anchor_2 = d anchor_1 + (1 - d) theta_2 with d = min(0.3, 0.001 * 2); and at the first
    checkpoint anchor_1 = 0.001 theta_0 + 0.999 theta_1 (theta_0: LoRA B = 0)."""
    two_iterations(tiny_sd3, tmp_path, prompts_file)
    run = tmp_path / "run"
    anchor = [saved(run / f"checkpoint-{k}", "extras", "kl_anchor", "shadow") for k in (1, 2)]
    theta = [saved(run / f"checkpoint-{k}", "params") for k in (1, 2)]
    moved = [n for n in theta[1] if not torch.equal(anchor[0][n], anchor[1][n])]
    assert moved
    for n in theta[1]:
        torch.testing.assert_close(anchor[1][n], 0.002 * anchor[0][n] + 0.998 * theta[1][n])
        if "lora_B" in n:  # theta_0's B is 0
            torch.testing.assert_close(anchor[0][n], 0.999 * theta[0][n])


def test_burn_in_iterations_neither_sample_nor_train(tiny_sd3, tmp_path, prompts_file):
    """--burn-in-iterations 1: iteration 0 has a row without rollout or update (and no checkpoint); iteration 1
    trains, and its anchor decay counts 1 optimizer step (the released global_step), not 2: the anchor's LoRA B is
    0.999 theta_2's (theta_0's B is 0), where counting the burn-in would give 0.998."""
    m = two_iterations(tiny_sd3, tmp_path, prompts_file, "--burn-in-iterations", "1")
    assert m[0]["trajectories"] == 0 and m[0]["train/optimizer_steps"] == 0
    assert "train/reward_mean" not in m[0] and "eval/reward_mean" in m[0]  # evaluated, not sampled
    assert m[1]["trajectories"] == 4 and m[1]["train/optimizer_steps"] == 1
    run = tmp_path / "run"
    assert not os.path.exists(run / "checkpoint-1")
    anchor = saved(run / "checkpoint-2", "extras", "kl_anchor", "shadow")
    theta = saved(run / "checkpoint-2", "params")
    b = [n for n in theta if "lora_B" in n]
    assert b and any(theta[n].abs().sum() > 0 for n in b)
    for n in b:
        torch.testing.assert_close(anchor[n], 0.999 * theta[n])


@pytest.mark.pictures
def test_two_iterations_on_flux_with_the_ode_and_uniform_weighting(
    tiny_flux, tmp_path, prompts_file
):
    """FLUX's packed latents, the Euler ODE rollout (--noise-level 0) and the paper's uniform weighting."""
    m = two_iterations(
        tiny_flux,
        tmp_path,
        prompts_file,
        *("--noise-level", "0", "--weighting", "Uniform", "--guidance-scale", "3.5"),
    )
    assert m[1]["train/optimizer_steps"] == 1 and math.isfinite(m[1]["policy_loss"])
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert os.path.exists(ckpt / "pytorch_lora_weights.safetensors")
    for picture in ("learning_curve.png", "before_after.png"):
        assert os.path.getsize(tmp_path / "run" / picture) > 0, picture


def test_resume_is_exact(tiny_sd3, tmp_path, prompts_file):
    """2 + 2 = 4 iterations bit-exact: weights, EMA, and the fast EMA (a resume that lost it would pull theta towards
    other weights), with both KL terms and two optimizer steps per iteration."""
    extra = ["--learning-rate", "1e-2", "--eval-every", "100", "--ema-decay", "0.5"]
    assert_resume_is_exact(
        SCRIPT,
        lambda name: tiny_flags(tiny_sd3, tmp_path, prompts_file, name),
        4,
        [*extra, "--train-timesteps", "2", "--optimizer-steps-per-iteration", "2"],
    )
    a, b = (
        saved(tmp_path / name / "checkpoint-4", "extras", "kl_anchor", "shadow")
        for name in ("straight", "split")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- learning on the toy world, by the script itself
def test_learning_on_the_toy_world(tmp_path):
    """awm.py itself (its rollout, A_hat and training section) on the shipped toy model: the eval reward
    (deterministic ODE, fixed seeds) on the training prompts rises within 3 iterations of 2 x 8 images, 6 steps,
    4 strata, the toy default's learning rate (1e-3) and KL weights: -1.146 -> -0.788 (one torch thread,
    2026-12-06; -1.038 at the learning rate 3e-4 it had before the screen). With the advantage's sign flipped in
    advantage_weight, where the rollout stores A_hat, where the training section reads it, in awm_loss or in
    group_advantages it falls to -1.377 (all five), and with learning rate 1e-30 the two evaluations are equal, so
    this fails when learning is broken. The reward is JPEG compressibility, as in
    the other scripts' learning tests (smooth and dense: a short CPU run shows the effect reliably)."""
    start, end = toy_world_gain(
        SCRIPT,
        tmp_path,
        *("--groups-per-iteration", "2", "--group-size", "8", "--rollout-batch-size", "16"),
        *("--num-iterations", "3", "--eval-every", "3", "--eval-seeds-per-prompt", "2"),
        *("--num-steps", "6", "--eval-num-steps", "10", "--reward", "jpeg_compressibility"),
        *("--train-timesteps", "4"),
    )
    assert end > start + 0.1, (start, end)


# ---- bad input: one clear line, before any model is loaded
@pytest.mark.parametrize(
    "flags,expect",
    [
        (["--kl-weight", "-1"], "--kl-weight -1.0: must be a finite number >= 0"),
        (["--ema-kl-weight", "-1"], "--ema-kl-weight -1.0: must be a finite number >= 0"),
        (["--kl-ema-decay", "1"], "--kl-ema-decay 1.0: must be"),
        (["--ghuber-power", "0"], "--ghuber-power 0.0: must be"),
        (["--train-timesteps", "0"], "--train-timesteps 0: must be"),
        (["--timestep-fraction", "0.3"], "leaves no grid index to train"),
        (["--noise-window", "0.9", "0.3"], "--noise-window 0.9 0.3: need 0 <= LO <= HI <= 1"),
        (["--optimizer-steps-per-iteration", "5"], "too few for that many steps"),
        (["--advantage-max", "0"], "--advantage-max 0.0: must be"),
        (["--burn-in-iterations", "-1"], "--burn-in-iterations -1: must be"),
    ],
)
def test_bad_input_is_one_clear_line(monkeypatch, flags, expect, tmp_path, prompts_file, tiny_sd3):
    msg = exit_message(monkeypatch, SCRIPT, *tiny_flags(tiny_sd3, tmp_path, prompts_file), *flags)
    assert msg.startswith("error:") and expect in msg and "\n" not in msg, msg
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
