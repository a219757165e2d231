"""The first GPU job (issue #55 item 4, issue #65 item 2): the paper presets on full-size random-weight SD3.5-Medium and
FLUX.1-dev, in fp16 and bf16, DDP and FSDP2, with evaluation, each run in a fresh process; per run its seconds per
phase, its peak memory beside the memory model's estimate, its gradient's share of zero entries, and PASS, FAIL or
SKIPPED; and whether FLUX still needs the cuDNN-attention workaround.

    python benchmarks/gpu_first_run.py --out /tmp/g1          # one H100 80 GB: about 7.5 minutes (estimated)
    python benchmarks/gpu_first_run.py --tiny --out /tmp/g1   # the same code on tiny models, CPU
    bash benchmarks/device_call.sh                            # the one command for a machine lent for one command

Without CUDA (and without --tiny) it prints one line and exits 1 (nothing ran).

0. Checks its flags (one line each: an unknown --only, a --budget-s that runs nothing, an --out or --cache that is a
   file), then a preflight of about 10 s in a child process with the runs' environment: the imports the runs need
   (their versions go in the report), the runs' one-rank process group and an all_reduce of a tensor on the GPU and
   one on the CPU (NCCL and gloo on CUDA, gloo on CPU), the
   free disk for the folders still to build, /dev/shm and the host memory. A failure stops the job in one line.
1. Builds, in a child process, random-weight model folders into --cache, only those the selected rows need and only
   before the first row that needs them (speed and memory do not depend on the values): SD3.5-M and FLUX.1-dev with
   their published transformers and the 16-channel VAE; text encoders at the published widths, heads and feed-forward
   sizes: CLIP-L and CLIP-G whole, T5-XXL's encoder with 2 of its 24 layers (the other 22 are 8.6 GB of bf16 weights
   and about 4 s of loading per run; they change no transient, and the memory model counts each folder's own
   encoders); a CLIP ViT-H/14 reward folder that `--reward pickscore` loads (PickScore's architecture, HPSv2's too).
   Tokenizers are common/plumbing/tiny.py's word lists.
2. Runs each row of RUNS in order: a paper preset's command (docs/*.md, "## Paper preset", via benchmarks/presets.py)
   with the few flags that scale it down (a few groups, 2 iterations, 3 in fp16, no calibration, the random folders),
   under `torchrun --nproc_per_node 1` (nccl on a GPU, gloo on CPU), each in its own process, so that an
   out-of-memory run cannot hold memory for the next. The process runs the script through `--wrap`, which records
   the peak of torch.cuda.max_memory_allocated at exit and the images of every VAE decode call, and skips the run's
   checkpoints (`Run.checkpoint`: a full fine-tuning checkpoint is 36 GB and 40-100 s of writing, and the CPU tests
   check checkpoints); the report says which it skipped. A row starts only when its estimated seconds fit in what
   is left of --budget-s; otherwise it is SKIPPED, which is not a pass.
3. Per run: seconds per phase from its metrics.jsonl, the peak beside bench_memory.estimate for that run's flags and
   folders, train/grad_zero_fraction, the fp16 loss scale and skipped steps of every iteration, and PASS or FAIL with
   the reason (FAIL_RULES). The report goes to {out}/gpu_first_run.md, its JSON to gpu_first_run.json and the tail of
   every child process's output to gpu_first_run.log, rewritten after every row (3 files: what a machine lent for one
   command sends back); the run folders live in a temporary folder, removed at the end.
4. The FLUX cuDNN-attention workaround: common/backbones.py turns the cuDNN SDPA backend off for FLUX on CUDA because
   a FLUX LoRA backward crashed with it on torch 2.11; a process of its own forces that backend for a FLUX LoRA
   forward and backward at the Flow-GRPO FLUX preset's micro-batch and at G²RPO's 720 px with gradient checkpointing,
   and reports, per case, that it ran or the error's class (reported, never a FAIL).

SIGTERM, SIGINT and SIGHUP (an outer `timeout`, Ctrl-C) stop the job in one line: the running child's whole process
group is ended (torchrun's workers too), the report is written with that row STOPPED, and the exit status is
128 + the signal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 2**30


def size(n: float) -> str:
    """Bytes as GiB, or MiB under 1 GiB (the tiny runs)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB or n != n else f"{n / 2**20:.0f} MiB"


# FAIL when: the process exits non-zero (an out-of-memory error named as such), the last iteration has no finite
# loss, the trained weights' gradient has more than ZERO_LIMIT exact zeros after unscaling at the last iteration after
# the first that took an optimizer step (an fp16 underflow gives ~0.9; a LoRA's first step has 0.5 by construction: B
# starts at 0, so A's gradient is 0, which is why iteration 0 is not read), fp16 skipped every optimizer step of all
# its FP16_ITERATIONS iterations (NFT and G²RPO take one step per iteration, so one iteration's skip is a settling
# overflow, not a verdict; the run itself stops after 20 skips in a row, when the scale has fallen a million-fold), a
# VAE decode call took more than --decode-batch-size images, or the peak passes the memory model's estimate by more
# than PEAK_TOLERANCE (the model leaves out the cuDNN/cuBLAS workspaces and the allocator's rounding: it was within
# -1 % / +4 % of the H200's peaks, `bench_memory.py --check`).
ZERO_LIMIT = 0.5
PEAK_TOLERANCE = 0.15
ITERATIONS = 2  # trained iterations of a bf16 run (iteration 0 pays the warm-up)
FP16_ITERATIONS = 3
T5_LAYERS = 2
DECODE_BATCH = 8  # --decode-batch-size of every run (the default)
LOG_TAIL_LINES = 60  # of each child process's output, in gpu_first_run.log
STOP_GRACE_S = 10  # a stopped child's process group: SIGTERM, then SIGKILL after this many seconds


