"""G²RPO (g2rpo.py): Singular Stochastic Sampling, MGAI, the NFE count, and the script end to end.

The helpers are imported from the script itself (its main block is guarded), so these tests check the very
functions the rollout section calls. Whole-script runs use tiny random pipelines and 1-2 iterations.
"""

import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from helpers import (  # noqa: E402
    assert_resume_is_exact,
    read_metrics,
    run_main,
    toy_world_gain,
    write_prompts,
)

import g2rpo  # noqa: E402
from common.backbones import load_backbone  # noqa: E402
from common.plumbing.reward_flags import build_reward  # noqa: E402
from common.sampler import ode_step, sde_step_with_logprob  # noqa: E402

RES = 64  # tiny pipelines: VAE factor 2, so 32x32 latents


# ---------------------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("official", [False, True])
@pytest.mark.parametrize("T", [5, 10, 16])
def test_completion_schedule_ends_at_zero_and_costs_the_closed_form(T, official):
    for k in range(T):
        for lam in (1, 2, 3, 4):
            idx = g2rpo.completion_schedule(k, lam, T, official)
            assert idx[0] == k + 1 and idx[-1] == T and idx == sorted(set(idx))
            assert len(idx) - 1 == math.ceil((T - k - 1) / lam)  # model calls
            if not official:  # every step is λ long except a shorter last one
                assert all(b - a == lam for a, b in zip(idx[:-2], idx[1:-1]))
                assert 0 < idx[-1] - idx[-2] <= lam if len(idx) > 1 else True
    assert g2rpo.completion_schedule(0, 1, T, official) == list(range(1, T + 1))


def test_official_schedule_reproduces_the_released_code():
    """The reference's simulation of train_g2rpo_*.py (T=16, shift 3): the image is x0_hat at these sigmas."""
    sig = torch.linspace(1, 0, 17)
    sig = 3 * sig / (1 + 2 * sig)
    for e, g, at in [(0, 2, 0.300), (1, 2, 0.409), (0, 3, 0.577), (1, 3, 0.500), (7, 3, 0.500)]:
        idx = g2rpo.completion_schedule(e, g, 16, official=True)
        # sigma[0..e+1] ++ sigma[e+2::g], from e+1
        code = list(range(e + 1, e + 2)) + list(range(e + 2, 17, g))
        assert idx[:-1] == code[:-1]  # the same model calls ...
        # ... the last one at the quoted sigma, then a jump to 0
        assert abs(float(sig[idx[-2]]) - at) < 1e-3
        clean = g2rpo.completion_schedule(e, g, 16)
        assert clean[-2] > idx[-2] or clean == idx  # the default goes further before its last step


# ---------------------------------------------------------------------------------------------- MGAI
def test_mgai_on_a_hand_computed_table():
    # 2 prompts, K=2 branch steps, L=2 granularities, G=3 members, R=1 reward.
    r = torch.zeros(2, 2, 2, 3, 1)
    r[0, 0, 0, :, 0] = torch.tensor([1.0, 2.0, 3.0])  # mean 2, unbiased std 1        -> -1, 0, 1
    # mean 2, std sqrt(12)          -> -2/s, -2/s, 4/s
    r[0, 0, 1, :, 0] = torch.tensor([0.0, 0.0, 6.0])
    r[0, 1, 0, :, 0] = torch.tensor([5.0, 5.0, 5.0])  # equal: 0
    r[0, 1, 1, :, 0] = torch.tensor([4.0, 0.0, 2.0])  # mean 2, std 2                 -> 1, -1, 0
    r[1] = 10 * r[0] + 7  # normalisation is affine-invariant
    s = math.sqrt(12)
    want = torch.tensor([[-1 - 2 / s, -2 / s, 1 + 4 / s], [1.0, -1.0, 0.0]])
    adv = g2rpo.mgai_advantages(r, torch.ones(1), eps=0.0)
    assert adv.shape == (2, 2, 3)
    torch.testing.assert_close(adv[0], want)
    torch.testing.assert_close(adv[1], want)
    # eps enters the denominator only
    adv_eps = g2rpo.mgai_advantages(r, torch.ones(1), eps=1.0)
    torch.testing.assert_close(
        adv_eps[0, 0], torch.tensor([-1 / 2 - 2 / (s + 1), -2 / (s + 1), 1 / 2 + 4 / (s + 1)])
    )
    # two reward models: per-reward normalisation, then the weighted sum (A_HPS + A_CLIP when both weights are 1)
    two = torch.cat([r, -r[..., :1] * 3], -1)
    torch.testing.assert_close(
        g2rpo.mgai_advantages(two, torch.tensor([1.0, 0.5]), 0.0), adv - 0.5 * adv
    )


