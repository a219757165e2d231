"""The GPU throughput benchmark's bookkeeping, checked on CPU with a tiny model.

The benchmark's numbers are only as good as its counts: the rows it attributes to sampling, training and decoding
must be the work the script really did. Here they are compared with what the script's own arithmetic says
(4 trajectories x 4 steps sampled, up to 3 trained steps each with a KL reference forward, 4 decoded images,
and the script's NFE).
"""

import sys
from unittest import mock

import pytest
import torch

from benchmarks import bench_gpu_throughput as bench


def test_without_cuda_it_skips_with_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with mock.patch.object(sys, "argv", ["bench_gpu_throughput.py", "--out", str(tmp_path)]):
        bench.main()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped" in out[0] and "CUDA" in out[0]
    assert not list(tmp_path.iterdir())  # nothing built, nothing written


def test_counts_match_the_scripts_own_accounting(tmp_path):
    path = bench.build_folder("sd35", str(tmp_path / "cache"), tiny=True, device="cpu")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a red circle\n")
    flags = [
        "--model-path",
        path,
        "--resolution",
        "64",
        "--reward",
        "jpeg_compressibility",
        "--num-iterations",
        "2",
        "--eval-every",
        "1000",
        "--eval-prompts",
        str(prompts),
        "--eval-seeds-per-prompt",
        "1",
        "--eval-num-steps",
        "2",
        "--num-steps",
        "4",
        "--group-size",
        "4",
        "--groups-per-iteration",
        "1",
        "--rollout-batch-size",
        "4",
        "--train-batch-size",
        "2",
        "--guidance-scale",
        "4.5",
        "--beta",
        "0.04",
        "--timestep-fraction",
        "0.99",
        "--lora-rank",
        "4",
        "--output-dir",
        str(tmp_path / "runs"),
        "--run-name",
        "r",
        "--save-every",
        "1000",
    ]
    row = bench.run_one("flowgrpo_baseline.py", flags, "sd35")
    kept = row["train_rows"]
    # 3 trained steps of 4 (--timestep-fraction 0.99), zero-advantage rows dropped
    assert 0 < kept <= 4 * 3
    # sampling + the KL reference forward (no grad) of each trained row
    assert row["forward_rows"] == 4 * 4 + kept
    assert row["decode_images"] == 4 and row["reward_images"] == 4
    # the script counts NFE as sampled rows + trained rows + reference rows
    assert row["nfe_iteration"] == 4 * 4 + 2 * kept
    a = bench.ANCHOR["sd35"]
    floor = row["forward_rows"] * a["forward"] + kept * a["train"] + 4 * a["decode"]
    assert row["floor_s"] == pytest.approx(floor)
    phases = row["rollout_s"] + row["reward_phase_s"] + row["train_s"]
    assert row["iteration_s"] == pytest.approx(phases)
    assert row["forward_s"] + row["decode_s"] <= row["rollout_s"] + row["train_s"] + 1e-3
