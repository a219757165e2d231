"""The paper presets of docs/*.md, "## Paper preset": each bash block that runs `torchrun ... script.py ...`, read
as the shell reads it and parsed with the script's own `Args` (tyro), as the script would parse it.

Shared by tests/test_paper_values.py (the first block of a section against the paper's table) and
benchmarks/bench_memory.py (every block's memory per GPU).
"""

from __future__ import annotations

import importlib
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = {
    "flowgrpo_baseline.py": "docs/flowgrpo.md",
    "g2rpo.py": "docs/g2rpo.md",
    "densegrpo.py": "docs/densegrpo.md",
    "diffusionnft.py": "docs/diffusionnft.md",
    "awm.py": "docs/awm.md",
}
PRESET = re.compile(r"^## Paper preset\n(?P<body>.*?)(?=^## |\Z)", re.S | re.M)
BASH = re.compile(r"```bash\n(?P<code>.*?)```", re.S)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def torchrun_blocks(doc_text: str) -> list[str]:
    """The bash blocks of the doc's "## Paper preset" section that start with `torchrun` (the section's other blocks
    are fragments to add to one, e.g. G²RPO's released-code flags)."""
    section = PRESET.search(doc_text)
    if section is None:
        raise ValueError('no "## Paper preset" section')
    return [
        b["code"]
        for b in BASH.finditer(section["body"])
        if b["code"].lstrip().startswith("torchrun")
    ]


def preset_command(doc_text: str, script: str, block: int = 0) -> tuple[list[str], int]:
    """(the arguments after `script` in the `block`-th torchrun block of the doc's "## Paper preset" section, the
    world size its torchrun asks for: --nnodes x --nproc_per_node). Comments and line continuations are the
    shell's."""
    blocks = torchrun_blocks(doc_text)
    if block >= len(blocks):
        raise ValueError(
            f'"## Paper preset" has {len(blocks)} ```bash blocks that start with torchrun'
        )
    tokens = shlex.split(blocks[block].replace("\\\n", " "), comments=True)
    if script not in tokens:
        raise ValueError(f"the block is not `torchrun ... {script} ...`")
    launcher, argv = tokens[: tokens.index(script)], tokens[tokens.index(script) + 1 :]

    def launcher_flag(*names, default=1):
        found = [int(launcher[i + 1]) for i, t in enumerate(launcher[:-1]) if t in names]
        return found[0] if found else default

    world_size = launcher_flag("--nnodes") * launcher_flag("--nproc_per_node", "--nproc-per-node")
    return argv, world_size


def parse_args(script: str, argv: list[str], world_size: int):
    """The script's `Args` from `argv`, with what the harness derives before the load filled in (the world size, the
    training micro-batch, the script's check_args: images per rank, trained steps, ...), as setup() does it."""
    import tyro

    module = importlib.import_module(script[: -len(".py")])
    args = tyro.cli(module.Args, args=argv)
    args.world_size = world_size
    args.train_batch_size = args.train_batch_size or args.rollout_batch_size
    module.check_args(args, world_size)
    return args


def presets() -> list[tuple[str, str, object, int]]:
    """Every runnable paper preset: (name, script, parsed Args, world size); name is the script, or the script and
    the block's number for the second and later blocks of a section (e.g. Flow-GRPO's FLUX.1-dev block)."""
    out = []
    for script, doc in DOCS.items():
        text = read(doc)
        for k in range(len(torchrun_blocks(text))):
            argv, world_size = preset_command(text, script, k)
            name = script[: -len(".py")] + (f" #{k + 1}" if k else "")
            out.append((name, script, parse_args(script, argv, world_size), world_size))
    return out