def test_mgai_of_equal_rewards_is_exactly_zero():
    # 0.1 is not exact in binary: a float32 mean would not return it
    r = torch.full((3, 2, 12, 2), 0.1)
    r[1] = 0.3333
    assert (g2rpo.mgai_advantages(r, torch.ones(2), eps=1e-8) == 0).all()


# ---------------------------------------------------------------------------------------------- NFE
def rollout_nfe(num_steps: int, branch_steps, group_size: int, granularities) -> int:
    """Closed-form velocity evaluations of one group's rollout (per prompt; a CFG pair counts as
    one, as the baseline):

        NFE = (max M + 1) + G * sum_{k in M} sum_{λ in Λ} ceil((T - k - 1) / λ)

    The anchor evaluates v at its states 0..max M; the branch step at k reuses the anchor's v at k
    (so the shared state costs no extra call: the official code spends G calls there); each
    completion costs its schedule's steps. Paper setting (T=16, M=0..7, G=12, Λ={1,2,3}):
    8 + 12 * 173 = 2084 (the official code: 16 + 12 * 181 = 2188). Training adds |M| forwards and
    |M| backwards per prompt, one per shared state x_k, in both (docs/g2rpo.md).
    """
    comp = sum(math.ceil((num_steps - k - 1) / lam) for k in branch_steps for lam in granularities)
    return max(branch_steps) + 1 + group_size * comp


def test_closed_form_nfe_paper_setting():
    # per member and k-sum of completion calls as tabulated from the official code (148 - 8 SDE steps, etc.)
    assert rollout_nfe(16, range(8), 12, (1,)) == 8 + 12 * 92
    assert rollout_nfe(16, range(8), 12, (1, 2)) == 8 + 12 * 140
    assert rollout_nfe(16, range(8), 12, (1, 3)) == 8 + 12 * 125
    assert rollout_nfe(16, range(8), 12, (1, 2, 3)) == 2084


@pytest.mark.parametrize(
    "T,M,G,lams,official",
    [
        (10, (0, 1, 2, 3, 4), 8, (1, 2, 3), False),
        (16, tuple(range(8)), 3, (1, 2), True),
        (7, (2, 5, 6), 2, (3,), False),
        (6, (0, 5), 4, (1, 4), True),
    ],
)
def test_counted_nfe_equals_closed_form(T, M, G, lams, official):
    calls = []

    def velocity(x, s, p):  # a fake model: counts rows, returns a smooth velocity
        calls.append(len(x))
        return 0.1 * x + torch.as_tensor(s, dtype=torch.float32).reshape(-1, 1)

    P = 3
    sig = torch.linspace(1, 0, T + 1)
    out = g2rpo.singular_stochastic_rollout(
        velocity,
        torch.randn(P, 5),
        sig,
        M,
        lams,
        G,
        0.7,
        generator=torch.Generator().manual_seed(0),
        batch=7,
        official=official,
    )
    assert sum(calls) == out["nfe"] == P * rollout_nfe(T, M, G, lams)
    assert max(calls) <= 7  # --rollout-batch-size caps every call
    assert out["final"].shape == (P, len(M), len(lams), G, 5)


# ---------------------------------------------------------------------------------------------- sampling
def _tiny_rollout(
    path, noise_level, prompts, M=(0, 2), lams=(1, 2), G=3, T=4, seed=0, official=False
):
    bb = load_backbone(path)
    emb = bb.encode(prompts)
    gen = torch.Generator().manual_seed(seed)
    sig = bb.schedule(T, RES, RES)
    x_T = bb.initial_noise(len(prompts), RES, RES, generator=gen)
    out = g2rpo.singular_stochastic_rollout(
        lambda x, s, p: bb.velocity(x, s, emb[p]),
        x_T,
        sig,
        M,
        lams,
        G,
        noise_level,
        generator=gen,
        batch=5,
        official=official,
    )
    return bb, emb, sig, x_T, out


