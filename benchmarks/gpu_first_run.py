"""The first GPU job (issue #55 item 4): the paper presets on full-size random-weight SD3.5-Medium and FLUX.1-dev, in
fp16 and bf16, DDP and FSDP2, with evaluation, each run in a fresh process; per run its seconds per phase, its peak
memory beside the memory model's estimate, its gradient's share of zero entries, and PASS or FAIL.

    python benchmarks/gpu_first_run.py                        # one H100 80 GB: about 8 minutes, no downloads
    python benchmarks/gpu_first_run.py --tiny --out /tmp/g1   # the same code on tiny models, CPU (tests/)

Without CUDA (and without --tiny) it prints one line and exits 0.

1. Builds, in a subprocess, random-weight model folders into --cache (speed and memory do not depend on the values):
   SD3.5-M and FLUX.1-dev with their published transformers and the 16-channel VAE; text encoders at the published
   widths, heads and feed-forward sizes: CLIP-L and CLIP-G whole, T5-XXL's encoder with 2 of its 24 layers (the other
   22 are 8.6 GB of bf16 weights and about 4 s of loading per run; they change no transient, and the memory model
   counts each folder's own encoders); a CLIP ViT-H/14 reward folder that `--reward pickscore` loads (PickScore's
   architecture, HPSv2's too). Tokenizers are common/tiny.py's word lists.
2. Runs each row of RUNS: a paper preset's command (docs/*.md, "## Paper preset", via benchmarks/presets.py) with the
   few flags that scale it down (a few groups, 2 iterations, no calibration, the random folders), under
   `torchrun --nproc_per_node 1` (nccl on a GPU, gloo on CPU), each in its own process, so that an out-of-memory run
   cannot hold memory for the next. The process runs the script through `--wrap`, which records the peak of
   torch.cuda.max_memory_allocated at exit and the images of every VAE decode call.
3. Per run: seconds per phase from its metrics.jsonl (iteration 1; evaluation at iteration 0), the peak beside
   bench_memory.estimate for that run's flags and folders, train/grad_zero_fraction, train/skipped_steps and
   train/loss_scale (fp16), and PASS or FAIL with the reason (FAIL_RULES). Results go to {out}/gpu_first_run.md and
   .json after every run, so a crash leaves what ran.
4. The FLUX cuDNN-attention workaround: common/backbones.py turns the cuDNN SDPA backend off for FLUX on CUDA because
   a FLUX LoRA backward crashed with it on torch 2.11; a separate process forces that backend for one FLUX LoRA
   forward and backward and reports whether this torch still needs the workaround (reported, never a FAIL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 2**30


def size(n: float) -> str:
    """Bytes as GiB, or MiB under 1 GiB (the tiny runs)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB or n != n else f"{n / 2**20:.0f} MiB"


# FAIL when: the process exits non-zero (an out-of-memory error named as such), iteration 1 has no finite loss, its
# trained weights' gradient has more than ZERO_LIMIT exact zeros after unscaling (an fp16 underflow gives ~0.9; a
# LoRA's first step has 0.5 by construction: B starts at 0, so A's gradient is 0, which is why iteration 0 is not
# read), fp16 skipped every optimizer step of iteration 1 (train/optimizer_steps counts the steps taken), a VAE
# decode call took more than --decode-batch-size images, or the peak passes the memory model's estimate by more than
# PEAK_TOLERANCE (the model leaves out the cuDNN/cuBLAS workspaces and the allocator's rounding: it was within
# -1 % / +4 % of the H200's peaks, `bench_memory.py --check`).
ZERO_LIMIT = 0.5
PEAK_TOLERANCE = 0.15
T5_LAYERS = 2
DECODE_BATCH = 8  # --decode-batch-size of every run (the default)


