"""The comparison harness (bench_compare.py) with stub "algorithms": the resume rule (finished runs kept, unfinished
ones deleted and run again), the flags every run gets, and the table's numbers. No model is loaded: fast."""

import json
import os
import textwrap

import pytest

from benchmarks import bench_compare as bc
from common.plumbing.checks import ConfigError  # noqa: E402

# A stand-in for a training script: the harness's flags in, a metrics.jsonl out. Accuracy 0.5 at the start and
# 0.5 + 0.05 * seed at the end; it logs every launch and fails on demand (STUB_CRASH = the run's name).
STUB = textwrap.dedent("""
    import argparse, json, os, sys
    ap = argparse.ArgumentParser()
    for f in ("--output-dir", "--run-name"):
        ap.add_argument(f)
    for f in ("--seed", "--num-iterations", "--eval-every", "--save-every", "--eval-seeds-per-prompt",
              "--final-eval-seeds-per-prompt"):
        ap.add_argument(f, type=int)
    ap.add_argument("--cpu-budget-s", type=float)
    a, rest = ap.parse_known_args()
    run = os.path.join(a.output_dir, a.run_name)
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(a.output_dir, "launches.txt"), "a") as f:
        f.write(a.run_name + " " + " ".join(sys.argv[1:]) + "\\n")
    n = 0 if a.num_iterations == 0 else 3  # "the budget ran out after 3 iterations"
    cats = lambda v: {"eval/accuracy_single": v, "eval/accuracy_counting": v / 2}
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for it in range(n + 1):
            row = {"iteration": it, "nfe": 100 * (it + 1), "nfe/eval": 10 * (it + 1), "images": 64 * it,
                   "time/cpu_s": 7.0 * (it + 1)}
            if it == n:
                acc = 0.5 + 0.05 * a.seed * (n > 0)
                row.update({"eval/accuracy": acc, **cats(acc), "eval/accuracy_se": 0.1 / a.final_eval_seeds_per_prompt,
                            "final": True})
            elif it % a.eval_every == 0:
                row.update({"eval/accuracy": 0.5, **cats(0.5), "eval/accuracy_se": 0.035})
            f.write(json.dumps(row) + "\\n")
            f.flush()
            if os.environ.get("STUB_CRASH") == a.run_name and it == 1:
                sys.exit(1)
""")


@pytest.fixture
def stubs(tmp_path):
    d = tmp_path / "scripts"
    d.mkdir()
    for name in ("flowgrpo_baseline.py", "yardstick_raft.py"):
        (d / name).write_text(STUB)
    return str(d)


def launches(out):
    with open(os.path.join(out, "launches.txt")) as f:
        return [line.split()[0] for line in f]


