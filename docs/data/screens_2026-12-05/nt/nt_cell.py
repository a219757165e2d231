"""Issue #48 item 4: DenseGRPO's paper-faithful main setting at the default batch, the verdict's missing cell:

    python docs/data/screens_2026-12-05/nt/nt_cell.py      # from the repository root

n = t completions (`--completion-steps None`), 9 of 10 steps trained (`--timestep-fraction 0.99`), 32 prompts x 8
for 30 iterations, our calibration rule (the default's), on the RL mix without the validation prompts, read on the
test prompts (launch: laneB.sh, laneA2.sh), against Flow-GRPO's default on the same mix, 5 seeds
(../nft/flowgrpo_baseline__default__*, 2026-12-05 00:26-01:53 UTC). Equal batch and iterations is here also equal
trajectories (7,680). Prints the gains, the Welch difference with p and the difference these seeds resolve (80 %
power, two-sided 5 %), the difference at iteration 10 (2 seeds per test prompt, as the periodic evaluations of
both), and the training CPU per iteration beside the DiffusionNFT runs that shared the machine with it.
"""

import glob
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, *[".."] * 4)))
sys.path.insert(0, os.path.join(HERE, "..", "..", "screens_2026-12-03", "verdict"))
sys.path.insert(0, os.path.join(HERE, "..", "nft"))

from nft_claim import at_iteration, fmt, group, train_cpu_per_iteration  # noqa: E402
from verdict import welch_test  # noqa: E402

from benchmarks.bench_compare import mean_ci, welch_ci  # noqa: E402

FLOW = os.path.join(HERE, "..", "nft")
STAB = os.path.join(HERE, "..", "nft_stab")


def main() -> None:
    dense, flow = group(HERE, "densegrpo"), group(FLOW, "flowgrpo_baseline")
    print(
        "| run | seeds | start | final, per seed | gain [95 % CI] | training CPU s / iteration |\n|---|---|---|---|---|---|"
    )
    for name, g in (("DenseGRPO n = t, 9 steps", dense), ("Flow-GRPO default", flow)):
        per_it = [r["cpu_per_iteration"] for r in g["runs"]]
        print(
            f"| {name} | {len(g['runs'])} | {g['start']:.3f} | "
            f"{' / '.join(format(r['final'], '.3f') for r in g['runs'])} | "
            f"{fmt(*mean_ci([r['gain'] for r in g['runs']]))} | "
            f"{statistics.mean(per_it):.1f} ({min(per_it):.1f}–{max(per_it):.1f}) |"
        )
    print("\n| DenseGRPO n = t − Flow-GRPO | difference [95 % CI] | df | p | these seeds resolve |")
    print("|---|---|---|---|---|")
    for label, it in (
        ("equal batch and iterations (30), final evaluations", None),
        ("at iteration 10", 10),
    ):
        a = [
            r["gain"] if it is None else at_iteration(r["points"], it) - dense["start"]
            for r in dense["runs"]
        ]
        b = [
            r["gain"] if it is None else at_iteration(r["points"], it) - flow["start"]
            for r in flow["runs"]
        ]
        df, p, resolved = welch_test(a, b)
        print(f"| {label} | {fmt(*welch_ci(a, b))} | {df:.1f} | {p:.2g} | {resolved:.3f} |")

    nft = [
        train_cpu_per_iteration(d) for d in sorted(glob.glob(os.path.join(STAB, "diffusionnft__*")))
    ]
    if nft:
        print(
            f"\nDiffusionNFT beside it (its 3x-iterations runs, the other lane): {statistics.mean(nft):.1f} CPU s per "
            f"training iteration ({', '.join(f'{v:.1f}' for v in nft)}); n = t / NFT = "
            f"{statistics.mean(r['cpu_per_iteration'] for r in dense['runs']) / statistics.mean(nft):.2f}"
        )


if __name__ == "__main__":
    main()