# ------------------------------------------------------------------------------------------------ the model folders
def encoder_configs(kind: str, tiny: bool) -> dict:
    """The text encoders of a folder, component -> transformers config: the published ones (bench_memory) with the
    ids of common/plumbing/tiny.py's tokenizers and T5_LAYERS of T5's layers; tiny: common/plumbing/tiny.py's own."""
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
    and VAE (fp32), encoder_configs' text encoders (bf16), common/plumbing/tiny.py's tokenizers and scheduler."""
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    from benchmarks import bench_memory as bm
    from common.plumbing.tiny import build_flux, build_sd3, tiny_vae

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
    """The folder of SD3.5-M ("sd35") or FLUX.1-dev ("flux") at `path`: full_size_pipeline's, or (tiny) common/plumbing/tiny.py's
    tiny SD3.5 / FLUX.1-dev."""
    from common.plumbing.tiny import build_flux, build_sd3

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
    ViT-H/14 of PickScore (tiny: 1 layer of 32), CLIPImageProcessor's 224-px geometry, common/plumbing/tiny.py's tokenizer."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from benchmarks import bench_memory as bm
    from common.plumbing.tiny import make_clip_tokenizer

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
# Bytes each full-size folder holds: its weights (bf16, the VAE fp32), as the meta-device pipelines count them
# (tests/test_gpu_first_run.py checks); the preflight wants them free on the disk before the build.
FOLDER_BYTES = {"sd35": 7.5e9, "flux": 25.5e9, "reward": 2.0e9}
TINY_FOLDER_BYTES = 50e6


def folder_path(cache: str, name: str, tiny: bool) -> str:
    return os.path.join(cache, name + ("_tiny" if tiny else ""))


def folder_built(cache: str, name: str, tiny: bool) -> bool:
    """A finished folder has model_index.json (or config.json: the reward); a build writes {name}.partial first."""
    marker = "config.json" if name == "reward" else "model_index.json"
    return os.path.exists(os.path.join(folder_path(cache, name, tiny), marker))


def build_folders(cache: str, names: list[str], tiny: bool) -> None:
    """The folders `names` not built yet, in this process."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in names:
        if folder_built(cache, name, tiny):
            continue
        path = folder_path(cache, name, tiny)
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


# Estimated seconds on one H100 (docs/usage.md, "Your first GPU run", derives each from
# ../shared/reference/gpu_anchor.md's H200 costs per image and step and docs/bench_gpu_2026-11-29/'s measured
# iterations, 15 % slower for the H100): iteration 0's warm-up, the preflight, and each folder's build (the 2026-11-29
# builds took 13 s for SD3.5-M and 28 s for FLUX.1-dev on the H200 with small text encoders; these write the real
# ones too) plus the build process's start.
WARMUP_S = 5
PREFLIGHT_S = 10
BUILD_S = {"sd35": 16, "flux": 30, "reward": 3}
BUILD_START_S = 8
# --tiny on a 2-core CPU: planning numbers, generous: in the rehearsal of 2026-12-06, on a 2-core machine shared with
# other work, a row took 27 to 104 s, a build 20 s and the preflight 13 to 21 s
TINY_ROW_S, TINY_BUILD_S, TINY_PREFLIGHT_S = 60, 30, 20


@dataclass
class Row:
    """One row of the job: a preset run (script set) or the cuDNN probe (script None). Adding a row is one entry in
    RUNS; its estimated seconds on one H100 are load_s (process start and folder load) + WARMUP_S + its iterations x
    iteration_s + 2 evaluations (iteration 0 and the end) x eval_s."""

    name: str
    model: str  # the model folder it loads: "sd35" or "flux"
    precision: str
    script: str | None = None
    block: int = 0  # the torchrun block of the script's "## Paper preset"
    parallel: str | None = None
    scaled: dict = field(default_factory=dict)  # the flags that scale the preset down
    eval_images: int = 1
    load_s: float = 0.0
    iteration_s: float = 0.0
    eval_s: float = 0.0
    what: str = ""  # what it shows (the report's plan)

    @property
    def iterations(self) -> int:
        return FP16_ITERATIONS if self.precision == "fp16" else ITERATIONS

    @property
    def folders(self) -> tuple[str, ...]:
        """The folders it loads: its model's, and the reward's for a run."""
        return (self.model, "reward") if self.script else (self.model,)

    def estimate_s(self, tiny: bool) -> float:
        if tiny:
            return TINY_ROW_S
        if self.script is None:  # the probe: its load, then its cases
            return self.load_s + self.iteration_s
        return self.load_s + WARMUP_S + self.iterations * self.iteration_s + 2 * self.eval_s


