"""The statistics behind two benchmarks' diagnostics: gradient SNR (bench_grad_snr.py) and pass@k (bench_toy_model.py).

Both are estimators whose numbers end up in docs/results.md, so they are checked against cases with a known answer.
"""
import itertools
import math
import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_grad_snr import snr_from_gram  # noqa: E402
from bench_toy_model import pass_at_k  # noqa: E402


@pytest.mark.parametrize("signal", [0.0, 0.05, 1.0])
def test_snr_recovers_a_known_signal_to_noise_ratio(signal):
    # N gradients g_i = mu + noise, ||mu||^2 = signal, E||noise||^2 = 1 (spread over P coordinates).
    g = torch.Generator().manual_seed(0)
    n, p = 50, 20_000  # few gradients: the bias noise / N (0.02) a naive ||g_bar||^2 would carry shows
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
