"""--parallel fsdp (common/plumbing/parallel.py): FSDP2 against DDP on 2 CPU ranks (gloo) in all four scripts, its memory per
rank, its sharded checkpoints and exact resume, the user's weights in stock pipelines, FSDP over one rank with
offload, a 2-node launch over loopback, and the one-line errors.

All 2-rank runs share ONE launch, the 2-node one (tests/parallel_worker.py: the imports are most of a tiny run's
time): SD3 full fine-tuning in all four scripts, FLUX full fine-tuning and LoRA in flowgrpo_baseline.py, and the
per-script DDP checks (LoRA, the default path: ranks agree on the weights, the SDE window, psi) too. FLUX under FSDP
runs in the baseline only: what FLUX changes lives in common/ (the backbone, the sharding plan), which the four
scripts share, and the SD3 runs already take each script's own training section through FSDP.
"""

import dataclasses
import json
import os
import re
import runpy
import socket
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    read_metrics,
    run_main,
    script_env,
    stock_pipeline_image,
    tiny_flags,
    write_prompts,
)

from common.plumbing.checks import ConfigError

SCRIPTS = ["flowgrpo_baseline.py", "g2rpo.py", "densegrpo.py", "diffusionnft.py", "awm.py"]
PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]
FAST = ["--learning-rate", "1e-2", "--eval-every", "100"]
CALIB = [
    "--calibration-iterations",
    "1",
    "--calibration-trajectories",
    "2",
    "--completion-batch-size",
    "4",
]


def script_flags(script, model, out, prompts, name):
    """tiny_flags, in the form each script takes (G²RPO: its branch steps instead of --timestep-fraction)."""
    flags = tiny_flags(model, out, prompts, name)
    if script == "g2rpo.py":
        i = flags.index("--timestep-fraction")
        flags = (
            flags[:i]
            + flags[i + 2 :]
            + ["--branch-steps", "0", "1", "--granularities", "1", "--group-size", "2"]
        )
    return flags + (CALIB if script == "densegrpo.py" else [])