# What every run changes in its preset (--model-path, --reward-model-paths, --num-iterations are filled in). The
# checkpoints are skipped by `wrap` whatever --save-every says.
SCALED = {
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
# The cuDNN probe's cases: (the row whose setting it takes, resolution, micro-batch, gradient checkpointing), with the
# LoRA of the first (tests/test_gpu_first_run.py checks them against those rows' parsed flags). The 2026-11-29 crash
# was a multi-image FLUX LoRA backward.
PROBE_CASES = (
    ("flowgrpo FLUX.1-dev bf16 ddp", 512, 3, False),
    ("g2rpo FLUX.1-dev LoRA 720 px bf16 fsdp eval 64", 720, 1, True),
)
PROBE_LORA = (
    "attention-ff",
    64,
    128,
)  # the Flow-GRPO FLUX.1-dev preset's --lora-target, --lora-rank, --lora-alpha

# The rows, in the order they run: the fp16 and 64-image-evaluation questions first, the cuDNN probe before the
# slowest rows, the least telling last (a budget cut drops it). Together: fp16 with loss scaling on a LoRA under FSDP2
# and DDP and on full fine-tuning; bf16; DDP and FSDP2 on both models; every script; evaluation of 64 images per call
# at 512 px and at 720 px (FLUX: the decode chunking's worst case). G²RPO's preset fine-tunes FLUX.1-dev fully on 16
# GPUs, which one GPU cannot hold (fp32 weights, gradients and Adam: 190 GB): here its FLUX run trains a LoRA, and
# full fine-tuning runs on SD3.5-M. Seconds: docs/usage.md, "Your first GPU run".
RUNS = [
    Row(
        "diffusionnft SD3.5-M fp16 fsdp eval 64",
        "sd35",
        "fp16",
        "diffusionnft.py",
        parallel="fsdp",
        scaled=SD35_512,
        eval_images=64,
        load_s=15,
        iteration_s=6.5,
        eval_s=2.3,
        what="loss scaling under FSDP2; 64 images per evaluation call",
    ),
    Row(
        "flowgrpo SD3.5-M fp16 ddp",
        "sd35",
        "fp16",
        "flowgrpo_baseline.py",
        parallel="ddp",
        scaled=SD35_512,
        load_s=15,
        iteration_s=10.1,
        eval_s=0.5,
        what="loss scaling on a LoRA under DDP",
    ),
    Row(
        "g2rpo SD3.5-M full fp16 fsdp",
        "sd35",
        "fp16",
        "g2rpo.py",
        parallel="fsdp",
        scaled=G2RPO_SD35_FULL,
        load_s=18,
        iteration_s=2.5,
        eval_s=0.5,
        what="full fine-tuning with loss scaling",
    ),
    # AWM's GenEval preset at its micro-batch (3 images x 6 timesteps = 18 rows per forward, with the base model's
    # and the fast EMA's forwards) on one group of 3 images; no burn-in, so that iteration 1 trains; a one-step
    # evaluation (evaluating is the other rows' question). Seconds: docs/usage.md, "Your first GPU run".
    Row(
        "awm SD3.5-M fp16 ddp",
        "sd35",
        "fp16",
        "awm.py",
        parallel="ddp",
        scaled={
            "--group-size": [3],
            "--groups-per-iteration": [1],
            "--rollout-batch-size": [3],
            "--burn-in-iterations": [0],
            "--eval-num-steps": [1],
        },
        load_s=15,
        iteration_s=1.6,
        eval_s=0.2,
        what="AWM's matching loss and its two KL forwards with loss scaling",
    ),
    Row(
        "cudnn probe",
        "flux",
        "bf16",
        load_s=25,
        iteration_s=5,
        what="whether this torch still needs the cuDNN-attention workaround",
    ),
    Row(
        "g2rpo FLUX.1-dev LoRA 720 px bf16 fsdp eval 64",
        "flux",
        "bf16",
        "g2rpo.py",
        parallel="fsdp",
        scaled=G2RPO_FLUX_LORA,
        eval_images=64,
        load_s=25,
        iteration_s=10.3,
        eval_s=9.2,
        what="decoding in chunks at its worst case (64 images at 720 px)",
    ),
    Row(
        "densegrpo SD3.5-M bf16 ddp",
        "sd35",
        "bf16",
        "densegrpo.py",
        parallel="ddp",
        scaled={**SD35_512, "--calibration-iterations": [0], "--calibration-trajectories": None},
        load_s=15,
        iteration_s=22.7,
        eval_s=0.5,
        what="DenseGRPO's completions",
    ),
    Row(
        "g2rpo SD3.5-M full bf16 ddp",
        "sd35",
        "bf16",
        "g2rpo.py",
        parallel="ddp",
        scaled=G2RPO_SD35_FULL,
        load_s=18,
        iteration_s=2.5,
        eval_s=0.5,
        what="full fine-tuning under autocast",
    ),
    Row(
        "flowgrpo FLUX.1-dev bf16 ddp",
        "flux",
        "bf16",
        "flowgrpo_baseline.py",
        block=1,
        parallel="ddp",
        scaled={"--group-size": [6], "--groups-per-iteration": [1]},
        load_s=25,
        iteration_s=11.5,
        eval_s=0.6,
        what="FLUX.1-dev under DDP",
    ),
]
# --tiny: the same runs scaled to the tiny models on CPU (32 px, 4 steps)
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


def run_flags(row: Row, folders: dict, work: str, tiny: bool) -> list[str]:
    """The run's command line: the preset's, overridden."""
    from benchmarks.presets import DOCS, preset_command, read

    argv, _ = preset_command(read(DOCS[row.script]), row.script, row.block)
    prompts = os.path.join(work, f"eval_{row.eval_images}.txt")
    words = ["a photo of a red circle", "two blue squares", "a green cat", "a yellow house"]
    with open(prompts, "w") as f:
        f.write("\n".join(words[k % 4] for k in range(row.eval_images)) + "\n")
    changes = {
        **SCALED,
        **row.scaled,
        "--num-iterations": [row.iterations],
        "--model-path": [folders[row.model]],
        "--reward-model-paths": [f"pickscore={folders['reward']}"],
        "--eval-prompts": [prompts],
        "--eval-batch-size": [64],
        "--decode-batch-size": [DECODE_BATCH],
        "--mixed-precision": [row.precision],
        "--parallel": [row.parallel],
        "--output-dir": [os.path.join(work, "runs")],
        "--run-name": [row.name.replace(" ", "_")],
    }
    if tiny:
        changes.update(TINY)
        changes.update({k: v for k, v in TINY_GROUPS.items() if k in row.scaled})
        if row.script == "g2rpo.py":
            changes.update({"--granularities": [1, 2], "--rollout-batch-size": [8]})
    return override(argv, changes)


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


def planned(work: str) -> list[tuple[str, dict]]:
    """Every run of RUNS at full size with its estimate, from the configs the job's folders get (built on the meta
    device, nothing written but the evaluation prompt files into `work`): docs/usage.md's table, and the test that
    the matrix fits an 80 GB card."""
    from benchmarks import bench_memory as bm

    pipes = {m: full_size_pipeline(k, "meta") for m, k in (("sd35", "sd3"), ("flux", "flux"))}
    specs = {m: spec_of(p, "sd3" if m == "sd35" else "flux") for m, p in pipes.items()}
    folders = {"sd35": "/models/sd35", "flux": "/models/flux", "reward": "/models/reward"}
    reward = dict(bm.CLIP_H)
    rows = []
    for row in RUNS:
        if row.script is None:
            continue
        flags = run_flags(row, folders, work, tiny=False)
        rows.append(
            (row.name, estimate_for(row.script, flags, specs[row.model], reward, row.eval_images))
        )
    return rows


def wrap(out_json: str, script: str, argv: list[str]) -> None:
    """`--wrap`: run `script` as __main__ (under torchrun, as the scripts run), counting the images of every VAE
    decode call and skipping its checkpoints (Run.checkpoint: every other part of the run is the script's own), and
    write at exit {peak: torch.cuda.max_memory_allocated, reserved, decode_max, decode_calls, checkpoints_skipped}."""
    import atexit
    import runpy

    import torch
    from diffusers import AutoencoderKL

    from common.plumbing import run as run_module

    seen = dict(decode_max=0, decode_calls=0, checkpoints_skipped=[])
    decode = AutoencoderKL.decode

    def counted(self, z, *args, **kwargs):
        seen["decode_max"] = max(seen["decode_max"], z.shape[0])
        seen["decode_calls"] += 1
        return decode(self, z, *args, **kwargs)

    if not callable(getattr(run_module.Run, "checkpoint", None)):
        raise SystemExit(
            "gpu_first_run: common/plumbing/run.py's Run has no checkpoint method any more: update wrap() to skip the runs' "
            "checkpoints where they are saved now"
        )

    def no_checkpoint(self, iteration: int) -> None:
        """A full fine-tuning checkpoint is 36 GB: the job's runs save none (the CPU tests check checkpoints)."""
        seen["checkpoints_skipped"].append(iteration)

    AutoencoderKL.decode = counted
    run_module.Run.checkpoint = no_checkpoint

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
    """The reasons this run FAILs (FAIL_RULES above; empty: PASS). r["iterations"]: its metrics.jsonl rows of the
    trained iterations, in order."""
    if r["rc"] != 0:
        return ["out of memory" if r["oom"] else f"exit {r['rc']}: {r['last_error']}"]
    its = r.get("iterations") or []
    if len(its) < ITERATIONS:
        return [f"{len(its)} trained iterations in metrics.jsonl, {ITERATIONS} or more expected"]
    why = []
    if not finite(its[-1].get("policy_loss")):
        why.append(f"no finite loss at iteration {len(its) - 1} ({its[-1].get('policy_loss')})")
    stepped = [m for m in its[1:] if m.get("train/optimizer_steps", 0)]
    zero = stepped[-1].get("train/grad_zero_fraction") if stepped else None
    if stepped and zero is None:
        why.append("no train/grad_zero_fraction in metrics.jsonl")
    elif zero is not None and zero > ZERO_LIMIT:
        why.append(
            f"{zero:.0%} of the gradient's entries are exactly zero (limit {ZERO_LIMIT:.0%})"
        )
    if r["precision"] == "fp16":
        taken = sum(m.get("train/optimizer_steps", 0) for m in its)
        skipped = sum(m.get("train/skipped_steps", 0) for m in its)
        if len(its) < FP16_ITERATIONS:
            why.append(
                f"fp16: {len(its)} iterations, too few to judge the loss scaling ({FP16_ITERATIONS} needed)"
            )
        elif not taken:
            why.append(f"fp16: all {skipped} optimizer steps of {len(its)} iterations skipped")
    elif not stepped:
        why.append("no optimizer step after iteration 0")
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


# ------------------------------------------------------------------------------------------------- the processes
def child_env() -> dict:
    """The children's environment: this one, with the repository PREPENDED to PYTHONPATH (a folder of carried wheels
    already on it stays: docs/usage.md, "Your first GPU run"), offline."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": ROOT + (os.pathsep + path if path else ""),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
    }


class Stopped(Exception):
    """SIGTERM, SIGINT or SIGHUP reached the job (`main` turns it into the report and exit 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_signals: list[
    int
] = []  # the stop signals received: the handler only notes them, so no cleanup is cut short


def _note_signal(signum, frame):
    _signals.append(signum)


def stopping() -> None:
    """Raise Stopped once a stop signal has come (checked between the job's steps and while a child runs)."""
    if _signals:
        raise Stopped(_signals[0])


def processes() -> list[tuple[int, int, int, str]]:
    """(pid, parent, process group, state) of every process, from Linux's /proc ([] elsewhere)."""
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)"
            except (OSError, IndexError):
                continue
            out.append((int(name), int(fields[1]), int(fields[2]), fields[0]))
    return out


def groups_of(pid: int) -> set[int]:
    """The process group of `pid` and those of all its descendants: torchrun starts each worker in a session of its
    own, which a signal to torchrun's group does not reach."""
    children = {}
    for child, parent, group, _ in processes():
        children.setdefault(parent, []).append((child, group))
    groups, todo = {pid}, [pid]
    while todo:
        for child, group in children.get(todo.pop(), []):
            groups.add(group)
            todo.append(child)
    return groups


def end_group(p: subprocess.Popen) -> None:
    """End `p` (started in a session of its own) and every process below it: SIGTERM to each of their process groups
    (the scripts stop on it in one line, torchrun passes it on to its workers), SIGKILL after STOP_GRACE_S, then wait
    until none of those groups has a running process (a zombie, dead and waiting for its parent, does not count)."""
    groups = groups_of(p.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        groups |= groups_of(p.pid)  # a worker started since
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            p.poll()  # reaps p itself
            if not any(g in groups and state != "Z" for _, _, g, state in processes()):
                return
            time.sleep(0.1)


def run_process(cmd: list[str], timeout: float, log: str) -> tuple[int, str]:
    """(exit code, note) of `cmd` with its output (stdout and stderr) in the file `log`, in a process group of its
    own. The group is ended whatever happens (its exit, the timeout, a stop signal to the job, an exception here):
    no process of a row keeps GPU memory for the next or outlives the job. note: "" when it exited by itself."""
    with open(log, "w") as f:
        p = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(),
            cwd=ROOT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while not _signals:
            try:
                return p.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))), ""
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return -9, f"timed out after {timeout:.0f} s"
        return -_signals[0], f"stopped by {signal.Signals(_signals[0]).name}"
    finally:
        end_group(p)


