"""Issue #36 item 5: the three algorithms' gains on three axes, from the committed run logs.

    python docs/data/screens_2026-12-03/verdict/verdict.py      # from the repository root

A run's gain is its final evaluation (8 seeds per test prompt) minus its folder's start run (the shipped model on
the same seeds, 0.471); a group's gain is the mean over its seeds with a 95 % t-interval, and a difference of two
groups is Welch's. Flow-GRPO's 30-iteration default is its re-run of 2026-12-04 with its logs kept
(docs/data/screens_2026-12-04/f30; the 2026-12-01 runs left only their table, `flow_default_2026-12-01.json`, which
the re-run reproduces in four seeds of five).
"""

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, *[".."] * 4)))

from benchmarks.bench_compare import mean_ci, summarize, t_cdf, t_quantile, welch_ci  # noqa: E402

DATA = os.path.dirname(HERE)  # docs/data/screens_2026-12-03


def from_folder(
    folder: str, pattern: str, start_folder: str | None = None, resumed_from: str | None = None
) -> dict:
    """Every finished seed of `pattern` in `folder` (the harness's reading: benchmarks/bench_compare.py), its gain
    against the start run of `start_folder` (default: `folder`). Runs continued with --resume from the same run in
    `resumed_from` add its CPU seconds: before 2026-12-03 (237750a) a resumed process restarted time/cpu_s at 0.
    -> {"start": the start run's accuracy, "runs": [{..., "points": every evaluation (bench_compare.eval_points;
    a resumed run's cpu_s as logged)}]}"""
    start_run = next(iter(glob.glob(os.path.join(start_folder or folder, "*__start"))), None)
    if start_run is None:
        return {"runs": []}
    start = summarize(start_run)["final"]["acc"]
    runs = []
    for d in sorted(glob.glob(os.path.join(folder, pattern))):
        s = summarize(d)
        if d.endswith("__start") or s is None:
            continue
        f = s["final"]
        runs.append(
            {
                "seed": int(d.rsplit("__", 1)[1]),
                "gain": f["acc"] - start,
                "points": s["points"],
                "iterations": f["iteration"],
                "trajectories": f["trajectories"],
                "cpu": f["cpu_s"]
                + (
                    summarize(os.path.join(resumed_from, os.path.basename(d)))["final"]["cpu_s"]
                    if resumed_from
                    else 0
                ),
            }
        )
    return {"start": start, "runs": runs}


V = os.path.join(DATA, "verdict")
G = os.path.join(DATA, "..", "screens_2026-12-04", "guard")
GROUPS = {
    "flow30": (
        "Flow-GRPO default (32 x 8), 30 it.",
        from_folder(os.path.join(DATA, "..", "screens_2026-12-04", "f30"), "flowgrpo_*"),
    ),
    "flow15": ("Flow-GRPO default (32 x 8), 15 it.", from_folder(f"{V}/f15", "flowgrpo_*")),
    "flow12": ("Flow-GRPO at 12 x 8, 39 it.", from_folder(f"{V}/f12", "flowgrpo_*")),
    "g2rpo39": (
        "G²RPO default (12 x 8), 39 it.",
        from_folder(os.path.join(DATA, "..", "screens_2026-12-02", "g12m3"), "g2rpo_*"),
    ),
    "dense30": ("DenseGRPO default (32 x 8), 30 it.", from_folder(f"{DATA}/c", "densegrpo_*")),
    "dense20": (
        "DenseGRPO default (32 x 8), 20 it.",
        from_folder(f"{V}/d20", "densegrpo_*", f"{V}/d15", f"{V}/d15"),
    ),
    "dense15": ("DenseGRPO default (32 x 8), 15 it.", from_folder(f"{V}/d15", "densegrpo_*")),
    "dense15u": (
        "DenseGRPO, uniform psi, 15 it.",
        from_folder(f"{V}/d15u", "densegrpo_*", f"{V}/d15"),
    ),
    # issue #36 item 3e (2026-12-04): GRPO-Guard's per-step weighting at the defaults; f30g continues f15g's runs
    "flow15g": (
        "Flow-GRPO default + --ratio-norm guard, 15 it.",
        from_folder(f"{G}/f15g", "flowgrpo_*"),
    ),
    "flow30g": (
        "Flow-GRPO default + --ratio-norm guard, 30 it.",
        from_folder(f"{G}/f30g", "flowgrpo_*", f"{G}/f15g"),
    ),
    "dense15g": (
        "DenseGRPO default + --ratio-norm guard, 15 it.",
        from_folder(f"{G}/d15g", "densegrpo_*"),
    ),
    "dense30g": (
        "DenseGRPO default + --ratio-norm guard, 30 it.",
        from_folder(f"{G}/d30g", "densegrpo_*", f"{G}/d15g"),
    ),
}


def fmt(m, lo, hi) -> str:
    return f"{m:+.3f}" + ("" if lo is None else f" [{lo:+.3f}, {hi:+.3f}]")


