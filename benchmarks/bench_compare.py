"""Benchmark (not a test): the algorithms on the toy world at an equal CPU-seconds budget, several seeds, with CIs.

    python benchmarks/bench_compare.py                                      # the grid: 3 scripts + yardstick x 5 seeds
    python benchmarks/bench_compare.py --jobs 2                             # two runs side by side, 1 thread each
    python benchmarks/bench_compare.py --algos yardstick --seeds 1 --cpu-seconds 20 --out /tmp/smoke   # a smoke run
    python benchmarks/bench_compare.py --report-only --out runs/compare     # redo every table and plot from the folders
    python benchmarks/bench_compare.py --report-only --out runs/verdict --merge runs/a runs/b   # grids from several places
    python benchmarks/bench_compare.py --variants "lr1e-4=--learning-rate 1e-4" -- --eval-every 20   # variants, extra flags
    python benchmarks/bench_compare.py --split validation --variants ...   # a screen: evaluate on the validation prompts

Every run is one script (its toy-world defaults, then the variant's flags, then the flags after `--`) with
`--cpu-budget-s`: it trains until its process CPU seconds since the training loop began (all threads) pass the
budget, then runs a final evaluation with enough seeds per evaluation prompt for a standard error <= --final-se
(binomial, worst case p = 0.5, categories weighted as eval/accuracy weights them) and exits. Per (algorithm,
variant) one more run with `--num-iterations 0` evaluates the starting model with the same seeds: the gain of a
run is its final accuracy minus that start, so both ends of the gain have the same precision. `--split` picks the
evaluation prompts: `validation` (common/toyworld/prompts_val.txt, carved from the training prompts and not trained
on) for every screen and every choice of a default, `test` (the default) read once, for the headline.

It resumes: a run whose metrics.jsonl has the `final: true` row is kept and skipped; any other run folder is
deleted and the run started again. So the grid can be finished in several sittings, and `--report-only`
rebuilds `{out}/results.md` and the plots `{out}/accuracy_vs_cpu.png`, `{out}/accuracy_vs_trajectories.png`,
`{out}/accuracy_vs_scored.png`, `{out}/reward_vs_trajectories.png` (the trained reward: a proxy's rise beside a falling accuracy is hacking) and
`{out}/accuracy_vs_reward.png` (the two against each other, evaluation by evaluation) from the run folders alone. Columns: docs/results.md, "The comparison harness".
Before a grid it times the machine (`speed_probe`, 10 toy forwards on one thread, in every harness.json): a CPU
second is not the same work on every machine, and a table mixing runs from machines of different speed says so.
"""

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.plumbing.checks import ConfigError, Rule, check_ranges, read_json  # noqa: E402
from common.plumbing.utils import read_metrics_lines  # noqa: E402

SCRIPTS = {
    "flowgrpo_baseline": "flowgrpo_baseline.py",
    "g2rpo": "g2rpo.py",
    "densegrpo": "densegrpo.py",
    "diffusionnft": "diffusionnft.py",
    "awm": "awm.py",
    "yardstick": "benchmarks/yardstick_raft.py",
}
ALGOS = tuple(SCRIPTS)
START = "start"  # the seed slot of the zero-iteration run that evaluates the starting model
# counter -> column name
BUDGETS = {
    "trajectories": "trajectories",
    "scored_images": "scored images",
}


# ------------------------------------------------------------------------------------------------ statistics
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1, a - 1
    c, d = 1.0, 1 - qab * x / qap
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((qam + 2 * m) * (a + 2 * m)),
            -(a + m) * (qab + m) * x / ((a + 2 * m) * (qap + 2 * m)),
        ):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom: 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2 for t > 0."""
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on t_cdf; |error| < 1e-10)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2


def mean_ci(xs: list[float], level: float = 0.95) -> tuple[float, float | None, float | None]:
    """(mean, low, high): the t-interval mean +- t_{(1+level)/2, n-1} s / sqrt(n) over seeds (None for n < 2)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, None, None
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * s / math.sqrt(n)
    return m, m - half, m + half


def welch_ci(
    xs: list[float], ys: list[float], level: float = 0.95
) -> tuple[float, float | None, float | None]:
    """(d, low, high) for d = mean(xs) - mean(ys): Welch's t-interval (unequal variances, Welch-Satterthwaite df)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    if len(xs) < 2 or len(ys) < 2:
        return mx - my, None, None
    vx, vy = (
        sum((v - m) ** 2 for v in vs) / (len(vs) - 1) / len(vs) for vs, m in ((xs, mx), (ys, my))
    )
    if vx + vy == 0:
        return mx - my, mx - my, mx - my
    df = (vx + vy) ** 2 / (vx**2 / (len(xs) - 1) + vy**2 / (len(ys) - 1))
    half = t_quantile((1 + level) / 2, df) * math.sqrt(vx + vy)
    return mx - my, mx - my - half, mx - my + half


def seeds_for_se(target: float, counts: dict[str, int]) -> int:
    """Fewest seeds per prompt S with SE(eval/accuracy) <= target at p = 0.5 in every category, where
    eval/accuracy = mean over the C categories, so SE^2 = sum_c 0.25 / (n_c S) / C^2 (n_c = prompts of c)."""
    var1 = sum(0.25 / n for n in counts.values()) / len(counts) ** 2
    return math.ceil(var1 / target**2 - 1e-12)


# ------------------------------------------------------------------------------------------------ run folders
def run_name(algo: str, variant: str, seed) -> str:
    return f"{algo}__{variant}__{seed}"


def read_rows(run_dir: str) -> list[dict]:
    """A run's metrics rows; a last line cut by a kill is not a row (common/plumbing/utils.py, as a resume reads them)."""
    return read_metrics_lines(os.path.join(run_dir, "metrics.jsonl"))[0]


