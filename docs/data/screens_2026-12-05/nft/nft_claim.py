"""Issue #47 items 2-3: DiffusionNFT's toy default against Flow-GRPO's, both on the RL mix without the validation
prompts, 5 seeds each, run side by side (one lane each), read on the test prompts:

    python docs/data/screens_2026-12-05/nft/nft_claim.py [FOLDER]     # from the repository root; FOLDER: the runs

prints the tables and draws docs/img/nft_vs_flowgrpo.png (gain against training CPU, trajectories and iterations,
every seed thin and the mean bold).

A gain is a run's last evaluation (8 seeds per test prompt) minus its start run's (the shipped model, the same
seeds). Training CPU seconds per iteration are each run's median over the iterations without an evaluation of the
step in time/cpu_s (evaluations left out: the two scripts evaluate at different iterations). The axes:

- equal CPU: NFT's default run against Flow-GRPO's, each at its own default iterations; the sentence says which
  used less;
- equal trajectories = equal batch and iterations (32 prompts x 8 for NFT's iterations): NFT's final against
  Flow-GRPO's periodic evaluation at the same iteration (2 seeds per prompt: noisier than a final);
- the fraction of Flow-GRPO's training CPU at which NFT first reaches Flow-GRPO's mean final accuracy: per NFT seed,
  linear between its periodic evaluations, as a share of Flow-GRPO's mean training CPU for its run.

Welch intervals and p, Holm over the two distinct comparisons, and the difference 5 seeds resolve (80 % power,
two-sided 5 %), as in docs/data/screens_2026-12-03/verdict/verdict.py.
"""

import glob
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, *[".."] * 4)))
sys.path.insert(0, os.path.join(HERE, "..", "..", "screens_2026-12-03", "verdict"))

from verdict import holm, welch_test  # noqa: E402
from verdict_figure import gain_axes  # noqa: E402

from benchmarks.bench_compare import mean_ci, read_rows, summarize, welch_ci  # noqa: E402
from common.plumbing.plots import _figure  # noqa: E402

ALGOS = {"flow": "flowgrpo_baseline", "nft": "diffusionnft"}


def train_cpu_per_iteration(run_dir: str, after: int = -1) -> float:
    """Median CPU seconds of one training iteration: the step of time/cpu_s between two rows with no evaluation
    (rows of iterations after `after` only)."""
    rows = [r for r in read_rows(run_dir) if "time/cpu_s" in r and r["iteration"] > after]
    steps = [
        b["time/cpu_s"] - a["time/cpu_s"]
        for a, b in zip(rows, rows[1:])
        if "eval/accuracy" not in b
        and "eval/accuracy" not in a
        and b["iteration"] == a["iteration"] + 1
    ]
    return statistics.median(steps)


def group(folder: str, algo: str) -> dict:
    start = summarize(glob.glob(os.path.join(folder, f"{algo}__*__start"))[0])["final"]["acc"]
    runs = []
    for d in sorted(glob.glob(os.path.join(folder, f"{algo}__*__[0-9]*"))):
        s = summarize(d)
        if s is None:
            continue
        per_it = train_cpu_per_iteration(d)
        runs.append(
            {
                "seed": int(d.rsplit("__", 1)[1]),
                "gain": s["final"]["acc"] - start,
                "final": s["final"]["acc"],
                "points": s["points"],
                "iterations": s["iterations"],
                "cpu_per_iteration": per_it,
                "train_cpu": per_it * s["iterations"],
            }
        )
    return {"start": start, "runs": runs}


def at_iteration(points: list[dict], iteration: int) -> float | None:
    """The accuracy of the (periodic or final) evaluation made before training iteration `iteration`."""
    hits = [p["acc"] for p in points if p["iteration"] == iteration]
    return hits[-1] if hits else None


def crossing(points: list[dict], level: float) -> float | None:
    """The iteration at which a run's evaluations first reach `level`, linear in between; None if never."""
    for a, b in zip(points, points[1:]):
        if a["acc"] < level <= b["acc"]:
            return a["iteration"] + (level - a["acc"]) / (b["acc"] - a["acc"]) * (
                b["iteration"] - a["iteration"]
            )
        if a["acc"] >= level:
            return a["iteration"]
    return None


def fmt(m, lo, hi) -> str:
    return f"{m:+.3f}" + ("" if lo is None else f" [{lo:+.3f}, {hi:+.3f}]")


