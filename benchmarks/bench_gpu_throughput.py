"""Benchmark (not a test): throughput of the three scripts on full-size SD3.5-Medium and FLUX.1-dev, one GPU.

    python benchmarks/bench_gpu_throughput.py --out runs/throughput          # GPU: full-size models, 512 px
    python benchmarks/bench_gpu_throughput.py --tiny --out /tmp/tp           # CPU dry run of the same code (tiny models)

Without CUDA (and without --tiny) it prints one line and exits 0.

What it does:
1. Builds random-weight SD3.5-Medium and FLUX.1-dev folders with `common/tiny.py`'s builders at the real transformer
   and VAE sizes (speed does not depend on the values); the text encoders are small (1-2 layers) but have the real
   output widths, and the CLIP/T5 token counts are the real ones (77 + 256 for SD3.5, 512 for FLUX).
   They are written with `save_pretrained` and each script loads them with `--model-path`, as it would real weights.
2. Runs each script in this process for 2 iterations with its paper setting scaled to a few groups (LoRA r=32 on
   the attention projections, 512 px, JPEG-compressibility reward so no reward weights are needed), and reads
   iteration 1 (iteration 0 pays the warm-up). Backbone.velocity / Backbone.decode / RewardModel.__call__ are
   wrapped with CUDA-synchronised timers to split the iteration into phases and count the work actually done.
3. Prints, per run: seconds per phase, NFE, images/s, peak memory, and the floor implied by
   ../shared/reference/gpu_anchor.md (measured per-image-per-step costs on one H200):
       floor = sampling rows x forward cost + trained rows x (forward+backward) cost + decoded images x decode cost.
   "x floor" = measured iteration time / floor (1.0 = no overhead beyond the transformer/VAE math).
4. G²RPO twice on SD3.5-M, --rollout-batch-size 32 and 1 (same seed, so equal NFE): what batching the branches buys.

Results go to {out}/throughput.md and {out}/throughput.json, rewritten after every run (partial results survive).
"""

import argparse
import gc
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Per image per denoising step, 512 px, bf16, one H200 (../shared/reference/gpu_anchor.md, measured 2026-11-29).
# SD3.5-M numbers include classifier-free guidance (batch doubled); FLUX.1-dev is guidance-distilled (no CFG).
ANCHOR = {
    "sd35": {"forward": 0.0186, "train": 0.0561, "decode": 0.0110},
    "flux": {"forward": 0.0553, "train": 0.150, "decode": 0.0110},
}


def real_vae(scaling_factor: float, shift_factor: float, tiny: bool):
    """The SD3 / FLUX autoencoder's architecture (16 latent channels, 8x downsampling); random weights."""
    from common.tiny import tiny_vae

    if tiny:
        return tiny_vae(16, scaling_factor=scaling_factor, shift_factor=shift_factor)
    return tiny_vae(
        16,
        (128, 256, 512, 512),
        layers_per_block=2,
        norm_groups=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        mid_attention=True,
    )


