"""Benchmark (not a test): the CPU cost of every training script's toy default, side by side on one machine.

    python benchmarks/bench_cost.py                                         # every script, 4 iterations, 2 rounds
    python benchmarks/bench_cost.py --repeats 3 --out runs/cost             # three rounds
    python benchmarks/bench_cost.py --scripts flowgrpo_baseline --iterations 2 --repeats 1 --out /tmp/smoke
    python benchmarks/bench_cost.py --report-only --out runs/cost           # redo cost.md from cost.json

Every run is one script with its own defaults for `--iterations` training iterations, evaluation cut to almost
nothing (4 test prompts, one seed, at iteration 0 and at the end; no checkpoint but the last), OMP/MKL threads
= `--threads`, OMP_WAIT_POLICY=PASSIVE. The runs are interleaved so that a drift of the machine's load hits every
script alike: `--repeats` rounds, each running every script once, round k starting at script k mod S, `--jobs`
runs at a time. diffusionnft.py joins when it exists in the repository root.

Cost per iteration: the difference of `time/cpu_s` (process CPU seconds since the training loop began, all
threads) between consecutive training rows of metrics.jsonl, without the first iteration (warm-up and the
iteration-0 evaluation). DenseGRPO calibrates psi(t) before its loop, outside that clock: its first row logs the
calibration's CPU seconds (`time/calibration_cpu_s`), reported in their own column and added to its cost per run.
The ratio to Flow-GRPO's mean is the number that travels between machines; the seconds do not (the same
iteration has cost 1.4x more CPU on another day, ~30 % more under load). Hence the load at every run's start
and end, the date, the commit, nproc and bench_compare's speed probe beside the table.

Writes {out}/cost.json (every run's raw per-iteration numbers and the machine) and {out}/cost.md (the table);
the run folders go to {out}/runs.
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.plumbing.checks import ConfigError, read_json  # noqa: E402
from common.plumbing.utils import read_metrics_lines  # noqa: E402

SCRIPTS = ("flowgrpo_baseline", "g2rpo", "densegrpo", "diffusionnft")
REFERENCE = "flowgrpo_baseline"  # the ratio column divides by its mean
PHASES = ("rollout", "reward", "train")
NFE = ("nfe/rollout", "nfe/completion", "nfe/train_forward", "nfe/train_backward")
CALIBRATION = ("time/calibration_cpu_s", "time/calibration_s")
# what cost.json keeps of each training row
KEEP = (
    "iteration",
    "time/cpu_s",
    "time/elapsed_s",
    "time/eval_s",
    *(f"time/{p}_s" for p in PHASES),
    *NFE,
)
EVAL_PROMPTS = 4
BIG = "100000"  # --eval-every / --save-every: never within the run


# ------------------------------------------------------------------------------------------------ plan
def available(root: str = ROOT) -> list[str]:
    """The scripts of SCRIPTS whose file is in the repository root."""
    return [s for s in SCRIPTS if os.path.isfile(os.path.join(root, f"{s}.py"))]


def pick_scripts(names: list[str] | None, root: str = ROOT) -> list[str]:
    """The scripts to run, in SCRIPTS order: `names`, or every available one. A name that is not a script,
    or whose file is absent, is refused in one line."""
    here = available(root)
    for n in names or []:
        if n not in SCRIPTS:
            raise ConfigError(f"--scripts {n}: unknown script (known: {', '.join(SCRIPTS)})")
        if n not in here:
            raise ConfigError(f"--scripts {n}: {n}.py is not in {root}")
    chosen = set(names or here)
    return [s for s in SCRIPTS if s in chosen]


def rotation(scripts: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, script) in launch order: every round runs each script once, round k starting at script
    k mod S, so no script always runs first or last."""
    s = len(scripts)
    return [(k, scripts[(k + i) % s]) for k in range(repeats) for i in range(s)]


def run_name(script: str, round_: int) -> str:
    return f"{script}_rep{round_ + 1}"


def script_flags(out: str, name: str, iterations: int, prompts: str) -> list[str]:
    """The flags of every run besides the script's own defaults."""
    return [
        "--num-iterations",
        str(iterations),
        "--eval-every",
        BIG,
        "--eval-prompts",
        prompts,
        "--eval-seeds-per-prompt",
        "1",
        "--final-eval-seeds-per-prompt",
        "1",
        "--save-every",
        BIG,
        "--output-dir",
        os.path.join(out, "runs"),
        "--run-name",
        name,
    ]


def write_eval_prompts(out: str) -> str:
    """{out}/eval_prompts.txt: the first EVAL_PROMPTS lines of the test prompts."""
    with open(os.path.join(ROOT, "common", "toyworld", "prompts_test.txt")) as f:
        lines = [line for line in f if line.strip()][:EVAL_PROMPTS]
    path = os.path.join(out, "eval_prompts.txt")
    with open(path, "w") as f:
        f.writelines(lines)
    return path


