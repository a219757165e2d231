"""What a user's own command can do to a run (issue #46), with real runs, processes and signals: a resume
keeps the run's own flags and never deletes a finished run's checkpoints; a run that died before its first
checkpoint restarts in place; a non-finite number stops the run in one line, also under `python -O`; derived
values are not flags; a signal stops a run with one line that says how to go on; inputs that trained nothing or
were misdiagnosed get one right line."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    ROOT,
    read_metrics,
    run_main,
    run_script,
    script_env,
    tiny_flags,
    write_prompts,
)

from common.plumbing.checks import ConfigError

SCRIPT = "flowgrpo_baseline.py"


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path / "prompts.txt", ["a red square", "a blue circle"])


def checkpoints(run):
    return sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))


def test_a_bare_resume_keeps_the_runs_flags_and_never_deletes_its_checkpoints(
    tiny_sd3, tmp_path, prompts_file
):
    """A finished 2-iteration run with --save-every 1 --keep-checkpoints 0: `--resume RUN` alone takes the
    run's own flags (model, prompts, cadence, learning rate...), so it asks for no more iterations and changes
    nothing; `--num-iterations 3` trains one more, saving every iteration and deleting nothing."""
    flags = tiny_flags(tiny_sd3, tmp_path, prompts_file)
    own = ["--save-every", "1", "--keep-checkpoints", "0", "--learning-rate", "1e-2"]
    run_main(SCRIPT, *flags, *own, "--num-iterations", "2")
    run = str(tmp_path / "run")
    args_before = open(os.path.join(run, "args.json")).read()
    with pytest.raises(
        ConfigError, match="is at iteration 2 and --num-iterations 2 asks for no more"
    ):
        run_main(SCRIPT, "--resume", run)
    assert checkpoints(run) == ["checkpoint-1", "checkpoint-2"]
    assert open(os.path.join(run, "args.json")).read() == args_before
    # the refusal's advice, followed literally
    run_main(SCRIPT, "--resume", run, "--num-iterations", "3")
    assert checkpoints(run) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    args = json.load(open(os.path.join(run, "args.json")))
    assert (
        args["keep_checkpoints"] == 0 and args["save_every"] == 1 and args["learning_rate"] == 1e-2
    )
    assert [r["iteration"] for r in read_metrics(run) if not r.get("final")] == [0, 1, 2]
    # a flag given that differs from the run's is named, with advice that works when followed
    with pytest.raises(ConfigError, match="drop them to continue that run with its own values"):
        run_main(SCRIPT, "--resume", run, "--num-iterations", "4", "--learning-rate", "1e-3")
    run_main(SCRIPT, "--resume", run, "--num-iterations", "4")  # that advice, followed
    assert checkpoints(run)[-1] == "checkpoint-4"
    # --resume A --run-name B would train in A and record B
    with pytest.raises(ConfigError, match="only --resume-override starts"):
        run_main(SCRIPT, "--resume", run, "--num-iterations", "5", "--run-name", "other")


def test_a_run_that_died_before_its_first_checkpoint_restarts_in_place(
    tiny_sd3, tmp_path, prompts_file
):
    """A run folder without a checkpoint (killed, a login error, a full disk in its first iterations) is no dead
    end: the refusal of a new run there says --resume, and --resume restarts it in place with its own flags,
    reproducing the rows and weights the uninterrupted run gives."""
    flags = tiny_flags(tiny_sd3, tmp_path, prompts_file)
    run_main(SCRIPT, *flags, "--num-iterations", "2", "--learning-rate", "1e-2")
    run = str(tmp_path / "run")
    reference = torch.load(
        os.path.join(run, "checkpoint-2", "trainer_state.pt"), weights_only=False
    )
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(run)]
    # the state a run killed during its first iterations leaves: args.json, a row, no checkpoint
    for name in checkpoints(run):
        subprocess.run(["rm", "-r", os.path.join(run, name)], check=True)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        first = f.readline()
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(first)
    with pytest.raises(ConfigError, match="continue it with --resume"):
        run_main(SCRIPT, *flags, "--num-iterations", "2", "--learning-rate", "1e-2")
    run_main(SCRIPT, "--resume", run)
    again = torch.load(os.path.join(run, "checkpoint-2", "trainer_state.pt"), weights_only=False)
    assert all(torch.equal(reference["params"][k], again["params"][k]) for k in reference["params"])
    assert [
        {k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(run)
    ] == rows


def test_a_huge_learning_rate_stops_in_one_line(tiny_sd3, tmp_path, prompts_file):
    """An update that overflows the weights stops the run in one line, naming what exists to go on from, and no
    non-finite weight is saved. The check is not an assert, so `python -O` keeps it: tests/test_training.py finds no
    assert or __debug__ in common/ or the scripts and runs a check compiled as -O compiles it. (This run under -O
    took 11 s where it takes 4: with PYTHONDONTWRITEBYTECODE set, as on the 2-core machine, -O compiles torch's and
    diffusers' sources at every start.)"""
    flags = tiny_flags(tiny_sd3, tmp_path, prompts_file)
    env = script_env()
    cmd = [sys.executable, os.path.join(ROOT, SCRIPT), *flags, "--num-iterations", "3"]
    r = subprocess.run(
        [*cmd, "--learning-rate", "1e30", "--save-every", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "non-finite" in lines[0], r.stderr[-3000:]
    assert "checkpoint" in lines[0] and "--resume" in lines[0]
    for name in checkpoints(tmp_path / "run"):
        state = torch.load(tmp_path / "run" / name / "trainer_state.pt", weights_only=False)
        assert all(torch.isfinite(v).all() for v in state["params"].values()), name


def test_derived_values_are_not_flags_and_the_run_name_is_one_folder(
    tiny_sd3, tmp_path, prompts_file
):
    r = run_script(SCRIPT, "--world-size", "2", check=False, timeout=120)
    assert r.returncode != 0 and "--world-size" in r.stderr
    flags = tiny_flags(tiny_sd3, tmp_path, prompts_file)
    for name in (".", "..", "/tmp/elsewhere", "a/b", ""):
        with pytest.raises(ConfigError, match="give one plain folder name"):
            run_main(SCRIPT, *flags, "--run-name", name)
    assert not os.path.exists(tmp_path / "run")


def test_a_signal_stops_the_run_with_one_line_that_says_how_to_go_on(
    tiny_sd3, tmp_path, prompts_file
):
    flags = tiny_flags(tiny_sd3, tmp_path, prompts_file)
    env = script_env()
    p = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, SCRIPT),
            *flags,
            "--num-iterations",
            "1000",
            "--save-every",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    run = tmp_path / "run"
    deadline = time.time() + 240
    while time.time() < deadline and not (run / "checkpoint-2").exists():
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("stopped by")]
    assert line.startswith("stopped by SIGTERM at iteration ") and f"--resume {run}" in line
    assert re.search(r"the last complete checkpoint is .*/checkpoint-\d+: continue with", line), (
        line
    )


def test_inputs_that_trained_nothing_or_were_misdiagnosed_get_the_right_line(tmp_path):
    from common.plumbing.checks import read_prompt_file
    from common.plumbing.reward_flags import parse_reward_spec

    with pytest.raises(ValueError, match="trains nothing"):
        parse_reward_spec("toyworld:0")
    from common.plumbing.reward_flags import check_rewards

    with pytest.raises(ConfigError, match="empty reward spec"):  # refused before any folder exists
        check_rewards("", "", "", {})
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffa red square\n".encode())
    assert read_prompt_file(str(bom), "--prompts-file") == ["a red square"]
    r = run_script(
        "densegrpo.py",
        "--psi-file",
        str(tmp_path),
        "--num-iterations",
        "0",
        check=False,
        timeout=120,
    )
    assert "is a folder" in r.stderr and "Traceback" not in r.stderr


def test_flags_bounded_by_the_model_are_refused_before_it_loads(
    tiny_sd3, tmp_path, prompts_file, monkeypatch
):
    import shutil

    import common.plumbing.harness as harness

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(harness, "load_backbone", no_load)
    flags = tiny_flags(tiny_sd3, tmp_path, prompts_file)
    for bad, match in (
        (["--seed", "-1"], "--seed -1"),
        (["--seed", str(2**32)], "--seed 4294967296"),
        (["--max-sequence-length", "100000"], "holds at most"),
        (["--lora-rank", "1000000"], "rank cannot exceed"),
    ):
        with pytest.raises(ConfigError, match=match):
            run_main(SCRIPT, *flags, *bad)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_sd3, broken)
    for component in ("transformer", "vae"):
        shutil.copy(os.path.join(tiny_sd3, component, "config.json"), broken / component)
        (broken / component / "config.json").write_text("{not json")
        i = flags.index("--model-path")
        with pytest.raises(ConfigError, match=f"{component}/config.json is unreadable"):
            run_main(SCRIPT, *flags[:i], "--model-path", str(broken), *flags[i + 2 :])
        shutil.copy(os.path.join(tiny_sd3, component, "config.json"), broken / component)
    assert not os.path.exists(tmp_path / "run")


