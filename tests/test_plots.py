"""common/plumbing/plots.py: every chart is a PNG of the promised size, whatever the log holds; grids frame correct
images green and wrong ones red (read back from the pixels); the before/after image pairs the same prompts."""

import math
import os

import numpy as np
import pytest
from PIL import Image

from common import toyworld
from common.plumbing.evaluation import Panel
from common.plumbing.plots import (
    GREEN,
    RED,
    STEP_LABELS,
    STEP_METRICS,
    before_after,
    captioned_grid,
    learning_curve,
    line_plot,
    step_heatmap,
)

# run_pictures is what this file tests: not replaced by tests/conftest.py
pytestmark = pytest.mark.pictures


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


def history(train=True, evals=True, steps=True, n=12):
    rows = []
    for it in range(n):
        h = {"iteration": it}
        if train:
            h["train/reward_mean"] = 0.4 + 0.01 * it if it != 3 else None  # a gap in the log
        if evals and it % 4 == 0:
            h.update(
                {
                    "eval/accuracy": 0.4 + 0.01 * it,
                    "eval/accuracy_se": 0.03,
                    "eval/accuracy_single": 0.7,
                    "eval/accuracy_counting": 0.2 + 0.01 * it,
                    "eval/reward_mean": 0.5,
                }
            )
        if steps:
            for j in range(3):
                h.update({f"steps/ratio/{j}": 1 + 0.01 * (j - 1) * it, f"steps/kl/{j}": 0.001 * it})
        rows.append(h)
    return rows


def test_line_plot_skips_missing_values(tmp_path):
    path = tmp_path / "l.png"
    line_plot(
        {"a": ([0, 1, 2], [0.1, None, 0.3]), "b": ([0, 1], [float("nan"), 0.2]), "empty": ([], [])},
        str(path),
        "x",
        "y",
        "t",
    )
    assert png_size(path) == (640, 400)
    line_plot({}, str(path), "x", "y", size=(300, 200))
    assert png_size(path) == (300, 200)


@pytest.mark.parametrize(
    "train,evals", [(True, True), (True, False), (False, True), (False, False)]
)
def test_learning_curve_with_or_without_train_and_eval_rows(tmp_path, train, evals):
    path = tmp_path / "c.png"
    learning_curve(history(train, evals), str(path), "run")
    assert png_size(path) == (900, 520)


def test_learning_curve_reward_only_evaluation(tmp_path):
    """Real-model runs log eval/reward_mean and no accuracy: the right axis shows the reward."""
    rows = [
        {
            "iteration": i,
            "train/reward_mean": 0.1 * i,
            **({"eval/reward_mean": 0.2} if i % 2 else {}),
        }
        for i in range(5)
    ]
    learning_curve(rows, str(tmp_path / "c.png"), "run")
    assert png_size(tmp_path / "c.png") == (900, 520)


@pytest.mark.parametrize("metrics", [STEP_METRICS, ("ratio", "kl"), ()])
def test_step_heatmap_one_panel_per_metric(tmp_path, metrics):
    # iteration 5 missing (grey column)
    rows = [
        {
            "iteration": it,
            "train/reward_mean": 0.5,
            **{f"steps/{m}/{j}": 1.0 + 0.01 * it * j for m in metrics for j in range(4)},
        }
        for it in range(0, 10)
        if it != 5
    ]
    path = tmp_path / "h.png"
    titles = step_heatmap(rows, "steps/", str(path), "per-step diagnostics")
    assert titles == [STEP_LABELS[m] for m in metrics]
    if not metrics:  # nothing differs between steps: no picture a student opens and finds empty
        assert not path.exists()
        return
    ncols = min(3, max(1, len(metrics)))
    assert png_size(path) == (440 * ncols, 320 * max(1, math.ceil(len(metrics) / ncols)))
    # every logged metric (tests/test_training.py) has its panel title
    assert set(STEP_LABELS) == set(STEP_METRICS)
    # a metric that is the same at every step of every iteration (the KL with beta 0; Flow-GRPO's |advantage|, equal
    # at every step of a trajectory) tells nothing per step: it is named under the panels, not drawn
    flat = [
        {
            "iteration": it,
            "steps/kl/0": 0.0,
            "steps/kl/1": 0.0,
            "steps/abs_adv/0": 0.5 + it,
            "steps/abs_adv/1": 0.5 + it,
            "steps/grad_share/0": 0.1 * it,
            "steps/grad_share/1": 1 - 0.1 * it,
        }
        for it in range(3)
    ]
    assert step_heatmap(flat, "steps/", str(tmp_path / "f.png"), "t") == [STEP_LABELS["grad_share"]]
    # one panel and the line naming the other two
    assert png_size(tmp_path / "f.png") == (
        440,
        320 + 40,
    )