def is_finished(run_dir: str) -> bool:
    return any(r.get("final") for r in read_rows(run_dir))


def eval_points(rows: list[dict], trajectories_per_iteration: int = 0) -> list[dict]:
    """Every evaluation of a run, placed at what the run had consumed when it was made. A row's evaluation runs
    at the start of its iteration, before that iteration's training, so its counters are the previous row's.
    Logs written before 2026-12-03 have one counter, `images`, which counted the scored images (completions and
    branches included); their trajectories are iterations x trajectories_per_iteration (prompts x G, args.json)."""
    out, prev = [], {}
    for r in rows:
        if "eval/accuracy" in r:
            # nfe: training forwards
            out.append(
                {
                    "iteration": r["iteration"],
                    "acc": r["eval/accuracy"],
                    "se": r.get("eval/accuracy_se"),
                    "reward": r.get("eval/reward_mean"),
                    "cats": {
                        k[len("eval/accuracy_") :]: v
                        for k, v in r.items()
                        if k.startswith("eval/accuracy_") and k != "eval/accuracy_se"
                    },
                    "cpu_s": prev.get("time/cpu_s", 0.0),
                    "trajectories": prev.get(
                        "trajectories", r["iteration"] * trajectories_per_iteration
                    ),
                    "scored_images": prev.get("scored_images", prev.get("images", 0)),
                    "nfe": prev.get("nfe", 0),
                    "final": bool(r.get("final")),
                }
            )
        prev = r
    return out


def _read_json(path: str) -> dict:
    """A run's args.json or harness.json: an object, else one line naming the file."""
    try:
        return read_json(path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} cannot be read ({e}): restore it, or move that run folder out"
        ) from None


def summarize(run_dir: str) -> dict | None:
    """The numbers of one finished run (None if it has no final row)."""
    per_iteration, eval_prompts = 0, "?"
    if os.path.exists(os.path.join(run_dir, "args.json")):
        a = _read_json(os.path.join(run_dir, "args.json"))
        per_iteration = a.get("groups_per_iteration", 0) * a.get("group_size", 0)
        eval_prompts = os.path.basename(a.get("eval_prompts", "?"))
    pts = eval_points(read_rows(run_dir), per_iteration)
    if not pts or not pts[-1]["final"]:
        return None
    meta = {}
    if os.path.exists(os.path.join(run_dir, "harness.json")):
        meta = _read_json(os.path.join(run_dir, "harness.json"))
    last = pts[-1]
    return {
        "points": pts,
        "final": last,
        "best": max(p["acc"] for p in pts),
        "iterations": last["iteration"],
        "nfe_train": last["nfe"],
        "meta": meta,
        "eval_prompts": eval_prompts,
    }


def collect(out: str, merge: tuple = ()) -> dict:
    """{(algo, variant): {"start": summary or None, "seeds": {seed: summary}}} of every finished run in `out` and in
    the `merge` folders (grids made in several places report as one; a run found twice is an error)."""
    groups, where = {}, {}
    for folder in (out, *merge):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            parts = name.split("__")
            if (
                len(parts) != 3
                or parts[0] not in SCRIPTS
                or not os.path.isdir(os.path.join(folder, name))
            ):
                continue
            s = summarize(os.path.join(folder, name))
            if s is None:
                continue
            if name in where:
                raise ConfigError(
                    f"run {name} is in both {where[name]} and {folder}: keep one (--merge reports each run once)"
                )
            where[name] = folder
            g = groups.setdefault((parts[0], parts[1]), {"start": None, "seeds": {}})
            if parts[2] == START:
                g["start"] = s
            elif parts[2].isdigit():
                g["seeds"][int(parts[2])] = s
    return groups


def accuracy_at(points: list[dict], key: str, x: float) -> float | None:
    """A run's accuracy at `x` of `key` (e.g. trajectories), linear between its evaluations; None beyond its last."""
    for a, b in zip(points, points[1:]):
        if a[key] <= x <= b[key]:
            return (
                a["acc"]
                if b[key] == a[key]
                else a["acc"] + (b["acc"] - a["acc"]) * (x - a[key]) / (b[key] - a[key])
            )
    return None


# ------------------------------------------------------------------------------------------------ report
def fmt_ci(m, lo, hi) -> str:
    return f"{m:+.3f}" if lo is None else f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def parallel(meta: dict) -> str:
    """ "jobs x threads, OpenMP wait policy" of a run, from its harness.json."""
    return f"{meta.get('jobs', '?')} x {meta.get('threads', '?')}, {meta.get('omp_wait_policy', '?').lower()}"


