"""Every picture a run saves: charts (matplotlib through `Figure` only: no global pyplot state, no
GUI backend) and captioned image grids (PIL, so that every image pixel is the sampled pixel)."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from common.plumbing.utils import atomic_file

DPI = 100
GREEN, RED, NEUTRAL, BACKGROUND = (0, 170, 60), (215, 25, 30), (150, 150, 150), (255, 255, 255)
BLACK, PAD = (0, 0, 0), 6
# Per-step metrics as logged (steps/<metric>/<step>), in step_heatmap's panel order: where the
# update comes from, what the algorithm hands each step (DenseGRPO's dense reward), the PPO ratio.
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
STEP_METRICS = tuple(STEP_LABELS)
PALETTE = "tab:orange tab:green tab:purple tab:brown tab:pink tab:olive tab:cyan".split()


def _figure(width_px: int, height_px: int, **kwargs):
    from matplotlib.figure import Figure

    return Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, **kwargs)


def _points(xs, ys) -> tuple[list, list]:
    """The (x, y) pairs whose y is a finite number (None and NaN are gaps in the log, not zeros)."""
    pts = [(x, float(y)) for x, y in zip(xs, ys) if y is not None and np.isfinite(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


# ------------------------------------------------------------------------------ charts (matplotlib)
def line_plot(series: dict, path: str, xlabel: str, ylabel: str, title="", size=(640, 400)) -> None:
    """One line per series ({name: (xs, ys)}; None/NaN skipped), saved as a PNG of `size` px."""
    fig = _figure(*size, layout="constrained")
    ax = fig.add_subplot()
    for name, (xs, ys) in series.items():
        x, y = _points(xs, ys)
        ax.plot(x, y, marker="o" if len(x) <= 30 else None, markersize=3, linewidth=1.5, label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    atomic_file(path, fig.savefig)


def learning_curve(history: list[dict], path: str, title: str, size=(900, 520)) -> None:
    """The training reward (left axis) and the held-out accuracy +- its standard error and per
    category, else the held-out reward (right axis), against the iteration; either may be absent."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(*size, layout="constrained")
    ax = fig.add_subplot()
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # 1 run: "0"
    ax.grid(alpha=0.3)
    handles = []
    its = [h.get("iteration") for h in history]
    tr_x, tr_y = _points(its, [h.get("train/reward_mean") for h in history])
    if tr_x:
        # one iteration's reward jumps by +-0.1: the raw points faint, the trend bold
        label = "training reward (mean of the rollouts)"
        style = dict(color="tab:blue", linewidth=0.8, alpha=0.35, marker=".")
        handles += ax.plot(tr_x, tr_y, label=label, **style)
        w = running_window(len(tr_y))
        if w > 1:
            label = f"training reward, running mean of {w} iterations"
            handles += ax.plot(tr_x, running_mean(tr_y, w), color="tab:blue", lw=2.2, label=label)
        ax.set_ylabel("training reward", color="tab:blue")
        ax.tick_params(axis="y", colors="tab:blue")
    else:
        ax.set_yticks([])
    acc = any("eval/accuracy" in h for h in history)
    ev_key = "eval/accuracy" if acc else "eval/reward_mean"
    evals = [h for h in history if h.get(ev_key) is not None]
    if evals:
        ev = ax.twinx() if tr_x else ax  # one axis only when there is nothing to share it with
        ev_its = [h["iteration"] for h in evals]
        x, y = _points(ev_its, [h[ev_key] for h in evals])
        se = [h.get("eval/accuracy_se") for h in evals] if acc else []
        if se and all(s is not None for s in se):
            lo, hi = np.array(y) - np.array(se, float), np.array(y) + np.array(se, float)
            style = dict(color="tab:red", alpha=0.15, lw=0, label="+-1 standard error")
            handles.append(ev.fill_between(x, lo, hi, **style))
        cats = {k for h in evals for k in h if k.startswith("eval/accuracy_")}
        for i, key in enumerate(sorted(cats - {"eval/accuracy_se"})):
            cx, cy = _points(ev_its, [h.get(key) for h in evals])
            label = f"accuracy: {key[len('eval/accuracy_') :].replace('_', ' ')}"
            style = dict(linewidth=1.0, linestyle="--", marker=".", markersize=3)
            handles += ev.plot(cx, cy, color=PALETTE[i % len(PALETTE)], label=label, **style)
        name = "held-out accuracy (mean of the categories)" if acc else "held-out reward"
        handles += ev.plot(x, y, color="tab:red", lw=2.2, marker="o", markersize=4, label=name)
        ev.set_ylabel(name.split(" (")[0], color="tab:red")
        ev.tick_params(axis="y", colors="tab:red")
        if acc:
            ev.set_ylim(-0.02, 1.02)
    if not handles:
        ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes)
    else:
        ncols = min(3, len(handles))
        fig.legend(handles=handles, fontsize="small", loc="outside lower center", ncols=ncols)
    ax.set_title(title)
    atomic_file(path, fig.savefig)


