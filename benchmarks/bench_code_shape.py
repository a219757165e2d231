"""Benchmark (not a test): the shape of the three scripts as a reader meets it, measured on formatted code.

    python benchmarks/bench_code_shape.py                 # this checkout
    python benchmarks/bench_code_shape.py --root DIR      # another checkout (e.g. a worktree at an older commit)
    python benchmarks/bench_code_shape.py --trace         # and one training iteration of each script, traced

Every number is taken after `ruff format --line-length 100` of a temporary copy (so packing lines cannot move it):
lines per script; lines > 100 characters; the main loop's lines (the `for iteration in ...` statement, whole) and the
share of them that is the algorithm (the rollout section between its ROLLOUT and END OF ROLLOUT banners, and the
loss: from the policy's log-prob to `loss.backward()`); the deepest statement of the training section (indent levels
of its first line: the body of `if __name__` is level 1); names imported from the project's own modules (`from common... import`); and, for
`diff flowgrpo_baseline.py X`, the share of changed lines that are the algorithm: everything but the module
docstring, the imports, and the help text of flags both scripts share (a flag of its own, its checks, its rollout,
its advantages are the algorithm). Needs ruff (pip install ruff).

With --trace, every script also runs one toy-world iteration under benchmarks/trace_iteration.py (a process each,
minutes each on 2 cores): the files and lines a student reads to follow it (every function entered, whole, and the
main loop's lines that ran) and the lines that ran; the per-file counts go to --trace-json.
"""

import argparse
import ast
import difflib
import os
import re
import shutil
import subprocess
import tempfile

SCRIPTS = ("flowgrpo_baseline.py", "g2rpo.py", "densegrpo.py", "diffusionnft.py", "awm.py")
GRPO = SCRIPTS[:3]  # the scripts that share the training section: their diffs are compared


def formatted(root: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        for s in SCRIPTS:
            shutil.copy(os.path.join(root, s), os.path.join(tmp, s))
        subprocess.run(
            ["ruff", "format", "--quiet", "--line-length", "100", "--no-cache", tmp], check=True
        )
        return {s: open(os.path.join(tmp, s)).read() for s in SCRIPTS}


def main_loop(tree: ast.Module) -> ast.For:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and node.target.id == "iteration"
        ):
            return node
    raise ValueError("no `for iteration in ...` loop")


def depth_of_statements(node, level=-1, out=None):
    """{line: indent level} of every statement under `node` (a module's own statements: 0)."""
    out = {} if out is None else out
    for field in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(node, field, []) or []:
            if isinstance(child, ast.stmt):
                out[child.lineno] = level + 1
            depth_of_statements(child, level + 1, out)
    return out


# A statement is plumbing when it only feeds metrics, counters, timers, diagnostics, checks or the
# run's bookkeeping (evaluation, logging, saving), or syncs ranks, wherever it stands; the rest is
# the algorithm. A compound statement (if / for / with) is judged by its header line alone, its body
# statement by statement.
PLUMBING = re.compile(
    r"\brun\.(?!timer\))|\bstats\b|\bmetrics\b|\bcounts\b|\btimer\(|require_backward_grad_sync|check_finite"
    r"|check_transitions|\.to\(h\.device\)|grad_share|group_reward_metrics|anchor_nfe|\bbreak\b"
    r"|\blast\b|eval_every|save_every|for iteration in"
)


def statement_kinds(text: str, node: ast.AST) -> dict[int, str]:
    """line -> 'algorithm' | 'plumbing' for every line of a statement under `node` (blank and
    comment-only lines are in none)."""
    lines = text.splitlines()
    out: dict[int, str] = {}

    def visit(stmt: ast.stmt) -> None:
        body = [c for f in ("body", "orelse", "finalbody") for c in getattr(stmt, f, []) or []]
        body = [c for c in body if isinstance(c, ast.stmt)]
        for h in getattr(stmt, "handlers", []) or []:
            body += h.body
        last = body[0].lineno - 1 if body else stmt.end_lineno
        own = "\n".join(line.split("  #")[0] for line in lines[stmt.lineno - 1 : last])
        kind = (
            "algorithm" if isinstance(stmt, ast.Return) or not PLUMBING.search(own) else "plumbing"
        )
        for i in range(stmt.lineno, last + 1):
            if lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"):
                out[i] = kind
        for child in body:
            visit(child)

    visit(node)
    return out


def algorithm_lines_of_loop(text: str, loop: ast.For) -> tuple[int, int]:
    """(code lines of the main loop, those that are the algorithm), counted strictly."""
    kinds = statement_kinds(text, loop)
    return len(kinds), sum(k == "algorithm" for k in kinds.values())


def regions(text: str) -> dict[int, str]:
    """line -> 'docstring' | 'import' | 'flag:<name>' for the lines that are not plainly algorithm or loop."""
    tree = ast.parse(text)
    out = {}
    doc = tree.body[0]
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
        out.update({i: "docstring" for i in range(doc.lineno, doc.end_lineno + 1)})
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({i: "import" for i in range(node.lineno, node.end_lineno + 1)})
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            body = node.body
            for k, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    end = (
                        body[k + 1].end_lineno
                        if k + 1 < len(body) and isinstance(body[k + 1], ast.Expr)
                        else stmt.end_lineno
                    )
                    out.update({i: f"flag:{stmt.target.id}" for i in range(stmt.lineno, end + 1)})
    for node in tree.body:  # plumbing statements of the functions and the main block
        if isinstance(node, (ast.FunctionDef, ast.If)):
            kinds = statement_kinds(text, node)
            out.update(
                {i: "plumbing" for i, k in kinds.items() if k == "plumbing" and i not in out}
            )
    return out