def load_text(meta: dict) -> str:
    """Mean (max) of the 1-minute load average sampled while the run ran, or — (runs from before 2026-12-01)."""
    load = meta.get("load") or []
    return f"{sum(load) / len(load):.1f} ({max(load):.1f})" if load else "—"


def probe_text(meta: dict) -> str:
    """The run's speed probe in CPU seconds, or — (runs from before 2026-12-02, or a failed probe)."""
    return f"{meta['speed_probe_cpu_s']:.2f}" if meta.get("speed_probe_cpu_s") else "—"


def busy(meta: dict) -> bool:
    """Did other work share the machine? Its own jobs x threads explain a load up to about that number; measured
    2026-12-01 on the 2-core machine: 31.7 CPU s per iteration with two harness runs alone (load ~2), 39-41 with
    a third busy process (load ~2.7-3): other processes cost CPU seconds, not only wall time."""
    load = meta.get("load") or []
    return bool(load) and sum(load) / len(load) > meta.get("jobs", 1) * meta.get("threads", 1) + 0.5


def report(out: str, merge: tuple = (), reference: str | None = None, only: tuple = ()) -> str:
    """Write {out}/results.md and the two plots from the finished run folders; return the markdown. `reference`
    "algo:variant" adds each group's gain minus the reference group's, with Welch's 95 % interval; `only` keeps
    just these "algo:variant" groups (a verdict table out of a folder of screens)."""
    groups = collect(out, merge)
    if not groups:  # a misspelled folder, or a grid none of whose runs finished: no empty table
        raise ConfigError(
            f"no finished run in {', '.join([out, *merge])}: nothing to report (a run folder is "
            "named algorithm__variant__seed and holds a metrics.jsonl with a final row)"
        )
    missing = [o for o in only if tuple(o.split(":", 1)) not in groups]
    if missing:
        raise ConfigError(
            f"--only {' '.join(missing)}: no such group among {sorted(':'.join(k) for k in groups)}"
        )
    groups = {k: g for k, g in groups.items() if not only or ":".join(k) in only}
    # a gain is a difference of two evaluations on one prompt set: a table never mixes validation and test
    splits = {
        s["eval_prompts"] for g in groups.values() for s in [g["start"], *g["seeds"].values()] if s
    }
    if len(splits) > 1:
        raise ConfigError(
            f"the runs were evaluated on different prompt files ({', '.join(sorted(splits))}): report "
            "them apart (--only, or separate --out folders)"
        )
    ref = tuple(reference.split(":", 1)) if reference else None
    if ref is not None and ref not in groups:
        raise ConfigError(
            f"--reference {reference}: no such group among {sorted(':'.join(k) for k in groups)}"
        )
    # Equal budgets: every run's accuracy where the run that consumed the fewest trajectories (scored images) ended,
    # read off its curve of periodic evaluations (2 seeds per prompt) and against its own first evaluation.
    equal = {
        k: min([s["final"][k] for g in groups.values() for s in g["seeds"].values()] or [0])
        for k in BUDGETS
    }
    cats = []
    for g in groups.values():
        for s in [g["start"], *g["seeds"].values()]:
            cats += [c for c in (s["final"]["cats"] if s else {}) if c not in cats]
    head = [
        "algorithm",
        "variant",
        "seeds",
        "start (SE)",
        "final",
        "gain [95 % CI]",
        *[f"gain {c}" for c in cats],
        "reward gain [95 % CI]",
        *([f"gain − {':'.join(ref)}'s (Welch 95 % CI)"] if ref else []),
        *[f"gain at {equal[k]} {BUDGETS[k]} (periodic evals)" for k in BUDGETS],
        "final-eval SE",
        "iterations",
        *BUDGETS.values(),
        "NFE (training)",
        "CPU s in loop",
        "CPU s process",
        "jobs x threads, OMP wait",
        "best eval − start (beside the last, biased up)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    per_run = [
        "| algorithm | variant | seed | iterations | start | final | gain | final-eval SE | best | trajectories "
        "| scored images | NFE (training) | CPU s in loop | CPU s / iteration | CPU s process | jobs x threads, "
        "OMP wait | load mean (max) | speed probe CPU s |",
        "|" + "---|" * 18,
    ]
    commands, notes = set(), []
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731

    def gains_of(g):
        """The group's runs, its start evaluation, each run's start (no start run: its own first, periodic
        evaluation, fewer seeds) and each run's gain."""
        runs = [g["seeds"][k] for k in sorted(g["seeds"])]
        start = g["start"]["final"] if g["start"] else None
        st = [start or s["points"][0] for s in runs]
        return runs, start, st, [s["final"]["acc"] - b["acc"] for s, b in zip(runs, st)]

    for (algo, variant), g in sorted(
        groups.items(), key=lambda kv: (ALGOS.index(kv[0][0]), kv[0][1])
    ):
        runs, start, st, gains = gains_of(g)
        for s in [g["start"], *runs]:
            if s and s["meta"].get("command"):
                commands.add(s["meta"]["command"])
        if not runs:
            continue
        if start is None:
            notes.append(
                f"{algo} {variant}: no start run; gains are against each run's first evaluation"
            )
        vs_ref = (
            []
            if ref is None
            else [
                "—"
                if (algo, variant) == ref
                else fmt_ci(*welch_ci(gains, gains_of(groups[ref])[3]))
            ]
        )
        cat_gains = [
            fmt_ci(*mean_ci([s["final"]["cats"][c] - b["cats"][c] for s, b in zip(runs, st)]))
            if all(c in s["final"]["cats"] and c in b["cats"] for s, b in zip(runs, st))
            else "—"
            for c in cats
        ]
        # the training reward on the held-out prompts: beside the accuracy it shows a proxy reward that rises while
        # the strict verdict falls, which is reward hacking
        rew = [(s["final"]["reward"], b["reward"]) for s, b in zip(runs, st)]
        rew_txt = "—" if any(None in r for r in rew) else fmt_ci(*mean_ci([f - b for f, b in rew]))
        at_txt = []
        for k in BUDGETS:
            at = [accuracy_at(s["points"], k, equal[k]) for s in runs]
            at_txt.append(
                "—"
                if None in at
                else fmt_ci(*mean_ci([a - s["points"][0]["acc"] for a, s in zip(at, runs)]))
            )
        ses = [s["final"]["se"] for s in runs if s["final"]["se"] is not None]
        par = sorted({parallel(s["meta"]) for s in runs})
        proc = [
            s["meta"]["process_cpu_s"] for s in runs if s["meta"].get("process_cpu_s") is not None
        ]
        start_txt = (
            "—"
            if start is None
            else f"{start['acc']:.3f} ({start['se']:.3f})"
            if start["se"] is not None
            else f"{start['acc']:.3f}"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    algo,
                    variant,
                    str(len(runs)),
                    start_txt,
                    f"{mean([s['final']['acc'] for s in runs]):.3f}",
                    fmt_ci(*mean_ci(gains)),
                    *cat_gains,
                    rew_txt,
                    *vs_ref,
                    *at_txt,
                    f"{mean(ses):.3f}" if ses else "—",
                    f"{mean([s['iterations'] for s in runs]):.0f}",
                    *[f"{mean([s['final'][k] for s in runs]):.0f}" for k in BUDGETS],
                    f"{mean([s['nfe_train'] for s in runs]):.0f}",
                    f"{mean([s['final']['cpu_s'] for s in runs]):.0f}",
                    f"{mean(proc):.0f}" if proc else "—",
                    ", ".join(par),
                    fmt_ci(*mean_ci([s["best"] - b["acc"] for s, b in zip(runs, st)])),
                ]
            )
            + " |"
        )
        for seed, s, b in zip(sorted(g["seeds"]), runs, st):
            f = s["final"]
            per_run.append(
                f"| {algo} | {variant} | {seed} | {s['iterations']} | {b['acc']:.3f} | {f['acc']:.3f} | "
                f"{f['acc'] - b['acc']:+.3f} | {'—' if f['se'] is None else format(f['se'], '.3f')} | "
                f"{s['best']:.3f} | {f['trajectories']} | {f['scored_images']} | {s['nfe_train']} | "
                f"{f['cpu_s']:.0f} | "
                f"{f['cpu_s'] / max(s['iterations'], 1):.1f} | "
                f"{s['meta'].get('process_cpu_s', float('nan')):.0f} | "
                f"{parallel(s['meta'])} | {load_text(s['meta'])} | "
                f"{probe_text(s['meta'])} |"
            )
            if busy(s["meta"]):
                flags = s["meta"].get("flags", [])  # --cpu-budget-s 0: a fixed number of iterations
                fixed = (
                    "--cpu-budget-s" in flags and flags[flags.index("--cpu-budget-s") + 1] == "0"
                )
                notes.append(
                    f"{algo} {variant} seed {seed} ran on a busy machine (load {load_text(s['meta'])} for "
                    f"{s['meta'].get('jobs')} x {s['meta'].get('threads')} threads of its own): "
                    + (
                        "its iterations were fixed, so only its CPU seconds are inflated"
                        if fixed
                        else "other work costs CPU seconds per iteration too, so its budget bought fewer iterations"
                    )
                )
    spread = speed_spread([s["meta"] for g in groups.values() for s in g["seeds"].values()])
    if spread:
        notes.insert(0, spread)
    md = [
        f"# Comparison at an equal budget (report written {datetime.date.today().isoformat()})",
        "",
        "Runs made by:",
        "",
        *[f"    {c}" for c in sorted(commands)],
        "",
        f"Evaluated on: {', '.join(sorted(splits)) or '?'} (prompts_val.txt: validation, for choosing; "
        "prompts_test.txt: test, the headline).",
        "",
        "Budget: CPU seconds per run, or a number of iterations (`--iterations`; see the commands). "
        "gain = final − start accuracy, mean over seeds with a 95 % t-interval; start = the starting model evaluated "
        "with the final evaluation's seeds. 'CPU s in loop' = the run's CPU seconds (all threads) when it stopped "
        "training, what the budget limits; 'CPU s process' = the whole process (imports, model load, setup, final "
        "evaluation). Trajectories (images the policy sampled to the end), scored images (every image a reward "
        "scored for training: DenseGRPO's completions and G²RPO's branches included) and NFE are the means at the "
        "final evaluation; NFE (training) excludes evaluation. "
        f"'gain at {equal['trajectories']} trajectories' ('... scored images'): where the run with the fewest ended, "
        "each run's accuracy read off its periodic evaluations (2 seeds per prompt, SE ~0.035; linear in between, "
        "its final evaluation the last point) minus its first, mean over seeds with a 95 % t-interval.",
        "",
        *lines,
        "",
        *[f"- {n}" for n in notes],
        "",
        "Per run:",
        "",
        *per_run,
        "",
        "![accuracy vs CPU seconds](accuracy_vs_cpu.png) ![accuracy vs trajectories](accuracy_vs_trajectories.png) "
        "![accuracy vs scored images](accuracy_vs_scored.png) "
        "![trained reward vs trajectories](reward_vs_trajectories.png) "
        "![accuracy vs trained reward](accuracy_vs_reward.png)",
        "",
    ]
    text = "\n".join(md)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    for key, label in (
        ("cpu_s", "CPU seconds in the training loop (all threads)"),
        ("trajectories", "trajectories (images the policy sampled to the end)"),
        ("scored_images", "scored images (completions and branches included)"),
    ):
        plot(groups, key, label, os.path.join(out, f"accuracy_vs_{key.split('_')[0]}.png"))
    # the trained reward on the held-out prompts beside it: a proxy that rises while the accuracy falls is hacked
    plot(
        groups,
        "trajectories",
        "trajectories",
        os.path.join(out, "reward_vs_trajectories.png"),
        y="reward",
        ylabel="eval/reward_mean (the trained reward, held-out prompts)",
    )
    tradeoff_plot(groups, os.path.join(out, "accuracy_vs_reward.png"))
    return text


