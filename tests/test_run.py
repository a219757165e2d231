"""The main loop's bookkeeping (common/plumbing/run.py) on its own: when the loop stops, what a metrics row holds, what a
checkpoint holds, what the evaluation saves, and the counters of an old checkpoint. No model is loaded: fast."""

import json
import os
import sys
from dataclasses import make_dataclass
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common.plumbing.run as run_module  # noqa: E402
from common.plumbing.checkpoint import list_checkpoints  # noqa: E402
from common.plumbing.checks import ConfigError  # noqa: E402
from common.plumbing.resume import load_checkpoint  # noqa: E402
from common.plumbing.run import (  # noqa: E402
    COUNTERS,
    Run,
    RunLogger,  # noqa: E402
    Stats,
    restored_counts,
    summary_line,
    training_nfe,
)


def make_args(**kw):
    base = dict(
        exp_name="t",
        num_iterations=3,
        cpu_budget_s=0.0,
        keep_checkpoints=2,
        eval_seeds_per_prompt=2,
        final_eval_seeds_per_prompt=None,
        guidance_scale=4.5,
        eval_guidance_scale=None,
        eval_num_steps=5,
        shift=None,
        eval_batch_size=8,
        resolution=32,
    )
    return SimpleNamespace(**{**base, **kw})


def make_run(tmp_path, counts=None, **kw):
    args = make_args(**kw)
    logger = RunLogger(str(tmp_path), True, False, {}, "p", None, "n")
    return Run(args, str(tmp_path), 0, 1, torch.device("cpu"), logger, counts, 0, "script.py")


def grpo_stats(num_steps):
    """The GRPO training section's Stats: the means it logs, at their value when nothing trained."""
    return Stats(num_steps, ratio=1, clipfrac=0, approx_kl_k2=0, kl=0, policy_loss=0)