def row(key: str, ref: str | None) -> str:
    name, g = GROUPS[key]
    gains = [r["gain"] for r in g["runs"]]
    if not gains:
        return f"| {name} | 0 | (no finished run) | | | | |"
    tr = sorted({r["trajectories"] for r in g["runs"]})
    cpu = [r["cpu"] for r in g["runs"]]
    diff = ""
    ref_gains = [r["gain"] for r in GROUPS[ref][1]["runs"]] if ref else []
    if ref_gains:
        diff = f"{fmt(*welch_ci(gains, ref_gains))} against {GROUPS[ref][0].split(' (')[0]}"
    return (
        f"| {name} | {len(gains)} | {'/'.join(f'{x:,}' for x in tr)} | {fmt(*mean_ci(gains))} | "
        f"{' / '.join(f'{x:+.3f}' for x in gains)} | {diff} | {min(cpu):,.0f}–{max(cpu):,.0f} |"
    )


AXES = [
    (
        "Equal CPU seconds (those of Flow-GRPO's default run: G²RPO at the iterations 1,200 CPU s bought on the "
        "verdict's machine, DenseGRPO at 30 / 1.49, its CPU per iteration against Flow-GRPO's side by side)",
        [("flow30", None), ("g2rpo39", "flow30"), ("dense20", "flow30")],
    ),
    (
        "Equal trajectories (G²RPO's default, 3,744; the others cut at 15 iterations, 3,840)",
        [("g2rpo39", None), ("flow15", "g2rpo39"), ("dense15", "g2rpo39"), ("dense15", "flow15")],
    ),
    (
        "Equal trajectories (7,680: Flow-GRPO's and DenseGRPO's defaults)",
        [("flow30", None), ("dense30", "flow30")],
    ),
    (
        "Equal batch and iterations (the same prompts x G per iteration and iterations as a Flow-GRPO run; the "
        "papers' own batches and iterations are far larger)",
        [("flow12", None), ("g2rpo39", "flow12"), ("flow30", None), ("dense30", "flow30")],
    ),
    (
        "Item 3c: calibrated psi against uniform noise (15 it.)",
        [("dense15", None), ("dense15u", "dense15")],
    ),
    (
        "Item 3e: GRPO-Guard's per-step weighting (--ratio-norm guard) at the defaults, equal iterations and batch",
        [
            ("flow15", None),
            ("flow15g", "flow15"),
            ("flow30", None),
            ("flow30g", "flow30"),
            ("dense15", None),
            ("dense15g", "dense15"),
            ("dense30", None),
            ("dense30g", "dense30"),
        ],
    ),
]

# The verdict's six differences: (label, algorithm, newer group, Flow-GRPO group). Holm runs over each algorithm's
# three axes (its claim) and over all six.
CELLS = [
    ("G²RPO − Flow-GRPO, equal CPU seconds", "g2rpo", "g2rpo39", "flow30"),
    ("G²RPO − Flow-GRPO, equal trajectories (3,744 / 3,840)", "g2rpo", "g2rpo39", "flow15"),
    ("G²RPO − Flow-GRPO, equal batch and iterations (12 × 8, 39 it.)", "g2rpo", "g2rpo39", "flow12"),
    ("DenseGRPO − Flow-GRPO, equal CPU seconds", "dense", "dense20", "flow30"),
    ("DenseGRPO − Flow-GRPO, equal trajectories (3,840)", "dense", "dense15", "flow15"),
    ("DenseGRPO − Flow-GRPO, equal batch and iterations = equal trajectories (7,680)", "dense", "dense30", "flow30"),
]  # fmt: skip


def welch_test(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(df, two-sided p, the difference resolved with 80 % power at a two-sided 5 % level: SE (t_.975 + t_.80))."""
    vx, vy = (
        sum((v - sum(vs) / len(vs)) ** 2 for v in vs) / (len(vs) - 1) / len(vs) for vs in (xs, ys)
    )
    se = (vx + vy) ** 0.5
    df = (vx + vy) ** 2 / (vx**2 / (len(xs) - 1) + vy**2 / (len(ys) - 1))
    d = sum(xs) / len(xs) - sum(ys) / len(ys)
    p = 2 * (1 - t_cdf(abs(d) / se, df))
    return df, p, se * (t_quantile(0.975, df) + t_quantile(0.80, df))


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def print_tests() -> None:
    gains = {k: [r["gain"] for r in g["runs"]] for k, (_, g) in GROUPS.items()}
    rows = []
    for label, algo, new, old in CELLS:
        df, p, resolved = welch_test(gains[new], gains[old])
        rows.append((label, algo, welch_ci(gains[new], gains[old]), df, p, resolved))
    all6 = holm([r[4] for r in rows])
    per_algo = {}
    for algo in {r[1] for r in rows}:
        idx = [i for i, r in enumerate(rows) if r[1] == algo]
        per_algo.update(zip(idx, holm([rows[i][4] for i in idx])))
    print(
        "\nThe verdict's tests (Welch, two-sided; Holm over the algorithm's 3 axes and over all 6)\n"
    )
    print(
        "| difference | [95 % CI] | df | p, uncorrected | p, Holm over the algorithm's 3 | p, Holm over all 6 "
        "| 5 seeds resolve |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, (label, _, ci, df, p, resolved) in enumerate(rows):
        print(
            f"| {label} | {fmt(*ci)} | {df:.1f} | {p:.2g} | {per_algo[i]:.2g} | {all6[i]:.2g} | {resolved:.3f} |"
        )


if __name__ == "__main__":
    for title, rows in AXES:
        print(f"\n{title}\n")
        print(
            "| run | seeds | trajectories | gain [95 % CI] | per seed | − another (Welch) | CPU s in loop, that day |"
        )
        print("|---|---|---|---|---|---|---|")
        for key, ref in rows:
            print(row(key, ref))
    print_tests()
