"""The docs point at real lines of the code.

A line reference in docs/*.md or README.md is written

    `KEY` ([PATH:N](../PATH#LN))        (in README.md, at the repo root: `KEY` ([PATH:N](PATH#LN)))

where PATH is a file of the repo, N a 1-based line number and KEY a short verbatim piece of line N. This test checks
every such reference: the file exists, label and link agree, line N exists and contains KEY. When the code moves,
the failure names the doc, the reference and the line(s) where KEY is now, so the fix is a number edit
(`python tests/test_docs.py --fix` makes it where the key sits on exactly one line). Any other
`file.py:N` or `#LN` link is an error too, so no unchecked line number can creep in. No torch import: this is fast.
"""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `KEY` ([PATH:N](PREFIX PATH#LN)); whitespace (even a line break) allowed between the key and the link
REF = re.compile(
    r"`(?P<key>[^`\n]+)`\s+\(\[(?P<path>[\w./-]+):(?P<n>\d+)\]"
    r"\((?P<link>[\w./-]+)#L(?P<ln>\d+)\)\)"
)
# anything that looks like a line reference: a `file.py:N` label or a `#LN` link target
LOOSE = re.compile(r"[\w-]\.py:\d+|\]\([^)\s]*#L\d+\)")
ALGO_DOCS = ["docs/flowgrpo.md", "docs/g2rpo.md", "docs/densegrpo.md"]
MIN_REFS = 10
KEY_LEN = (10, 60)


def doc_files():
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md"] + docs


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") else lines


def check_doc(doc: str, text: str, root: str = ROOT) -> tuple[list[str], int]:
    """(error messages, number of references) for the markdown `text` of `doc` (a path relative to root)."""
    prefix = os.path.relpath(root, os.path.dirname(os.path.join(root, doc))).replace(os.sep, "/")
    prefix = "" if prefix == "." else prefix + "/"
    errors, spans, count = [], [], 0
    for m in REF.finditer(text):
        count += 1
        spans.append(m.span())
        key, path, n, link, ln = m["key"], m["path"], int(m["n"]), m["link"], int(m["ln"])
        where = f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: reference `{key}` ({path}:{n})"
        if not KEY_LEN[0] <= len(key) <= KEY_LEN[1]:
            errors.append(
                f"{where}: the key is {len(key)} characters; use {KEY_LEN[0]}-{KEY_LEN[1]}"
            )
        if link != prefix + path:
            errors.append(
                f"{where}: the link goes to '{link}', expected '{prefix + path}' (from {doc})"
            )
        if ln != n:
            errors.append(f"{where}: the label says line {n} but the link says #L{ln}")
        full = os.path.join(root, path)
        if not os.path.isfile(full):
            errors.append(f"{where}: {path} does not exist")
            continue
        lines = read_lines(full)
        found = [i + 1 for i, line in enumerate(lines) if key in line]
        now = (
            f"the key is now on line(s) {', '.join(map(str, found))} of {path}"
            if found
            else f"the key occurs nowhere in {path}: update the key or the reference"
        )
        if not 1 <= n <= len(lines):
            errors.append(f"{where}: {path} has only {len(lines)} lines; {now}")
        elif key not in lines[n - 1]:
            errors.append(
                f"{where}: line {n} of {path} does not contain the key "
                f"(it reads: {lines[n - 1].strip()[:100]!r}); {now}"
            )
    for m in LOOSE.finditer(text):
        if not any(a <= m.start() < b for a, b in spans):
            line_no = text.count("\n", 0, m.start()) + 1
            errors.append(
                f"{doc}:{line_no}: '{m.group(0)}' looks like a line reference but is not in the checked "
                f"form `KEY` ([PATH:N]({prefix}PATH#LN))"
            )
    return errors, count


@pytest.mark.parametrize("doc", doc_files())
def test_line_references_point_at_their_key(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        errors, _ = check_doc(doc, f.read())
    assert not errors, "stale line references:\n" + "\n".join(errors)


@pytest.mark.parametrize("doc", ALGO_DOCS)
def test_algorithm_docs_reference_the_code(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        _, count = check_doc(doc, f.read())
    assert count >= MIN_REFS, (
        f"{doc} has {count} checked line references; its implementation details need {MIN_REFS}+"
    )


def test_checker_catches_a_stale_number(tmp_path):
    """The checker itself: a wrong number fails and names the line the key is on now; a right one passes."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "script.py").write_text("a = 1\nadvantages.clamp(-args.adv_clip_max)\n")
    good = "`advantages.clamp(-args` ([script.py:2](../script.py#L2))"
    assert check_doc("docs/x.md", good, str(tmp_path)) == ([], 1)
    for bad, expect in [
        (
            "`advantages.clamp(-args` ([script.py:1](../script.py#L1))",
            "now on line(s) 2 of script.py",
        ),
        ("`advantages.clamp(-args` ([script.py:2](../script.py#L1))", "the link says #L1"),
        ("`advantages.clamp(-args` ([script.py:9](../script.py#L9))", "has only 2 lines"),
        ("`advantages.clamp(-args` ([script.py:2](script.py#L2))", "expected '../script.py'"),
        ("`advantages.clamp(-args` ([nothere.py:2](../nothere.py#L2))", "does not exist"),
        ("see [script.py:2](../script.py#L2)", "not in the checked form"),
    ]:
        errors, _ = check_doc("docs/x.md", bad, str(tmp_path))
        assert any(expect in e for e in errors), (bad, errors)
        assert all(e.startswith("docs/x.md:1") for e in errors), errors
    # README.md sits at the root: its links have no ../
    readme = "`advantages.clamp(-args` ([script.py:2](script.py#L2))"
    assert check_doc("README.md", readme, str(tmp_path)) == ([], 1)
    # --fix renumbers a moved key, and leaves a correct one alone
    stale = "`advantages.clamp(-args` ([script.py:1](../script.py#L1))"
    assert fix_doc("docs/x.md", stale, str(tmp_path)) == (good, 1)
    assert fix_doc("docs/x.md", good, str(tmp_path)) == (good, 0)


def fix_doc(doc: str, text: str, root: str = ROOT) -> tuple[str, int]:
    """Renumber the references whose key now sits on exactly one line of its file; (new text, how many moved).
    Ambiguous or vanished keys are left for a person (the test still names them)."""
    moved = 0

    def renumber(m):
        nonlocal moved
        full = os.path.join(root, m["path"])
        if not os.path.isfile(full):
            return m.group(0)
        found = [i + 1 for i, line in enumerate(read_lines(full)) if m["key"] in line]
        if len(found) != 1 or found[0] == int(m["n"]) == int(m["ln"]):
            return m.group(0)
        moved += 1
        return (
            m.group(0)
            .replace(f":{m['n']}]", f":{found[0]}]")
            .replace(f"#L{m['ln']})", f"#L{found[0]})")
        )

    return REF.sub(renumber, text), moved


if (
    __name__ == "__main__"
):  # python tests/test_docs.py --fix : renumber references after the code moved
    import sys

    for doc in doc_files():
        path = os.path.join(ROOT, doc)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new, moved = fix_doc(doc, text)
        if moved and "--fix" in sys.argv:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        errors, _ = check_doc(doc, new)
        print(
            f"{doc}: {moved} reference(s) {'renumbered' if '--fix' in sys.argv else 'would be renumbered'}, "
            f"{len(errors)} left to fix by hand"
        )
        for e in errors:
            print("  " + e)
