"""The benchmarks a user runs refuse bad flags and bad folders in one line, before any run (issue #57): a budget of
nan or inf never ended, an --out that is a file or a corrupt cost.json was a traceback, a misspelled --out wrote an
empty report and exited 0, a --merge of a missing folder was ignored."""

import json
import os

import pytest

from benchmarks import bench_compare, bench_cost
from common.plumbing.checks import ConfigError


def refused(main, *argv) -> str:
    with pytest.raises(ConfigError) as e:
        main(list(argv))
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--cpu-seconds", "nan"], "a positive finite budget"),
        (["--cpu-seconds", "inf"], "a positive finite budget"),
        (["--cpu-seconds", "-5"], "a positive finite budget"),
        (["--final-se", "nan"], "0 < final-se < 0.5"),
        (["--jobs", "0"], "jobs and threads >= 1"),
        (["--max-wall-s", "nan"], "--max-wall-s nan: must be > 0"),
        (["--max-wall-s", "-1"], "--max-wall-s -1.0: must be > 0"),
        (["--seeds", "1", "-2"], "--seeds 1 -2: each value must be an integer in [0, 4.29497e+09]"),
        (["--eval-every", "0"], "--eval-every 0: must be an integer >= 1"),
        (["--eval-seeds-per-prompt", "0"], "--eval-seeds-per-prompt 0: must be an integer >= 1"),
    ],
)
def test_bench_compare_refuses_bad_numbers_before_any_run(tmp_path, argv, said):
    msg = refused(bench_compare.main, *argv, "--out", str(tmp_path / "out"), "--dry-run")
    assert said in msg, msg
    assert not os.path.exists(tmp_path / "out")


def test_bench_compare_refuses_bad_folders_and_a_report_of_nothing(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert refused(bench_compare.main, "--out", str(a_file), "--dry-run").startswith(
        f"error: --out {a_file} is a file"
    )
    assert a_file.read_text() == "x"
    missing = tmp_path / "verdcit"  # misspelled: it wrote an empty report and exited 0
    msg = refused(bench_compare.main, "--report-only", "--out", str(missing))
    assert (
        msg
        == f"error: --report-only --out {missing} does not exist: pass the folder the grid was run in"
    )
    assert not missing.exists()
    out = tmp_path / "out"
    out.mkdir()
    msg = refused(
        bench_compare.main, "--report-only", "--out", str(out), "--merge", str(tmp_path / "nowhere")
    )
    assert (
        msg
        == f"error: --merge {tmp_path}/nowhere is not a folder: pass a folder that holds run folders"
    )
    msg = refused(bench_compare.main, "--report-only", "--out", str(out))
    assert msg.startswith(f"error: no finished run in {out}: nothing to report")
    assert os.listdir(out) == []  # no empty results.md


@pytest.mark.parametrize(
    "text,said",
    [
        ("{not json", "JSONDecodeError: Expecting property name"),
        ("{}", "its 'meta' is not an object"),
        ('{"meta": {}, "runs": {}}', "its 'runs' are not a list"),
        ('{"meta": {}, "runs": [3]}', "a run is not an object with a script, a name and rows"),
        ("[" * 100_000, "nested deeper than 32 levels"),
    ],
)
def test_bench_cost_report_of_a_corrupt_cost_json_is_one_line(tmp_path, text, said):
    (tmp_path / "cost.json").write_text(text)
    msg = refused(bench_cost.main, "--report-only", "--out", str(tmp_path))
    assert (
        msg.startswith(f"error: {tmp_path}/cost.json is not a cost.json this benchmark wrote (")
        and said in msg
    )
    assert not (tmp_path / "cost.md").exists()


def test_bench_cost_refuses_a_report_of_nothing_and_an_out_that_is_a_file(tmp_path):
    failed = {
        "name": "flowgrpo_baseline__0",
        "script": "flowgrpo_baseline",
        "returncode": 1,
        "rows": [],
    }
    (tmp_path / "cost.json").write_text(json.dumps({"meta": {}, "runs": [failed]}))
    msg = refused(bench_cost.main, "--report-only", "--out", str(tmp_path))
    assert msg.startswith(
        f"error: {tmp_path}/cost.json holds no finished run (1 recorded): nothing to report"
    )
    assert not (tmp_path / "cost.md").exists()
    msg = refused(bench_cost.main, "--out", str(tmp_path / "cost.json"))
    assert msg.startswith(f"error: --out {tmp_path}/cost.json is a file")


def test_the_sweeps_cases_of_issue_68_are_clean_in_every_script(tmp_path):
    """benchmarks/sweep_bad_input.py's cases of issue #68 (sizes past what a run holds, a remote reward's options,
    reward servers that answer the start-up check badly): each one line before the model loads, in bounded time.
    On 23dca5d 38 of these 69 were not: the model loaded first, or a RecursionError."""
    from benchmarks import sweep_bad_input as sweep

    with sweep.hostile_servers() as urls:
        cases = [
            (s, *c) for s in sweep.SCRIPTS for c in sweep.issue_68(urls) + sweep.OWN_68.get(s, [])
        ]
        dirty = [
            (script, name, msg)
            for k, (script, name, flags) in enumerate(cases)
            for clean, msg in [sweep.run_case(script, flags, str(tmp_path / f"out{k}"))]
            if not clean
        ]
    assert len(cases) == 69 and dirty == []