def launch(runs, tmp_path, nodes: int = 1, timeout: int = 600) -> dict:
    """Run `runs` ([script, flags...] each) in one 2-rank launch: torchrun --standalone (nodes=1) or two torchrun
    agents, one per "node", meeting over loopback by c10d rendezvous, as on a cluster (nodes=2). The jpeg reward is
    made smooth (tests/parallel_worker.py: a JPEG's size jumps, which would turn FSDP's 1e-7 differences from DDP
    into other advantages). Returns {(run, rank): RESULT}."""
    spec = tmp_path / f"runs{nodes}.json"
    spec.write_text(json.dumps(runs))
    env = script_env()
    worker = [os.path.join(ROOT, "tests", "parallel_worker.py"), str(spec), "--smooth-reward"]
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        procs = [
            subprocess.Popen(
                [*run, "--standalone", "--nproc-per-node", "2", *worker],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=ROOT,
            )
        ]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [
            subprocess.Popen(
                [
                    *run,
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(r),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--nproc-per-node",
                    "1",
                    "--local-addr",
                    "127.0.0.1",
                    *worker,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=ROOT,
            )
            for r in range(nodes)
        ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    results = [json.loads(m) for out in outs for m in re.findall(r"RESULT (\{[^{}]*\})", out)]
    return {(r["run"], r["rank"]): r for r in results}


def transformer_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"))


def assert_close(a: dict, b: dict, base: dict | None = None, atol: float = 1e-4):
    """Equal within float tolerance (FSDP sums the ranks' gradients in another order than DDP), and far closer to
    each other than to the starting weights (so the comparison is not trivially met)."""
    assert sorted(a) == sorted(b)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < atol, diff
    if base is not None:
        moved = max((a[k] - base[k]).abs().max().item() for k in a)
        assert moved > 100 * diff, (moved, diff)


# ============================================================ one launch of 2 "nodes" x 1 process for all the runs
# and 3 evaluation prompts: split unevenly over 2 ranks
LORA = [
    "--ema-decay",
    "0.5",
    "--ema-update-interval",
    "1",
    "--beta",
    "0.04",
    "--eval-batch-size",
    "1",
    "--num-iterations",
    "2",
    "--learning-rate",
    "5e-2",
]


@pytest.fixture(scope="module")
def two_nodes(tiny_sd3, tiny_flux, tmp_path_factory):
    """Every 2-rank run of this file in ONE launch, the documented multi-node one (2 nodes x 1 process over loopback):
    SD3 full fine-tuning with ddp and with fsdp in each script (2 iterations; 4 for the baseline, with the KL to the
    frozen copy, and its fsdp run again as 2 + 2 with a resume), FLUX full fine-tuning (3) and LoRA (2) in the
    baseline. Returns (output folder, run names, {(run, rank): RESULT})."""
    out = tmp_path_factory.mktemp("fsdp")
    prompts = write_prompts(out / "prompts.txt", PROMPTS)
    three = write_prompts(out / "three.txt", [*PROMPTS, "a photo of three green triangles"])
    full = [*FAST, "--full-finetune"]
    runs, names = [], []
    for script in SCRIPTS:
        its = "4" if script == SCRIPTS[0] else "2"
        # the KL reference: the frozen copy, sharded too
        beta = ["--beta", "0.04"] if script == SCRIPTS[0] else []
        for par in ("ddp", "fsdp"):
            names.append(f"{script}-{par}")
            runs.append(
                [
                    script,
                    *script_flags(script, tiny_sd3, out, prompts, names[-1]),
                    *full,
                    *beta,
                    "--num-iterations",
                    its,
                    "--parallel",
                    par,
                ]
            )
    split = [
        *script_flags(SCRIPTS[0], tiny_sd3, out, prompts, "split"),
        *full,
        "--beta",
        "0.04",
        "--parallel",
        "fsdp",
    ]
    runs += [
        [SCRIPTS[0], *split, "--num-iterations", "2"],
        [SCRIPTS[0], *split, "--num-iterations", "4", "--resume", str(out / "split")],
    ]
    names += ["split", "resumed"]
    for kind in ("full", "lora"):
        for par in ("ddp", "fsdp"):
            names.append(f"flux-{kind}-{par}")
            runs.append(
                [
                    SCRIPTS[0],
                    *tiny_flags(tiny_flux, out, prompts, names[-1]),
                    *FAST,
                    "--parallel",
                    par,
                    *(
                        ["--full-finetune", "--num-iterations", "3"]
                        if kind == "full"
                        else [*LORA, "--eval-prompts", three]
                    ),
                ]
            )
    # Precision (issue #55), 2 iterations each: a LoRA computes in fp32 under FSDP as under DDP (bf16 base), so the
    # two end with the same LoRA; full fine-tuning in bf16 gathers bf16 weights under FSDP where DDP keeps fp32
    # masters under autocast (the difference measured); fp16 with loss scaling under both, LoRA and full.
    for kind, precision in (("lora", "bf16"), ("full", "bf16"), ("lora", "fp16"), ("full", "fp16")):
        for par in ("ddp", "fsdp"):
            names.append(f"{kind}-{precision}-{par}")
            runs.append(
                [
                    SCRIPTS[0],
                    *tiny_flags(tiny_sd3, out, prompts, names[-1]),
                    *FAST,
                    *(["--full-finetune"] if kind == "full" else []),
                    *("--num-iterations", "2", "--mixed-precision", precision, "--parallel", par),
                ]
            )
    # --fsdp-offload on 2 ranks, fp16: the shards, their gradients, the clip's norm and the loss scaler's overflow
    # check live in host memory; every collective's tensor is recorded (issue #65)
    names.append("full-fp16-fsdp-offload")
    runs.append(["RECORD", *runs[names.index("full-fp16-fsdp")], "--fsdp-offload"])
    runs[-1][runs[-1].index("--run-name") + 1] = names[-1]
    # The per-script DDP checks (LoRA, the default path) ride in the same launch: a launch costs its imports.
    from test_flowgrpo_baseline import WINDOW
    from test_g2rpo import _flags as g2rpo_flags

    base = tiny_flags(tiny_sd3, out, prompts, "ddp-window")
    i = base.index("--timestep-fraction")
    runs += [
        [
            SCRIPTS[0],
            *base[:i],
            *base[i + 2 :],
            "--num-iterations",
            "3",
            "--groups-per-iteration",
            "2",
            "--group-size",
            "4",
            "--rollout-batch-size",
            "2",
            "--learning-rate",
            "1e-2",
            "--eval-every",
            "100",
            *WINDOW,
        ],
        [
            "g2rpo.py",
            *g2rpo_flags(tiny_sd3, out, "ddp-g2rpo"),
            "--num-iterations",
            "2",
            "--learning-rate",
            "1e-2",
            "--eval-every",
            "100",
        ],
        [
            "densegrpo.py",
            *tiny_flags(tiny_sd3, out, prompts, "ddp-psi"),
            "--num-iterations",
            "2",
            "--groups-per-iteration",
            "2",
            "--group-size",
            "4",
            "--rollout-batch-size",
            "2",
            "--learning-rate",
            "1e-2",
            "--eval-every",
            "100",
            "--calibration-iterations",
            "2",
            "--calibration-trajectories",
            "2",
            "--completion-batch-size",
            "4",
        ],
    ]
    names += ["ddp-window", "ddp-g2rpo", "ddp-psi"]
    return out, names, launch(runs, out, nodes=2)


# ============================================================ precision under DDP and FSDP, from the same launch
def lora_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "pytorch_lora_weights.safetensors"))