# ------------------------------------------------------------------------------------------------ the model folders
def encoder_configs(kind: str, tiny: bool) -> dict:
    """The text encoders of a folder, component -> transformers config: the published ones (bench_memory) with the
    ids of common/tiny.py's tokenizers and T5_LAYERS of T5's layers; tiny: common/tiny.py's own."""
    from transformers import CLIPTextConfig, T5Config

    from benchmarks import bench_memory as bm

    if tiny:
        return {}
    ids = dict(
        bos_token_id=0, eos_token_id=1, pad_token_id=1
    )  # CLIP pools at the tokenizer's eos (tiny.py)
    clip_l = CLIPTextConfig(**bm.CLIP_L, **ids)
    t5 = T5Config(
        **{**bm.T5_XXL, "num_layers": T5_LAYERS},
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        dropout_rate=0.0,
    )
    if kind == "sd3":
        return dict(
            text_encoder=clip_l,
            text_encoder_2=CLIPTextConfig(**bm.CLIP_G, **ids),
            text_encoder_3=t5,
        )
    return dict(text_encoder=clip_l, text_encoder_2=t5)


def full_size_pipeline(kind: str, device: str):
    """A random-weight SD3.5-M ("sd3") or FLUX.1-dev ("flux") pipeline on `device`: the published transformer (bf16)
    and VAE (fp32), encoder_configs' text encoders (bf16), common/tiny.py's tokenizers and scheduler."""
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    from benchmarks import bench_memory as bm
    from common.tiny import build_flux, build_sd3, tiny_vae

    classes = {
        "sd3": dict(
            transformer=SD3Transformer2DModel,
            text_encoder=CLIPTextModelWithProjection,
            text_encoder_2=CLIPTextModelWithProjection,
            text_encoder_3=T5EncoderModel,
        ),
        "flux": dict(
            transformer=FluxTransformer2DModel,
            text_encoder=CLIPTextModel,
            text_encoder_2=T5EncoderModel,
        ),
    }[kind]
    # random init of 2-12 B parameters: minutes on a CPU, seconds on a GPU
    with torch.device(device):
        vae = tiny_vae(**bm.VAE, **VAE_FACTORS[kind])  # fp32
        # the tokenizers, the scheduler and small placeholders for the rest, replaced below
        build = build_sd3 if kind == "sd3" else build_flux
        pipe = build(
            None,
            latent_channels=16,
            max_len=77,
            vae=vae,
            **({"sd35": True} if kind == "sd3" else {}),
        )
        default = torch.get_default_dtype()
        # built in bf16: FLUX's fp32 weights alone would be 48 GB, and its bf16 copy 24 GB more
        torch.set_default_dtype(torch.bfloat16)
        try:
            parts = {"transformer": classes["transformer"](**bm.CONFIGS[bm.MODEL_OF_KIND[kind]][1])}
            for component, config in encoder_configs(kind, False).items():
                parts[component] = classes[component](config)
        finally:
            torch.set_default_dtype(default)
    pipe.register_modules(**parts)
    return pipe


def spec_of(pipe, kind: str):
    """bench_memory's ModelSpec of a pipeline built here (full_size_pipeline on the meta device: the folder's
    configs without writing it)."""
    from benchmarks import bench_memory as bm

    names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    encoders = [
        (n, type(m).__name__, m.config.to_dict())
        for n, m in pipe.components.items()
        if n in names and m is not None
    ]
    return bm.ModelSpec(
        kind,
        bm._freeze(dict(pipe.transformer.config)),
        bm._freeze(encoders),
        bm._freeze(dict(pipe.vae.config)),
    )


def build_model_folder(name: str, path: str, tiny: bool, device: str) -> None:
    """The folder of SD3.5-M ("sd35") or FLUX.1-dev ("flux") at `path`: full_size_pipeline's, or (tiny) common/tiny.py's
    tiny SD3.5 / FLUX.1-dev."""
    from common.tiny import build_flux, build_sd3

    kind = "sd3" if name == "sd35" else "flux"
    if tiny:
        (build_sd3 if kind == "sd3" else build_flux)(
            path, **({"sd35": True} if kind == "sd3" else {})
        )
    else:
        full_size_pipeline(kind, device).save_pretrained(path)


VAE_FACTORS = {  # the published vae/config.json scaling and shift
    "sd3": dict(scaling_factor=1.5305, shift_factor=0.0609),
    "flux": dict(scaling_factor=0.3611, shift_factor=0.1159),
}