@pytest.mark.parametrize("fixture", ["tiny_sd3", "tiny_flux"])
def test_noise_zero_gives_identical_groups_and_zero_advantages(request, fixture):
    prompts = ["a photo of a red circle", "a photo of two blue squares"]
    bb, _, _, _, out = _tiny_rollout(request.getfixturevalue(fixture), 0.0, prompts)
    final = out["final"]  # [P, K, L, G, ...]
    P, K, L, G = final.shape[:4]
    images = bb.decode(final.flatten(0, 3), RES, RES).view(P, K, L, G, 3, RES, RES)
    assert (images == images[:, :, :, :1]).all()  # every member of every group: the same image
    reward = build_reward("jpeg_compressibility,toyworld")
    scores = reward(images.flatten(0, 3), [p for p in prompts for _ in range(K * L * G)]).view(
        P, K, L, G, 2
    )
    assert (scores == scores[:, :, :, :1]).all()
    assert (g2rpo.mgai_advantages(scores, reward.weights, 1e-8) == 0).all()
    assert (
        out["log_prob"] == 0
    ).all()  # a deterministic step has no density (and nothing trains on it)


def test_members_share_every_latent_before_k_and_differ_after(tiny_sd3):
    prompts = ["a photo of a red circle", "a photo of two blue squares"]
    M, lams, G, T = (0, 2), (1, 2), 3, 4
    bb, emb, sig, x_T, out = _tiny_rollout(tiny_sd3, 0.7, prompts, M, lams, G, T)
    # Before step k: the one ODE trajectory from the group's single x_T (independently recomputed, prompt by prompt).
    for p in range(len(prompts)):
        x = x_T[p : p + 1]
        for j in range(max(M) + 1):
            if j in M:
                torch.testing.assert_close(
                    out["latents"][M.index(j), p : p + 1], x, atol=1e-5, rtol=1e-5
                )
            x = ode_step(bb.velocity(x, sig[j], emb[p : p + 1]), x, sig[j], sig[j + 1])
    # At step k: G different draws from the SAME Gaussian (same mean, the shared velocity), scored by log_prob.
    for kk, k in enumerate(M):
        y = out["next_latents"][kk]  # [P, G, ...]
        for p in range(len(prompts)):
            x = out["latents"][kk, p : p + 1].expand(G, *y.shape[2:])
            lp = sde_step_with_logprob(
                bb.velocity(x, sig[k], emb[[p] * G]),
                x,
                sig[k],
                sig[k + 1],
                0.7,
                prev_sample=y[p],
                sigma_max=sig[1],
            )[1]
            torch.testing.assert_close(lp, out["log_prob"][kk, p], atol=1e-4, rtol=1e-4)
            for i in range(G):
                for j in range(i):
                    assert (y[p, i] - y[p, j]).abs().max() > 1e-3
    # After it: each member's own ODE completion (re-run alone, batch 1) gives its image; the images differ.
    for kk, k in enumerate(M):
        for li, lam in enumerate(lams):
            path = sig[g2rpo.completion_schedule(k, lam, T)]
            for p in range(len(prompts)):
                for i in range(G):
                    x = out["next_latents"][kk, p, i : i + 1]
                    for a, b in zip(path[:-1], path[1:]):
                        x = ode_step(bb.velocity(x, a, emb[p : p + 1]), x, a, b)
                    torch.testing.assert_close(
                        out["final"][p, kk, li, i : i + 1], x, atol=1e-4, rtol=1e-4
                    )
                f = out["final"][p, kk, li]
                assert (f[1:] - f[:1]).flatten(1).abs().amax(1).min() > 1e-3


# ---------------------------------------------------------------------------------------------- the script
SCRIPT = "g2rpo.py"


def _flags(model, tmp_path, name="run", *extra):
    """A tiny run: 2 prompts, 4 steps, M = {0, 2}, Λ = {1, 2}, G = 3, 64 px, a reward that needs no weights."""
    prompts = write_prompts(
        tmp_path / "prompts.txt", ["a photo of a red circle", "a photo of two blue squares"]
    )
    return [
        "--model-path",
        model,
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        "--resolution",
        str(RES),
        "--max-sequence-length",
        "8",
        "--num-steps",
        "4",
        "--eval-num-steps",
        "2",
        "--prompts-file",
        prompts,
        "--eval-prompts",
        prompts,
        "--eval-seeds-per-prompt",
        "1",
        "--group-size",
        "3",
        "--groups-per-iteration",
        "2",
        "--branch-steps",
        "0",
        "2",
        "--granularities",
        "1",
        "2",
        "--rollout-batch-size",
        "8",
        "--train-batch-size",
        "4",
        "--reward",
        "jpeg_compressibility",
        "--lora-rank",
        "4",
        *extra,
    ]