def update_cosine(a: dict, b: dict, base: dict) -> tuple[float, float]:
    """(cosine of the two runs' updates from `base`, share of entries whose updates differ by more than 1e-3, a
    tenth of the learning rate: Adam's first steps move an entry by about +-lr whatever its gradient's size, so
    an entry whose gradient is ~0 flips with the order of a sum and differs by up to 2 lr)."""
    da = torch.cat([(a[k] - base[k]).flatten() for k in sorted(a)]).double()
    db = torch.cat([(b[k] - base[k]).flatten() for k in sorted(a)]).double()
    cos = float(torch.nn.functional.cosine_similarity(da, db, dim=0))
    return cos, float(((da - db).abs() > 1e-3).double().mean())


def test_a_lora_trains_in_the_same_precision_under_ddp_and_fsdp(two_nodes):
    """--mixed-precision bf16, 2 ranks: the frozen base computes in bf16 and the LoRA in fp32 under both engines
    (FSDP2's param_dtype is None for a LoRA: each weight is gathered in its own dtype; test_fsdp_gathers_a_lora_in_fp32
    checks the dtype), and after 2 iterations the two LoRAs' updates agree: cosine 0.99999 and 0.07 % of the entries
    apart (measured 2026-12-05; the ranks' gradients are summed in another order)."""
    out, names, res = two_nodes
    ddp, fsdp = (lora_weights(out / f"lora-bf16-{p}" / "checkpoint-2") for p in ("ddp", "fsdp"))
    b = [k for k in ddp if "lora_B" in k]  # B starts at 0; A has no gradient until B has moved
    cos, apart = update_cosine(
        {k: ddp[k] for k in b}, {k: fsdp[k] for k in b}, {k: 0 * ddp[k] for k in b}
    )
    assert cos > 0.9999 and apart < 0.005, (cos, apart)


def test_fsdp_gathers_a_lora_in_fp32_and_full_finetuning_in_the_compute_dtype(
    tiny_sd3, monkeypatch
):
    """What each forward computes with, seen from inside it (one rank, in this process): under --parallel fsdp in bf16
    a LoRA's weights arrive in fp32 beside the bf16 base weight, as under DDP; full fine-tuning's arrive in bf16."""
    import torch.distributed as dist

    from common.backbones import LORA_TARGETS, load_backbone
    from common.plumbing.parallel import parallelize
    from common.policy import Trainable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        seen = {}
        for full in (False, True):
            bb = load_backbone(tiny_sd3, "cpu", precision="bf16", max_sequence_length=8)
            trainable = Trainable(bb, full, 4, 4, LORA_TARGETS["attention"], need_reference=False)
            policy = parallelize(trainable, "fsdp", 1)
            layer = bb.transformer.transformer_blocks[0].attn.to_q
            lora = layer.lora_A["default"] if not full else layer

            def hook(module, args, full=full):
                seen[full] = (module.weight.dtype, args[0].dtype)

            handle = lora.register_forward_pre_hook(hook)
            emb = bb.encode(["a photo of a red circle"])
            bb.velocity(torch.randn(1, 4, 32, 32), 0.5, emb, model=policy)
            handle.remove()
        # LoRA: fp32 weights (peft casts the bf16 input to them); full: the gathered bf16 weight
        assert seen[False][0] == torch.float32 and seen[True][0] == torch.bfloat16, seen
        assert (
            bb.transformer.transformer_blocks[0].attn.to_k.weight.dtype == torch.float32
        )  # the fp32 master
    finally:
        dist.destroy_process_group()