def rows(tmp_path):
    with open(tmp_path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_the_loop_stops_at_the_last_iteration_or_once_the_cpu_budget_is_spent(tmp_path):
    run = make_run(tmp_path)
    assert [run.is_last(i) for i in range(4)] == [False, False, False, True]
    spent = make_run(tmp_path, cpu_budget_s=1e-9)
    while spent.cpu_seconds() <= 1e-9:
        sum(range(1000))
    assert spent.is_last(0)
    assert not make_run(tmp_path, cpu_budget_s=1e6).is_last(0)


def test_a_resumed_run_continues_its_clocks_and_its_cpu_budget(tmp_path):
    # the checkpoint's clocks (restore_checkpoint merges them into the counts): a resume that
    # restarted them would give a killed budget run a fresh budget and reset time/cpu_s
    saved = {"trajectories": 5, "time/cpu_s": 100.0, "time/elapsed_s": 50.0}
    run = make_run(tmp_path, counts=saved, cpu_budget_s=150.0)
    assert 100.0 <= run.cpu_seconds() < 101.0 and 50.0 <= run._clocks()["time/elapsed_s"] < 51.0
    assert not run.is_last(0) and make_run(tmp_path, counts=saved, cpu_budget_s=99.0).is_last(0)
    assert "time/cpu_s" not in run.counts  # a clock, not a counter: not summed into the rows
    run.args = make_dataclass("Args", [("keep_checkpoints", int, 2)])()
    w = torch.nn.Parameter(torch.ones(2))
    run.bind(None, None, None, [], {"w": w}, torch.optim.AdamW([w]), None, None, lambda f: None)
    run.checkpoint(3)
    ((_, folder),) = list_checkpoints(str(tmp_path))
    assert load_checkpoint(folder)["clocks"]["time/cpu_s"] >= 100.0


def test_a_training_row_holds_the_counters_the_reduced_stats_and_the_phase_times(tmp_path):
    run = make_run(tmp_path, counts={"trajectories": 8, "scored_images": 80, "nfe/rollout": 30})
    stats = grpo_stats(3)
    steps = torch.tensor([0, 0, 2])
    stats.add(
        torch.ones(3),
        steps,
        ratio=torch.tensor([1.0, 1.2, 0.8]),
        ratio_sq=torch.tensor([1.0, 1.44, 0.64]),
        kl=torch.zeros(3),
        clipfrac=torch.tensor([0.0, 1.0, 1.0]),
        policy_loss=torch.ones(3),
        approx_kl_k2=torch.zeros(3),
        abs_adv=torch.ones(3),
        kept=torch.ones(3),
    )
    stats.first(ratio_dev=torch.tensor(0.25))
    stats.first(ratio_dev=torch.tensor(9.0))  # only the first micro-batch counts
    stats.count(grad_norm=3.0, optimizer_steps=1)
    stats.count(grad_norm=5.0, optimizer_steps=1)
    with run.timer("rollout"):
        pass
    counts = {"trajectories": 4, "scored_images": 44, "nfe/rollout": 12}
    m = run.log({"iteration": 0}, stats, SimpleNamespace(metrics={}, counts=counts))
    assert m["trajectories"] == 12 and m["scored_images"] == 124 and m["nfe/rollout"] == 42
    assert m["nfe"] == training_nfe(run.counts) == 42
    assert m["ratio/mean"] == pytest.approx(1.0) and m["ratio/max"] == pytest.approx(1.2)
    assert m["ratio/min"] == pytest.approx(0.8) and m["clipfrac"] == pytest.approx(2 / 3)
    assert m["steps/ratio/0"] == pytest.approx(1.1) and m["steps/ratio/2"] == pytest.approx(0.8)
    # step 1 had no transition
    assert m["steps/ratio_std/0"] == pytest.approx(0.1, rel=1e-5) and "steps/ratio/1" not in m
    # the mean over steps
    assert m["grad_norm"] == pytest.approx(4.0) and m["train/optimizer_steps"] == 2
    assert (
        m["ratio/first_minibatch_max_dev"] == pytest.approx(0.25)
        and m["train/kept_transitions"] == 3
    )
    # train: what the iteration took besides the timed phases
    assert m["time/rollout_s"] >= 0 and m["time/train_s"] >= 0 and "time/cpu_s" in m
    # written, and the phase timers start again
    assert rows(tmp_path) == [m] and run.timer.times == {}


def test_an_iteration_that_trained_nothing_logs_a_ratio_of_one(tmp_path):
    run = make_run(tmp_path)
    rollout = SimpleNamespace(metrics={"train/reward_mean": 0.5}, counts={"trajectories": 4})
    m = run.log({"iteration": 0}, grpo_stats(2), rollout)
    assert m["train/reward_mean"] == 0.5 and m["trajectories"] == 4
    assert m["ratio/mean"] == m["ratio/min"] == m["ratio/max"] == 1.0 and m["grad_norm"] == 0.0
    assert m["ratio/first_minibatch_max_dev"] == 0.0 and m["train/optimizer_steps"] == 0


def test_the_final_row_is_marked_and_carries_the_runs_counters(tmp_path):
    run = make_run(tmp_path, counts={"trajectories": 64, "nfe/eval": 10})
    run.log_final({"iteration": 3, "eval/accuracy": 0.5})
    (row,) = rows(tmp_path)
    assert (
        row["final"] is True
        and row["trajectories"] == 64
        and row["nfe/eval"] == 10
        and row["nfe"] == 0
    )


def test_a_checkpoint_holds_the_counters_the_rng_the_args_and_the_script(tmp_path):
    run = make_run(tmp_path, counts={"trajectories": 5})
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([w], lr=0.1)
    run.args = make_dataclass(
        "Args", [("keep_checkpoints", int, 2), ("seed", int, 7)]
    )()  # asdict needs a dataclass

    def save_weights(folder):
        torch.save({"w": w.detach()}, os.path.join(folder, "weights.pt"))

    side = {"psi.json": '{"psi": [0.5]}'}  # a script's own file, handed to every checkpoint
    run.bind(None, None, None, [], {"w": w}, optimizer, None, None, save_weights, side)
    run.checkpoint(4)
    ((it, folder),) = list_checkpoints(str(tmp_path))
    state = load_checkpoint(folder)
    assert it == 4 and state["iteration"] == 4 and state["counts"]["trajectories"] == 5
    assert state["script"] == "script.py" and state["args"]["seed"] == 7 and len(state["rng"]) == 1
    assert os.path.exists(os.path.join(folder, "weights.pt"))
    with open(os.path.join(folder, "psi.json")) as f:
        assert f.read() == side["psi.json"]


def test_the_evaluation_uses_the_final_seeds_at_the_end_counts_its_nfe_and_saves_its_pictures(
    tmp_path, monkeypatch
):
    calls = []

    class Grid:
        def save(self, path):
            open(path, "w").close()

    class Panel(Grid):
        def captioned(self):
            return []

    def fake_evaluate(backbone, reward, guard, prompts, steps, shift, guidance, seeds, *rest, **kw):
        calls.append((seeds, guidance))
        return {"eval/accuracy": 0.5, "eval/reward_mean": 0.1}, Grid(), Panel()

    monkeypatch.setattr(run_module, "evaluate", fake_evaluate)
    run = make_run(tmp_path, final_eval_seeds_per_prompt=8)
    prompts = ["a", "b", "c"]
    run.bind(None, None, None, prompts, {}, None, None, None, None)
    assert run.evaluate(0, False) == {
        "eval/accuracy": 0.5,
        "eval/reward_mean": 0.1,
    }
    run.evaluate(3, True)
    # periodic: 2 seeds per prompt; final: 8; eval guidance = the rollout's
    assert calls == [
        (2, 4.5),
        (8, 4.5),
    ]
    assert run.counts["nfe/eval"] == 3 * 2 * 5 + 3 * 8 * 5
    assert sorted(os.listdir(tmp_path / "samples")) == [
        "eval_00000.npz",
        "eval_00000.png",
        "eval_00003.npz",
        "eval_00003.png",
    ]
    assert run.last_eval == "0.500@3" and run.pictures is not None


def test_an_old_checkpoints_counters_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="before 2026-12-03"):
        restored_counts({"images": 704, "nfe/rollout": 10})
    assert restored_counts({"trajectories": 3})["trajectories"] == 3
    assert restored_counts(None) == dict.fromkeys(COUNTERS, 0)


def test_the_summary_names_the_first_and_last_evaluation():
    history = [
        {"iteration": 0, "eval/accuracy": 0.471, "eval/accuracy_se": 0.018},
        {"iteration": 1},
        {"iteration": 30, "eval/accuracy": 0.59, "eval/accuracy_se": 0.017},
    ]
    assert summary_line(history) == (
        "held-out eval/accuracy: 0.471 ± 0.018 at iteration 0 -> 0.590 ± 0.017 at iteration 30"
    )
    assert summary_line([{"iteration": 0, "eval/reward_mean": 0.25}]) == (
        "held-out eval/reward_mean: 0.250 at iteration 0 -> 0.250 at iteration 0"
    )