def tail(path: str, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last n lines of a child's output (each cut at 500 characters)."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [line[:500] for line in lines[-n:]]


def last_error(lines: list[str]) -> str:
    """The script's own error line (its one-line error, or the exception), not torchrun's trailer about its child."""
    launcher = (
        "torch/distributed/elastic",
        "ChildFailedError",
        "traceback :",
        "error_file",
        "errors.html",
    )
    lines = [line for line in lines if line.strip()]
    errors = [
        line for line in lines if "rror" in line and not any(mark in line for mark in launcher)
    ]
    return (errors or lines or ["(no output)"])[-1][-300:]


def error_class(rc: int, note: str, lines: list[str]) -> str:
    """What ended a process, in a few words: the signal that killed it, the timeout, or its exception's class (the
    last traceback line `Class: message`)."""
    if note:
        return note
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    for line in reversed(lines):
        head = line.split(":", 1)[0].strip()
        if ":" in line and head and " " not in head and head[0].isalpha():
            return head
    return f"exit {rc}"


# ------------------------------------------------------------------------------------------------------ preflight
PREFLIGHT = r"""
import importlib, json, sys, time
t0 = time.perf_counter()
versions = {}
for name in ("torch", "diffusers", "transformers", "peft", "tyro", "safetensors", "accelerate", "PIL", "numpy",
             "matplotlib", "tqdm", "flowgrpo_baseline", "g2rpo", "densegrpo", "diffusionnft"):
    try:
        module = importlib.import_module(name)
    except Exception as e:
        print("PREFLIGHT " + json.dumps(dict(error=f"cannot import {name}: {type(e).__name__}: {e}")))
        sys.exit(0)
    versions[name] = getattr(module, "__version__", "")
import torch
import torch.distributed as dist
from common.plumbing.utils import process_group_backend
cuda = torch.cuda.is_available()
# the runs' own process group (cpu:gloo,cuda:nccl on a GPU), and a tensor on each device: a CPU tensor reduced
# over an NCCL-only group stopped every multi-GPU run at iteration 0 (issue #65)
backend, device = process_group_backend(cuda), torch.device("cuda", 0) if cuda else torch.device("cpu")
try:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: a free port
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **({"device_id": device} if cuda else {}))
    x, y = torch.full((4,), 2.0, device=device), torch.full((4,), 2.0)
    dist.all_reduce(x)
    dist.all_reduce(y)
    ok = x.tolist() == y.tolist() == [2.0] * 4
    dist.destroy_process_group()
except Exception as e:
    print("PREFLIGHT " + json.dumps(dict(error=f"{backend}: {type(e).__name__}: {e}")))
    sys.exit(0)
if not ok:
    print("PREFLIGHT " + json.dumps(dict(error=f"{backend}: all_reduce of one rank gave {x.tolist()}")))
    sys.exit(0)
print("PREFLIGHT " + json.dumps(dict(versions={k: v for k, v in versions.items() if v}, backend=backend,
                                     seconds=time.perf_counter() - t0)))
"""


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return shutil.disk_usage(path).free


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 1024 * int(line.split()[1])
    except OSError:
        pass
    return None


def resources(cache: str, rows: list[Row], tiny: bool) -> tuple[list[str], str]:
    """(problems, one line of what there is): the disk for the folders still to build and the runs' folders, /dev/shm
    (NCCL's and torch's shared memory), and host memory for twice the largest folder (from_pretrained reads a folder
    into host memory; under FSDP the transformer stays there while its shards move to the GPU)."""
    names = list(dict.fromkeys(n for row in rows for n in row.folders))
    sizes = {n: TINY_FOLDER_BYTES if tiny else FOLDER_BYTES[n] for n in names}
    to_build = sum(sizes[n] for n in names if not folder_built(cache, n, tiny))
    need = {
        "disk": to_build + (0.1e9 if tiny else 2e9),
        "/dev/shm": 64 * 2**20 if tiny else GiB,
        "memory": 2 * max(sizes.values(), default=0),
    }
    have = {"disk": free_bytes(cache), "/dev/shm": None, "memory": mem_available()}
    if os.path.isdir("/dev/shm"):
        have["/dev/shm"] = shutil.disk_usage("/dev/shm").free
    problems = [
        f"{what}: {have[what] / 1e9:.1f} GB free, {need[what] / 1e9:.1f} GB needed"
        + (f" (the folders to build in {cache})" if what == "disk" else "")
        for what in need
        if have[what] is not None and have[what] < need[what]
    ]
    line = ", ".join(
        f"{what} {'unknown' if have[what] is None else f'{have[what] / 1e9:.0f} GB'} free "
        f"({need[what] / 1e9:.1f} needed)"
        for what in need
    )
    return problems, line


def preflight(job: Job, rows: list[Row]) -> str | None:
    """The preflight (step 0 above): None, or the one line that stops the job."""
    t0 = time.perf_counter()
    log = os.path.join(job.work, "preflight.log")
    rc, note = run_process([sys.executable, "-c", PREFLIGHT], 120, log)
    lines = tail(log)
    job.log_parts.append(("preflight", [sys.executable, "-c", "PREFLIGHT"], lines))
    found = [json.loads(line[10:]) for line in lines if line.startswith("PREFLIGHT ")]
    if not found:
        return f"preflight: the check process ended ({error_class(rc, note, lines)}): {last_error(lines)}"
    if "error" in found[-1]:
        return f"preflight: {found[-1]['error']}"
    problems, resources_line = resources(job.cache, rows, job.tiny)
    if problems:
        return "preflight: too little room: " + "; ".join(problems)
    versions = ", ".join(f"{k} {v}" for k, v in found[-1]["versions"].items())
    job.header += [
        "",
        f"Preflight ({time.perf_counter() - t0:.0f} s): {versions}; {found[-1]['backend']} all_reduce of one "
        f"rank: ok; {resources_line}",
    ]
    print(job.header[-1], flush=True)
    return None


# ------------------------------------------------------------------------------------------------------ the job
class Job:
    """What the job writes as it goes: the report's header and lines, the results, the log's parts."""

    def __init__(self, out: str, cache: str, tiny: bool, work: str, header: list[str]):
        self.out, self.cache, self.tiny, self.work = out, cache, tiny, work
        self.header, self.lines, self.results, self.log_parts = header, [], [], []
        self.t_start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def say(self, lines: list[str]) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)

    def write(self) -> None:
        """{out}/gpu_first_run.md, .json and .log, whole, after every row."""
        from common.plumbing.utils import atomic_write

        atomic_write(
            os.path.join(self.out, "gpu_first_run.json"),
            json.dumps(self.results, indent=1, default=str),
        )
        atomic_write(
            os.path.join(self.out, "gpu_first_run.md"),
            "\n".join(self.header + ["", "```", *self.lines, "```"]) + "\n",
        )
        log = []
        for what, cmd, lines in self.log_parts:
            log += [
                f"===== {what}",
                " ".join(cmd),
                f"----- its last {LOG_TAIL_LINES} lines",
                *lines,
                "",
            ]
        atomic_write(os.path.join(self.out, "gpu_first_run.log"), "\n".join(log))

    def folders(self) -> dict:
        return {n: folder_path(self.cache, n, self.tiny) for n in FOLDERS}

    def build(self, names: list[str], timeout: float) -> str | None:
        """The folders `names` not built yet, in a child process (this one never holds GPU memory the runs could
        want); None, or why it failed."""
        missing = [n for n in names if not folder_built(self.cache, n, self.tiny)]
        if not missing:
            return None
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--build-only", *missing]
        cmd += ["--cache", self.cache] + ["--tiny"] * self.tiny
        log = os.path.join(self.work, "build.log")
        rc, note = run_process(cmd, timeout, log)
        lines = tail(log)
        self.log_parts.append((f"build {', '.join(missing)}", cmd, lines))
        if rc:
            return f"building {', '.join(missing)}: {error_class(rc, note, lines)}: {last_error(lines)}"
        self.say([f"built {', '.join(missing)} in {time.perf_counter() - t0:.0f} s"])
        return None