def diff_share(base: str, other: str) -> tuple[int, int]:
    """(changed lines of `diff base other`, those that are the algorithm)."""
    a, b = base.splitlines(), other.splitlines()
    ra, rb = regions(base), regions(other)
    flags_a = {v for v in ra.values() if v.startswith("flag:")}
    flags_b = {v for v in rb.values() if v.startswith("flag:")}
    shared = flags_a & flags_b
    changed = algo = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for region, lo, hi in ((ra, i1, i2), (rb, j1, j2)):
            for i in range(lo, hi):
                changed += 1
                kind = region.get(i + 1, "")
                if kind not in ("docstring", "import", "plumbing") and kind not in shared:
                    algo += 1
    return changed, algo


def measure(root: str) -> dict:
    texts = formatted(root)
    out = {}
    for s, text in texts.items():
        lines = text.splitlines()
        tree = ast.parse(text)
        loop = main_loop(tree)
        depth = depth_of_statements(tree)
        train_first = next(
            i for i, line in enumerate(lines, 1) if "# =" in line and "TRAINING on" in line
        )
        train_last = next(i for i, line in enumerate(lines, 1) if "END OF TRAINING" in line)
        deepest = max(d for line, d in depth.items() if train_first <= line <= train_last)
        own = sum(
            len(n.names)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("common")
        )
        loop_lines, loop_algorithm = algorithm_lines_of_loop(text, loop)
        args_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
        own_flags = [
            st
            for st in args_class.body
            if isinstance(st, ast.AnnAssign)
            and not (
                isinstance(st.value, ast.Call) and getattr(st.value.func, "id", "") == "derived"
            )
        ]
        rollout = next(
            (n.lineno for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "rollout"),
            None,
        )
        out[s] = {
            "lines": len(lines),
            "over_100": sum(len(line) > 100 for line in lines) / len(lines),
            "own_flags": len(own_flags),
            "rollout_line": rollout,
            "loop_lines": loop_lines,
            "loop_algorithm": loop_algorithm / loop_lines,
            "deepest_training_statement": deepest,
            "own_names_imported": own,
        }
    for s in GRPO[1:]:
        changed, algo = diff_share(texts[GRPO[0]], texts[s])
        out[s]["diff_changed"], out[s]["diff_algorithm"] = changed, algo / changed
    return out


def table(result: dict) -> str:
    rows = [
        ("lines (formatted)", lambda m: str(m["lines"])),
        ("lines > 100 characters", lambda m: f"{100 * m['over_100']:.1f} %"),
        ("flags declared in the script", lambda m: str(m["own_flags"])),
        ("first line of the rollout", lambda m: str(m["rollout_line"])),
        ("main loop, code lines", lambda m: str(m["loop_lines"])),
        (
            "share of the main loop that is the algorithm (strict)",
            lambda m: f"{100 * m['loop_algorithm']:.0f} %",
        ),
        (
            "deepest statement of the training section",
            lambda m: str(m["deepest_training_statement"]),
        ),
        ("names imported from common/", lambda m: str(m["own_names_imported"])),
        (
            "changed lines of the diff against the baseline",
            lambda m: str(m.get("diff_changed", "—")),
        ),
        (
            "share of the diff that is the algorithm (strict)",
            lambda m: f"{100 * m['diff_algorithm']:.0f} %" if "diff_algorithm" in m else "—",
        ),
    ]
    head = "| | " + " | ".join(SCRIPTS) + " |\n|---|" + "---|" * len(SCRIPTS)
    return (
        head
        + "\n"
        + "\n".join(
            f"| {name} | " + " | ".join(f(result[s]) for s in SCRIPTS) + " |" for name, f in rows
        )
    )


def traced(root: str, json_out: str | None) -> dict:
    """{script: {"files": n, "read": lines, "run": lines}} of one traced iteration per script."""
    import json
    import sys

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_iteration.py")
    out, per_file = {}, {}
    for s in SCRIPTS:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            subprocess.run([sys.executable, here, s, "--root", root, "--json", path], check=True)
            per_file[s] = json.load(open(path))[s]
        counts = per_file[s].values()
        out[s] = {
            "files": len(per_file[s]),
            "read": sum(c["read"] for c in counts),
            "run": sum(c["run"] for c in counts),
        }
    if json_out:
        with open(json_out, "w") as f:
            json.dump(per_file, f, indent=1)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--trace", action="store_true", help="also trace one iteration of each script")
    ap.add_argument("--trace-json", help="with --trace: the per-file counts, as JSON")
    a = ap.parse_args()
    print(table(measure(a.root)))
    if a.trace:
        rows = traced(a.root, a.trace_json)
        print("\n| one iteration, traced | " + " | ".join(SCRIPTS) + " |")
        print("|---|" + "---|" * len(SCRIPTS))
        for key, name in (("read", "lines read"), ("run", "lines run"), ("files", "files")):
            print(f"| {name} | " + " | ".join(str(rows[s][key]) for s in SCRIPTS) + " |")