def test_resume_keeps_finished_runs_and_restarts_unfinished_ones(stubs, tmp_path, monkeypatch):
    out = str(tmp_path / "grid")
    argv = [
        "--script-dir",
        stubs,
        "--out",
        out,
        "--algos",
        "flowgrpo_baseline",
        "yardstick",
        "--seeds",
        "1",
        "2",
        "--cpu-seconds",
        "30",
        "--jobs",
        "2",
        "--eval-every",
        "1",
    ]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    # the real one loads the toy model (test below)
    monkeypatch.setattr(bc, "speed_probe", lambda: 2.5)
    monkeypatch.setenv("STUB_CRASH", "yardstick__default__2")
    bc.main(argv)
    first = launches(out)
    assert sorted(first) == sorted(
        [
            "flowgrpo_baseline__default__start",
            "yardstick__default__start",
            "flowgrpo_baseline__default__1",
            "yardstick__default__1",
            "flowgrpo_baseline__default__2",
            "yardstick__default__2",
        ]
    )
    crashed = os.path.join(out, "yardstick__default__2")
    assert not bc.is_finished(crashed) and os.path.exists(os.path.join(crashed, "metrics.jsonl"))
    assert json.load(open(os.path.join(crashed, "harness.json")))["returncode"] == 1
    (tmp_path / "grid" / "yardstick__default__2" / "leftover").write_text("from the crashed run")

    monkeypatch.delenv("STUB_CRASH")
    bc.main(argv)
    # only the unfinished run ran again
    assert launches(out)[len(first) :] == ["yardstick__default__2"]
    assert bc.is_finished(crashed) and not os.path.exists(os.path.join(crashed, "leftover"))
    bc.main(argv)
    assert len(launches(out)) == len(first) + 1  # a complete grid launches nothing

    # the flags a run got: the budget, 8 final seeds (SE <= 0.02 on the toy test file), no checkpoints
    flags = {line.split()[0]: line.split()[1:] for line in open(os.path.join(out, "launches.txt"))}
    f = flags["flowgrpo_baseline__default__1"]
    for k, v in [
        ("--cpu-budget-s", "30.0"),
        ("--final-eval-seeds-per-prompt", "8"),
        ("--seed", "1"),
        ("--eval-every", "1"),
        ("--save-every", "100000"),
    ]:
        assert f[f.index(k) + 1] == v, (k, f)
    s = flags["yardstick__default__start"]
    assert s[s.index("--num-iterations") + 1] == "0"
    meta = json.load(open(os.path.join(out, "flowgrpo_baseline__default__1", "harness.json")))
    assert (
        meta["jobs"] == 2
        and meta["threads"] == 1
        and meta["returncode"] == 0
        and meta["process_cpu_s"] >= 0
    )
    assert meta["omp_wait_policy"] == "PASSIVE" and meta["speed_probe_cpu_s"] == 2.5

    # a finished run made with another budget is not silently mixed into the table
    with pytest.raises(ConfigError, match="other flags"):
        bc.main([*argv[:-6], "--cpu-seconds", "60", "--jobs", "2", "--eval-every", "1"])

    # --report-only rebuilds everything from the folders
    os.remove(os.path.join(out, "results.md"))
    os.remove(os.path.join(out, "accuracy_vs_cpu.png"))
    bc.main(["--out", out, "--report-only"])
    text = open(os.path.join(out, "results.md")).read()
    assert os.path.getsize(os.path.join(out, "accuracy_vs_cpu.png")) > 0
    for name in (
        "accuracy_vs_trajectories.png",
        "accuracy_vs_scored.png",
        "reward_vs_trajectories.png",
    ):
        assert os.path.getsize(os.path.join(out, name)) > 0
    assert os.path.getsize(os.path.join(out, "accuracy_vs_reward.png")) > 0
    # gains 0.05 and 0.10 over 2 seeds: mean 0.075, half-width t_{0.975,1} * 0.03536 / sqrt(2) = 0.3177
    assert (
        "| flowgrpo_baseline | default | 2 | 0.500 (0.013) | 0.575 | +0.075 [-0.243, +0.393] |"
        in text
    )
    # side by side, 1 thread, no spinning
    assert "| 1 x 2" not in text and "| 2 x 1, passive |" in text
    # the probe, per run
    assert text.count("| 2.50 |") == 4 and "machines of different speed" not in text