def fill(disk: str, leave: int) -> None:
    """Fill the disk but for about `leave` bytes."""
    import shutil

    with open(os.path.join(disk, "ballast"), "wb") as f:
        f.write(b"\0" * max(shutil.disk_usage(disk).free - leave, 0))


def test_every_write_on_a_full_disk_is_one_line_and_leaves_no_partial_file(small_disk):
    """The metrics row, a picture, args.json, a side file: each goes whole or not at all, and the failure is
    the checkpoint's one line, naming what exists to go on from."""
    from common.plumbing.checkpoint import writing
    from common.plumbing.plots import learning_curve
    from common.plumbing.run import RunLogger, append_line
    from common.plumbing.utils import atomic_write

    run = os.path.join(small_disk, "run")
    os.makedirs(run)
    logger = RunLogger(run, True, False, {"seed": 1}, "p", None, "n")  # args.json fits
    logger.log({"iteration": 0, "train/reward_mean": 0.5})
    rows = open(os.path.join(run, "metrics.jsonl")).read()
    fill(small_disk, 0)
    with pytest.raises(SystemExit) as e, writing(run):
        append_line(os.path.join(run, "metrics.jsonl"), json.dumps({"x": "y" * 100_000}) + "\n")
    msg = str(e.value.code)
    assert msg.startswith(f"error: could not write {run}/metrics.jsonl (") and "\n" not in msg
    assert "the disk is full" in msg and f"restart it in place with --resume {run}" in msg, msg
    assert open(os.path.join(run, "metrics.jsonl")).read() == rows  # no half row
    for write in (
        lambda: atomic_write(os.path.join(run, "psi.json"), "x" * 200_000),
        lambda: learning_curve(
            [{"iteration": i, "eval/accuracy": 0.5} for i in range(3)],
            os.path.join(run, "learning_curve.png"),
            "t",
        ),
        lambda: atomic_write(os.path.join(run, "args.json"), "x" * 200_000),
    ):
        with pytest.raises(SystemExit, match="could not write .*the disk is full"), writing(run):
            write()
    assert sorted(os.listdir(run)) == [
        "args.json",
        "metrics.jsonl",
    ]  # nothing partial, no temp file
    assert json.load(open(os.path.join(run, "args.json"))) == {"seed": 1}


