"""The first GPU job (benchmarks/gpu_first_run.py) on CPU: its tiny run end to end (the same code as on the GPU: the
preflight, the folders, the preset commands, torchrun with DDP and FSDP2 over gloo, fp16 and bf16 honoured on CPU,
evaluation of 64 images, the report's 3 files), its flags refused in one line, a stop signal that ends every child,
its verdict rules, and its full-size commands, estimates and plan (meta device)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import gpu_first_run as job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUTS = {"gpu_first_run.md", "gpu_first_run.json", "gpu_first_run.log"}


def test_without_cuda_it_says_nothing_ran_and_fails(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert job.main(["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "nothing ran" in out[0] and "CUDA" in out[0]
    assert os.listdir(tmp_path) == ["out"] and not os.listdir(
        tmp_path / "out"
    )  # nothing built or written


def test_the_tiny_job_runs_fp16_under_fsdp_with_a_64_image_evaluation(tmp_path, capsys):
    """One row of the job, tiny, on CPU, the one that combines the most: DiffusionNFT's SD3.5-M preset in fp16 with
    loss scaling under FSDP2, evaluating 64 images per batch, after the preflight (imports, a gloo all_reduce). It
    PASSES: 3 iterations (fp16), the last with a finite loss and few exact zeros in its gradient, the loss scale
    logged, no VAE call decoding more than 8 images, no checkpoint written; the out folder holds the report's 3 files
    and nothing else, and only the folders this row needs were built. (Every row runs through the same run_one and
    judge; the rows differ in their flags, whose DDP, bf16 and FLUX paths tests/test_parallel.py runs.)"""
    out, cache = tmp_path / "out", tmp_path / "cache"
    name = "diffusionnft SD3.5-M fp16 fsdp eval 64"
    rc = job.main(["--tiny", "--out", str(out), "--cache", str(cache), "--only", name])
    printed = capsys.readouterr().out
    results = json.loads((out / "gpu_first_run.json").read_text())
    assert rc == 0, printed
    assert set(os.listdir(out)) == OUTPUTS
    assert sorted(os.listdir(cache)) == [
        "reward_tiny",
        "sd35_tiny",
    ]  # no FLUX folder: no FLUX row ran
    (r,) = results
    assert (r["name"], r["precision"], r["parallel"], r["status"]) == (name, "fp16", "fsdp", "PASS")
    assert r["fail"] == [] and r["rc"] == 0, r
    assert [m["iteration"] for m in r["iterations"]] == [0, 1, 2]
    assert r["iterations"][-1]["train/grad_zero_fraction"] <= job.ZERO_LIMIT
    assert all("train/loss_scale" in m for m in r["iterations"])
    assert 0 < r["decode_max"] <= 8 and r["estimate"] > 0
    # the 64-image evaluation decodes in chunks of 8: two evaluations, at least 8 calls each
    assert r["decode_calls"] >= 16
    assert r["checkpoints_skipped"] == [3] and r["checkpoints_written"] == []
    text = (out / "gpu_first_run.md").read_text()
    assert f"[1/1] {name}: PASS" in text and "1 passed, 0 failed, 0 skipped of 1 runs" in text
    assert "Preflight" in text and "gloo all_reduce of one rank: ok" in text
    assert "seconds: rollout" in printed and "memory: no CUDA peak on CPU" in printed
    log = (out / "gpu_first_run.log").read_text()
    assert "===== preflight" in log and f"===== {name}" in log and "torch.distributed.run" in log
    work = r["flags"].split("--output-dir ")[1].split()[0]  # {the job's temporary folder}/runs
    assert os.path.basename(os.path.dirname(work)).startswith(
        "gpu_first_run."
    ) and not os.path.exists(work)


# ------------------------------------------------------------------------------------------- flags: one line each
@pytest.mark.parametrize(
    "flags,said",
    [
        (["--budget-s", "-5"], "--budget-s -5 runs nothing"),
        (["--budget-s", "nan"], "--budget-s nan runs nothing"),
        (
            ["--budget-s", "30"],
            "--budget-s 30 runs nothing: the first row",
        ),  # below the first row's estimate
        (
            ["--only", "nosuchrun"],
            "'nosuchrun': no such row; the rows are 'diffusionnft SD3.5-M fp16",
        ),
        (["--out", "FILE"], "--out FILE is a file, not a folder"),
        (["--cache", "FILE"], "--cache FILE is a file, not a folder"),
    ],
)
def test_a_flag_that_would_run_nothing_or_fail_later_is_one_line(tmp_path, flags, said):
    """#68 item 4: a budget that runs nothing, an unknown row, an --out or --cache that is a file: one line before
    any work (no import of torch, nothing built, nothing written)."""
    (tmp_path / "FILE").write_text("x")
    flags = [str(tmp_path / "FILE") if f == "FILE" else f for f in flags]
    said = said.replace("FILE", str(tmp_path / "FILE"))
    argv = ["--tiny", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), *flags]
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_first_run.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and p.stdout == "", (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines
    assert os.listdir(tmp_path) == ["FILE"]


def test_no_verdict_without_work():
    """A skipped row is SKIPPED, never PASSED, and a job with one exits 1; so does a job that ran nothing. The probe
    passes by answering (its verdict is reported, never a FAIL)."""
    passed = dict(name="a", script="x.py", status="PASS")
    skipped = dict(name="b", script="x.py", status="SKIPPED", why="about 60 s needed, 10 s left")
    probe = dict(
        name="cudnn probe", script=None, status="PROBE", cuda=True, cases=[dict(error=None)]
    )
    line, rc = job.summary([passed, skipped], 100)
    assert rc == 1 and line.startswith("1 passed, 0 failed, 1 skipped of 2 runs; SKIPPED: b")
    assert job.summary([], 1) == ("0 passed, 0 failed, 0 skipped of 0 runs; 1 s in all", 1)
    line, rc = job.summary([passed, probe], 100)
    assert rc == 0 and "cudnn probe: the workaround is no longer needed" in line
    line, rc = job.summary([passed, dict(probe, status="SKIPPED", why="no time")], 100)
    assert rc == 1 and "cudnn probe: SKIPPED" in line
    assert job.run_lines(2, 2, skipped) == ["[2/2] b: SKIPPED: about 60 s needed, 10 s left"]


def test_children_prepend_to_pythonpath(monkeypatch):
    """A folder of carried wheels on PYTHONPATH stays there, after the repository (issue #65: `"PYTHONPATH": ROOT`
    replaced it, and the folder build failed)."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert job.child_env()["PYTHONPATH"] == job.ROOT + os.pathsep + "/tmp/site"
    monkeypatch.delenv("PYTHONPATH")
    assert job.child_env()["PYTHONPATH"] == job.ROOT


