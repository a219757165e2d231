"""The plumbing of the shared training section: the transitions contract (common/plumbing/transitions.py), the micro-batch plan
(the GRPO scripts' optimizer_steps and micro_batch), the metric reduction (common/plumbing/run.py), the EMA schedule, and the
count of optimizer steps in a real run."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, read_metrics, run_main, tiny_flags, write_prompts

from common.plumbing.plots import STEP_METRICS
from common.plumbing.run import NonFiniteUpdate, Stats, check_finite
from common.plumbing.transitions import TransitionsError, check_transitions
from common.policy import EMA
from common.rewards import group_advantages

sys.path.insert(0, ROOT)
import flowgrpo_baseline as F  # noqa: E402


# ---------------------------------------------------------------------------------------- EMA
def test_ema_schedule_matches_a_hand_computed_sequence():
    """Flow-GRPO's EMA: blend after optimizer step s (0-based) when (s + 1) % interval == 0, with decay
    d_s = min((1 + s) / (10 + s), decay). Parameter values 1, 2, 3, ... after each step."""
    p = {"w": torch.zeros(1)}
    ema = EMA(p, decay=0.9, interval=2, warmup=True)
    expected = 0.0
    for s in range(12):
        p["w"].fill_(s + 1.0)
        ema.update()
        if (s + 1) % 2 == 0:
            d = min((1 + s) / (10 + s), 0.9)
            expected = d * expected + (1 - d) * (s + 1.0)
        assert ema.shadow["w"].item() == pytest.approx(expected, rel=1e-6), s
    # by hand for the first blends: s = 1: d = 2/11 -> 9/11 * 2; s = 3: d = 4/13
    e1 = (9 / 11) * 2
    assert EMA({"w": torch.zeros(1)}, 0.9, 2).current_decay(1) == pytest.approx(2 / 11)
    assert expected != pytest.approx(e1)  # the sequence moved on
    # warm-up off, interval 1: the plain per-step EMA the scripts had before (lerp with 1 - decay every step)
    q = {"w": torch.zeros(1)}
    plain = EMA(q, decay=0.9, interval=1, warmup=False)
    q["w"].fill_(1.0)
    plain.update()
    assert plain.shadow["w"].item() == pytest.approx(0.1)


def test_ema_swap_and_state_roundtrip():
    p = {"w": torch.ones(2)}
    ema = EMA(p, 0.5, 1, warmup=False)
    p["w"].fill_(3.0)
    ema.update()  # shadow 2
    with ema.swapped():
        assert torch.equal(p["w"], torch.full((2,), 2.0))
    assert torch.equal(p["w"], torch.full((2,), 3.0))
    other = EMA({"w": torch.zeros(2)}, 0.5, 1)
    other.load_state_dict(ema.state_dict())
    assert other.steps == 1 and torch.equal(other.shadow["w"], ema.shadow["w"])


# ---------------------------------------------------------------------------------------- micro-batches
def planned(keep, batch, steps, state=None, block=None, epochs=1):
    """The GRPO training section's optimizer steps (flowgrpo_baseline.optimizer_steps, the same in the three
    scripts) on one rank, each as ([its micro-batches (rows, position, first)], kept transitions)."""
    state = torch.arange(len(keep)) if state is None else state
    block = torch.zeros_like(state) if block is None else block
    args = SimpleNamespace(num_inner_epochs=epochs, optimizer_steps_per_iteration=steps)
    return [
        ([F.micro_batch(state, s) for s in step_states.split(batch)], n_kept)
        for step_states, n_kept in F.optimizer_steps(state, keep, block, args, 1)
    ]


def test_the_plan_makes_exactly_the_requested_optimizer_steps():
    """4 optimizer steps over 5 micro-batches' worth of transitions: 4 steps (the old ceil rule made 3)."""
    keep = torch.ones(40, dtype=torch.bool)
    plan = planned(keep, 8, 4)
    assert len(plan) == 4
    rows = torch.cat([mb[0] for mbs, _ in plan for mb in mbs])
    assert sorted(rows.tolist()) == list(range(40))  # every transition exactly once
    assert sum(n_kept for _, n_kept in plan) == 40  # each step's mean divides by its own count
    # --num-inner-epochs: one shuffled pass each
    assert len(planned(keep, 8, 4, epochs=3)) == 3 * len(plan)


