"""The end of a run, from what it wrote: its pictures and the one line of its held-out metric."""

from __future__ import annotations

import glob
import os

from common.plumbing.evaluation import Panel
from common.plumbing.plots import before_after, learning_curve, step_heatmap


def run_pictures(run_dir: str, history: list[dict], title: str) -> list[str]:
    """learning_curve.png, steps_heatmap.png (when drawn) and before_after.png (the first and last
    samples/eval_*.npz: a resumed run still compares with its start); -> the paths written."""
    written = [os.path.join(run_dir, "learning_curve.png")]
    learning_curve(history, written[0], title)
    heatmap = os.path.join(run_dir, "steps_heatmap.png")
    if step_heatmap(history, "steps/", heatmap, f"{title}: per-step diagnostics"):
        written.append(heatmap)
    panels = sorted(glob.glob(os.path.join(run_dir, "samples", "eval_*.npz")))
    if len(panels) < 2:
        return written
    try:
        first, last = Panel.load(panels[0]), Panel.load(panels[-1])
    except (OSError, ValueError, TypeError, KeyError) as e:  # not a panel this code wrote
        print(
            f"warning: before_after.png not drawn: {panels[0]} or {panels[-1]} is not an "
            f"evaluation panel ({e.__class__.__name__}: {str(e)[:160]})"
        )
        return written
    written.append(os.path.join(run_dir, "before_after.png"))
    before_after(first, last, written[-1], title)
    return written


def summary_line(history: list[dict]) -> str:
    """'held-out eval/accuracy: 0.471 ± 0.018 at iteration 0 -> 0.590 ± 0.017 at iteration 30'."""
    key = "eval/accuracy" if any("eval/accuracy" in h for h in history) else "eval/reward_mean"
    evals = [h for h in history if key in h]
    if not evals:
        return f"held-out {key}: no evaluation"

    def at(h):
        se = f" ± {h['eval/accuracy_se']:.3f}" if "eval/accuracy_se" in h else ""
        return f"{h[key]:.3f}{se} at iteration {h['iteration']}"

    return f"held-out {key}: {at(evals[0])} -> {at(evals[-1])}"