def test_the_preflight_stops_the_job_in_one_line_before_the_build(tmp_path, monkeypatch, capsys):
    """A package the runs import that the environment lacks (here a diffusers that fails to import, first on
    PYTHONPATH): one line naming it, exit 1, no folder built, the report's 3 files written."""
    fake = tmp_path / "site" / "diffusers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    out, cache = tmp_path / "out", tmp_path / "cache"
    rc = job.main(
        ["--tiny", "--out", str(out), "--cache", str(cache), "--only", "flowgrpo SD3.5-M"]
    )
    printed = capsys.readouterr().out.strip().splitlines()
    assert rc == 1
    assert (
        printed[-1] == "FAIL: preflight: cannot import diffusers: ImportError: not installed here"
    )
    assert not cache.exists() and set(os.listdir(out)) == OUTPUTS


def test_a_stop_signal_ends_the_running_childs_whole_process_group(tmp_path):
    """SIGTERM to the job while a child runs (as an outer `timeout` sends it): run_process ends the child and every
    process below it, a grandchild in a session of its own too (as torchrun starts its workers), and returns; nothing
    outlives the job. (benchmarks/rehearse_device_call.sh does the same to a real --tiny row mid-run.)"""
    log = tmp_path / "child.log"
    grandchild = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(300)"
    )
    script = (
        f"import signal, sys; sys.path.insert(0, {ROOT!r}); from benchmarks import gpu_first_run as job\n"
        "for s in job.STOP_SIGNALS: signal.signal(s, job._note_signal)\n"
        f"print(*job.run_process([sys.executable, '-c', {grandchild!r}], 600, {str(log)!r}), flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(log.read_text())
    assert alive(pid)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert out.strip() == "-15 stopped by SIGTERM" and p.returncode == 0
    assert not alive(pid)


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its parent to read its status does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------- the verdicts
def verdict(precision="bf16", iterations=None, **changes):
    it = {
        "policy_loss": 0.1,
        "train/grad_zero_fraction": 0.01,
        "train/optimizer_steps": 2,
        "train/skipped_steps": 0,
    }
    r = dict(
        rc=0,
        oom=False,
        last_error="",
        precision=precision,
        decode_max=8,
        peak=50 * job.GiB,
        estimate=48 * job.GiB,
        iterations=iterations
        or [dict(it) for _ in range(job.FP16_ITERATIONS if precision == "fp16" else 2)],
    )
    for k, v in changes.items():
        if k in it:
            r["iterations"][-1] = {**r["iterations"][-1], k: v}
        else:
            r[k] = v
    return job.judge(r)


def steps(*per_iteration):
    """fp16 iterations with (optimizer steps taken, skipped) each."""
    return [
        {
            "policy_loss": 0.1,
            "train/grad_zero_fraction": 0.01 if taken else 0.0,
            "train/optimizer_steps": taken,
            "train/skipped_steps": skipped,
        }
        for taken, skipped in per_iteration
    ]


@pytest.mark.parametrize(
    "changes,reason",
    [
        ({}, None),
        ({"rc": 1, "oom": True}, "out of memory"),
        ({"rc": 1, "last_error": "ValueError: x"}, "exit 1: ValueError: x"),
        ({"train/grad_zero_fraction": 0.93}, "exactly zero"),
        ({"policy_loss": float("nan")}, "no finite loss"),
        ({"decode_max": 64}, "decode call took 64 images"),
        ({"peak": 60 * job.GiB}, "above the estimate"),
        ({"peak": None}, None),  # CPU: no peak to compare
        ({"iterations": steps((1, 0))}, "1 trained iterations"),
        # fp16: a settling overflow skips the one step of an iteration (NFT, G²RPO): not a verdict
        ({"precision": "fp16", "iterations": steps((1, 0), (0, 1), (1, 0))}, None),
        ({"precision": "fp16", "iterations": steps((0, 1), (1, 0), (0, 1))}, None),
        (
            {"precision": "fp16", "iterations": steps((0, 1), (0, 1), (0, 1))},
            "all 3 optimizer steps of 3",
        ),
        ({"precision": "fp16", "iterations": steps((0, 2), (0, 2))}, "too few to judge"),
    ],
)
def test_the_verdict_rules(changes, reason):
    why = verdict(**changes)
    assert (why == []) if reason is None else any(reason in w for w in why), why


def test_error_class_names_what_ended_a_process():
    """The cuDNN probe's answer per case: a signal, a timeout, or the exception's class."""
    assert job.error_class(-11, "", []) == "killed by SIGSEGV"
    assert job.error_class(-9, "timed out after 60 s", []) == "timed out after 60 s"
    lines = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1',
        "torch.AcceleratorError: CUDA error",
    ]
    assert job.error_class(1, "", lines) == "torch.AcceleratorError"
    assert job.error_class(3, "", ["no error line"]) == "exit 3"


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


