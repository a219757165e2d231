"""Issue #48: the verdict as one figure. The three toy defaults' held-out gain against training CPU seconds,
trajectories and iterations, every seed faint and the mean bold, from the committed logs:

    python docs/data/screens_2026-12-03/verdict/verdict_figure.py      # from the repository root

draws docs/img/verdict.png. The runs are verdict.py's (its readers; args.json equal to each script's default but
for --num-iterations and --eval-every): G²RPO `screens_2026-12-02/g12m3/`, DenseGRPO `screens_2026-12-03/c/`
(`verdict/d15`, `d20` are cuts of the same runs and add nothing), Flow-GRPO's 30-iteration re-run
`screens_2026-12-04/f30/`, seeds drawn as they land. Until all five have, the bold Flow-GRPO mean is that of its
15-iteration cut `verdict/f15/` (the same runs' first half: seed 1's iteration-10 evaluations are equal).
"""

import os
import sys

from verdict import DATA, GROUPS, from_folder  # also puts the repository root on sys.path

from common.plumbing.plots import _figure  # noqa: E402

SEEDS = 5
F30 = from_folder(os.path.join(DATA, "..", "screens_2026-12-04", "f30"), "flowgrpo_*")
# name, default in a few words, colour, its runs (longest first) and the day and machine each ran on
ALGOS = [
    ("Flow-GRPO", "32 prompts × 8, steps 0–4, 30 it.", "tab:blue",
     [(F30, "2026-12-04 (30 it., beside the test suite)"), (GROUPS["flow15"][1], "2026-12-03 (15 it., in two lanes)")]),
    ("G²RPO", "12 prompts × 8, branches at steps 0–2, 39 it.", "tab:orange",
     [(GROUPS["g2rpo39"][1], "2026-12-02 on a slow machine (its 39 iterations logged 873–877 CPU s on a faster one that day)")]),
    ("DenseGRPO", "32 prompts × 8, steps 0–4, n = 2, 30 it.", "tab:green",
     [(GROUPS["dense30"][1], "2026-12-03 (seeds 3, 5 alone; 1, 2, 4 beside the test suite, about 30 % more)")]),
]  # fmt: skip
PANELS = [
    ("cpu_s", "training CPU seconds (time/cpu_s as logged, evaluations included)"),
    ("trajectories", "trajectories (prompts × G, summed over iterations)"),
    ("iteration", "iterations (one optimizer step each)"),
]


def curves(group: dict) -> list[list[dict]]:
    """Each seed's evaluations as {x key: value, "gain": accuracy - the folder's start run}."""
    return [[{**p, "gain": p["acc"] - group["start"]} for p in r["points"]] for r in group["runs"]]


def mean_curve(runs: list[list[dict]]) -> list[dict]:
    """The mean over seeds of every key at the iterations all seeds evaluated."""
    shared = set.intersection(*({p["iteration"] for p in r} for r in runs))
    at = [[p for p in r if p["iteration"] in shared] for r in runs]
    keys = [k for k, _ in PANELS] + ["gain"]
    return [{k: sum(r[i][k] for r in at) / len(at) for k in keys} for i in range(len(shared))]


def gain_axes(fig, axes, legend_top: float) -> None:
    """The frame every gain figure shares: the zero line and grid, the y label, one legend above the panels."""
    for ax in axes:
        ax.axhline(0, color="black", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy gain over the start (fraction correct)")
    axes[0].plot([], [], color="grey", lw=0.9, alpha=0.6, label="one seed (thin lines)")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="upper center",
        bbox_to_anchor=(0.5, legend_top),
        ncols=3,
    )


def draw(path: str) -> None:
    # placed by hand: constrained layout lays a legend outside the axes over the title
    fig = _figure(1500, 600)
    fig.subplots_adjust(left=0.055, right=0.99, top=0.84, bottom=0.25, wspace=0.06)
    axes = fig.subplots(1, 3, sharey=True)
    days, notes = [], []
    for name, default, colour, sources in ALGOS:
        # the mean comes from the longest runs that have every seed; longer ones still landing are drawn dashed
        k = next(
            (i for i, (g, _) in enumerate(sources) if len(g["runs"]) >= SEEDS), len(sources) - 1
        )
        mean, n = mean_curve(curves(sources[k][0])), len(sources[k][0]["runs"])
        days.append(f"{name} on " + " and ".join(day for _, day in sources[: k + 1]))
        for i, (g, _) in enumerate(sources[: k + 1]):
            for ax, (key, label) in zip(axes, PANELS):
                for r in curves(g):
                    x, y = [p[key] for p in r], [p["gain"] for p in r]
                    ax.plot(
                        x,
                        y,
                        color=colour,
                        **(dict(lw=1.2, ls="--") if i < k else dict(lw=0.9, alpha=0.4)),
                    )
                ax.set_xlabel(label)
        for ax, (key, _) in zip(axes, PANELS):
            ax.plot(
                [p[key] for p in mean], [p["gain"] for p in mean], color=colour, lw=2.6, marker="o"
            )
        axes[0].lines[-1].set_label(f"{name} ({default}): mean of {n} seeds")
        if k:
            landed = len(sources[0][0]["runs"])
            axes[0].plot(
                [],
                [],
                color=colour,
                lw=1.2,
                ls="--",
                label=f"{name}, 30 it.: {landed} of {SEEDS} seeds so far",
            )
            notes.append(
                f"{name}'s 30-iteration re-run has {landed} of {SEEDS} seeds so far (dashed); its bold mean is that of "
                f"the {n} seeds of its {mean[-1]['iteration']:.0f}-iteration cut, the same runs' first half."
            )
    gain_axes(fig, axes, legend_top=0.95)
    fig.suptitle(
        "The three toy defaults: held-out strict-accuracy gain over the start (0.471; 100 test prompts) "
        "against cost, runs of 2026-12-02 to 2026-12-04",
        fontsize="large",
        y=0.985,
    )
    fig.text(
        0.005,
        0.01,
        "Each point is an evaluation with 2 seeds per prompt (a run's last: 8); bold markers where all of an "
        "algorithm's seeds evaluated. CPU seconds as logged, each run on its own day and machine: "
        + "; ".join(days)
        + ".\nSo the left panel mixes machines and loads: compare CPU seconds within one day's runs only, never "
        "across days. Timed side by side (benchmarks/bench_cost.py, 2026-12-04), per iteration G²RPO costs 0.93× "
        "Flow-GRPO's CPU and DenseGRPO 1.52×.\n" + " ".join(notes),
        va="bottom",
        wrap=True,
    )
    fig.savefig(path)


if __name__ == "__main__":
    out = os.path.join(DATA, "..", "..", "img", "verdict.png")
    draw(out)
    print(os.path.normpath(out), file=sys.stderr)