def write_run(out, name, rows):
    os.makedirs(os.path.join(out, name))
    with open(os.path.join(out, name, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_table_numbers(tmp_path):
    out = str(tmp_path)
    cat = lambda a, b: {"eval/accuracy_single": a, "eval/accuracy_position": b}  # noqa: E731
    write_run(
        out,
        "g2rpo__lr1e-4__start",
        [
            {
                "iteration": 0,
                "eval/accuracy": 0.5,
                **cat(0.6, 0.4),
                "eval/reward_mean": 0.2,
                "eval/accuracy_se": 0.019,
                "nfe": 0,
                "final": True,
            }
        ],
    )
    for seed, final, best in [(1, 0.6, 0.75), (2, 0.7, 0.7), (3, 0.8, 0.8)]:
        write_run(
            out,
            f"g2rpo__lr1e-4__{seed}",
            [
                {
                    "iteration": 0,
                    "eval/accuracy": 0.45,
                    **cat(0.5, 0.4),
                    "nfe": 1000,
                    "nfe/eval": 400,
                    "images": 64,
                    "time/cpu_s": 10.0,
                },
                {
                    "iteration": 1,
                    "eval/accuracy": best,
                    **cat(0.5, 0.4),
                    "nfe": 1600,
                    "nfe/eval": 800,
                    "images": 128,
                    "time/cpu_s": 20.0 + seed,
                },
                {
                    "iteration": 2,
                    "eval/accuracy": final,
                    **cat(final + 0.1, final - 0.1),
                    "eval/accuracy_se": 0.018,
                    "eval/reward_mean": 0.2 + final,
                    "nfe": 4000,
                    "nfe/eval": 2000,
                    "images": 128,
                    "time/cpu_s": 40.0,
                    "final": True,
                },
            ],
        )
    # unfinished: left out
    write_run(out, "g2rpo__lr1e-4__4", [{"iteration": 0, "eval/accuracy": 0.5, "nfe": 0}])
    text = bc.report(out)
    row = next(line for line in text.splitlines() if line.startswith("| g2rpo | lr1e-4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    head = [
        c.strip()
        for c in text.splitlines()[
            text.splitlines().index(
                next(
                    line
                    for line in text.splitlines()
                    if line.startswith("| algorithm | variant | seeds")
                )
            )
        ]
        .strip("|")
        .split("|")
    ]
    got = dict(zip(head, cells))
    assert got["seeds"] == "3" and got["start (SE)"] == "0.500 (0.019)" and got["final"] == "0.700"
    # gains .1 .2 .3: s = .1, t_{.975,2} = 4.303
    assert got["gain [95 % CI]"] == "+0.200 [-0.048, +0.448]"
    assert (
        got["gain single"] == "+0.200 [-0.048, +0.448]"
        and got["gain position"] == "+0.200 [-0.048, +0.448]"
    )
    # .8 .9 1.0 against the start's .2
    assert got["reward gain [95 % CI]"] == "+0.700 [+0.452, +0.948]"
    assert got["final-eval SE"] == "0.018" and got["iterations"] == "2"
    # consumption at the final evaluation = the counters of the row before it (the last training iteration)
    # (a log from before 2026-12-03: its one `images` counter counted the scored images)
    assert (
        got["scored images"] == "128"
        and got["NFE (training)"] == "1600"
        and got["CPU s in loop"] == "22"
    )
    # the best evaluation only beside the last: bests .75 .7 .8 minus .5
    assert got["best eval − start (beside the last, biased up)"] == "+0.250 [+0.126, +0.374]"
    assert (
        "| g2rpo | lr1e-4 | 4 |" not in text
        and "| g2rpo | lr1e-4 | 3 | 2 | 0.500 | 0.800 | +0.300 |" in text
    )


def counted(trajectories, scored):
    return {"trajectories": trajectories, "scored_images": scored}


def test_merged_folders_and_the_gain_at_equal_trajectories_and_scored_images(tmp_path):
    """--merge reports grids from several folders as one table (a run found twice is refused), and every group's
    gain is also read where the run with the fewest trajectories (scored images) ended: equal budgets on both axes."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for seed, final in [
        (1, 0.6),
        (2, 0.8),
    ]:  # ends at 128 trajectories, 1280 scored images (completions)
        write_run(
            a,
            f"g2rpo__small__{seed}",
            [
                {"iteration": 0, "eval/accuracy": 0.4, **counted(64, 640), "time/cpu_s": 1.0},
                {"iteration": 1, **counted(128, 1280), "time/cpu_s": 2.0},
                {
                    "iteration": 2,
                    "eval/accuracy": final,
                    **counted(128, 1280),
                    "time/cpu_s": 3.0,
                    "final": True,
                },
            ],
        )
    for seed, mid in [
        (1, 0.5),
        (2, 0.6),
    ]:  # 512 trajectories; at 128 it is halfway from its first eval to `mid`
        write_run(
            b,
            f"densegrpo__big__{seed}",
            [
                {"iteration": 0, "eval/accuracy": 0.4, **counted(256, 256), "time/cpu_s": 1.0},
                {"iteration": 1, "eval/accuracy": mid, **counted(512, 512), "time/cpu_s": 2.0},
                {
                    "iteration": 2,
                    "eval/accuracy": 0.9,
                    **counted(512, 512),
                    "time/cpu_s": 3.0,
                    "final": True,
                },
            ],
        )
    text = bc.report(str(tmp_path / "verdict"), (a, b))
    head = next(
        line for line in text.splitlines() if line.startswith("| algorithm | variant | seeds")
    )
    cols = [c.strip() for c in head.strip("|").split("|")]
    col = cols.index("gain at 128 trajectories (periodic evals)")
    scored = cols.index("gain at 512 scored images (periodic evals)")

    def row(algo):  # reads the latest `text`
        line = next(line for line in text.splitlines() if line.startswith(f"| {algo} |"))
        return [c.strip() for c in line.strip("|").split("|")]

    # gains .2 .4 at their end: s = .141, t_{.975,1} = 12.71
    assert row("g2rpo")[col] == "+0.300 [-0.971, +1.571]"
    # (.5 - .4) / 2 and (.6 - .4) / 2 at 128 of 256
    assert row("densegrpo")[col] == "+0.075 [-0.243, +0.393]"
    # at 512 scored images DenseGRPO has ended (its final evaluation: .9 - .4 in both seeds), and G²RPO is 0.4 of the
    # way from its first evaluation (0 scored) to its last (1280): gains .08 and .16
    assert row("densegrpo")[scored] == "+0.500 [+0.500, +0.500]" and row("g2rpo")[
        scored
    ].startswith("+0.120 [")
    assert os.path.exists(tmp_path / "verdict" / "results.md")
    # gain minus the reference's
    text = bc.report(str(tmp_path / "verdict"), (a, b), reference="g2rpo:small")
    head = next(
        line for line in text.splitlines() if line.startswith("| algorithm | variant | seeds")
    )
    col = [c.strip() for c in head.strip("|").split("|")].index(
        "gain − g2rpo:small's (Welch 95 % CI)"
    )
    assert row("g2rpo")[col] == "—"
    # .5 .5 against .2 .4: df 1, t 12.706, SE .1
    assert row("densegrpo")[col] == "+0.200 [-1.071, +1.471]"
    text = bc.report(str(tmp_path / "verdict"), (a, b), only=("densegrpo:big",))
    assert "| densegrpo | big |" in text and "| g2rpo |" not in text
    with pytest.raises(ConfigError, match="--only g2rpo:none: no such group"):
        bc.report(str(tmp_path / "verdict"), (a, b), only=("g2rpo:none",))
    with pytest.raises(ConfigError, match="--reference g2rpo:none: no such group"):
        bc.report(str(tmp_path / "verdict"), (a, b), reference="g2rpo:none")
    write_run(b, "g2rpo__small__1", [{"iteration": 0, "eval/accuracy": 0.4, "final": True}])
    with pytest.raises(ConfigError, match="g2rpo__small__1 is in both"):
        bc.report(str(tmp_path / "verdict"), (a, b))


def test_bad_variant_is_one_clear_line():
    with pytest.raises(ConfigError, match="NAME=FLAGS"):
        bc.parse_variants(["lr__1=--learning-rate 1e-4"])
    with pytest.raises(ConfigError, match="NAME=FLAGS"):
        bc.parse_variants(["--learning-rate 1e-4"])
    assert bc.parse_variants(["lr1e-4=--learning-rate 1e-4"]) == {
        "lr1e-4": ["--learning-rate", "1e-4"]
    }
    assert bc.parse_variants([]) == {"default": []}
    with pytest.raises(ConfigError, match="iterations >= 1"):
        bc.main(["--iterations", "0", "--dry-run"])


def test_fixed_iterations_replace_the_cpu_budget_except_for_the_start_run(capsys):
    """--iterations N: every seeded run trains N iterations with no CPU budget; the start run still trains none."""
    bc.main(
        [
            "--algos",
            "g2rpo",
            "--seeds",
            "3",
            "--iterations",
            "30",
            "--variants",
            "hack=--beta 0.04",
            "--dry-run",
            "--",
            "--eval-every",
            "5",
        ]
    )
    cmd = {
        line.split()[0]: line.split()[1:]
        for line in capsys.readouterr().out.splitlines()
        if "__" in line
    }
    start, run = cmd["g2rpo__hack__start"], cmd["g2rpo__hack__3"]
    flag = lambda argv, name: argv[max(i for i, a in enumerate(argv) if a == name) + 1]  # noqa: E731  (last wins)
    assert flag(start, "--num-iterations") == "0" and flag(run, "--num-iterations") == "30"
    # a variant that sets its own iterations trains them; its start run still trains none
    bc.main(
        ["--algos", "g2rpo", "--seeds", "3", "--variants", "long=--num-iterations 40", "--dry-run"]
    )
    cmd = {
        line.split()[0]: line.split()[1:]
        for line in capsys.readouterr().out.splitlines()
        if "__" in line
    }
    assert flag(cmd["g2rpo__long__start"], "--num-iterations") == "0"
    assert flag(cmd["g2rpo__long__3"], "--num-iterations") == "40"
    assert (
        flag(run, "--cpu-budget-s") == "0"
        and flag(run, "--beta") == "0.04"
        and flag(run, "--eval-every") == "5"
    )


def test_a_run_on_a_busy_machine_is_flagged():
    """The load sampled while a run ran: its own jobs x threads are expected, more means other work shared the
    machine (which costs CPU seconds per iteration, so the budget bought fewer iterations)."""
    quiet, loaded = (
        {"jobs": 2, "threads": 1, "load": [1.9, 2.1, 2.2]},
        {"jobs": 2, "threads": 1, "load": [2.9, 3.1]},
    )
    # old runs: no samples
    assert not bc.busy(quiet) and bc.busy(loaded) and not bc.busy({"jobs": 2, "threads": 1})
    assert bc.load_text(loaded) == "3.0 (3.1)" and bc.load_text({}) == "—"


def test_the_speed_probe_times_the_toy_model_and_flags_runs_from_machines_of_different_speed():
    """CPU seconds are equal work only on one machine (the same G2RPO iteration: 45.9 CPU s on 2026-12-01's,
    86.3 on 2026-12-02's): every run records a timed workload, and a table that mixes speeds says so."""
    assert 0 < bc.probe_workload(calls=1) < 60
    # {}: a run from before the probe
    same = [
        {"speed_probe_cpu_s": 2.7},
        {"speed_probe_cpu_s": 3.0},
        {},
    ]
    assert bc.speed_spread(same) is None and bc.speed_spread([{"speed_probe_cpu_s": 2.7}]) is None
    note = bc.speed_spread([*same, {"speed_probe_cpu_s": 5.3}])
    assert "from 2.70 to 5.30 CPU s" in note and "different speed" in note


def test_a_log_from_before_the_two_counters_is_read_under_their_names(tmp_path):
    """Logs before 2026-12-03 have one `images` counter, which counted every scored image; their trajectories are
    iterations x prompts x G, from args.json."""
    out = str(tmp_path)
    write_run(
        out,
        "densegrpo__old__1",
        [
            {"iteration": 0, "eval/accuracy": 0.4, "images": 0, "time/cpu_s": 1.0},
            {"iteration": 1, "images": 704, "time/cpu_s": 2.0},
            {
                "iteration": 2,
                "eval/accuracy": 0.5,
                "images": 1408,
                "time/cpu_s": 3.0,
                "final": True,
            },
        ],
    )
    with open(os.path.join(out, "densegrpo__old__1", "args.json"), "w") as f:
        json.dump({"groups_per_iteration": 8, "group_size": 8}, f)
    last = bc.summarize(os.path.join(out, "densegrpo__old__1"))["final"]
    # the counters of the row before
    assert last["trajectories"] == 2 * 64 and last["scored_images"] == 704


def test_split_validation_evaluates_every_run_on_the_validation_prompts(capsys, tmp_path):
    """Issue #48 item 1: `--split validation` points every run (the start run too) at prompts_val.txt, sizes the
    final evaluation for its prompts, and a report refuses to put validation and test gains in one table."""
    bc.main(
        [
            "--algos",
            "diffusionnft",
            "--seeds",
            "1",
            "--iterations",
            "2",
            "--split",
            "validation",
            "--dry-run",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    cmd = {line.split()[0]: line.split()[1:] for line in lines if "__" in line}
    for argv in cmd.values():
        assert argv[argv.index("--eval-prompts") + 1] == "common/toyworld/prompts_val.txt"
        assert os.path.exists(os.path.join(bc.ROOT, argv[argv.index("--eval-prompts") + 1]))
    seeds = bc.seeds_for_se(0.02, bc.eval_prompt_counts("validation"))
    assert f"{seeds} seeds per validation prompt" in lines[0] and seeds != bc.seeds_for_se(
        0.02, bc.eval_prompt_counts("test")
    )
    bc.main(["--algos", "diffusionnft", "--seeds", "1", "--iterations", "2", "--dry-run"])
    assert "--eval-prompts" not in capsys.readouterr().out  # the test split: the scripts' default
    # a table of runs evaluated on two prompt files is refused
    row = {"iteration": 0, "eval/accuracy": 0.5, "nfe": 0, "final": True}
    for name, prompts in [
        ("g2rpo__a__start", "prompts_val.txt"),
        ("g2rpo__a__1", "prompts_test.txt"),
    ]:
        write_run(str(tmp_path), name, [row])
        with open(os.path.join(tmp_path, name, "args.json"), "w") as f:
            json.dump({"eval_prompts": f"common/toyworld/{prompts}"}, f)
    with pytest.raises(bc.ConfigError, match="different prompt files"):
        bc.report(str(tmp_path))
