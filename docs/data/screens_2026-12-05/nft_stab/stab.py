"""Issue #47 item 2: DiffusionNFT's toy default at 3x its iterations (60), seeds 1-3:

    python docs/data/screens_2026-12-05/nft_stab/stab.py      # from the repository root

Each run is seed s of the 5-seed headline (../nft/diffusionnft__default__s), resumed from its checkpoint-20 with
`--num-iterations 60` (laneA.sh); its rows 0-20 are the headline run's. Prints every evaluation (2 seeds per test
prompt every 5 iterations; 8 at iteration 20, the headline's final, and at 60), the gain at 60 over the start
(0.471, the headline's start run) with its 95 % interval, the paired change from iteration 20 to 60, and the loss
and gradient norm over the run (means of 10-iteration windows); draws docs/img/nft_stability.png (held-out accuracy
and policy loss against iterations, each seed).
"""

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, *[".."] * 4)))

from benchmarks.bench_compare import mean_ci, read_rows, summarize  # noqa: E402
from common.plumbing.plots import _figure  # noqa: E402

START = summarize(os.path.join(HERE, "..", "nft", "diffusionnft__default__start"))["final"]["acc"]


def headline_final(seed: int) -> float:
    return summarize(os.path.join(HERE, "..", "nft", f"diffusionnft__default__{seed}"))["final"][
        "acc"
    ]


def main() -> None:
    runs = sorted(glob.glob(os.path.join(HERE, "diffusionnft__default__[0-9]*")))
    at20, at60 = [], []
    for d in runs:
        seed = int(d.rsplit("__", 1)[1])
        s, rows = summarize(d), read_rows(d)
        at20.append(headline_final(seed))
        at60.append(s["final"]["acc"])
        evals = " ".join(f"{p['iteration']}:{p['acc']:.3f}" for p in s["points"])
        windows = []
        for lo in range(0, 60, 10):
            w = [r for r in rows if lo <= r["iteration"] < lo + 10 and "policy_loss" in r]
            windows.append(
                f"{lo}-{lo + 9}: {sum(r['policy_loss'] for r in w) / len(w):.2f} / "
                f"{sum(r['grad_norm'] for r in w) / len(w):.2f}"
            )
        print(f"seed {seed}: evaluations (iteration:accuracy) {evals}")
        print(
            f"  final at 20 (headline) {at20[-1]:.3f}, at 60 {at60[-1]:.3f}, lowest after the start {min(p['acc'] for p in s['points'] if p['iteration'] > 0):.3f}"
        )
        print(f"  policy loss / gradient norm, 10-iteration means: {'; '.join(windows)}")
    m, lo, hi = mean_ci([a - START for a in at60])
    print(
        f"\nstart {START:.3f}; gain at 60: {m:+.3f} [{lo:+.3f}, {hi:+.3f}] (95 % t, {len(runs)} seeds)"
    )
    print(f"runs ending below the start: {sum(a < START for a in at60)} of {len(runs)}")
    m, lo, hi = mean_ci([b - a for a, b in zip(at20, at60)])
    print(
        f"change from iteration 20 to 60 (paired, 8 seeds per prompt both): {m:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    )


def draw(path: str) -> None:
    fig = _figure(1200, 480)
    fig.subplots_adjust(left=0.06, right=0.99, top=0.86, bottom=0.2, wspace=0.18)
    acc, loss = fig.subplots(1, 2)
    for d in sorted(glob.glob(os.path.join(HERE, "diffusionnft__default__[0-9]*"))):
        seed = d.rsplit("__", 1)[1]
        pts, rows = summarize(d)["points"], [r for r in read_rows(d) if "policy_loss" in r]
        acc.plot(
            [p["iteration"] for p in pts],
            [p["acc"] for p in pts],
            marker="o",
            ms=3,
            label=f"seed {seed}",
        )
        loss.plot(
            [r["iteration"] for r in rows],
            [r["policy_loss"] for r in rows],
            lw=1,
            label=f"seed {seed}",
        )
    acc.axhline(START, color="grey", ls="--", lw=1, label=f"start ({START:.3f})")
    acc.axvline(20, color="black", ls=":", lw=1, label="the default's 20 iterations")
    loss.axvline(20, color="black", ls=":", lw=1)
    acc.set(
        xlabel="iteration", ylabel="held-out strict accuracy (100 test prompts)", ylim=(0.4, 0.85)
    )
    loss.set(xlabel="iteration", ylabel="NFT policy loss (x0 form, / beta)")
    for ax in (acc, loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(
        "DiffusionNFT's toy default run to 3x its iterations (60), three seeds", fontsize="large"
    )
    fig.text(
        0.005,
        0.01,
        "Evaluations every 5 iterations with 2 seeds per test prompt (SE about 0.035), the last with 8 (about 0.016). "
        "Iterations 21-60 resumed from each headline run's checkpoint-20 (docs/data/screens_2026-12-05/nft_stab).",
        va="bottom",
        wrap=True,
    )
    fig.savefig(path)


if __name__ == "__main__":
    main()
    draw(os.path.join(HERE, "..", "..", "..", "img", "nft_stability.png"))