def test_the_plan_drops_zero_advantage_transitions_and_keeps_the_mean():
    keep = torch.tensor([True, False, True, True, False, False, True, False])
    ((mbs, n_kept),) = planned(keep, 3, 1)
    rows = torch.cat([mb[0] for mb in mbs])
    assert sorted(rows.tolist()) == [0, 2, 3, 6] and n_kept == 4
    assert sum(len(mb[2]) for mb in mbs) == 4  # dropped transitions cost no forward on one rank


def test_the_plan_with_shared_states_runs_one_forward_per_state():
    """G²RPO: 3 states x 4 members; members of a state share its forward; a state whose members all have
    advantage 0 is not run; `position` maps every row to its state's position."""
    state = torch.arange(3).repeat_interleave(4)
    keep = torch.ones(12, dtype=torch.bool)
    keep[4:8] = False  # state 1: every member tied
    keep[0] = False  # state 0: one member tied
    (([(rows, position, first)], n_kept),) = planned(keep, 8, 1, state=state)
    assert len(first) == 2 and sorted(state[first].tolist()) == [0, 2]
    assert torch.equal(state[rows], state[first][position])
    assert keep[rows].sum() == 7 and n_kept == 7


def test_the_plan_gives_update_blocks_their_own_steps_in_order():
    block = torch.arange(3).repeat_interleave(4)
    plan = planned(torch.ones(12, dtype=torch.bool), 2, 1, block=block)
    assert len(plan) == 3
    assert [sorted(set(block[torch.cat([m[0] for m in mbs])].tolist())) for mbs, _ in plan] == [
        [0],
        [1],
        [2],
    ]


def test_the_plan_with_nothing_kept_is_empty():
    assert planned(torch.zeros(6, dtype=torch.bool), 2, 2) == []


# ---------------------------------------------------------------------------------------- stats
def test_stats_weighted_means_per_step_and_extremes():
    st = Stats(3, ratio=1)
    w = torch.tensor([1.0, 1.0, 0.0, 1.0])
    st.add(w, torch.tensor([0, 0, 1, 2]), ratio=torch.tensor([1.0, 3.0, 100.0, 5.0]))
    st.count(grad_norm=2.0)
    st.count(grad_norm=1.0)
    out = st.reduce(1, "cpu")
    assert out["ratio"] == pytest.approx(3.0) and out["ratio/weight"] == 3
    # step 1 had only weight 0
    assert out["ratio/per_step"] == {
        0: pytest.approx(2.0),
        2: pytest.approx(5.0),
    }
    assert out["ratio/max"] == 5.0 and out["ratio/min"] == 1.0 and out["grad_norm"] == 3.0


# ---------------------------------------------------------------------------------------- contract
def _transitions(n=3, T=2, shape=(4,)):
    """A valid step-major set: row j * n + i is step j of chain i, chains continue from step to step."""
    sigmas = torch.tensor([1.0, 0.6, 0.2, 0.0])
    chain = torch.randn(T + 1, n, *shape)
    step, traj = torch.arange(T).repeat_interleave(n), torch.arange(n).repeat(T)
    return {
        "latents": chain[:T].flatten(0, 1),
        "next_latents": chain[1:].flatten(0, 1),
        "log_prob": torch.zeros(n * T),
        "sigma": sigmas[step],
        "sigma_next": sigmas[step + 1],
        "noise_level": torch.full((n * T,), 0.7),
        "advantage": torch.randn(n * T),
        "prompt_index": traj,
        "step_index": step,
        "trajectory": traj,
    }, sigmas


