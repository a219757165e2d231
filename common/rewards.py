"""The rewards the papers train and evaluate with (each maps images and prompts to a float per
image), their mix and the group advantages. Which ones a run uses, and their weight files, are
flags: common/plumbing/reward_flags.py. A reward maps (images [B,3,H,W] float in [0,1], prompts)
to one float per image:

| name                   | source                                                | score              | range         |
|------------------------|-------------------------------------------------------|--------------------|---------------|
| toyworld               | common.toyworld.score, a pixel-exact GenEval stand-in | partial credit S²  | [0, 1]        |
| toyworld_coverage      | common.toyworld.color_coverage: hackable on purpose   | prompt-colour area | [0, 1]        |
| jpeg_compressibility   | DDPO; PIL JPEG q95 (512²: flat ≈ 5 kB, noise ≈ 310)   | -size in kB        | -310 .. -5    |
| jpeg_incompressibility | DDPO                                                  | +size in kB        | 5 .. 310      |
| aesthetic              | LAION improved-aesthetic-predictor (CLIP L/14 + MLP)  | raw MLP output     | ~1 .. 10      |
| pickscore              | PickScore_v1 (CLIP ViT-H/14), scaled as Flow-GRPO     | logit_scale·cos/26 | ~0.8 .. 0.9   |
| clipscore              | any CLIP, default openai/clip-vit-large-patch14       | cos                | ~0.15 .. 0.35 |
| hpsv2                  | HPS-v2.1, open_clip ViT-H-14 (needs open_clip_torch)  | cos                | ~0.2 .. 0.35  |
| imagereward            | ImageReward-v1.0 (BLIP ViT-L + BERT + MLP)            | package's z-score  | ~-2 .. 2      |

Scales of the papers, to reproduce them with weights: Flow-GRPO's jpeg_compressibility is -kB/500
(`jpeg_compressibility:0.002`), its clipscore 100·cos/30 (`clipscore:3.333`); PickScore papers
report 100·cos ≈ 21-23 (`pickscore:26`), G²RPO reports cos ≈ 0.23 (`pickscore:0.26`); the CLIPScore
metric is 100·cos or 2.5·max(cos, 0).

Preprocessing stays on the reward's device, on tensors: bicubic (antialiased) resize of the shortest
side to the processor's size, centre crop to its crop size, normalise with its mean/std: the
CLIPImageProcessor recipe without the uint8/PIL round trip, so scores differ slightly from those of
PIL-preprocessed images. Models load lazily (nothing heavy is imported before a reward is built),
once per (name, device, paths): guard rewards reuse the target's instances.

A remote reward (`remote:NAME@URL`, common/plumbing/remote_reward.py) mixes like any other;
`RewardModel.submit` scores a batch with the in-process rewards in the call, and starts a remote
one in the background, so the scripts sample their next batch while the server scores this one.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch import nn

from common.plumbing.checks import pickled_global
from common.plumbing.remote_reward import RemoteReward, RemoteRewardError
from common.plumbing.reward_files import (
    RewardLoadError,
    _blip_configs,
    _find_file,
    _first_line,
    _from_pretrained,
    _hub_hint,
    _imagereward_state_dicts,
    _needs_pickle,
    _require,
    _torch_load,
)

DEFAULT_PATHS = {
    "pickscore": "yuvalkirstain/PickScore_v1",
    "clipscore": "openai/clip-vit-large-patch14",
    "hpsv2": "xswu/HPSv2",
    "imagereward": "THUDM/ImageReward",
}
DEFAULT_PROCESSORS = {"pickscore": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"}
# used when neither aesthetic_clip nor the aesthetic folder has one
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
PICKSCORE_DIVISOR = 26.0  # Flow-GRPO pickscore_scorer.py: reward = logit_scale * cos / 26
AESTHETIC_MLP_FILE = "sac+logos+ava1-l14-linearMSE.pth"
HPSV2_FILE, HPSV2_ARCH = "HPS_v2.1_compressed.pt", "ViT-H-14"
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


# ----------------------------------------------------------------------------- shared preprocessing
def clip_preprocess(
    images: torch.Tensor, shortest_edge: int, crop: tuple[int, int], mean, std
) -> torch.Tensor:
    """[B,3,H,W] in [0,1] -> CLIP pixel values, on the images' device: bicubic resize of the
    shortest side, centre crop, normalise (the CLIPImageProcessor / open_clip recipe, done on
    tensors)."""
    h, w = images.shape[-2:]
    scale = shortest_edge / min(h, w)
    size = (max(crop[0], int(h * scale)), max(crop[1], int(w * scale)))
    if size != (h, w):
        images = F.interpolate(
            images, size=size, mode="bicubic", align_corners=False, antialias=True
        )
    top, left = (size[0] - crop[0]) // 2, (size[1] - crop[1]) // 2
    images = images[..., top : top + crop[0], left : left + crop[1]].clamp(0, 1)
    mean = torch.tensor(mean, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(std, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    return (images - mean) / std


def _size(d, key):  # transformers 5 gives a SizeDict, 4.x a dict
    return d.get(key) if isinstance(d, dict) else getattr(d, key, None)


def _features(out) -> torch.Tensor:  # transformers 5 returns a ModelOutput, 4.x a tensor
    return F.normalize(out if isinstance(out, torch.Tensor) else out.pooler_output, dim=-1)


# ----------------------------------------------------------------------------- rewards
def _jpeg_kb(images: torch.Tensor) -> torch.Tensor:
    """Size of each image as a quality-95 JPEG, in kB (1000 bytes), as DDPO
    (`buffer.tell() / 1000`)."""
    arrays = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for a in arrays:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def _toyworld(name: str):
    """A reward of the toy world, which is the environment's own (common/toyworld/scorer.py),
    imported when a run uses it."""
    from common.toyworld import scorer

    return getattr(scorer, name)


class CLIPReward:
    """A transformers CLIP checkpoint + its processor. score = cos(image, text), in [-1, 1]."""

    def __init__(
        self, name: str, paths: dict, device, model_key: str | None = None, text: bool = True
    ):
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        model_key = model_key or name
        model_path = paths[model_key]
        proc_path = paths.get(f"{name}_processor") or (
            model_path
            if os.path.isfile(os.path.join(model_path, "preprocessor_config.json"))
            else DEFAULT_PROCESSORS.get(name, model_path)
        )
        default = DEFAULT_PATHS.get(
            model_key, AESTHETIC_CLIP if model_key == "aesthetic_clip" else model_path
        )
        self.device = device
        model = _from_pretrained(
            name, CLIPModel, model_path, _hub_hint("a CLIP checkpoint folder", default, model_key)
        )
        # fp16 checkpoints too: pixels are fp32
        self.model = model.to(device=device, dtype=torch.float32).eval()
        proc_hint = _hub_hint(
            "a processor folder with the tokenizer and preprocessor_config.json",
            DEFAULT_PROCESSORS.get(name, default),
            f"{name}_processor",
            " --include '*.json' '*.txt'",
        )
        proc = _from_pretrained(name, AutoImageProcessor, proc_path, proc_hint)
        self.geometry = (
            _size(proc.size, "shortest_edge") or _size(proc.crop_size, "height"),
            (_size(proc.crop_size, "height"), _size(proc.crop_size, "width")),
            proc.image_mean,
            proc.image_std,
        )
        self.tokenizer = (
            _from_pretrained(name, AutoTokenizer, proc_path, proc_hint) if text else None
        )

    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        pixels = clip_preprocess(images, *self.geometry)
        return _features(self.model.get_image_features(pixel_values=pixels))

    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        max_len = min(
            self.tokenizer.model_max_length, self.model.config.text_config.max_position_embeddings
        )
        tok = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt"
        )
        text = _features(
            self.model.get_text_features(
                input_ids=tok.input_ids.to(self.device),
                attention_mask=tok.attention_mask.to(self.device),
            )
        )
        return (self.image_embeds(images) * text).sum(-1)

    __call__ = cosine


class PickScore(CLIPReward):
    """PickScore_v1 (Kirstain et al. 2023): logit_scale·cos (≈ 100·cos ≈ 17-24), divided by 26 as in
    Flow-GRPO, so the training reward is ≈ 0.8-0.9."""

    def __call__(self, images, prompts):
        return self.model.logit_scale.exp() * self.cosine(images, prompts) / PICKSCORE_DIVISOR


class AestheticMLP(nn.Module):
    """The LAION improved-aesthetic-predictor head (its `MLP` class: no activations, dropout
    only)."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x):
        return self.layers(x)


