"""The yardstick (benchmarks/yardstick_raft.py): which images it keeps, and a short run on the shipped toy model that
writes the metrics the comparison harness reads, stops on its CPU budget and trains the LoRA."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import read_metrics, run_main, write_prompts  # noqa: E402

from benchmarks.yardstick_raft import select  # noqa: E402

SCRIPT = "benchmarks/yardstick_raft.py"


def test_select_keeps_the_best_of_each_group_with_a_spread():
    rewards = torch.tensor([0.1, 0.9, 0.6, 0.3, 0.3, 0.3, 0.2, 0.8])
    group = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    correct = torch.tensor([False, True, False, False, False, True, False, True])
    # group 1 is tied: none
    assert select(rewards, correct, group, "best").nonzero().squeeze(1).tolist() == [
        1,
        7,
    ]
    assert select(rewards, correct, group, "correct").nonzero().squeeze(1).tolist() == [1, 5, 7]
    assert select(rewards, correct, group, "above_mean").nonzero().squeeze(1).tolist() == [1, 2, 7]


def test_short_run_logs_the_harness_keys_and_stops_on_its_budget(tmp_path):
    evals = write_prompts(
        tmp_path / "eval.txt", ["a photo of a red circle", "a photo of two blue squares"]
    )
    common = [
        "--output-dir",
        str(tmp_path),
        "--eval-prompts",
        evals,
        "--num-steps",
        "3",
        "--eval-num-steps",
        "2",
        "--groups-per-iteration",
        "2",
        "--group-size",
        "4",
        "--eval-seeds-per-prompt",
        "1",
        "--final-eval-seeds-per-prompt",
        "3",
        "--learning-rate",
        "1e-3",
    ]
    # a budget far below one iteration: the run stops at the first boundary after iteration 0, evaluates, exits 0
    run_main(
        SCRIPT, *common, "--run-name", "run", "--num-iterations", "1000", "--cpu-budget-s", "0.01"
    )
    m = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in m] == [0, 1] and m[-1]["final"] and not m[0].get("final")
    assert m[0]["time/cpu_s"] > 0.01
    for key in (
        "eval/accuracy",
        "eval/accuracy_single",
        "eval/accuracy_counting",
        "eval/accuracy_se",
        "eval/reward_mean",
        "nfe",
        "nfe/rollout",
        "nfe/completion",
        "nfe/train_forward",
        "nfe/train_backward",
        "nfe/eval",
        "trajectories",
        "scored_images",
        "time/cpu_s",
        "time/elapsed_s",
    ):
        assert all(key in r for r in m), key
    assert (
        "train/reward_mean" in m[0]
        and m[1]["trajectories"] == m[1]["scored_images"] == 8
        and m[1]["nfe/rollout"] == 8 * 3
    )
    # the periodic evaluation (1 seed), the final one (3 seeds)
    assert m[-1]["nfe/eval"] == 2 * 1 * 2 + 2 * 3 * 2
    assert m[-1]["nfe"] == sum(
        m[-1][f"nfe/{k}"] for k in ("rollout", "completion", "train_forward")
    )
    lora = torch.load(tmp_path / "run" / "lora.pt")
    # B starts at 0: it trained
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)
