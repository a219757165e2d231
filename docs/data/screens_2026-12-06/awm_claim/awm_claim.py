"""Issue #69 items 4-5: AWM's toy default beside Flow-GRPO's and DiffusionNFT's, 5 seeds each, the three scripts run
side by side (lanes.sh here: one lane per script, one thread per run, each at its default iterations), read on the
test prompts:

    python docs/data/screens_2026-12-06/awm_claim/awm_claim.py [FOLDER]     # from the repository root

A gain is a run's last evaluation (8 seeds per test prompt) minus its start run's (the shipped model, the same seeds).
Training CPU seconds per iteration are each run's median over the iterations without an evaluation of the step in
time/cpu_s (evaluations left out: the scripts evaluate at different iterations), as
docs/data/screens_2026-12-05/nft/nft_claim.py reads them. Printed:

- each script's gain with its 95 % t-interval, and its training CPU per iteration and per default run;
- AWM against each at their default runs (the CPU each used said beside it): Welch's interval and p, Holm over the two;
- AWM at the others' training CPU: its accuracy linear between its periodic evaluations at the iteration where its
  training CPU equals the other script's mean run, against that script's finals (Welch);
- the paper's axis: the training CPU at which each AWM seed first reaches the other script's mean final accuracy
  (linear between AWM's periodic evaluations, 2 seeds per prompt), as a share of that script's mean training CPU for
  its default run, and its inverse (how many times less CPU); the mean share with its t-interval over AWM's seeds
  (the other script's own spread is not propagated).
"""

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, *[".."] * 4))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(HERE, "..", "..", "screens_2026-12-05", "nft"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "screens_2026-12-03", "verdict"))

from nft_claim import crossing, fmt, group  # noqa: E402
from verdict import holm, welch_test  # noqa: E402

from benchmarks.bench_compare import mean_ci, welch_ci  # noqa: E402

NAMES = {"awm": "AWM", "flowgrpo_baseline": "Flow-GRPO", "diffusionnft": "DiffusionNFT"}


def at_cpu(points: list[dict], iteration: float) -> float:
    """A run's accuracy at a fractional iteration, linear between its evaluations (its last one past the end)."""
    for a, b in zip(points, points[1:]):
        if a["iteration"] <= iteration <= b["iteration"]:
            return a["acc"] + (iteration - a["iteration"]) / (b["iteration"] - a["iteration"]) * (
                b["acc"] - a["acc"]
            )
    return points[-1]["acc"]


def main(folder: str) -> None:
    g = {a: group(folder, a) for a in NAMES}
    print(f"runs: {folder}\n")
    print(
        "| script | seeds | start | iterations | final, per seed | gain [95 % CI] | training CPU s / iteration | training CPU s / run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for a, name in NAMES.items():
        runs = g[a]["runs"]
        per_it = [r["cpu_per_iteration"] for r in runs]
        print(
            f"| {name} | {len(runs)} | {g[a]['start']:.3f} | "
            f"{'/'.join(sorted({str(r['iterations']) for r in runs}))} | "
            f"{' / '.join(format(r['final'], '.3f') for r in runs)} | "
            f"{fmt(*mean_ci([r['gain'] for r in runs]))} | "
            f"{statistics.mean(per_it):.1f} ({min(per_it):.1f}–{max(per_it):.1f}) | "
            f"{statistics.mean(r['train_cpu'] for r in runs):,.0f} |"
        )
    awm = g["awm"]["runs"]
    awm_cpu = statistics.mean(r["train_cpu"] for r in awm)
    cells = []
    for other in ("flowgrpo_baseline", "diffusionnft"):
        runs = g[other]["runs"]
        share = awm_cpu / statistics.mean(r["train_cpu"] for r in runs)
        cells.append(
            (
                f"AWM's default run ({share:.2f} of {NAMES[other]}'s training CPU) against {NAMES[other]}'s",
                [r["gain"] for r in awm],
                [r["gain"] for r in runs],
            )
        )
    tests = [welch_test(a, b) for _, a, b in cells]
    adjusted = holm([p for _, p, _ in tests])
    print(
        "\n| AWM − other | difference [95 % CI] | df | p, uncorrected | p, Holm over the 2 | 5 seeds resolve |"
    )
    print("|---|---|---|---|---|---|")
    for (label, a, b), (df, p, resolved), adj in zip(cells, tests, adjusted):
        print(
            f"| {label} | {fmt(*welch_ci(a, b))} | {df:.1f} | {p:.2g} | {adj:.2g} | {resolved:.3f} |"
        )

    print(
        "\n| AWM at the other's training CPU | AWM iteration | AWM accuracy there [95 % CI] | other's final | AWM − other [95 % CI] |"
    )
    print("|---|---|---|---|---|")
    for other in ("flowgrpo_baseline", "diffusionnft"):
        runs = g[other]["runs"]
        other_cpu = statistics.mean(r["train_cpu"] for r in runs)
        there = [(other_cpu / r["cpu_per_iteration"], r["points"]) for r in awm]
        accs = [at_cpu(points, it) for it, points in there]
        finals = [r["final"] for r in runs]
        mean_it = statistics.mean(it for it, _ in there)
        print(
            f"| {NAMES[other]} ({other_cpu:,.0f} s) | {mean_it:.1f} | {fmt(*mean_ci(accs)).replace('+', '')} | "
            f"{fmt(*mean_ci(finals)).replace('+', '')} | {fmt(*welch_ci(accs, finals))} |"
        )

    for other in ("flowgrpo_baseline", "diffusionnft"):
        runs = g[other]["runs"]
        level = statistics.mean(r["final"] for r in runs)
        other_cpu = statistics.mean(r["train_cpu"] for r in runs)
        shares = []
        for r in awm:
            it = crossing(r["points"], level)
            shares.append(None if it is None else it * r["cpu_per_iteration"] / other_cpu)
        print(
            f"\nAWM reaches {NAMES[other]}'s mean final accuracy ({level:.3f}) at these shares of its training CPU "
            f"({other_cpu:,.0f} s): {' / '.join('never' if s is None else f'{s:.2f}' for s in shares)}"
        )
        reached = [s for s in shares if s is not None]
        if len(reached) >= 2:
            m, lo, hi = mean_ci(reached)
            print(
                f"mean over the {len(reached)} of {len(shares)} seeds that reach it: {m:.2f} [{lo:.2f}, {hi:.2f}] "
                f"(95 % t-interval over AWM's seeds), i.e. {1 / m:.2f}x less training CPU "
                f"[{1 / hi:.2f}, {1 / lo:.2f}]"
                + (
                    " (the seeds that never reach it left out)"
                    if len(reached) < len(shares)
                    else ""
                )
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