def build_folder(name: str, cache: str, tiny: bool, device: str) -> str:
    """A random-weight model folder ("sd35" or "flux"; bf16 transformer), built once into `cache`."""
    from common.tiny import build_flux, build_sd3

    path = os.path.join(cache, {"sd35": "sd35m", "flux": "flux1dev"}[name] + "_tiny" * tiny)
    dtype = torch.float32 if tiny else torch.bfloat16
    if not os.path.exists(os.path.join(path, "model_index.json")):
        t0 = time.perf_counter()
        with torch.device(
            device
        ):  # random init of 2-12 B parameters is minutes on a CPU, seconds on a GPU
            if name == "sd35":
                size = (
                    {}
                    if tiny
                    else dict(
                        num_layers=24,
                        heads=24,
                        head_dim=64,
                        clip_dim=1024,
                        t5_dim=4096,
                        transformer_kwargs=dict(
                            sample_size=128,
                            pos_embed_max_size=384,
                            dual_attention_layers=tuple(range(13)),
                        ),
                    )
                )
                pipe = build_sd3(
                    None,
                    sd35=True,
                    latent_channels=16,
                    max_len=77,
                    vae=real_vae(1.5305, 0.0609, tiny),
                    **size,
                )
            else:
                size = (
                    {}
                    if tiny
                    else dict(
                        num_layers=19,
                        num_single_layers=38,
                        heads=24,
                        head_dim=128,
                        clip_dim=768,
                        t5_dim=4096,
                        transformer_kwargs=dict(axes_dims_rope=(16, 56, 56)),
                    )
                )
                pipe = build_flux(
                    None, latent_channels=16, max_len=77, vae=real_vae(0.3611, 0.1159, tiny), **size
                )
        pipe.transformer.to(dtype)
        n = sum(p.numel() for p in pipe.transformer.parameters())
        pipe.save_pretrained(path)
        del pipe
        gc.collect()
        print(
            f"built {path}: transformer {n / 1e9:.2f} B params in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    return path


class Probe:
    """`with Probe() as probe:` wraps Backbone.velocity / decode and RewardModel.__call__ with synchronised timers
    (undone on exit); every RunLogger.log call closes one snapshot in probe.per_iteration."""

    def __init__(self):
        self.per_iteration, self.now, self.saved = [], {}, []

    def add(self, key, value):
        self.now[key] = self.now.get(key, 0) + value

    def timed(self, fn, kind):
        def wrapper(*args, **kwargs):
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            dt, rows = time.perf_counter() - t0, args[1].shape[0]
            # the KL reference: no gradient
            reference = getattr(kwargs.get("model"), "__name__", "") == "reference"
            if (
                kind == "velocity" and torch.is_grad_enabled() and not reference
            ):  # a training forward: the train phase
                self.add("train_rows", rows)
            else:  # velocity without grad (sampling, completions, KL reference), decode, reward
                key = "forward" if kind == "velocity" else kind
                self.add(f"{key}_rows", rows)
                self.add(f"{key}_s", dt)
                self.add(f"{key}_calls", 1)
            return out

        return wrapper

    def snapshot_after(self, log):
        def wrapper(logger, metrics, images=None):
            log(logger, metrics, images)
            self.per_iteration.append({**self.now, "metrics": dict(metrics)})
            self.now = {}

        return wrapper

    def __enter__(self):
        from common import backbones, rewards, utils

        for owner, name, wrap in [
            (backbones.Backbone, "velocity", lambda f: self.timed(f, "velocity")),
            (backbones.Backbone, "decode", lambda f: self.timed(f, "decode")),
            (rewards.RewardModel, "__call__", lambda f: self.timed(f, "reward")),
            (utils.RunLogger, "log", self.snapshot_after),
        ]:
            self.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, wrap(getattr(owner, name)))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self.saved:
            setattr(owner, name, original)


def run_one(script: str, flags: list[str], model: str) -> dict:
    """Run `script` for 2 iterations in this process; the measured row is iteration 1."""
    from tests.helpers import run_main

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        with Probe() as probe:
            run_main(script, *flags)
    finally:
        gc.collect()
    wall = time.perf_counter() - t0
    it = probe.per_iteration[1]
    m = it["metrics"]
    total = m["time/rollout_s"] + m["time/reward_s"] + m["time/train_s"]
    a = ANCHOR[model]
    floor = (
        it.get("forward_rows", 0) * a["forward"]
        + it.get("train_rows", 0) * a["train"]
        + it.get("decode_rows", 0) * a["decode"]
    )
    row = {
        "script": script,
        "model": model,
        "flags": " ".join(flags),
        "iteration_s": total,
        "rollout_s": m["time/rollout_s"],
        "reward_phase_s": m["time/reward_s"],
        "train_s": m["time/train_s"],
        "forward_s": it.get("forward_s", 0.0),
        "forward_rows": it.get("forward_rows", 0),
        "forward_calls": it.get("forward_calls", 0),
        "train_rows": it.get("train_rows", 0),
        "decode_s": it.get("decode_s", 0.0),
        "decode_images": it.get("decode_rows", 0),
        "reward_s": it.get("reward_s", 0.0),
        "reward_images": it.get("reward_rows", 0),
        "nfe_iteration": m["nfe"] - probe.per_iteration[0]["metrics"]["nfe"],
        "images_per_s": it.get("decode_rows", 0) / total if total else 0.0,
        "s_per_group": total / int(flags[flags.index("--groups-per-iteration") + 1]),
        "floor_s": floor,
        "x_floor": total / floor if floor else float("nan"),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available()
        else None,
        "run_wall_s": wall,
    }
    return row


