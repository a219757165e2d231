"""A run folder or a weight file from someone else runs no code and touches nothing outside it (issue #57).

Every file the project unpickles is loaded with torch.load(weights_only=True) (or numpy's allow_pickle=False, or a
restricted unpickler for torch.distributed.checkpoint's metadata): a file built to run code is refused in one line,
unloaded. Each payload here would create a harmless file when unpickled; each test asserts the refusal and that the
file is absent. A run never writes or deletes through a symbolic link it finds in its folder: each link here points
to an outside file or folder, which stays byte for byte as it was.

On the code before #57 the payload tests and the .lock / metrics.jsonl / samples/ link tests fail (the payload ran,
the lock truncated its target, the run wrote outside its folder).
"""

import filecmp
import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from fault_worker import tiny_state, tiny_weights
from helpers import read_metrics, run_main, tiny_flags, write_prompts

import common.plumbing.checkpoint as ck
import common.plumbing.resume as rs
import common.plumbing.run_folder as rf
from common.plumbing.checks import ConfigError

SCRIPT = "flowgrpo_baseline.py"
PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]
FAST = ["--learning-rate", "1e-2", "--eval-every", "100", "--save-every", "1"]


class Payload:
    """Unpickling this creates the file `path` (what a malicious file would do, harmlessly)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def one_line(e) -> str:
    msg = str(e.value.code if hasattr(e.value, "code") else e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def outcome(fn, *args) -> str | None:
    """The one line `fn(*args)` stopped with (ConfigError, SystemExit, a reward's load error), None if it ran on:
    a test checks what the call did to the files first, then what it said."""
    from common.plumbing.reward_files import RewardLoadError

    try:
        fn(*args)
    except (SystemExit, RewardLoadError) as e:
        msg = str(e.code if isinstance(e, SystemExit) else e)
        assert "\n" not in msg and "Traceback" not in msg, msg
        return msg
    return None


@pytest.fixture
def no_model_load(monkeypatch):
    import common.backbones

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(common.backbones, "load_backbone", refuse)


@pytest.fixture(scope="module")
def base_run(tiny_sd3, tmp_path_factory):
    """One flowgrpo run of 1 iteration: {run}/checkpoint-1, metrics rows 0 and 1, samples/."""
    out = tmp_path_factory.mktemp("base")
    prompts = write_prompts(out / "prompts.txt", PROMPTS)
    flags = [*tiny_flags(tiny_sd3, out, prompts, "run"), *FAST, "--eval-every", "1"]
    run_main(SCRIPT, *flags, "--num-iterations", "1")
    return {"run": str(out / "run"), "flags": flags}


def copy_run(base_run, tmp_path):
    """A received copy of the base run, and the flags that continue it for one more iteration."""
    run = str(tmp_path / "run")
    shutil.copytree(base_run["run"], run)
    flags = list(base_run["flags"])
    flags[flags.index("--output-dir") + 1] = str(tmp_path)
    return run, [*flags, "--resume", run, "--num-iterations", "2"]


# ============================================================ nothing loaded runs code
def test_a_trainer_state_that_would_run_code_is_refused_unloaded(tmp_path, base_run, no_model_load):
    """Security 1: --resume of a received run folder whose trainer_state.pt (re-sealed in COMPLETE.json) holds a
    payload: one line, the payload never ran. Both the loader and the script's --resume."""
    created = tmp_path / "payload-ran"
    run = str(tmp_path / "forged")
    state = {**tiny_state(1), "note": Payload(created)}
    ck.save_checkpoint(run, state, tiny_weights(1))  # sealed: it passes its checksums
    msg = outcome(rs.load_checkpoint, ck.checkpoint_dir(run, 1))
    assert not created.exists(), "the payload ran"
    assert msg and "holds Python objects (io.open)" in msg and "was not loaded" in msg, msg
    # the same through the script: a received copy of a real run, its trainer state swapped and re-sealed
    run, flags = copy_run(base_run, tmp_path)
    c1 = ck.checkpoint_dir(run, 1)
    real = torch.load(os.path.join(c1, ck.STATE_FILE), weights_only=True)
    shutil.rmtree(c1)
    ck.save_checkpoint(run, {**real, "note": Payload(created)}, lambda folder: None)
    msg = outcome(run_main, SCRIPT, *flags)
    assert not created.exists(), "the payload ran"
    assert msg and "was not loaded" in msg, msg


def old_checkpoint(run: str) -> str:
    """checkpoint-1 of `run` as this project wrote it before 2026-12-05: numpy's RNG state pickled as an ndarray."""
    np.random.seed(7)
    old_rng = {**ck.rng_state(), "numpy": np.random.get_state()}  # as rng_state wrote it before
    ck.save_checkpoint(run, {**tiny_state(1), "rng": [old_rng]}, tiny_weights(1))
    return ck.checkpoint_dir(run, 1)


def test_a_checkpoint_written_before_the_change_is_refused_and_converts_when_trusted(tmp_path):
    """numpy's RNG state was pickled as an ndarray: such a checkpoint is refused with the command that converts it
    (for a user who trusts the file); converted, it loads with weights_only=True and restores the same RNG."""
    folder = old_checkpoint(str(tmp_path / "old"))
    with pytest.raises(ConfigError) as e:
        rs.load_checkpoint(folder)
    assert f"python -m common.plumbing.resume --convert-trusted {folder}" in one_line(e)
    rs.convert_trusted(folder)
    assert ck.verify_checkpoint(folder) is None  # re-sealed
    state = rs.load_checkpoint(folder)
    expected = np.random.rand()
    np.random.seed(99)
    ck.set_rng_state(state["rng"][0])
    assert np.random.rand() == expected


def files_of(folder) -> dict:
    """{path inside folder: (its bytes, its inode)}: what a conversion must leave as it was."""
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_ino)
    return out