TINY_NFE = rollout_nfe(4, (0, 2), 3, (1, 2))  # per prompt, for _flags


CPS = ["--sde-type", "cps", "--noise-level", "0.8"]


@pytest.mark.parametrize(
    "fixture,extra",
    [
        pytest.param("tiny_sd3", [], marks=pytest.mark.pictures),
        ("tiny_flux", []),
        ("tiny_sd3", CPS),
        ("tiny_flux", ["--sigma-grid", "official", "--lora-target", "attention-ff", *CPS]),
    ],
)
def test_smoke_tiny_backbones(request, fixture, extra, tmp_path):
    guidance = ["--guidance-scale", "4.5" if fixture == "tiny_sd3" else "3.5"]
    run_main(
        SCRIPT,
        *_flags(request.getfixturevalue(fixture), tmp_path),
        "--num-iterations",
        "1",
        *guidance,
        *extra,
        "--grad-share-every",
        "1",
    )
    m = read_metrics(tmp_path / "run")
    assert [x["iteration"] for x in m] == [0, 1]
    first = m[0]
    # the diagnostic: M = {0, 2}
    shares = {k: v for k, v in first.items() if k.startswith("steps/grad_share/")}
    assert sorted(shares) == ["steps/grad_share/0", "steps/grad_share/2"] and sum(
        shares.values()
    ) == pytest.approx(1)
    for key in (
        "train/reward_mean",
        "train/reward_std",
        "train/group_std_k0",
        "train/group_std_k2",
        "train/reward_mean_lam1",
        "train/reward_mean_lam2",
        "ratio/first_minibatch_max_dev",
        "nfe",
        "eval/reward_mean",
    ):
        assert key in first and math.isfinite(first[key]), key
    # on-policy: the rollout's log-probs are recomputed
    assert first["ratio/first_minibatch_max_dev"] < 1e-5
    if "cps" in extra:  # the CPS branch step: its (unnormalised) log-prob recomputed bit for bit
        assert (
            first["ratio/first_minibatch_max_dev"] == 0
            and first["ratio/min"] == first["ratio/max"] == 1
        )
    # NFE: the closed-form rollout count; training runs one forward + backward per shared state x_k, i.e.
    # |M| x prompts = 2 x 2 rows, not |M| x prompts x G = 12.
    assert first["train/kept_transitions"] > 0
    assert first["nfe/rollout"] + first["nfe/completion"] == 2 * TINY_NFE
    # trajectories: prompts x G; scored: every branch (|M| = 2) of every member at every granularity (|Λ| = 2)
    assert first["trajectories"] == 2 * 3 and first["scored_images"] == 2 * 2 * 2 * 3
    assert first["nfe/train_forward"] == first["nfe/train_backward"] == 2 * 2
    assert os.path.exists(tmp_path / "run" / "checkpoint-1" / "pytorch_lora_weights.safetensors")
    if (
        fixture == "tiny_sd3" and not extra
    ):  # the case marked `pictures`: the end-of-run pictures are drawn
        for picture in ("learning_curve.png", "steps_heatmap.png", "before_after.png"):
            assert os.path.getsize(tmp_path / "run" / picture) > 0, picture


def test_noise_zero_run_has_zero_advantages(tiny_sd3, tmp_path):
    run_main(SCRIPT, *_flags(tiny_sd3, tmp_path), "--num-iterations", "1", "--noise-level", "0")
    first = read_metrics(tmp_path / "run")[0]
    assert first["train/zero_std_frac"] == 1.0 and first["train/group_std_mean"] == 0.0
    # every advantage is 0, so every transition is dropped: no training forward, no optimizer step
    assert (
        first["train/optimizer_steps"] == 0
        and first["nfe/train_forward"] == 0
        and first["grad_norm"] == 0.0
    )
    # the G identical branches of a group were run once: G = 1 in the closed form
    assert first["nfe/rollout"] + first["nfe/completion"] == 2 * rollout_nfe(4, (0, 2), 1, (1, 2))


