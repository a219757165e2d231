"""The harness every script shares, once: its flags (`HarnessArgs`; `GRPOArgs` adds the training
section the three GRPO scripts share) and its set-up. A script reads (CleanRL's shape):

    args = tyro.cli(Args)                  # Args(GRPOArgs): the shared flags, then its own
    h = setup(args, __file__, check_args)  # checks, distributed, run folder, rewards, model, logger
    run = h.start(optimizer)               # the EMA, and a resume's weights, optimizer, RNG...
    for iteration in range(run.start_iteration, args.num_iterations + 1): ...

Paper values live in docs/ and the checked presets, not in the help.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

from common import toyworld
from common.backbones import (
    LORA_TARGETS,
    check_model_flags,
    check_model_path,
    load_backbone,
    resolve_precision,
)
from common.plumbing.checkpoint import writing
from common.plumbing.checks import ConfigError, check_eval_size, check_run_name, read_prompt_file
from common.plumbing.parallel import parallelize
from common.plumbing.resume import restore_checkpoint
from common.plumbing.reward_flags import check_rewards, load_rewards
from common.plumbing.run import Run, RunLogger
from common.plumbing.run_folder import adopt_run_flags, resolve_run_dir, resume_source
from common.plumbing.signals import setup_reached, stop_on_signals_in_setup
from common.plumbing.tracking import check_tracking
from common.plumbing.utils import seed_everything, set_tf32, setup_distributed, truncate_metrics
from common.policy import EMA, Trainable, ema_weights

TOY_MODEL = os.path.join(os.path.dirname(toyworld.__file__), "model")  # the shipped toy model
# The batch's shape, printed at the start (the fields a script has).
BATCH_FIELDS = (
    "world_size groups_per_iteration group_size images_per_iteration images_per_rank "
    "rollout_batch_size train_batch_size trained_steps optimizer_steps_per_iteration"
).split()


def derived(default=0):
    """A field the program fills in: recorded in args.json, not a flag."""
    return field(default=default, init=False)


@dataclass
class HarnessArgs:
    # ---- experiment and run folder
    exp_name: str = "run"
    """name of the experiment, part of the default run name"""
    seed: int = 1
    """seed of prompts, noise and LoRA init, in [0, 2**32 - 1]"""
    torch_deterministic: bool = True
    """set torch.backends.cudnn.deterministic"""
    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works offline)"""
    wandb_project_name: str = "flow-rl"
    """the wandb project"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{run_name}/"""
    run_name: str | None = None
    """the run folder's name (default: {exp_name}__{seed}__{unix time})"""
    resume: str | None = None
    """continue a run folder, or one of its checkpoint-N folders, exactly (docs/design.md)"""
    resume_override: bool = False
    """with --resume and changed flags: start a new run folder from the checkpoint's weights"""
    save_every: int = 10
    """save checkpoint-{iteration} every N iterations, and at the end"""
    keep_checkpoints: int = 2
    """keep the newest K checkpoints (0 = all)"""

    # ---- model: the backbone, how it samples, what of it is trained
    model_path: str = TOY_MODEL
    """local diffusers folder of SD3/SD3.5/FLUX.1 (default: the shipped toy-world model)"""
    resolution: int = 32
    """height and width in pixels of every sampled image"""
    max_sequence_length: int | None = None
    """T5 tokens of the text context (default: 128 for SD3, 512 for FLUX, 1 without T5)"""
    shift: float | None = None
    """timestep shift s of the sigma schedule (default: the model's scheduler config)"""
    guidance_scale: float = 1.0
    """SD3: classifier-free guidance w (<= 1: none); FLUX.1-dev: its guidance input"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about 30 % more time"""
    mixed_precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """dtype of frozen weights and activations (auto: bf16 on CUDA, fp32 on CPU); fp16 scales the
    loss"""
    tf32: bool = True
    """CUDA: fp32 matmuls and convolutions in TF32 (as the released Flow-GRPO); --no-tf32: full fp32"""
    full_finetune: bool = False
    """train every transformer weight instead of a LoRA"""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """under torchrun: every rank holds the model (ddp), or 1/N of it (fsdp, FSDP2)"""
    fsdp_offload: bool = False
    """with --parallel fsdp: shards, gradients and optimizer step in host memory"""
    lora_rank: int = 16
    """LoRA rank r (unused with --full-finetune)"""
    lora_alpha: float = 32.0
    """LoRA alpha: the update is scaled by alpha / r"""
    lora_target: Literal["attention", "attention-ff", "all-linear"] = "all-linear"
    """layers that get a LoRA"""

    # ---- prompts and reward
    prompts_file: str = str(toyworld.RL_TRAIN_FILE)
    """training prompts, one per line"""
    reward: str = "toyworld"
    """reward name or weighted mix, e.g. "pickscore:1.0,clipscore:0.5" (common/rewards.py)"""
    reward_model_paths: str = ""
    """where reward weights live, e.g. "pickscore=/models/PickScore_v1" """
    guard_rewards: str = ""
    """rewards logged at evaluation only, to expose reward hacking, e.g. "aesthetic" """

    # ---- held-out evaluation, EMA and budget
    eval_prompts: str = str(toyworld.TEST_FILE)
    """evaluation prompts, one per line, never trained on"""
    eval_every: int = 10
    """evaluate every N iterations, and at the start and the end"""
    eval_num_steps: int = 20
    """ODE steps at evaluation"""
    eval_guidance_scale: float | None = None
    """guidance at evaluation (default: --guidance-scale)"""
    eval_seeds_per_prompt: int = 2
    """images per evaluation prompt, each from a fixed seed"""
    eval_batch_size: int = 64
    """images per transformer call at evaluation"""
    final_eval_seeds_per_prompt: int | None = None
    """images per prompt at the final evaluation (default: --eval-seeds-per-prompt)"""
    ema_decay: float = 0.0
    """largest EMA decay of the trained weights, used to evaluate and save (0 = off)"""
    ema_update_interval: int = 8
    """blend the EMA every N optimizer steps"""
    ema_warmup: bool = True
    """EMA decay min((1 + s) / (10 + s), --ema-decay) at optimizer step s"""
    cpu_budget_s: float = 0.0
    """stop after this many process CPU seconds, then evaluate (0 = no budget)"""

    # ---- batches and the optimizer step (the optimizer itself is built in each script)
    rollout_batch_size: int = 64
    """latents per transformer call while sampling, per rank"""
    decode_batch_size: int = 8
    """images per VAE decode call (rollout and evaluation): its memory grows with it"""
    max_grad_norm: float = 1.0
    """clip each optimizer step's gradient to this L2 norm"""
    train_batch_size: int | None = None
    """rows (stored states) per training forward, per rank (default: --rollout-batch-size)"""
    optimizer_steps_per_iteration: int = 1
    """optimizer steps per iteration (each after the first is off-policy)"""

    # ---- filled in by the program (not flags)
    world_size: int = derived()  # number of processes (torchrun ranks)
    resumed_from: str | None = derived(None)  # the checkpoint folder this run was resumed from

    def wants_reference(self) -> bool:
        """Whether the loss needs the reference model (the backbone without its LoRA)."""
        return False


