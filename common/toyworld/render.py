"""Renderer: a random scene that is *correct* for a prompt, the training data of the toy model.

Scenes are 32x32 RGB on black, objects in pure palette colours without anti-aliasing, so that every
pixel of a render belongs to exactly one palette colour and the scorer is exact on renders. Object
sizes shrink with the object count so that four objects still fit; objects keep a >= 2 px gap, so
they never merge into one connected component. Layouts are rejection-sampled from a `random.Random`
seeded by (prompt, seed): deterministic, and different prompts with the same seed get different
layouts.
"""

import functools
import random

import numpy as np
from PIL import Image, ImageDraw

from .prompts import COLORS, SHAPES, parse
from .scorer import relation_holds

RESOLUTION = 32
# object side in px, by object count (>= 8: small triangles blur into round blobs in generated
# images)
SIZES = {1: (9, 16), 2: (8, 12), 3: (8, 10), 4: (8, 9)}
GAP = 2
_RGB = {c: np.array(rgb, np.uint8) for c, rgb in COLORS.items()}


@functools.lru_cache(maxsize=None)
def shape_mask(shape: str, size: int) -> tuple[np.ndarray, float, float]:
    """(bool mask [size, size], centroid y, centroid x) of one shape, drawn once by PIL and
    cached."""
    img = Image.new("L", (size, size), 0)
    draw, m = ImageDraw.Draw(img), size - 1
    if shape == "circle":
        draw.ellipse([0, 0, m, m], fill=1)
    elif shape == "square":
        draw.rectangle([0, 0, m, m], fill=1)
    elif shape == "triangle":
        # upright isosceles: apex at the top centre, base along the bottom row
        draw.polygon([(0, m), (m, m), (m / 2, 0)], fill=1)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    mask = np.asarray(img, bool)
    ys, xs = np.nonzero(mask)
    return mask, float(ys.mean()), float(xs.mean())


def _layout(spec, rng: random.Random, res: int):
    """Rejection-sample [(color, shape, size, y, x)] with >= GAP px between bounding boxes and, for
    position prompts, the relation holding under the scorer's rule (with a margin, see
    scorer.relation_holds)."""
    objs = [(c, s) for c, s, n in spec.objects for _ in range(n)]
    lo, hi = SIZES[len(objs)]
    for _ in range(1000):
        placed = []
        for color, shape in objs:
            size = lo + int(rng.random() * (hi - lo + 1))  # = rng.randint(lo, hi), but ~10x faster
            for _ in range(50):
                y, x = int(rng.random() * (res - size + 1)), int(rng.random() * (res - size + 1))
                if all(
                    x + size + GAP <= px
                    or px + ps + GAP <= x
                    or y + size + GAP <= py
                    or py + ps + GAP <= y
                    for _, _, ps, py, px in placed
                ):
                    placed.append((color, shape, size, y, x))
                    break
            else:
                break  # this object did not fit: start the scene again
        if len(placed) < len(objs):
            continue
        if spec.relation is not None:
            (_, sa, za, ya, xa), (_, sb, zb, yb, xb) = placed
            _, cya, cxa = shape_mask(sa, za)
            _, cyb, cxb = shape_mask(sb, zb)
            if not relation_holds(
                spec.relation,
                (ya + cya, xa + cxa),
                (za, za),
                (yb + cyb, xb + cxb),
                (zb, zb),
                margin=True,
            ):
                continue
        return placed
    raise RuntimeError(f"could not lay out {spec.prompt!r}")  # does not happen at 32 px


def render_array(prompt: str, seed: int, res: int = RESOLUTION) -> np.ndarray:
    """uint8 [res, res, 3] scene for `prompt`, deterministic in (prompt, seed)."""
    spec = parse(prompt)
    image = np.zeros((res, res, 3), np.uint8)
    for color, shape, size, y, x in _layout(spec, random.Random(f"{prompt}|{int(seed)}"), res):
        image[y : y + size, x : x + size][shape_mask(shape, size)[0]] = _RGB[color]
    return image


def render(prompt: str, seed: int) -> Image.Image:
    """A 32x32 RGB PIL image of a scene that is correct for `prompt`."""
    return Image.fromarray(render_array(prompt, seed))


def render_batch(prompts, seeds) -> np.ndarray:
    """uint8 [B, 32, 32, 3]: render_array for each (prompt, seed), for fast on-the-fly training
    data."""
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
    out = np.zeros((len(prompts), RESOLUTION, RESOLUTION, 3), np.uint8)
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        out[i] = render_array(p, s)
    return out
