"""Issue #38, class 4: what can be checked before the model load is checked there. Each bad input below used to be a
traceback after the backbone had loaded (or after a whole rollout, or an exit 0 having trained nothing); now each is
one line, the backbone is never loaded, and the run folder holds nothing a run writes."""

import json
import os
import runpy
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.plumbing.run_folder import run_outputs  # noqa: E402


def _files(tmp_path, tiny_sd3) -> dict:
    """The bad files the cases point at, keyed by name."""
    no_vae = tmp_path / "model_without_vae"
    shutil.copytree(tiny_sd3, no_vae)
    shutil.rmtree(no_vae / "vae")
    (tmp_path / "not_toy.txt").write_text("a photo of a red circle\na cat riding a bicycle\n")
    (tmp_path / "not_json.json").write_text("not json")
    (tmp_path / "no_key.json").write_text(json.dumps({"noise": [0.7] * 10}))
    (tmp_path / "nan.json").write_text(
        json.dumps({"psi": [float("nan")] * 10, "psi_scale": "multiplier"})
    )
    (tmp_path / "big.json").write_text(
        json.dumps({"psi": [5.0] * 10, "psi_scale": "multiplier", "sde_type": "cps"})
    )
    return {p.name: str(p) for p in tmp_path.iterdir()}


CASES = [  # script, flags ({name} = a file of _files), what the line must say
    ("flowgrpo_baseline.py", ["--reward-model-paths", "foo=/x"], "bad model path 'foo=/x'"),
    (
        "flowgrpo_baseline.py",
        ["--reward", "pickscore", "--reward-model-paths", "pickscore=/no/ps"],
        "does not exist",
    ),
    (
        "g2rpo.py",
        ["--guard-rewards", "aesthetic", "--reward-model-paths", "aesthetic=/no/a"],
        "does not exist",
    ),
    ("flowgrpo_baseline.py", ["--model-path", "{model_without_vae}"], "vae/config.json is missing"),
    ("flowgrpo_baseline.py", ["--resolution", "512"], "position embedding covers"),
    (
        "g2rpo.py",
        ["--prompts-file", "{not_toy.txt}"],
        "--prompts-file, prompt 2: prompt 'a cat riding a bicycle'",
    ),
    ("densegrpo.py", ["--eval-prompts", "{not_toy.txt}"], "--eval-prompts, prompt 2"),
    ("flowgrpo_baseline.py", ["--reward", "toyworld:1e39"], "finite float32"),
    ("g2rpo.py", ["--branch-steps", "0", "0", "1"], "--branch-steps 0 0 1 lists a value twice"),
    ("g2rpo.py", ["--granularities", "1", "2", "2"], "--granularities 1 2 2 lists a value twice"),
    (
        "densegrpo.py",
        ["--calibration-step", "-1"],
        "--calibration-step -1.0: must be a finite number > 0",
    ),
    (
        "densegrpo.py",
        ["--calibration-trajectories", "0"],
        "--calibration-trajectories 0: must be an integer in [1, 1e+06]",
    ),
    (
        "densegrpo.py",
        ["--calibration-iterations", "-1"],
        "--calibration-iterations -1: must be an integer >= 0",
    ),
    (
        "densegrpo.py",
        ["--balance-threshold", "0"],
        "--balance-threshold 0.0: must be a finite number > 0",
    ),
    ("densegrpo.py", ["--psi-file", "{not_json.json}"], "is not a psi.json (JSONDecodeError"),
    ("densegrpo.py", ["--psi-file", "{no_key.json}"], "is not a psi.json (KeyError"),
    ("densegrpo.py", ["--psi-file", "{nan.json}"], "must be finite and >= 0"),
    (
        "densegrpo.py",
        ["--psi-file", "{big.json}", "--sde-type", "cps", "--psi-bounds", "0", "1"],
        "at most 1",
    ),
]


@pytest.mark.parametrize(
    "script,flags,expect", CASES, ids=[f"{c[0][:5]}{' '.join(c[1])[:40]}" for c in CASES]
)
def test_bad_input_is_one_line_before_the_model_loads(
    monkeypatch, tmp_path, tiny_sd3, script, flags, expect
):
    import common.backbones
    import common.plumbing.harness

    def no_load(*a, **k):
        raise AssertionError("the backbone was loaded before the bad input was found")

    # where the set-up looks it up: harness.py's own name, bound when it was first imported (patching
    # common.backbones alone missed it once harness was imported, and leaked the stub into it otherwise)
    monkeypatch.setattr(common.backbones, "load_backbone", no_load)
    monkeypatch.setattr(common.plumbing.harness, "load_backbone", no_load)
    (tmp_path / "files").mkdir()
    files = _files(tmp_path / "files", tiny_sd3)
    flags = [files[f[1:-1]] if f.startswith("{") else f for f in flags]
    out = tmp_path / "runs"
    argv = [script, "--output-dir", str(out), "--run-name", "r", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    msg = str(e.value.code)
    assert msg.startswith("error:") and expect in msg and "\n" not in msg, msg
    assert not (out / "r").exists() or run_outputs(str(out / "r")) == []  # nothing a run writes
