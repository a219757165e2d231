"""Benchmark (not a test): how good is DenseGRPO's dense reward, step by step, for n = t, 2 and 1 ODE steps?

    python benchmarks/bench_dense_reward.py                     # 512 trajectories on the shipped toy model, psi = 0.7
    python benchmarks/bench_dense_reward.py --psi-file runs/<a DenseGRPO run>/psi.json
    python benchmarks/bench_dense_reward.py --psi-constant 0 --completion-steps t,2   # the n = 2 grids' effect alone

DenseGRPO (arXiv 2601.20218, Eq. 8-9) scores every latent x_t of a trajectory by the reward of its ODE completion,
R_t = R(ODE_n(x_t)), and trains step t on DeltaR_t = R_{t-1} - R_t. Its Fig. 6c finds n = t (all remaining steps)
better than n = 2, and n = 1 (the one-step x0 prediction) worse than Flow-GRPO. This measures, on the same
trajectories (one generator seed, so every n sees the same latents), for each step index k (0 = pure noise):

- corr: Pearson correlation of R(ODE_n(x_k)) with the trajectory's final reward R(x_0) (the SDE image);
- |R_k - R_0|: mean absolute gap between the two (how far the completion's verdict is from the image's);
- dR = 0: share of trajectories whose DeltaR at step k is exactly 0 (no signal for that step);
- sign = n=t: share of trajectories whose DeltaR at step k has the same sign (-, 0, +) as with n = t;
- mean |dR|: the mean size of DeltaR at step k.

With `--psi-constant 0` every step is noise-free, so n = t gives DeltaR = 0 exactly and whatever n = 2 gives is
the change of completion grid alone (its grids from x_k and x_{k+1} are not nested, docs/densegrpo.md).

and the completion NFE per trajectory. No training: the shipped model, its rollout exactly as densegrpo.py samples it
(`dense_rollout`, the function the script calls). Prints a markdown table.
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import densegrpo as D  # noqa: E402
from common.backbones import load_backbone  # noqa: E402
from common.plumbing.checks import read_prompt_file  # noqa: E402
from common.plumbing.reward_flags import build_reward  # noqa: E402


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = (a.norm() * b.norm()).item()
    return float((a @ b).item() / den) if den > 0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trajectories", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--psi-file",
        default=None,
        help="a run's psi.json (default: psi = --noise-level at every step)",
    )
    ap.add_argument(
        "--psi-constant",
        type=float,
        default=None,
        help="psi = this at every step (0: noise-free trajectories, the grids' effect alone)",
    )
    ap.add_argument(
        "--completion-steps", default="t,2,1", help="comma-separated n; t = all remaining steps"
    )
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    args = D.Args()  # the script's defaults: model, resolution, steps, batch sizes, reward
    backbone = load_backbone(args.model_path, "cpu", precision=args.mixed_precision)
    reward_model = build_reward(args.reward)
    sigmas = backbone.schedule(args.num_steps, args.resolution, args.resolution, args.shift)
    if a.psi_file:
        psi = torch.tensor(
            D.load_psi(a.psi_file, args.num_steps, args.psi_scale)["psi"], dtype=torch.float32
        )
    else:
        psi = torch.full(
            (args.num_steps,), args.noise_level if a.psi_constant is None else a.psi_constant
        )
    noise_levels = D.step_noise_levels(psi, sigmas, args.psi_scale)
    pool = read_prompt_file(args.prompts_file, "--prompts-file")
    g = torch.Generator().manual_seed(a.seed)
    prompts = [pool[i] for i in torch.randint(len(pool), (a.trajectories,), generator=g).tolist()]
    emb = backbone.encode(prompts)
    T = args.num_steps
    print(
        f"{a.trajectories} trajectories, {T} steps, psi = {', '.join(f'{p:.2f}' for p in psi.tolist())}"
    )

    R, cost = {}, {}
    for name in a.completion_steps.split(","):
        args.completion_steps = None if name == "t" else int(name)
        t0 = time.process_time()
        out = D.dense_rollout(
            backbone,
            reward_model,
            prompts,
            emb,
            sigmas,
            noise_levels,
            args,
            torch.Generator().manual_seed(a.seed),
        )
        # [N, T+1]: column k = R(ODE_n(latents[k])), last = the SDE image
        R[name] = reward_model.mix(out["scores"])
        cost[name] = (out["nfe"]["completion"] / a.trajectories, time.process_time() - t0)
        print(
            f"n = {name}: {cost[name][0]:.0f} completion NFE per trajectory, {cost[name][1]:.0f} CPU s"
        )
    ref = next(iter(R))
    final = R[ref][:, T]
    for (
        name
    ) in R:  # the same trajectories for every n: the SDE image's reward must agree to the last bit
        assert torch.equal(R[name][:, T], final), (
            "the trajectories differ between completion settings"
        )

    print(
        f"\nfinal reward R(x_0): mean {final.mean():.3f}, zero for {(final == 0).float().mean():.0%} of trajectories\n"
    )
    head = "| step k (t = T - k) | " + " | ".join(
        f"n = {n}: corr / abs gap / dR = 0 / sign as n = t / mean abs dR" for n in R
    )
    print(head + " |")
    print("|---" * (len(R) + 1) + "|")
    dR_ref = D.dense_step_rewards(R["t"]) if "t" in R else None
    for k in range(T):
        cells = []
        for r in R.values():
            dR = D.dense_step_rewards(r)[:, k]
            same = (
                (torch.sign(dR) == torch.sign(dR_ref[:, k])).float().mean()
                if dR_ref is not None
                else float("nan")
            )
            cells.append(
                f"{pearson(r[:, k], final):+.2f} / {(r[:, k] - final).abs().mean():.2f} / "
                f"{(dR == 0).float().mean():.2f} / {same:.2f} / {dR.abs().mean():.3f}"
            )
        print(f"| {k} (t = {T - k}) | " + " | ".join(cells) + " |")
    print(
        "\ncompletion NFE per trajectory: "
        + ", ".join(f"n = {n}: {c[0]:.0f}" for n, c in cost.items())
    )


if __name__ == "__main__":
    main()
