"""Shared fixtures: tiny random-weight pipelines written to disk once per test session.

Every test loads them back with `load_backbone(path)`, the same `from_pretrained(folder)` path that real
SD3.5 / FLUX.1 weights take.
"""

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402

# One torch thread per process. pytest runs two workers (pyproject.toml: `-n 2`, one per core of the 2-core
# machine the suite is sized for); two threads each made them spin against each other (measured 2026-12-06: user
# time 652 s against 389 s with one). A script a test starts inherits the one thread through OMP_NUM_THREADS, so
# weights that a test compares bit for bit between this process and a child are summed in the same order.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "pictures: the script runs of this test draw their end-of-run pictures"
    )


@pytest.fixture(autouse=True)
def no_run_pictures(request, monkeypatch):
    """A training run in a test skips its end-of-run pictures (learning curve, step heat map, before/after): matplotlib
    takes 2-3 s of them per run (measured 2026-12-01 on 2 cores: about half of a tiny run), and nothing but the
    picture tests reads them. Tests marked `@pytest.mark.pictures` (each script's smoke test) keep them, and check
    them end to end; tests/test_plots.py checks what they show."""
    if request.node.get_closest_marker("pictures") is None:
        import common.plumbing.run

        monkeypatch.setattr(common.plumbing.run, "run_pictures", lambda *a, **k: [])


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    from common.plumbing.tiny import build_sd3

    path = str(tmp_path_factory.mktemp("tiny-sd3"))
    build_sd3(path, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_sd35(tmp_path_factory):
    from common.plumbing.tiny import build_sd3

    path = str(tmp_path_factory.mktemp("tiny-sd35"))
    build_sd3(path, seed=1, sd35=True)
    return path


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory):
    from common.plumbing.tiny import build_flux

    path = str(tmp_path_factory.mktemp("tiny-flux"))
    build_flux(path, seed=0, guidance_embeds=True)
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (tmpfs), mounted for the test: a save that fills it gets the errors a full disk gives
    (torch.save: RuntimeError; safetensors: SafetensorError; plain writes: OSError ENOSPC). Needs root (CI is)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
