"""Benchmark (not a test): how much of one iteration's policy gradient is signal, and how much is noise?

    python benchmarks/bench_grad_snr.py --batches 32                          # flowgrpo_baseline, toy defaults, ~3 min
    python benchmarks/bench_grad_snr.py --batches 32 -- --timestep-fraction 0.99   # any script flags after "--"

Runs a training script in this process with its AdamW replaced by a recorder: every optimizer step stores the
gradient and leaves the weights alone, so each iteration gives an independent gradient estimate g_i at the
starting model (new prompts, new noise, same weights). From N of them, with g_bar their mean:

    noise  = E||g_i - E g||^2, estimated by sum_i ||g_i - g_bar||^2 / (N - 1)      (one batch's spread)
    signal = ||E g||^2,         estimated by ||g_bar||^2 - noise / N                (unbiased)
    SNR    = signal / noise                                                        (of one batch)

An average of k batches has SNR k * SNR; the optimizer's momentum averages about 1 / (1 - beta1) of them. The
standard error comes from the jackknife (leave one batch out). Everything is computed from the N x N Gram
matrix of the gradients, so memory is N gradients.
"""

import argparse
import os
import runpy
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class _Done(Exception):
    pass


def snr_from_gram(gram: torch.Tensor) -> tuple[float, float, float]:
    """(SNR, signal, noise) of one batch from the Gram matrix of N gradient estimates (see the module doc)."""
    n = gram.shape[0]
    total, trace = gram.sum(), gram.trace()
    noise = (trace / n - total / n**2) * n / (n - 1)
    signal = total / n**2 - noise / n
    return float(signal / noise), float(signal), float(noise)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--script", default="flowgrpo_baseline.py")
    ap.add_argument(
        "--batches", type=int, default=32, help="gradient estimates (optimizer steps) to record"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("flags", nargs="*", help="flags for the script (after --)")
    a = ap.parse_args()
    if a.batches < 3:
        raise SystemExit(
            f"error: --batches {a.batches}: the jackknife needs at least 3 gradients (try 32)"
        )
    torch.set_num_threads(a.threads)

    grads = []

    class Recorder(torch.optim.AdamW):
        """AdamW that records the gradient and does not step: the weights stay at the starting model."""

        def step(self, closure=None):
            # float32 on the CPU: N copies fit
            grads.append(
                torch.cat(
                    [
                        p.grad.detach().flatten()
                        for g in self.param_groups
                        for p in g["params"]
                        if p.grad is not None
                    ]
                )
                .float()
                .cpu()
            )
            if len(grads) == a.batches:
                raise _Done

    torch.optim.AdamW = Recorder
    script = os.path.join(ROOT, a.script)
    with tempfile.TemporaryDirectory(
        prefix="grad_snr_"
    ) as out:  # the run's metrics and samples are not kept
        sys.argv = [
            script,
            "--num-iterations",
            "100000",
            "--eval-every",
            "100000",
            "--save-every",
            "100000",
            "--output-dir",
            out,
            "--run-name",
            "probe",
            *a.flags,
        ]
        try:
            runpy.run_path(script, run_name="__main__")
        except _Done:
            pass
    g = torch.stack(grads)
    n = len(g)
    # float64 sums, bounded memory
    chunks = (g[:, c : c + (1 << 20)].double() for c in range(0, g.shape[1], 1 << 20))
    gram = sum(x @ x.T for x in chunks)
    snr, signal, noise = snr_from_gram(gram)
    others = ~torch.eye(n, dtype=torch.bool)  # row i: every gradient but the i-th
    jack = torch.tensor([snr_from_gram(gram[others[i]][:, others[i]])[0] for i in range(n)])
    se = float(((n - 1) / n * ((jack - jack.mean()) ** 2).sum()).sqrt())
    norms = gram.diagonal().sqrt()
    pair_cos = float((gram / norms[:, None] / norms[None, :])[others].mean())
    print(f"{a.script} {' '.join(a.flags)}")
    print(
        f"  {n} gradients of {g.shape[1]:,} trainable numbers; mean norm {float(norms.mean()):.3e}"
    )
    print(
        f"  one batch: SNR {snr:+.4f} +- {se:.4f} (signal {signal:.3e}, noise {noise:.3e}); "
        f"mean pairwise cosine {pair_cos:+.4f}"
    )
    if snr > 2 * se:
        print(f"  batches to average for SNR 1: about {1 / snr:.0f}")
    else:
        print(
            f"  the signal is not distinguishable from 0 with {n} gradients (SNR < {max(snr, 0) + 2 * se:.4f})"
        )


if __name__ == "__main__":
    main()
