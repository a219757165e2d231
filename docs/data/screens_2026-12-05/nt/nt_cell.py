"""Issue #48 item 4: DenseGRPO's paper-faithful main setting at the default batch, the verdict's missing cell:

    python docs/data/screens_2026-12-05/nt/nt_cell.py      # from the repository root

n = t completions (`--completion-steps None`), 9 of 10 steps trained (`--timestep-fraction 0.99`), 32 prompts x 8
for 30 iterations, our calibration rule (the default's), on the RL mix without the validation prompts, read on the
test prompts (launch: laneB.sh, laneA2.sh), against Flow-GRPO's default on the same mix, 5 seeds
(../nft/flowgrpo_baseline__default__*, 2026-12-05 00:26-01:53 UTC). Equal batch and iterations is here also equal
trajectories (7,680). Prints the gains, the Welch difference with p and the difference these seeds resolve (80 %
power, two-sided 5 %), and about equal CPU: n = t's iteration-10 evaluation (2 seeds per test prompt) against
Flow-GRPO's final. The CPU ratio goes through DiffusionNFT: n = t ran beside NFT's 3x-iterations runs (../nft_stab),
and NFT beside Flow-GRPO (its per-iteration ratio, read from ../nft).
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
    nft = [
        train_cpu_per_iteration(d, after=20)
        for d in sorted(glob.glob(os.path.join(STAB, "diffusionnft__*")))
    ]
    nft_flow = statistics.mean(  # NFT / Flow-GRPO per iteration, side by side (../nft)
        r["cpu_per_iteration"] for r in group(FLOW, "diffusionnft")["runs"]
    ) / statistics.mean(r["cpu_per_iteration"] for r in flow["runs"])
    ratio = (
        statistics.mean(r["cpu_per_iteration"] for r in dense["runs"])
        / statistics.mean(nft)
        * nft_flow
    )
    print(
        f"\nDiffusionNFT beside it (its 3x-iterations runs' iterations 21-60, the other lane): {statistics.mean(nft):.1f} CPU s per "
        f"training iteration; n = t / Flow-GRPO = n = t / NFT x {nft_flow:.2f} = {ratio:.2f} per iteration, so "
        f"Flow-GRPO's 30 iterations buy n = t about {30 / ratio:.0f}"
    )
    print("\n| DenseGRPO n = t − Flow-GRPO | difference [95 % CI] | df | p | these seeds resolve |")
    print("|---|---|---|---|---|")
    cells = [
        ("equal batch and iterations (30) = equal trajectories (7,680), finals", 30, 30),
        (
            f"about equal CPU: n = t at iteration 10 ({10 * ratio / 30:.2f} of Flow-GRPO's) against Flow's 30",
            10,
            30,
        ),
    ]
    for label, it_dense, it_flow in cells:
        a = [at_iteration(r["points"], it_dense) - dense["start"] for r in dense["runs"]]
        b = [at_iteration(r["points"], it_flow) - flow["start"] for r in flow["runs"]]
        df, p, resolved = welch_test(a, b)
        print(f"| {label} | {fmt(*welch_ci(a, b))} | {df:.1f} | {p:.2g} | {resolved:.3f} |")


if __name__ == "__main__":
    main()
