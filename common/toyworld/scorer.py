"""Scorer: a GenEval-like detector for the toy world, in pure numpy (the reward of every RL script).

GenEval runs an object detector and checks colours, counts and positions. Here the "detector" is
exact and cheap, because the world is simple:

1. every pixel goes to the nearest of 7 palette colours (black background + 6 objects). Nearest in
   RGB means thresholding each channel at 128, so dim pixels are background and soft, blurry edges
   of generated images split cleanly;
2. 4-connected components per colour (a vectorised min-label propagation over the whole batch);
   components under MIN_AREA px (at 32x32) are specks and are ignored;
3. shape from two numbers of the component: fill = area / bbox area (square 1.0, circle ~0.7-0.8,
   triangle ~0.5-0.6) and the relative height of the centroid in its bbox (0.5 for the symmetric
   circle and square, ~0.65 for an upright triangle, whose mass sits low). Using both keeps blobby
   *generated* triangles (rounded corners, fill up to ~0.8) apart from circles;
4. relations between centroids with GenEval's rule (`relation_holds`).
"""

import math
from collections import Counter

import numpy as np

from .prompts import COLORS, SHAPES, parse

MIN_AREA = 5  # px at 32x32 (scaled with the image area)
# Shape thresholds, calibrated on renders (fill: circle 0.75-0.81, square 1.0, triangle 0.50-0.58;
# centroid height: 0.5, 0.5, 0.64-0.67) and on renders blurred through a 16x16 bottleneck, a
# stand-in for generated images (circle fill 0.67-0.84 and height <= 0.54; triangle fill up to 0.8
# but height >= 0.55).
SQUARE_FILL = 0.87  # fill >= this: square
# otherwise, fill < this or centroid height >= TRIANGLE_LOW: triangle; else circle
TRIANGLE_FILL = 0.62
TRIANGLE_LOW = 0.555
POSITION_THRESHOLD = 0.1  # GenEval's value
_NAMES = list(COLORS)
# 3-bit code r*4 + g*2 + b of the thresholded channels -> colour index (0 = background, 1.. = _NAMES
# order)
_CODE = np.zeros(8, np.int8)
for _i, _rgb in enumerate(COLORS.values(), 1):
    _CODE[(_rgb[0] > 0) * 4 + (_rgb[1] > 0) * 2 + (_rgb[2] > 0)] = _i
# drop darkest channel
_WHITE = np.array([_NAMES.index(c) + 1 for c in ("cyan", "magenta", "yellow")], np.int8)


def relation_holds(relation, ca, dims_a, cb, dims_b, margin=False) -> bool:
    """GenEval's relative-position rule for "A <relation> B" (y grows downwards).

    ca, cb are (y, x) centroids, dims (h, w) bbox sizes. The centroid offset A - B is shrunk by
    0.1 * (dim_a + dim_b) per axis and divided by its length; "left of" holds if the x component is
    < -0.5 (the offset points left and is mostly horizontal; within ~60 degrees), etc. A diagonal
    offset can make "left of" and "above" hold at once, as in GenEval. `margin=True` is the
    renderer's stricter version (component > 0.7 and the perpendicular relations false), so renders
    are unambiguous and robust to small shifts.
    """
    oy, ox = ca[0] - cb[0], ca[1] - cb[1]
    norm = math.hypot(ox, oy)
    if norm == 0:
        return False
    shrink = lambda o, d: math.copysign(max(abs(o) - POSITION_THRESHOLD * d, 0.0), o) / norm  # noqa: E731
    dy, dx = shrink(oy, dims_a[0] + dims_b[0]), shrink(ox, dims_a[1] + dims_b[1])
    along, across = {
        "left of": (-dx, dy),
        "right of": (dx, dy),
        "above": (-dy, dx),
        "below": (dy, dx),
    }[relation]
    return (along > 0.7 and abs(across) <= 0.5) if margin else along > 0.5