def test_full_finetuning_in_bf16_differs_between_ddp_and_fsdp_by_the_documented_rounding(
    two_nodes, tiny_sd3
):
    """Full fine-tuning in bf16: DDP keeps fp32 masters and computes under autocast, FSDP2 gathers the masters in bf16
    (half the gathered memory). The matmuls see the same bf16 weights; what autocast runs in fp32 (the norms, with
    their fp32 weights) sees bf16-rounded weights under FSDP. Measured 2026-12-05: after 2 iterations the updates'
    cosine is 0.9998 with 0.26 % of the entries apart (a LoRA: 0.99999 and 0.07 %; docs/design.md, "Sharding with
    FSDP2"), and each engine's ranks agree."""
    out, names, res = two_nodes
    base = transformer_weights(tiny_sd3)
    ddp, fsdp = (
        transformer_weights(out / f"full-bf16-{p}" / "checkpoint-2") for p in ("ddp", "fsdp")
    )
    cos, apart = update_cosine(ddp, fsdp, base)
    assert 0.999 < cos < 1 and apart < 0.01, (cos, apart)
    for p in ("ddp", "fsdp"):
        i = names.index(f"full-bf16-{p}")
        assert res[i, 0]["digest"] == res[i, 1]["digest"]


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("par", ["ddp", "fsdp"])
def test_fp16_scales_the_loss_under_ddp_and_fsdp(two_nodes, kind, par):
    """fp16 on 2 ranks, LoRA and full fine-tuning, DDP and FSDP2: the loss scale is logged, the ranks agree on every
    skip (an overflow on one rank's shard skips the step on all: torch.amp's found-inf is reduced over the mesh), the
    gradient has no underflow zeros beyond fp32's structural ones, and the ranks end with the same weights."""
    out, names, res = two_nodes
    run = f"{kind}-fp16-{par}"
    i = names.index(run)
    assert res[i, 0]["digest"] == res[i, 1]["digest"]
    rows = [r for r in read_metrics(out / run) if "train/loss_scale" in r]
    assert len(rows) == 2 and all(
        r["train/optimizer_steps"] + r["train/skipped_steps"] > 0 for r in rows
    )
    # at B = 0 (iteration 0) a LoRA's A has no gradient in any precision: the last row, after B moved
    assert rows[-1]["train/grad_zero_fraction"] < 0.1, rows


def test_fsdp_offload_on_two_ranks_trains_as_fsdp_does_and_its_collectives_are_served_on_gpus(
    two_nodes,
):
    """--fsdp-offload on 2 ranks (fp16, full fine-tuning): it ends with the weights of the same run without offload,
    the ranks agree, and every tensor that reached a collective (recorded by device type, including DTensor's own
    reductions in the gradient clip and the loss scaler) is on a device the process group a GPU run makes serves.
    On 2026-12-06's code that group was NCCL alone, which serves no CPU tensor (issue #65): `Run.is_last`'s flag and
    offload's host-memory shards stopped every multi-GPU run."""
    from torch.distributed.distributed_c10d import BackendConfig

    from common.plumbing.utils import process_group_backend

    out, names, res = two_nodes
    i = names.index("full-fp16-fsdp-offload")
    assert res[i, 0]["digest"] == res[i, 1]["digest"]
    offload, plain = (
        transformer_weights(out / run / "checkpoint-2") for run in (names[i], "full-fp16-fsdp")
    )
    assert all(torch.equal(offload[k], plain[k]) for k in plain)
    served = BackendConfig(process_group_backend(cuda=True)).get_device_backend_map()
    assert res[i, 0]["collective_devices"] == ["cpu"]  # every one of them
    assert set(res[i, 0]["collective_devices"]) <= set(served), served


