"""One owner per run folder (issue #38, class 1): a folder that already holds a run is refused without --resume, and
a run holds its folder with an exclusive lock, so two processes never write one folder. Real processes throughout:
two training scripts started together on one folder, a holder killed with SIGKILL, a second run on a finished one."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT, read_metrics, run_main, script_env, tiny_flags, write_prompts

SCRIPT = "flowgrpo_baseline.py"
HOLD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from common.plumbing.run_folder import hold_run_folder
    hold_run_folder(sys.argv[1])
    print("held", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def no_model_load(monkeypatch):
    import common.backbones

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(common.backbones, "load_backbone", refuse)


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(
        tmp_path / "prompts.txt", ["a photo of a red circle", "a photo of two blue squares"]
    )


def holder(run_dir):
    os.makedirs(run_dir, exist_ok=True)
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir), ROOT], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "held"
    return p


def start(tiny_sd3, tmp_path, prompts_file):
    env = script_env()
    cmd = [
        sys.executable,
        os.path.join(ROOT, SCRIPT),
        *tiny_flags(tiny_sd3, tmp_path, prompts_file, "shared"),
    ]
    return subprocess.Popen(
        [*cmd, "--num-iterations", "1"],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_two_scripts_started_on_one_folder_one_runs_the_other_stops_in_one_line(
    tiny_sd3, tmp_path, prompts_file
):
    a, b = start(tiny_sd3, tmp_path, prompts_file), start(tiny_sd3, tmp_path, prompts_file)
    (_, err_a), (_, err_b) = a.communicate(timeout=300), b.communicate(timeout=300)
    codes = sorted([a.returncode, b.returncode])
    assert codes == [0, 1], (err_a[-2000:], err_b[-2000:])
    loser = err_a if a.returncode else err_b
    lines = [line for line in loser.strip().splitlines() if line.strip()]
    assert "Traceback" not in loser and len(lines) == 1, loser
    assert "being written by another process" in lines[0] or "already holds a run" in lines[0]
    m = read_metrics(tmp_path / "shared")  # the winner's run, whole and alone
    assert [r["iteration"] for r in m] == [0, 1]


def test_a_folder_held_by_a_live_process_is_refused_before_the_model_loads(
    tiny_sd3, tmp_path, prompts_file
):
    run = tmp_path / "run"
    p = holder(run)
    try:
        with pytest.raises(SystemExit, match=rf"being written by another process \(pid {p.pid}\)"):
            run_main(SCRIPT, *tiny_flags(tiny_sd3, tmp_path, prompts_file), "--num-iterations", "1")
        assert sorted(os.listdir(run)) == [".lock"]  # nothing written
    finally:
        p.kill()
        p.wait()


def test_the_lock_of_a_killed_run_is_gone_with_it(tmp_path):
    from common.plumbing.run_folder import hold_run_folder, release_run_folder

    run = str(tmp_path / "run")
    p = holder(run)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    hold_run_folder(run)  # a SIGKILL leaves no stale lock
    release_run_folder(run)


def test_a_second_run_on_a_finished_run_is_refused_and_the_first_is_untouched(
    tiny_sd3, tmp_path, prompts_file
):
    flags = [*tiny_flags(tiny_sd3, tmp_path, prompts_file), "--num-iterations", "1"]
    run_main(SCRIPT, *flags)
    run = tmp_path / "run"
    before = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "args.json")}
    with pytest.raises(
        SystemExit, match=r"already holds a run \(args.json, checkpoint-1, metrics.jsonl, samples\)"
    ):
        run_main(SCRIPT, *flags, "--learning-rate", "1e-3")
    assert {n: (run / n).read_bytes() for n in before} == before
    assert sorted(n for n in os.listdir(run) if n.startswith("checkpoint-")) == ["checkpoint-1"]
    # a resume that would train nothing is refused before it touches the run (it used to drop the final row)
    with pytest.raises(
        SystemExit, match=r"is at iteration 1 and --num-iterations 1 asks for no more"
    ):
        run_main(SCRIPT, *flags, "--resume", str(run))
    assert {n: (run / n).read_bytes() for n in before} == before
    # what the message says works
    run_main(SCRIPT, *flags[:-2], "--num-iterations", "2", "--resume", str(run))
    assert [r["iteration"] for r in read_metrics(run)] == [0, 1, 2]


def test_a_run_killed_after_its_last_save_resumes_to_its_final_evaluation(
    tiny_sd3, tmp_path, prompts_file
):
    """A kill between the last checkpoint and the end (the final evaluation, the pictures) leaves a run that owes its
    final row: `--resume` at the same --num-iterations runs only that evaluation, trains nothing, and the run ends
    as the uninterrupted one did. (The end-to-end kill test met this when a kill landed there.)"""
    flags = [*tiny_flags(tiny_sd3, tmp_path, prompts_file), "--num-iterations", "1"]
    run_main(SCRIPT, *flags)
    run = tmp_path / "run"
    rows = read_metrics(run)
    assert rows[-1]["final"] and rows[-1]["iteration"] == 1
    weights = (run / "checkpoint-1" / "pytorch_lora_weights.safetensors").read_bytes()
    # the kill: everything but the final row
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    run_main(SCRIPT, *flags, "--resume", str(run))
    again = read_metrics(run)
    assert [r["iteration"] for r in again] == [r["iteration"] for r in rows] and again[-1]["final"]
    # the same weights, the same seeds
    assert again[-1]["eval/accuracy"] == rows[-1]["eval/accuracy"]
    assert (run / "checkpoint-1" / "pytorch_lora_weights.safetensors").read_bytes() == weights


def test_path_flags_are_compared_by_what_they_point_to(tmp_path, monkeypatch):
    """The same prompts file by a relative path, or a copy of it (a second clone of the repository), is the same
    experiment; a file with other content is not."""
    from common.plumbing.run_folder import changed_flags

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "prompts.txt").write_text("a photo of a red circle\n")
    (tmp_path / "other.txt").write_text("a photo of a blue square\n")
    monkeypatch.chdir(tmp_path)
    saved = {"prompts_file": str(tmp_path / "a" / "prompts.txt"), "seed": 1}
    # relative spelling
    assert changed_flags(saved, {"prompts_file": "a/prompts.txt", "seed": 1}) == []
    # a copy
    assert (
        changed_flags(saved, {"prompts_file": str(tmp_path / "b" / "prompts.txt"), "seed": 1}) == []
    )
    assert [c[0] for c in changed_flags(saved, {"prompts_file": "other.txt", "seed": 1})] == [
        "prompts_file"
    ]
    assert [c[0] for c in changed_flags(saved, {"prompts_file": "a/prompts.txt", "seed": 2})] == [
        "seed"
    ]


def test_a_model_folder_is_known_by_its_files_and_configs(tmp_path):
    import shutil

    from common.plumbing.checkpoint import path_fingerprint, same_path_meaning

    model = tmp_path / "clone1" / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    (model / "transformer" / "config.json").write_text('{"num_layers": 2}')
    (model / "transformer" / "weights.safetensors").write_bytes(b"\0" * 1000)
    shutil.copytree(model, tmp_path / "clone2" / "model")
    # a second clone: the same model
    assert same_path_meaning(str(model), str(tmp_path / "clone2" / "model"))
    (tmp_path / "clone2" / "model" / "transformer" / "config.json").write_text('{"num_layers": 3}')
    assert not same_path_meaning(str(model), str(tmp_path / "clone2" / "model"))
    assert path_fingerprint(str(tmp_path / "nowhere")) is None


def test_a_path_that_is_gone_is_compared_with_what_the_checkpoint_recorded(tmp_path):
    """A checkpoint records each path flag's fingerprint: when the saved path no longer exists (the first clone was
    deleted), a path with the same content is the same experiment and one with other content is not; without a
    record (a checkpoint from before 2026-12-03) a vanished path counts as changed."""
    from common.plumbing.checkpoint import path_fingerprints
    from common.plumbing.run_folder import changed_flags

    old = tmp_path / "clone_a" / "prompts.txt"
    old.parent.mkdir()
    old.write_text("a photo of a red circle\n")
    saved = {"prompts_file": str(old), "model_path": str(tmp_path / "nowhere")}
    recorded = path_fingerprints(saved)
    assert list(recorded) == ["prompts_file"]  # only what exists is recorded
    shutil.rmtree(old.parent)
    same, other = tmp_path / "same.txt", tmp_path / "other.txt"
    same.write_text("a photo of a red circle\n")
    other.write_text("a photo of a blue square\n")
    assert changed_flags(saved, {**saved, "prompts_file": str(same)}, recorded) == []
    assert [
        c[0] for c in changed_flags(saved, {**saved, "prompts_file": str(other)}, recorded)
    ] == ["prompts_file"]
    assert [c[0] for c in changed_flags(saved, {**saved, "prompts_file": str(same)})] == [
        "prompts_file"
    ]


def test_a_run_started_in_one_clone_resumes_from_another(tmp_path):
    """End to end, real processes: DenseGRPO at its defaults' paths (--model-path and --prompts-file default to
    absolute paths into the clone) trains 1 iteration from clone A; clone A is deleted; `--resume` from clone B
    (another folder, the same files) continues to iteration 2: the same experiment, not a changed flag (the
    checkpoint recorded what each path pointed to); psi(t) comes from the checkpoint."""
    clones = []
    for name in ("clone_a", "clone_b"):
        clone = tmp_path / name
        shutil.copytree(
            os.path.join(ROOT, "common"),
            clone / "common",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        shutil.copy(os.path.join(ROOT, "densegrpo.py"), clone)
        clones.append(clone)
    evals = write_prompts(tmp_path / "eval.txt", ["a photo of a red circle"])
    small = [
        "--groups-per-iteration",
        "2",
        "--group-size",
        "2",
        "--rollout-batch-size",
        "4",
        "--eval-prompts",
        evals,
    ]
    small += [
        "--eval-seeds-per-prompt",
        "1",
        "--eval-num-steps",
        "4",
        "--calibration-iterations",
        "1",
    ]
    small += [
        "--calibration-trajectories",
        "2",
        "--timestep-fraction",
        "0.5",
        "--output-dir",
        str(tmp_path / "runs"),
    ]
    env = script_env()  # its PYTHONPATH is replaced by each clone's below

    def run(clone, *flags):
        cmd = [sys.executable, str(clone / "densegrpo.py"), *small, *flags]
        p = subprocess.run(
            cmd, env={**env, "PYTHONPATH": str(clone)}, cwd=clone, text=True, capture_output=True
        )
        assert p.returncode == 0, p.stderr[-2000:]

    run(clones[0], "--run-name", "r", "--num-iterations", "1")
    run_dir = tmp_path / "runs" / "r"
    # the first clone is gone: its paths are compared with what the checkpoint recorded of them
    shutil.rmtree(clones[0])
    run(clones[1], "--num-iterations", "2", "--resume", str(run_dir))
    rows = read_metrics(str(run_dir))
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows[-1]["final"]
    assert json.loads((run_dir / "args.json").read_text())["model_path"].startswith(str(clones[1]))


# ============================================================ what a resume knows about the folder (issue #57)
@pytest.fixture(scope="module")
def finished(tiny_sd3, tmp_path_factory):
    """A finished 1-iteration flowgrpo run whose evaluation prompts came from a pipe (`<(...)`, /dev/fd/N)."""
    out = tmp_path_factory.mktemp("finished")
    prompts = write_prompts(
        out / "p.txt", ["a photo of a red circle", "a photo of two blue squares"]
    )
    flags = [
        *tiny_flags(tiny_sd3, out, prompts),
        "--num-iterations",
        "1",
        "--eval-prompts",
        pipe(PIPED),
    ]
    run_main(SCRIPT, *flags)
    return {"run": str(out / "run"), "flags": flags}


PIPED = ["a photo of a red circle", "a photo of a blue square"]


_PIPE_FD: list[
    int
] = []  # the descriptor every pipe() takes, chosen once and kept open (no other file gets it)


def pipe(prompts) -> str:
    """What bash's `<(printf ...)` gives a script: /dev/fd/N (bash's N is 63), a pipe that holds `prompts` and is
    read once. N is the first descriptor from 63 that no open file uses, chosen once, then reused: dup2 onto a
    descriptor in use swaps the pipe in under that file, whose close (or collection) then closes the pipe before
    the script reads it (CI, 2026-12-06: "--eval-prompts '/dev/fd/63' does not exist")."""
    if not _PIPE_FD:
        fd = 63
        while _is_open(fd):
            fd += 1
        _PIPE_FD.append(fd)
    r, w = os.pipe()
    os.write(w, ("\n".join(prompts) + "\n").encode())
    os.close(w)
    os.dup2(r, _PIPE_FD[0])
    os.close(r)
    return f"/dev/fd/{_PIPE_FD[0]}"


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_resume_compares_piped_evaluation_prompts_by_content(finished, no_model_load):
    """The run read its --eval-prompts from a pipe, and so does the resume: the same name (/dev/fd/N) with other
    prompts is a changed flag (it was not compared: the resume trained on and wrote rows on other prompts); the same
    prompts pass the check (the run is then refused only because it asks for no more iterations)."""
    run, flags = finished["run"], list(finished["flags"])
    before = open(os.path.join(run, "metrics.jsonl")).read()
    path = flags[-1] = pipe(["a photo of two green triangles", "a photo of a red circle"])
    assert path == finished["flags"][-1]  # the same name as the run's
    with pytest.raises(SystemExit) as e:
        run_main(SCRIPT, *flags, "--num-iterations", "2", "--resume", run)
    assert str(e.value.code) == (
        f"error: --resume {run}/checkpoint-1 was trained with other experiment-defining flags: --eval-prompts "
        f"'{path}' -> '{path} (other content)'; drop them to continue that run with its own values, or add "
        "--resume-override to start a new run folder from its weights"
    )
    flags[-1] = pipe(PIPED)
    with pytest.raises(
        SystemExit, match="is at iteration 1 and --num-iterations 1 asks for no more"
    ):
        run_main(SCRIPT, *flags, "--resume", run)
    assert open(os.path.join(run, "metrics.jsonl")).read() == before


def test_a_checkpoint_name_with_leading_zeros_is_refused_not_guessed(
    finished, tmp_path, no_model_load
):
    """checkpoint-02 beside checkpoint-2 silently resumed from another iteration; now it is named in one line."""
    run = str(tmp_path / "run")
    shutil.copytree(finished["run"], run)
    shutil.copytree(os.path.join(run, "checkpoint-1"), os.path.join(run, "checkpoint-01"))
    for target in (run, os.path.join(run, "checkpoint-01")):
        with pytest.raises(SystemExit) as e:
            run_main(SCRIPT, *finished["flags"], "--num-iterations", "2", "--resume", target)
        assert str(e.value.code) == (
            f"error: --resume '{target}': {run}/checkpoint-01 is not a checkpoint name this code writes "
            "(checkpoint-N has no leading zeros), so which iteration it holds is ambiguous: rename it to "
            "checkpoint-N, or move it out of the run folder"
        )


@pytest.mark.parametrize("named", [True, False])
def test_a_folder_of_another_script_without_a_checkpoint_names_that_script(
    tmp_path, no_model_load, named
):
    """A DenseGRPO run folder that died before its first checkpoint, resumed with diffusionnft.py: the line names
    densegrpo.py (by args.json's `script`, or for older folders by the flags only densegrpo.py has), instead of
    listing ~30 flags to drop."""
    import runpy

    mod = runpy.run_path(os.path.join(ROOT, "densegrpo.py"), run_name="not_main")
    saved = json.loads(json.dumps(dataclasses.asdict(mod["Args"]()), default=str))
    if named:
        saved = {"script": "densegrpo.py", **saved}
    early = tmp_path / "early"
    early.mkdir()
    (early / "args.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit) as e:
        run_main("diffusionnft.py", "--resume", str(early))
    assert str(e.value.code) == (
        f"error: --resume {early} was written by densegrpo.py, not diffusionnft.py: resume it with "
        f"`python densegrpo.py --resume {early}`"
    )
    assert os.listdir(early) == ["args.json"]


def test_a_read_only_run_folder_is_one_line_on_resume(finished, tmp_path, no_model_load):
    """The resume path skipped the write probe: a read-only copy of a run was an OSError traceback."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here: needs root")
    try:
        run = str(mnt / "run")
        shutil.copytree(finished["run"], run)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(SystemExit) as e:
            run_main(
                SCRIPT,
                *finished["flags"][:-1],
                pipe(PIPED),
                "--num-iterations",
                "2",
                "--resume",
                run,
            )
        assert str(e.value.code) == (
            f"error: --resume: cannot write the run folder {run} (OSError: Read-only file system): make it "
            "writable, or copy the run folder to a place you can write and resume the copy"
        )
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