def run_one(job: Job, row: Row, timeout: float) -> dict:
    """One run in a fresh torchrun process; its result (read back from its files)."""
    from benchmarks import bench_memory as bm

    folders = job.folders()
    flags = run_flags(row, folders, job.work, job.tiny)
    r = dict(
        name=row.name,
        script=row.script,
        model=row.model,
        precision=row.precision,
        parallel=row.parallel,
        flags=" ".join(flags),
    )
    try:
        with open(os.path.join(folders["reward"], "config.json")) as f:
            reward = json.load(f)
        e = estimate_for(
            row.script, flags, bm.from_folder(folders[row.model]), reward, row.eval_images
        )
        r.update(estimate=e["peak"], estimate_phase=e["phase"])
    except Exception as err:  # noqa: BLE001 -- a run's report must not be lost to its estimate
        r.update(estimate=float("nan"), estimate_phase=f"estimate failed: {err}")
    run_name = row.name.replace(" ", "_")
    run_dir = os.path.join(job.work, "runs", run_name)
    shutil.rmtree(run_dir, ignore_errors=True)
    peak_json = os.path.join(job.work, "peak.json")
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
        row.script,
        *flags,
    ]
    log = os.path.join(job.work, run_name + ".log")
    t0 = time.perf_counter()
    try:
        rc, note = run_process(cmd, timeout, log)
    finally:
        job.log_parts.append((row.name, cmd, tail(log)))
    wall = time.perf_counter() - t0
    lines = tail(log)
    seen = {}
    if os.path.exists(peak_json):
        with open(peak_json) as f:
            seen = json.load(f)
    everything = "\n".join(tail(log, 10**9))
    r.update(
        rc=rc,
        wall_s=wall,
        oom="out of memory" in everything.lower() or "OutOfMemoryError" in everything,
        last_error=note or last_error(lines),
        iterations=[m for m in read_rows(run_dir) if not m.get("final")],
        peak=seen.get("peak"),
        reserved=seen.get("reserved"),
        decode_max=seen.get("decode_max", 0),
        decode_calls=seen.get("decode_calls", 0),
        checkpoints_skipped=seen.get("checkpoints_skipped"),
        checkpoints_written=sorted(
            n
            for n in (os.listdir(run_dir) if os.path.isdir(run_dir) else [])
            if n.startswith("checkpoint-")
        ),
    )
    r["fail"] = judge(r)
    r["status"] = "FAIL" if r["fail"] else "PASS"
    shutil.rmtree(run_dir, ignore_errors=True)
    return r