def test_the_learning_curves_running_mean_shows_the_trend_through_the_noise():
    from common.plumbing.plots import running_mean, running_window

    assert (
        running_window(5) == 1
        and running_window(30) == 3
        and running_window(60) == 6
        and running_window(500) == 10
    )
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    # a climb hidden by +-0.1 jumps
    noisy = [0.5 + 0.002 * i + (0.1 if i % 2 else -0.1) for i in range(60)]
    smooth = running_mean(noisy, running_window(len(noisy)))
    assert (
        max(abs(a - b) for a, b in zip(smooth[6:], smooth[7:]))
        < 0.02
        < min(abs(a - b) for a, b in zip(noisy, noisy[1:]))
    )


def frame_pixels(cell: np.ndarray, color) -> int:
    return int(np.all(cell == np.array(color, np.uint8), axis=-1).sum())


def test_grid_frames_correct_green_and_wrong_red():
    """A render of its own prompt is correct, the same render under a contradicting prompt is wrong; the grid's
    frames say so. (The uncaptioned grid before issue 21 had no frame: both counts were 0.)"""
    scene = toyworld.render_array("a photo of a red circle", seed=3)
    images = np.stack([scene, scene])
    prompts = ["a photo of a red circle", "a photo of two blue squares"]
    _, verdicts = toyworld.score(images, prompts)
    assert verdicts.tolist() == [True, False]
    grid = np.asarray(captioned_grid(images, prompts, verdicts.tolist(), [1.0, 0.0], ncol=2))
    left, right = grid[:, : grid.shape[1] // 2], grid[:, grid.shape[1] // 2 :]
    ring = 4 * 128 * 3  # the frame around a 128 px image is at least 3 px wide
    assert frame_pixels(left, GREEN) > ring and frame_pixels(left, RED) == 0
    assert frame_pixels(right, RED) > ring and frame_pixels(right, GREEN) == 0
    assert grid.shape[1] >= 2 * 128 + 4 * 3  # upscaled 32 -> 128 px
    no_verdict = np.asarray(captioned_grid(images, prompts, None, [1.0, 0.0], ncol=2))
    assert frame_pixels(no_verdict, GREEN) == frame_pixels(no_verdict, RED) == 0


def make_panel(prompts, it, flip=False):
    imgs = toyworld.render_batch(prompts, list(range(len(prompts))))
    verdicts = [bool(v) != flip for v in toyworld.score(imgs, prompts)[1]]
    metrics = {
        "eval/accuracy_single": 0.5,
        "eval/accuracy": 0.5,
        "eval/accuracy_se": 0.05,
        "eval/reward_mean": 0.4,
    }
    return Panel(
        imgs, list(prompts), list(range(len(prompts))), [0.5] * len(prompts), verdicts, metrics, it
    )


def test_before_after_pairs_the_same_prompts_and_panel_round_trips(tmp_path):
    prompts = [p for c in toyworld.CATEGORIES for p in toyworld.all_prompts(c)[:2]]
    before, after = make_panel(prompts, 0), make_panel(prompts, 60, flip=True)
    before.save(str(tmp_path / "p.npz"))
    again = Panel.load(str(tmp_path / "p.npz"))
    assert np.array_equal(again.images, before.images) and again.prompts == before.prompts
    assert (
        again.verdicts == before.verdicts
        and again.metrics == before.metrics
        and again.iteration == 0
    )
    out = before_after(again, after, str(tmp_path / "ba.png"), "run")
    assert png_size(tmp_path / "ba.png") == out.size
    arr = np.asarray(out)
    # correct before, wrong after
    assert frame_pixels(arr, GREEN) > 0 and frame_pixels(arr, RED) > 0
    with pytest.raises(ValueError, match="different prompts"):
        before_after(before, make_panel(prompts[::-1], 60), str(tmp_path / "x.png"))


def test_run_pictures_draws_curve_heatmap_and_before_after_from_the_run_folder(tmp_path):
    from common.plumbing.run import run_pictures

    prompts = [p for c in toyworld.CATEGORIES for p in toyworld.all_prompts(c)[:1]]
    os.makedirs(tmp_path / "samples")
    for it, flip in ((0, False), (5, True), (10, True)):
        make_panel(prompts, it, flip).save(str(tmp_path / "samples" / f"eval_{it:05d}.npz"))
    written = run_pictures(str(tmp_path), history(), "run")
    assert [os.path.basename(w) for w in written] == [
        "learning_curve.png",
        "steps_heatmap.png",
        "before_after.png",
    ]
    for w in written:
        png_size(w)
    os.remove(tmp_path / "samples" / "eval_00005.npz")
    os.remove(tmp_path / "samples" / "eval_00010.npz")
    # one evaluation, no step metrics
    assert len(run_pictures(str(tmp_path), history(steps=False), "run")) == 1


def test_run_logger_sends_captioned_panels_to_wandb(tmp_path, monkeypatch):
    """--track: a list of (image, caption) pairs becomes a list of captioned wandb.Images (wandb faked here)."""
    import sys
    import types

    from common.plumbing.run import RunLogger

    logged = {}
    fake = types.ModuleType("wandb")
    fake.Image = lambda im, caption=None: ("Image", im.size, caption)
    fake.Settings = lambda **kw: kw  # RunLogger bounds wandb.init with init_timeout
    fake.init = lambda **kw: types.SimpleNamespace(
        log=lambda d, step: logged.update(d, step=step), finish=lambda: 0
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    panel = make_panel(["a photo of a red circle", "a photo of two blue squares"], 0)
    logger = RunLogger(str(tmp_path), True, True, {}, "p", None, "n")
    logger.log({"iteration": 3}, {"eval/samples": panel.grid(), "eval/panel": panel.captioned()})
    assert logged["step"] == 3 and logged["eval/samples"][0] == "Image"
    assert [c for _, _, c in logged["eval/panel"]] == [
        "a photo of a red circle (seed 0): reward 0.50, correct",
        "a photo of two blue squares (seed 1): reward 0.50, correct",
    ]
    assert logged["eval/panel"][0][1] == (128, 128)


def test_a_one_iteration_heatmap_has_whole_iterations_on_its_axis(tmp_path, monkeypatch):
    """A first iteration's heat map spans -0.5..0.5: its axis says "0", not -0.5, -0.4, ... run together."""
    import common.plumbing.plots as plots

    figures = []
    real = plots._figure
    monkeypatch.setattr(
        plots, "_figure", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1]
    )
    rows = [{"iteration": 0, **{f"steps/ratio/{j}": 1.0 + 0.01 * j for j in range(4)}}]
    assert step_heatmap(rows, "steps/", str(tmp_path / "h.png"), "one iteration")
    ticks = [t for t in figures[0].axes[0].get_xticks() if -0.5 <= t <= 0.5]
    assert ticks == [0.0]