@pytest.mark.parametrize("choice, expect", [("", {"cpu": "gloo", "cuda": "nccl"}), ("gloo", None)])
def test_a_gpu_run_makes_a_process_group_for_cuda_and_cpu_tensors(monkeypatch, choice, expect):
    """On a GPU, setup_distributed makes a group with NCCL for CUDA tensors and gloo for CPU ones (the CPU tensors a
    GPU run reduces: a flag all ranks agree on, --fsdp-offload's host-memory shards); FLOW_RL_DIST_BACKEND=gloo runs
    gloo for both, for a machine where NCCL will not start. Set up with CUDA faked: what init_process_group gets."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import BackendConfig

    import common.plumbing.utils

    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: got.update(kw, b=backend))
    monkeypatch.setattr(common.plumbing.utils, "_install_collective_failure_hook", lambda *a: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("FLOW_RL_DIST_BACKEND", choice)
    assert common.plumbing.utils.setup_distributed() == (0, 2, torch.device("cuda", 0))
    assert got["device_id"] == torch.device("cuda", 0)
    served = BackendConfig(got["b"]).get_device_backend_map()
    assert served == (expect or {"cpu": "gloo", "cuda": "gloo"})


def test_an_unknown_process_group_backend_is_one_line(monkeypatch):
    from common.plumbing.utils import process_group_backend

    monkeypatch.setenv("FLOW_RL_DIST_BACKEND", "mpi")
    with pytest.raises(ConfigError, match="FLOW_RL_DIST_BACKEND='mpi': the only choice is 'gloo'"):
        process_group_backend(cuda=True)


# ============================================================ DDP (the default) in each script, from the same launch
def test_ddp_ranks_end_with_identical_weights_and_agree_on_the_window(two_nodes):
    """flowgrpo_baseline.py with an SDE window. Per-step metrics are sums over both ranks, so a rank that drew another
    window would add a second trained step to an iteration's metrics."""
    from test_flowgrpo_baseline import expected_window

    out, names, res = two_nodes
    i = names.index("ddp-window")
    assert res[i, 0]["digest"] == res[i, 1]["digest"]
    m = read_metrics(out / "ddp-window")
    assert m[-2]["train/kept_transitions"] > 0 and m[-1]["nfe"] > 0
    for it in range(3):
        w0 = expected_window(it, 1, 0, 3, group_size=4)
        assert m[it]["train/sde_window_start"] == w0
        assert [k for k in m[it] if k.startswith("steps/kept/")] == [f"steps/kept/{w0}"], m[it]


def test_ddp_g2rpo_ranks_end_with_identical_weights(two_nodes):
    """g2rpo.py: each rank samples whole groups; DDP keeps the weights identical."""
    from test_g2rpo import TINY_NFE

    out, names, res = two_nodes
    i = names.index("ddp-g2rpo")
    assert res[i, 0]["digest"] == res[i, 1]["digest"]
    m = read_metrics(out / "ddp-g2rpo")
    assert m[0]["train/kept_transitions"] > 0
    assert m[0]["nfe/rollout"] + m[0]["nfe/completion"] == 2 * TINY_NFE  # both ranks, 1 prompt each


def test_ddp_densegrpo_ranks_agree_on_psi_and_weights(two_nodes):
    out, names, res = two_nodes
    i = names.index("ddp-psi")
    assert res[i, 0]["digest"] == res[i, 1]["digest"]
    m = read_metrics(out / "ddp-psi")
    assert m[0]["train/kept_transitions"] > 0 and m[-1]["nfe"] > 0
    assert len(json.load(open(out / "ddp-psi" / "psi.json"))["history"][0]["pos"]) == 3


@pytest.mark.parametrize("script", SCRIPTS)
def test_fsdp_full_finetune_ends_with_ddps_weights(two_nodes, tiny_sd3, script):
    """2 ranks, full fine-tuning of the tiny SD3 for 2 iterations (4 for the baseline, with the KL to a sharded frozen
    copy): the saved transformer equals DDP's within float tolerance, and both ranks end with the same weights."""
    out, names, res = two_nodes
    its = 4 if script == "flowgrpo_baseline.py" else 2
    ddp, fsdp = (
        transformer_weights(out / f"{script}-{p}" / f"checkpoint-{its}") for p in ("ddp", "fsdp")
    )
    assert_close(ddp, fsdp, transformer_weights(tiny_sd3))
    i = names.index(f"{script}-fsdp")
    assert res[i, 0]["digest"] == res[i, 1]["digest"]
    m = read_metrics(out / f"{script}-fsdp")
    assert m[-2]["train/optimizer_steps"] > 0  # NFT and AWM have no transitions to count as kept
    assert script in ("diffusionnft.py", "awm.py") or m[-2]["train/kept_transitions"] > 0