CUDNN_PROBE = r"""
import json, sys, torch
sys.path.insert(0, {root!r})
from torch.nn.attention import SDPBackend, sdpa_kernel
from common.backbones import LORA_TARGETS, load_backbone
from common.policy import Trainable
spec = json.loads({spec!r})
device = "cuda" if torch.cuda.is_available() else "cpu"
backbone = load_backbone(spec["path"], device, precision="bf16")  # turns the cuDNN backend off for FLUX on CUDA
Trainable(backbone, False, spec["rank"], spec["alpha"], LORA_TARGETS[spec["target"]], need_reference=False)
torch.backends.cuda.enable_cudnn_sdp(True)  # what the workaround turns off, back on
for case in spec["cases"]:
    if case["checkpointing"]:
        backbone.transformer.enable_gradient_checkpointing()
    else:
        backbone.transformer.disable_gradient_checkpointing()
    n, side = case["micro_batch"], case["resolution"]
    try:
        emb = backbone.encode(["a photo of a red circle"] * n)
        x = backbone.initial_noise(n, side, side)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # the cuDNN kernel or an error, nothing else
            backbone.velocity(x, 0.5, emb, 3.5).pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        grads = [p.grad for p in backbone.transformer.parameters() if p.requires_grad]
        error = None if all(g is not None and bool(torch.isfinite(g).all()) for g in grads) else "non-finite gradients"
    except Exception as e:
        kind = type(e)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{{kind.__module__}}.{{kind.__qualname__}}"
        error = f"{{name}}: {{' '.join(str(e).split())[:200]}}"
    print("PROBE " + json.dumps(dict(case=case["id"], error=error)), flush=True)
    if error:
        sys.exit(3)  # a CUDA error can leave the context unusable: the job runs the next case in a fresh process
    for p in backbone.transformer.parameters():
        p.grad = None
"""


def probe_cases(tiny: bool) -> list[dict]:
    return [
        dict(
            id=k,
            row=name,
            resolution=32 if tiny else res,
            micro_batch=mb,
            checkpointing=ckpt,
        )
        for k, (name, res, mb, ckpt) in enumerate(PROBE_CASES)
    ]


def case_name(c: dict) -> str:
    return f"micro-batch {c['micro_batch']} at {c['resolution']} px" + (
        " with gradient checkpointing" if c["checkpointing"] else ""
    )