def test_convert_trusted_holds_the_runs_lock(tmp_path):
    """Before #68 it converted the newest checkpoint of a run that was writing its folder (and when the run rotated
    it away mid-conversion: a FileNotFoundError traceback). Now one line, nothing converted."""
    import fcntl

    live = old_checkpoint(str(tmp_path / "live"))
    before = files_of(live)
    with open(tmp_path / "live" / rf.LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the run writing the folder holds it
        msg = outcome(rs.convert_trusted, live)
    assert files_of(live) == before
    assert (
        msg and f"the run folder {tmp_path / 'live'} is being written by another process" in msg
    ), msg


def test_convert_trusted_writes_nothing_through_a_link(tmp_path):
    """Before #68 a checkpoint-N that linked out of the run folder was followed: trainer_state.pt and COMPLETE.json
    rewritten in the folder it pointed to (security, low). Now refused in one line, as a run refuses it."""
    outside = old_checkpoint(str(tmp_path / "outside"))
    before = files_of(outside)
    (tmp_path / "linked").mkdir()
    os.symlink(outside, tmp_path / "linked" / "checkpoint-1")
    msg = outcome(rs.convert_trusted, str(tmp_path / "linked" / "checkpoint-1"))
    assert files_of(outside) == before
    assert (
        msg and f"{tmp_path / 'linked' / 'checkpoint-1'} is a symbolic link (to {outside})" in msg
    ), msg


def test_convert_trusted_leaves_a_checkpoint_that_loads_safely_as_it_is(tmp_path, capsys):
    """Before #68 it re-saved it (a new file)."""
    ck.save_checkpoint(str(tmp_path / "new"), tiny_state(1), tiny_weights(1))
    safe = ck.checkpoint_dir(str(tmp_path / "new"), 1)
    before = files_of(safe)
    capsys.readouterr()
    assert outcome(rs.convert_trusted, safe) is None
    assert files_of(safe) == before
    said = capsys.readouterr().out
    assert said == f"{safe}/{ck.STATE_FILE} already loads with weights_only=True: left as it is\n"


def reseal(folder: str, state: dict) -> None:
    """`state` as the folder's trainer_state.pt, with COMPLETE.json re-sealed over it: what someone who edits a
    checkpoint before sending it does, so that its checksums pass."""
    path = os.path.join(folder, ck.STATE_FILE)
    torch.save(state, path)
    marker = ck.read_marker(folder)
    marker["files"][ck.STATE_FILE] = {"size": os.path.getsize(path), "sha256": ck._sha256(path)}
    with open(os.path.join(folder, ck.MARKER), "w") as f:
        json.dump(marker, f)


@pytest.mark.parametrize(
    "change,said",
    [
        ({"iteration": 10**18}, "its COMPLETE.json says 1; its folder's name says 1"),
        ({"iteration": 0}, "its COMPLETE.json says 1; its folder's name says 1"),
        ({"counts": {"trajectories": -4}}, "its 'trajectories' is -4"),
        ({"clocks": {"time/cpu_s": float("inf")}}, "its 'time/cpu_s' is out of range"),
        ({"args": {"num_iterations": 10**18}}, "its 'args' differs from its COMPLETE.json's"),
    ],
    ids=["iteration-1e18", "iteration-0", "negative-count", "infinite-clock", "other-args"],
)
def test_a_trainer_state_whose_numbers_disagree_with_its_checkpoint_is_refused(
    tmp_path, base_run, change, said
):
    """A received checkpoint-1 whose trainer_state.pt was edited and re-sealed. Before #68 each resumed with exit 0:
    iteration 10**18 "finished" at once without training or saving, the others trained on from numbers that were
    not the checkpoint's."""
    run, flags = copy_run(base_run, tmp_path)
    c1 = ck.checkpoint_dir(run, 1)
    state = torch.load(os.path.join(c1, ck.STATE_FILE), weights_only=True)
    for key, value in change.items():
        state[key] = {**state[key], **value} if isinstance(value, dict) else value
    reseal(c1, state)
    metrics = open(os.path.join(run, "metrics.jsonl"), "rb").read()
    msg = outcome(run_main, SCRIPT, *flags)
    assert msg and msg.startswith(f"error: --resume {c1}: its trainer_state.pt (iteration "), msg
    assert said in msg and msg.endswith(
        "resume from another checkpoint-N folder, or start a new run"
    ), msg
    assert [i for i, _ in ck.list_checkpoints(run)] == [1] and ck.verify_checkpoint(c1) is None
    assert open(os.path.join(run, "metrics.jsonl"), "rb").read() == metrics


def test_rng_states_round_trip_through_a_safe_load(tmp_path):
    random_state = ck.rng_state()
    torch.save({"rng": [random_state]}, tmp_path / "s.pt")
    a = (np.random.rand(), torch.rand(1).item(), __import__("random").random())
    ck.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"][0])
    assert (np.random.rand(), torch.rand(1).item(), __import__("random").random()) == a


@pytest.mark.parametrize("reward", ["aesthetic", "imagereward"])
def test_a_reward_weight_file_that_would_run_code_is_refused_unloaded(tmp_path, reward):
    """Security 2: a reward weight file that needs pickle is refused in one line that says how to convert it; the
    payload never ran (it ran before, on the retry with weights_only=False)."""
    from common import rewards
    from common.plumbing.reward_flags import build_reward

    created = tmp_path / "payload-ran"
    folder = tmp_path / reward
    if reward == "imagereward":
        here = os.path.dirname(os.path.abspath(__file__))
        shutil.copytree(os.path.join(here, "fixtures", "imagereward"), folder)
        path = folder / "ImageReward.pt"
    else:
        folder.mkdir()
        path = folder / rewards.AESTHETIC_MLP_FILE
    torch.save({"layers.0.weight": torch.zeros(1, 4), "note": Payload(created)}, path)
    msg = outcome(build_reward, reward, "cpu", {reward: str(folder)})
    assert not created.exists(), "the payload ran"
    assert msg and "was not loaded" in msg and "torch.load(p, weights_only=False)" in msg, msg


def test_a_sharded_checkpoints_metadata_that_would_run_code_is_refused(tmp_path):
    """torch.distributed.checkpoint unpickles its .metadata with plain pickle: a --parallel fsdp resume reads it
    first with an unpickler that builds only metadata classes. A real metadata file passes; a payload is refused."""
    import torch.distributed.checkpoint as dcp

    created = tmp_path / "payload-ran"
    good = tmp_path / "good"
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.randn(3, 4, dtype=torch.bfloat16)}}, checkpoint_id=str(good))
    rs.check_sharded_metadata(str(good))
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(Payload(created), f)
    with pytest.raises(ConfigError) as e:
        rs.check_sharded_metadata(str(bad))
    assert "io.open" in one_line(e) and not created.exists()


