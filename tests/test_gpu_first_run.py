"""The first GPU job (benchmarks/gpu_first_run.py) on CPU: its tiny run end to end (the same code as on the GPU: the
folders, the preset commands, torchrun with DDP and FSDP2 over gloo, fp16 and bf16 honoured on CPU, evaluation of 64
images, the report), its verdict rules, and its full-size commands and estimates (meta device)."""

import json
import os

import pytest

from benchmarks import gpu_first_run as job


def test_without_cuda_it_skips_with_one_line(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert job.main(["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped" in out[0] and "CUDA" in out[0]
    assert not list(tmp_path.iterdir())  # nothing built, nothing written


def test_the_tiny_job_runs_fp16_under_fsdp_with_a_64_image_evaluation(tmp_path, capsys):
    """One row of the job, tiny, on CPU, the one that combines the most: DiffusionNFT's SD3.5-M preset in fp16 with
    loss scaling under FSDP2, evaluating 64 images per batch. It PASSES: iteration 1 has a finite loss and few exact
    zeros in its gradient, the loss scale is logged, no VAE call decodes more than 8 images. (Every row runs through
    the same run_one and judge; the rows differ in their flags, whose DDP, bf16 and FLUX paths
    tests/test_parallel.py runs. A row takes ~9 s on 2 cores, nearly all of it the launch's imports, so the test runs one.)"""
    out = tmp_path / "out"
    name = "diffusionnft SD3.5-M fp16 fsdp eval 64"
    rc = job.main(["--tiny", "--out", str(out), "--cache", str(tmp_path / "cache"), "--only", name])
    printed = capsys.readouterr().out
    results = json.loads((out / "gpu_first_run.json").read_text())
    assert rc == 0, printed
    assert [r["name"] for r in results] == [name]
    (r,) = results
    assert (r["precision"], r["parallel"]) == ("fp16", "fsdp")
    assert r["fail"] == [] and r["rc"] == 0, r
    assert r["iteration1"]["train/grad_zero_fraction"] <= job.ZERO_LIMIT
    assert 0 < r["decode_max"] <= 8 and r["estimate"] > 0
    assert "train/loss_scale" in r["iteration1"]
    # the 64-image evaluation decodes in chunks of 8: two evaluations, at least 8 calls each
    assert r["decode_calls"] >= 16
    text = (out / "gpu_first_run.md").read_text()
    assert f"[1/1] {name}: PASS" in text and "1 of 1 passed" in text
    assert "seconds: rollout" in printed and "memory: no CUDA peak on CPU" in printed


def verdict(**changes):
    r = dict(
        rc=0,
        oom=False,
        last_error="",
        precision="fp16",
        decode_max=8,
        peak=50 * job.GiB,
        estimate=48 * job.GiB,
        iteration1={
            "policy_loss": 0.1,
            "train/grad_zero_fraction": 0.01,
            "train/optimizer_steps": 2,
            "train/skipped_steps": 1,
        },
    )
    for k, v in changes.items():
        if k in r["iteration1"]:
            r["iteration1"] = {**r["iteration1"], k: v}
        else:
            r[k] = v
    return job.judge(r)


@pytest.mark.parametrize(
    "changes,reason",
    [
        ({}, None),
        ({"rc": 1, "oom": True}, "out of memory"),
        ({"rc": 1, "last_error": "ValueError: x"}, "exit 1: ValueError: x"),
        ({"train/grad_zero_fraction": 0.93}, "exactly zero"),
        ({"policy_loss": float("nan")}, "no finite loss"),
        ({"train/skipped_steps": 2, "train/optimizer_steps": 0}, "steps of iteration 1 skipped"),
        ({"decode_max": 64}, "decode call took 64 images"),
        ({"peak": 60 * job.GiB}, "above the estimate"),
        ({"peak": None}, None),  # CPU: no peak to compare
    ],
)
def test_the_verdict_rules(changes, reason):
    why = verdict(**changes)
    assert (why == []) if reason is None else any(reason in w for w in why), why


def test_override_replaces_a_flags_values():
    argv = ["--a", "1", "--b", "0", "1", "2", "--c", "--d", "x"]
    assert job.override(argv, {"--b": [5], "--c": None, "--e": []}) == [
        "--a",
        "1",
        "--d",
        "x",
        "--b",
        "5",
        "--e",
    ]


def test_the_full_size_folders_and_runs(tmp_path):
    """At the real shapes (meta device): the folders' transformers and encoders have the published sizes (T5 with
    2 of its layers), every run's command parses with its script's Args and passes its checks, and the memory
    model's estimate of each leaves 10 % of an 80 GB card free."""
    from benchmarks import bench_memory as bm

    flux = job.full_size_pipeline("flux", "meta")
    count = {
        n: sum(p.numel() for p in m.parameters())
        for n, m in flux.components.items()
        if hasattr(m, "parameters")
    }
    assert round(count["transformer"] / 1e9, 2) == 11.90 and count["text_encoder"] == 123_060_480
    t5 = flux.text_encoder_2.config
    assert (t5.d_model, t5.d_ff, t5.num_heads, t5.num_layers) == (4096, 10240, 64, job.T5_LAYERS)
    planned = job.planned(str(tmp_path))
    assert len(planned) == len([r for r in job.RUNS if r[1]])
    for name, e in planned:
        assert bm.fits(e["peak"], "80 GB"), (name, e["peak"] / job.GiB)
    compile(job.CUDNN_PROBE.format(root="/r", path="/p"), "cudnn_probe", "exec")
    assert os.path.exists(os.path.join(tmp_path, "eval_64.txt"))
