"""Benchmark (not a test): the shipped toy model's load time, CPU sampling time, and its base accuracy.

    python tests/bench_toy_model.py            # ~1-2 minutes on 2 CPU cores; writes docs/img/toy_base_grid.png

Prints load time (cold: first load in the process; warm: second), the time to sample a 16-image grid
(20 ODE steps, fixed seeds), and strict accuracy per category on the test prompts under the evaluation
protocol of the training scripts (deterministic ODE, 2 fixed seeds per prompt, 20 steps), at guidance 1 and 3.
"""
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import toyworld  # noqa: E402
from common.backbones import load_backbone, sample_ode  # noqa: E402

MODEL = os.path.join(ROOT, "common", "toyworld", "model")
GRID_PROMPTS = ["a photo of a red circle", "a photo of a blue triangle", "a photo of a yellow square",
                "a photo of a green circle", "a photo of two red squares", "a photo of three cyan circles",
                "a photo of four blue triangles", "a photo of two magenta circles",
                "a photo of a red circle and a blue square", "a photo of a green triangle and a yellow circle",
                "a photo of a cyan square and a magenta triangle", "a photo of a blue circle and a red triangle",
                "a photo of a red square left of a blue circle", "a photo of a green circle above a yellow square",
                "a photo of a magenta triangle below a cyan circle", "a photo of a blue square right of a red circle"]


def sample(bb, prompts, seeds, steps=20, cfg=1.0):
    return sample_ode(bb, prompts, seeds, steps, toyworld.RESOLUTION, toyworld.RESOLUTION, cfg)


def main():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t = time.perf_counter()
    bb = load_backbone(MODEL, "cpu")
    cold = time.perf_counter() - t
    t = time.perf_counter()
    bb = load_backbone(MODEL, "cpu")
    warm = time.perf_counter() - t
    sample(bb, GRID_PROMPTS[:2], [0, 1], steps=2)  # warm-up
    t = time.perf_counter()
    images = sample(bb, GRID_PROMPTS, list(range(16)))
    grid_s = time.perf_counter() - t
    os.makedirs(os.path.join(ROOT, "docs", "img"), exist_ok=True)
    toyworld.image_grid(images, nrow=4, scale=4).save(os.path.join(ROOT, "docs", "img", "toy_base_grid.png"))
    result = {"load_cold_s": round(cold, 3), "load_warm_s": round(warm, 3), "grid16_20steps_s": round(grid_s, 3)}

    from common.toyworld.pretrain import eval_protocol, evaluate  # after the timed loads: its imports are not theirs

    eval_images = eval_protocol(toyworld.load_prompts(toyworld.TEST_FILE))  # the scripts' prompts and seeds
    for cfg in (1.0, 3.0):
        r = evaluate(bb, *eval_images, steps=20, cfg=cfg, batch=100)
        acc = {c: round(r[c], 3) for c in toyworld.CATEGORIES}
        acc["overall (mean of categories)"] = round(r["accuracy"], 3)
        result[f"accuracy_cfg{cfg:g}"] = acc
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