@dataclass
class GRPOArgs(HarnessArgs):
    """The flags of the training section that the three GRPO scripts share line for line."""

    # ---- the GRPO training section
    sde_type: Literal["sde", "cps"] = "sde"
    """the stochastic step: Flow-GRPO's SDE, or coefficients-preserving sampling"""
    clip_range: float = 1e-4
    """PPO clip epsilon on the ratio"""
    beta: float = 0.0
    """weight of the KL to the reference (the model without LoRA); 0 = none"""
    ratio_norm: Literal["off", "ratio", "guard"] = "off"
    """GRPO-Guard: normalise the log-ratio (ratio), and re-weight steps by 1/|dt| (guard)"""
    detach_uncond: bool = False
    """stop the gradient through CFG's unconditional branch (a different objective)"""
    drop_zero_advantage: bool = True
    """skip transitions whose advantage is exactly 0 (no policy gradient)"""
    num_inner_epochs: int = 1
    """passes over the iteration's transitions"""
    grad_share_every: int = 0
    """diagnostic: every N iterations, log each trained step's share of the gradient"""

    def wants_reference(self) -> bool:
        return self.beta > 0  # the KL term's reference forward


@dataclass
class Harness:
    """What the set-up made: the process's place, the run folder, the data, the model."""

    args: HarnessArgs
    script: str
    rank: int
    world_size: int
    device: torch.device
    run_dir: str
    resume_dir: str | None
    train_prompts: list[str]
    eval_prompts: list[str]
    reward_model: object
    guard_model: object
    backbone: object
    trainable: Trainable
    policy: torch.nn.Module  # the trained module, wrapped for DDP or FSDP2
    logger: RunLogger
    prompt_digests: dict = field(default_factory=dict)  # {path flag: sha256 of the file as read}
    params: dict = field(init=False)  # the trained weights by name: what the optimizer steps

    def __post_init__(self):
        self.params = self.trainable.params  # FSDP: already re-pointed at the shards

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def start(
        self, optimizer, scaler=None, side_files=None, first_row=None, extra_state=None
    ) -> Run:
        """The EMA and a resume's state; -> the Run that logs, evaluates and saves. `scaler`: a
        GradScaler (fp16 needs it enabled); `side_files` ({name: text}) go into every checkpoint,
        `first_row` into iteration 0's metrics, `extra_state` ({name: EMA-like}) with the weights."""
        a = self.args
        if self.backbone.dtype == torch.float16 and not (scaler and scaler.is_enabled()):
            raise ConfigError(
                "--mixed-precision fp16 without loss scaling: the gradients underflow to zero; "
                "build torch.amp.GradScaler(device, enabled=True) and pass it to h.start"
            )
        scaler = scaler or torch.amp.GradScaler(self.device.type, enabled=False)
        ema = None
        if a.ema_decay > 0:
            ema = EMA(self.params, a.ema_decay, a.ema_update_interval, a.ema_warmup)
        start_iteration, counts = 0, None
        if self.resume_dir:
            start_iteration, counts = restore_checkpoint(
                self.resume_dir,
                self.rank,
                self.params,
                optimizer,
                ema,
                self.policy,
                extra_state,
                scaler,
            )
            if self.is_main:
                truncate_metrics(self.run_dir, start_iteration)

        def save_weights(folder):
            with ema_weights(ema):
                self.trainable.save_weights(folder)

        run = Run(
            a,
            self.run_dir,
            self.rank,
            self.world_size,
            self.device,
            self.logger,
            counts,
            start_iteration,
            self.script,
        )
        run.bind(
            self.backbone,
            self.reward_model,
            self.guard_model,
            self.eval_prompts,
            self.params,
            optimizer,
            ema,
            self.policy,
            save_weights,
            side_files,
            extra_state,
        )
        run.scaler, run.skips_in_a_row = scaler, counts.pop("skips_in_a_row", 0) if counts else 0
        run.first_row = dict(first_row or {})
        run.prompt_digests = dict(self.prompt_digests)
        run.stop_on_signals()
        return run