# ------------------------------------------------------------------------------------- full size, on the meta device
def test_the_full_size_folders_and_runs(tmp_path):
    """At the real shapes (meta device): the folders' transformers and encoders have the published sizes (T5 with
    2 of its layers) and the bytes the preflight asks the disk for; every run's command parses with its script's Args
    and passes its checks; the memory model's estimate of each leaves 10 % of an 80 GB card free, and one-GPU full
    fine-tuning peaks at the optimizer step, about 4 % above its other phases; the probe's cases are its rows'
    settings; the whole plan is estimated at 8 minutes or less on one H100."""
    from benchmarks import bench_memory as bm
    from benchmarks.presets import parse_args

    pipes = {
        "sd35": job.full_size_pipeline("sd3", "meta"),
        "flux": job.full_size_pipeline("flux", "meta"),
    }
    count = {
        n: sum(p.numel() for p in m.parameters())
        for n, m in pipes["flux"].components.items()
        if hasattr(m, "parameters")
    }
    assert round(count["transformer"] / 1e9, 2) == 11.90 and count["text_encoder"] == 123_060_480
    t5 = pipes["flux"].text_encoder_2.config
    assert (t5.d_model, t5.d_ff, t5.num_heads, t5.num_layers) == (4096, 10240, 64, job.T5_LAYERS)
    for name, pipe in pipes.items():
        weights = sum(
            sum(p.numel() * p.element_size() for p in m.parameters())
            for m in pipe.components.values()
            if hasattr(m, "parameters")
        )
        assert 1 <= job.FOLDER_BYTES[name] / weights < 1.02, (name, weights)
    planned = dict(job.planned(str(tmp_path)))
    assert list(planned) == [r.name for r in job.RUNS if r.script]
    for name, e in planned.items():
        assert bm.fits(e["peak"], "80 GB"), (name, e["peak"] / job.GiB)
    full = planned["g2rpo SD3.5-M full fp16 fsdp"]
    others = max(v for k, v in full["phases"].items() if k != "step")
    assert full["phase"] == "step"
    assert 0.03 < full["peak"] / (sum(full["resident"].values()) + others) - 1 < 0.05
    rows = {r.name: r for r in job.RUNS}
    for k, (name, resolution, micro_batch, checkpointing) in enumerate(job.PROBE_CASES):
        flags = job.run_flags(
            rows[name], {"sd35": "/m", "flux": "/m", "reward": "/m"}, str(tmp_path), False
        )
        with pytest.MonkeyPatch.context() as m:
            m.setenv("RANK", "0")
            args = parse_args(rows[name].script, flags, 1)
        assert (args.resolution, args.train_batch_size, args.gradient_checkpointing) == (
            resolution,
            micro_batch,
            checkpointing,
        )
        if k == 0:
            assert (args.lora_target, args.lora_rank, args.lora_alpha) == job.PROBE_LORA
    compile(job.CUDNN_PROBE.format(root="/r", spec="{}"), "cudnn_probe", "exec")
    plan = job.schedule(job.RUNS, str(tmp_path / "cache"), False)
    assert job.PREFLIGHT_S + sum(plan) <= 8 * 60
    assert os.path.exists(os.path.join(tmp_path, "eval_64.txt"))