def main(folder: str) -> None:
    g = {k: group(folder, a) for k, a in ALGOS.items()}
    flow, nft = g["flow"], g["nft"]
    print(f"runs: {folder}\n")
    print(
        "| script | seeds | start | iterations | final, per seed | gain [95 % CI] | training CPU s / iteration | training CPU s / run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k, name in (("flow", "Flow-GRPO"), ("nft", "DiffusionNFT")):
        runs = g[k]["runs"]
        per_it = [r["cpu_per_iteration"] for r in runs]
        finals = " / ".join(f"{r['final']:.3f}" for r in runs)
        print(
            f"| {name} | {len(runs)} | {g[k]['start']:.3f} | {'/'.join(sorted({str(r['iterations']) for r in runs}))} | "
            f"{finals} | {fmt(*mean_ci([r['gain'] for r in runs]))} | "
            f"{statistics.mean(per_it):.1f} ({min(per_it):.1f}–{max(per_it):.1f}) | "
            f"{statistics.mean(r['train_cpu'] for r in runs):,.0f} |"
        )
    ratio = statistics.mean(r["cpu_per_iteration"] for r in nft["runs"]) / statistics.mean(
        r["cpu_per_iteration"] for r in flow["runs"]
    )
    share = statistics.mean(r["train_cpu"] for r in nft["runs"]) / statistics.mean(
        r["train_cpu"] for r in flow["runs"]
    )
    print(
        f"\nNFT / Flow-GRPO training CPU: {ratio:.2f} per iteration, {share:.2f} per default run\n"
    )

    n_it = max(r["iterations"] for r in nft["runs"])
    flow_at = [at_iteration(r["points"], n_it) for r in flow["runs"]]
    cells = [
        (
            f"equal CPU: NFT's {n_it} iterations ({share:.2f} of Flow-GRPO's CPU) against Flow-GRPO's "
            f"{max(r['iterations'] for r in flow['runs'])}",
            [r["gain"] for r in nft["runs"]],
            [r["gain"] for r in flow["runs"]],
        ),
        (
            f"equal trajectories = equal batch and iterations: both at 32 x 8 for {n_it} iterations "
            "(Flow-GRPO's periodic evaluation, 2 seeds per prompt)",
            [r["gain"] for r in nft["runs"]],
            [a - flow["start"] for a in flow_at if a is not None],
        ),
    ]
    tests = [welch_test(a, b) for _, a, b in cells]
    adjusted = holm([p for _, p, _ in tests])
    print(
        "| NFT − Flow-GRPO | difference [95 % CI] | df | p, uncorrected | p, Holm over the 2 | 5 seeds resolve |"
    )
    print("|---|---|---|---|---|---|")
    for (label, a, b), (df, p, resolved), adj in zip(cells, tests, adjusted):
        print(
            f"| {label} | {fmt(*welch_ci(a, b))} | {df:.1f} | {p:.2g} | {adj:.2g} | {resolved:.3f} |"
        )

    level = statistics.mean(r["final"] for r in flow["runs"])
    flow_cpu = statistics.mean(r["train_cpu"] for r in flow["runs"])
    fractions = []
    for r in nft["runs"]:
        it = crossing(r["points"], level)
        fractions.append(None if it is None else it * r["cpu_per_iteration"] / flow_cpu)
    print(
        f"\nNFT reaches Flow-GRPO's mean final accuracy ({level:.3f}) at these shares of Flow-GRPO's training CPU "
        f"({flow_cpu:,.0f} s): {' / '.join('never' if f is None else f'{f:.2f}' for f in fractions)}"
    )
    reached = [f for f in fractions if f is not None]
    if len(reached) == len(fractions):
        m, lo, hi = mean_ci(reached)
        print(
            f"mean {m:.2f} [{lo:.2f}, {hi:.2f}] (95 % t-interval over NFT's seeds; Flow-GRPO's own spread not "
            "propagated)"
        )


def draw(g: dict, path: str) -> None:
    """Gain over the start against training CPU (iterations x the run's CPU per iteration), trajectories and
    iterations; each seed thin, the mean over seeds at the iterations all evaluated bold."""
    fig = _figure(1500, 560)
    fig.subplots_adjust(left=0.055, right=0.99, top=0.80, bottom=0.2, wspace=0.06)
    axes = fig.subplots(1, 3, sharey=True)
    panels = [
        (
            "cpu",
            "training CPU seconds (iterations × the run's CPU per iteration, evaluations left out)",
        ),
        ("trajectories", "trajectories (prompts × G, summed over iterations)"),
        ("iteration", "iterations (one optimizer step each)"),
    ]
    styles = {
        "flow": ("Flow-GRPO (32 × 8, steps 0–4, 30 it.)", "tab:blue"),
        "nft": ("DiffusionNFT (32 × 8, 20 it.)", "tab:red"),
    }
    for k, (name, colour) in styles.items():
        runs = [
            [
                {
                    "cpu": p["iteration"] * r["cpu_per_iteration"],
                    **p,
                    "gain": p["acc"] - g[k]["start"],
                }
                for p in r["points"]
            ]
            for r in g[k]["runs"]
        ]
        shared = sorted(set.intersection(*({p["iteration"] for p in r} for r in runs)))
        for ax, (key, label) in zip(axes, panels):
            for r in runs:
                ax.plot(
                    [p[key] for p in r], [p["gain"] for p in r], color=colour, lw=0.9, alpha=0.4
                )
            at = [[next(p for p in r if p["iteration"] == it) for r in runs] for it in shared]
            xs = [statistics.mean(p[key] for p in ps) for ps in at]
            ys = [statistics.mean(p["gain"] for p in ps) for ps in at]
            ax.plot(
                xs, ys, color=colour, lw=2.6, marker="o", label=f"{name}: mean of {len(runs)} seeds"
            )
            ax.set_xlabel(label)
    gain_axes(fig, axes, legend_top=0.93)
    fig.suptitle(
        f"DiffusionNFT and Flow-GRPO at their toy defaults: held-out strict-accuracy gain over the start "
        f"({g['flow']['start']:.3f}; 100 test prompts), the same machine, side by side",
        fontsize="large",
        y=0.985,
    )
    fig.text(
        0.005,
        0.01,
        "Each point is an evaluation with 2 seeds per prompt (a run's last: 8); bold: the mean over seeds where all "
        "evaluated (Flow-GRPO every 10 iterations, NFT every 5). Both trained on the RL mix without the validation "
        "prompts; NFT's default was chosen on the validation prompts, Flow-GRPO's on the test prompts (2026-12-01).",
        va="bottom",
        wrap=True,
    )
    fig.savefig(path)


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else HERE
    main(folder)
    draw(
        {k: group(folder, a) for k, a in ALGOS.items()},
        os.path.join(HERE, "..", "..", "..", "img", "nft_vs_flowgrpo.png"),
    )
