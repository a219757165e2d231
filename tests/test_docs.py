"""The docs point at real code, by content: a function's name and a verbatim piece of its text, no line numbers.

A code reference in docs/*.md or README.md is written

    `KEY` ([PATH › SCOPE](../PATH))     (in README.md, at the repo root: `KEY` ([PATH › SCOPE](PATH)))

where PATH is a file of the repo, SCOPE the innermost function or class whose source holds the line
(`Class.method` for a method; `main` for the `if __name__ == "__main__":` block of a script, where the training
loop lives) and KEY a short verbatim piece of that line. A module-level line (a constant, an import) has no scope:
`KEY` ([PATH](../PATH)). This test checks every such reference: the file exists, the link is the right relative
path, SCOPE is a def/class (or `main`) of PATH, and KEY occurs exactly once in SCOPE's source (for no scope: once
in the file, at module level). A reader finds the line with the editor's search inside the named function.

Why not line numbers: every code move shifted them and forced a renumbering commit. A reference by content only
breaks when the line itself changes, or moves to another function; then the failure names the scope(s) where the
key is now, and `python tests/test_docs.py --fix` rewrites the scope where the key occurs exactly once in the file
(the rest it lists, for a person: lengthen an ambiguous key, or update a key whose text changed). Any other
`file.py:N` label or `#LN` link is an error too, so no unchecked line number can creep in. No torch import: this is
fast.
"""

import ast
import builtins
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEP = "›"
# `KEY` ([PATH › SCOPE](PREFIX PATH)) or `KEY` ([PATH](PREFIX PATH)); whitespace (even a line break) allowed
# between the key and the link and around the ›
REF = re.compile(
    r"`(?P<key>[^`\n]+)`\s+\(\[(?P<label>(?P<path>[\w./-]+)(?:\s+"
    + SEP
    + r"\s+(?P<scope>[\w.]+))?)\]"
    r"\((?P<link>[\w./-]+)\)\)"
)
# anything that looks like a line reference: a `file.py:N` label or a `#LN` link target
LOOSE = re.compile(r"[\w./-]*[\w-]\.py:\d+|\]\([^)\s]*#L\d+\)")
ALGO_DOCS = [
    "docs/flowgrpo.md",
    "docs/g2rpo.md",
    "docs/densegrpo.md",
    "docs/diffusionnft.md",
    "docs/awm.md",
]
MIN_REFS = 10
KEY_LEN = (10, 60)
MAIN = "main"  # the scope name of the `if __name__ == "__main__":` block


def doc_files():
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md"] + docs


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") else lines


def _is_main_block(node) -> bool:
    """`if __name__ == "__main__":`"""
    t = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(t, ast.Compare)
        and isinstance(t.left, ast.Name)
        and t.left.id == "__name__"
        and len(t.ops) == 1
        and isinstance(t.ops[0], ast.Eq)
        and isinstance(t.comparators[0], ast.Constant)
        and t.comparators[0].value == "__main__"
    )


