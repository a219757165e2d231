"""Fault injection: processes killed mid-save, broken checkpoints, a resume under other flags, bad numbers, an
unwritable output folder, NaN rewards and losses, a rank that dies or hangs. Each case asserts its exact outcome.

The long randomised kill loop is benchmarks/bench_faults.py; here a short one (40 kills) and an exhaustive one (a crash
before every file-system call of a save) keep the suite fast.
"""

import dataclasses
import errno
import filecmp
import json
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from fault_worker import save_loop, tiny_state, tiny_weights
from helpers import ROOT, read_metrics, run_main, script_env, tiny_flags, write_prompts
from safetensors.torch import load_file

import common.plumbing.checkpoint as ck
import common.plumbing.resume as rs
import common.plumbing.run_folder as rf
from common.plumbing.checks import ConfigError

SCRIPTS = ["flowgrpo_baseline.py", "g2rpo.py", "densegrpo.py"]
PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]
FAST = ["--learning-rate", "1e-2", "--eval-every", "100", "--save-every", "1"]


# ============================================================ kills and crashes in the middle of a save
def _resume_point(run_dir: str) -> int:
    """The iteration a resume of run_dir starts from (0: no checkpoint), checking the checkpoint's content."""
    if not ck.list_checkpoints(run_dir):
        return 0
    folder = rf.find_resume_checkpoint(run_dir, log=lambda *_: None)
    state = rs.load_checkpoint(folder)
    # checkpoint-N, or the complete copy of a save killed between its two renames (a resave of the same N)
    assert folder in (
        ck.checkpoint_dir(run_dir, state["iteration"]),
        os.path.join(run_dir, f".checkpoint-{state['iteration']}.tmp"),
    )
    assert torch.equal(state["params"]["w"], tiny_state(state["iteration"])["params"]["w"])
    return state["iteration"]