def write_report(out: str, rows: list[dict], header: str) -> None:
    with open(os.path.join(out, "throughput.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [
        header,
        "",
        "| run | model | iteration s | forward s (rows, calls) | decode s (images) | reward s | "
        "train s (rows) | NFE | decoded images/s | s per group | floor s | x floor | peak GiB |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        lines.append(
            f"| {r['name']} | {r['model']} | {r['iteration_s']:.2f} | {r['forward_s']:.2f} "
            f"({r['forward_rows']}, {r['forward_calls']}) | {r['decode_s']:.2f} ({r['decode_images']}) | "
            f"{r['reward_s']:.2f} | {r['train_s']:.2f} ({r['train_rows']}) | {r['nfe_iteration']} | "
            f"{r['images_per_s']:.2f} | {r['s_per_group']:.2f} | {r['floor_s']:.2f} | {r['x_floor']:.2f} | {mem} |"
        )
    batched, single = (
        next((r for r in rows if r["name"] == n), None) for n in ("g2rpo batched", "g2rpo batch-1")
    )
    if batched and single:
        lines += [
            "",
            f"G²RPO branch batching: forward {single['forward_s']:.2f} s at batch 1 vs "
            f"{batched['forward_s']:.2f} s batched ({single['forward_rows']} vs {batched['forward_rows']} rows): "
            f"{single['forward_s'] / batched['forward_s']:.2f}x faster batched",
        ]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "throughput.md"), "w") as f:
        f.write(text)
    print(text, flush=True)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "throughput"))
    ap.add_argument(
        "--cache", default="/tmp/flow_rl_fullsize", help="where the random-weight model folders go"
    )
    ap.add_argument(
        "--tiny", action="store_true", help="tiny models at 64 px: a CPU dry run of this benchmark"
    )
    ap.add_argument("--only", nargs="*", default=None, help="run names to run (default: all)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=1e9,
        help="skip runs that would start after this many seconds",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        print("bench_gpu_throughput: skipped, no CUDA device (use --tiny for a CPU dry run)")
        return
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = os.path.join(args.out, "one_prompt.txt")
    with open(prompts, "w") as f:
        f.write("a photo of a red circle\n")
    res = "64" if args.tiny else "512"
    common = [
        "--resolution",
        res,
        "--reward",
        "jpeg_compressibility",
        "--num-iterations",
        "2",
        "--eval-every",
        "1000",
        "--eval-prompts",
        prompts,
        "--eval-seeds-per-prompt",
        "1",
        "--eval-num-steps",
        "2",
        "--lora-target",
        "attention",
        "--lora-rank",
        "32",
        "--lora-alpha",
        "64",
        "--save-every",
        "1000",
        "--output-dir",
        os.path.join(args.out, "runs"),
        "--num-steps",
        "10",
    ]
    sd35 = ["--model-path", "{sd35}", "--guidance-scale", "4.5", "--max-sequence-length", "256"]
    flux = ["--model-path", "{flux}", "--guidance-scale", "3.5", "--max-sequence-length", "512"]
    # not the toy defaults
    paper = [
        "--timestep-fraction",
        "0.99",
        "--optimizer-steps-per-iteration",
        "1",
    ]
    g2 = [
        "--branch-steps",
        "0",
        "1",
        "2",
        "--granularities",
        "1",
        "2",
        "--group-size",
        "8",
        "--groups-per-iteration",
        "1",
    ]
    runs = [  # name, script, model, flags: the paper settings, scaled down to a few groups
        (
            "flowgrpo",
            "flowgrpo_baseline.py",
            "sd35",
            sd35
            + paper
            + [
                "--group-size",
                "8",
                "--groups-per-iteration",
                "2",
                "--rollout-batch-size",
                "8",
                "--beta",
                "0.04",
            ],
        ),
        (
            "g2rpo batched",
            "g2rpo.py",
            "sd35",
            sd35 + g2 + ["--rollout-batch-size", "32", "--train-batch-size", "8"],
        ),
        (
            "g2rpo batch-1",
            "g2rpo.py",
            "sd35",
            sd35 + g2 + ["--rollout-batch-size", "1", "--train-batch-size", "8"],
        ),
        (
            "densegrpo",
            "densegrpo.py",
            "sd35",
            sd35
            + paper
            + [
                "--group-size",
                "8",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "8",
                "--calibration-iterations",
                "0",
            ],
        ),
        (
            "flowgrpo 24GB",
            "flowgrpo_baseline.py",
            "sd35",
            sd35
            + paper
            + [
                "--group-size",
                "4",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "4",
                "--train-batch-size",
                "1",
                "--gradient-checkpointing",
            ],
        ),
        # the compute table: which micro-batch / checkpointing fits which card, and what it costs
        (
            "flowgrpo 24GB b4",
            "flowgrpo_baseline.py",
            "sd35",
            sd35
            + paper
            + [
                "--group-size",
                "4",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "4",
                "--train-batch-size",
                "4",
                "--gradient-checkpointing",
            ],
        ),
        (
            "flowgrpo b1 no-ckpt",
            "flowgrpo_baseline.py",
            "sd35",
            sd35
            + paper
            + [
                "--group-size",
                "4",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "4",
                "--train-batch-size",
                "1",
            ],
        ),
        (
            "flowgrpo 141GB",
            "flowgrpo_baseline.py",
            "sd35",
            sd35
            + paper
            + [
                "--group-size",
                "16",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "16",
                "--beta",
                "0.04",
            ],
        ),
        (
            "flux flowgrpo",
            "flowgrpo_baseline.py",
            "flux",
            flux
            + paper
            + [
                "--group-size",
                "4",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "4",
                "--train-batch-size",
                "2",
            ],
        ),
        (
            "flux g2rpo",
            "g2rpo.py",
            "flux",
            flux
            + [
                "--num-steps",
                "16",
                "--branch-steps",
                "0",
                "--granularities",
                "1",
                "2",
                "3",
                "--group-size",
                "4",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "16",
                "--train-batch-size",
                "2",
            ],
        ),
        (
            "flux densegrpo",
            "densegrpo.py",
            "flux",
            flux
            + paper
            + [
                "--group-size",
                "2",
                "--groups-per-iteration",
                "1",
                "--rollout-batch-size",
                "2",
                "--train-batch-size",
                "2",
                "--calibration-iterations",
                "0",
            ],
        ),
    ]
    header = (
        f"GPU throughput, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (tiny dry run)'}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; iteration 1 of 2; {res} px"
    )
    rows = []
    for name, script, model, flags in runs:
        if args.only and name not in args.only:
            continue
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipped {name}: over --budget-s", flush=True)
            continue
        try:
            # the first run of a model builds it
            path = build_folder(model, args.cache, args.tiny, device)
            run_flags = [
                f.replace("{" + model + "}", path)
                for f in [*common, *flags, "--run-name", name.replace(" ", "_")]
            ]
            row = run_one(script, run_flags, model)
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- one failed run must not lose the others' numbers
            print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
            continue
        rows.append({"name": name, **row})
        write_report(args.out, rows, header)


if __name__ == "__main__":
    main()
