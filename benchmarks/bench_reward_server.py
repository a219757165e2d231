"""Benchmark (not a test): a reward served over HTTP, scored overlapped with sampling or not, and the round trip.

    python benchmarks/bench_reward_server.py                  # both parts, ~4 min on 2 CPU cores
    python benchmarks/bench_reward_server.py --skip-overlap   # the round trip only (seconds)

1. Overlap. flowgrpo_baseline.py on the toy world (4 groups x 4 images, rollout batches of 4: 4 batches an
   iteration, 10 steps), its toyworld reward served by common/plumbing/reward_server.py through a stand-in scorer that
   sleeps what a real scorer takes per image before returning the toy score. Each delay runs twice: overlapped (the
   default: a batch is scored while the next one samples) and sequential (RemoteReward.overlap = False: each batch
   scored before the next samples). Reported: seconds per iteration (iterations 1.. of --iterations, from
   metrics.jsonl's time/elapsed_s; iteration 0 also pays the first evaluation), and whether the two arms' metrics rows
   (but their timings) and final weights' digests are identical. Delays per image:
   - geneval 0.625 s: 20 s for 32 images, "API call is slow", github.com/yifan123/reward-server/issues/11
     (2025-12-11: Mask2Former + CLIP, flow_grpo's GenEval server);
   - ocr 0.24 s: PaddleOCR on a GPU (P100), about 240 ms an image, github.com/PaddlePaddle/PaddleOCR/issues/74
     (2020-05-20; "over 2 s" on a CPU, where flow_grpo runs it by default).
   - matched 0.07 s: about the toy model's own sampling time per image here (10 steps, 2 CPU threads), the case
     where overlap gains most.
   Overlap hides the sampling of every batch but the first under the scoring of the one before: per iteration it can
   save at most (batches - 1) x min(sampling, scoring) of a batch.
2. Round trip. The project's wire format on loopback, a scorer that returns zeros: milliseconds per request of
   --batch images (PNG encode, base64, JSON, HTTP, decode on the server, reply), at the toy size and at 512 px, of
   smooth random images (16 x 16 noise, upsampled bilinearly).
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the round trip's client: common/
DELAYS = {"geneval": 0.625, "ocr": 0.24, "matched": 0.07}
FLAGS = [
    *("--groups-per-iteration", "4", "--group-size", "4", "--rollout-batch-size", "4"),
    *("--eval-every", "100000", "--eval-seeds-per-prompt", "1", "--eval-num-steps", "10"),
]
SEQUENTIAL = (
    "import runpy, sys; from common.plumbing.remote_reward import RemoteReward; RemoteReward.overlap = False; "
    "sys.argv[0] = 'flowgrpo_baseline.py'; runpy.run_path('flowgrpo_baseline.py', run_name='__main__')"
)


# ---------------------------------------------------------------------------------------------- stand-in scorers
def delayed_toyworld():
    """The toy score, after $BENCH_DELAY_PER_IMAGE seconds per image (a GenEval or OCR server's time)."""
    from common.plumbing.reward_server import registry_scorer

    score, delay = registry_scorer("toyworld"), float(os.environ["BENCH_DELAY_PER_IMAGE"])

    def scorer(images, prompts, metadata):
        time.sleep(delay * len(images))
        return score(images, prompts, metadata)

    return scorer


def zeros():
    return lambda images, prompts, metadata: [0.0] * len(images)


# ---------------------------------------------------------------------------------------------- helpers
def env(threads: int, **extra) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": str(threads),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        **extra,
    }


def start_server(scorer: str, threads: int, **extra):
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.plumbing.reward_server", "--scorer", scorer, "--port", "0"],
        cwd=ROOT,
        env=env(threads, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())
    if not url:
        proc.kill()
        raise SystemExit(f"error: the reward server ({scorer}) did not start")
    return proc, url[0]