class Aesthetic:
    """LAION aesthetic score (christophschuhmann/improved-aesthetic-predictor, used by DDPO and
    Flow-GRPO): MLP on the L2-normalised CLIP ViT-L/14 image embedding. Raw output, AVA-like 1-10
    scale."""

    def __init__(self, paths: dict, device):
        folder = paths.get("aesthetic")
        hint = (
            f"{AESTHETIC_MLP_FILE} (from "
            "github.com/christophschuhmann/improved-aesthetic-predictor), or a folder holding it "
            "and optionally the CLIP ViT-L/14 checkpoint: --reward-model-paths aesthetic=PATH"
        )
        if not folder:
            raise RewardLoadError(f"aesthetic: no weights given: expected {hint}")
        state = _torch_load(_find_file("aesthetic", folder, AESTHETIC_MLP_FILE, hint), "aesthetic")
        if not isinstance(state, dict) or "layers.0.weight" not in state:
            raise RewardLoadError(
                f"aesthetic: '{folder}' is not the LAION MLP state dict (no layers.0.weight)"
            )
        self.mlp = AestheticMLP(state["layers.0.weight"].shape[1])
        self.mlp.load_state_dict(state)
        self.mlp.to(device).eval()
        if "aesthetic_clip" not in paths:
            # the CLIP checkpoint lives in the same folder, or on the hub
            has_clip = os.path.isfile(os.path.join(folder, "config.json"))
            paths = {**paths, "aesthetic_clip": folder if has_clip else AESTHETIC_CLIP}
        self.clip = CLIPReward("aesthetic", paths, device, model_key="aesthetic_clip", text=False)
        if self.clip.model.config.projection_dim != self.mlp.layers[0].in_features:
            raise RewardLoadError(
                f"aesthetic: the MLP expects {self.mlp.layers[0].in_features}-d embeddings but "
                f"the CLIP gives {self.clip.model.config.projection_dim}-d: use CLIP ViT-L/14"
            )

    def __call__(self, images, prompts):
        return self.mlp(self.clip.image_embeds(images)).squeeze(-1)


