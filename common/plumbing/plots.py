"""Every picture a run saves: line charts, the learning curve, per-step heat maps (matplotlib), and
captioned image grids with before/after comparisons (PIL, so that every image pixel is the sampled
pixel).

matplotlib is used through `matplotlib.figure.Figure` only, never `pyplot`: no global figure state,
no GUI backend, nothing leaks between calls (a Figure is garbage-collected like any object;
`savefig` renders with Agg).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from common.plumbing.utils import atomic_file

DPI = 100
GREEN, RED, NEUTRAL, BACKGROUND = (0, 170, 60), (215, 25, 30), (150, 150, 150), (255, 255, 255)
# Per-step metrics as logged (steps/<metric>/<step>), in step_heatmap's panel order: first where the
# update comes from (--grad-share-every), then what the algorithm hands each step (DenseGRPO's dense
# reward), then the PPO ratio.
STEP_METRICS = (
    "grad_share",
    "grad_norm",
    "abs_adv",
    "kept",
    "dR_abs",
    "dR_zero",
    "ratio",
    "ratio_std",
    "clipfrac",
    "kl",
)
STEP_LABELS = {
    "grad_share": "share of the gradient, g_j . g / |g|^2",
    "grad_norm": "gradient norm |g_j|",
    "abs_adv": "mean |advantage|",
    "kept": "share of transitions kept",
    "dR_abs": "mean |ΔR_t|",
    "dR_zero": "share of ΔR_t = 0",
    "ratio": "mean ratio",
    "ratio_std": "std of the ratio",
    "clipfrac": "clip fraction",
    "kl": "KL to the reference",
}


def _figure(width_px: int, height_px: int, **kwargs):
    from matplotlib.figure import Figure

    return Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, **kwargs)


def _points(xs, ys) -> tuple[list, list]:
    """The (x, y) pairs whose y is a finite number (None and NaN are gaps in the log, not zeros)."""
    pts = [(x, float(y)) for x, y in zip(xs, ys) if y is not None and np.isfinite(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


# ------------------------------------------------------------------------------ charts (matplotlib)
def line_plot(
    series: dict[str, tuple[list, list]],
    path: str,
    xlabel: str,
    ylabel: str,
    title: str = "",
    size=(640, 400),
) -> None:
    """One line per series ({name: (xs, ys)}; None/NaN values skipped), with a legend, saved as a
    PNG of `size` px."""
    fig = _figure(*size, layout="constrained")
    ax = fig.add_subplot()
    for name, (xs, ys) in series.items():
        x, y = _points(xs, ys)
        ax.plot(x, y, marker="o" if len(x) <= 30 else None, markersize=3, linewidth=1.5, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    atomic_file(path, fig.savefig)


def learning_curve(history: list[dict], path: str, title: str, size=(900, 520)) -> None:
    """The run at a glance, against the iteration: the training reward (`train/reward_mean`, left
    axis) and the held-out accuracy (`eval/accuracy`, else `eval/reward_mean`; right axis) with a
    band of +-1 standard error (`eval/accuracy_se`) and one thin line per category
    (`eval/accuracy_<category>`). Either side may be absent."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(*size, layout="constrained")
    ax = fig.add_subplot()
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    handles = []
    tr_x, tr_y = _points(
        [h.get("iteration") for h in history], [h.get("train/reward_mean") for h in history]
    )
    if tr_x:
        # one iteration's reward jumps by +-0.1 (a few prompts per iteration): the raw points faint,
        # the trend bold
        handles += ax.plot(
            tr_x,
            tr_y,
            color="tab:blue",
            linewidth=0.8,
            alpha=0.35,
            marker=".",
            label="training reward (mean of the rollouts)",
        )
        w = running_window(len(tr_y))
        if w > 1:
            handles += ax.plot(
                tr_x,
                running_mean(tr_y, w),
                color="tab:blue",
                linewidth=2.2,
                label=f"training reward, running mean of {w} iterations",
            )
        ax.set_ylabel("training reward", color="tab:blue")
        ax.tick_params(axis="y", colors="tab:blue")
    else:
        ax.set_yticks([])
    ev_key = "eval/accuracy" if any("eval/accuracy" in h for h in history) else "eval/reward_mean"
    evals = [h for h in history if h.get(ev_key) is not None]
    if evals:
        ev = ax.twinx() if tr_x else ax  # one axis only when there is nothing to share it with
        x, y = _points([h["iteration"] for h in evals], [h[ev_key] for h in evals])
        se = [h.get("eval/accuracy_se") for h in evals] if ev_key == "eval/accuracy" else []
        if se and all(s is not None for s in se):
            lo, hi = np.array(y) - np.array(se, float), np.array(y) + np.array(se, float)
            handles.append(
                ev.fill_between(
                    x, lo, hi, color="tab:red", alpha=0.15, linewidth=0, label="+-1 standard error"
                )
            )
        cats = sorted(
            {
                k[len("eval/accuracy_") :]
                for h in evals
                for k in h
                if k.startswith("eval/accuracy_") and k != "eval/accuracy_se"
            }
        )
        palette = [
            "tab:orange",
            "tab:green",
            "tab:purple",
            "tab:brown",
            "tab:pink",
            "tab:olive",
            "tab:cyan",
        ]
        for i, c in enumerate(cats):
            cx, cy = _points(
                [h["iteration"] for h in evals], [h.get(f"eval/accuracy_{c}") for h in evals]
            )
            handles += ev.plot(
                cx,
                cy,
                color=palette[i % len(palette)],
                linewidth=1.0,
                linestyle="--",
                marker=".",
                markersize=3,
                label=f"accuracy: {c.replace('_', ' ')}",
            )
        name = (
            "held-out accuracy (mean of the categories)"
            if ev_key == "eval/accuracy"
            else "held-out reward"
        )
        handles += ev.plot(
            x, y, color="tab:red", linewidth=2.2, marker="o", markersize=4, label=name
        )
        ev.set_ylabel(name.split(" (")[0], color="tab:red")
        ev.tick_params(axis="y", colors="tab:red")
        if ev_key == "eval/accuracy":
            ev.set_ylim(-0.02, 1.02)
    if not handles:
        ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes)
    else:
        fig.legend(
            handles=handles,
            fontsize="small",
            loc="outside lower center",
            ncols=min(3, len(handles)),
        )
    ax.set_title(title)
    atomic_file(path, fig.savefig)


