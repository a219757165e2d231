"""The wheels a GPU machine with no network needs beside its image's packages, fetched once into .whl/ (ignored by
git) for Python 3.12 on manylinux x86_64; then the size of what a device call carries (docs/usage.md, "Your first GPU
run").

    python benchmarks/fetch_device_wheels.py    # downloads what .whl/ lacks, checks the set, prints the sizes

The image (PyTorch 2.11 for CUDA, transformers 5.17, safetensors, accelerate, peft, ...) has no diffusers and no
tyro. Carried, at requirements.txt's pins: diffusers and tyro; transformers 5.24, which the tests run (the image's
5.17 needs torchvision for AutoImageProcessor, which the CPU rehearsal found: the image has a torchvision, but no test
runs that pairing); peft, whose version in the image was not reported. And pinned here at the versions CI's
environment resolves: the two dependencies of tyro the image lacks (docstring-parser, typeguard). Every Requires-Dist
of a carried wheel (on Python 3.12, Linux, no extras) must be carried, in the image (IMAGE_HAS), or not needed
(NOT_NEEDED, with why): a pin change that brings a new dependency stops here in one line, not on the machine. The
device installs them with `python3 -m pip install --no-index --no-deps --target DIR .whl/*.whl` and puts DIR first on
PYTHONPATH (benchmarks/device_call.sh): the image's torch stays, its transformers and peft are shadowed.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS_DIR = os.path.join(ROOT, ".whl")
FROM_REQUIREMENTS = ("diffusers", "tyro", "transformers", "peft")
PINNED_HERE = {"docstring-parser": "0.18.0", "typeguard": "4.6.1"}  # tyro's, as CI resolves them
IMAGE_LACKS = (
    "diffusers",
    "tyro",
    *PINNED_HERE,
)  # the carried projects the image has no version of
# the carried wheels' dependencies that the image holds (its package list)
IMAGE_HAS = {
    "accelerate",
    "filelock",
    "huggingface-hub",
    "numpy",
    "packaging",
    "pillow",
    "psutil",
    "pyyaml",
    "regex",
    "requests",
    "safetensors",
    "tokenizers",
    "torch",
    "tqdm",
    "typer",
    "typing-extensions",
}
NOT_NEEDED = {
    "importlib-metadata": "diffusers imports it only on Python < 3.8 (diffusers/utils/import_utils.py)",
}
TARGET = dict(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython")
TARGET.update(
    sys_platform="linux", platform_system="Linux", platform_machine="x86_64", os_name="posix"
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CARRY_LIMIT = (
    64 * 2**20
)  # what one device call carries: the tracked tree, untracked files git does not ignore, .whl


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted() -> dict[str, str]:
    """{project: version}: requirements.txt's pins of FROM_REQUIREMENTS, and PINNED_HERE."""
    pins = {}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#;]+)", line.strip())
            if m:
                pins[canonical(m[1])] = m[2]
    missing = [n for n in FROM_REQUIREMENTS if n not in pins]
    if missing:
        raise SystemExit(
            f"fetch_device_wheels: requirements.txt pins no {', '.join(missing)} (name==version)"
        )
    return {**{n: pins[n] for n in FROM_REQUIREMENTS}, **PINNED_HERE}


def wheel_of(path: str) -> tuple[str, str]:
    """(project, version) from a wheel's file name."""
    name, version = os.path.basename(path).split("-")[:2]
    return canonical(name), version


def fetch(want: dict[str, str]) -> None:
    """Download into .whl/ the wanted wheels it lacks; a wheel of a carried project at another version is removed
    (two versions of one project stop the install), and a wheel of no carried project stops here in one line."""
    os.makedirs(WHEELS_DIR, exist_ok=True)
    have = {}
    for path in glob.glob(os.path.join(WHEELS_DIR, "*.whl")):
        project, version = wheel_of(path)
        if project not in want:
            raise SystemExit(
                f"fetch_device_wheels: {path} is no wheel this script carries ({', '.join(want)}): remove it"
            )
        if version != want[project]:
            print(f"removing {os.path.basename(path)}: the pin is {project}=={want[project]}")
            os.remove(path)
        else:
            have[project] = path
    missing = [f"{p}=={v}" for p, v in want.items() if p not in have]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", TARGET["python_version"], "--implementation", "cp"]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)] + ["-d", WHEELS_DIR, *missing]
    print("downloading " + ", ".join(missing), flush=True)
    if subprocess.run(cmd).returncode:
        raise SystemExit(
            f"fetch_device_wheels: pip could not download {', '.join(missing)} (above)"
        )


def requirements(path: str) -> list[str]:
    """The projects a wheel requires on the target (Python 3.12, Linux x86_64, no extras)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({**TARGET, "extra": ""}):
                out.append(canonical(req.name))
    return out


def check(want: dict[str, str]) -> list[str]:
    """One line per carried wheel: its dependencies, each carried, in the image or not needed; SystemExit(one line)
    for one that is none of these."""
    lines = []
    for path in sorted(glob.glob(os.path.join(WHEELS_DIR, "*.whl"))):
        needs = requirements(path)
        unknown = [n for n in needs if n not in want and n not in IMAGE_HAS and n not in NOT_NEEDED]
        if unknown:
            raise SystemExit(
                f"fetch_device_wheels: {os.path.basename(path)} requires {', '.join(unknown)}, which is neither "
                "carried nor in the image: add it to PINNED_HERE (or to IMAGE_HAS if the image has it)"
            )
        lines.append(f"{os.path.basename(path)}: needs {', '.join(needs) or 'nothing'}")
    return lines


def tree_bytes() -> int | None:
    """Bytes of the files a device call sends besides .whl: git's tracked files and its untracked, not ignored ones;
    None outside a git checkout."""
    try:
        names = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = [os.path.join(ROOT, n) for n in names.decode().split("\0") if n]
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p) and not os.path.islink(p))


def main() -> int:
    want = wanted()
    fetch(want)
    for line in check(want):
        print(line)
    wheels = sum(os.path.getsize(p) for p in glob.glob(os.path.join(WHEELS_DIR, "*.whl")))
    tree = tree_bytes()
    MiB = 2**20
    if tree is None:
        print(
            f".whl: {wheels / MiB:.1f} MiB ({len(want)} wheels); the tree's size is unknown (no git checkout)"
        )
        return 0
    total = tree + wheels
    print(
        f"a device call carries {total / MiB:.1f} MiB of its {CARRY_LIMIT / MiB:.0f} MiB: the tree "
        f"{tree / MiB:.1f} MiB + .whl {wheels / MiB:.1f} MiB ({len(want)} wheels)"
    )
    if total > CARRY_LIMIT:
        print(
            f"fetch_device_wheels: {total / MiB:.1f} MiB is over the {CARRY_LIMIT / MiB:.0f} MiB a call carries"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