def _forked(fn) -> int:
    """Run fn() in a forked child (torch is already imported: a fork costs milliseconds, not an import)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return pid


def kill_loop(run_dir: str, kills: int, seed: int, max_delay: float = 0.25) -> dict:
    """Start a saving process, SIGKILL it at a random instant, resume from what a resume finds, repeat."""
    rng, figures = (
        random.Random(seed),
        {"kills": 0, "resumes": 0, "lost": 0, "mid_save": 0, "saves": 0},
    )
    start = 0
    for _ in range(kills):
        r, w = os.pipe()
        pid = _forked(
            lambda: (os.close(r), save_loop(run_dir, start, lambda i: os.write(w, b"%d\n" % i)))  # noqa: B023
        )
        os.close(w)
        time.sleep(rng.uniform(0.0, max_delay))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            done = [int(x) for x in f.read().split()]
        figures["kills"] += 1
        figures["saves"] += len(done)
        last_completed = done[-1] if done else start
        figures["mid_save"] += any(n.endswith(".tmp") for n in os.listdir(run_dir))
        resumed = _resume_point(run_dir)  # verifies the checkpoint and its content
        figures["resumes"] += 1
        # Nothing completed is lost; at most the save in flight (renamed but not yet reported) is ahead.
        figures["lost"] += max(0, last_completed - resumed)
        assert last_completed <= resumed <= last_completed + 1, (last_completed, resumed)
        # keep 2, plus at most one renamed before its rotation
        assert len(ck.list_checkpoints(run_dir)) <= 3
        start = resumed
    return figures


def test_sigkill_at_random_points_of_a_save_never_loses_a_completed_save(tmp_path):
    figures = kill_loop(str(tmp_path / "run"), kills=40, seed=0)
    print("kill loop:", figures)
    assert figures["kills"] == figures["resumes"] == 40 and figures["lost"] == 0
    assert figures["mid_save"] >= 10  # the kills do land inside saves, not only between them
    # and the run made progress: every reported save is still counted in where a resume starts
    assert figures["saves"] >= 10 and _resume_point(str(tmp_path / "run")) >= figures["saves"]


def test_a_real_run_killed_at_random_instants_resumes_to_the_uninterrupted_weights(
    tiny_sd3, tmp_path, capsys
):
    """End to end, real processes: a DenseGRPO run (it writes every kind of file a run writes: its lock,
    args.json, psi.json, metrics.jsonl, checkpoint-N with ψ inside) is SIGKILLed at a random instant after each
    new checkpoint, twice, and continued with --resume each time. It ends with the uninterrupted run's trained
    weights bit for bit, every metrics row exactly once, and whole side files: a kill loses at most the work
    since the last checkpoint, never a file."""
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS)
    dense = ["--calibration-iterations", "2", "--calibration-trajectories", "2"]
    dense += ["--completion-batch-size", "4", "--num-iterations", "4", *FAST]

    def flags(name):
        return [*tiny_flags(tiny_sd3, tmp_path, prompts, name), *dense]

    run_main("densegrpo.py", *flags("straight"))
    digest = [ln for ln in capsys.readouterr().out.splitlines() if "sha256" in ln][-1].split()[-1]
    run, rng = tmp_path / "killed", random.Random(0)
    env = script_env()  # this process's one thread: the weights compared bit for bit come from both
    cmd = [sys.executable, os.path.join(ROOT, "densegrpo.py"), *flags("killed")]
    kills = 0

    def new_checkpoint(before):
        names = os.listdir(run) if run.exists() else []
        return any(n.startswith("checkpoint-") and n not in before for n in names)

    for attempt in range(2):
        before = set(os.listdir(run)) if run.exists() else set()
        p = subprocess.Popen(
            cmd + (["--resume", str(run)] if attempt else []),
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while p.poll() is None and not new_checkpoint(before):
            time.sleep(0.05)  # a new checkpoint: from here on a kill has something to resume from
        time.sleep(rng.uniform(0.0, 0.6))  # then anywhere: a save, a metrics append, the rollout
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        killed = "killed" if p.returncode == -signal.SIGKILL else "finished"
        print(
            f"run {attempt}: {killed} with", sorted(n for n in os.listdir(run) if "checkpoint" in n)
        )
    assert kills >= 1, "both runs finished before their kill: the test killed nothing"
    if not read_metrics(run)[-1].get("final"):  # the second run was killed, not finished
        last = subprocess.run(
            [*cmd, "--resume", str(run)], env=env, cwd=ROOT, capture_output=True, text=True
        )
        assert last.returncode == 0, last.stderr[-3000:]
        assert f"sha256 {digest}" in last.stdout  # the uninterrupted run's weights, bit for bit
    weights = [
        load_file(str(d / "checkpoint-4" / "pytorch_lora_weights.safetensors"))
        for d in (tmp_path / "straight", run)
    ]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    rows = [r["iteration"] for r in read_metrics(run)]
    assert rows == [r["iteration"] for r in read_metrics(tmp_path / "straight")]
    for side in ("args.json", "psi.json"):
        json.loads((run / side).read_text())  # whole, not cut by a kill
    psi = json.loads((run / "psi.json").read_text())["psi"]
    assert psi == json.loads((tmp_path / "straight" / "psi.json").read_text())["psi"]


FS_CALLS = [
    (os, "makedirs"),
    (os, "replace"),
    (os, "fsync"),
    (os, "open"),
    (shutil, "rmtree"),
    (torch, "save"),
]


def _crash_at(n: int):
    """Patch the file-system calls of a save so that the n-th one kills the process before it runs."""
    count = [0]
    for mod, name in FS_CALLS:
        real = getattr(mod, name)

        def wrapped(*a, _real=real, **k):
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*a, **k)

        setattr(mod, name, wrapped)


@pytest.mark.parametrize("resave", [False, True], ids=["new-iteration", "same-iteration-again"])
def test_a_crash_before_any_file_system_call_of_a_save_leaves_a_resumable_run(tmp_path, resave):
    """Exhaustive: checkpoints 1 and 2 exist; a save of 3 (or of 2 again, as after a resume from 1) dies before its
    n-th call of makedirs/open/fsync/torch.save/replace/rmtree, for every n. A resume then finds 2 (or 3: the save
    got through its rename); never anything incomplete, never an older one."""
    n, survived = 0, 0
    target = 2 if resave else 3
    while True:
        n += 1
        run = str(tmp_path / f"run{n}")
        for i in (1, 2):
            ck.save_checkpoint(run, tiny_state(i), tiny_weights(i), keep=2)
        pid = _forked(
            lambda: (
                _crash_at(n),  # noqa: B023
                ck.save_checkpoint(run, tiny_state(target), tiny_weights(target), 2),  # noqa: B023
            )
        )
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        resumed = _resume_point(run)
        assert resumed in ({2} if resave else {2, 3}), (n, resumed)
        if not killed:
            survived = n
            break
        shutil.rmtree(run)
    assert survived > 8  # a save makes this many calls; each was a crash point


def test_disk_full_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    ck.save_checkpoint(run, tiny_state(1), tiny_weights(1))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(SystemExit) as e:
        ck.save_checkpoint(run, tiny_state(2), tiny_weights(2))
    msg = str(e.value.code)
    assert msg == (
        f"error: could not write {run}/checkpoint-2 (OSError: No space left on device; the disk is full); the last complete "
        f"checkpoint, {run}/checkpoint-1, is intact: free space or fix the folder's permissions, then "
        f"--resume {run}"
    )
    assert sorted(os.listdir(run)) == ["checkpoint-1"]  # the temporary folder is gone too


@pytest.mark.parametrize("fills", ["torch.save", "safetensors"])
def test_a_real_full_disk_during_a_save_is_one_line_and_loses_nothing(small_disk, fills):
    """checkpoint-1 (400 kB) fits the 1 MiB disk; checkpoint-2 (800 kB, in the trainer state or in the weights)
    does not. The save stops in one line naming the intact checkpoint-1, removes its temporary folder (the disk is as
    free as before it) and leaves checkpoint-1 verifiable."""
    from safetensors.torch import save_file

    run = os.path.join(small_disk, "run")

    def save(i: int, numel: int):
        blob, small = torch.zeros(numel), torch.zeros(4)
        state = {"iteration": i, "args": {}, "blob": blob if fills == "torch.save" else small}
        weights = {"w": small if fills == "torch.save" else blob}
        return ck.save_checkpoint(
            run, state, lambda d: save_file(weights, os.path.join(d, "w.safetensors")), keep=2
        )

    save(1, 100_000)
    free = shutil.disk_usage(small_disk).free
    with pytest.raises(SystemExit) as e:
        save(2, 200_000)
    msg = str(e.value.code)
    assert msg.startswith(f"error: could not write {run}/checkpoint-2 (") and "\n" not in msg, msg
    assert msg.endswith(
        f"the disk is full); the last complete checkpoint, {run}/checkpoint-1, is intact: free space "
        f"or fix the folder's permissions, then --resume {run}"
    ), msg
    assert (
        sorted(os.listdir(run)) == ["checkpoint-1"] and shutil.disk_usage(small_disk).free == free
    )
    assert ck.verify_checkpoint(os.path.join(run, "checkpoint-1")) is None


def test_rotation_keeps_the_newest_k(tmp_path):
    run = str(tmp_path / "run")
    for i in range(1, 6):
        ck.save_checkpoint(run, tiny_state(i), tiny_weights(i), keep=2)
    assert [i for i, _ in ck.list_checkpoints(run)] == [4, 5]
    for i in range(6, 8):
        ck.save_checkpoint(run, tiny_state(i), tiny_weights(i), keep=0)  # 0 keeps all
    assert [i for i, _ in ck.list_checkpoints(run)] == [4, 5, 6, 7]


# ============================================================ broken checkpoints
def _damage(folder, how):
    path = os.path.join(folder, ck.STATE_FILE)
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "corrupt":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "no-marker":
        os.remove(os.path.join(folder, ck.MARKER))
    elif how == "missing-state":
        os.remove(path)


DAMAGE = {
    "truncated": "{c}/trainer_state.pt is truncated (",
    "corrupt": "{c}/trainer_state.pt is corrupt (its sha256 differs from the one recorded in COMPLETE.json)",
    "no-marker": "{c} has no COMPLETE.json: its save never finished",
    "missing-state": "{c}/trainer_state.pt is missing",
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_checkpoint_is_one_line_or_falls_back(tmp_path, how):
    run = str(tmp_path / "run")
    for i in (1, 2):
        ck.save_checkpoint(run, tiny_state(i), tiny_weights(i))
    c1, c2 = ck.checkpoint_dir(run, 1), ck.checkpoint_dir(run, 2)
    _damage(c2, how)
    problem = DAMAGE[how].format(c=c2)
    # The checkpoint folder named explicitly: stop, and name the older complete one to pass instead.
    with pytest.raises(ConfigError) as e:
        rf.find_resume_checkpoint(c2)
    assert str(e.value.code).startswith(f"error: --resume: {problem}") and "\n" not in str(
        e.value.code
    )
    assert str(e.value.code).endswith(
        f"pass the older complete checkpoint instead: --resume {c1} (or the run folder {run})"
    )
    # The run folder: say so in one line, and use the older complete one.
    said = []
    assert rf.find_resume_checkpoint(run, log=said.append) == c1
    assert (
        len(said) == 1
        and said[0].startswith(f"warning: {problem}")
        and said[0].endswith(f"resuming from {c1}, the latest complete checkpoint, instead")
    )
    # Nothing complete left: one line, no fallback.
    _damage(c1, how)
    with pytest.raises(ConfigError) as e:
        rf.find_resume_checkpoint(run)
    assert str(e.value.code).startswith(f"error: --resume: {problem}") and str(
        e.value.code
    ).endswith(
        "(and 1 older checkpoint(s) are unusable too); this run has no complete checkpoint: start a new run without "
        "--resume"
    )


def test_missing_or_empty_resume_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        rf.find_resume_checkpoint(str(tmp_path / "nope"))
    assert str(e.value.code) == (
        f"error: --resume '{tmp_path}/nope' does not exist: pass a run folder "
        "({output_dir}/{run_name}) or one of its checkpoint-N folders"
    )
    with pytest.raises(ConfigError) as e:
        rf.find_resume_checkpoint(str(tmp_path))
    assert "holds no checkpoint-N folder" in str(e.value.code)


def test_a_checkpoint_that_passes_its_checksum_but_will_not_unpickle_is_one_line(tmp_path):
    folder = str(tmp_path / "checkpoint-1")
    os.makedirs(folder)
    with open(os.path.join(folder, ck.STATE_FILE), "wb") as f:
        f.write(b"not a zip")
    with pytest.raises(ConfigError) as e:
        rs.load_checkpoint(folder)
    assert str(e.value.code).startswith(
        f"error: --resume: {folder}/trainer_state.pt is unreadable ("
    )


# ============================================================ loaded structures checked before use (issue #57)
def _write_marker(folder, edit):
    path = os.path.join(folder, ck.MARKER)
    marker = json.load(open(path))
    text = edit(marker)
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(marker))


MARKER_DAMAGE = {
    "files a list": lambda m: m.update(files=list(m["files"])),
    "a null file entry": lambda m: m["files"].update({ck.STATE_FILE: None}),
    "a size as text": lambda m: m["files"][ck.STATE_FILE].update(size="12"),
    "iteration as text": lambda m: m.update(iteration="2"),
    "another iteration": lambda m: m.update(iteration=7),
    "a file outside": lambda m: m["files"].update({"../../outside": {"size": 1, "sha256": "x"}}),
    "args a list": lambda m: m.update(args=[1, 2]),
    "a list": lambda m: "[1, 2]",
    "deep nesting": lambda m: "[" * 200_000 + "]" * 200_000,
    "nested 40 deep": lambda m: json.dumps({**m, "args": json.loads("[" * 40 + "]" * 40)}),
}


@pytest.mark.parametrize("how", list(MARKER_DAMAGE))
def test_a_complete_json_of_the_wrong_shape_falls_back_to_the_previous_checkpoint(tmp_path, how):
    """Valid JSON of the wrong shape in COMPLETE.json (or JSON too deep to parse) is the checkpoint's problem, in one
    warning line naming the file: the resume of the run uses the previous checkpoint, as for a damaged file (it was
    a KeyError / TypeError / RecursionError traceback)."""
    run = str(tmp_path / "run")
    for i in (1, 2):
        ck.save_checkpoint(run, tiny_state(i), tiny_weights(i))
    c1, c2 = ck.checkpoint_dir(run, 1), ck.checkpoint_dir(run, 2)
    _write_marker(c2, MARKER_DAMAGE[how])
    said = []
    assert rf.find_resume_checkpoint(run, log=said.append) == c1
    assert len(said) == 1 and said[0].startswith(f"warning: {c2}/COMPLETE.json is "), said
    assert "\n" not in said[0] and said[0].endswith(
        f"resuming from {c1}, the latest complete checkpoint, instead"
    )


def test_a_rotation_killed_mid_delete_is_tidied_by_the_next_save(tmp_path, monkeypatch):
    """A kill after a rotated checkpoint was renamed for deletion, before its files were gone, leaves a .del folder:
    the next save deletes it (a checkpoint-N.del was never tidied: a whole checkpoint's disk, kept forever)."""
    run = str(tmp_path / "run")
    for i in (1, 2):
        ck.save_checkpoint(run, tiny_state(i), tiny_weights(i), keep=1)
        if i == 1:  # the next rotation is "killed" between its rename and its delete
            monkeypatch.setattr(ck.shutil, "rmtree", lambda *a, **k: None)
    left = sorted(os.listdir(run))
    assert len(left) == 2 and left[-1] == "checkpoint-2" and left[0].endswith(".del"), left
    monkeypatch.undo()
    ck.save_checkpoint(run, tiny_state(3), tiny_weights(3), keep=1)
    assert sorted(os.listdir(run)) == ["checkpoint-3"]


def _tiny_model(seed=0):
    """A trained state as a script holds it: params, AdamW after a step, an EMA and an old policy (DiffusionNFT)."""
    from common.policy import EMA

    torch.manual_seed(seed)
    params = {"w": torch.nn.Parameter(torch.randn(4, 3)), "b": torch.nn.Parameter(torch.randn(3))}
    opt = torch.optim.AdamW(params.values(), lr=0.1)
    sum((p**2).sum() for p in params.values()).backward()
    opt.step()
    ema, old = EMA(params, 0.9), EMA(params, 0.5)
    return params, opt, ema, {"old_policy": old}


def _save_tiny(run, edit=None):
    params, opt, ema, extras = _tiny_model()
    state = {
        **ck.trainer_state(params, opt, ema, extras=extras),
        "iteration": 1,
        "counts": {},
        "rng": [ck.rng_state()],
        "args": {},
        "script": "x.py",
    }
    if edit:
        edit(state)
    return ck.save_checkpoint(run, state, lambda folder: None)


STATE_DAMAGE = {
    "EMA weight of shape (1,)": lambda s: s["ema"]["shadow"].update(w=torch.zeros(1)),
    "old policy of shape (1,)": lambda s: s["extras"]["old_policy"]["shadow"].update(
        w=torch.zeros(1)
    ),
    "old policy without a weight": lambda s: s["extras"]["old_policy"]["shadow"].pop("b"),
    "trained weight of shape (1,)": lambda s: s["params"].update(w=torch.zeros(1)),
    "Adam moment of another shape": lambda s: s["optimizer"]["state"][0].update(
        exp_avg=torch.zeros(1)
    ),
    "optimizer with a parameter less": lambda s: s["optimizer"]["param_groups"][0]["params"].pop(),
    "rng not a list": lambda s: s.update(rng={"python": 1}),
    "counts not numbers": lambda s: s.update(counts={"trajectories": "many"}),
    "params a list": lambda s: s.update(params=[1, 2]),
}


@pytest.mark.parametrize("how", list(STATE_DAMAGE))
def test_every_restored_state_is_checked_before_any_is_copied(tmp_path, how):
    """Weights, EMA, old policy, optimizer, RNG and counters of a checkpoint are checked against the model before
    anything is copied in: a (1,) EMA or old-policy tensor was broadcast by copy_ into the whole weight and training
    went on; now each is one line, and the model keeps its own values."""
    folder = _save_tiny(str(tmp_path / "run"), STATE_DAMAGE[how])
    params, opt, ema, extras = _tiny_model(seed=1)
    before = {k: p.detach().clone() for k, p in params.items()}
    shadow = {k: t.clone() for k, t in extras["old_policy"].shadow.items()}
    with pytest.raises(ConfigError) as e:
        rs.restore_checkpoint(folder, 0, params, opt, ema, extras=extras)
    msg = str(e.value.code)
    assert msg.startswith("error: --resume") and folder in msg and "\n" not in msg, msg
    assert all(torch.equal(before[k], params[k]) for k in params)
    assert all(torch.equal(shadow[k], extras["old_policy"].shadow[k]) for k in shadow)
    # and the undamaged checkpoint restores
    good = _save_tiny(str(tmp_path / "good"))
    assert rs.restore_checkpoint(good, 0, params, opt, ema, extras=extras)[0] == 1


def test_the_ema_refuses_a_shadow_of_another_shape():
    from common.policy import EMA

    ema = EMA({"w": torch.zeros(4, 3)}, 0.9)
    with pytest.raises(
        ValueError, match=r"EMA weight w is of shape \(1,\), the weight has \(4, 3\)"
    ):
        ema.load_state_dict({"shadow": {"w": torch.ones(1)}, "steps": 3})
    assert ema.shadow["w"].abs().sum() == 0 and ema.steps == 0


# ============================================================ the scripts: resume, flags, bad input, NaN
@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: bad input must be refused before one."""
    import common.backbones

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(common.backbones, "load_backbone", refuse)


def script_error(*flags, script="flowgrpo_baseline.py") -> str:
    with pytest.raises(SystemExit) as e:
        run_main(script, *flags)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def base_run(tiny_sd3, tmp_path_factory):
    """One flowgrpo run of 2 iterations, saved after each: {run}/checkpoint-1, checkpoint-2."""
    out = tmp_path_factory.mktemp("base")
    prompts = write_prompts(out / "prompts.txt", PROMPTS)
    flags = tiny_flags(tiny_sd3, out, prompts, "run") + FAST
    run_main("flowgrpo_baseline.py", *flags, "--num-iterations", "2")
    return {"run": str(out / "run"), "flags": flags, "out": str(out)}


def copy_run(base_run, tmp_path, name="run"):
    dst = str(tmp_path / name)
    shutil.copytree(base_run["run"], dst)
    flags = list(base_run["flags"])
    flags[flags.index("--output-dir") + 1] = str(tmp_path)
    flags[flags.index("--run-name") + 1] = name
    return dst, flags


@pytest.mark.parametrize(
    "flag,value,shown",
    [
        ("--group-size", "4", "--group-size 2 -> 4"),
        ("--groups-per-iteration", "1", "--groups-per-iteration 2 -> 1"),
        (
            "--reward",
            "jpeg_incompressibility",
            "--reward 'jpeg_compressibility' -> 'jpeg_incompressibility'",
        ),
        ("--lora-rank", "8", "--lora-rank 4 -> 8"),
        ("--seed", "2", "--seed 1 -> 2"),
    ],
)
def test_resume_under_changed_flags_is_one_line_naming_them(
    base_run, tmp_path, no_model_load, flag, value, shown
):
    run, flags = copy_run(base_run, tmp_path)
    msg = script_error(*flags, "--num-iterations", "4", "--resume", run, flag, value)
    c2 = ck.checkpoint_dir(run, 2)
    if flag == "--lora-rank":  # a shape change cannot be overridden
        assert msg == (
            f"error: --resume {c2}: {shown} changes the shape of the trained weights, which cannot be "
            "loaded into it (not even with --resume-override): pass the checkpoint's value, or start a new "
            "run without --resume"
        )
    else:
        assert msg == (
            f"error: --resume {c2} was trained with other experiment-defining flags: {shown}; drop "
            "them to continue that run with its own values, or add --resume-override to start a new "
            "run folder from its weights"
        )
    assert len(read_metrics(run)) == 3  # the run's metrics (iterations 0, 1, 2) are untouched


def test_resume_with_a_damaged_latest_checkpoint_falls_back_and_is_exact(
    base_run, tmp_path, capsys
):
    """Run folder passed, checkpoint-2 truncated: one warning line, resume from checkpoint-1, and the redone
    iteration 1 rewrites checkpoint-2 bit-identical to the undamaged one."""
    run, flags = copy_run(base_run, tmp_path)
    c2 = ck.checkpoint_dir(run, 2)
    _damage(c2, "truncated")
    run_main("flowgrpo_baseline.py", *flags, "--num-iterations", "2", "--resume", run)
    warnings = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")
    ]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: {c2}/trainer_state.pt is truncated ("
    ), warnings
    assert warnings[0].endswith(
        f"resuming from {ck.checkpoint_dir(run, 1)}, the latest complete checkpoint, instead"
    )
    assert ck.verify_checkpoint(c2) is None
    a = rs.load_checkpoint(ck.checkpoint_dir(base_run["run"], 2))
    b = rs.load_checkpoint(c2)
    assert a["iteration"] == b["iteration"] == 2
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert [m["iteration"] for m in read_metrics(run)] == [0, 1, 2]


def test_resume_override_starts_a_new_run_folder(base_run, tmp_path):
    run, flags = copy_run(base_run, tmp_path)
    before = open(os.path.join(run, "metrics.jsonl")).read()
    new_flags = list(flags)
    new_flags[new_flags.index("--run-name") + 1] = "bigger-groups"
    override = ["--num-iterations", "2", "--resume", run, "--group-size", "4", "--resume-override"]
    run_main("flowgrpo_baseline.py", *new_flags, *override)
    new = str(tmp_path / "bigger-groups")
    args = json.load(open(os.path.join(new, "args.json")))
    assert args["resumed_from"] == ck.checkpoint_dir(run, 2) and args["group_size"] == 4
    # the final evaluation of the resumed weights
    assert [m["iteration"] for m in read_metrics(new)] == [2]
    assert open(os.path.join(run, "metrics.jsonl")).read() == before  # the old run is untouched
    assert json.load(open(os.path.join(run, "args.json")))["group_size"] == 2
    # the same folder again is refused: a new run folder must be new
    msg = script_error(*new_flags, *override)
    assert msg == (
        f"error: --resume-override: the new run folder {new} already exists and is not empty: pass another --run-name"
    )


def test_resume_problems_from_the_script_are_one_line(base_run, tmp_path, no_model_load):
    run, flags = copy_run(base_run, tmp_path)
    msg = script_error(*flags, "--resume", str(tmp_path / "missing"))
    assert msg.startswith(f"error: --resume '{tmp_path}/missing' does not exist")
    _damage(ck.checkpoint_dir(run, 2), "corrupt")
    msg = script_error(*flags, "--resume", ck.checkpoint_dir(run, 2))
    assert msg.endswith(
        f"pass the older complete checkpoint instead: --resume {ck.checkpoint_dir(run, 1)} (or the run folder {run})"
    )
    # a flag g2rpo does not have
    g2rpo_flags = [f for f in flags if f not in ("--timestep-fraction", "0.99")]
    msg = script_error(*g2rpo_flags, "--resume", run, script="g2rpo.py")
    assert msg == (
        f"error: --resume {ck.checkpoint_dir(run, 1)} was written by flowgrpo_baseline.py, not g2rpo.py: "
        "resume it with `python flowgrpo_baseline.py --resume ...`"
    )


@pytest.mark.parametrize(
    "row,what",
    [
        ("3", "a number without an integer 'iteration'"),
        ("[1, 2]", "a list without an integer 'iteration'"),
        ('{"note": "hand-written"}', "an object without an integer 'iteration'"),
        ('{"iteration": "1"}', "an object without an integer 'iteration'"),
    ],
)
def test_a_metrics_row_that_is_not_a_row_is_one_line_before_the_model_loads(
    base_run, tmp_path, no_model_load, row, what
):
    run, flags = copy_run(base_run, tmp_path)
    path = os.path.join(run, "metrics.jsonl")
    lines = open(path).read().splitlines()
    before = "\n".join([lines[0], row, *lines[1:]]) + "\n"
    open(path, "w").write(before)
    msg = script_error(*flags, "--num-iterations", "3", "--resume", run)
    assert msg == (
        f"error: {path}: line 2 is {what}, not a metrics row (a JSON object with an integer 'iteration'); "
        "remove that line (or restore the file), then run again"
    )
    assert open(path).read() == before  # nothing rewritten


def test_run_files_of_the_wrong_kind_are_one_line(base_run, tmp_path, no_model_load):
    """metrics.jsonl a folder; a run folder without a checkpoint whose args.json is a list, or too deep (they were
    IsADirectoryError / TypeError / RecursionError tracebacks)."""
    run, flags = copy_run(base_run, tmp_path)
    os.remove(os.path.join(run, "metrics.jsonl"))
    os.mkdir(os.path.join(run, "metrics.jsonl"))
    msg = script_error(*flags, "--num-iterations", "3", "--resume", run)
    assert msg.startswith(
        f"error: {run}/metrics.jsonl is not a file: a run's metrics.jsonl is a file"
    ), msg
    for text, what in (
        ("[1, 2]", "a list, not an object"),
        ("[" * 100_000, "nested deeper than 32 levels"),
    ):
        early = tmp_path / "early"
        early.mkdir(exist_ok=True)
        (early / "args.json").write_text(text)
        msg = script_error(*flags, "--resume", str(early))
        assert msg == (
            f"error: --resume '{early}' holds no checkpoint and its args.json cannot be read (ValueError: "
            f"{what}): start a new run without --resume"
        )


@pytest.mark.parametrize(
    "text,what",
    [
        ("[" * 200_000 + "]" * 200_000, "nested deeper than 32 levels"),
        ('{"psi": 3}', "its 'psi' is a number, not a list of numbers"),
        ('{"psi": []}', "its 'psi' is a list, not a list of numbers"),
        ("[0.5]", "a list, not an object"),
    ],
)
def test_a_psi_file_of_the_wrong_shape_is_one_line(tmp_path, tiny_sd3, no_model_load, text, what):
    """A 200k-deep --psi-file was a RecursionError traceback."""
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS)
    (tmp_path / "psi.json").write_text(text)
    msg = script_error(
        *tiny_flags(tiny_sd3, tmp_path, prompts),
        "--psi-file",
        str(tmp_path / "psi.json"),
        script="densegrpo.py",
    )
    assert msg.startswith(
        f"error: --psi-file '{tmp_path}/psi.json' is not a psi.json (ValueError: {what}): "
    ), msg


def test_inputs_too_large_to_be_meant_are_one_line_before_any_work(
    tmp_path, tiny_sd3, no_model_load
):
    """--eval-seeds-per-prompt 200000000 (a MemoryError building the job list), a 10 MB prompt line (a 10.5 MB
    error line), a run name with a newline: one short line each, nothing written."""
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS)
    flags = tiny_flags(tiny_sd3, tmp_path / "out", prompts)
    msg = script_error(*flags, "--eval-seeds-per-prompt", "200000000")
    assert msg == (
        "error: --eval-seeds-per-prompt 200000000: 2 evaluation prompts x 200000000 seeds = 400,000,000 images per "
        "evaluation, at most 1,000,000; pass at most 500000"
    )
    huge = write_prompts(tmp_path / "huge.txt", ["a photo of a red circle", "x" * 10_000_000])
    msg = script_error(*flags, "--eval-prompts", huge)
    assert len(msg) < 300 and msg.startswith(
        f"error: --eval-prompts '{huge}': prompt 2 is 10,000,000 characters long, at most 4096"
    ), msg[:300]
    msg = script_error(*flags, "--run-name", "two\nlines")
    assert msg.startswith(
        "error: --run-name 'two\\nlines': give one plain folder name of printable characters"
    )
    assert not os.path.exists(tmp_path / "out")


def test_unwritable_output_folder_is_one_line_before_the_model_loads(
    tmp_path, tiny_sd3, no_model_load
):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    msg = script_error(*tiny_flags(tiny_sd3, blocker / "out", prompts))
    assert msg.startswith(
        f"error: --output-dir: cannot write the run folder {blocker}/out/run (NotADirectoryError: "
    )
    assert msg.endswith("choose a folder you can write to, or free space")
    if os.geteuid() != 0:  # root writes through permission bits
        ro = tmp_path / "read-only"
        ro.mkdir(mode=0o500)
        msg = script_error(*tiny_flags(tiny_sd3, ro, prompts))
        assert "(PermissionError: Permission denied)" in msg


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_reward_stops_before_the_update_and_keeps_the_checkpoint(
    base_run, tmp_path, monkeypatch, poison
):
    """The reward (a poisoned jpeg_compressibility, registered in this process only) turns non-finite in the first
    rollout after a resume from checkpoint-2: the run stops at iteration 2, before any update, checkpoint intact."""
    import common.plumbing.reward_flags as reward_flags
    import common.rewards as rewards

    real = rewards.LOADERS["jpeg_compressibility"]
    monkeypatch.setattr(reward_flags, "_CACHE", {})
    monkeypatch.setitem(
        rewards.LOADERS,
        "jpeg_compressibility",
        lambda paths, device: lambda im, p: real(paths, device)(im, p) * float(poison),
    )
    run, flags = copy_run(base_run, tmp_path)
    msg = script_error(*flags, "--num-iterations", "4", "--resume", run)
    assert msg == (
        "error: non-finite reward at iteration 2; stopping before anything non-finite is saved (the "
        f"last complete checkpoint is {run}/checkpoint-2: continue with --resume {run})"
    )
    assert [i for i, _ in ck.list_checkpoints(run)] == [1, 2] and ck.verify_checkpoint(
        ck.checkpoint_dir(run, 2)
    ) is None
    assert filecmp.cmp(
        ck.checkpoint_dir(run, 2) + "/trainer_state.pt",
        ck.checkpoint_dir(base_run["run"], 2) + "/trainer_state.pt",
        shallow=False,
    )


def test_non_finite_loss_stops_before_the_update(base_run, tmp_path, monkeypatch):
    """The training forward's log-prob turns NaN (the rollout's stays finite): the loss check stops iteration 2."""
    import common.sampler as sampler

    real = sampler.sde_step_with_logprob

    def poisoned(*a, prev_sample=None, **k):
        out = real(*a, prev_sample=prev_sample, **k)
        return (out[0], out[1] * float("nan"), *out[2:]) if prev_sample is not None else out

    monkeypatch.setattr(sampler, "sde_step_with_logprob", poisoned)
    run, flags = copy_run(base_run, tmp_path)
    msg = script_error(*flags, "--num-iterations", "4", "--resume", run)
    assert msg.startswith(
        "error: non-finite loss or gradient at iteration 2; stopping before anything non-finite is "
        f"saved (the last complete checkpoint is {run}/checkpoint-2"
    )
    assert [i for i, _ in ck.list_checkpoints(run)] == [1, 2] and ck.verify_checkpoint(
        ck.checkpoint_dir(run, 2)
    ) is None


# ---- bad numbers: every numeric flag, in every script, refused in one line by check_args (no model, no tyro)
SHARED_BAD = [
    ("noise_level", -1.0),
    ("noise_level", float("nan")),
    ("learning_rate", -1.0),
    ("learning_rate", 0.0),
    ("clip_range", 0.0),
    ("clip_range", 1.5),
    ("adam_betas", (0.9, 1.0)),
    ("adam_betas", (-0.1, 0.999)),
    ("weight_decay", -0.1),
    ("max_grad_norm", 0.0),
    ("ema_decay", 1.0),
    ("ema_decay", -0.5),
    ("std_eps", -1.0),
    ("adv_clip_max", 0.0),
    ("beta", -0.1),
    ("num_steps", 0),
    ("eval_num_steps", 0),
    ("num_iterations", -1),
    ("eval_every", 0),
    ("save_every", 0),
    ("keep_checkpoints", -1),
    ("groups_per_iteration", 0),
    ("group_size", 1),
    ("rollout_batch_size", 0),
    ("train_batch_size", 0),
    ("eval_batch_size", 0),
    ("eval_seeds_per_prompt", 0),
    ("optimizer_steps_per_iteration", 0),
    ("num_inner_epochs", 0),
    ("resolution", 0),
    ("lora_rank", 0),
    ("lora_alpha", 0.0),
    ("guidance_scale", -1.0),
    ("shift", 0.0),
    ("max_sequence_length", 0),
    ("learning_rate", float("inf")),
    ("ema_update_interval", 0),
    ("final_eval_seeds_per_prompt", 0),
    ("cpu_budget_s", -1.0),
]
OWN_BAD = {
    "flowgrpo_baseline.py": [
        ("timestep_fraction", 0.0),
        ("timestep_fraction", 1.5),
        ("std_eps", 0.0),
    ],
    "g2rpo.py": [("branch_steps", (99,)), ("granularities", (0,))],
    "densegrpo.py": [
        ("timestep_fraction", 0.0),
        ("std_eps", 0.0),
        ("completion_steps", 0),
        ("completion_batch_size", 0),
    ],
}
BAD_CASES = [(s, f, v) for s in SCRIPTS for f, v in SHARED_BAD + OWN_BAD[s]]


@pytest.fixture(scope="module")
def script_modules():
    return {s: runpy.run_path(os.path.join(ROOT, s), run_name="not_main") for s in SCRIPTS}


def test_every_bad_number_is_one_line_saying_given_allowed_and_usual(script_modules):
    tried = {s: 0 for s in SCRIPTS}
    for script, field, value in BAD_CASES:
        mod = script_modules[script]
        args = dataclasses.replace(mod["Args"](), **{field: value})
        with pytest.raises(ConfigError) as e:
            mod["check_args"](args, 1)
        msg, flag = str(e.value.code), "--" + field.replace("_", "-")
        assert msg.startswith(f"error: {flag} ") and "\n" not in msg, (script, field, msg)
        assert "the default is" in msg, (script, field, msg)
        tried[script] += 1
        mod["check_args"](mod["Args"](), 1)  # and the defaults pass
    print("bad inputs tried per script:", tried)
    assert min(tried.values()) >= 38


# ---- sizes past what a run can hold (issue #68): each was accepted, then a traceback after the model loaded (torch
# cannot split by 10**20, nor allocate a schedule of 10**20 steps)
HUGE = 99999999999999999999
SIZE_BAD = [
    "decode_batch_size",
    "train_batch_size",
    "num_steps",
    "eval_num_steps",
    "eval_batch_size",
]


@pytest.mark.parametrize("script", [*SCRIPTS, "diffusionnft.py"])
def test_sizes_past_what_the_run_holds_are_one_line_before_the_model_loads(script):
    mod = runpy.run_path(os.path.join(ROOT, script), run_name="not_main")
    own = ["calibration_trajectories"] if script == "densegrpo.py" else []
    for field in SIZE_BAD + own:
        args = dataclasses.replace(mod["Args"](), **{field: HUGE})
        with pytest.raises(ConfigError) as e:
            mod["check_args"](args, 1)
        msg = str(e.value.code)
        assert msg.startswith(f"error: --{field.replace('_', '-')} {HUGE}: ") and "\n" not in msg, (
            msg
        )
    # a decode call gets a rollout batch or an evaluation batch: one image more than both is refused
    args = mod["Args"]()
    most = max(args.rollout_batch_size, args.eval_batch_size)
    with pytest.raises(ConfigError) as e:
        mod["check_args"](dataclasses.replace(args, decode_batch_size=most + 1), 1)
    assert str(e.value.code) == (
        f"error: --decode-batch-size {most + 1}: a VAE decode call here gets at most {most} images "
        f"(--rollout-batch-size {args.rollout_batch_size}, --eval-batch-size {args.eval_batch_size}), so a larger "
        f"value decodes the same: pass at most {most} (the default is 8)"
    )
    mod["check_args"](dataclasses.replace(mod["Args"](), decode_batch_size=most), 1)


def test_the_defaults_pass_check_args(script_modules):
    for script in SCRIPTS:
        script_modules[script]["check_args"](script_modules[script]["Args"](), 1)


@pytest.mark.parametrize(
    "flags,expect",
    [
        (
            ["--noise-level", "-1"],
            "error: --noise-level -1.0: must be a finite number >= 0 (a scales the SDE's standard "
            "deviation; 0 = the deterministic ODE, no exploration); the default is 0.7",
        ),
        (
            ["--learning-rate", "-1"],
            "error: --learning-rate -1.0: must be a finite number > 0 (AdamW step size); the default is 0.0003",
        ),
        (
            ["--eval-prompts", "/no/such/prompts.txt"],
            "error: --eval-prompts '/no/such/prompts.txt' does not exist: give a text file with one prompt per line",
        ),
    ],
)
@pytest.mark.parametrize("script", SCRIPTS)
def test_issue_table_rows_are_refused_before_any_model_load(
    tmp_path, tiny_sd3, no_model_load, script, flags, expect
):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS)
    base = [
        f
        for f in tiny_flags(tiny_sd3, tmp_path, prompts)
        if script != "g2rpo.py" or f not in ("--timestep-fraction", "0.99")
    ]
    msg = script_error(*base, *flags, script=script)
    assert msg.startswith(expect.split("; the default")[0]), msg  # the default is each script's own


def test_bad_number_from_the_shell_exits_fast_without_traceback(tmp_path):
    t = time.time()
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "flowgrpo_baseline.py"),
            "--noise-level",
            "-1",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=script_env(),
    )
    assert (
        r.returncode == 1 and "Traceback" not in r.stderr and "Loading pipeline" not in r.stderr
    ), r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "error: --noise-level -1.0: must be a finite number >= 0 (a scales the SDE's standard deviation; 0 = the "
        "deterministic ODE, no exploration); the default is 0.7"
    ], r.stderr  # and nothing else: a quiet start
    assert time.time() - t < 60 and not os.listdir(tmp_path)


# ============================================================ a rank that dies or hangs under torchrun (gloo)
def _torchrun(mode: str, timeout_s: float):
    env = {**script_env(), "FLOW_RL_DIST_TIMEOUT": str(timeout_s)}
    t = time.time()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(ROOT, "tests", "fault_worker.py"),
            "dist",
            mode,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    return r, time.time() - t


def test_a_rank_that_hangs_makes_the_other_exit_with_one_line(tmp_path):
    """Rank 1 stops joining collectives: rank 0 gives up after FLOW_RL_DIST_TIMEOUT (3 s) with one line, exit 1,
    and torchrun stops rank 1."""
    r, wall = _torchrun("hang", 3)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error: rank 0:")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert (
        lines[0].startswith("error: rank 0: a collective operation failed (")
        and (
            "another rank died, hung or was stopped (collective timeout 3 s, set by FLOW_RL_DIST_TIMEOUT)"
        )
        in lines[0]
    )
    assert "[rank0]: Traceback" not in r.stderr and wall < 90


def test_a_rank_that_dies_stops_the_job_in_bounded_time():
    """Rank 1 is SIGKILLed mid-run: the job ends (no hang), torchrun lists rank 1's SIGKILL, and rank 0 either reports
    the lost collective in one line (gloo sees the connection reset) or is stopped by torchrun first (SIGTERM)."""
    r, wall = _torchrun("die", 600)  # not the collective timeout: the peer's death is seen at once
    assert r.returncode == 1 and wall < 90, r.stderr[-3000:]
    failures = r.stderr[r.stderr.index("Failures:") :]
    assert (
        "rank      : 1 (local_rank: 1)\n  exitcode  : -9" in failures
        and "Signal 9 (SIGKILL)" in failures
    ), failures
    ours = [
        x
        for x in r.stderr.splitlines()
        if x.startswith("error: rank 0: a collective operation failed (")
    ]
    assert len(ours) == 1 or "Signal 15 (SIGTERM) received" in failures, r.stderr[-3000:]
    assert "[rank0]: Traceback" not in r.stderr
