"""Benchmark (not a test): the three algorithms on the toy world, several seeds, same wall-clock budget.

    python tests/bench_compare.py --minutes 10 --seeds 1 --algos flowgrpo_baseline   # issue: CPU, 10 minutes
    python tests/bench_compare.py --minutes 5 --seeds 1 2 3 --parallel 9             # all three, 3 seeds (GPU)
    python tests/bench_compare.py --report-only --out runs/bench                     # redo table and plots

Each run is the script with its default (toy-world) flags, `--eval-every` set here, killed after `--minutes`.
`eval/accuracy` (strict, 100 held-out prompts x 2 fixed seeds, deterministic ODE) is read from metrics.jsonl
and reported against cumulative NFE and against wall-clock seconds; plots go to `{out}/accuracy_vs_*.png`
(means over seeds) and `{out}/accuracy_per_run.png` (every run against seconds), and a markdown table to
`{out}/results.md`.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.plots import line_plot  # noqa: E402

ALGOS = ("flowgrpo_baseline", "g2rpo", "densegrpo")


def parse_variants(specs):
    """"name=--flag value --flag2 value" -> {name: [flags]}; no spec -> one variant "default"."""
    return {s.split("=", 1)[0]: s.split("=", 1)[1].split() for s in specs} if specs else {"default": []}


def launch(algo, seed, variant, flags, out, eval_every, threads, extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    name = f"{algo}__{variant}__{seed}"
    cmd = [sys.executable, os.path.join(ROOT, f"{algo}.py"), "--seed", str(seed), "--output-dir", out,
           "--run-name", name, "--num-iterations", "100000", "--eval-every", str(eval_every),
           "--save-every", "100000", *flags, *extra]
    log = open(os.path.join(out, f"{name}.log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def load(out, name):
    path = os.path.join(out, name, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a killed run may be cut
                pass
    return rows


def report(out, algos, seeds, variants):
    lines = ["| algorithm | variant | seed | iterations | start acc. | final acc. | best acc. | NFE at final eval | "
             "wall-clock s at final eval |", "|---|---|---|---|---|---|---|---|---|"]
    by_nfe, by_time, by_acc, per_run = {}, {}, {}, {}
    for algo, variant, seed in itertools.product(algos, variants, seeds):
        rows = load(out, f"{algo}__{variant}__{seed}")
        # an eval row is logged before the iteration's training: its NFE/time are the previous row's
        evals, nfe, elapsed = [], 0, 0.0
        for r in rows:
            if "eval/accuracy" in r:
                evals.append((nfe, elapsed, r["eval/accuracy"]))
            nfe, elapsed = r.get("nfe", nfe), r.get("time/elapsed_s", elapsed)
        if not evals:
            continue
        label = f"{algo} {variant}" if len(variants) > 1 else algo
        by_nfe.setdefault(label, []).append([e[0] for e in evals])
        by_time.setdefault(label, []).append([e[1] for e in evals])
        by_acc.setdefault(label, []).append([e[2] for e in evals])
        per_run[f"{label}, seed {seed}"] = ([e[1] for e in evals], [e[2] for e in evals])
        lines.append(f"| {algo} | {variant} | {seed} | {len(rows)} | {evals[0][2]:.3f} | {evals[-1][2]:.3f} | "
                     f"{max(e[2] for e in evals):.3f} | {evals[-1][0]} | {evals[-1][1]:.0f} |")

    def mean_curve(curves):  # mean over seeds, up to the shortest run
        n = min(len(c) for c in curves)
        return [sum(c[i] for c in curves) / len(curves) for i in range(n)]

    by_nfe = {k: (mean_curve(v), mean_curve(by_acc[k])) for k, v in by_nfe.items()}
    by_time = {k: (mean_curve(v), mean_curve(by_acc[k])) for k, v in by_time.items()}
    line_plot(by_nfe, os.path.join(out, "accuracy_vs_nfe.png"), "NFE (cumulative)", "eval/accuracy", "mean over seeds")
    line_plot(by_time, os.path.join(out, "accuracy_vs_wallclock.png"), "seconds", "eval/accuracy", "mean over seeds")
    line_plot(per_run, os.path.join(out, "accuracy_per_run.png"), "seconds", "eval/accuracy", "every run")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of each run")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per run")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench"))
    ap.add_argument("--variants", nargs="*", default=[],
                    help='flag sets to compare, e.g. "lr1e-3=--learning-rate 1e-3" (default: the scripts\' defaults)')
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("extra", nargs="*", help="flags passed to every script (after --)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    variants = parse_variants(args.variants)
    if not args.report_only:
        queue = [(a, s, v, f) for s in args.seeds for a in args.algos for v, f in variants.items()]
        while queue:
            batch, queue = queue[: args.parallel], queue[args.parallel:]
            procs = [launch(a, s, v, f, args.out, args.eval_every, args.threads, args.extra) for a, s, v, f in batch]
            deadline = time.time() + 60 * args.minutes
            while time.time() < deadline and any(p.poll() is None for p in procs):
                time.sleep(2)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait()
    report(args.out, args.algos, args.seeds, list(variants))


if __name__ == "__main__":
    main()
