"""Benchmark (not a test): the shipped toy model's load time, CPU sampling time, and its base accuracy.

    python benchmarks/bench_toy_model.py            # ~2 minutes on 2 CPU cores; writes docs/img/toy_base_grid.png

Prints load time (cold: first load in the process; warm: second), the time to sample a 16-image grid
(20 ODE steps, fixed seeds), and strict accuracy per category on the test prompts under the evaluation
protocol of the training scripts (deterministic ODE, 2 fixed seeds per prompt, 20 steps), at guidance 1 and 3.
Then the headroom RL can draw on: pass@k, the chance that at least one of k images of a test prompt (k seeds,
same ODE, guidance 1) is correct, from `--pass-at-k` seeds per prompt with the unbiased estimator
1 - C(n - c, k) / C(n, k) (n images, c correct). pass@1 is the accuracy; a policy that always produced the
prompt's best-of-k image would score pass@k.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import toyworld  # noqa: E402
from common.backbones import load_backbone, sample_ode  # noqa: E402

MODEL = os.path.join(ROOT, "common", "toyworld", "model")
GRID_PROMPTS = [
    "a photo of a red circle",
    "a photo of a blue triangle",
    "a photo of a yellow square",
    "a photo of a green circle",
    "a photo of two red squares",
    "a photo of three cyan circles",
    "a photo of four blue triangles",
    "a photo of two magenta circles",
    "a photo of a red circle and a blue square",
    "a photo of a green triangle and a yellow circle",
    "a photo of a cyan square and a magenta triangle",
    "a photo of a blue circle and a red triangle",
    "a photo of a red square left of a blue circle",
    "a photo of a green circle above a yellow square",
    "a photo of a magenta triangle below a cyan circle",
    "a photo of a blue square right of a red circle",
]


def sample(bb, prompts, seeds, steps=20, cfg=1.0):
    return sample_ode(bb, prompts, seeds, steps, toyworld.RESOLUTION, toyworld.RESOLUTION, cfg)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--pass-at-k", type=int, default=16, help="seeds per test prompt for pass@k (0: skip)"
    )
    a = ap.parse_args()
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
    toyworld.image_grid(images, nrow=4, scale=4).save(
        os.path.join(ROOT, "docs", "img", "toy_base_grid.png")
    )
    result = {
        "load_cold_s": round(cold, 3),
        "load_warm_s": round(warm, 3),
        "grid16_20steps_s": round(grid_s, 3),
    }

    # after the timed loads: its imports are not theirs
    from common.toyworld.pretrain import (
        evaluate,
    )

    for cfg in (1.0, 3.0):  # the scripts' prompts, seeds and sampler
        r, _ = evaluate(bb, steps=20, cfg=cfg, batch=100)
        acc = {c: round(r[c], 3) for c in toyworld.CATEGORIES}
        acc["overall (mean of categories)"] = round(r["accuracy"], 3)
        result[f"accuracy_cfg{cfg:g}"] = acc
    if a.pass_at_k:
        test = toyworld.load_prompts(toyworld.TEST_FILE)
        n = a.pass_at_k
        prompts = [p for p in test for _ in range(n)]
        # s = 0, 1 are the evaluation seeds
        seeds = [10_000 * s + i for i in range(len(test)) for s in range(n)]
        images = torch.cat(
            [
                sample(bb, prompts[b : b + 256], seeds[b : b + 256])
                for b in range(0, len(prompts), 256)
            ]
        )
        correct = toyworld.score(images, prompts)[1].reshape(len(test), n).sum(1)
        cats = [toyworld.category_of(p) for p in test]
        for k in (k for k in (1, 2, 4, 8, 16, 32) if k <= n):
            per = {
                c: sum(pass_at_k(n, int(x), k) for x, cc in zip(correct, cats) if cc == c)
                / cats.count(c)
                for c in toyworld.CATEGORIES
            }
            per["overall (mean of categories)"] = sum(per.values()) / len(toyworld.CATEGORIES)
            result[f"pass@{k}_cfg1"] = {c: round(v, 3) for c, v in per.items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
