"""Run a training script the way a user does (`python script.py ...` or `torchrun ...`) and read its outputs."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_env() -> dict:
    """The environment a script runs in as a subprocess of the tests: offline, no wandb, this repo, and the one
    torch thread of the test process that starts it (tests/conftest.py)."""
    return {
        **os.environ,
        "PYTHONPATH": ROOT,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"),
    }


def run_script(script: str, *flags: str, nproc: int = 1, check: bool = True, timeout: int = 300):
    """Run `script` with `flags` in a subprocess (1 process, or `nproc` ranks under torchrun); return the result."""
    env = script_env()
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            os.path.join(ROOT, script),
            *flags,
        ]
    else:
        cmd = [sys.executable, os.path.join(ROOT, script), *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        )
    return r


def run_main(script: str, *flags: str) -> None:
    """Run `script` as __main__ inside this process (the imports are already paid: much faster than a
    subprocess on 2 cores). A clean exit returns; an error exit raises."""
    import runpy
    from unittest import mock

    with mock.patch.object(sys, "argv", [script, *flags]):
        try:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise


def exit_message(monkeypatch, script: str, *flags: str) -> str:
    """Run `script` as __main__ in this process with `flags` and return the message it exits with (bad input: one
    line); monkeypatch is pytest's fixture (sys.argv is restored after the test)."""
    import runpy

    import pytest

    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    return str(e.value.code)


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_prompts(path, prompts) -> str:
    with open(path, "w") as f:
        f.write("\n".join(prompts) + "\n")
    return str(path)


def tiny_flags(
    model_path: str, out_dir: str, prompts_file: str, run_name: str = "run"
) -> list[str]:
    """The smallest meaningful run on a tiny random model: 2 prompts x group 2, 3 steps, 64 px."""
    return [
        "--model-path",
        model_path,
        "--output-dir",
        str(out_dir),
        "--run-name",
        run_name,
        "--resolution",
        "64",
        "--max-sequence-length",
        "8",
        "--num-steps",
        "3",
        "--eval-num-steps",
        "2",
        "--groups-per-iteration",
        "2",
        "--group-size",
        "2",
        "--rollout-batch-size",
        "2",
        "--prompts-file",
        prompts_file,
        "--eval-prompts",
        prompts_file,
        "--eval-seeds-per-prompt",
        "1",
        "--reward",
        "jpeg_compressibility",
        "--timestep-fraction",
        "0.99",
        "--lora-rank",
        "4",
    ]


# The learning tests' prompts: counting prompts of the toy world, trained and evaluated on (the eval reward
# is deterministic: ODE samples from fixed seeds, so a run that learns nothing reads the same twice).
TOY_LEARNING_PROMPTS = [
    "a photo of three red squares",
    "a photo of three blue squares",
    "a photo of three green triangles",
    "a photo of three red triangles",
]


def toy_world_gain(script: str, tmp_path, *flags: str) -> tuple[float, float]:
    """Run `script` itself (its rollout and its training section, as `python script.py` does) on the
    shipped toy model, trained and evaluated on TOY_LEARNING_PROMPTS, with `flags` (the budget and the
    reward); returns the eval reward mean at the first and at the last evaluation. A learning test
    asserts a gain: with the advantage's sign flipped anywhere the script computes or uses it the
    reward falls, and with a learning rate of 1e-30 (the flag check refuses 0) the two evaluations are equal."""
    prompts = write_prompts(os.path.join(tmp_path, "learning_prompts.txt"), TOY_LEARNING_PROMPTS)
    run_main(
        script,
        *("--prompts-file", prompts, "--eval-prompts", prompts),
        *("--output-dir", str(tmp_path), "--run-name", "toy"),
        *flags,
    )
    m = [row for row in read_metrics(os.path.join(tmp_path, "toy")) if "eval/reward_mean" in row]
    return m[0]["eval/reward_mean"], m[-1]["eval/reward_mean"]


def assert_resume_is_exact(script: str, flags_for, total: int, extra, between=None) -> None:
    """Run `total` iterations straight, and total // 2 + resume + the rest; the trained weights (and the EMA,
    when there is one) must be bit-identical. `flags_for(run_name)` gives a run's base flags; `between(run_dir)`, if
    given, runs before the resume (e.g. deletes a side file the resume must not need)."""
    import torch

    run_main(script, *flags_for("straight"), "--num-iterations", str(total), *extra)
    run_main(script, *flags_for("split"), "--num-iterations", str(total // 2), *extra)
    out = flags_for("split")[flags_for("split").index("--output-dir") + 1]
    # the run folder: resume takes its latest complete checkpoint-N
    run = os.path.join(out, "split")
    if between is not None:
        between(run)
    run_main(script, *flags_for("split"), "--num-iterations", str(total), "--resume", run, *extra)
    a = torch.load(
        os.path.join(out, "straight", f"checkpoint-{total}", "trainer_state.pt"), weights_only=False
    )
    b = torch.load(os.path.join(run, f"checkpoint-{total}", "trainer_state.pt"), weights_only=False)
    assert a["iteration"] == b["iteration"] == total and a["counts"] == b["counts"]
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
        if a["ema"] is not None:
            assert torch.equal(a["ema"]["shadow"][k], b["ema"]["shadow"][k]), k
    assert any(v.abs().sum() > 0 for k, v in a["params"].items() if "lora_B" in k)  # it did train


def stock_pipeline_image(pipe, prompt: str, guidance_scale: float = 1.0):
    """One 64 px image in 2 steps from a stock diffusers pipeline, seed 0, as a tensor: the same call before and
    after loading trained weights, so that any difference is the weights'."""
    import torch

    return pipe(
        prompt,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=guidance_scale,
        max_sequence_length=8,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