def run_env(threads: int) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": "PASSIVE",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
    }


def default_iterations(script: str, root: str = ROOT) -> int | None:
    """The script's default --num-iterations, read from its `num_iterations: int = N` (nothing imported)."""
    path = os.path.join(root, f"{script}.py")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        m = re.search(r"^\s*num_iterations:\s*int\s*=\s*(\d+)", f.read(), re.MULTILINE)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------------------------ machine
def git_state() -> dict:
    """The commit (short) and whether the work tree differs from it."""

    def git(*a):
        p = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(status)}


def speed_probe() -> float | None:
    """bench_compare's speed probe (10 toy forwards at batch 64 on one thread, in a fresh process)."""
    try:
        from benchmarks.bench_compare import speed_probe as probe
    except ImportError as e:
        print(f"speed probe unavailable: {e}", flush=True)
        return None
    return probe()


def machine(threads: int, jobs: int, command: str) -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **git_state(),
        "nproc": len(os.sched_getaffinity(0)),
        "threads": threads,
        "jobs": jobs,
        "command": command,
    }


# ------------------------------------------------------------------------------------------------ runs
def read_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (a cut last line is skipped; common/plumbing/utils.py, as a resume reads them)."""
    return read_metrics_lines(path)[0]


def training_rows(rows: list[dict]) -> list[dict]:
    """The training iterations' rows (no `final`), by iteration, reduced to KEEP and the calibration."""
    kept = [r for r in rows if not r.get("final") and "time/cpu_s" in r]
    kept.sort(key=lambda r: r["iteration"])
    return [{k: r[k] for k in (*KEEP, *CALIBRATION) if k in r} for r in kept]


