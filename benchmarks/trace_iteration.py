"""Benchmark (not a test): the lines a student reads to follow ONE training iteration of a script, traced.

    python benchmarks/trace_iteration.py flowgrpo_baseline.py [--root DIR] [--json OUT]

Runs the script in this process on the toy world (3 iterations, evaluation and saving pushed past the run:
`--eval-every 100 --save-every 100`; iteration 0's evaluation on two prompts, one seed each) and traces iteration 1 with `sys.settrace`: every function of the
project's own files that the iteration enters (rollout, training, logging; the toy world's model and reward are
left out, as gym is to CleanRL). Lines read = the union of the whole source of every function entered (a method
is its own span, not its class; its docstring, comments and blank lines included) plus the lines of the main loop
that ran; lines run = the distinct lines that executed. Counted on the checkout as it is (the repository is
`ruff format`-ed at 100 columns, which .ci/run checks). This is the measure of issue #66 (2026-12-06: 1,038 lines
in 10 files for flowgrpo_baseline.py at 23dca5d).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the environment, as gym is to CleanRL: the toy world's model files and reward
LEFT_OUT = (os.path.join("common", "toyworld"),)


class Traced(Exception):
    """Raised once the traced iteration is over."""


def function_spans(path: str) -> dict[int, tuple[int, int]]:
    """{first line of a code object: (first, last) line of the innermost function it belongs to}: a def's code
    object starts at its first decorator; a comprehension or lambda belongs to its enclosing function."""
    tree = ast.parse(open(path).read())
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno, node.name))
    return spans


def innermost(spans, line: int) -> tuple[int, int, str] | None:
    inside = [s for s in spans if s[0] <= line <= s[1]]
    return min(inside, key=lambda s: s[1] - s[0]) if inside else None


def main_loop_span(path: str) -> tuple[int, int]:
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.For) and getattr(node.target, "id", "") == "iteration":
            return node.lineno, node.end_lineno
    raise SystemExit(f"{path}: no `for iteration in ...` loop")


def trace(script: str, root: str, extra: list[str]) -> dict:
    script_path = os.path.join(root, script)
    loop = main_loop_span(script_path)
    project = os.path.join(root, "")
    entered: set[tuple[str, int]] = set()  # (file, first line of the code object)
    ran: set[tuple[str, int]] = set()

    def ours(
        path: str,
    ) -> bool:  # the project's files: not a virtual environment inside it, not this tool
        return (
            path.startswith(project)
            and "site-packages" not in path
            and path != os.path.abspath(__file__)
            and not any(os.path.relpath(path, root).startswith(p) for p in LEFT_OUT)
        )

    def local(frame, event, arg):
        if event == "line":
            ran.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def call(frame, event, arg):
        path = frame.f_code.co_filename
        if not ours(path):
            return None
        entered.add((path, frame.f_code.co_firstlineno))
        return local

    def iterations(*bounds):
        """The main loop's `range`: the tracer is on while the loop's body runs iteration 1 (set
        here, so that the set-up and iteration 0 run untraced, at full speed)."""
        loop_frame = sys._getframe(1)
        for iteration in builtins.range(*bounds):
            if iteration == 1:
                loop_frame.f_trace = local
                sys.settrace(call)
            elif iteration == 2:
                sys.settrace(None)
                raise Traced  # the rest of the run is not measured
            yield iteration

    def loop_range(*bounds):
        caller = sys._getframe(1)
        at_loop = caller.f_code.co_filename == script_path and caller.f_lineno == loop[0]
        return iterations(*bounds) if at_loop else builtins.range(*bounds)

    out_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "trace_iteration")
    os.makedirs(out_dir, exist_ok=True)
    # iteration 0's evaluation comes before the traced iteration: two prompts, one seed each
    eval_file = os.path.join(out_dir, "two_prompts.txt")
    with open(eval_file, "w") as f:
        f.write("a photo of a red circle\na photo of two blue squares\n")
    argv = [script, "--num-iterations", "3", "--eval-every", "100", "--save-every", "100"]
    argv += ["--output-dir", out_dir, "--eval-prompts", eval_file, "--eval-seeds-per-prompt", "1"]
    sys.argv, sys.path[0] = argv + extra, root
    try:
        runpy.run_path(script_path, {"range": loop_range}, run_name="__main__")
    except Traced:
        pass
    finally:
        sys.settrace(None)

    read: dict[str, set[int]] = {}
    names: dict[str, set[str]] = {}
    spans_of = {}
    for path, first in entered:
        spans = spans_of.setdefault(path, function_spans(path))
        span = innermost(spans, first)
        if span is not None:
            read.setdefault(path, set()).update(range(span[0], span[1] + 1))
            names.setdefault(path, set()).add(f"{span[2]} {span[1] - span[0] + 1}")
    # the loop's own lines: those of its statement that ran in the traced iteration
    read.setdefault(script_path, set()).update(
        i for p, i in ran if p == script_path and loop[0] <= i <= loop[1]
    )
    out = {}
    for path, lines in sorted(read.items()):
        out[os.path.relpath(path, root)] = {
            "read": len(lines),
            "run": sum(1 for p, i in ran if p == path and i in lines),
            "functions": sorted(names.get(path, ())),
        }
    return out


def report(script: str, per_file: dict) -> str:
    total = sum(v["read"] for v in per_file.values())
    run = sum(v["run"] for v in per_file.values())
    rows = sorted(per_file.items(), key=lambda kv: -kv[1]["read"])
    by_file = ", ".join(f"{k} {v['read']}" for k, v in rows)
    return f"{script}: {total} lines read, {run} run, in {len(per_file)} files ({by_file})"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("script")
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--json", help="also write the per-file counts here")
    a, extra = ap.parse_known_args()
    result = trace(a.script, os.path.abspath(a.root), extra)
    print(report(a.script, result), file=sys.__stderr__)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({a.script: result}, f, indent=1)