def to_uint8(images) -> np.ndarray:
    """uint8 [B, H, W, 3] from: uint8 [B,H,W,3]; float array / torch tensor in [0, 1] as [B,3,H,W]
    or [B,H,W,3]; or a list of PIL images (a single image without the batch axis is accepted
    too)."""
    if isinstance(images, (list, tuple)):
        images = np.stack(
            [
                np.asarray(im.convert("RGB")) if hasattr(im, "convert") else to_uint8(im)[0]
                for im in images
            ]
        )
    if hasattr(images, "detach"):  # torch tensor, without importing torch
        images = images.detach().cpu().float().numpy()
    x = np.asarray(images)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4 or 3 not in (x.shape[1], x.shape[3]):
        raise ValueError(f"expected images [B,H,W,3] or [B,3,H,W], got shape {x.shape}")
    if x.shape[3] != 3:
        x = x.transpose(0, 2, 3, 1)
    if x.dtype != np.uint8:
        if x.size and x.min() < -0.5:
            raise ValueError(
                "float images must be in [0, 1]; got values < -0.5 (did you forget (x + 1) / 2?)"
            )
        x = np.clip(np.asarray(x, np.float32) * 255 + 0.5, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(x)


def classify_pixels(x: np.ndarray) -> np.ndarray:
    """int8 [B, H, W]: 0 for background, i for the i-th colour of COLORS (nearest palette
    colour)."""
    bits = x >= 128
    code = bits[..., 0] * 4 + bits[..., 1] * 2 + bits[..., 2]
    cls = _CODE[code]
    # not in the palette: nearest of yellow/magenta/cyan is the one without the darkest channel
    white = code == 7
    if white.any():
        cls[white] = _WHITE[x[white].argmin(-1)]
    return cls


def components(cls: np.ndarray, min_area: int):
    """4-connected same-colour components of a batch of label maps.

    Every foreground pixel starts with its own flat index as label; repeatedly take the minimum over
    same-colour neighbours and follow labels to their labels ("pointer jumping") until nothing
    changes. Each component ends up labelled by its smallest flat index, which also tells its image
    and colour.
    Returns a dict of per-component arrays (image, color, area, cy, cx, y0, x0, h, w).
    """
    b, h, w = cls.shape
    n = b * h * w
    fg = cls > 0
    lab = np.where(fg, np.arange(n, dtype=np.int64).reshape(b, h, w), n)
    same_v = (cls[:, 1:] == cls[:, :-1]) & fg[:, 1:]
    same_h = (cls[:, :, 1:] == cls[:, :, :-1]) & fg[:, :, 1:]
    flat, idx = lab.reshape(-1), np.flatnonzero(fg)
    while True:
        old = flat[idx]
        np.minimum(lab[:, 1:], np.where(same_v, lab[:, :-1], n), out=lab[:, 1:])
        np.minimum(lab[:, :-1], np.where(same_v, lab[:, 1:], n), out=lab[:, :-1])
        np.minimum(lab[:, :, 1:], np.where(same_h, lab[:, :, :-1], n), out=lab[:, :, 1:])
        np.minimum(lab[:, :, :-1], np.where(same_h, lab[:, :, 1:], n), out=lab[:, :, :-1])
        for _ in range(3):
            flat[idx] = flat[flat[idx]]
        if np.array_equal(old, flat[idx]):
            break
    roots, inv = np.unique(flat[idx], return_inverse=True)
    ys, xs = idx // w % h, idx % w
    area = np.bincount(inv, minlength=len(roots))
    y0, x0 = np.full(len(roots), h), np.full(len(roots), w)  # each component's bounding box
    y1, x1 = np.zeros(len(roots), int), np.zeros(len(roots), int)
    np.minimum.at(y0, inv, ys)
    np.minimum.at(x0, inv, xs)
    np.maximum.at(y1, inv, ys)
    np.maximum.at(x1, inv, xs)
    keep = area >= min_area
    return dict(
        image=(roots // (h * w))[keep],
        color=cls.reshape(-1)[roots][keep],
        area=area[keep],
        cy=(np.bincount(inv, ys, len(roots)) / area)[keep],
        cx=(np.bincount(inv, xs, len(roots)) / area)[keep],
        y0=y0[keep],
        x0=x0[keep],
        h=(y1 - y0 + 1)[keep],
        w=(x1 - x0 + 1)[keep],
    )


def classify_shapes(comp) -> np.ndarray:
    """Shape index (into SHAPES) per component, from fill ratio and centroid height (see module
    doc)."""
    fill = comp["area"] / (comp["h"] * comp["w"])
    low = (comp["cy"] - comp["y0"] + 0.5) / comp["h"]
    triangle = (fill < TRIANGLE_FILL) | (low >= TRIANGLE_LOW)
    return np.where(fill >= SQUARE_FILL, 1, np.where(triangle, 2, 0))


def detect(images) -> list[list[dict]]:
    """Per image, the detected objects: dicts with color, shape, area, centroid (y, x) and bbox dims
    (h, w)."""
    x = to_uint8(images)
    b, h, w, _ = x.shape
    comp = components(classify_pixels(x), max(1, round(MIN_AREA * h * w / 1024)))
    shape = classify_shapes(comp)
    out = [[] for _ in range(b)]
    for i in range(len(shape)):
        out[comp["image"][i]].append(
            dict(
                color=_NAMES[comp["color"][i] - 1],
                shape=SHAPES[shape[i]],
                area=int(comp["area"][i]),
                centroid=(comp["cy"][i], comp["cx"][i]),
                dims=(int(comp["h"][i]), int(comp["w"][i])),
            )
        )
    return out


def score_objects(objects: list[dict], prompt: str) -> tuple[float, bool]:
    """(reward, correct) of one image's detections for one prompt. See `score` for the formula."""
    spec = parse(prompt)
    found = Counter((o["color"], o["shape"]) for o in objects)
    per_color = Counter(o["color"] for o in objects)
    wanted = Counter({(c, s): n for c, s, n in spec.objects})
    wanted_color = Counter()
    for (c, _), n in wanted.items():
        wanted_color[c] += n
    credits = []
    for (c, s), k in wanted.items():
        n = found[(c, s)]
        # colour right, no wanted shape
        m = per_color[c] - sum(found[key] for key in wanted if key[0] == c)
        ratio = lambda a, k=k: min(a, k) / max(a, k)  # noqa: E731
        credits.append(
            1.0 if n == k else 0.5 * ratio(n) if n else 0.25 * ratio(m) if m > 0 else 0.0
        )
    extras = sum(max(0, d - wanted_color[c]) for c, d in per_color.items())
    relation_ok = True
    if spec.relation is not None:
        (ca, sa, _), (cb, sb, _) = spec.objects
        a = max(
            (o for o in objects if (o["color"], o["shape"]) == (ca, sa)),
            key=lambda o: o["area"],
            default=None,
        )
        b = max(
            (o for o in objects if (o["color"], o["shape"]) == (cb, sb)),
            key=lambda o: o["area"],
            default=None,
        )
        relation_ok = (
            a is not None
            and b is not None
            and relation_holds(spec.relation, a["centroid"], a["dims"], b["centroid"], b["dims"])
        )
    s = np.mean(credits) / (1 + extras) * (1.0 if relation_ok else 0.25)
    return float(s * s), bool(found == wanted and relation_ok)


def score(images, prompts) -> tuple[np.ndarray, np.ndarray]:
    """GenEval-style reward and verdict for a batch: (reward float [B] in [0, 1], correct bool [B]).

    correct: the detected multiset of (colour, shape) equals the prompt's exactly (exact counts, no
    other objects) and, for position prompts, the relation holds (GenEval's strict score).

    reward = S ** 2 with S = Q * E * R, the partial credit for RL:
      Q = mean over the requested (colour, shape, k) of the item credit
            1                        exactly k objects of that colour and shape
            0.5  * min(n,k)/max(n,k) n != k objects of that colour and shape (wrong count)
            0.25 * min(m,k)/max(m,k) none, but m objects of that colour with a shape no item
                                     asks for
            0                        the colour is absent (a wrong colour earns nothing)
      E = 1 / (1 + extras), extras = objects beyond the requested number, per colour (other colours
          count in full), so an extra object always costs reward;
      R = 1 if the relation holds (position prompts; always 1 otherwise), else 0.25 (also when A
          or B is missing).
    S = 1 exactly when `correct`. The square keeps the ordering of S (every step towards the prompt
    still pays: dense), but gives near misses little (a wrong shape on a single object: 0.06, one of
    two objects of a wrong colour: 0.06, a flipped relation: 0.06), so the reward is high only for
    images GenEval would accept. GRPO-style advantages are normalised per prompt group anyway.
    """
    prompts = list(prompts)
    objects = detect(images)
    if len(objects) != len(prompts):
        raise ValueError(f"got {len(objects)} images but {len(prompts)} prompts")
    results = [score_objects(o, p) for o, p in zip(objects, prompts)]
    return np.array([r for r, _ in results], np.float64), np.array([c for _, c in results], bool)


def color_coverage(images, prompts) -> np.ndarray:
    """A deliberately hackable proxy reward, for watching reward hacking against the strict verdict:
    float [B] in [0, 1], the share of the canvas whose palette colour is one that the prompt names.
    Correct renders of the 100 test prompts cover 6-30 % of it (median 16 %); a canvas flooded with
    the colour scores 1 and has lost every count, shape and position, which `score` (the strict
    verdict) sees. Flow-GRPO finds the flood on the toy model in ten iterations
    (docs/reward_hacking.md)."""
    cls = classify_pixels(to_uint8(images))
    prompts = list(prompts)
    if len(cls) != len(prompts):
        raise ValueError(f"got {len(cls)} images but {len(prompts)} prompts")
    wanted = [[_NAMES.index(c) + 1 for c, _, _ in parse(p).objects] for p in prompts]
    return np.array([np.isin(c, w).mean() for c, w in zip(cls, wanted)], np.float64)


def image_grid(images, nrow: int, scale: int = 4, gap: int = 1):
    """PIL image of a grid with `nrow` images per row (as torchvision's make_grid), each upscaled
    `scale` times by pixel repetition (no smoothing: what you see is what the scorer sees), with a
    thin grey gap so the black backgrounds stay apart."""
    from PIL import Image

    x = to_uint8(images).repeat(scale, 1).repeat(scale, 2)
    b, h, w, _ = x.shape
    rows = -(-b // nrow)
    grid = np.full((rows * (h + gap) + gap, nrow * (w + gap) + gap, 3), 96, np.uint8)
    for i in range(b):
        r, c = divmod(i, nrow)
        grid[
            gap + r * (h + gap) : gap + r * (h + gap) + h,
            gap + c * (w + gap) : gap + c * (w + gap) + w,
        ] = x[i]
    return Image.fromarray(grid)


# ----------------------------------------------------------------------------- as training rewards
def reward(images, prompts):
    """`--reward toyworld`: `score`'s partial credit S² in [0, 1] (1 exactly when correct), as
    float32 torch scores [B] of images [B, 3, H, W] in [0, 1]."""
    import torch  # the toy world itself needs only numpy

    return torch.as_tensor(np.asarray(score(images.cpu(), prompts)[0]), dtype=torch.float32)


def coverage_reward(images, prompts):
    """`--reward toyworld_coverage`, the reward-hacking lab's proxy: the share of pixels in the
    prompt's colours (flooding the canvas wins it), as float32 torch scores [B]."""
    import torch

    return torch.as_tensor(color_coverage(images.cpu(), prompts), dtype=torch.float32)