def test_fsdp_holds_half_the_parameters_and_optimizer_state_per_rank(two_nodes):
    """Measured per rank after training: the transformer's parameters and the Adam moments under FSDP on 2 ranks are
    half of DDP's (FSDP2 shards every tensor along dim 0; the two halves differ by at most one row each), and the
    Adam moments are twice the fp32 weights on every rank, as the memory model counts them."""
    _, names, res = two_nodes
    for script in SCRIPTS:
        d, f = (res[names.index(f"{script}-{p}"), 0] for p in ("ddp", "fsdp"))
        both = [res[names.index(f"{script}-fsdp"), r] for r in (0, 1)]
        for key in ("param_bytes", "optimizer_bytes"):
            # the shards add up to the whole
            assert sum(r[key] for r in both) == d[key], (
                script,
                key,
            )
            assert abs(f[key] / d[key] - 0.5) < 0.02, (script, key, f[key], d[key])
        for r in (
            d,
            *both,
        ):  # the memory model's terms at rest (benchmarks/bench_memory.py): weights 4P / N, Adam 8P / N
            assert r["optimizer_bytes"] == 2 * r["param_bytes"], (script, r)
        print(
            script,
            "per-rank bytes, ddp -> fsdp:",
            d["param_bytes"] + d["optimizer_bytes"],
            "->",
            f["param_bytes"] + f["optimizer_bytes"],
        )


def test_fsdp_resume_is_exact_and_loads_in_a_stock_pipeline(two_nodes, tiny_sd3):
    """2 + 2 = 4 iterations with the sharded checkpoint (one file per rank) equal 4 straight ones bit for bit; the
    saved transformer is a stock diffusers folder that changes StableDiffusion3Pipeline's image."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    out, names, res = two_nodes
    i, resumed = names.index(f"{SCRIPTS[0]}-fsdp"), names.index("resumed")
    assert res[i, 0]["digest"] == res[resumed, 0]["digest"] == res[resumed, 1]["digest"]
    straight, split = out / f"{SCRIPTS[0]}-fsdp" / "checkpoint-4", out / "split" / "checkpoint-4"
    assert sorted(os.listdir(split / "trainer_state.dcp")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    a, b = transformer_weights(straight), transformer_weights(split)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [x["iteration"] for x in read_metrics(out / "split")] == [0, 1, 2, 3, 4]
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    before = stock_pipeline_image(pipe, PROMPTS[0])
    pipe.transformer = SD3Transformer2DModel.from_pretrained(str(split / "transformer"))
    after = stock_pipeline_image(pipe, PROMPTS[0])
    assert (after - before).abs().max() > 1e-3


def test_two_nodes_over_loopback_and_flux_fsdp_matches_ddp(two_nodes, tiny_flux):
    """The documented multi-node launch (torchrun --nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint
    HOST:PORT --nproc-per-node 1), two nodes on this machine: every run completes with identical weights on both
    ranks. FLUX full fine-tuning (3 iterations) and LoRA (2, with the EMA, the adapter-off KL reference and an
    evaluation split unevenly over the ranks) end with DDP's weights; both load into a stock FluxPipeline and change
    its image."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import load_file

    out, names, res = two_nodes
    assert sorted(res) == [(i, r) for i in range(len(names)) for r in (0, 1)]
    for i, name in enumerate(names):
        assert res[i, 0]["digest"] == res[i, 1]["digest"], name
    assert_close(
        *(transformer_weights(out / f"flux-full-{p}" / "checkpoint-3") for p in ("ddp", "fsdp")),
        transformer_weights(tiny_flux),
    )
    a, b = (
        load_file(str(out / f"flux-lora-{p}" / "checkpoint-2" / "pytorch_lora_weights.safetensors"))
        for p in ("ddp", "fsdp")
    )
    # LoRA at lr 5e-2: Adam turns a gradient element at float-noise level, whose sign depends on the reduction order,
    # into a step of up to lr, so the weights differ by more than full fine-tuning's: 6.0e-4 on a weight of 0.056 on
    # the machine of 2026-12-02 (under 1e-4 before), while they moved by 0.09 (the 100x check below still holds)
    assert_close(
        a, b, {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in a.items()}, atol=2e-3
    )
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    before = stock_pipeline_image(pipe, PROMPTS[0], guidance_scale=3.5)
    pipe.load_lora_weights(str(out / "flux-lora-fsdp" / "checkpoint-2"))
    with_lora = stock_pipeline_image(pipe, PROMPTS[0], guidance_scale=3.5)
    pipe.unload_lora_weights()
    pipe.transformer = FluxTransformer2DModel.from_pretrained(
        str(out / "flux-full-fsdp" / "checkpoint-3" / "transformer")
    )
    full = stock_pipeline_image(pipe, PROMPTS[0], guidance_scale=3.5)
    assert (with_lora - before).abs().max() > 1e-3 and (full - before).abs().max() > 1e-3