def build_reward_folder(path: str, tiny: bool, device: str) -> None:
    """A random-weight CLIP folder that `--reward pickscore --reward-model-paths pickscore=path` loads: the CLIP
    ViT-H/14 of PickScore (tiny: 1 layer of 32), CLIPImageProcessor's 224-px geometry, common/tiny.py's tokenizer."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from benchmarks import bench_memory as bm
    from common.tiny import make_clip_tokenizer

    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if tiny:
        small = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
        config = CLIPConfig(
            text_config=dict(small, vocab_size=49408, max_position_embeddings=77, **ids),
            vision_config=dict(small, patch_size=14, image_size=224),
            projection_dim=16,
        )
    else:
        config = CLIPConfig(
            text_config=dict(bm.CLIP_H["text_config"], **ids),
            vision_config=bm.CLIP_H["vision_config"],
            projection_dim=bm.CLIP_H["projection_dim"],
        )
    with torch.device(device):
        CLIPModel(config).to(torch.bfloat16).save_pretrained(path)
    CLIPImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    ).save_pretrained(path)
    make_clip_tokenizer(model_max_length=77).save_pretrained(path)


FOLDERS = ("sd35", "flux", "reward")


def folder_path(cache: str, name: str, tiny: bool) -> str:
    return os.path.join(cache, name + ("_tiny" if tiny else ""))


def build_folders(cache: str, tiny: bool) -> None:
    """Every folder not built yet (a finished one has model_index.json or config.json); in this process."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in FOLDERS:
        path = folder_path(cache, name, tiny)
        marker = "config.json" if name == "reward" else "model_index.json"
        if os.path.exists(os.path.join(path, marker)):
            continue
        t0 = time.perf_counter()
        tmp = path + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        if name == "reward":
            build_reward_folder(tmp, tiny, device)
        else:
            build_model_folder(name, tmp, tiny, device)
        os.replace(tmp, path)
        print(f"built {path} in {time.perf_counter() - t0:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------------ the runs
def override(argv: list[str], changes: dict) -> list[str]:
    """argv with each flag of `changes` replaced: its old occurrence and values removed, then the flag and its values
    appended (None: removed only; []: a flag without value)."""
    out, skip = [], False
    for tok in argv:
        if tok.startswith("--"):
            skip = tok in changes
        if not skip:
            out.append(tok)
    for flag, values in changes.items():
        if values is not None:
            out += [flag, *map(str, values)]
    return out


# One row per run, in the order they run (the most telling first, so a budget cut drops the least): (name, the
# preset's script and block, model folder, precision, parallel, the flags that scale the preset down, the tiny ones).
# Each covers: fp16 with loss scaling on a LoRA (1, 3) and on full fine-tuning (5); bf16 (2, 4, 6, 8); DDP (1, 4, 6,
# 8) and FSDP2 (2, 3, 5); every script; evaluation of 64 images per call at 720 px (2: FLUX, the decode chunking's
# worst case) and at 512 px (3). G²RPO's preset fine-tunes FLUX.1-dev fully on 16 GPUs, which one GPU cannot hold
# (fp32 weights, gradients and Adam: 190 GB): here its FLUX run trains a LoRA, and full fine-tuning runs on SD3.5-M.
SCALED = {  # what every run changes in its preset (--model-path, --reward-model-paths are filled in)
    "--num-iterations": [2],
    "--eval-every": [1000],
    "--save-every": [1000],
    "--eval-seeds-per-prompt": [1],
    "--eval-num-steps": [2],
    "--reward": ["pickscore"],
    "--prompts-file": None,  # the toy prompts: words the random folders' tokenizers know
    "--reward-mix": None,
}
SD35_512 = {"--group-size": [9], "--groups-per-iteration": [1]}
G2RPO_FLUX_LORA = {
    "--full-finetune": None,
    "--lora-target": ["attention"],
    "--lora-rank": [32],
    "--lora-alpha": [64],
    "--num-steps": [8],
    "--branch-steps": [0],
    "--group-size": [4],
    "--groups-per-iteration": [1],
    "--eval-num-steps": [1],
}
G2RPO_SD35_FULL = {
    "--resolution": [512],
    "--num-steps": [8],
    "--branch-steps": [0],
    "--granularities": [1, 2],
    "--group-size": [4],
    "--groups-per-iteration": [1],
    "--rollout-batch-size": [8],
    "--gradient-checkpointing": None,
}
RUNS = [
    ("flowgrpo SD3.5-M fp16 ddp", "flowgrpo_baseline.py", 0, "sd35", "fp16", "ddp", SD35_512),
    (
        "g2rpo FLUX.1-dev LoRA 720 px bf16 fsdp eval 64",
        "g2rpo.py",
        0,
        "flux",
        "bf16",
        "fsdp",
        G2RPO_FLUX_LORA,
    ),
    (
        "diffusionnft SD3.5-M fp16 fsdp eval 64",
        "diffusionnft.py",
        0,
        "sd35",
        "fp16",
        "fsdp",
        SD35_512,
    ),
    (
        "densegrpo SD3.5-M bf16 ddp",
        "densegrpo.py",
        0,
        "sd35",
        "bf16",
        "ddp",
        {**SD35_512, "--calibration-iterations": [0], "--calibration-trajectories": None},
    ),
    (
        "g2rpo SD3.5-M full fp16 fsdp",
        "g2rpo.py",
        0,
        "sd35",
        "fp16",
        "fsdp",
        G2RPO_SD35_FULL,
    ),
    (
        "flowgrpo FLUX.1-dev bf16 ddp",
        "flowgrpo_baseline.py",
        1,
        "flux",
        "bf16",
        "ddp",
        {"--group-size": [6], "--groups-per-iteration": [1]},
    ),
    ("cudnn", None, None, "flux", "bf16", None, None),
    ("g2rpo SD3.5-M full bf16 ddp", "g2rpo.py", 0, "sd35", "bf16", "ddp", G2RPO_SD35_FULL),
    (  # GenEval's 18 rows per training forward; no burn-in, so that iteration 1 trains
        "awm SD3.5-M fp16 ddp",
        "awm.py",
        0,
        "sd35",
        "fp16",
        "ddp",
        {"--group-size": [6], "--groups-per-iteration": [1], "--burn-in-iterations": [0]},
    ),
]
EVAL_64 = {
    "g2rpo FLUX.1-dev LoRA 720 px bf16 fsdp eval 64",
    "diffusionnft SD3.5-M fp16 fsdp eval 64",
}
# --tiny: the same runs scaled to the tiny models on CPU (32 px, 4 steps); the test runs one of them
TINY = {
    "--resolution": [32],
    "--num-steps": [4],
    "--eval-num-steps": [1],
    "--max-sequence-length": [16],
    "--lora-rank": [4],  # the tiny transformers are 32 wide
    "--lora-alpha": [8],
    "--rollout-batch-size": [4],
    "--train-batch-size": [2],
    "--completion-batch-size": None,
}
TINY_GROUPS = {"--group-size": [4], "--groups-per-iteration": [1]}
# Estimated seconds on one H100 (docs/usage.md, "Your first GPU run": from ../shared/reference/gpu_anchor.md's
# per-image-per-step costs, 15 % over the H200's, plus a process start and a folder load of 15 s for SD3.5-M and
# 25 s for FLUX.1-dev, and a 36 GB checkpoint write for full fine-tuning)
ESTIMATED_S = [40, 65, 35, 55, 65, 50, 30, 65]
BUILD_S = 90


def run_flags(row, folders: dict, out: str, tiny: bool) -> tuple[list[str], int]:
    """The run's command line (the preset's, overridden) and the images one evaluation samples."""
    from benchmarks.presets import DOCS, preset_command, read

    name, script, block, model, precision, parallel, scaled = row
    argv, _ = preset_command(read(DOCS[script]), script, block)
    eval_images = 64 if name in EVAL_64 else 1
    prompts = os.path.join(out, f"eval_{eval_images}.txt")
    words = ["a photo of a red circle", "two blue squares", "a green cat", "a yellow house"]
    with open(prompts, "w") as f:
        f.write("\n".join(words[k % 4] for k in range(eval_images)) + "\n")
    changes = {
        **SCALED,
        **scaled,
        "--model-path": [folders[model]],
        "--reward-model-paths": [f"pickscore={folders['reward']}"],
        "--eval-prompts": [prompts],
        "--eval-batch-size": [64],
        "--decode-batch-size": [DECODE_BATCH],
        "--mixed-precision": [precision],
        "--parallel": [parallel],
        "--output-dir": [os.path.join(out, "runs")],
        "--run-name": [name.replace(" ", "_")],
    }
    if tiny:
        changes.update(TINY)
        changes.update({k: v for k, v in TINY_GROUPS.items() if k in scaled})
        if script == "g2rpo.py":
            changes.update({"--granularities": [1, 2], "--rollout-batch-size": [8]})
    return override(argv, changes), eval_images


def estimate_for(script: str, flags: list[str], spec, reward: dict, eval_images: int) -> dict:
    """bench_memory's estimate for a run's flags on one GPU, its model `spec` and its PickScore CLIP config."""
    from unittest import mock

    from benchmarks import bench_memory as bm
    from benchmarks.presets import parse_args

    with mock.patch.dict(
        os.environ, {"RANK": "0"}
    ):  # launched by torchrun: --parallel fsdp is allowed
        args = parse_args(script, flags, 1)
    s = bm.setting(script, args, 1, spec.kind, eval_images=eval_images)
    return bm.estimate(spec, s, reward_configs={"pickscore": reward})


def planned(out: str) -> list[tuple[str, dict]]:
    """Every run of RUNS at full size with its estimate, from the configs the job's folders get (built on the meta
    device, nothing written but the evaluation prompt files into `out`): docs/usage.md's table, and the test that
    the matrix fits an 80 GB card."""
    from benchmarks import bench_memory as bm

    pipes = {m: full_size_pipeline(k, "meta") for m, k in (("sd35", "sd3"), ("flux", "flux"))}
    specs = {m: spec_of(p, "sd3" if m == "sd35" else "flux") for m, p in pipes.items()}
    folders = {"sd35": "/models/sd35", "flux": "/models/flux", "reward": "/models/reward"}
    reward = dict(bm.CLIP_H)
    rows = []
    for row in RUNS:
        if row[1] is None:
            continue
        flags, eval_images = run_flags(row, folders, out, tiny=False)
        rows.append((row[0], estimate_for(row[1], flags, specs[row[3]], reward, eval_images)))
    return rows


def wrap(out_json: str, script: str, argv: list[str]) -> None:
    """`--wrap`: run `script` as __main__ (under torchrun, as the scripts run), counting the images of every VAE
    decode call, and write at exit {peak: torch.cuda.max_memory_allocated, reserved, decode_max, decode_calls}."""
    import atexit
    import runpy

    import torch
    from diffusers import AutoencoderKL

    seen = dict(decode_max=0, decode_calls=0)
    decode = AutoencoderKL.decode

    def counted(self, z, *args, **kwargs):
        seen["decode_max"] = max(seen["decode_max"], z.shape[0])
        seen["decode_calls"] += 1
        return decode(self, z, *args, **kwargs)

    AutoencoderKL.decode = counted

    def write():
        if os.environ.get("RANK", "0") != "0":
            return
        cuda = torch.cuda.is_available()
        seen.update(
            peak=torch.cuda.max_memory_allocated() if cuda else None,
            reserved=torch.cuda.max_memory_reserved() if cuda else None,
        )
        with open(out_json, "w") as f:
            json.dump(seen, f)

    atexit.register(write)
    sys.argv = [script, *argv]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


def read_rows(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def judge(r: dict) -> list[str]:
    """The reasons this run FAILs (FAIL_RULES above; empty: PASS)."""
    why = []
    if r["rc"] != 0:
        why.append("out of memory" if r["oom"] else f"exit {r['rc']}: {r['last_error']}")
        return why
    it = r.get("iteration1")
    if not it:
        return ["no metrics row for iteration 1"]
    if not finite(it.get("policy_loss")):
        why.append(f"no finite loss at iteration 1 ({it.get('policy_loss')})")
    zero = it.get("train/grad_zero_fraction")
    if zero is None:
        why.append("no train/grad_zero_fraction in metrics.jsonl")
    elif zero > ZERO_LIMIT:
        why.append(
            f"{zero:.0%} of the gradient's entries are exactly zero (limit {ZERO_LIMIT:.0%})"
        )
    skipped = it.get("train/skipped_steps", 0)
    if r["precision"] == "fp16" and skipped and not it.get("train/optimizer_steps", 0):
        why.append(f"fp16: all {skipped} optimizer steps of iteration 1 skipped")
    if r["decode_max"] > DECODE_BATCH:
        why.append(
            f"a VAE decode call took {r['decode_max']} images (--decode-batch-size {DECODE_BATCH})"
        )
    if r["peak"] is not None and r["peak"] > (1 + PEAK_TOLERANCE) * r["estimate"]:
        why.append(
            f"peak {r['peak'] / GiB:.1f} GiB above the estimate {r['estimate'] / GiB:.1f} GiB by more than "
            f"{PEAK_TOLERANCE:.0%}"
        )
    return why


def run_process(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cmd` in a process group of its own: at the timeout the whole group is killed,
    torchrun's worker too, so that no process of this run keeps GPU memory for the next."""
    import signal

    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return -9, out, err + f"\ntimed out after {timeout:.0f} s"


def output_root(out: str, need: float) -> str | None:
    """Where a run's folder goes: {out}/runs, or /dev/shm when the disk lacks `need` bytes (a full fine-tuning
    checkpoint of SD3.5-M is about 36 GB: fp32 weights, Adam's two moments and the saved transformer, beside the
    model folders on a 64 GB disk); None when neither has room."""
    for root in (os.path.join(out, "runs"), "/dev/shm/gpu_first_run"):
        parent = root if os.path.isdir(root) else os.path.dirname(root)
        if os.path.isdir(parent) and shutil.disk_usage(parent).free > need:
            return root
    return None


def run_one(row, folders: dict, out: str, tiny: bool, timeout: float) -> dict:
    """One run in a fresh torchrun process; its result row (read back from its files)."""
    from benchmarks import bench_memory as bm

    name, script, _, model, precision, parallel, _ = row
    flags, eval_images = run_flags(row, folders, out, tiny)
    r = dict(
        name=name,
        script=script,
        model=model,
        precision=precision,
        parallel=parallel,
        flags=" ".join(flags),
    )
    try:
        with open(os.path.join(folders["reward"], "config.json")) as f:
            reward = json.load(f)
        e = estimate_for(script, flags, bm.from_folder(folders[model]), reward, eval_images)
        r.update(estimate=e["peak"], estimate_phase=e["phase"])
        # a checkpoint: 16 bytes per weight with full fine-tuning, a LoRA's is small
        need = (16 * e["P"] if "--full-finetune" in flags else 0) + 2 * GiB
    except Exception as err:  # noqa: BLE001 -- a run's report must not be lost to its estimate
        r.update(estimate=float("nan"), estimate_phase=f"estimate failed: {err}")
        need = 2 * GiB
    root = output_root(out, need)
    if root is None:
        return dict(r, skipped=True, fail=[f"no disk for its {need / 1e9:.0f} GB checkpoint"])
    os.makedirs(root, exist_ok=True)
    run_name = name.replace(" ", "_")
    flags = override(flags, {"--output-dir": [root], "--run-name": [run_name]})
    run_dir = os.path.join(root, run_name)
    shutil.rmtree(run_dir, ignore_errors=True)
    peak_json = os.path.join(out, "peak.json")
    if os.path.exists(peak_json):
        os.remove(peak_json)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        os.path.abspath(__file__),
        "--wrap",
        peak_json,
        script,
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    rc, stdout, stderr = run_process(cmd, env, timeout)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, run_name + ".log"), "w") as f:
        f.write(" ".join(cmd) + "\n\n" + stdout + "\n" + stderr)
    seen = {}
    if os.path.exists(peak_json):
        with open(peak_json) as f:
            seen = json.load(f)
    rows = [m for m in read_rows(run_dir) if not m.get("final")]
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    # the script's own line (its one-line error, or the exception), not torchrun's trailer about its child
    launcher = (
        "torch/distributed/elastic",
        "ChildFailedError",
        "traceback :",
        "error_file",
        "errors.html",
    )
    errors = [
        line for line in lines if "rror" in line and not any(mark in line for mark in launcher)
    ]
    r.update(
        rc=rc,
        wall_s=wall,
        oom="out of memory" in stderr.lower() or "OutOfMemoryError" in stderr,
        last_error=(errors or lines or ["(no output)"])[-1][-300:],
        iteration0=rows[0] if rows else None,
        iteration1=rows[1] if len(rows) > 1 else None,
        peak=seen.get("peak"),
        reserved=seen.get("reserved"),
        decode_max=seen.get("decode_max", 0),
        decode_calls=seen.get("decode_calls", 0),
    )
    r["fail"] = judge(r)
    shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoints
    return r


CUDNN_PROBE = r"""
import json, sys, torch
sys.path.insert(0, {root!r})
from torch.nn.attention import SDPBackend, sdpa_kernel
from common.backbones import LORA_TARGETS, load_backbone
from common.policy import Trainable
backbone = load_backbone({path!r}, "cuda", precision="bf16")  # turns the cuDNN backend off for FLUX
Trainable(backbone, False, 32, 64, LORA_TARGETS["attention"], need_reference=False)
torch.backends.cuda.enable_cudnn_sdp(True)  # what the workaround turns off, back on
emb = backbone.encode(["a photo of a red circle"])
x = backbone.initial_noise(1, 512, 512)
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # the cuDNN kernel or an error, nothing else
    backbone.velocity(x, 0.5, emb, 3.5).pow(2).mean().backward()
torch.cuda.synchronize()
grads = [p.grad for p in backbone.transformer.parameters() if p.requires_grad]
print(json.dumps(dict(ok=all(g is not None and bool(torch.isfinite(g).all()) for g in grads))))
"""


def cudnn_probe(flux: str, timeout: float) -> dict:
    """One FLUX.1-dev LoRA forward and backward with the cuDNN SDPA kernel forced, in its own process: does this
    torch still need common/backbones.py's enable_cudnn_sdp(False)? (A crash there kills only that process.)"""
    import torch

    t0 = time.perf_counter()
    code = CUDNN_PROBE.format(root=ROOT, path=flux)
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    rc, out, err = run_process([sys.executable, "-c", code], env, timeout)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    ok = rc == 0 and '"ok": true' in out
    if ok:
        verdict = (
            f"cuDNN SDPA, FLUX.1-dev LoRA forward + backward: ran, finite gradients (torch {torch.__version__}):"
            " common/backbones.py's enable_cudnn_sdp(False) is no longer needed on this GPU"
        )
    else:
        verdict = (
            f"cuDNN SDPA, FLUX.1-dev LoRA forward + backward: FAILED (exit {rc}: "
            f"{(lines or ['no output'])[-1][-200:]}; torch {torch.__version__}): keep enable_cudnn_sdp(False)"
        )
    return dict(name="cudnn", ok=ok, rc=rc, verdict=verdict, wall_s=time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------------- reports
def run_lines(k: int, n: int, r: dict) -> list[str]:
    """What the job prints for one run (docs/usage.md, "Your first GPU run", explains each line)."""
    if r["name"] == "cudnn":
        return [f"[{k}/{n}] cudnn probe ({r['wall_s']:.0f} s): {r['verdict']}"]
    if r.get("skipped"):
        return [f"[{k}/{n}] {r['name']}: FAIL: {'; '.join(r['fail'])}"]
    status = "PASS" if not r["fail"] else "FAIL: " + "; ".join(r["fail"])
    out = [f"[{k}/{n}] {r['name']}: {status} ({r['wall_s']:.0f} s)"]
    it0, it1 = r["iteration0"] or {}, r["iteration1"] or {}
    if it1:
        phases = "  ".join(
            f"{p} {it1.get(f'time/{p}_s', 0.0):.1f}" for p in ("rollout", "reward", "train")
        )
        out.append(
            f"    seconds: {phases} (iteration 1); eval {it0.get('time/eval_s', 0.0):.1f} (iteration 0)"
        )
    est = f"estimate {size(r['estimate'])} (largest phase: {r['estimate_phase']})"
    if r["peak"] is None:
        out.append(f"    memory: no CUDA peak on CPU; {est}")
    else:
        out.append(
            f"    memory: peak {size(r['peak'])} allocated ({size(r['reserved'])} reserved), {est}, "
            f"peak/estimate {r['peak'] / r['estimate']:.2f}"
        )
    if it1:
        zero = it1.get("train/grad_zero_fraction")
        line = "    gradient: " + (
            f"{zero:.1%} of its entries exactly zero (iteration 1)" if zero is not None else "n/a"
        )
        if r["precision"] == "fp16":
            skipped = it1.get("train/skipped_steps", 0)
            steps = skipped + it1.get("train/optimizer_steps", 0)
            line += (
                f"; fp16 loss scale {it1.get('train/loss_scale', float('nan')):g}, "
                f"{skipped} of {steps} optimizer steps skipped"
            )
        out.append(line)
    out.append(f"    decode: at most {r['decode_max']} images per call ({r['decode_calls']} calls)")
    return out


def write_report(out: str, header: list[str], results: list[dict], lines: list[str]) -> None:
    """{out}/gpu_first_run.json and .md, whole after every run."""
    from common.utils import atomic_write

    atomic_write(
        os.path.join(out, "gpu_first_run.json"), json.dumps(results, indent=1, default=str)
    )
    atomic_write(
        os.path.join(out, "gpu_first_run.md"), "\n".join(header + ["", "```", *lines, "```"]) + "\n"
    )


def gpu_name() -> str:
    """The GPU's name from nvidia-smi: asking torch would open a CUDA context in this process, whose memory the runs
    then lack."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        return names.splitlines()[0] if names else "CUDA device"
    except (OSError, subprocess.SubprocessError):
        return "CUDA device"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_first_run"))
    ap.add_argument("--cache", default="/tmp/flow_rl_fullsize", help="the random-weight folders")
    ap.add_argument("--tiny", action="store_true", help="tiny models on CPU: the same code")
    ap.add_argument("--only", nargs="*", help="run names (or their first word) to run")
    ap.add_argument(
        "--budget-s", type=float, default=480, help="no run starts after this many seconds"
    )
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not a.tiny:
        print("gpu_first_run: skipped, no CUDA device (--tiny runs the same code on CPU)")
        return 0
    if a.build_only:
        build_folders(a.cache, a.tiny)
        return 0
    t_start = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    device = gpu_name() if torch.cuda.is_available() else "CPU (--tiny)"
    header = [
        f"# First GPU job: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"`python benchmarks/gpu_first_run.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
    ]
    print("\n".join(header), flush=True)
    # the folders in a process of their own: this one never holds GPU memory the runs could want
    b = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--build-only", "--cache", a.cache]
        + ["--tiny"] * a.tiny,
        env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"},
        text=True,
    )
    if b.returncode:
        print(f"FAIL: building the model folders exited {b.returncode}", flush=True)
        return 1
    folders = {n: folder_path(a.cache, n, a.tiny) for n in FOLDERS}
    rows = [r for r in RUNS if not a.only or any(r[0].startswith(o) for o in a.only)]
    results, lines = [], []
    for k, row in enumerate(rows, 1):
        elapsed = time.perf_counter() - t_start
        if elapsed > a.budget_s:
            lines.append(
                f"[{k}/{len(rows)}] {row[0]}: SKIP (started after --budget-s {a.budget_s:g} s)"
            )
            print(lines[-1], flush=True)
            results.append(dict(name=row[0], skipped=True))
            continue
        timeout = max(60.0, a.budget_s + 120 - elapsed)
        if row[0] == "cudnn":
            if not torch.cuda.is_available():
                lines.append(f"[{k}/{len(rows)}] cudnn probe: skipped (needs CUDA)")
                print(lines[-1], flush=True)
                continue
            r = cudnn_probe(folders["flux"], timeout)
        else:
            r = run_one(row, folders, a.out, a.tiny, timeout)
        results.append(r)
        lines += run_lines(k, len(rows), r)
        print("\n".join(run_lines(k, len(rows), r)), flush=True)
        write_report(a.out, header, results, lines)
    failed = [r["name"] for r in results if r.get("fail")]
    lines.append(
        f"{len(results) - len(failed)} of {len(results)} passed"
        + (f"; FAIL: {', '.join(failed)}" if failed else "")
        + f"; {time.perf_counter() - t_start:.0f} s in all"
    )
    print(lines[-1], flush=True)
    write_report(a.out, header, results, lines)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--wrap"]:
        wrap(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(main())
