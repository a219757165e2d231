"""The fork test: docs/variants.md's worked example (MixGRPO's sliding window), applied to a copy of
flowgrpo_baseline.py exactly as the page shows it, runs and trains the window's steps. If the script's
shape moves under the page (a renamed line, a moved block), this fails and names the anchor."""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import ROOT, read_metrics, run_main, tiny_flags  # noqa: E402

# where each of the page's four code blocks goes: (anchor line in the script, how)
PLACES = [
    ('    """START END of the window\'s steps (default: 0 and num_steps // 2)"""\n', "after"),
    ("    if args.sde_window_size:\n        # Flow-GRPO-Fast: the window replaces", "before"),
    ("        trained = range(w0, w0 + args.trained_steps)\n", "before"),
    (
        "                    a = args.noise_level if j in trained or not args.sde_window_size "
        "else 0.0\n",
        "replace",
    ),
]


def page_blocks() -> list[str]:
    with open(os.path.join(ROOT, "docs", "variants.md")) as f:
        page = f.read()
    example = page[page.index("## Worked example") :]
    return re.findall(r"```python\n(.*?)```", example, re.S)[:4]


def forked_script(tmp_path) -> tuple[str, int]:
    """(the copy with the page's four blocks applied, the lines those blocks add or change)"""
    with open(os.path.join(ROOT, "flowgrpo_baseline.py")) as f:
        text = f.read()
    blocks = page_blocks()
    assert len(blocks) == 4, "docs/variants.md's worked example lost a code block"
    for (anchor, how), block in zip(PLACES, blocks):
        assert text.count(anchor) == 1, f"the script no longer has this line once: {anchor!r}"
        new = {"after": anchor + block, "before": block + anchor, "replace": block}[how]
        text = text.replace(anchor, new)
    path = tmp_path / "mixgrpo.py"
    path.write_text(text)
    return str(path), sum(len(b.splitlines()) for b in blocks)


def test_the_pages_mixgrpo_window_runs_and_trains_the_moving_window(
    tiny_sd3, tmp_path, monkeypatch
):
    script, lines = forked_script(tmp_path)
    assert lines <= 20, f"the variant takes {lines} lines, the page promises a short one"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red square\na blue circle\n")
    flags = tiny_flags(tiny_sd3, tmp_path, str(prompts))
    i = flags.index("--timestep-fraction")
    flags = flags[:i] + flags[i + 2 :]  # the window chooses the trained steps
    monkeypatch.syspath_prepend(ROOT)  # the copy imports the repository's common/
    mix = ["--mix-window-size", "1", "--mix-window-every", "1", "--num-iterations", "3"]
    run_main(script, *flags, *mix, "--learning-rate", "1e-2")
    rows = [r for r in read_metrics(tmp_path / "run") if not r.get("final")]
    trained = [sorted(k for k in r if k.startswith("steps/kept/")) for r in rows]
    # 3 steps, a window of 1 moving every iteration over steps 0 and 1 (the last is never in it)
    assert trained == [["steps/kept/0"], ["steps/kept/1"], ["steps/kept/0"]]
    assert all(r["ratio/first_minibatch_max_dev"] < 1e-5 for r in rows)