# ============================================================ signals from the first line, services bounded (#57)
SLOW_LOAD = """
import runpy, sys, time
sys.path.insert(0, sys.argv[1])
import common.plumbing.harness as harness

def slow_load(*a, **k):  # the model load, long enough to be interrupted
    print("loading", flush=True)
    time.sleep(120)

harness.load_backbone = slow_load
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_model_load_is_one_line_and_128_plus_the_signal(
    tiny_sd3, tmp_path, prompts_file, sig
):
    """Ctrl-C during the model load was an 18-frame traceback (once swallowed, with exit 0); SIGTERM exited 143
    without a word. Real process, real signal, at the model load."""
    flags = tiny_flags(tiny_sd3, tmp_path, prompts_file)
    p = subprocess.Popen(
        [sys.executable, "-c", SLOW_LOAD, ROOT, os.path.join(ROOT, SCRIPT), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(),
        cwd=ROOT,
    )
    for line in p.stdout:
        if line.strip() == "loading":
            break
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, (p.returncode, err[-2000:])
    assert err.strip() == (
        f"stopped by {signal.Signals(sig).name} during the set-up, before training started; nothing was written: "
        "run the same command again"
    ), err[-2000:]
    assert os.listdir(tmp_path / "run") == [".lock"]  # no run output: the same command runs


def test_the_set_up_puts_the_signal_handlers_back_when_it_stops(tmp_path, prompts_file):
    """A set-up refused in one line leaves the process's own handlers (a test runner's, a notebook's) in place."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(ConfigError):
        run_main(
            SCRIPT, "--output-dir", str(tmp_path), "--eval-prompts", str(tmp_path / "missing.txt")
        )
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.fixture
def wandb_online(monkeypatch, tmp_path):
    """wandb online, with no key anywhere it looks (environment, ~/.netrc, its settings file)."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home"))
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    import wandb.sdk.wandb_setup as ws

    ws.singleton().settings.mode = (
        "online"  # the singleton read WANDB_MODE=disabled at its first use
    )
    yield
    ws.singleton().settings.mode = "disabled"


def test_track_without_a_key_or_with_a_bad_project_is_one_line_before_the_model_loads(
    tiny_sd3, tmp_path, prompts_file, monkeypatch, wandb_online
):
    """--track online without a key, or with a project name wandb refuses: a traceback after the model load, with
    args.json left behind; now one line before it, nothing written."""
    import common.plumbing.harness

    monkeypatch.setattr(
        common.plumbing.harness,
        "load_backbone",
        lambda *a, **k: pytest.fail("the model was loaded"),
    )
    flags = [*tiny_flags(tiny_sd3, tmp_path / "out", prompts_file), "--track"]
    with pytest.raises(ConfigError) as e:
        run_main(SCRIPT, *flags)
    assert "no wandb API key is set" in str(e.value.code) and "WANDB_MODE=offline" in str(
        e.value.code
    )
    with pytest.raises(ConfigError) as e:
        run_main(SCRIPT, *flags, "--wandb-project-name", "team/project")
    assert str(e.value.code).startswith(
        "error: --wandb-project-name 'team/project': wandb takes 1 to 128"
    )
    assert not os.path.exists(tmp_path / "out")


def test_track_to_a_server_nothing_answers_at_is_one_line_before_the_model_loads(
    tiny_sd3, tmp_path, prompts_file, monkeypatch, wandb_online
):
    """A key but no network (here: a port nothing listens on): wandb spent 5 s on each of its two identity lookups,
    then WANDB_INIT_TIMEOUT on the run, after the model load. Now one line before the model loads, nothing written;
    behind a proxy the check is left to wandb (the proxy is what would have to answer)."""
    import wandb.sdk.wandb_setup as ws

    import common.plumbing.harness
    import common.plumbing.tracking

    monkeypatch.setattr(
        common.plumbing.harness,
        "load_backbone",
        lambda *a, **k: pytest.fail("the model was loaded"),
    )
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    # the singleton read WANDB_BASE_URL at its first use; a run reads it at its start
    monkeypatch.setattr(ws.singleton().settings, "base_url", "http://127.0.0.1:9")
    flags = [*tiny_flags(tiny_sd3, tmp_path / "out", prompts_file), "--track"]
    t = time.time()
    with pytest.raises(ConfigError) as e:
        run_main(SCRIPT, *flags)
    msg = str(e.value.code)
    assert msg.startswith(
        "error: --track logs online to http://127.0.0.1:9, and this machine cannot"
    )
    assert "ConnectionRefusedError" in msg and "WANDB_MODE=offline" in msg and "\n" not in msg
    assert time.time() - t < common.plumbing.tracking.REACH_TIMEOUT_S and not os.path.exists(
        tmp_path / "out"
    )
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    common.plumbing.tracking.check_reachable(
        "http://127.0.0.1:9", None
    )  # through a proxy: not probed


@pytest.fixture
def wandb_server(monkeypatch):
    """A wandb server on loopback that says whose key it is (the identity lookups) and then never answers the
    run's creation: what a server that accepts a connection and stalls looks like to wandb.init."""
    import http.server
    import threading

    release = threading.Event()

    class Stall(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if b"viewer" not in body:
                release.wait(60)  # the run's creation: no reply while the test runs
                return
            who = {"id": "1", "entity": "e", "username": "u", "flags": "{}", "teams": {"edges": []}}
            reply = json.dumps({"data": {"viewer": who}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stall)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    import wandb.sdk.wandb_setup as ws

    # the singleton read WANDB_BASE_URL at its first use
    monkeypatch.setattr(
        ws.singleton().settings, "base_url", f"http://127.0.0.1:{server.server_address[1]}"
    )
    yield
    release.set()
    server.shutdown()
    server.server_close()


def test_a_wandb_server_that_never_starts_the_run_is_bounded_and_leaves_no_run(
    tmp_path, monkeypatch, wandb_online, wandb_server
):
    """A key, a server that answers and then stalls: wandb.init waited 109 s, then a traceback, args.json left
    behind. Now it waits WANDB_INIT_TIMEOUT (here 1 s), says what to do in one line and removes what this run
    wrote."""
    from common.plumbing.run import RunLogger

    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "1")
    run = tmp_path / "run"
    run.mkdir()
    t = time.time()
    with pytest.raises(ConfigError) as e:
        RunLogger(str(run), True, True, {"seed": 1}, "flow-rl", None, "run")
    msg = str(e.value.code)
    assert msg.startswith("error: --track: wandb did not start in ") and "\n" not in msg, msg
    assert "WANDB_MODE=offline" in msg and "WANDB_INIT_TIMEOUT=1 s" in msg
    assert time.time() - t < 10 and os.listdir(run) == []