def cudnn_probe(job: Job, row: Row, timeout: float) -> dict:
    """FLUX.1-dev LoRA forward and backward with the cuDNN SDPA kernel forced, for each of PROBE_CASES, in a process
    of its own (a case that crashes it ends that process: the cases after it run in a new one): does this torch still
    need common/backbones.py's enable_cudnn_sdp(False)? Per case: None (ran, finite gradients) or the error's class."""
    import torch

    t0 = time.perf_counter()
    target, rank, alpha = PROBE_LORA
    cases, answers = probe_cases(job.tiny), {}
    if job.tiny:
        rank, alpha = 4, 8
    while len(answers) < len(cases):
        left = [c for c in cases if c["id"] not in answers]
        spec = dict(
            path=job.folders()[row.model], target=target, rank=rank, alpha=alpha, cases=left
        )
        code = CUDNN_PROBE.format(root=ROOT, spec=json.dumps(spec))
        log = os.path.join(job.work, "cudnn_probe.log")
        cmd = [sys.executable, "-c", code]
        rc, note = run_process(cmd, max(1.0, timeout - (time.perf_counter() - t0)), log)
        lines = tail(log)
        job.log_parts.append(
            (
                f"cudnn probe: {', '.join(case_name(c) for c in left)}",
                [sys.executable, "-c", "CUDNN_PROBE"],
                lines,
            )
        )
        before = len(answers)
        for line in lines:
            if line.startswith("PROBE "):
                a = json.loads(line[6:])
                answers[a["case"]] = a["error"]
        if len(answers) == before:  # it ended before answering its first case
            answers[left[0]["id"]] = f"{error_class(rc, note, lines)}: {last_error(lines)}"
            stopping()
            if (
                rc > 0 and not note
            ):  # a Python error before any case (the load): the same for every case
                answers.update({c["id"]: answers[left[0]["id"]] for c in left[1:]})
            # else a crash or a timeout inside that case: the next case runs in a new process
    failed = [(c, answers[c["id"]]) for c in cases if answers[c["id"]]]
    cuda = torch.cuda.is_available()
    if not failed:
        verdict = (
            f"cuDNN SDPA, FLUX.1-dev LoRA forward + backward ran with finite gradients at "
            f"{' and '.join(case_name(c) for c in cases)} (torch {torch.__version__}): common/backbones.py's "
            "enable_cudnn_sdp(False) is no longer needed on this GPU"
        )
    else:
        classes = "; ".join(f"{case_name(c)}: {e.split(':', 1)[0]}" for c, e in failed)
        verdict = (
            f"cuDNN SDPA, FLUX.1-dev LoRA forward + backward FAILED at {classes} (torch {torch.__version__}; "
            f"first error: {failed[0][1][:200]}): "
            + (
                "keep enable_cudnn_sdp(False)"
                if cuda
                else "expected on CPU, which has no cuDNN (this checks the probe's plumbing only)"
            )
        )
    return dict(
        name=row.name,
        script=None,
        status="PROBE",
        cuda=cuda,
        cases=[dict(c, error=answers[c["id"]]) for c in cases],
        verdict=verdict,
        wall_s=time.perf_counter() - t0,
    )


# ------------------------------------------------------------------------------------------------------- reports
def run_lines(k: int, n: int, r: dict) -> list[str]:
    """What the job prints for one row (docs/usage.md, "Your first GPU run", explains each line)."""
    if r["status"] == "PROBE":
        return [f"[{k}/{n}] {r['name']} ({r['wall_s']:.0f} s): {r['verdict']}"]
    if "why" in r:  # skipped, stopped, or a failed build: nothing ran
        return [f"[{k}/{n}] {r['name']}: {r['status']}: {r['why']}"]
    status = "PASS" if not r["fail"] else "FAIL: " + "; ".join(r["fail"])
    out = [f"[{k}/{n}] {r['name']}: {status} ({r['wall_s']:.0f} s)"]
    its = r["iterations"] or []
    first, last = (its[0], its[-1]) if its else ({}, {})
    if its:
        phases = "  ".join(
            f"{p} {last.get(f'time/{p}_s', 0.0):.1f}" for p in ("rollout", "reward", "train")
        )
        out.append(
            f"    seconds: {phases} (iteration {len(its) - 1}); eval {first.get('time/eval_s', 0.0):.1f} "
            "(iteration 0)"
        )
    est = f"estimate {size(r['estimate'])} (largest phase: {r['estimate_phase']})"
    if r["peak"] is None:
        out.append(f"    memory: no CUDA peak on CPU; {est}")
    else:
        out.append(
            f"    memory: peak {size(r['peak'])} allocated ({size(r['reserved'])} reserved), {est}, "
            f"peak/estimate {r['peak'] / r['estimate']:.2f}"
        )
    if its:
        stepped = [m for m in its[1:] if m.get("train/optimizer_steps", 0)]
        zero = stepped[-1].get("train/grad_zero_fraction") if stepped else None
        line = "    gradient: " + (
            f"{zero:.1%} of its entries exactly zero (iteration {its.index(stepped[-1])})"
            if zero is not None
            else "n/a"
        )
        if r["precision"] == "fp16":
            skips = ", ".join(
                f"{m.get('train/skipped_steps', 0)} of "
                f"{m.get('train/skipped_steps', 0) + m.get('train/optimizer_steps', 0)}"
                for m in its
            )
            line += (
                f"; fp16 loss scale {last.get('train/loss_scale', float('nan')):g}, optimizer steps skipped "
                f"per iteration: {skips}"
            )
        out.append(line)
    out.append(f"    decode: at most {r['decode_max']} images per call ({r['decode_calls']} calls)")
    skipped = r.get("checkpoints_skipped")
    out.append(
        "    checkpoint: "
        + (
            f"none written (the job skipped checkpoint-{', checkpoint-'.join(map(str, skipped))})"
            if skipped and not r["checkpoints_written"]
            else f"written: {', '.join(r['checkpoints_written']) or 'none'}"
        )
    )
    return out


def summary(results: list[dict], seconds: float) -> tuple[str, int]:
    """The last line and the exit status: 0 only when every selected row ran and passed (a skipped or stopped row is
    not a pass, and a job that ran nothing is not a success); the probe passes by answering."""
    runs = [r for r in results if r["script"]]
    count = {
        s: [r["name"] for r in runs if r["status"] == s]
        for s in ("PASS", "FAIL", "SKIPPED", "STOPPED")
    }
    line = f"{len(count['PASS'])} passed, {len(count['FAIL'])} failed, {len(count['SKIPPED'])} skipped of {len(runs)} runs"
    for s in ("FAIL", "SKIPPED", "STOPPED"):
        if count[s]:
            line += f"; {s}: {', '.join(count[s])}"
    probes = [r for r in results if not r["script"]]
    for p in probes:
        answered = p["status"] == "PROBE"
        line += f"; {p['name']}: " + (
            p["status"]
            if not answered
            else "no answer on CPU"
            if not p["cuda"]
            else "the workaround is still needed"
            if any(c["error"] for c in p["cases"])
            else "the workaround is no longer needed"
        )
    line += f"; {seconds:.0f} s in all"
    ok = (
        bool(results)
        and len(count["PASS"]) == len(runs)
        and all(p["status"] == "PROBE" for p in probes)
    )
    return line, 0 if ok else 1


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


