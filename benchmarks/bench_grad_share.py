"""Benchmark (not a test): where each script's update comes from, step by step, on the toy world.

    python benchmarks/bench_grad_share.py --out runs/grad_share            # the recipes below, 3 iterations each
    python benchmarks/bench_grad_share.py --out runs/grad_share --report-only

Every recipe is one script at its toy defaults plus a few flags, run for --iterations iterations with
`--grad-share-every 1` (common/plumbing/transitions.py GradShare: each trained step's share g_j . g / |g|^2 of the iteration's
gradient, summing to 1; the update itself unchanged). The figure (`{out}/grad_share.png`) shows, per recipe, the mean
share of each trained step over the iterations, and DenseGRPO's dense reward per step (mean |ΔR_t| and the share of
trajectories with ΔR_t = 0), the two things Eq. 10 turns into per-step advantages. The evaluation is cut to the
first four test prompts, one seed: it is not what this measures. Runs are kept and skipped when finished.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_DENSE = [
    "--groups-per-iteration",
    "8",
    "--timestep-fraction",
    "0.99",
    "--completion-steps",
    "None",
]
RECIPES = {  # name -> (script, flags)
    "Flow-GRPO default (steps 0-4)": ("flowgrpo_baseline.py", []),
    "Flow-GRPO default, --ratio-norm guard": ("flowgrpo_baseline.py", ["--ratio-norm", "guard"]),
    "Flow-GRPO, 9 steps": ("flowgrpo_baseline.py", ["--timestep-fraction", "0.99"]),
    "G²RPO default (branches 0-2)": ("g2rpo.py", []),
    "DenseGRPO default (steps 0-4, n = 2)": ("densegrpo.py", []),
    "DenseGRPO default, --ratio-norm guard": ("densegrpo.py", ["--ratio-norm", "guard"]),
    # the default until 2026-12-03 (8 prompts x 8, 9 steps trained, n = t): where issue #36 found the update
    "DenseGRPO old default (9 steps)": ("densegrpo.py", OLD_DENSE),
    "DenseGRPO old default, steps 0-4": (
        "densegrpo.py",
        [*OLD_DENSE, "--timestep-fraction", "0.5"],
    ),
    "DenseGRPO old default, --ratio-norm guard": (
        "densegrpo.py",
        [*OLD_DENSE, "--ratio-norm", "guard"],
    ),
}
DENSE_REWARD = "DenseGRPO old default (9 steps)"  # its dense reward is logged at all 9 steps


def folder(out: str, name: str) -> str:
    return os.path.join(out, "".join(c if c.isalnum() else "_" for c in name).strip("_"))


def run(out: str, iterations: int, threads: int) -> None:
    eval_file = os.path.join(out, "eval4.txt")
    with open(os.path.join(ROOT, "common", "toyworld", "prompts_test.txt")) as f:
        prompts = [line for line in f if line.strip()][:4]
    os.makedirs(out, exist_ok=True)
    with open(eval_file, "w") as f:
        f.writelines(prompts)
    for name, (script, flags) in RECIPES.items():
        run_dir = folder(out, name)
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(metrics) and any(json.loads(line).get("final") for line in open(metrics)):
            print(f"kept     {name}")
            continue
        cmd = [
            sys.executable,
            os.path.join(ROOT, script),
            *flags,
            "--num-iterations",
            str(iterations),
            "--grad-share-every",
            "1",
            "--eval-prompts",
            eval_file,
            "--eval-seeds-per-prompt",
            "1",
            "--save-every",
            "100000",
            "--output-dir",
            out,
            "--run-name",
            os.path.basename(run_dir),
        ]
        if os.path.isdir(run_dir):
            import shutil

            shutil.rmtree(run_dir)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
        print(f"started  {name}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def read(out: str) -> dict:
    """{recipe: {"share": {step: mean}, "dR_abs": {...}, "dR_zero": {...}, "norm": {...}}} over the training rows."""
    result = {}
    for name in RECIPES:
        path = os.path.join(folder(out, name), "metrics.jsonl")
        if not os.path.exists(path):
            continue
        rows = [json.loads(line) for line in open(path) if line.strip()]
        rows = [r for r in rows if not r.get("final")]
        entry = {}
        for key, metric in (
            ("share", "grad_share"),
            ("norm", "grad_norm"),
            ("dR_abs", "dR_abs"),
            ("dR_zero", "dR_zero"),
        ):
            per = {}
            for r in rows:
                for k, v in r.items():
                    if k.startswith(f"steps/{metric}/"):
                        per.setdefault(int(k.rsplit("/", 1)[1]), []).append(v)
            entry[key] = {j: sum(v) / len(v) for j, v in sorted(per.items())}
        entry["iterations"] = len(rows)
        result[name] = entry
    return result


def growth(norms: dict) -> str:
    """How much larger the last trained step's gradient norm is than the first's."""
    v = list(norms.values())
    return f"{v[-1] / v[0]:.0f}x" if v and v[0] > 0 else "—"


def report(out: str) -> str:
    data = read(out)
    lines = [
        "| recipe | iterations | share of steps 0-4 | share of steps 5-8 | share per step (0 = noisiest) "
        "| |g_j|, last trained step / first |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in data.items():
        s = e["share"]
        early, late = sum(v for j, v in s.items() if j <= 4), sum(v for j, v in s.items() if j >= 5)
        lines.append(
            f"| {name} | {e['iterations']} | {early:.2f} | {late:.2f} | "
            + " ".join(f"{j}:{v:+.2f}" for j, v in s.items())
            + f" | {growth(e['norm'])} |"
        )
    dense = data.get(DENSE_REWARD)
    if dense and dense["dR_abs"]:
        lines += [
            "",
            f"{DENSE_REWARD}, per trained step: mean |ΔR_t| "
            + " ".join(f"{j}:{v:.3f}" for j, v in dense["dR_abs"].items())
            + "; share of ΔR_t = 0 "
            + " ".join(f"{j}:{v:.2f}" for j, v in dense["dR_zero"].items()),
        ]
    text = "\n".join(lines)
    with open(os.path.join(out, "grad_share.md"), "w") as f:
        f.write(text + "\n")
    figure(data, os.path.join(out, "grad_share.png"))
    return text


def figure(data: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.8), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[1.2, 1.5, 1])
    groups = {  # one panel of bars per script family, so that each step's bars stay readable
        "Flow-GRPO and G²RPO": [n for n in data if not n.startswith("DenseGRPO")],
        "DenseGRPO": [n for n in data if n.startswith("DenseGRPO")],
    }
    low = min([0.0, *[v for e in data.values() for v in e["share"].values()]])
    ticks = range(1 + max([j for e in data.values() for j in e["share"]] or [0]))
    for ax, (title, names) in zip(axes, groups.items()):
        width = 0.8 / max(1, len(names))
        for n, name in enumerate(names):
            s = data[name]["share"]
            ax.bar([j - 0.4 + width * (n + 0.5) for j in s], list(s.values()), width, label=name)
        ax.axhline(0, color="0.3", lw=0.8)
        ax.set_ylim(low - 0.02, 1.25)  # room above the bars for the legend
        ax.set_xticks(ticks)
        ax.set_xlabel("trained step j (0 = the noisiest, first step of the rollout)")
        ax.set_title(f"{title}:\nwhere the update comes from")
        ax.legend(fontsize="small", loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("share of the iteration's gradient, g_j . g / |g|^2")
    bx = axes[2]
    dense = data.get(DENSE_REWARD)
    if dense and dense["dR_abs"]:
        steps = list(dense["dR_abs"])
        bx.plot(steps, list(dense["dR_abs"].values()), "o-", color="tab:blue", label="mean |ΔR_t|")
        bx.plot(
            steps,
            list(dense["dR_zero"].values()),
            "s--",
            color="tab:red",
            label="share of trajectories with ΔR_t = 0",
        )
        bx.set_ylim(0, 1)
        bx.set_xticks(steps)
        bx.legend(fontsize="small")
        bx.grid(alpha=0.3)
    bx.set_xlabel("trained step j")
    bx.set_title("DenseGRPO's dense reward per step\n(its old default, 9 steps trained)")
    fig.savefig(path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "grad_share"))
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if not a.report_only:
        run(a.out, a.iterations, a.threads)
    print(report(a.out))