def test_check_transitions_accepts_a_valid_set_and_catches_order_mistakes():
    tr, sigmas = _transitions()
    check_transitions(tr, sigmas, n_prompts=3)
    # the mistake the old comment invited: per-step values laid out trajectory-major (repeat vs repeat_interleave)
    bad = dict(tr, sigma=sigmas[torch.arange(2).repeat(3)])
    with pytest.raises(TransitionsError, match="step order"):
        check_transitions(bad, sigmas, 3)
    bad = dict(tr, prompt_index=torch.arange(3).repeat_interleave(2))
    with pytest.raises(TransitionsError, match="changes prompt"):
        check_transitions(bad, sigmas, 3)
    bad = dict(tr, latents=tr["latents"].view(2, 3, 4).transpose(0, 1).reshape(6, 4))
    with pytest.raises(TransitionsError, match="next_latents"):
        check_transitions(bad, sigmas, 3)
    with pytest.raises(TransitionsError, match="missing fields"):
        check_transitions({k: v for k, v in tr.items() if k != "step_index"}, sigmas, 3)
    with pytest.raises(TransitionsError, match="dtype"):
        check_transitions(dict(tr, advantage=tr["advantage"].double()), sigmas, 3)
    # rows 0 and 1 start from different latents
    bad = dict(tr, state_index=torch.tensor([0, 0, 1, 2, 2, 3]))
    with pytest.raises(TransitionsError, match="rows of one state"):
        check_transitions(bad, sigmas, 3)
    # the rollout means: optional
    check_transitions(dict(tr, mean=torch.randn_like(tr["latents"])), sigmas, 3)
    with pytest.raises(TransitionsError, match="mean differ in shape"):
        check_transitions(dict(tr, mean=tr["latents"][:, :2]), sigmas, 3)
    # a NaN rollout stops the run in one line (a SystemExit), not with a traceback: the scripts check every
    # iteration's transitions with check_finite (the contract, on a run's first iteration)
    bad = dict(tr, log_prob=torch.full_like(tr["log_prob"], float("nan")))
    with pytest.raises(
        NonFiniteUpdate, match=r"non-finite rollout \('log_prob'\) at iteration 3; stopping before"
    ):
        check_finite("rollout", 3, bad)