def tyro_args(flags):
    import tyro

    return tyro.cli(g2rpo.Args, args=flags)


@pytest.mark.parametrize(
    "flags,world,expect",
    [
        (["--branch-steps", "4"], 1, "--branch-steps"),
        (["--granularities", "0"], 1, "--granularities"),
        (["--group-size", "1"], 1, "at least 2 images"),
        (["--groups-per-iteration", "3"], 2, "multiple of 2"),  # groups never span ranks
        (["--sigma-grid", "official", "--shift", "0"], 1, "--shift 0"),
        (["--sde-type", "cps", "--branch-steps", "0", "3"], 1, "the last step is trained"),
    ],
)
def test_bad_input_is_one_clear_line(flags, world, expect, tmp_path, tiny_sd3):
    args = tyro_args(_flags(tiny_sd3, tmp_path) + flags)
    with pytest.raises(SystemExit) as e:
        g2rpo.check_args(args, world)
    assert str(e.value.code).startswith("error: ") and expect in str(e.value.code)


@pytest.mark.parametrize("fixture", ["tiny_flux", "tiny_sd3"])
def test_official_sigma_grid_is_the_released_codes(request, fixture):
    """--sigma-grid official: shift 3 (the scheduler config's, or --shift) on linspace(1, 0, T+1) for FLUX too,
    where the pipeline grid is FLUX's dynamic shift and ignores --shift (#17.6)."""
    bb = load_backbone(request.getfixturevalue(fixture))
    res = 720 * bb.vae_scale_factor // 8  # the packed token count of FLUX.1-dev at 720 px: 45 x 45
    official = bb.schedule(16, res, res, grid="official")
    assert round(float(official[7]), 3) == 0.794 and official[0] == 1 and official[-1] == 0
    torch.testing.assert_close(official, bb.schedule(16, res, res, 3.0, grid="official"))
    # --shift is honoured
    assert not torch.allclose(bb.schedule(16, res, res, 2.0, grid="official"), official)
    pipeline = bb.schedule(16, res, res)
    assert pipeline.shape == official.shape and not torch.allclose(pipeline, official, atol=1e-3)
    if fixture == "tiny_flux":
        assert round(float(pipeline[7]), 3) == 0.741
    assert tyro_args([]).sigma_grid == "pipeline"
    assert tyro_args(["--sigma-grid", "official"]).sigma_grid == "official"


def test_branch_steps_and_the_images_they_cost():
    args = tyro_args([])  # the toy default: the first 3 of 10 steps, 12 prompts
    g2rpo.check_args(args, 1)
    assert args.branch_steps == (0, 1, 2) and args.images_per_iteration == 12 * 3 * 3 * 8
    args = tyro_args(
        [
            "--num-steps",
            "16",
            "--groups-per-iteration",
            "4",
            "--branch-steps",
            *map(str, range(7, -1, -1)),
        ]
    )
    g2rpo.check_args(args, 2)  # the paper's first half, given in any order
    assert (
        args.branch_steps == tuple(range(8))
        and args.trained_steps == 8
        and args.prompts_per_rank == 2
    )
    assert args.images_per_rank == 2 * 8 * 3 * 8  # prompts x |M| x |Λ| x G images scored per rank


def test_resume_is_exact(tiny_sd3, tmp_path):
    assert_resume_is_exact(
        SCRIPT,
        lambda name: _flags(tiny_sd3, tmp_path, name),
        4,
        ["--learning-rate", "1e-2", "--eval-every", "100", "--save-every", "2"],
    )