def run_arm(url: str, sequential: bool, iterations: int, threads: int, out: str, name: str):
    """One run; its metrics rows and the final weights' digest it prints."""
    prompts = os.path.join(out, "prompts.txt")
    with open(prompts, "w") as f:  # toy-world prompts, also the (4-image) evaluation
        f.write("a photo of a red circle\na photo of two blue squares\n")
        f.write("a photo of a green triangle\na photo of three yellow circles\n")
    flags = [
        *("--reward", f"remote:toyworld@{url}", "--num-iterations", str(iterations)),
        *("--prompts-file", prompts, "--eval-prompts", prompts),
        *("--output-dir", out, "--run-name", name, *FLAGS),
    ]
    cmd = ["-c", SEQUENTIAL] if sequential else [os.path.join(ROOT, "flowgrpo_baseline.py")]
    r = subprocess.run(
        [sys.executable, *cmd, *flags], cwd=ROOT, env=env(threads), capture_output=True, text=True
    )
    if r.returncode:
        raise SystemExit(f"error: the {name} run failed:\n{r.stderr[-2000:]}")
    digest = re.search(r"final weights: rank 0 sha256 (\w+)", r.stdout + r.stderr)[1]
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, digest


def seconds_per_iteration(rows: list[dict]) -> float:
    elapsed = [r["time/elapsed_s"] for r in rows if not r.get("final")]
    return statistics.mean(b - a for a, b in zip(elapsed[:-1], elapsed[1:]))


def without_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def overlap(delays: dict, iterations: int, threads: int) -> list[str]:
    lines = [
        "| scorer delay | per batch of 4 | sequential s/iteration | overlapped s/iteration | saved | same numbers |",
        "|---|---|---|---|---|---|",
    ]
    for label, delay in delays.items():
        server, url = start_server(
            "toyworld=benchmarks.bench_reward_server:delayed_toyworld",
            threads,
            BENCH_DELAY_PER_IMAGE=str(delay),
        )
        try:
            out = tempfile.mkdtemp(prefix=f"bench_reward_{label}_")
            seq, seq_digest = run_arm(url, True, iterations, threads, out, "sequential")
            ovl, ovl_digest = run_arm(url, False, iterations, threads, out, "overlapped")
        finally:
            server.kill()
        s, o = seconds_per_iteration(seq), seconds_per_iteration(ovl)
        same = without_timings(seq) == without_timings(ovl) and seq_digest == ovl_digest
        lines.append(
            f"| {label} {delay:g} s/image | {4 * delay:.2f} s | {s:.2f} | {o:.2f} | {s - o:.2f} s "
            f"({100 * (s - o) / s:.0f} %) | {'yes' if same else 'NO'} (digest {ovl_digest}) |"
        )
        print(lines[-1], flush=True)
    return lines


def round_trip(batch: int, sizes: list[int], repeats: int, threads: int) -> list[str]:
    import torch

    from common.plumbing.reward_flags import build_reward

    server, url = start_server("zeros=benchmarks.bench_reward_server:zeros", threads)
    lines = [
        f"| image size | ms per request of {batch} images (median of {repeats}) | request size |",
        "|---|---|---|",
    ]
    try:
        model = build_reward(f"remote:zeros@{url}")
        for size in sizes:
            # smooth content, as generated images are (pure noise is PNG's worst case, ~3x larger)
            coarse = torch.rand(batch, 3, 16, 16, generator=torch.Generator().manual_seed(0))
            images = torch.nn.functional.interpolate(coarse, size=size, mode="bilinear")
            prompts = ["a photo of a red circle"] * batch
            model(images, prompts)  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                model(images, prompts)
                times.append(1000 * (time.perf_counter() - start))
            pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            body = model.fns[0]._request(pixels, prompts)
            lines.append(
                f"| {size} px | {statistics.median(times):.0f} ms | {len(body) / 2**20:.2f} MiB |"
            )
            print(lines[-1], flush=True)
    finally:
        server.kill()
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--delays", default=",".join(f"{k}={v}" for k, v in DELAYS.items()))
    p.add_argument("--batch", type=int, default=64, help="images per request in the round trip")
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-overlap", action="store_true")
    p.add_argument("--out", default=None, help="append the tables to this file")
    a = p.parse_args()
    header = (
        f"bench_reward_server.py, {datetime.date.today()}, {a.threads} threads, "
        f"`python benchmarks/bench_reward_server.py {' '.join(sys.argv[1:])}`".rstrip()
    )
    print(header, flush=True)
    lines = [header, ""]
    if not a.skip_overlap:
        delays = {k: float(v) for k, v in (d.split("=") for d in a.delays.split(","))}
        lines += overlap(delays, a.iterations, a.threads) + [""]
    lines += round_trip(a.batch, a.sizes, a.repeats, a.threads)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