def running_window(n: int) -> int:
    """Points in the learning curve's running mean: a tenth of the run, 3 to 10 (1 below 6)."""
    return 1 if n < 6 else max(3, min(10, n // 10))


def running_mean(ys: list[float], w: int) -> list[float]:
    """Trailing mean of the last w points (fewer at the start)."""
    c = np.cumsum([0.0, *ys])
    return [(c[i + 1] - c[max(0, i + 1 - w)]) / (i + 1 - max(0, i + 1 - w)) for i in range(len(ys))]


def _differ(vs: list[float]) -> bool:
    """Values that differ by more than float noise (an on-policy ratio is 1 +- 1e-9)."""
    return max(vs) - min(vs) > 1e-6 * max(1.0, abs(max(vs)), abs(min(vs)))


def step_heatmap(
    history: list[dict], key_prefix: str, path: str, title: str, panel_px=(440, 320)
) -> list[str]:
    """Heat maps of `<key_prefix><metric>/<step>`, step x iteration, one per metric that differs
    between steps (the others named under them); -> their titles, and no file when there is none."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    prefix = key_prefix.rstrip("/") + "/"
    cells: dict[str, dict[tuple[int, int], float]] = {}
    for h in history:
        for k, v in h.items():
            metric, _, j = k[len(prefix) :].rpartition("/")
            if k.startswith(prefix) and v is not None and metric and j.isdigit():
                cells.setdefault(metric, {})[(int(j), int(h["iteration"]))] = float(v)
    present = [m for m in STEP_METRICS if m in cells] + sorted(set(cells) - set(STEP_METRICS))
    metrics, flat = [], []  # flat: the same at every step (Flow-GRPO's |advantage|, KL at beta 0)
    for m in present:
        by_it: dict[int, list[float]] = {}
        for (_, i), v in cells[m].items():
            by_it.setdefault(i, []).append(v)
        if any(len(vs) > 1 and _differ(vs) for vs in by_it.values()):
            metrics.append(m)
        else:
            values = list(cells[m].values())
            flat.append(STEP_LABELS.get(m, m) + ("" if _differ(values) else f" ({values[0]:.3g})"))
    if not metrics:
        return []
    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    height = panel_px[1] * nrows + (40 if flat else 0)
    fig = _figure(panel_px[0] * ncols, height, layout="constrained")
    fig.suptitle(title)
    if flat:
        line = "the same at every step, not drawn: " + "; ".join(flat)
        fig.supxlabel(line, fontsize="small", wrap=True)
    its = sorted({i for c in cells.values() for _, i in c})
    for n, metric in enumerate(metrics):
        ax = fig.add_subplot(nrows, ncols, n + 1)
        steps = 1 + max(j for j, _ in cells[metric])
        grid = np.full((steps, its[-1] - its[0] + 1), np.nan)
        for (j, i), v in cells[metric].items():
            grid[j, i - its[0]] = v
        finite = grid[np.isfinite(grid)]
        # diverging colours around 1 and 0: GRPO-Guard reads over-optimisation off the ratio
        norm, centre = None, {"ratio": 1.0, "grad_share": 0.0}.get(metric)
        if centre is not None and finite.size and finite.min() < centre < finite.max():
            norm = TwoSlopeNorm(vcenter=centre, vmin=finite.min(), vmax=finite.max())
        extent = (its[0] - 0.5, its[-1] + 0.5, -0.5, steps - 0.5)
        cmap = "coolwarm" if norm is not None else "viridis"
        im = ax.imshow(
            grid, cmap, norm, aspect="auto", interpolation="nearest", origin="lower", extent=extent
        )
        im.cmap.set_bad("0.85")
        ax.set_title(STEP_LABELS.get(metric, metric), fontsize="medium")
        ax.set(xlabel="iteration", ylabel="trained step index")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # 1 run: "0"
        few = steps <= 12
        ax.set_yticks(range(steps) if few else np.linspace(0, steps - 1, 6).round().astype(int))
        bar = fig.colorbar(im, ax=ax)
        bar.formatter.set_useOffset(False)  # ratios as 0.9999, not as -0.0001 under a "+1"
    atomic_file(path, fig.savefig)
    return [STEP_LABELS.get(m, m) for m in metrics]


# -------------------------------------------------------------------------------- image grids (PIL)
@lru_cache(maxsize=8)
def font(size: int) -> ImageFont.FreeTypeFont:
    """DejaVu Sans, which ships inside matplotlib, so captions look the same on every machine."""
    from matplotlib import font_manager

    return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)


def _cell_size(res: int) -> int:
    """Displayed image side: small images repeat pixels up to >= 128 px (what the scorer sees),
    large ones shrink to 256 px so that a 16-image grid stays a few MB."""
    return res * max(1, 128 // res) if res < 128 else min(res, 256)


def _to_cell(image: np.ndarray, side: int) -> Image.Image:
    resample = Image.NEAREST if side >= image.shape[0] else Image.LANCZOS
    return Image.fromarray(image).resize((side, side), resample)


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


def _color(verdict) -> tuple:
    return NEUTRAL if verdict is None else (GREEN if verdict else RED)


def _draw_cells(cells, head, ncol, side, margin=PAD, gap=0, wrap_head=True) -> Image.Image:
    """The grid of both pictures. cells: ([(image, frame colour)], prompt, (last caption line, its
    colour) or None). The header lines are wrapped to the grid (wrap_head) or widen it."""
    fnt, head_font = font(max(12, side // 10)), font(max(13, side // 9))
    frame, line_h, head_step = max(3, side // 32), int(fnt.size * 1.25), int(head_font.size * 1.35)
    k = len(cells[0][0]) if cells else 1
    framed = side + 2 * frame
    images_w = k * framed + (k - 1) * gap
    captions = [
        [(line, BLACK) for line in _wrap(prompt, fnt, images_w)] + ([last] if last else [])
        for _, prompt, last in cells
    ]
    cap_h = line_h * max((len(c) for c in captions), default=1) + PAD
    cell_w, cell_h = images_w + 2 * margin, framed + cap_h + 2 * PAD
    ncol = max(1, min(ncol, len(cells)))
    nrow = max(1, math.ceil(len(cells) / ncol))
    width = ncol * cell_w
    if wrap_head:
        head = [w for line in head for w in _wrap(line, head_font, width - 2 * PAD)]
    else:
        width = max(width, 2 * PAD + int(max(head_font.getlength(h) for h in head)))
    head_h = head_step * len(head) + (2 * PAD if head else 0)
    out = Image.new("RGB", (width, head_h + nrow * cell_h), BACKGROUND)
    d = ImageDraw.Draw(out)
    for n, line in enumerate(head):
        d.text((PAD, PAD + n * head_step), line, fill=BLACK, font=head_font)
    for i, (images, _, _) in enumerate(cells):
        r, c = divmod(i, ncol)
        x0, y0 = c * cell_w + margin, head_h + r * cell_h + PAD
        for m, (image, color) in enumerate(images):
            xm = x0 + m * (framed + gap)
            d.rectangle([xm, y0, xm + framed - 1, y0 + framed - 1], fill=color)
            out.paste(_to_cell(np.asarray(image), side), (xm + frame, y0 + frame))
        for n, (line, color) in enumerate(captions[i]):
            d.text((x0, y0 + framed + PAD // 2 + n * line_h), line, font=fnt, fill=color)
    return out


def captioned_grid(
    images, prompts: list[str], verdicts=None, rewards=None, ncol: int = 4, header: str = ""
) -> Image.Image:
    """Images (anything `toyworld.to_uint8` takes) with their prompt and reward underneath, framed
    green (correct) or red (wrong) where a verdict is given; verdicts / rewards: one per image."""
    from common.toyworld import to_uint8

    x = to_uint8(images)
    if len(prompts) != len(x):
        raise ValueError(f"captioned_grid: got {len(x)} images but {len(prompts)} prompts")
    cells = []
    for i, prompt in enumerate(prompts):
        v = None if verdicts is None else verdicts[i]
        extra = [] if rewards is None else [f"reward {rewards[i]:.2f}"]
        extra += [] if v is None else ["correct" if v else "wrong"]
        last = (", ".join(extra), BLACK if v is None else _color(v)) if extra else None
        cells.append(([(x[i], _color(v))], prompt, last))
    return _draw_cells(cells, header.splitlines(), ncol, _cell_size(x.shape[1]))


def accuracy_line(metrics: dict) -> str:
    """'single 0.75, counting 0.23, ... | overall 0.47' from evaluation metrics, else the reward."""
    if "eval/accuracy" not in metrics:
        return f"reward {metrics.get('eval/reward_mean', float('nan')):.3f}"
    cats = [k for k in metrics if k.startswith("eval/accuracy_") and k != "eval/accuracy_se"]
    parts = [f"{k[len('eval/accuracy_') :].replace('_', ' ')} {metrics[k]:.2f}" for k in cats]
    se = metrics.get("eval/accuracy_se")
    se_text = "" if se is None else f" +- {se:.3f}"
    return ", ".join(parts) + f" | overall {metrics['eval/accuracy']:.3f}{se_text}"


def before_after(before, after, path: str, title: str = "", ncol: int = 2) -> Image.Image:
    """The same prompts and seeds from the starting model (left of each pair) and the final one,
    from two evaluation `Panel`s, with both accuracies in the title; saved to `path`."""
    if list(before.prompts) != list(after.prompts) or list(before.seeds) != list(after.seeds):
        raise ValueError(
            "before_after: the two panels hold different prompts or seeds (were they made from the "
            "same evaluation prompts and seeds_per_prompt?)"
        )
    head = [title] if title else []
    head += [
        f"before (iteration {before.iteration}): {accuracy_line(before.metrics)}",
        f"after (iteration {after.iteration}):  {accuracy_line(after.metrics)}",
        "each pair: left = starting model, right = final model; same prompt and seed",
    ]

    def word(v):
        return "" if v is None else (" correct" if v else " wrong")

    cells = []
    for k, prompt in enumerate(before.prompts):
        vb, va = (None if p.verdicts is None else p.verdicts[k] for p in (before, after))
        last = f"{before.rewards[k]:.2f}{word(vb)} -> {after.rewards[k]:.2f}{word(va)}"
        images = [(before.images[k], _color(vb)), (after.images[k], _color(va))]
        cells.append((images, prompt, (last, BLACK)))
    side = _cell_size(before.images.shape[1])
    out = _draw_cells(cells, head, ncol, side, 2 * PAD, max(4, side // 16), wrap_head=False)
    atomic_file(path, out.save)
    return out