def _figure():
    """(pyplot, figure, axes) of one comparison plot, drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    return plt, fig, ax


def _save(plt, fig, ax, path: str, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(
    groups: dict,
    key: str,
    xlabel: str,
    path: str,
    y: str = "acc",
    ylabel: str = "eval/accuracy (held-out, strict)",
) -> None:
    """`y` (an evaluation point's "acc" or "reward") against `key`: every seed faint, the mean over seeds bold
    (interpolated on the range that every seed covers), one colour per (algorithm, variant)."""
    import numpy as np

    plt, fig, ax = _figure()
    for i, ((algo, variant), g) in enumerate(sorted(groups.items())):
        runs = [g["seeds"][k] for k in sorted(g["seeds"])]
        if not runs:
            continue
        colour = plt.cm.tab10(i % 10)
        curves = [
            (
                np.array([p[key] for p in s["points"]], float),
                np.array([np.nan if p[y] is None else p[y] for p in s["points"]], float),
            )
            for s in runs
        ]
        for xs, ys in curves:
            ax.plot(xs, ys, color=colour, alpha=0.25, lw=1)
            # the final (many-seed) evaluation
            ax.plot(xs[-1:], ys[-1:], "o", color=colour, alpha=0.4, ms=3)
        end = min(xs[-1] for xs, _ in curves)
        grid = np.linspace(0, end, 50) if end > 0 else np.zeros(1)
        ax.plot(
            grid,
            np.mean([np.interp(grid, xs, ys) for xs, ys in curves], 0),
            color=colour,
            lw=2.5,
            label=f"{algo} {variant} ({len(runs)} seeds)",
        )
    _save(
        plt,
        fig,
        ax,
        path,
        xlabel,
        ylabel,
        "faint: each seed (dot: its final evaluation); bold: mean over seeds",
    )


def tradeoff_plot(groups: dict, path: str) -> None:
    """Held-out accuracy against the trained reward on the same held-out evaluations, one path per run from its
    first evaluation to its last: the exchange rate between the reward and the task. A knob that only slows the
    optimisation moves along the same path; one that protects the task bends it upwards. Every seed faint, the mean
    over seeds of each evaluation (the ones every seed made) bold, its start and end marked."""
    import numpy as np

    plt, fig, ax = _figure()
    for i, ((algo, variant), g) in enumerate(sorted(groups.items())):
        runs = [g["seeds"][k] for k in sorted(g["seeds"])]
        paths = [
            np.array(
                [(p["reward"], p["acc"]) for p in s["points"] if p["reward"] is not None], float
            )
            for s in runs
        ]
        paths = [q for q in paths if len(q)]
        if not paths:
            continue
        colour = plt.cm.tab10(i % 10)
        for q in paths:
            ax.plot(q[:, 0], q[:, 1], color=colour, alpha=0.25, lw=1)
        n = min(len(q) for q in paths)
        mean = np.mean([q[:n] for q in paths], 0)
        ax.plot(
            mean[:, 0],
            mean[:, 1],
            "-o",
            color=colour,
            lw=2.5,
            ms=4,
            label=f"{algo} {variant} ({len(paths)} seeds)",
        )
        ax.plot(mean[-1:, 0], mean[-1:, 1], "s", color=colour, ms=8)  # the final evaluation
    _save(
        plt,
        fig,
        ax,
        path,
        "eval/reward_mean (the trained reward, held-out prompts)",
        "eval/accuracy (held-out, strict)",
        "each evaluation of a run, first to last (square: the final one); faint: each seed; bold: mean",
    )


# ------------------------------------------------------------------------------------------------ running
def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """ "name=--flag value --flag2 value" -> {name: [flags]}; no spec -> one variant "default"."""
    out = {}
    for s in specs:
        name, sep, flags = s.partition("=")
        if (
            not sep
            or not name
            or "__" in name
            or not name.replace("-", "").replace(".", "").replace("_", "").isalnum()
        ):
            raise ConfigError(
                f"--variants '{s}': expected NAME=FLAGS with NAME of letters, digits, '.', '-', single "
                "'_' (it names the run folders), e.g. \"lr1e-4=--learning-rate 1e-4\""
            )
        out[name] = flags.split()
    return out or {"default": []}


def plan(args, variants: dict[str, list[str]], final_seeds: int) -> list[dict]:
    """Every run of the grid: the start runs first, then seed by seed (a partial grid stays balanced)."""
    runs = []
    for seed in [START, *args.seeds]:
        for algo in args.algos:
            for variant, flags in variants.items():
                script = (
                    os.path.join(args.script_dir, os.path.basename(SCRIPTS[algo]))
                    if args.script_dir
                    else os.path.join(ROOT, SCRIPTS[algo])
                )
                budget = (
                    ["--num-iterations", "0", "--cpu-budget-s", "0"]
                    if seed == START
                    else ["--num-iterations", str(args.iterations), "--cpu-budget-s", "0"]
                    if args.iterations
                    else ["--num-iterations", "100000", "--cpu-budget-s", str(args.cpu_seconds)]
                )
                flags_all = [
                    "--seed",
                    str(1 if seed == START else seed),
                    *budget,
                    "--eval-every",
                    str(args.eval_every),
                    "--save-every",
                    "100000",
                    "--eval-seeds-per-prompt",
                    str(args.eval_seeds_per_prompt),
                    "--final-eval-seeds-per-prompt",
                    str(final_seeds),
                    *(["--eval-prompts", split_file(args.split)] if args.split != "test" else []),
                    *flags,
                    *args.extra,
                    # the start run evaluates the starting model: last, so no variant's flag makes it train
                    *(["--num-iterations", "0"] if seed == START else []),
                ]
                runs.append(
                    {
                        "name": run_name(algo, variant, seed),
                        "algo": algo,
                        "variant": variant,
                        "seed": seed,
                        "script": script,
                        "flags": flags_all,
                    }
                )
    return runs


def check_kept_run(out: str, run: dict) -> None:
    """A finished run is reused only if it was made with the same flags: else the table would mix budgets."""
    path = os.path.join(out, run["name"], "harness.json")
    if os.path.exists(path):
        old = _read_json(path).get("flags")
        if old is not None and old != run["flags"]:
            raise ConfigError(
                f"{out}/{run['name']} is finished but was made with other flags ({' '.join(old)}) than "
                f"this grid asks for ({' '.join(run['flags'])}); use another --out or delete that folder"
            )


def run_env(threads: int) -> dict:
    """The environment of every process the harness starts: the runs and the speed probe."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        # Waiting OpenMP threads sleep instead of spinning: spinning is counted as CPU time, 5-10x the work
        # on a shared machine (docs/results.md, "The comparison harness"), and would make budgets unequal.
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    }