def test_an_evaluation_panel_that_would_run_code_is_refused(tmp_path):
    """samples/eval_*.npz (read back for before_after.png) is loaded with allow_pickle=False."""
    from common.plumbing.evaluation import Panel

    created = tmp_path / "payload-ran"
    path = tmp_path / "eval_00000.npz"
    np.savez(path, images=np.array([Payload(created)], dtype=object), meta="{}")
    with pytest.raises(ValueError, match="allow_pickle=False"):
        Panel.load(str(path))
    assert not created.exists()


# ============================================================ links stay inside the run folder
def _outside(tmp_path):
    """An outside file and folder with content, and a snapshot to compare against."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "precious.txt").write_text("precious\n")
    (outside / "dir" / "keep.txt").write_text("keep\n")
    snapshot = tmp_path / "snapshot"
    shutil.copytree(outside, snapshot)
    return outside, snapshot


def _unchanged(outside, snapshot):
    cmp = filecmp.dircmp(outside, snapshot)
    assert not (cmp.left_only or cmp.right_only or cmp.diff_files), (cmp.left_only, cmp.diff_files)
    assert not (filecmp.dircmp(outside / "dir", snapshot / "dir").left_only)
    assert (outside / "precious.txt").read_text() == "precious\n"


def test_a_lock_link_is_refused_and_its_target_kept(tmp_path):
    """Security 3: .lock linked to an outside file was opened a+ and truncated to a pid."""
    outside, snapshot = _outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(outside / "precious.txt")
    msg = outcome(rf.hold_run_folder, str(run))
    _unchanged(outside, snapshot)
    assert msg and "is a symbolic link" in msg, msg


@pytest.mark.parametrize(
    "name,target",
    [
        (
            "metrics.jsonl",
            "missing.jsonl",
        ),  # Security 4: a dangling link, the run created its target outside
        ("metrics.jsonl", "precious.txt"),
        ("samples", "dir"),
        ("checkpoint-1", "dir"),
        (".lock", "precious.txt"),
        ("args.json", "precious.txt"),
    ],
)
def test_a_link_in_a_received_run_folder_is_refused_and_the_outside_is_unchanged(
    tmp_path, base_run, name, target
):
    """--resume of a received run folder holding a link where the run writes or deletes: one line before anything
    is written; the outside file or folder is byte for byte as it was, and nothing new appears there."""
    outside, snapshot = _outside(tmp_path)
    run, flags = copy_run(base_run, tmp_path)
    if name == "checkpoint-1":  # the checkpoint itself, moved outside and linked back
        shutil.copytree(os.path.join(run, name), outside / "dir" / name)
        shutil.copytree(os.path.join(run, name), snapshot / "dir" / name)
        target = f"dir/{name}"
    path = os.path.join(run, name)
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    os.symlink(outside / target, path)
    msg = outcome(run_main, SCRIPT, *flags)
    _unchanged(outside, snapshot)
    assert not (outside / "missing.jsonl").exists()
    assert msg and "symbolic link" in msg, msg


def test_a_restart_in_place_with_a_samples_link_deletes_nothing_outside(
    tmp_path, base_run, no_model_load
):
    """A run folder without a checkpoint restarts in place and deletes its samples/: a samples/ link to an outside
    folder is refused in one line (it was an rmtree traceback), the folder kept."""
    outside, snapshot = _outside(tmp_path)
    run, flags = copy_run(base_run, tmp_path)
    shutil.rmtree(ck.checkpoint_dir(run, 1))  # died before its first checkpoint
    shutil.rmtree(os.path.join(run, "samples"))
    os.symlink(outside / "dir", os.path.join(run, "samples"))
    try:
        msg = outcome(run_main, SCRIPT, *flags[:-2], "--num-iterations", "1")
    except OSError as e:  # rmtree's "Cannot call rmtree on a symbolic link", before #57
        msg = f"traceback: {e}"
    _unchanged(outside, snapshot)
    assert msg and "symbolic link" in msg and "traceback" not in msg, msg
    assert [r["iteration"] for r in read_metrics(run)] == [0, 1]  # the run's rows untouched