# ============================================================ one rank: FSDP over 1 rank with offload, in-process
def test_fsdp_over_one_rank_with_offload(tiny_sd3, tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 1 ... --parallel fsdp --fsdp-offload` (the way a model larger than the GPU trains on
    one GPU), here in this process with torchrun's variables: it trains a LoRA and saves its sharded checkpoint."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(k, v)
    prompts = write_prompts(tmp_path / "prompts.txt", PROMPTS)
    flags = [
        *tiny_flags(tiny_sd3, tmp_path, prompts, "one"),
        *FAST,
        "--parallel",
        "fsdp",
        "--fsdp-offload",
    ]
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # setup_distributed installs its own
    try:
        run_main(SCRIPTS[0], *flags, "--num-iterations", "1")
    finally:  # with one rank the script leaves its process group up (it tears down only a multi-rank one)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert sorted(os.listdir(tmp_path / "one" / "checkpoint-1" / "trainer_state.dcp")) == [
        ".metadata",
        "__0_0.distcp",
    ]
    assert os.path.isfile(tmp_path / "one" / "checkpoint-1" / "pytorch_lora_weights.safetensors")
    assert [x["iteration"] for x in read_metrics(tmp_path / "one")] == [0, 1]


# ============================================================ bad input: one line, before any model is loaded
@pytest.fixture(scope="module")
def modules():
    return {s: runpy.run_path(os.path.join(ROOT, s), run_name="not_main") for s in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "change,world,expect",
    [
        (
            dict(parallel="fsdp"),
            1,
            "error: --parallel fsdp shards the model over the ranks of a process group, and "
            "`python script.py` starts none: launch it with `torchrun --nproc-per-node N",
        ),
        (
            dict(fsdp_offload=True),
            1,
            "error: --fsdp-offload keeps FSDP's shards in host memory: it needs --parallel fsdp",
        ),
        (dict(parallel="fsdp"), 5, "multiple of 5"),  # 64 images (G²RPO: 3 groups) over 5 ranks
    ],
    ids=["no-torchrun", "offload-without-fsdp", "world-size"],
)
def test_bad_parallel_input_is_one_line(modules, monkeypatch, script, change, world, expect):
    monkeypatch.delenv("RANK", raising=False)
    args = dataclasses.replace(modules[script]["Args"](), **change)
    with pytest.raises(ConfigError) as e:
        modules[script]["check_args"](args, world)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and expect in msg and "\n" not in msg, msg


def test_fsdp_without_torchrun_stops_before_the_model_loads(tiny_sd3, tmp_path, monkeypatch):
    import common.backbones

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(common.backbones, "load_backbone", refuse)
    prompts = write_prompts(tmp_path / "prompts.txt", PROMPTS)
    monkeypatch.setattr(
        sys, "argv", [SCRIPTS[0], *tiny_flags(tiny_sd3, tmp_path, prompts), "--parallel", "fsdp"]
    )
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, SCRIPTS[0]), run_name="__main__")
    assert str(e.value.code).startswith("error: --parallel fsdp shards the model")
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("enabled, expect", [(True, "tf32"), (False, "ieee")])
def test_tf32_is_on_for_cuda_fp32_matmuls_unless_turned_off(enabled, expect):
    """--tf32 (the default) / --no-tf32 set torch's fp32 precision of CUDA matmuls and convolutions; on the CPU, which
    has no TF32, nothing changes, so every bit-exact CPU test computes as before."""
    from common.plumbing.utils import set_tf32

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        matmul.fp32_precision = conv.fp32_precision = "none"
        set_tf32(torch.device("cpu"), enabled)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("none", "none")
        set_tf32(torch.device("cuda", 0), enabled)
        assert (matmul.fp32_precision, conv.fp32_precision) == (expect, expect)
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
