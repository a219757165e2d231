"""Benchmark (not a test): seconds per iteration by phase, and NFE per phase, for the three scripts at their defaults.

    python benchmarks/bench_phases.py                              # this checkout
    git worktree add /tmp/before b828563                      # an older commit, to compare
    python benchmarks/bench_phases.py --repo /tmp/before --label before

Runs each script with its default (toy-world) flags for `--iterations` iterations, one run at a time, evaluation only
at the start (`--eval-every` large), and averages the phase times of iterations 1.. (iteration 0 also pays the first
evaluation and the warm-up). Prints a markdown table; `--out FILE` appends it there.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("flowgrpo_baseline", "g2rpo", "densegrpo")
PHASES = ("rollout", "reward", "train")


def run(repo: str, script: str, iterations: int, threads: int, extra: list[str]) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"phases_{script}_")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": repo,
    }
    cmd = [
        sys.executable,
        os.path.join(repo, f"{script}.py"),
        "--num-iterations",
        str(iterations),
        "--eval-every",
        "100000",
        "--output-dir",
        out,
        "--run-name",
        "run",
        *extra,
    ]
    subprocess.run(cmd, env=env, cwd=repo, check=True, capture_output=True)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=ROOT, help="checkout whose scripts to time")
    p.add_argument("--label", default="this checkout")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS))
    p.add_argument("--out", default=None, help="append the table to this file")
    a = p.parse_args()
    rows = [
        f"| script ({a.label}) | " + " | ".join(f"{ph} s/it" for ph in PHASES) + " | total s/it | "
        "NFE/it rollout | completion | train fwd | train bwd |",
        "|---|" + "---|" * (len(PHASES) + 5),
    ]
    for s in a.scripts:
        # time the loop, not Algorithm 1
        extra = ["--calibration-iterations", "0"] if s == "densegrpo" else []
        m = [
            r
            for r in run(a.repo, s, a.iterations, a.threads, extra)
            if 1 <= r["iteration"] < a.iterations
        ]
        t = {ph: sum(r.get(f"time/{ph}_s", 0.0) for r in m) / len(m) for ph in PHASES}
        nfe = ["", "", "", ""]
        if "nfe/rollout" in m[-1]:  # per-phase counts exist from the training-section refactor on
            prev = m[0]
            nfe = [
                f"{(m[-1][k] - prev[k]) / (len(m) - 1):.0f}" if len(m) > 1 else ""
                for k in (
                    "nfe/rollout",
                    "nfe/completion",
                    "nfe/train_forward",
                    "nfe/train_backward",
                )
            ]
        rows.append(
            f"| {s} | "
            + " | ".join(f"{t[ph]:.2f}" for ph in PHASES)
            + f" | {sum(t.values()):.2f} | "
            + " | ".join(nfe)
            + " |"
        )
    table = "\n".join(rows)
    print(table)
    if a.out:
        with open(a.out, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