class HPSv2:
    """HPS-v2.1 (Wu et al. 2023; G²RPO's and DanceGRPO's reward): open_clip ViT-H-14 fine-tuned on
    HPD v2. score = cos(image, text) of its normalised features, ≈ 0.2-0.35 (reported ×100 in
    papers)."""

    def __init__(self, paths: dict, device):
        open_clip = _require("hpsv2")
        hint = _hub_hint(f"{HPSV2_FILE} or a folder holding it", "xswu/HPSv2", "hpsv2")
        ckpt = _find_file("hpsv2", paths["hpsv2"], HPSV2_FILE, hint)
        self.model = open_clip.create_model(HPSV2_ARCH, pretrained=None)
        try:  # weights_only: open_clip 3.3's default, said here (a pickled file is refused)
            open_clip.load_checkpoint(self.model, ckpt, weights_only=True)
        except pickle.UnpicklingError as e:
            if pickled_global(e) is None:
                raise RewardLoadError(
                    f"hpsv2: '{ckpt}' is not a weight file ({_first_line(e)})"
                ) from None
            raise RewardLoadError(_needs_pickle("hpsv2", ckpt)) from None
        except (RuntimeError, KeyError) as e:
            msg = f"hpsv2: '{ckpt}' is not an open_clip {HPSV2_ARCH} checkpoint ({_first_line(e)})"
            raise RewardLoadError(msg) from None
        self.model.to(device=device, dtype=torch.float32).eval()
        self.tokenizer, self.device = open_clip.get_tokenizer(HPSV2_ARCH), device
        cfg = getattr(self.model.visual, "preprocess_cfg", {})
        size = cfg.get("size", self.model.visual.image_size)
        size = (size, size) if isinstance(size, int) else tuple(size)
        self.geometry = (min(size), size, cfg.get("mean", CLIP_MEAN), cfg.get("std", CLIP_STD))

    def __call__(self, images, prompts):
        image = self.model.encode_image(clip_preprocess(images, *self.geometry), normalize=True)
        text = self.model.encode_text(self.tokenizer(prompts).to(self.device), normalize=True)
        return (image * text).sum(-1)