def launch(
    out: str, run: dict, threads: int, jobs: int, command: str, probe: float | None = None
) -> subprocess.Popen:
    run_dir = os.path.join(out, run["name"])
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run starts again from nothing
    os.makedirs(run_dir)
    env = run_env(threads)
    cmd = [
        sys.executable,
        run["script"],
        "--output-dir",
        out,
        "--run-name",
        run["name"],
        *run["flags"],
    ]
    meta = {
        "flags": run["flags"],
        "threads": threads,
        "jobs": jobs,
        "omp_wait_policy": env["OMP_WAIT_POLICY"],
        "command": command,
        "speed_probe_cpu_s": probe,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    with open(os.path.join(run_dir, "harness.json"), "w") as f:
        json.dump(meta, f, indent=1)
    log = open(os.path.join(run_dir, "stdout.log"), "w")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    p.run, p.meta, p.t0, p.log = run, meta, time.time(), log
    return p


def reap(p: subprocess.Popen) -> bool:
    """True once `p` has exited; records its exit code and its whole-process CPU seconds (os.wait4's rusage)."""
    pid, status, usage = os.wait4(p.pid, os.WNOHANG)
    if pid == 0:
        return False
    p.returncode = os.waitstatus_to_exitcode(status)
    p.meta.update(
        returncode=p.returncode,
        process_cpu_s=usage.ru_utime + usage.ru_stime,
        wall_s=time.time() - p.t0,
        ended=datetime.datetime.now().isoformat(timespec="seconds"),
    )
    p.log.close()
    return True


PROBE_CALLS = 10


def probe_workload(calls: int = PROBE_CALLS) -> float:
    """CPU seconds of `calls` forwards of the toy transformer at batch 64 (one warm-up first): the machine's speed.
    A CPU-seconds budget is equal work only on one machine: the same G2RPO iteration took 45.9 CPU s on the machine
    of 2026-12-01 and 86.3 on that of 2026-12-02 (docs/results.md), so every run records this number."""
    import torch

    from common.backbones import load_backbone

    torch.manual_seed(0)
    bb = load_backbone(os.path.join(ROOT, "common", "toyworld", "model"), "cpu")
    emb, x = bb.encode(["a photo of a red circle"] * 64), bb.initial_noise(64, 32, 32)
    with torch.no_grad():
        bb.velocity(x, 0.5, emb)
        t0 = time.process_time()
        for _ in range(calls):
            bb.velocity(x, 0.5, emb)
    return time.process_time() - t0


def speed_probe() -> float | None:
    """probe_workload() in a fresh process with one thread and the runs' environment; None if it fails."""
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--probe-only"],
        env=run_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    try:
        return float(p.stdout.split()[-1])
    except (IndexError, ValueError):
        print(f"speed probe failed (exit {p.returncode}): {p.stderr.strip()[-300:]}", flush=True)
        return None


def speed_spread(metas: list[dict]) -> str | None:
    """A warning when the runs of one table were made on machines of different speed (probe CPU s differing by
    more than 15 %): their CPU-seconds budgets are then not the same work."""
    probes = [m["speed_probe_cpu_s"] for m in metas if m.get("speed_probe_cpu_s")]
    if len(probes) < 2 or max(probes) <= 1.15 * min(probes):
        return None
    return (
        f"the runs' speed probes range from {min(probes):.2f} to {max(probes):.2f} CPU s ({PROBE_CALLS} toy "
        "forwards): they were made on machines of different speed, so equal CPU seconds are not equal work; "
        "compare runs with similar probes, at equal trajectories, or made with --iterations"
    )


def run_grid(
    out: str,
    runs: list[dict],
    jobs: int,
    threads: int,
    max_wall_s: float,
    command: str,
    probe: float | None = None,
) -> list[str]:
    """Run what is not finished, `jobs` at a time; return the names of runs that failed. `probe`: this machine's
    speed_probe(), recorded in every run's harness.json."""
    todo = []
    for r in runs:
        if is_finished(os.path.join(out, r["name"])):
            check_kept_run(out, r)
            print(f"kept     {r['name']} (finished)")
        else:
            todo.append(r)
    failed, active, last_load = [], [], 0.0
    try:
        while todo or active:
            while todo and len(active) < jobs:
                active.append(launch(out, todo.pop(0), threads, jobs, command, probe))
                print(f"started  {active[-1].run['name']}", flush=True)
            time.sleep(0.2)
            if (
                time.time() - last_load > 5
            ):  # the machine's load: other work inflates CPU seconds per iteration
                last_load, load = time.time(), os.getloadavg()[0]
                for p in active:
                    p.meta.setdefault("load", []).append(round(load, 2))
            for p in list(active):
                if time.time() - p.t0 > max_wall_s and not p.meta.get("killed"):
                    print(
                        f"killing  {p.run['name']}: over --max-wall-s {max_wall_s:.0f}", flush=True
                    )
                    # not p.kill(): its poll() would reap the child before reap()
                    os.kill(p.pid, signal.SIGKILL)
                    p.meta["killed"] = True
                if not reap(p):
                    continue
                active.remove(p)
                run_dir = os.path.join(out, p.run["name"])
                with open(os.path.join(run_dir, "harness.json"), "w") as f:
                    json.dump(p.meta, f, indent=1)
                ok = p.returncode == 0 and is_finished(run_dir)
                print(
                    f"{'finished' if ok else 'FAILED  '} {p.run['name']} ({p.meta['wall_s']:.0f} s"
                    f"{'' if ok else f', exit {p.returncode}, see {run_dir}/stdout.log'})",
                    flush=True,
                )
                if not ok:
                    failed.append(p.run["name"])
    finally:  # Ctrl-C: stop the children; their folders are unfinished and start again next time
        for p in active:
            p.kill()
            p.wait()
    return failed


def split_file(split: str) -> str:
    """The evaluation prompt file of a --split, relative to the repository (the runs' working folder)."""
    from common import toyworld

    return os.path.relpath(toyworld.VAL_FILE if split == "validation" else toyworld.TEST_FILE, ROOT)


def eval_prompt_counts(split: str = "test") -> dict[str, int]:
    from common import toyworld

    counts = {}
    for p in toyworld.load_prompts(split_file(split)):
        counts[toyworld.category_of(p)] = counts.get(toyworld.category_of(p), 0) + 1
    return counts


# The other numbers, each in one line as the training scripts' flags are (common/plumbing/checks.py).
FLAG_RANGES = {
    "seeds": Rule(0, 2**32 - 1, integer=True, why="numpy's seeds are 32-bit"),
    "eval_every": Rule(1, integer=True, why="iterations between the periodic evaluations"),
    "eval_seeds_per_prompt": Rule(1, integer=True, why="seeds per test prompt"),
    "max_wall_s": Rule(0, lo_open=True, optional=True, allow_inf=True, why="seconds; inf = none"),
}


def check_paths(args) -> None:
    """--out a folder (or nothing yet), every --merge and --script-dir an existing folder; with
    --report-only, --out must exist: a misspelled one reported nothing and exited 0."""
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(
            f"--out {args.out} is a file: pass a folder (it holds the runs and the table)"
        )
    if args.report_only and not os.path.isdir(args.out):
        raise ConfigError(
            f"--report-only --out {args.out} does not exist: pass the folder the grid was run in"
        )
    for flag, folders in (
        ("--merge", args.merge),
        ("--script-dir", [args.script_dir] * bool(args.script_dir)),
    ):
        missing = [f for f in folders if not os.path.isdir(f)]
        if missing:
            raise ConfigError(
                f"{flag} {missing[0]} is not a folder: pass a folder that holds run folders"
            )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    ap.add_argument(
        "--cpu-seconds",
        type=float,
        default=1200.0,
        help="training budget of every run in process CPU seconds, all threads (1200 = 10 min on 2 cores)",
    )
    ap.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="instead of the CPU budget, a fixed number of iterations per run (equal trajectories, not equal "
        "CPU: for curves read per iteration, e.g. the reward-hacking lab)",
    )
    ap.add_argument(
        "--split",
        choices=("test", "validation"),
        default="test",
        help="evaluation prompts: validation for screens and choosing defaults, test once for the headline",
    )
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads per run (default: 2 with --jobs 1, else 1)",
    )
    ap.add_argument(
        "--final-se",
        type=float,
        default=0.02,
        help="the final evaluation gets enough seeds per test prompt for this standard error at p = 0.5",
    )
    ap.add_argument(
        "--eval-every", type=int, default=10, help="iterations between the periodic evaluations"
    )
    ap.add_argument(
        "--eval-seeds-per-prompt",
        type=int,
        default=2,
        help="seeds per test prompt, periodic evaluations",
    )
    ap.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help='flag sets, e.g. "lr1e-4=--learning-rate 1e-4" (default: one variant, the defaults)',
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "compare"))
    ap.add_argument(
        "--script-dir",
        default=None,
        help="take every script's file name from this folder instead (tests use stub scripts)",
    )
    ap.add_argument(
        "--max-wall-s",
        type=float,
        default=None,
        help="kill a run after this many wall-clock seconds (default: 4 x budget / threads + 3600; "
        "none with --iterations, whose runs the CPU budget does not bound)",
    )
    ap.add_argument(
        "--report-only", action="store_true", help="only rebuild the table and plots from --out"
    )
    ap.add_argument(
        "--reference",
        default=None,
        metavar="ALGO:VARIANT",
        help="add every group's gain minus this group's, with Welch's 95 %% interval",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="ALGO:VARIANT",
        help="with --report-only: report just these groups",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="DIR",
        help="with --report-only: also report the finished runs in these folders (the table goes to --out)",
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="print the runs and their commands, run nothing"
    )
    ap.add_argument(
        "--no-speed-probe",
        action="store_true",
        help="skip timing the machine before the grid (speed_probe_cpu_s in every harness.json)",
    )
    # speed_probe()'s child process
    ap.add_argument("--probe-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="flags for every script (after --)")
    args = ap.parse_args(argv)
    if args.probe_only:
        print(f"{probe_workload():.3f}")
        return
    threads = args.threads or (2 if args.jobs == 1 else 1)
    if not all(
        rule.ok(v)
        for rule, v in (
            (Rule(1, integer=True), args.jobs),
            (Rule(1, integer=True), threads),
            (Rule(0, lo_open=True), args.cpu_seconds),  # nan and inf too: a budget that never ends
            (Rule(0, 0.5, lo_open=True, hi_open=True), args.final_se),
            (Rule(1, integer=True, optional=True), args.iterations),
        )
    ):
        raise ConfigError(
            f"--jobs {args.jobs} / --threads {threads} / --cpu-seconds {args.cpu_seconds} / --final-se "
            f"{args.final_se} / --iterations {args.iterations}: need jobs and threads >= 1, a positive "
            "finite budget, 0 < final-se < 0.5 and iterations >= 1 (or none)"
        )
    check_ranges(args, FLAG_RANGES)
    check_paths(args)
    variants = parse_variants(args.variants)
    if not args.report_only:
        final_seeds = seeds_for_se(args.final_se, eval_prompt_counts(args.split))
        runs = plan(args, variants, final_seeds)
        print(
            f"{len(runs)} runs; final evaluation: {final_seeds} seeds per {args.split} prompt (SE <= {args.final_se} at "
            f"p = 0.5); {args.jobs} at a time, {threads} thread(s) each"
        )
        if args.dry_run:
            for r in runs:
                print(r["name"], " ".join([r["script"], *r["flags"]]))
            return
        os.makedirs(args.out, exist_ok=True)
        max_wall = args.max_wall_s or (
            math.inf if args.iterations else 4 * args.cpu_seconds / threads + 3600
        )
        command = shlex.join(
            ["python", "benchmarks/bench_compare.py", *(sys.argv[1:] if argv is None else argv)]
        )
        probe = None if args.no_speed_probe else speed_probe()
        if probe is not None:
            print(
                f"speed probe: {probe:.2f} CPU s for {PROBE_CALLS} toy forwards at batch 64, one thread",
                flush=True,
            )
        failed = run_grid(args.out, runs, args.jobs, threads, max_wall, command, probe)
        if failed:
            print(
                f"{len(failed)} run(s) failed (they start again on the next call): {', '.join(failed)}"
            )
    print(report(args.out, tuple(args.merge), args.reference, tuple(args.only)))


if __name__ == "__main__":
    main()