def given_flags(argv: list[str]) -> set[str]:
    """Fields given in argv: --learning-rate 1e-3 -> learning_rate, --no-track -> track."""
    names = set()
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name = token[2:].split("=", 1)[0].replace("-", "_")
            names.add(name[3:] if name.startswith("no_") else name)
    return names


@stop_on_signals_in_setup
def setup(args: HarnessArgs, script: str, check_args, argv: list[str] | None = None) -> Harness:
    """Everything before the optimizer, cheapest first so that bad input costs one line, not a model
    load. A resume takes the run's flags but those in `argv` (default sys.argv). SIGINT and SIGTERM
    stop it in one line from its first line, exit 128 + signal."""
    check_run_name(args)
    check_tracking(args)
    given = given_flags(sys.argv[1:] if argv is None else argv)
    source = None
    if args.resume:  # the checkpoint (or a run folder without one) and the run's flags
        log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *_: None)
        source = resume_source(args.resume, log)
        # args.json before 2026-12-05 (no decode_batch_size) computed in fp32 on a CPU whatever the
        # flag said: resumed on a CPU, such a run continues in fp32, not in the bf16 it names
        if "decode_batch_size" not in source[1] and not torch.cuda.is_available():
            source[1]["mixed_precision"] = "fp32"
        adopt_run_flags(args, source[1], source[2], given)
    digests = {}  # the prompt files as read: a checkpoint records them, a resume compares them
    train_prompts = read_prompt_file(args.prompts_file, "--prompts-file", digests)
    eval_prompts = read_prompt_file(args.eval_prompts, "--eval-prompts", digests)
    check_eval_size(args, eval_prompts)
    prompt_files = {"--prompts-file": train_prompts, "--eval-prompts": eval_prompts}
    check_rewards(args.reward, args.guard_rewards, args.reward_model_paths, prompt_files)
    check_model_flags(args.model_path, check_model_path(args.model_path), args)
    rank, world_size, device = setup_distributed()
    set_tf32(device, args.tf32)
    # what runs here is what args.json records: a resume on another device keeps the precision
    args.mixed_precision = resolve_precision(args.mixed_precision, device)
    if args.mixed_precision == "fp16" and getattr(args, "grad_share_every", 0):
        raise ConfigError(
            f"--grad-share-every {args.grad_share_every} differentiates each step's loss without the "
            "fp16 loss scale, and those gradients underflow: run the diagnostic with "
            "--mixed-precision bf16 or fp32, or pass --grad-share-every 0"
        )
    args.world_size = world_size  # the derived values every script has, filled in here once
    args.train_batch_size = args.train_batch_size or args.rollout_batch_size
    check_args(args, world_size)
    seed_everything(args.seed, args.torch_deterministic)
    run_dir, resume_dir = resolve_run_dir(
        args, script, rank == 0, source, frozenset(given), digests
    )
    setup_reached(run_dir)
    if rank == 0:
        shape = (f"{k}={getattr(args, k)}" for k in BATCH_FIELDS if hasattr(args, k))
        print("batch arithmetic: " + ", ".join(shape))
    reward_model, guard_model = load_rewards(
        args.reward, args.guard_rewards, args.reward_model_paths, device
    )
    backbone = load_backbone(
        args.model_path,
        device,
        max_sequence_length=args.max_sequence_length,
        gradient_checkpointing=args.gradient_checkpointing,
        precision=args.mixed_precision,
        shard=args.parallel == "fsdp",
        decode_batch_size=args.decode_batch_size,
    )
    trainable = Trainable(
        backbone,
        args.full_finetune,
        args.lora_rank,
        args.lora_alpha,
        LORA_TARGETS[args.lora_target],
        need_reference=args.wants_reference(),
    )
    policy = parallelize(trainable, args.parallel, world_size, args.fsdp_offload)
    config = {"script": os.path.basename(script), **asdict(args)}  # a resume names the script
    name = os.path.basename(run_dir)
    with writing(run_dir):  # args.json, atomic; a full disk: one line
        logger = RunLogger(
            run_dir, rank == 0, args.track, config, args.wandb_project_name, args.wandb_entity, name
        )
    setup_reached(run_dir)  # a stop whose exit a library swallowed ends here
    return Harness(
        args,
        script,
        rank,
        world_size,
        device,
        run_dir,
        resume_dir,
        train_prompts,
        eval_prompts,
        reward_model,
        guard_model,
        backbone,
        trainable,
        policy,
        logger,
        digests,
    )


def split_batch(args, world_size: int) -> None:
    """The images per iteration (prompts x G) and per rank of a script whose groups spread over the
    ranks; one line when they do not split over the ranks or the rollout batches."""
    args.images_per_iteration = args.groups_per_iteration * args.group_size
    if args.images_per_iteration % world_size:
        raise ConfigError(
            f"groups_per_iteration * group_size = {args.images_per_iteration} images cannot be "
            f"split evenly over {world_size} ranks; make it a multiple of {world_size}"
        )
    args.images_per_rank = args.images_per_iteration // world_size
    if args.images_per_rank % args.rollout_batch_size:
        raise ConfigError(
            f"each rank samples {args.images_per_rank} images, not a multiple of "
            f"--rollout-batch-size {args.rollout_batch_size}; pick a divisor of "
            f"{args.images_per_rank}"
        )