class Source:
    """A file's lines and scopes: `spans[name]` lists the (first, last) lines of every def/class called `name`
    (dotted through enclosing classes: `Class.method`; `main` for the __main__ block), `scope_at[n]` is the
    innermost scope of line n (None at module level)."""

    def __init__(self, path: str):
        self.lines = read_lines(path)
        self.spans: dict[str, list[tuple[int, int]]] = {}
        self.scope_at: list[str | None] = [None] * (len(self.lines) + 2)
        if path.endswith(".py"):
            self._visit(ast.parse("\n".join(self.lines), filename=path), "")

    def _add(self, name, node, first):
        self.spans.setdefault(name, []).append((first, node.end_lineno))
        for n in range(
            first, node.end_lineno + 1
        ):  # outer scopes first: an inner one overwrites them
            self.scope_at[n] = name

    def _visit(self, node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                self._add(
                    name, child, min([child.lineno] + [d.lineno for d in child.decorator_list])
                )
                self._visit(child, name + "." if isinstance(child, ast.ClassDef) else "")
            elif isinstance(node, ast.Module) and _is_main_block(child):
                self._add(MAIN, child, child.lineno)
                self._visit(child, "")
            else:
                self._visit(child, prefix)

    def occurrences(self, key: str, scope: str | None = None) -> list[int]:
        """Line numbers of every occurrence of key (a line holding it twice is listed twice), within scope's
        source (nested defs included) or, for scope None, the whole file."""
        if scope is None:
            ranges = [(1, len(self.lines))]
        else:
            ranges = self.spans.get(scope, [])
        lines = sorted({n for a, b in ranges for n in range(a, b + 1)})
        return [n for n in lines for _ in range(self.lines[n - 1].count(key))]

    def where(self, lines: list[int]) -> str:
        """'`f` (line 3), module level (line 9)'"""
        return ", ".join(
            f"`{self.scope_at[n]}` (line {n})" if self.scope_at[n] else f"module level (line {n})"
            for n in lines
        )


def _label(path, scope):
    return f"{path} {SEP} {scope}" if scope else path


def check_doc(doc: str, text: str, root: str = ROOT) -> tuple[list[str], int]:
    """(error messages, number of references) for the markdown `text` of `doc` (a path relative to root)."""
    prefix = os.path.relpath(root, os.path.dirname(os.path.join(root, doc))).replace(os.sep, "/")
    prefix = "" if prefix == "." else prefix + "/"
    errors, spans, count, sources = [], [], 0, {}
    for m in REF.finditer(text):
        count += 1
        spans.append(m.span())
        key, path, scope, link = m["key"], m["path"], m["scope"], m["link"]
        where = f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: reference `{key}` ({_label(path, scope)})"
        if not KEY_LEN[0] <= len(key) <= KEY_LEN[1]:
            errors.append(
                f"{where}: the key is {len(key)} characters; use {KEY_LEN[0]}-{KEY_LEN[1]} verbatim characters of the line"
            )
        if link != prefix + path:
            errors.append(
                f"{where}: the link goes to '{link}', expected '{prefix + path}' (from {doc}): write ]({prefix + path})"
            )
        full = os.path.join(root, path)
        if not os.path.isfile(full):
            errors.append(
                f"{where}: {path} does not exist: point the reference at the file that holds the key now"
            )
            continue
        if path not in sources:
            try:
                sources[path] = Source(full)
            except SyntaxError as e:
                sources[path] = e
        src = sources[path]
        if isinstance(src, SyntaxError):
            errors.append(
                f"{where}: {path} does not parse ({src.msg}, line {src.lineno}), so its scopes are unknown"
            )
            continue
        everywhere = src.occurrences(key)
        now = (
            f"the key is now in {src.where(everywhere)} of {path}"
            if everywhere
            else f"the key occurs nowhere in {path}: update the key to the code's current text"
        )
        if scope is None:
            if len(everywhere) == 1 and src.scope_at[everywhere[0]] is None:
                continue
            if len(everywhere) > 1:
                errors.append(
                    f"{where}: the key occurs {len(everywhere)} times in {path} ({src.where(everywhere)}): "
                    f"name its scope ([{path} {SEP} SCOPE]) or lengthen the key with more of the line"
                )
            elif everywhere:
                errors.append(
                    f"{where}: the key is not at module level; {now}: write [{_label(path, src.scope_at[everywhere[0]])}]"
                )
            else:
                errors.append(f"{where}: {now}")
            continue
        if scope not in src.spans:
            errors.append(
                f"{where}: {path} has no def/class `{scope}`"
                + (' and no `if __name__ == "__main__":` block' if scope == MAIN else "")
                + f" (renamed or moved?); {now}"
            )
            continue
        found = src.occurrences(key, scope)
        if not found:
            errors.append(f"{where}: the key is not in `{scope}` of {path}; {now}")
        elif len(found) > 1:
            errors.append(
                f"{where}: the key occurs {len(found)} times in `{scope}` of {path} "
                f"(lines {', '.join(map(str, found))}): lengthen it with more of the line until it is unique"
            )
        elif src.scope_at[found[0]] != scope:
            inner = src.scope_at[found[0]]
            errors.append(
                f"{where}: the key is in `{inner}` (line {found[0]}), nested inside `{scope}`: "
                f"name the innermost scope, [{_label(path, inner)}]"
            )
    for m in LOOSE.finditer(text):
        if not any(a <= m.start() < b for a, b in spans):
            line_no = text.count("\n", 0, m.start()) + 1
            errors.append(
                f"{doc}:{line_no}: '{m.group(0)}' looks like a line reference; line numbers go stale: write "
                f"`KEY` ([PATH {SEP} SCOPE]({prefix}PATH)), KEY a verbatim piece of the line, SCOPE its function"
            )
    return errors, count


def fix_doc(doc: str, text: str, root: str = ROOT) -> tuple[str, int]:
    """Rewrite the scope of the references whose key now occurs exactly once in its file, in another scope than
    written (the code moved between functions); (new text, how many moved). Ambiguous or vanished keys are left
    for a person (the check still names them)."""
    moved, sources = 0, {}

    def rescope(m):
        nonlocal moved
        full = os.path.join(root, m["path"])
        if not os.path.isfile(full):
            return m.group(0)
        if m["path"] not in sources:
            try:
                sources[m["path"]] = Source(full)
            except SyntaxError:
                sources[m["path"]] = None
        src = sources[m["path"]]
        found = src.occurrences(m["key"]) if src else []
        if len(found) != 1 or src.scope_at[found[0]] == m["scope"]:
            return m.group(0)
        moved += 1
        a, b = m.span("label")
        s = m.start()
        return m.group(0)[: a - s] + _label(m["path"], src.scope_at[found[0]]) + m.group(0)[b - s :]

    return REF.sub(rescope, text), moved


@pytest.mark.parametrize("doc", doc_files())
def test_code_references_point_at_their_key(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        errors, _ = check_doc(doc, f.read())
    assert not errors, "stale code references:\n" + "\n".join(errors)


@pytest.mark.parametrize("doc", ALGO_DOCS)
def test_algorithm_docs_reference_the_code(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        _, count = check_doc(doc, f.read())
    assert count >= MIN_REFS, (
        f"{doc} has {count} checked code references; its implementation details need {MIN_REFS}+"
    )


SCRIPT = """\
import torch

ADV_CLIP = 5.0


class Trainer:
    def step(self, advantages, args):
        return advantages.clamp(-args.adv_clip_max)

    def log(self, stats):
        print(stats["loss"])
        print(stats["loss"])


def rollout(model):
    def inner(x):
        return model.denoise(x, steps=10)

    return inner


if __name__ == "__main__":
    for it in range(num_iterations):
        trainer.optimizer.zero_grad()
"""


def _check(doc, text, root):
    errors, count = check_doc(doc, text, root)
    assert all(e.startswith(f"{doc}:1") for e in errors), errors
    assert all("\n" not in e for e in errors), errors
    return errors, count


def test_checker_passes_references_by_scope_and_catches_every_mistake(tmp_path):
    """The checker itself: good references pass (method, nested def, __main__ block, module level, README's
    root-relative link); each kind of mistake fails with a message that says what is wrong and where the key is."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    for good in [
        "`advantages.clamp(-args` ([script.py › Trainer.step](../script.py))",
        "`model.denoise(x, steps=10)` ([script.py › inner](../script.py))",
        "`for it in range(num_iterations)` ([script.py › main](../script.py))",
        "`ADV_CLIP = 5.0` ([script.py](../script.py))",
        "`class Trainer:` ([script.py › Trainer](../script.py))",
        "`advantages.clamp(-args`\n([script.py ›\nTrainer.step](../script.py))",  # wrapped by the editor
    ]:
        assert _check("docs/x.md", good, str(tmp_path)) == ([], 1), good
    readme = "`advantages.clamp(-args` ([script.py › Trainer.step](script.py))"
    assert _check("README.md", readme, str(tmp_path)) == ([], 1)
    for bad, expect in [
        (  # the code moved to another function: the message names where the key is now
            "`advantages.clamp(-args` ([script.py › rollout](../script.py))",
            "not in `rollout` of script.py; the key is now in `Trainer.step` (line 8)",
        ),
        (
            "`advantages.clamp(+args` ([script.py › Trainer.step](../script.py))",
            "occurs nowhere in script.py: update the key",
        ),
        (
            '`print(stats["loss"])` ([script.py › Trainer.log](../script.py))',
            "occurs 2 times in `Trainer.log` of script.py (lines 11, 12): lengthen it",
        ),
        (
            "`advantages.clamp(-args` ([script.py › Trainer.stop](../script.py))",
            "no def/class `Trainer.stop` (renamed or moved?); the key is now in `Trainer.step` (line 8)",
        ),
        (
            "`for it in range(num_iterations)` ([script.py › mian](../script.py))",
            "no def/class `mian`",
        ),
        (
            "`model.denoise(x, steps=10)` ([script.py › rollout](../script.py))",
            "nested inside `rollout`: name the innermost scope, [script.py › inner]",
        ),
        (
            "`advantages.clamp(-args` ([script.py](../script.py))",
            "not at module level; the key is now in `Trainer.step` (line 8) of script.py",
        ),
        ("`advantages.clamp(-args` ([nothere.py › f](../nothere.py))", "nothere.py does not exist"),
        (
            "`advantages.clamp(-args` ([script.py › Trainer.step](script.py))",
            "expected '../script.py'",
        ),
        ("`clamp(` ([script.py › Trainer.step](../script.py))", "the key is 6 characters"),
        ("see [script.py:2](../script.py)", "'script.py:2' looks like a line reference"),
        ("see [the clamp](../script.py#L2)", "'](../script.py#L2)' looks like a line reference"),
        ("`advantages.clamp(-args` ([script.py](../script.py#L8))", "looks like a line reference"),
    ]:
        errors, _ = _check("docs/x.md", bad, str(tmp_path))
        assert any(expect in e for e in errors), (bad, errors)


def test_main_scope_needs_a_main_block(tmp_path):
    """`main` is the `if __name__ == "__main__":` block; a module without one has no `main` scope."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "lib.py").write_text("def f():\n    return torch.zeros(3)\n")
    errors, _ = _check("docs/x.md", "`torch.zeros(3)` ([lib.py › main](../lib.py))", str(tmp_path))
    assert len(errors) == 1 and 'no `if __name__ == "__main__":` block' in errors[0], errors
    assert "the key is now in `f` (line 2)" in errors[0], errors


def test_fix_moves_a_reference_to_the_scope_its_key_is_in_now(tmp_path):
    """--fix rewrites the scope of a key found once in the file; leaves correct and ambiguous references alone."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    good = "`advantages.clamp(-args` ([script.py › Trainer.step](../script.py))"
    moved = "`advantages.clamp(-args` ([script.py › rollout](../script.py))"
    assert fix_doc("docs/x.md", moved, str(tmp_path)) == (good, 1)
    assert fix_doc("docs/x.md", good, str(tmp_path)) == (good, 0)
    unscoped = "`advantages.clamp(-args` ([script.py](../script.py))"
    assert fix_doc("docs/x.md", unscoped, str(tmp_path)) == (good, 1)
    module = "`ADV_CLIP = 5.0` ([script.py](../script.py))"
    assert fix_doc(
        "docs/x.md", "`ADV_CLIP = 5.0` ([script.py › main](../script.py))", str(tmp_path)
    ) == (module, 1)
    wrapped = "`advantages.clamp(-args`\n([script.py › rollout](../script.py))"
    assert fix_doc("docs/x.md", wrapped, str(tmp_path)) == (good.replace("` (", "`\n("), 1)
    twice = '`print(stats["loss"])` ([script.py › rollout](../script.py))'
    assert fix_doc("docs/x.md", twice, str(tmp_path)) == (twice, 0)


# ---- names: a function or identifier a doc puts in backticks is one the code has
FENCE = re.compile(
    r"^\s*```.*?^\s*```", re.M | re.S
)  # fenced blocks: commands and snippets, not names
SPAN = re.compile(r"`([^`\n]+)`")
CALL = re.compile(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*)([A-Za-z_]\w*)\(")  # name( or a.b.name(
SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")  # a bare snake_case identifier: step_policy
# a span followed by ([PATH ...](...)) is a REF key, checked above
REF_AFTER = re.compile(r"\s+\(\[")
WORD = re.compile(r"[A-Za-z_]\w*")
CODE_GLOBS = ["*.py", "common/**/*.py", "benchmarks/**/*.py", "tests/**/*.py", "docs/**/*.py"]
# Names of other code that the docs name on purpose, each with where it comes from. A new one goes here, with its
# source; a name of ours that the code no longer has is fixed in the doc instead.
OTHER_CODE = {
    # libraries, named without their module
    "linspace": "torch / numpy",
    "named_parameters": "torch.nn.Module",
    "get_model_state_dict": "torch.distributed.checkpoint.state_dict",
    "init_process_group": "torch.distributed",
    "set_requires_gradient_sync": "torch FSDP2",
    "LoraConfig": "peft",
    "disable_adapters": "peft",
    "load_lora_weights": "diffusers",
    "set_seed": "accelerate",
    "get_action_and_value": "CleanRL's ppo.py",
    # the released code the algorithm pages set beside ours
    "compute_text_embeddings": "NVlabs/DiffusionNFT scripts/train_nft_sd3.py",
    "PerPromptStatTracker": "NVlabs/DiffusionNFT and Flow-GRPO flow_grpo/stat_tracking.py",
    "EMAModuleWrapper": "NVlabs/DiffusionNFT flow_grpo/ema.py",
    "return_decay": "NVlabs/DiffusionNFT scripts/train_nft_sd3.py",
    "eval_freq": "NVlabs/DiffusionNFT config/base.py",
    "save_freq": "NVlabs/DiffusionNFT config/base.py",
    "test_batch_size": "NVlabs/DiffusionNFT config/nft.py",
    "sd3_geneval": "NVlabs/DiffusionNFT config/nft.py",
    "sd3_pickscore": "NVlabs/DiffusionNFT config/nft.py",
    "sd3_ocr": "NVlabs/DiffusionNFT config/nft.py",
    "sd3_multi_reward": "NVlabs/DiffusionNFT config/nft.py",
    "pickscore_flux": "Flow-GRPO config/grpo.py",
    "geneval_sd3_fast_nocfg": "Flow-GRPO config/grpo.py",
    "pickscore_sd3_fast_nocfg": "Flow-GRPO config/grpo.py",
    "pickscore_sd3_fast": "Flow-GRPO config/grpo.py",
    "flow_grpo_step": "G²RPO's official code",
    "create_app": "yifan123/reward-server app_geneval.py (flow_grpo's GenEval server)",
    "geneval_score": "yifan123/flow_grpo flow_grpo/rewards.py",
    "geneval_sd3_no_cfg_1node": "scxue/advantage_weighted_matching config/dgx_awm.py",
    "ocr_sd3_no_cfg_1node": "scxue/advantage_weighted_matching config/dgx_awm.py",
    "pickscore_sd3_no_cfg_1node": "scxue/advantage_weighted_matching config/dgx_awm.py",
    "gradient_accumulation_steps": "scxue/advantage_weighted_matching config/dgx_awm.py",
    "log_prob_ref": "scxue/advantage_weighted_matching scripts/train_sd3_awm.py",
    "awm_trainer": "verl-project/verl-omni examples/awm_trainer",
    "awm_kl_coef": "verl-project/verl-omni examples/awm_trainer (its README)",
    "ref_kl_coef": "verl-project/verl-omni examples/awm_trainer (its README)",
    # a placeholder the usage page's `--scorer NAME=MODULE:FACTORY` spelling names
    "FACTORY": "docs/usage.md's placeholder for a user's own function",
    # a former name of ours, said as such ("until 2026-12-01 ... `ode_complete`")
    "ode_complete": "g2rpo.md's history of the batched completions",
}


def code_names(root: str = ROOT) -> tuple[set[str], set[str]]:
    """(defined, mentioned) over the repository's Python files but this one. defined: every def and class, parameter and
    assigned name (a call's target); mentioned: those, every attribute, keyword and imported name, and the words
    of every string that is not a docstring (dict keys, metric names)."""
    defined, mentioned = set(), set()
    for pattern in CODE_GLOBS:
        for path in glob.glob(os.path.join(root, pattern), recursive=True):
            if os.path.basename(path) == os.path.basename(__file__):
                continue  # this file's examples name stale names on purpose
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
            docstrings = (
                set()
            )  # ast.walk visits a def before its body: its docstring is known in time
            for n in ast.walk(tree):
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    first = n.body[0] if n.body else None
                    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                        docstrings.add(id(first.value))
                    if not isinstance(n, ast.Module):
                        defined.add(n.name)
                elif isinstance(n, ast.arg):
                    defined.add(n.arg)
                elif isinstance(n, ast.Name):
                    (defined if isinstance(n.ctx, ast.Store) else mentioned).add(n.id)
                elif isinstance(n, ast.Attribute):
                    mentioned.add(n.attr)
                elif isinstance(n, ast.keyword) and n.arg:
                    mentioned.add(n.arg)
                elif isinstance(n, ast.alias):
                    mentioned.add((n.asname or n.name).split(".")[0])
                elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                    if id(n) not in docstrings:
                        mentioned.update(WORD.findall(n.value))
    return defined, mentioned | defined


def unknown_names(doc: str, text: str, defined: set[str], mentioned: set[str]) -> list[str]:
    """The backticked names of `text` that the code does not have, one message each.

    Checked, in every `inline code` span outside fenced blocks and REF keys (those are verbatim code, checked by
    test_code_references_point_at_their_key):
    - a call, `name(` or `name(...)`: name must be a def, class, parameter or assigned name of the repository, a
      Python builtin, or in OTHER_CODE. A qualified call `a.b(` is checked only when `a` is one of our classes
      (`EMA.update(`): a method on a value (`x0.double(`, `h.start(`) or a library module (`torch.randint(`)
      cannot be resolved without running the code, so it is left alone;
    - a span that is one bare snake_case identifier (`step_policy`, `kl_weight`): it must occur in the code (as a
      name, attribute, keyword, or a word of a non-docstring string: a dict key or metric name), or in OTHER_CODE.
    Flags (`--kl-weight`), metrics with a slash (`train/r_mean`), paths and expressions are not single identifiers,
    and are not checked here."""
    known = defined | set(dir(builtins)) | set(OTHER_CODE)
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep the line numbers
    errors = []
    for m in SPAN.finditer(text):
        span, line = m.group(1), text.count("\n", 0, m.start()) + 1
        if REF_AFTER.match(text, m.end()):
            continue
        for c in CALL.finditer(span):
            qualifier, name = c.group(1), c.group(2)
            receiver = qualifier.split(".")[0]
            if qualifier and not (receiver[:1].isupper() and receiver in defined):
                continue
            if name not in known:
                errors.append(
                    f"{doc}:{line}: `{span}` calls {name}(), which the code does not define"
                )
        if SNAKE.fullmatch(span) and span not in mentioned and span not in OTHER_CODE:
            errors.append(f"{doc}:{line}: `{span}` occurs nowhere in the code")
    return errors


def test_docs_name_only_what_the_code_has():
    """A renamed or deleted function leaves no doc naming it (issue #56 item 5: `step_log_prob`, `optimizer_step`
    and `grad_sync` outlived their code in design.md, g2rpo.md and densegrpo.md). The rule is unknown_names'."""
    defined, mentioned = code_names()
    errors = []
    for doc in doc_files():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            errors += unknown_names(doc, f.read(), defined, mentioned)
    assert not errors, (
        "names the code does not have (fix the doc, or add another codebase's name to "
        + ("OTHER_CODE with its source):\n" + "\n".join(errors))
    )


def test_the_name_check_catches_a_stale_name_and_passes_the_rest(tmp_path):
    """The checker itself, on a one-file repository: defined calls, builtins, methods on values, library calls,
    REF keys, fenced blocks and OTHER_CODE names pass; an undefined call, an undefined method of one of our classes
    and a bare name the code lacks fail, each with its line."""
    (tmp_path / "lib.py").write_text(
        'class EMA:\n    def update(self):\n        return {"old_policy": 1}\n\n\n'
        "def step_policy(x, timer):\n    timer()\n    return x\n"
    )
    defined, mentioned = code_names(str(tmp_path))
    good = (
        '`step_policy(x, timer)`, `timer("reward")`, `len(x)`, `EMA.update()`, `x0.double()`,\n'
        "`torch.randint(3, (2,))`, `old_policy`, `step_policy`, `LoraConfig(r=32)`, `sd3_geneval`,\n"
        "`step_log_prob(x` ([lib.py › step_policy](../lib.py))\n```\nstep_log_prob(x)\n```\n"
    )
    assert unknown_names("docs/x.md", good, defined, mentioned) == []
    bad = "ok\n`step_log_prob(backbone, ...)`, `EMA.blend()`\nthen `optimizer_step` and `--kl-weight`\n"
    errors = unknown_names("docs/x.md", bad, defined, mentioned)
    assert errors == [
        "docs/x.md:2: `step_log_prob(backbone, ...)` calls step_log_prob(), which the code does not define",
        "docs/x.md:2: `EMA.blend()` calls blend(), which the code does not define",
        "docs/x.md:3: `optimizer_step` occurs nowhere in the code",
    ], errors


if (
    __name__ == "__main__"
):  # python tests/test_docs.py [--fix] : rescope references after code moved
    import sys

    fix = "--fix" in sys.argv
    for doc in doc_files():
        path = os.path.join(ROOT, doc)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new, moved = fix_doc(doc, text)
        if moved and fix:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        errors, _ = check_doc(doc, new)
        print(
            f"{doc}: {moved} reference(s) {'moved to their new scope' if fix else 'would move to a new scope'}, "
            f"{len(errors)} left to fix by hand"
        )
        for e in errors:
            print("  " + e)


def readme_timings() -> tuple[list[float], list[float]]:
    """Seconds of every run of the README's two commands in docs/data/readme_timings_*/: the main command's
    /usr/bin/time elapsed time (main_command*.txt); pytest's own total where the log's first line says it ran on two
    workers of one torch thread each (pyproject.toml's -n 2, what `pytest` runs since 1f14a08; the older logs timed
    one process); and the figures issue #67 quotes from a newcomer's machine (issue67_newcomer.txt, not a log: its
    header says so)."""
    main, tests = [], []
    for folder in sorted(glob.glob(os.path.join(ROOT, "docs", "data", "readme_timings_*"))):
        for path in sorted(glob.glob(os.path.join(folder, "*.txt"))):
            text = open(path, encoding="utf-8").read()
            name = os.path.basename(path)
            if name.startswith("main_command"):
                m, s = re.search(
                    r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([\d.]+)", text
                ).groups()
                main.append(60 * int(m) + float(s))
            elif name.startswith("pytest") and "one torch thread each" in text.split("\n")[0]:
                tests.append(float(re.search(r"passed.* in ([\d.]+)s", text)[1]))
            elif name == "issue67_newcomer.txt":
                tests.append(
                    float(re.search(r"^pytest, two workers: .* in ([\d.]+) s$", text, re.M)[1])
                )
                m, s = re.search(
                    r"^python flowgrpo_baseline.py: (\d+) min (\d+) s", text, re.M
                ).groups()
                main.append(60 * int(m) + float(s))
    return main, tests


def readme_ranges(readme: str) -> dict[str, tuple[int, int]]:
    """The README's cost range of each command, in minutes: `8 to 12 minutes` in the command's comment."""
    ranges = {}
    for command, pattern in (
        ("main", r"python flowgrpo_baseline.py +# .*?: (\d+) to (\d+) minutes on 2 CPU cores"),
        ("tests", r"\npytest +# .*?: (\d+) to (\d+) minutes on 2 cores"),
    ):
        found = re.search(pattern, readme)
        assert found, (
            f"README.md has no `{command}` range (a comment '...: N to M minutes on 2 ... cores')"
        )
        ranges[command] = (int(found[1]), int(found[2]))
    return ranges


def test_the_readmes_time_ranges_contain_every_logged_run():
    """README's "N to M minutes" for the main command and for pytest holds every run of docs/data/readme_timings_*/
    (readme_timings), and each end is within a minute of the runs' extremes, so a range stays as narrow as they
    allow and moves when a new log falls outside it."""
    ranges = readme_ranges(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read())
    main, tests = readme_timings()
    assert len(main) >= 3 and len(tests) >= 3, (main, tests)
    for command, seconds in (("main", main), ("tests", tests)):
        lo, hi = (60 * minutes for minutes in ranges[command])
        said = (command, ranges[command], sorted(seconds))
        assert lo <= min(seconds) and max(seconds) <= hi, said
        assert min(seconds) - 60 < lo and hi < max(seconds) + 60, said
