"""The statistics behind two benchmarks' diagnostics: gradient SNR (bench_grad_snr.py) and pass@k (bench_toy_model.py).

Both are estimators whose numbers end up in docs/results.md, so they are checked against cases with a known answer.
"""

import itertools
import math

import pytest
import torch

from benchmarks.bench_grad_snr import snr_from_gram
from benchmarks.bench_toy_model import pass_at_k


@pytest.mark.parametrize("signal", [0.0, 0.05, 1.0])
def test_snr_recovers_a_known_signal_to_noise_ratio(signal):
    # N gradients g_i = mu + noise, ||mu||^2 = signal, E||noise||^2 = 1 (spread over P coordinates).
    g = torch.Generator().manual_seed(0)
    # few gradients: the bias noise / N (0.02) a naive ||g_bar||^2 would carry shows
    n, p = (
        50,
        20_000,
    )
    mu = torch.randn(p, generator=g, dtype=torch.float64)
    mu *= math.sqrt(signal) / mu.norm()
    grads = mu + torch.randn(n, p, generator=g, dtype=torch.float64) / math.sqrt(p)
    snr, sig, noise = snr_from_gram(grads @ grads.T)
    assert noise == pytest.approx(1.0, rel=0.02)
    assert sig == pytest.approx(signal, abs=0.006)  # unbiased, also at signal 0
    assert snr == pytest.approx(signal, abs=0.006)


def test_pass_at_k_matches_enumeration():
    # pass@k = chance that a random k-subset of the n samples holds a correct one; enumerate all subsets.
    for n, c, k in [(6, 0, 2), (6, 1, 1), (6, 2, 3), (5, 5, 2), (8, 3, 8)]:
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


# ---- the comparison harness's interval (bench_compare.py): t quantiles without scipy
from benchmarks.bench_compare import mean_ci, seeds_for_se, t_cdf, t_quantile, welch_ci  # noqa: E402


@pytest.mark.parametrize(
    "p, df, expected",
    [
        (0.975, 1, 12.7062),
        (0.975, 2, 4.3027),
        (0.975, 4, 2.7764),
        (0.975, 9, 2.2622),
        (0.975, 29, 2.0452),
        (0.95, 4, 2.1318),
        (0.995, 10, 3.1693),
        (0.975, 10_000, 1.9602),
        (0.5, 3, 0.0),
        (0.025, 4, -2.7764),
    ],
)
def test_t_quantile_matches_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-4)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_t_interval_of_known_samples():
    # s = 0.1, n = 3: half-width t_{0.975,2} 0.1 / sqrt(3) = 0.24841
    m, lo, hi = mean_ci([0.1, 0.2, 0.3])
    assert (
        m == pytest.approx(0.2)
        and lo == pytest.approx(0.2 - 0.24841, abs=1e-5)
        and hi == pytest.approx(0.44841, abs=1e-5)
    )
    assert mean_ci([0.3]) == (0.3, None, None)  # one seed: no interval
    # coverage: over many normal samples of 5 the 95 % t-interval holds the true mean ~95 % of the time
    g = torch.Generator().manual_seed(0)
    hits = sum(
        lo <= 0 <= hi
        for lo, hi in (mean_ci(torch.randn(5, generator=g).tolist())[1:] for _ in range(4000))
    )
    assert 0.94 <= hits / 4000 <= 0.96


def test_final_eval_seeds_give_the_standard_error():
    # the toy test file: 12 / 24 / 32 / 32 prompts; eval/accuracy is the mean of the 4 categories
    counts = {"single": 12, "counting": 24, "two_object": 32, "position": 32}
    s = seeds_for_se(0.02, counts)
    se = lambda k: math.sqrt(sum(0.25 / (n * k) for n in counts.values())) / 4  # noqa: E731
    assert se(s) <= 0.02 < se(s - 1) and s == 8
    # 0.5 / sqrt(100 S) <= 0.02
    assert seeds_for_se(0.05, {"a": 100}) == 1 and seeds_for_se(0.02, {"a": 100}) == 7


def test_welch_interval_of_known_samples():
    """Equal sizes and sample variances: Welch's df is 2 (n - 1) = 4, t_{.975,4} = 2.776445 (tables), the standard
    error sqrt(1/3 + 1/3); unequal ones: df by Welch-Satterthwaite, 3.53 here, between the tables' t for 3 and 4."""
    d, lo, hi = welch_ci([1, 2, 3], [4, 5, 6])
    half = 2.776445 * (2 / 3) ** 0.5
    assert d == -3 and abs(lo - (-3 - half)) < 1e-5 and abs(hi - (-3 + half)) < 1e-5
    d, lo, hi = welch_ci([1, 2, 3, 4, 5], [2, 4, 6])
    t = (hi - d) / (0.5 + 4 / 3) ** 0.5
    assert d == -1 and 2.776 < t < 3.182
    assert welch_ci([1.0], [2.0, 3.0]) == (-1.5, None, None)