def test_no_runtime_check_is_an_assert_so_python_O_keeps_them(monkeypatch):
    """`python -O` drops two things: assert statements and `if __debug__:` blocks. No file of common/ or the scripts
    has either (so a check there raises under -O as it does without), and a check compiled as -O compiles it (the
    same `optimize=1` of the byte-code compiler, in this process: a `python -O` start took 3.5 s here, recompiling
    torch's sources) still raises our error."""
    import ast
    import glob
    import types

    files = glob.glob(os.path.join(ROOT, "common", "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "*.py"))
    stripped = [
        f"{os.path.relpath(f, ROOT)}:{n.lineno}"
        for f in files
        for n in ast.walk(ast.parse(open(f).read()))
        if isinstance(n, ast.Assert) or (isinstance(n, ast.Name) and n.id == "__debug__")
    ]
    assert not stripped, f"runtime checks python -O removes (assert, __debug__): {stripped}"

    path = os.path.join(ROOT, "common", "plumbing", "transitions.py")
    module = types.ModuleType("training_as_python_O")
    # the module's dataclasses look their module up in sys.modules
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(open(path).read(), path, "exec", optimize=1), module.__dict__)
    with pytest.raises(module.TransitionsError, match="missing fields"):
        module.check_transitions({"advantage": torch.zeros(2)}, torch.ones(3), 1)


# ---------------------------------------------------------------------------------------- in a run
@pytest.mark.parametrize("n_opt", [1, 5])  # the old ceil rule made 4 of 5
def test_optimizer_steps_per_iteration_is_honoured(tiny_sd3, tmp_path, n_opt):
    prompts = write_prompts(
        tmp_path / "p.txt", ["a photo of a red circle", "a photo of two blue squares"]
    )
    run_main(
        "flowgrpo_baseline.py",
        *tiny_flags(tiny_sd3, tmp_path, prompts),
        "--num-iterations",
        "1",
        "--eval-every",
        "100",
        "--group-size",
        "4",
        "--rollout-batch-size",
        "4",
        "--train-batch-size",
        "1",
        "--optimizer-steps-per-iteration",
        str(n_opt),
        "--no-drop-zero-advantage",
    )
    m = read_metrics(tmp_path / "run")[0]
    assert m["train/optimizer_steps"] == n_opt  # 8 images x 2 trained steps = 16 micro-batches of 1
    assert m["nfe/train_forward"] == m["nfe/train_backward"] == 16
    # per-step diagnostics: one value per trained step (2 of 3), consistent with the overall numbers (every step has
    # 8 transitions, all kept, so the overall mean is the mean of the per-step means)
    logged = {key.split("/")[1] for key in m if key.startswith("steps/")}
    # what the heat map draws, each with its label (a renamed key would be lost); the gradient share only when asked,
    # the dense reward's statistics only in DenseGRPO
    assert logged == set(STEP_METRICS) - {"grad_share", "grad_norm", "dR_abs", "dR_zero"}
    for k in logged:
        assert sorted(int(key.rsplit("/", 1)[1]) for key in m if key.startswith(f"steps/{k}/")) == [
            0,
            1,
        ], k
    assert m["steps/kept/0"] == m["steps/kept/1"] == 1.0
    assert (m["steps/ratio/0"] + m["steps/ratio/1"]) / 2 == pytest.approx(
        m["ratio/mean"], abs=1e-12
    )
    assert (m["steps/clipfrac/0"] + m["steps/clipfrac/1"]) / 2 == pytest.approx(
        m["clipfrac"], abs=1e-12
    )
    assert all(m[f"steps/ratio_std/{j}"] >= 0 for j in (0, 1))
    if n_opt > 1:  # later optimizer steps are off-policy: the ratio spreads
        assert m["ratio/max"] > m["ratio/min"]


def test_tied_groups_get_exactly_zero_advantage():
    """Groups whose rewards are tied at a partial credit (0.3, 2/3, ...) get A = 0 exactly, at several group sizes and
    with either std, so --drop-zero-advantage drops them; in float32 the rounded group mean left 1e-7..3e-4."""

    for value in (0.3, 2 / 3, 0.1, 0.7, 1 / 3):
        for G in (3, 8, 24):
            tied = torch.full((G,), value, dtype=torch.float32)
            varied = torch.linspace(0, 1, G)
            rewards = torch.cat([tied, varied, tied + 0.05])
            group = torch.arange(3).repeat_interleave(G)
            for global_std in (True, False):
                a = group_advantages(rewards, group, global_std, 1e-4)
                assert a.dtype == torch.float32
                assert torch.equal(a[:G], torch.zeros(G)) and torch.equal(
                    a[2 * G :], torch.zeros(G)
                ), (value, G)
                assert (
                    a[G : 2 * G] != 0
                ).sum() >= G - 1  # the varied group still has its advantages


def test_cfg_gradient_goes_through_both_branches_unless_detached(tiny_sd3):
    """Default (the paper): d/dθ of v = v_u + w (v_c - v_u) is w dv_c - (w - 1) dv_u; --detach-uncond keeps only
    w dv_c. The scripts default to the former (the old code hard-coded the latter)."""
    from peft import LoraConfig

    import flowgrpo_baseline
    from common.backbones import load_backbone

    assert flowgrpo_baseline.Args().detach_uncond is False
    bb = load_backbone(tiny_sd3, "cpu", max_sequence_length=8)
    bb.transformer.requires_grad_(False)
    bb.transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q"])
    )
    params = [p for p in bb.transformer.parameters() if p.requires_grad]
    torch.manual_seed(0)
    for p in params:
        p.data.normal_(0, 0.05)
    emb = bb.encode(["a photo of a red circle"])
    x = bb.initial_noise(1, 64, 64, generator=torch.Generator().manual_seed(1))
    w = 4.5

    def grad(fn):
        for p in params:
            p.grad = None
        fn().sum().backward()
        return torch.cat([p.grad.flatten() for p in params])

    both = grad(lambda: bb.velocity(x, 0.7, emb, w))
    cond_only = grad(lambda: bb.velocity(x, 0.7, emb, w, detach_uncond=True))
    g_c = grad(lambda: bb.velocity(x, 0.7, emb, 1.0))  # the conditional branch alone
    g_u = grad(
        lambda: bb.transformer(
            hidden_states=x,
            timestep=torch.full((1,), 700.0),
            encoder_hidden_states=emb.neg_embeds,
            pooled_projections=emb.neg_pooled,
            return_dict=False,
        )[0].float()
    )
    torch.testing.assert_close(both, w * g_c - (w - 1) * g_u, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(cond_only, w * g_c, rtol=1e-4, atol=1e-6)
    assert (both - cond_only).norm() > 1e-3 * both.norm()


@pytest.mark.parametrize("fixture", ["tiny_sd3", "tiny_flux"])
def test_full_finetune_in_bf16_computes_under_autocast(fixture, request):
    """On CUDA the frozen weights load in bf16 and full fine-tuning turns the transformer into fp32 masters while the
    latents and text embeddings stay bf16: a plain forward then fails on the dtype mismatch (the bug this guards).
    Emulated on the CPU by loading in bf16: the policy, the sampling call and the frozen KL reference must all run,
    close to the fp32 model, and the gradient must land on the fp32 masters."""
    from common.backbones import load_backbone
    from common.policy import Trainable

    path = request.getfixturevalue(fixture)
    bb = load_backbone(path, "cpu", max_sequence_length=8)
    emb = bb.encode(["a photo of a red circle", "a photo of two blue squares"])
    x = bb.initial_noise(2, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v32 = bb.velocity(x, 0.7, emb, 4.5)
    bb.pipe.to(torch.bfloat16)  # what load_backbone does on CUDA
    bb.dtype = torch.bfloat16
    emb = bb.encode(["a photo of a red circle", "a photo of two blue squares"])
    trainable = Trainable(
        bb,
        full_finetune=True,
        lora_rank=4,
        lora_alpha=4,
        lora_targets=["to_q"],
        need_reference=True,
    )
    assert all(p.dtype == torch.float32 for p in trainable.params.values())
    v = bb.velocity(x, 0.7, emb, 4.5)
    v.square().mean().backward()
    v_ref = bb.velocity(x, 0.7, emb, 4.5, model=trainable.reference)
    for out in (v, v_ref):
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert (out - v32).norm() < 0.05 * v32.norm(), (out - v32).norm() / v32.norm()
    grads = [p.grad for p in trainable.params.values()]
    assert (
        all(g is not None and g.dtype == torch.float32 for g in grads)
        and sum(g.norm() for g in grads) > 0
    )


def test_grad_share_splits_the_gradient_by_step_exactly_as_separate_backward_passes():
    """GradShare, fed micro-batch by micro-batch, gives each step's gradient as a backward pass over that step's
    transitions alone would; the shares g_j . g / |g|^2 sum to 1; and .grad (the update) is left alone."""
    from common.plumbing.transitions import GradShare

    torch.manual_seed(0)
    net = torch.nn.Linear(6, 1)
    params = dict(net.named_parameters())
    x, steps = torch.randn(12, 6), torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 2, 2, 1, 0])
    weight = torch.rand(12)

    def row_loss(rows):
        return (net(x[rows]).squeeze(1) ** 2 - 0.3 * net(x[rows]).squeeze(1)) * weight[rows]

    share = GradShare(params, num_slots=4)  # slot 3: a step with no transition
    for rows in (torch.arange(0, 5), torch.arange(5, 12)):  # two micro-batches, steps mixed in each
        loss = row_loss(rows)
        share.add(loss, steps[rows])
        loss.sum().backward()
    accumulated = torch.cat([p.grad.flatten() for p in params.values()]).double()
    separate = []
    for j in range(3):
        grads = torch.autograd.grad(
            row_loss((steps == j).nonzero().squeeze(1)).sum(), list(params.values())
        )
        separate.append(torch.cat([g.flatten() for g in grads]).double())
    for j in range(3):
        # float32 sums, split differently
        assert torch.allclose(share.grads[j], separate[j], atol=1e-6), j
    assert share.grads[3] is None and torch.allclose(sum(separate), accumulated, atol=1e-6)
    total = sum(separate)
    expect = {j: float(separate[j] @ total / (total @ total)) for j in range(3)}
    assert share.shares() == pytest.approx(expect, abs=1e-6) and sum(
        share.shares().values()
    ) == pytest.approx(1.0)
    assert share.norms() == pytest.approx({j: float(separate[j].norm()) for j in range(3)})