# ------------------------------------------------------------------------------------------------------- the flags
def default_out() -> str:
    """$OUT where it is set (a machine lent for one command sends back what is there), else a folder in /tmp."""
    return os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "gpu_first_run")


def select(only: list[str] | None) -> list[Row]:
    """The rows --only names (a row's name or its first words), in RUNS' order; SystemExit(one line) for a name that
    is no row's."""
    if not only:
        return list(RUNS)
    unknown = [o for o in only if not any(row.name.startswith(o) for row in RUNS)]
    if unknown:
        raise SystemExit(
            f"gpu_first_run: --only {', '.join(map(repr, unknown))}: no such row; the rows are "
            + ", ".join(repr(row.name) for row in RUNS)
            + " (a name or its first words)"
        )
    return [row for row in RUNS if any(row.name.startswith(o) for o in only)]


def schedule(rows: list[Row], cache: str, tiny: bool) -> list[float]:
    """Each row's estimated seconds with the builds of the folders it is the first to need."""
    built, out = {n for n in FOLDERS if folder_built(cache, n, tiny)}, []
    for row in rows:
        new = [n for n in row.folders if n not in built]
        built.update(new)
        build = (
            (TINY_BUILD_S if tiny else BUILD_START_S + sum(BUILD_S[n] for n in new)) if new else 0
        )
        out.append(build + row.estimate_s(tiny))
    return out


def check_paths(a) -> None:
    """--out and --cache are folders (or can be made): SystemExit(one line) before any work."""
    for flag, path in (("--out", a.out), ("--cache", a.cache)):
        if os.path.exists(path) and not os.path.isdir(path):
            raise SystemExit(
                f"gpu_first_run: {flag} {path} is a file, not a folder: pass a folder (it is made if missing)"
            )
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        raise SystemExit(
            f"gpu_first_run: --out {a.out}: cannot make it ({e.strerror}): pass another folder"
        ) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        default=default_out(),
        help="the report's 3 files (default: $OUT, else /tmp/gpu_first_run)",
    )
    ap.add_argument("--cache", default="/tmp/flow_rl_fullsize", help="the random-weight folders")
    ap.add_argument("--tiny", action="store_true", help="tiny models on CPU: the same code")
    ap.add_argument("--only", nargs="*", help="rows (a name or its first words) to run")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="the job ends by this many seconds: a row starts only when its estimate fits in what is left",
    )
    a = ap.parse_args(argv)
    rows = select(a.only)
    plan = schedule(rows, a.cache, a.tiny)
    first = (TINY_PREFLIGHT_S if a.tiny else PREFLIGHT_S) + plan[0]
    if not (math.isfinite(a.budget_s) and a.budget_s >= first):
        raise SystemExit(
            f"gpu_first_run: --budget-s {a.budget_s:g} runs nothing: the first row ({rows[0].name!r}) needs about "
            f"{first:.0f} s with the preflight and its folders; pass --budget-s {math.ceil(first)} or more (all "
            f"{len(rows)} rows: about {first - plan[0] + sum(plan):.0f} s)"
        )
    check_paths(a)
    import torch

    if not torch.cuda.is_available() and not a.tiny:
        print("gpu_first_run: nothing ran: no CUDA device (--tiny runs the same code on CPU)")
        return 1
    device = gpu_name() if torch.cuda.is_available() else "CPU (--tiny)"
    header = [
        f"# First GPU job: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"`python benchmarks/gpu_first_run.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"Plan: {len(rows)} rows, about {first - plan[0] + sum(plan):.0f} s "
        f"({'a 2-core CPU' if a.tiny else 'one H100'}, estimated), --budget-s {a.budget_s:g}.",
    ]
    print("\n".join(header), flush=True)
    job = Job(a.out, a.cache, a.tiny, tempfile.mkdtemp(prefix="gpu_first_run."), header)
    before = {sig: signal.signal(sig, _note_signal) for sig in STOP_SIGNALS}
    try:
        stop = preflight(job, rows)
        stopping()
        if stop:
            job.say([f"FAIL: {stop}"])
            job.write()
            return 1
        job.write()
        for k, (row, estimate) in enumerate(zip(rows, plan), 1):
            r = run_row(job, row, estimate, a.budget_s)
            if _signals:  # what ran was cut short: the row is STOPPED, not judged
                r = dict(
                    name=row.name,
                    script=row.script,
                    status="STOPPED",
                    why=f"by {Stopped(_signals[0])}",
                )
            job.results.append(r)
            job.say(run_lines(k, len(rows), r))
            job.write()
            stopping()
        line, rc = summary(job.results, job.elapsed())
        job.say([line])
        job.write()
        return rc
    except Stopped as s:
        line, _ = summary(job.results, job.elapsed())
        job.say([f"stopped by {s} after {job.elapsed():.0f} s (every child process ended): {line}"])
        job.write()
        return 128 + s.signum
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        _signals.clear()
        shutil.rmtree(job.work, ignore_errors=True)


def run_row(job: Job, row: Row, estimate: float, budget_s: float) -> dict:
    """A row's result: SKIPPED when its estimate does not fit in what is left of the budget; else its folders built
    and the run (or the probe), which may take what is left, up to 3 times its estimate (at least 2 minutes): a hung
    row does not take the budget of the rows after it."""
    left = budget_s - job.elapsed()
    if estimate > left:
        why = f"about {estimate:.0f} s needed, {max(left, 0):.0f} s left of --budget-s {budget_s:g}"
        return dict(name=row.name, script=row.script, status="SKIPPED", why=why)
    cap = max(120.0, 3 * estimate)
    failed = job.build(list(row.folders), min(left, cap))
    if failed:
        return dict(name=row.name, script=row.script, status="FAIL", why=failed)
    stopping()
    timeout = min(budget_s - job.elapsed(), cap)
    if timeout < 1:
        why = f"its folders' build took what was left of --budget-s {budget_s:g}"
        return dict(name=row.name, script=row.script, status="SKIPPED", why=why)
    return run_one(job, row, timeout) if row.script else cudnn_probe(job, row, timeout)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--wrap"]:
        wrap(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1:2] == ["--build-only"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("names", nargs="+", choices=FOLDERS)
        ap.add_argument("--cache", required=True)
        ap.add_argument("--tiny", action="store_true")
        b = ap.parse_args(sys.argv[2:])
        build_folders(b.cache, b.names, b.tiny)
    else:
        sys.exit(main())
