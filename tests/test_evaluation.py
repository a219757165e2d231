"""common/plumbing/evaluation.py: the evaluation protocol the three scripts share (on the shipped toy model, ~5 s)."""

import numpy as np
import pytest
import torch

from common import toyworld
from common.backbones import load_backbone, sample_ode
from common.plumbing.evaluation import accuracy_se, evaluate, panel_jobs
from common.plumbing.reward_flags import build_reward

RES = toyworld.RESOLUTION


@pytest.fixture(scope="module")
def toy():
    return load_backbone(str(toyworld.PROMPT_DIR / "model"), "cpu", torch.float32)


def test_evaluate_scores_fixed_seed_ode_samples_per_category(toy):
    """The metrics are those of the ODE samples from seeds 10_000 * s + prompt index, recomputed here by hand:
    mean reward, guard means, strict accuracy per category and its mean over categories (not over images)."""
    prompts = [p for c in toyworld.CATEGORIES for p in toyworld.all_prompts(c)[:2]] + [
        "a photo of a red circle"
    ]
    reward, guard = build_reward("toyworld"), build_reward("jpeg_compressibility")
    m, grid, panel = evaluate(
        toy,
        reward,
        guard,
        prompts,
        8,
        None,
        1.0,
        seeds_per_prompt=2,
        batch_size=len(prompts) * 2,
        resolution=RES,
        return_panel=True,
    )

    ps = [p for p in prompts for _ in range(2)]
    imgs = sample_ode(
        toy, ps, [10_000 * s + i for i in range(len(prompts)) for s in range(2)], 8, RES, RES
    )
    _, correct = toyworld.score(imgs, ps)
    per_cat = {
        c: np.mean([ok for ok, p in zip(correct, ps) if toyworld.category_of(p) == c])
        for c in toyworld.CATEGORIES
    }
    for c in toyworld.CATEGORIES:
        assert m[f"eval/accuracy_{c}"] == pytest.approx(per_cat[c])
    assert m["eval/accuracy"] == pytest.approx(np.mean(list(per_cat.values())))
    p = np.array([per_cat[c] for c in toyworld.CATEGORIES])
    # images per category
    n = np.array([sum(toyworld.category_of(q) == c for q in ps) for c in toyworld.CATEGORIES])
    assert m["eval/accuracy_se"] == pytest.approx(np.sqrt(np.sum(p * (1 - p) / n)) / len(p))
    assert m["eval/reward_mean"] == pytest.approx(
        reward.mix(reward(imgs, ps)).mean().item(), abs=1e-6
    )
    assert m["eval/guard/jpeg_compressibility"] == pytest.approx(
        guard(imgs, ps)[:, 0].mean().item(), abs=1e-6
    )
    # The grid shows the fixed subset: the first 4 prompts of every category, seed index 0, category by category.
    shown = panel_jobs(prompts)
    assert [toyworld.category_of(prompts[i]) for i in shown] == [
        c for c in toyworld.CATEGORIES for _ in range(3 if c == "single" else 2)
    ]
    assert panel.prompts == [prompts[i] for i in shown] and panel.seeds == shown
    assert np.array_equal(panel.images, toyworld.to_uint8(imgs[[2 * i for i in shown]]))
    assert panel.verdicts == [bool(correct[2 * i]) for i in shown] and panel.metrics == m
    assert grid.size == panel.grid().size and grid.width >= 4 * 128  # 4 per row, upscaled to 128 px

    again, _ = evaluate(toy, reward, None, prompts, 8, None, 1.0, 2, len(prompts) * 2, RES)
    # deterministic
    assert {k: again[k] for k in m if "guard" not in k} == {k: m[k] for k in m if "guard" not in k}


def test_evaluate_reports_accuracy_only_for_toy_prompts(toy):
    m, _ = evaluate(
        toy,
        build_reward("jpeg_compressibility"),
        None,
        ["a photo of a red circle", "a cat on a mat"],
        4,
        None,
        1.0,
        1,
        2,
        RES,
    )
    assert set(m) == {"eval/reward_mean"}


def test_accuracy_se_is_the_standard_error_of_the_mean_of_category_means():
    # p = 3/4 and 1/4 over 4 images each: se_c^2 = 0.75 * 0.25 / 4; se = sqrt(2 se_c^2) / 2
    assert accuracy_se({"a": [1, 0, 1, 1], "b": [0, 0, 1, 0]}) == pytest.approx(
        np.sqrt(2 * 0.75 * 0.25 / 4) / 2
    )
    assert accuracy_se({"a": [1, 1], "b": [0, 0, 0]}) == 0.0