def running_window(n: int) -> int:
    """Iterations in the learning curve's running mean: a tenth of the run, 3 to 10
    (1 below 6 points: none)."""
    return 1 if n < 6 else max(3, min(10, n // 10))


def running_mean(ys: list[float], w: int) -> list[float]:
    """Trailing mean of the last w points (fewer at the start)."""
    c = np.cumsum([0.0, *ys])
    return [(c[i + 1] - c[max(0, i + 1 - w)]) / (i + 1 - max(0, i + 1 - w)) for i in range(len(ys))]


def _differ(vs: list[float]) -> bool:
    """Values that differ by more than float noise (1e-6 relative: an on-policy ratio
    is 1 +- 1e-9)."""
    return max(vs) - min(vs) > 1e-6 * max(1.0, abs(max(vs)), abs(min(vs)))


def varies_over_steps(cells: dict[tuple[int, int], float]) -> bool:
    """Does a per-step metric differ between the steps of some iteration? (Flow-GRPO's |advantage|
    is the same at every step of a trajectory, the ratio is 1 at every step on-policy, the KL 0 with
    beta 0: nothing to see.)"""
    by_it: dict[int, list[float]] = {}
    for (_, i), v in cells.items():
        by_it.setdefault(i, []).append(v)
    return any(len(vs) > 1 and _differ(vs) for vs in by_it.values())


def step_heatmap(
    history: list[dict], key_prefix: str, path: str, title: str, panel_px=(440, 320)
) -> list[str]:
    """Per-step metrics as heat maps, step index (rows) x iteration (columns), one panel per metric
    that differs between the steps (`varies_over_steps`) among the keys
    `<key_prefix><metric>/<step index>` (e.g. `steps/grad_share/3`, step 3's share of the gradient),
    each with its colour bar; the others are named in one line under the panels, with their value
    when it is one. Iterations without a value are grey. The gradient share's and the mean ratio's
    colours are centred on 0 and 1; GRPO-Guard (arXiv 2510.22319) reads over-optimisation off the
    per-step ratio mean and spread drifting apart. -> the drawn panels' titles, in order."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    prefix = key_prefix.rstrip("/") + "/"
    cells: dict[str, dict[tuple[int, int], float]] = {}
    for h in history:
        for k, v in h.items():
            if not k.startswith(prefix) or v is None:
                continue
            metric, _, j = k[len(prefix) :].rpartition("/")
            if metric and j.isdigit():
                cells.setdefault(metric, {})[(int(j), int(h["iteration"]))] = float(v)
    present = [m for m in STEP_METRICS if m in cells] + sorted(set(cells) - set(STEP_METRICS))
    metrics = [m for m in present if varies_over_steps(cells[m])]
    if not metrics:  # nothing to see: no file (a picture a student opens and finds empty)
        return []
    flat = []  # the panels not drawn: the same at every step
    for m in present:
        if m not in metrics:
            values = list(cells[m].values())
            flat.append(STEP_LABELS.get(m, m) + ("" if _differ(values) else f" ({values[0]:.3g})"))
    ncols = min(3, max(1, len(metrics)))
    nrows = max(1, math.ceil(len(metrics) / ncols))
    fig = _figure(
        panel_px[0] * ncols, panel_px[1] * nrows + (40 if flat else 0), layout="constrained"
    )
    fig.suptitle(title)
    if flat:
        fig.supxlabel(
            "the same at every step, not drawn: " + "; ".join(flat), fontsize="small", wrap=True
        )
    its = sorted({i for c in cells.values() for _, i in c})
    titles = []
    for n, metric in enumerate(metrics):
        ax = fig.add_subplot(nrows, ncols, n + 1)
        steps = 1 + max(j for j, _ in cells[metric])
        grid = np.full((steps, its[-1] - its[0] + 1), np.nan)
        for (j, i), v in cells[metric].items():
            grid[j, i - its[0]] = v
        finite = grid[np.isfinite(grid)]
        norm, centre = None, {"ratio": 1.0, "grad_share": 0.0}.get(metric)
        if centre is not None and finite.size and finite.min() < centre < finite.max():
            norm = TwoSlopeNorm(vcenter=centre, vmin=finite.min(), vmax=finite.max())
        cmap = "coolwarm" if norm is not None else "viridis"
        im = ax.imshow(
            grid,
            aspect="auto",
            origin="lower",
            interpolation="nearest",
            cmap=cmap,
            norm=norm,
            extent=(its[0] - 0.5, its[-1] + 0.5, -0.5, steps - 0.5),
        )
        im.cmap.set_bad("0.85")
        label = STEP_LABELS.get(metric, metric)
        titles.append(label)
        ax.set_title(label, fontsize="medium")
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("trained step index")
        ax.set_yticks(
            range(steps) if steps <= 12 else np.linspace(0, steps - 1, 6).round().astype(int)
        )
        bar = fig.colorbar(im, ax=ax)
        bar.formatter.set_useOffset(False)  # ratios as 0.9999, not as -0.0001 under a "+1"
    atomic_file(path, fig.savefig)
    return titles


# -------------------------------------------------------------------------------- image grids (PIL)
@lru_cache(maxsize=8)
def font(size: int) -> ImageFont.FreeTypeFont:
    """DejaVu Sans, which ships inside matplotlib, so captions look the same on every machine."""
    from matplotlib import font_manager

    return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)


def _cell_size(res: int) -> int:
    """Displayed image side: small images are upscaled by pixel repetition to >= 128 px (32 px toy
    images x4: what you see is what the scorer sees); large ones shrunk to 256 px so a 16-image grid
    stays a few MB."""
    return res * max(1, 128 // res) if res < 128 else min(res, 256)


def _to_cell(image: np.ndarray, side: int) -> Image.Image:
    im = Image.fromarray(image)
    resample = Image.NEAREST if side >= image.shape[0] else Image.LANCZOS
    return im.resize((side, side), resample)


def _wrap(text: str, fnt, width: int) -> list[str]:
    """Greedy word wrap to `width` px."""
    lines, line = [], ""
    for word in text.split():
        cand = f"{line} {word}".strip()
        if not line or fnt.getlength(cand) <= width:
            line = cand
        else:
            lines.append(line)
            line = word
    return lines + ([line] if line else [])


def _caption_lines(
    prompt: str, reward: float | None, verdict: bool | None, fnt, width: int
) -> list[str]:
    lines = _wrap(prompt, fnt, width)
    extra = [] if reward is None else [f"reward {reward:.2f}"]
    if verdict is not None:
        extra.append("correct" if verdict else "wrong")
    return lines + ([", ".join(extra)] if extra else [])


def captioned_grid(
    images,
    prompts: list[str],
    verdicts: list | None = None,
    rewards: list | None = None,
    ncol: int = 4,
    header: str = "",
) -> Image.Image:
    """A grid of images, each with its prompt (wrapped) and reward printed underneath and, where a
    verdict is given (the toy world's strict scorer), a green frame for correct or a red frame for
    wrong.

    images: uint8 [N, H, W, 3] (or anything `toyworld.to_uint8` takes); verdicts / rewards: one per
    image or None.
    """
    from common.toyworld import to_uint8

    x = to_uint8(images)
    n, side = len(x), _cell_size(x.shape[1])
    if len(prompts) != n:
        raise ValueError(f"captioned_grid: got {n} images but {len(prompts)} prompts")
    frame, pad = max(3, side // 32), 6
    fnt = font(max(12, side // 10))
    line_h = int(fnt.size * 1.25)
    captions = [
        _caption_lines(
            p,
            None if rewards is None else rewards[i],
            None if verdicts is None else verdicts[i],
            fnt,
            side + 2 * frame,
        )
        for i, p in enumerate(prompts)
    ]
    cap_h = line_h * max((len(c) for c in captions), default=1) + pad
    cell_w, cell_h = side + 2 * frame + 2 * pad, side + 2 * frame + cap_h + 2 * pad
    ncol = max(1, min(ncol, n))
    nrow = max(1, math.ceil(n / ncol))
    head_font = font(max(13, side // 9))
    head_lines = [
        w for line in header.splitlines() for w in _wrap(line, head_font, ncol * cell_w - 2 * pad)
    ]
    head_h = int(head_font.size * 1.35) * len(head_lines) + (2 * pad if head_lines else 0)
    grid = Image.new("RGB", (ncol * cell_w, head_h + nrow * cell_h), BACKGROUND)
    d = ImageDraw.Draw(grid)
    for k, line in enumerate(head_lines):
        d.text((pad, pad + k * int(head_font.size * 1.35)), line, fill=(0, 0, 0), font=head_font)
    for i in range(n):
        r, c = divmod(i, ncol)
        x0, y0 = c * cell_w + pad, head_h + r * cell_h + pad
        v = None if verdicts is None else verdicts[i]
        color = NEUTRAL if v is None else (GREEN if v else RED)
        d.rectangle([x0, y0, x0 + side + 2 * frame - 1, y0 + side + 2 * frame - 1], fill=color)
        grid.paste(_to_cell(x[i], side), (x0 + frame, y0 + frame))
        for k, line in enumerate(captions[i]):
            last = k == len(captions[i]) - 1 and (rewards is not None or v is not None)
            d.text(
                (x0, y0 + side + 2 * frame + pad // 2 + k * line_h),
                line,
                font=fnt,
                fill=(color if last and v is not None else (0, 0, 0)),
            )
    return grid


def accuracy_line(metrics: dict) -> str:
    """'single 0.75, counting 0.23, ... | overall 0.47' from evaluation metrics (else the mean
    reward)."""
    cats = [k for k in metrics if k.startswith("eval/accuracy_") and k != "eval/accuracy_se"]
    if "eval/accuracy" not in metrics:
        return f"reward {metrics.get('eval/reward_mean', float('nan')):.3f}"
    parts = [f"{k[len('eval/accuracy_') :].replace('_', ' ')} {metrics[k]:.2f}" for k in cats]
    se = metrics.get("eval/accuracy_se")
    overall = f"overall {metrics['eval/accuracy']:.3f}" + (
        f" +- {se:.3f}" if se is not None else ""
    )
    return ", ".join(parts) + " | " + overall


def before_after(before, after, path: str, title: str = "", ncol: int = 2) -> Image.Image:
    """The same prompts and seeds from the starting model (left of each pair) and the final model
    (right), with the evaluation's per-category accuracy before and after in the title. before /
    after: `common.plumbing.evaluation.Panel`s (the fixed subset an evaluation draws; they must hold
    the same prompts and seeds). Saves to `path`."""
    if list(before.prompts) != list(after.prompts) or list(before.seeds) != list(after.seeds):
        raise ValueError(
            "before_after: the two panels hold different prompts or seeds (were they made from the "
            "same evaluation prompts and seeds_per_prompt?)"
        )
    cells = list(zip(before.images, after.images))  # one cell per prompt: both images, one caption
    head = [title] if title else []
    head += [
        f"before (iteration {before.iteration}): {accuracy_line(before.metrics)}",
        f"after (iteration {after.iteration}):  {accuracy_line(after.metrics)}",
        "each pair: left = starting model, right = final model; same prompt and seed",
    ]
    side = _cell_size(before.images.shape[1])
    frame, pad, gap = max(3, side // 32), 6, max(4, side // 16)
    fnt = font(max(12, side // 10))
    line_h = int(fnt.size * 1.25)
    pair_w = 2 * (side + 2 * frame) + gap

    def verdict_word(v):
        return "" if v is None else (" correct" if v else " wrong")

    captions = []
    for k, p in enumerate(before.prompts):
        vb = None if before.verdicts is None else before.verdicts[k]
        va = None if after.verdicts is None else after.verdicts[k]
        captions.append(
            _wrap(p, fnt, pair_w)
            + [
                f"{before.rewards[k]:.2f}{verdict_word(vb)} -> "
                f"{after.rewards[k]:.2f}{verdict_word(va)}"
            ]
        )
    cap_h = line_h * max(len(c) for c in captions) + pad
    cell_w, cell_h = pair_w + 4 * pad, side + 2 * frame + cap_h + 2 * pad
    n = len(cells)
    ncol = max(1, min(ncol, n))
    nrow = math.ceil(n / ncol)
    head_font = font(max(13, side // 9))
    head_step = int(head_font.size * 1.35)
    width = max(ncol * cell_w, pad * 2 + int(max(head_font.getlength(h) for h in head)))
    head_h = head_step * len(head) + 2 * pad
    out = Image.new("RGB", (width, head_h + nrow * cell_h), BACKGROUND)
    d = ImageDraw.Draw(out)
    for k, line in enumerate(head):
        d.text((pad, pad + k * head_step), line, fill=(0, 0, 0), font=head_font)
    for k, (b_img, a_img) in enumerate(cells):
        r, c = divmod(k, ncol)
        x0, y0 = c * cell_w + 2 * pad, head_h + r * cell_h + pad
        for m, (img, panel) in enumerate(((b_img, before), (a_img, after))):
            v = None if panel.verdicts is None else panel.verdicts[k]
            color = NEUTRAL if v is None else (GREEN if v else RED)
            xm = x0 + m * (side + 2 * frame + gap)
            d.rectangle([xm, y0, xm + side + 2 * frame - 1, y0 + side + 2 * frame - 1], fill=color)
            out.paste(_to_cell(np.asarray(img), side), (xm + frame, y0 + frame))
        for m, line in enumerate(captions[k]):
            d.text(
                (x0, y0 + side + 2 * frame + pad // 2 + m * line_h), line, font=fnt, fill=(0, 0, 0)
            )
    atomic_file(path, out.save)
    return out