def launch(out: str, script: str, name: str, flags: list[str], threads: int) -> subprocess.Popen:
    run_dir = os.path.join(out, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier call starts again from nothing
    os.makedirs(run_dir)
    log = open(os.path.join(run_dir, "stdout.log"), "w")
    cmd = [sys.executable, os.path.join(ROOT, f"{script}.py"), *flags]
    p = subprocess.Popen(cmd, env=run_env(threads), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    p.log = log
    return p


def finish(p: subprocess.Popen, rec: dict, out: str) -> dict | None:
    """None while `p` runs; once it has exited, `rec` completed: exit code, whole-process CPU (os.wait4's
    rusage: startup and evaluations included), wall seconds, the load at the end, and the training rows."""
    pid, status, usage = os.wait4(p.pid, os.WNOHANG)
    if pid == 0:
        return None
    p.returncode = os.waitstatus_to_exitcode(status)
    p.log.close()
    rec.update(
        returncode=p.returncode,
        process_cpu_s=round(usage.ru_utime + usage.ru_stime, 3),
        wall_s=round(time.time() - rec.pop("_t0"), 2),
        load_end=round(os.getloadavg()[0], 2),
        rows=training_rows(read_rows(os.path.join(out, "runs", rec["name"], "metrics.jsonl"))),
    )
    return rec


def run_all(out: str, order: list[tuple[int, str]], args, cost: dict) -> list[str]:
    """Run `order`, args.jobs at a time; cost.json is rewritten after every run. Returns the failed runs."""
    prompts = write_eval_prompts(out)
    todo, active, failed = list(order), [], []
    try:
        while todo or active:
            while todo and len(active) < args.jobs:
                k, script = todo.pop(0)
                name = run_name(script, k)
                flags = script_flags(out, name, args.iterations, prompts)
                rec = {"script": script, "name": name, "round": k, "flags": flags}
                rec.update(load_start=round(os.getloadavg()[0], 2), _t0=time.time())
                active.append((launch(out, script, name, flags, args.threads), rec))
                print(f"started  {name}", flush=True)
            time.sleep(0.5)
            for p, rec in list(active):
                if finish(p, rec, out) is None:
                    continue
                active.remove((p, rec))
                cost["runs"].append(rec)
                save(out, cost)
                ok = rec["returncode"] == 0 and len(rec["rows"]) >= 2
                print(f"{'finished' if ok else 'FAILED  '} {rec['name']} ({rec['wall_s']:.0f} s)")
                if not ok:
                    failed.append(rec["name"])
    finally:  # Ctrl-C: stop the children
        for p, _ in active:
            p.kill()
            p.wait()
    return failed


def save(out: str, cost: dict) -> None:
    tmp = os.path.join(out, "cost.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cost, f, indent=1)
    os.replace(tmp, os.path.join(out, "cost.json"))


# ------------------------------------------------------------------------------------------------ numbers
def iteration_costs(rows: list[dict]) -> list[float]:
    """CPU seconds of each training iteration but the first: time/cpu_s minus the previous row's (only
    between consecutive iterations)."""
    return [
        b["time/cpu_s"] - a["time/cpu_s"]
        for a, b in zip(rows, rows[1:])
        if b["iteration"] == a["iteration"] + 1
    ]


def phase_seconds(rows: list[dict]) -> dict[str, float]:
    """Wall seconds per phase, summed over the iterations but the first."""
    return {p: sum(r.get(f"time/{p}_s", 0.0) for r in rows[1:]) for p in PHASES}


def nfe_counts(rows: list[dict]) -> dict[str, float]:
    """Transformer calls per phase, summed over the iterations but the first (the counters are cumulative)."""
    return {k: rows[-1].get(k, 0) - rows[0].get(k, 0) for k in NFE} if rows else {}


def calibration_cpu(rows: list[dict]) -> float | None:
    """CPU seconds spent before the loop (DenseGRPO's psi calibration), from the first row, or None."""
    return rows[0].get("time/calibration_cpu_s") if rows else None


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per script: the runs counted, every iteration cost, the mean and range, phases and NFE per iteration,
    the calibration's CPU seconds (mean over runs, None if not logged)."""
    out = {}
    for r in runs:
        rows = r.get("rows") or []
        costs = iteration_costs(rows)
        if r.get("returncode") != 0 or not costs:
            continue
        s = out.setdefault(
            r["script"],
            {"runs": 0, "costs": [], "phases": dict.fromkeys(PHASES, 0.0), "nfe": {}, "calib": []},
        )
        s["runs"] += 1
        s["costs"] += costs
        for p, v in phase_seconds(rows).items():
            s["phases"][p] += v
        for k, v in nfe_counts(rows).items():
            s["nfe"][k] = s["nfe"].get(k, 0) + v
        c = calibration_cpu(rows)
        if c is not None:
            s["calib"].append(c)
    for s in out.values():
        n = len(s["costs"])
        s["mean"], s["min"], s["max"] = sum(s["costs"]) / n, min(s["costs"]), max(s["costs"])
        s["phases"] = {p: v / n for p, v in s["phases"].items()}
        s["nfe"] = {k: v / n for k, v in s["nfe"].items()}
        s["calib"] = sum(s["calib"]) / len(s["calib"]) if s["calib"] else None
    return out


def ratio(summary: dict, script: str) -> float | None:
    """The script's mean cost per iteration over Flow-GRPO's, or None without Flow-GRPO."""
    ref = summary.get(REFERENCE)
    return summary[script]["mean"] / ref["mean"] if ref else None


# ------------------------------------------------------------------------------------------------ report
def calib_text(script: str, s: dict) -> str:
    if s["calib"] is not None:
        return f"{s['calib']:.1f}"
    return "not logged" if script == "densegrpo" else "none"


def per_run_text(s: dict, iterations: int | None) -> str:
    if iterations is None:
        return "? (no default found)"
    total = s["mean"] * iterations + (s["calib"] or 0.0)
    return f"{total:,.0f} ({iterations} it)"


def table(cost: dict) -> list[str]:
    summary, defaults = summarize(cost["runs"]), cost["meta"].get("defaults", {})
    lines = [
        "| script | runs | CPU s / iteration: mean (min–max) | × Flow-GRPO | before loop, CPU s | "
        "CPU s / run at default | wall s / iteration: rollout / reward / train | "
        "NFE / iteration: rollout / completion / train fwd / train bwd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for script in SCRIPTS:
        if script not in summary:
            continue
        s, q = summary[script], ratio(summary, script)
        lines.append(
            f"| {script} | {s['runs']} | {s['mean']:.1f} ({s['min']:.1f}–{s['max']:.1f}) | "
            + ("—" if q is None else f"{q:.2f}")
            + f" | {calib_text(script, s)} | {per_run_text(s, defaults.get(script))} | "
            + " / ".join(f"{s['phases'][p]:.1f}" for p in PHASES)
            + " | "
            + " / ".join(f"{s['nfe'].get(k, 0):.0f}" for k in NFE)
            + " |"
        )
    return lines


def loads_text(runs: list[dict]) -> str:
    loads = [r[k] for r in runs for k in ("load_start", "load_end") if r.get(k) is not None]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"


def footer(cost: dict) -> list[str]:
    m, runs = cost["meta"], cost["runs"]
    probe = m.get("speed_probe_cpu_s")
    failed = [r["name"] for r in runs if r.get("returncode") != 0]
    return [
        "",
        f"Measured {m.get('date_utc', '?')} at commit {m.get('commit', '?')}"
        + (" (work tree modified)" if m.get("dirty") else "")
        + f"; nproc {m.get('nproc', '?')}; 1-minute load {loads_text(runs)} (runs' starts and ends); "
        + "speed probe "
        + ("—" if probe is None else f"{probe:.2f} CPU s (10 toy forwards, batch 64, one thread)")
        + f"; {m.get('jobs', '?')} job(s) × {m.get('threads', '?')} thread(s); "
        + f"{m.get('iterations', '?')} iterations per run, {m.get('repeats', '?')} round(s).",
        "",
        f"Command: `{m.get('command', '?')}`",
        "",
        "Per iteration: process CPU seconds (all threads) of iterations 2..N, pooled over the runs. Per run: "
        "that mean times the script's default --num-iterations plus the CPU before the loop (DenseGRPO's psi "
        "calibration, `time/calibration_cpu_s`); without the evaluations (every 10 iterations and the final "
        "one), the model's loading and the first iteration's warm-up. Seconds differ between machines and "
        "days; the ratio to Flow-GRPO is what carries over.",
        *(f"- {note}" for note in m.get("notes", [])),
        *([f"- failed runs (not counted): {', '.join(failed)}"] if failed else []),
    ]


def cost_problem(cost: dict) -> str | None:
    """What is wrong with the layout of a cost.json (None: nothing), before the report reads it."""
    if not isinstance(cost.get("meta"), dict):
        return "its 'meta' is not an object"
    runs = cost.get("runs")
    if not isinstance(runs, list):
        return "its 'runs' are not a list"
    for r in runs:
        if not (
            isinstance(r, dict)
            and isinstance(r.get("script"), str)
            and isinstance(r.get("name"), str)
            and isinstance(r.get("rows", []), list)
            and all(isinstance(x, dict) for x in r.get("rows", []))
        ):
            return "a run is not an object with a script, a name and rows"
    return None


def report(out: str) -> str:
    """Write {out}/cost.md from {out}/cost.json; return the markdown."""
    path = os.path.join(out, "cost.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--report-only: {path} does not exist (run the benchmark first)")
    try:
        cost = read_json(path)
        problem = cost_problem(cost)
    except (OSError, ValueError) as e:
        problem = f"{e.__class__.__name__}: {e}"
    if problem:
        raise ConfigError(
            f"{path} is not a cost.json this benchmark wrote ({problem}): run the benchmark again"
        )
    if not summarize(cost["runs"]):  # every run failed, or none ran: no table of nothing
        raise ConfigError(
            f"{path} holds no finished run ({len(cost['runs'])} recorded): nothing to report; see "
            "the runs' stdout.log, then run the benchmark again"
        )
    text = (
        "\n".join(["# CPU cost per script, side by side", "", *table(cost), *footer(cost)]) + "\n"
    )
    with open(os.path.join(out, "cost.md"), "w") as f:
        f.write(text)
    return text


# ------------------------------------------------------------------------------------------------ main
def parse(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scripts", nargs="+", default=None, help=f"a subset of {', '.join(SCRIPTS)}")
    ap.add_argument("--iterations", type=int, default=4, help="training iterations per run (>= 2)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds; each runs every script once")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side")
    ap.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per run")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "cost"))
    ap.add_argument(
        "--report-only", action="store_true", help="only rebuild cost.md from cost.json"
    )
    ap.add_argument(
        "--no-speed-probe", action="store_true", help="skip timing the machine before the runs"
    )
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(
            f"--out {args.out} is a file: pass a folder (it holds cost.json and the runs)"
        )
    if args.iterations < 2 or args.repeats < 1 or args.jobs < 1 or args.threads < 1:
        raise ConfigError(
            f"--iterations {args.iterations} / --repeats {args.repeats} / --jobs {args.jobs} / "
            f"--threads {args.threads}: need iterations >= 2 (the first is not counted) and the others >= 1"
        )
    return args


def main(argv=None):
    args = parse(argv)
    if not args.report_only:
        scripts = pick_scripts(args.scripts)
        command = shlex.join(
            ["python", "benchmarks/bench_cost.py", *(sys.argv[1:] if argv is None else argv)]
        )
        meta = machine(args.threads, args.jobs, command)
        meta.update(iterations=args.iterations, repeats=args.repeats, scripts=scripts)
        meta["defaults"] = {s: default_iterations(s) for s in scripts}
        meta["notes"] = [
            f"{s}.py is not in this checkout: skipped" for s in SCRIPTS if s not in available()
        ]
        meta["speed_probe_cpu_s"] = None if args.no_speed_probe else speed_probe()
        order = rotation(scripts, args.repeats)
        print(
            f"{len(order)} runs, {args.jobs} at a time, {args.threads} thread(s) each", flush=True
        )
        os.makedirs(args.out, exist_ok=True)
        cost = {"meta": meta, "runs": []}
        save(args.out, cost)
        failed = run_all(args.out, order, args, cost)
        if failed:
            print(f"{len(failed)} run(s) failed, see their stdout.log: {', '.join(failed)}")
    print(report(args.out))


if __name__ == "__main__":
    main()
