"""The project's layout: no import circle among its own modules, counting every import statement (a function's
lazy import too: a circle there is a circle a reader must untangle, and a hidden order of first use)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("common", "benchmarks")


def own_modules() -> dict[str, str]:
    """{dotted module name: file} of the project's packages and top-level scripts (tests and the toy world's
    model folder aside)."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[: -len(".py")]
                    name = rel.replace(os.sep, ".").removesuffix(".__init__")
                    out[name] = os.path.join(folder, f)
    for f in os.listdir(ROOT):
        if f.endswith(".py"):
            out[f[: -len(".py")]] = os.path.join(ROOT, f)
    return out


def imports(path: str, name: str, known: set[str]) -> set[str]:
    """The project modules a file imports anywhere in it (`from a.b import c` is a.b.c when that is a module)."""
    found = set()
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this file
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = own_modules()
    return {name: imports(path, name, set(modules)) for name, path in modules.items()}


def test_no_import_circle_among_the_projects_modules():
    assert cycles(import_graph()) == []


def test_the_circle_finder_sees_a_circle():
    graph = import_graph()
    a, b = "common.sampler", "common.backbones"
    assert a in graph[b]  # the backbone calls the sampler
    graph[a] = graph[a] | {b}
    assert [a, b] in [sorted(c) for c in cycles(graph)] or any(
        a in c and b in c for c in cycles(graph)
    )