# ---------------------------------------------------------------------------------------------- learning
def test_learning_on_the_toy_world(tmp_path):
    """g2rpo.py itself on the shipped toy model: the eval reward (deterministic ODE, fixed seeds) on the training
    prompts rises within 3 iterations of 2 prompts (a G²RPO prompt costs ~7x a Flow-GRPO one) with G²RPO's default
    branch steps and granularities, 6 sampling steps for training and a 10-step evaluation: -1.146 -> -1.060 (2 torch
    threads, 2026-12-05; the same on the suite's one, 2026-12-06). With the advantages' sign flipped (in the rollout's
    transitions, in mgai_advantages or in the loss) it falls (-1.221 with the rollout's flip; -1.224 with each flip on
    one thread), and with learning rate 1e-30 the two evaluations are equal, so this fails when learning is broken. The
    reward is JPEG compressibility, as in the other scripts' learning tests
    (smooth and dense: 3 iterations show the effect; on the toy world's own scorer this test took 6 iterations and
    4-seed, 20-step evaluations, 0.249 -> 0.367, 2026-12-02)."""
    start, end = toy_world_gain(
        SCRIPT,
        tmp_path,
        *("--groups-per-iteration", "2", "--num-iterations", "3", "--eval-every", "3"),
        *("--eval-seeds-per-prompt", "2", "--num-steps", "6", "--eval-num-steps", "10"),
        *("--reward", "jpeg_compressibility"),
    )
    assert end > start + 0.04, (start, end)


def test_per_k_update_schedule_steps_once_per_branch_step(tmp_path, tiny_sd3):
    """--update-schedule per-k: one optimizer step per branch step, so the later steps are off-policy."""
    run_main(
        SCRIPT,
        *_flags(tiny_sd3, tmp_path),
        "--num-iterations",
        "1",
        "--update-schedule",
        "per-k",
        "--learning-rate",
        "1e-2",
    )
    first = read_metrics(tmp_path / "run")[0]
    assert first["ratio/first_minibatch_max_dev"] < 1e-5  # the first k is still on-policy
    assert first["ratio/max"] - first["ratio/min"] > 1e-6  # later k are trained after an update
    assert first["train/optimizer_steps"] == 2  # |M| = 2


@pytest.mark.parametrize("fixture", ["tiny_sd3", "tiny_flux"])
def test_shared_state_gradient_equals_per_transition_gradient(request, fixture):
    """One forward per shared state x_k, its v given to each of the G members (v[position]), has the gradient of one
    forward per member: within 1e-5 relative, noise > 0, LoRA with non-zero B so every weight gets a gradient."""
    from peft import LoraConfig

    bb = load_backbone(request.getfixturevalue(fixture), "cpu", max_sequence_length=8)
    bb.transformer.requires_grad_(False)
    bb.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v"]
        )
    )
    params = [p for n, p in bb.transformer.named_parameters() if p.requires_grad]
    torch.manual_seed(0)
    for p in params:
        p.data.normal_(0, 0.05)
    P, G, cfg = 2, 3, 4.5 if fixture == "tiny_sd3" else 3.5
    sigmas = bb.schedule(4, RES, RES)
    emb = bb.encode(["a photo of a red circle", "a photo of two blue squares"])
    states = bb.initial_noise(P, RES, RES, generator=torch.Generator().manual_seed(1))
    # transitions (prompt, member), each starting from its prompt's state
    rows_x = states.repeat_interleave(G, 0)
    with torch.no_grad():
        v0 = bb.velocity(rows_x, sigmas[1], emb[torch.arange(P).repeat_interleave(G)], cfg)
        nxt, lp_old, _, _ = sde_step_with_logprob(
            v0,
            rows_x,
            sigmas[1],
            sigmas[2],
            0.9,
            sigma_max=sigmas[1],
            generator=torch.Generator().manual_seed(2),
        )
    adv = torch.randn(P * G, generator=torch.Generator().manual_seed(3))
    state_index = torch.arange(P).repeat_interleave(G)

    def grad(shared: bool):
        for p in params:
            p.grad = None
        state = state_index if shared else torch.arange(P * G)
        r, position, s = g2rpo.micro_batch(state, state.unique())  # the training section's
        v = bb.velocity(rows_x[s], sigmas[1], emb[state_index[s]], cfg)[position]
        _, lp, _, _ = sde_step_with_logprob(
            v, rows_x[r], sigmas[1], sigmas[2], 0.9, prev_sample=nxt[r], sigma_max=sigmas[1]
        )
        (-(adv[r] * torch.exp(lp - lp_old[r]))).sum().backward()
        return (len(s), torch.cat([p.grad.flatten() for p in params]))

    (n_shared, g_shared), (n_rows, g_rows) = grad(True), grad(False)
    assert (n_shared, n_rows) == (P, P * G)  # forwards: one per state against one per transition
    assert g_rows.norm() > 0
    assert ((g_shared - g_rows).norm() / g_rows.norm()).item() < 1e-5