# the package's ImageReward.py
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072
# its init_tokenizer() and score()
IMAGEREWARD_TOKENIZER, IMAGEREWARD_MAX_TOKENS = "bert-base-uncased", 35


class ImageRewardScore:
    """ImageReward-v1.0 (Xu et al. 2023), scored natively with transformers (no `image-reward`
    package): BLIP's ViT-L/16 (BlipVisionModel) encodes the 224-px image, a BERT with
    cross-attention to the image tokens (BlipTextModel: BLIP's med.py) encodes the prompt, its [CLS]
    state goes through the MLP, and the package's (r - mean) / std standardises it (mean
    0, std 1 on its data). Tokens as the package's `score` / `inference_rank` (Flow-GRPO's path):
    bert-base-uncased plus [DEC] and [ENC], [CLS] kept first, padded or truncated to 35. Its PIL
    bicubic resize + centre crop + uint8 round trip become clip_preprocess on tensors: identical on
    224x224 uint8-valued images, within ~5e-3 otherwise (tests/fixtures/imagereward)."""

    def __init__(self, paths: dict, device):
        from transformers import BertTokenizer, BlipTextModel, BlipVisionModel

        path = paths["imagereward"]
        hint = _hub_hint(
            "a folder holding ImageReward.pt and med_config.json",
            "THUDM/ImageReward",
            "imagereward",
        )
        ckpt = _find_file("imagereward", path, "ImageReward.pt", hint)
        folder = os.path.dirname(ckpt) if os.path.isfile(path) else path
        med_path = _find_file("imagereward", folder, "med_config.json", hint)
        tok_path = paths.get("imagereward_tokenizer") or (
            folder if os.path.isfile(os.path.join(folder, "vocab.txt")) else IMAGEREWARD_TOKENIZER
        )
        tok_hint = _hub_hint(
            "a BERT tokenizer folder (vocab.txt)",
            IMAGEREWARD_TOKENIZER,
            "imagereward_tokenizer",
            " --include '*.txt' '*.json'",
        )
        # vocab.txt first: transformers 5's BertTokenizer.from_pretrained turns a missing hub id
        # into an empty vocab
        vocab = _find_file("imagereward", tok_path, "vocab.txt", tok_hint)
        self.tokenizer = _from_pretrained(
            "imagereward", BertTokenizer, os.path.dirname(vocab), tok_hint
        )
        # as init_tokenizer(): 30522, 30523
        self.tokenizer.add_tokens(["[DEC]", "[ENC]"], special_tokens=True)
        state = _torch_load(ckpt, "imagereward")  # a file that needs pickle: its own line
        try:
            with open(med_path) as f:
                med = json.load(f)
            if not isinstance(state, dict):
                raise ValueError(f"a {type(state).__name__}, not a state dict")
            parts = _imagereward_state_dicts(state)
            vision_config, text_config = _blip_configs(parts["vision"], med)
            self.vision = BlipVisionModel(vision_config)
            self.text = BlipTextModel(text_config, add_pooling_layer=False)
            # the package's MLP: the same layers, 1024-128-64-16-1
            self.mlp = AestheticMLP(med["hidden_size"])
            for module, part in ((self.vision, "vision"), (self.text, "text"), (self.mlp, "mlp")):
                missing, unexpected = module.load_state_dict(parts[part], strict=False)
                if missing or unexpected:  # every weight mapped, none left at its random init
                    raise KeyError(
                        f"{part} weights: missing {missing[:3]}, unexpected {unexpected[:3]}"
                    )
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: a shape mismatch
            detail = " ".join(str(e).split())[:300]
            raise RewardLoadError(
                f"imagereward: '{ckpt}' with '{med_path}' is not an ImageReward checkpoint "
                f"({type(e).__name__}: {detail}): expected {hint}"
            ) from None
        for module in (self.vision, self.text, self.mlp):
            module.to(device=device, dtype=torch.float32).eval()
        if len(self.tokenizer) != text_config.vocab_size:
            raise RewardLoadError(
                f"imagereward: the tokenizer in '{os.path.dirname(vocab)}' has "
                f"{len(self.tokenizer)} tokens with [DEC] and [ENC], its text encoder "
                f"{text_config.vocab_size}: expected {tok_hint}"
            )
        self.size, self.device = vision_config.image_size, device

    def __call__(self, images, prompts):
        tok = self.tokenizer(
            prompts,
            padding="max_length",
            truncation=True,
            max_length=IMAGEREWARD_MAX_TOKENS,
            return_tensors="pt",
        ).to(self.device)
        # BLIP's = CLIP's
        pixels = clip_preprocess(images, self.size, (self.size, self.size), CLIP_MEAN, CLIP_STD)
        image_tokens = self.vision(pixel_values=pixels).last_hidden_state
        text = self.text(
            input_ids=tok.input_ids,
            attention_mask=tok.attention_mask,
            encoder_hidden_states=image_tokens,
        ).last_hidden_state  # no image mask: all tokens count
        return ((self.mlp(text[:, 0]) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD).squeeze(-1)


LOADERS = {  # name -> (paths, device) -> callable(images on device [b,3,H,W], prompts) -> [b]
    "toyworld": lambda paths, device: _toyworld("reward"),
    "toyworld_coverage": lambda paths, device: _toyworld("coverage_reward"),
    "jpeg_compressibility": lambda paths, device: lambda images, prompts: -_jpeg_kb(images),
    "jpeg_incompressibility": lambda paths, device: lambda images, prompts: _jpeg_kb(images),
    "aesthetic": Aesthetic,
    "pickscore": lambda paths, device: PickScore("pickscore", paths, device),
    "clipscore": lambda paths, device: CLIPReward("clipscore", paths, device),
    "hpsv2": HPSv2,
    "imagereward": ImageRewardScore,
}


# ----------------------------------------------------------------------------- combined model
class Pending:
    """A batch a remote reward scores in the background (RewardModel.submit): the in-process
    rewards' scores, taken in the call, and a Future of each remote reward's, sent the 8-bit
    pixels."""

    def __init__(self, model: RewardModel, images: torch.Tensor, prompts: list[str]):
        self.cancel = threading.Event()
        with torch.no_grad():
            pixels = (images.float() * 255).round().clamp(0, 255).to(torch.uint8).cpu()
        self.futures = {k: model.fns[k].submit(pixels, prompts, self.cancel) for k in model.remote}
        local = model.local_scores(images, prompts).unbind(1) if model.local else []
        self.local = dict(zip(model.local, local))

    def scores(self) -> torch.Tensor:
        """[B, K], once every remote reward has answered."""
        columns = {**self.local, **{k: f.result() for k, f in self.futures.items()}}
        return torch.stack([columns[k] for k in sorted(columns)], 1)

    def stop(self) -> None:
        """Drop the remote requests not sent yet; one under way stops before its next try."""
        self.cancel.set()
        for future in self.futures.values():
            future.cancel()

    @staticmethod
    def gather(pending: list) -> torch.Tensor:
        """The batches' scores in order; a remote reward that fails stops the others first."""
        try:
            return torch.cat([p.scores() if isinstance(p, Pending) else p for p in pending])
        except RemoteRewardError as e:
            for p in pending:
                if isinstance(p, Pending):
                    p.stop()
            raise e.stopping() from None


class RewardModel:
    """Several rewards scored together. A call gives the raw scores [B, K] (float32, CPU), `mix`
    their weighted sum [B]. A rollout hands each batch to `submit` and gets all their scores from
    `gather`: without a remote reward `submit` is the plain call; a remote one scores in the
    background while the rollout samples its next batch."""

    def __init__(self, names: list[str], weights: torch.Tensor, fns: list, device, batch_size: int):
        self.names, self.weights, self.fns = names, weights, fns
        self.device, self.batch_size = device, batch_size
        self.remote = [k for k, fn in enumerate(fns) if isinstance(fn, RemoteReward)]
        self.local = [k for k in range(len(fns)) if k not in self.remote]

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.gather([self.submit(images, prompts)])

    def submit(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor | Pending:
        """images [B,3,H,W] in [0,1] -> the scores [B, K], or a Pending while a remote reward
        scores."""
        if images.ndim != 4 or images.shape[1] != 3 or len(prompts) != len(images):
            shapes = f"{tuple(images.shape)} and {len(prompts)}"
            raise ValueError(f"expected images [B,3,H,W] and B prompts, got {shapes}")
        if self.remote:
            return Pending(self, images, list(prompts))
        return self.local_scores(images, prompts)

    def local_scores(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The in-process rewards' scores [B, K_local], float32 on the CPU, batch_size at a time."""
        fns, b, chunks = [self.fns[k] for k in self.local], self.batch_size, []
        with torch.inference_mode():
            for i in range(0, len(images), b):
                x = images[i : i + b].to(self.device, torch.float32)
                scores = [fn(x, prompts[i : i + b]).float().cpu() for fn in fns]
                chunks.append(torch.stack(scores, 1))
        return torch.cat(chunks).clone()  # cloned outside inference mode: usable in autograd

    def gather(self, pending: list) -> torch.Tensor:
        """The scores [n, K] of the submitted batches, in order (a failed remote reward: one
        line)."""
        if any(isinstance(p, Pending) for p in pending):
            return Pending.gather(pending)
        return torch.cat(pending) if pending else torch.zeros(0, len(self.fns))

    def mix(self, scores: torch.Tensor) -> torch.Tensor:
        """'score' mix mode (Flow-GRPO): [B, K] raw scores -> [B] weighted sum."""
        return scores.float() @ self.weights

    def means(self, scores: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """{prefix + name: mean score}: one line to log target or guard rewards."""
        return {f"{prefix}{n}": scores[:, k].mean().item() for k, n in enumerate(self.names)}

    def __repr__(self):
        return (
            "RewardModel("
            f"{', '.join(f'{n}:{w:g}' for n, w in zip(self.names, self.weights.tolist()))}"
            ")"
        )


def advantage_mix(advantages_per_reward: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """'advantage' mix mode (G²RPO: A = A_HPS + A_CLIP): [N, K] per-reward advantages -> [N]
    weighted sum."""
    if advantages_per_reward.ndim != 2 or advantages_per_reward.shape[1] != len(weights):
        raise ValueError(
            f"expected advantages [N, {len(weights)}], got {tuple(advantages_per_reward.shape)}"
        )
    return advantages_per_reward.float() @ weights.to(advantages_per_reward.device, torch.float32)


def group_reward_metrics(rewards: torch.Tensor) -> dict:
    """The rollout's reward metrics of every script, from rewards [groups, G] (one row per group):
    their mean and std, the mean within-group std, and the share of groups whose G rewards all
    agree (no advantage to learn from). In float64, where G equal rewards have std exactly 0."""
    r = rewards.double()
    tied = (r.amax(-1) == r.amin(-1)).double()
    return {
        "train/reward_mean": r.mean().item(),
        "train/reward_std": r.std().item(),
        "train/group_std_mean": r.std(-1, unbiased=False).mean().item(),
        "train/zero_std_frac": tied.mean().item(),
    }


def all_gather_cat(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `t` along dim 0, rank-major (rank 0's rows first): the group advantages compare
    images of all ranks (a group is spread over them). One process: `t` itself; under torchrun, `t`
    is on the run's device (NCCL takes no CPU tensor)."""
    if world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def group_advantages(
    rewards: torch.Tensor, group: torch.Tensor, global_std: bool, eps: float
) -> torch.Tensor:
    """A_i = (r_i - mean of i's group) / std, std over all rewards (global_std) or over i's group:
    Flow-GRPO's PerPromptStatTracker, shared by every script. In float64, as its numpy: in float32
    the mean of a group tied at 0.3 or 2/3 is rounded, and its members get advantages of 1e-7 to
    3e-4, not 0. A tied group (max == min) gets exactly 0 (GRPO: --drop-zero-advantage drops it;
    NFT: r = 1/2). Returns float32."""
    r, n = rewards.double(), int(group.max()) + 1
    size = torch.bincount(group, minlength=n).double()
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, group, r) / size
    sq_dev = torch.zeros(n, dtype=torch.float64).index_add_(0, group, (r - mean[group]) ** 2)
    # population std, as np.std in Flow-GRPO
    std = r.std(unbiased=False).expand(n) if global_std else (sq_dev / size).sqrt()
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, group, r, "amin")
    hi = torch.full((n,), -float("inf"), dtype=torch.float64).scatter_reduce(0, group, r, "amax")
    adv = torch.where((hi == lo)[group], 0.0, (r - mean[group]) / (std[group] + eps))
    return adv.float()
