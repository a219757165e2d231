"""The side-by-side cost benchmark (bench_cost.py) on synthetic metrics rows: the cost per iteration without
the first, the ratio to Flow-GRPO, the rotated order of the runs, the report from a cost.json, and the one-line
refusal of an unknown script. No training is launched: fast."""

import json
import os

import pytest

from benchmarks import bench_cost as bc


def row(it: int, cpu: float, **extra) -> dict:
    """A training row of metrics.jsonl: cumulative CPU and NFE, phase seconds of this iteration."""
    return {
        "iteration": it,
        "time/cpu_s": cpu,
        "time/elapsed_s": cpu,
        "time/rollout_s": 1.0,
        "time/reward_s": 0.5,
        "time/train_s": 2.0,
        "nfe/rollout": 100 * (it + 1),
        "nfe/completion": 0,
        "nfe/train_forward": 50 * (it + 1),
        "nfe/train_backward": 50 * (it + 1),
        **extra,
    }


def write_metrics(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write('{"iteration": 9, "time/cpu')  # a line cut by a kill
    return str(path)


def run_record(script: str, k: int, cpus: list[float], **first) -> dict:
    rows = [row(i, c) for i, c in enumerate(cpus)]
    rows[0].update(first)
    return {
        "script": script,
        "name": bc.run_name(script, k),
        "round": k,
        "returncode": 0,
        "load_start": 1.0 + k,
        "load_end": 1.5 + k,
        "rows": rows,
    }


def test_iteration_costs_skip_the_first_and_the_final_row(tmp_path):
    # iteration 0 pays warm-up and the first evaluation (30 s); the final row's evaluation is not training
    rows = [row(0, 30.0), row(1, 40.0), row(2, 52.0), row(3, 63.0)]
    final = {"iteration": 4, "final": True, "time/cpu_s": 99.0, "eval/accuracy": 0.5}
    path = write_metrics(tmp_path / "metrics.jsonl", [rows[2], rows[0], final, rows[1], rows[3]])
    kept = bc.training_rows(bc.read_rows(path))
    assert [r["iteration"] for r in kept] == [0, 1, 2, 3]
    assert bc.iteration_costs(kept) == [10.0, 12.0, 11.0]
    assert bc.phase_seconds(kept) == {"rollout": 3.0, "reward": 1.5, "train": 6.0}
    assert bc.nfe_counts(kept)["nfe/rollout"] == 300
    assert bc.calibration_cpu(kept) is None
    # a gap (a missing row) is not one iteration's cost
    assert bc.iteration_costs([row(0, 0.0), row(2, 50.0), row(3, 60.0)]) == [10.0]


def test_summary_ratio_and_calibration():
    runs = [
        run_record("flowgrpo_baseline", 0, [30, 40, 50, 60]),
        run_record("flowgrpo_baseline", 1, [30, 42, 54, 66]),
        run_record("densegrpo", 0, [40, 55, 70, 85], **{"time/calibration_cpu_s": 30.0}),
        {**run_record("densegrpo", 1, [40, 99, 199, 299]), "returncode": 1},  # failed: not counted
    ]
    s = bc.summarize(runs)
    assert s["flowgrpo_baseline"]["runs"] == 2
    assert s["flowgrpo_baseline"]["mean"] == pytest.approx(11.0)
    assert (s["flowgrpo_baseline"]["min"], s["flowgrpo_baseline"]["max"]) == (10.0, 12.0)
    assert s["densegrpo"]["runs"] == 1 and s["densegrpo"]["calib"] == 30.0
    assert s["densegrpo"]["nfe"]["nfe/rollout"] == pytest.approx(100.0)
    assert bc.ratio(s, "densegrpo") == pytest.approx(15.0 / 11.0)
    assert bc.ratio(s, "flowgrpo_baseline") == pytest.approx(1.0)
    assert bc.ratio({"densegrpo": s["densegrpo"]}, "densegrpo") is None


def test_rotation_interleaves_the_scripts():
    order = bc.rotation(["a", "b", "c"], 4)
    assert order == [
        (0, "a"),
        (0, "b"),
        (0, "c"),
        (1, "b"),
        (1, "c"),
        (1, "a"),
        (2, "c"),
        (2, "a"),
        (2, "b"),
        (3, "a"),
        (3, "b"),
        (3, "c"),
    ]


def test_default_iterations_read_from_the_script(tmp_path):
    (tmp_path / "x.py").write_text(
        "class Args:\n    num_iterations: int = 39\n    lr: float = 1.0\n"
    )
    (tmp_path / "y.py").write_text("nothing here\n")
    assert bc.default_iterations("x", str(tmp_path)) == 39
    assert bc.default_iterations("y", str(tmp_path)) is None
    assert bc.default_iterations("absent", str(tmp_path)) is None


def test_report_from_cost_json(tmp_path):
    cost = {
        "meta": {
            "date_utc": "2026-12-05T10:00:00+00:00",
            "commit": "abc1234",
            "dirty": True,
            "nproc": 2,
            "threads": 1,
            "jobs": 1,
            "iterations": 4,
            "repeats": 2,
            "command": "python benchmarks/bench_cost.py",
            "speed_probe_cpu_s": 1.23,
            "defaults": {"flowgrpo_baseline": 30, "densegrpo": 30},
            "notes": ["diffusionnft.py is not in this checkout: skipped"],
        },
        "runs": [
            run_record("flowgrpo_baseline", 0, [30, 40, 50, 60]),
            run_record("densegrpo", 0, [40, 55, 70, 85], **{"time/calibration_cpu_s": 30.0}),
            run_record("flowgrpo_baseline", 1, [30, 42, 54, 66]),
            run_record("densegrpo", 1, [40, 55, 70, 85]),
        ],
    }
    (tmp_path / "cost.json").write_text(json.dumps(cost))
    text = bc.report(str(tmp_path))
    assert text == (tmp_path / "cost.md").read_text()
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    flow, dense = lines["| flowgrpo_baseline"], lines["| densegrpo"]
    assert "| 2 | 11.0 (10.0–12.0) | 1.00 | none | 330 (30 it) |" in flow
    # calibration: the mean over the runs that logged it; per run = 15 x 30 + 30
    assert "| 2 | 15.0 (15.0–15.0) | 1.36 | 30.0 | 480 (30 it) |" in dense
    assert "| 1.0 / 0.5 / 2.0 | 100 / 0 / 50 / 50 |" in dense
    assert "abc1234 (work tree modified)" in text and "load 1.0–2.5" in text
    assert "1.23 CPU s" in text and "`python benchmarks/bench_cost.py`" in text
    assert "diffusionnft.py is not in this checkout" in text


def test_densegrpo_without_calibration_row_says_not_logged(tmp_path):
    cost = {"meta": {"defaults": {}}, "runs": [run_record("densegrpo", 0, [1, 2, 3])]}
    (tmp_path / "cost.json").write_text(json.dumps(cost))
    text = bc.report(str(tmp_path))
    assert "| not logged |" in text and "| — |" in text  # no Flow-GRPO: no ratio


def test_unknown_script_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        bc.main(["--scripts", "nosuchscript", "--out", str(tmp_path)])
    msg = str(e.value)
    assert "nosuchscript" in msg and "unknown script" in msg and "\n" not in msg
    assert not os.listdir(tmp_path)  # nothing was run or written


def test_absent_script_refused_and_default_skips_it(tmp_path):
    (tmp_path / "flowgrpo_baseline.py").write_text("")
    with pytest.raises(SystemExit, match="diffusionnft.py is not in"):
        bc.pick_scripts(["diffusionnft"], str(tmp_path))
    assert bc.pick_scripts(None, str(tmp_path)) == ["flowgrpo_baseline"]
    assert bc.pick_scripts(["densegrpo", "flowgrpo_baseline"], bc.ROOT) == [
        "flowgrpo_baseline",
        "densegrpo",
    ]


def test_report_only_without_cost_json_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        bc.main(["--report-only", "--out", str(tmp_path)])
