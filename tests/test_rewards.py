"""Reward registry: parsing, mixing, model-free rewards, and every model-based reward loaded from tiny
random-weight checkpoints written in the real layout, through the same code path as real weights."""

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from common import rewards
from common.plumbing.reward_files import MissingRewardPackage, RewardLoadError
from common.plumbing.reward_flags import (
    REWARD_NAMES,
    build_reward,
    parse_model_paths,
    parse_reward_spec,
)
from common.rewards import advantage_mix

# e.g. cuda: the model tests then run on the GPU
DEVICE = os.environ.get("REWARD_TEST_DEVICE", "cpu")
PROMPTS = [
    "a red circle",
    "two blue squares",
    "a cat",
    "a green triangle above a dog",
    "sky",
    "a tree",
]


def images(n=6, h=40, w=48, seed=0):  # non-square: exercises the shortest-side resize + centre crop
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- parsing and mixing
def test_parse_reward_spec():
    assert parse_reward_spec("pickscore") == [("pickscore", 1.0)]
    assert parse_reward_spec(" pickscore:1.0 , clipscore:0.5") == [
        ("pickscore", 1.0),
        ("clipscore", 0.5),
    ]
    assert parse_reward_spec("jpeg_compressibility:-2e-3") == [("jpeg_compressibility", -0.002)]
    with pytest.raises(ValueError, match="unknown reward 'pickscor'") as e:
        parse_reward_spec("pickscor:1.0")
    assert all(
        name in str(e.value) for name in REWARD_NAMES
    ) and "pickscore:1.0,clipscore:0.5" in str(e.value)
    for bad in ("pickscore:", "pickscore:abc", "pickscore:nan", "pickscore:1:2"):
        with pytest.raises(ValueError, match="bad weight"):
            parse_reward_spec(bad)
    for bad in ("", " , ", "pickscore,pickscore:2"):
        with pytest.raises(ValueError):
            parse_reward_spec(bad)


def test_parse_model_paths():
    assert parse_model_paths("") == {}
    assert parse_model_paths("pickscore=/x/y, clipscore=/z") == {
        "pickscore": "/x/y",
        "clipscore": "/z",
    }
    for bad in ("pickscore", "nope=/x", "pickscore="):
        with pytest.raises(ValueError, match="KEY=PATH"):
            parse_model_paths(bad)
    with pytest.raises(ValueError, match="unknown model path keys"):
        build_reward("jpeg_compressibility", model_paths={"pickscor": "/x"})


def test_mix_and_advantage_mix():
    model = build_reward("jpeg_compressibility:1.0,jpeg_incompressibility:0.5")
    assert model.names == ["jpeg_compressibility", "jpeg_incompressibility"]
    torch.testing.assert_close(model.weights, torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(
        model.mix(torch.tensor([[1.0, 2.0], [3.0, -4.0]])), torch.tensor([2.0, 1.0])
    )
    adv = torch.tensor([[1.0, -1.0], [0.5, 2.0], [0.0, 0.0]])
    torch.testing.assert_close(
        advantage_mix(adv, torch.tensor([1.0, 2.0])), torch.tensor([-1.0, 4.5, 0.0])
    )
    with pytest.raises(ValueError):
        advantage_mix(adv, torch.tensor([1.0, 2.0, 3.0]))
    assert model.means(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "eval/") == {
        "eval/jpeg_compressibility": 2.0,
        "eval/jpeg_incompressibility": 3.0,
    }


def test_no_heavy_import_until_used():
    """Parsing reward specs and building a light reward import no reward model's library; and the harness every script
    imports pulls in none of diffusers, peft or transformers (1.4 s on 2 cores), so a script's flags and files are
    checked, and a bad one refused, before anything heavy loads."""
    code = (
        "import sys; from common.plumbing import reward_flags as r; r.parse_reward_spec('pickscore:1,hpsv2:1');"
        "r.build_reward('jpeg_compressibility'); print(any(m in sys.modules for m in "
        "('transformers', 'open_clip', 'ImageReward', 'common.toyworld')));"
        "import common.plumbing.harness; print(sorted({'diffusers', 'peft', 'transformers'} & set(sys.modules)))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "[]"], out.stdout


# ----------------------------------------------------------------------------- JPEG
def test_jpeg_sign_and_scale():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = images(1, 64, 64)
    model = build_reward("jpeg_compressibility,jpeg_incompressibility")
    s = model(torch.cat([flat, noise]), ["a", "b"])
    assert s.shape == (2, 2) and s.dtype == torch.float32
    assert s[0, 0] > s[1, 0], "a flat image must be more compressible than noise"
    torch.testing.assert_close(s[:, 0], -s[:, 1])
    buf = io.BytesIO()  # documented scale: kB (1000 bytes) of a quality-95 JPEG
    Image.fromarray((noise[0] * 255).round().byte().permute(1, 2, 0).numpy()).save(
        buf, format="JPEG", quality=95
    )
    assert s[1, 1].item() == pytest.approx(buf.tell() / 1000)
    assert s[0, 1] < 2 < s[1, 1] < 40


# ----------------------------------------------------------------------------- tiny checkpoints
class LaionMLP(
    nn.Module
):  # the layout of improved-aesthetic-predictor's MLP, written independently
    def __init__(self, dim):
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


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """model/ (CLIPModel only, like PickScore_v1), processor/ (tokenizer + image processor, like the
    laion ViT-H-14 repo), full/ (both, like openai/clip-vit-large-patch14), aesthetic/ (full + MLP)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from common.plumbing.tiny import make_clip_tokenizer

    root = tmp_path_factory.mktemp("reward-ckpts")
    tok = make_clip_tokenizer(model_max_length=16)
    torch.manual_seed(0)
    model = CLIPModel(
        CLIPConfig(
            text_config=dict(
                vocab_size=len(tok),
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=16,
                bos_token_id=0,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            ),
            vision_config=dict(
                image_size=32,
                patch_size=8,
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
            ),
            projection_dim=16,
        )
    )
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    for name, parts in {
        "model": (model,),
        "processor": (tok, proc),
        "full": (model, tok, proc),
        "aesthetic": (model, tok, proc),
    }.items():
        for part in parts:
            part.save_pretrained(root / name)
    torch.save(LaionMLP(16).state_dict(), root / "aesthetic" / rewards.AESTHETIC_MLP_FILE)
    (root / "mlp768").mkdir()
    torch.save(LaionMLP(768).state_dict(), root / "mlp768" / rewards.AESTHETIC_MLP_FILE)
    return {p.name: str(p) for p in root.iterdir()}


IMAGEREWARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "imagereward")


def paths_for(name, c):
    return {
        "pickscore": {"pickscore": c["model"], "pickscore_processor": c["processor"]},
        "clipscore": {"clipscore": c["full"]},
        "aesthetic": {"aesthetic": c["aesthetic"]},
        "imagereward": {"imagereward": IMAGEREWARD},
    }[name]


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic", "imagereward"])
def test_model_reward_loads_and_is_consistent(name, ckpts):
    x = images(5)
    model = build_reward(name, DEVICE, model_paths=paths_for(name, ckpts), batch_size=4)
    s = model(x, PROMPTS[:5])
    assert (
        s.shape == (5, 1)
        and s.dtype == torch.float32
        and s.device.type == "cpu"
        and torch.isfinite(s).all()
    )
    assert s.std() > 0, "different images must get different scores"
    # deterministic (eval mode, no dropout)
    torch.testing.assert_close(model(x, PROMPTS[:5]), s, rtol=0, atol=0)
    one = build_reward(name, DEVICE, model_paths=paths_for(name, ckpts), batch_size=1)
    assert one.fns[0] is model.fns[0], "rewards are cached, not loaded twice"
    torch.testing.assert_close(one(x, PROMPTS[:5]), s, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model(x.double() * 1.0, PROMPTS[:5]), s)  # any dtype in


def test_clip_scalings(ckpts):
    """clipscore = cos in [-1, 1]; pickscore = exp(logit_scale)·cos / 26 on the same weights; the processor
    is found in the checkpoint folder when the folder has one."""
    x = images(4)
    mix = build_reward(
        "clipscore,pickscore", DEVICE, {"clipscore": ckpts["full"], "pickscore": ckpts["full"]}
    )
    s = mix(x, PROMPTS[:4])
    assert (s[:, 0].abs() <= 1).all()
    scale = mix.fns[1].model.logit_scale.exp().item()
    torch.testing.assert_close(s[:, 1], s[:, 0] * scale / 26)
    # cosine by hand: CLIP features of the preprocessed images and padded prompts
    clip = mix.fns[0]
    pixels = torch.nn.functional.interpolate(x, size=(32, 38), mode="bicubic", antialias=True)[
        ..., 3:35
    ].clamp(0, 1)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (rewards.CLIP_MEAN, rewards.CLIP_STD))
    pixels = (pixels - mean) / std
    tok = clip.tokenizer(
        PROMPTS[:4], padding="max_length", max_length=16, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = clip.model(
            input_ids=tok.input_ids.to(DEVICE),
            attention_mask=tok.attention_mask.to(DEVICE),
            pixel_values=pixels.to(DEVICE),
        )
    torch.testing.assert_close(
        s[:, 0], out.logits_per_image.diagonal().cpu() / scale, rtol=1e-4, atol=1e-5
    )


def test_aesthetic_dimension_mismatch_is_one_clear_line(ckpts):
    with pytest.raises(RewardLoadError, match="768-d.*ViT-L/14"):
        build_reward(
            "aesthetic", model_paths={"aesthetic": ckpts["mlp768"], "aesthetic_clip": ckpts["full"]}
        )


# ----------------------------------------------------------------------------- clear errors
def _one_line(err):
    msg = str(err.value)
    chained = err.value.__context__ is not None and not err.value.__suppress_context__
    assert "\n" not in msg and not chained, "one line, no chained traceback"
    return msg


def test_wrong_paths_give_one_clear_line(ckpts, tmp_path):
    with pytest.raises(RewardLoadError) as e:
        build_reward("pickscore", model_paths={"pickscore": str(tmp_path / "missing")})
    assert (
        "pickscore" in _one_line(e)
        and "yuvalkirstain/PickScore_v1" in _one_line(e)
        and "missing" in _one_line(e)
    )
    with pytest.raises(RewardLoadError) as e:  # exists, but holds no checkpoint
        build_reward("clipscore", model_paths={"clipscore": str(tmp_path)})
    assert "could not load" in _one_line(e) and "openai/clip-vit-large-patch14" in _one_line(e)
    with pytest.raises(
        RewardLoadError
    ) as e:  # processor defaults to the laion hub id: offline, not cached
        build_reward("pickscore", model_paths={"pickscore": ckpts["model"]})
    assert "laion/CLIP-ViT-H-14-laion2B-s32B-b79K" in _one_line(
        e
    ) and "pickscore_processor" in _one_line(e)
    with pytest.raises(RewardLoadError) as e:  # a CLIP folder, but no MLP file
        build_reward("aesthetic", model_paths={"aesthetic": ckpts["full"]})
    assert rewards.AESTHETIC_MLP_FILE in _one_line(
        e
    ) and "improved-aesthetic-predictor" in _one_line(e)
    with pytest.raises(RewardLoadError, match="no weights given"):
        build_reward("aesthetic")


def test_hpsv2_without_open_clip_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # makes `import open_clip` fail
    with pytest.raises(MissingRewardPackage) as e:
        build_reward(
            "pickscore:1,hpsv2:1", model_paths={"hpsv2": str(tmp_path), "pickscore": str(tmp_path)}
        )
    assert "hpsv2" in _one_line(
        e
    ) and "pip install open_clip_torch==3.3.0 torchvision==0.28.0" in _one_line(e)


# ----------------------------------------------------------------------------- ImageReward vs the original package
def _imagereward_expected():
    """tests/fixtures/imagereward: a tiny random-weight ImageReward in the package's layout and the scores that
    image-reward==1.5 (transformers 4) gives it; make_fixture.py there wrote both, and makes the images again."""
    spec = importlib.util.spec_from_file_location(
        "make_fixture", os.path.join(IMAGEREWARD, "make_fixture.py")
    )
    make_fixture = importlib.util.module_from_spec(spec)
    # imports only torch at the top; the package only in its main()
    spec.loader.exec_module(make_fixture)
    with open(os.path.join(IMAGEREWARD, "expected.json")) as f:
        expected = json.load(f)
    square, smooth = make_fixture.images(), make_fixture.smooth_images()
    assert int(square.long().sum()) == expected["images_checksum"], "make_fixture.images() changed"
    assert int(smooth.long().sum()) == expected["smooth_images_checksum"], (
        "make_fixture.smooth_images() changed"
    )
    return expected, square.float() / 255, smooth.float() / 255


def test_imagereward_matches_the_original_package(monkeypatch):
    """Every prompt x image pair scores as the package's public `load` + `inference_rank` does, without importing
    it. 224x224 images: the package's PIL preprocessing is then the identity, so scores agree to float rounding;
    non-square ones go through its PIL bicubic resize + uint8 round trip, which ours does on tensors (~4e-3)."""
    # the package is not needed (nor importable here)
    monkeypatch.setitem(sys.modules, "ImageReward", None)
    expected, square, smooth = _imagereward_expected()
    model = build_reward(
        "imagereward", DEVICE, model_paths={"imagereward": IMAGEREWARD}, batch_size=4
    )
    reward = model.fns[0]
    prompts = [p for p in expected["prompts"] for _ in range(4)]  # prompt i with images 0..3
    assert (
        reward.tokenizer(
            expected["prompts"], padding="max_length", truncation=True, max_length=35
        ).input_ids
        == expected["input_ids"]
    )
    s = model(square.repeat(4, 1, 1, 1), prompts)
    assert s.shape == (16, 1) and s.dtype == torch.float32
    want = torch.tensor(expected["scores"]).reshape(16, 1)
    torch.testing.assert_close(s, want, rtol=0, atol=1e-4)
    assert want.std() > 0.1, "the fixture's scores differ enough to tell a wrong model apart"
    torch.testing.assert_close(
        model(smooth.repeat(4, 1, 1, 1), prompts),
        torch.tensor(expected["smooth_scores"]).reshape(16, 1),
        rtol=0,
        atol=1e-2,
    )


def test_imagereward_file_path_and_tokenizer_key(tmp_path, monkeypatch):
    """ImageReward.pt given as a file; the tokenizer from imagereward_tokenizer when the folder has none."""
    expected, square, _ = _imagereward_expected()
    for name in ("ImageReward.pt", "med_config.json"):
        shutil.copy(os.path.join(IMAGEREWARD, name), tmp_path / name)
    paths = {"imagereward": str(tmp_path / "ImageReward.pt"), "imagereward_tokenizer": IMAGEREWARD}
    s = build_reward("imagereward", DEVICE, model_paths=paths)(square, expected["prompts"][:1] * 4)
    torch.testing.assert_close(s[:, 0], torch.tensor(expected["scores"][0]), rtol=0, atol=1e-4)
    # surely not cached
    monkeypatch.setattr(rewards, "IMAGEREWARD_TOKENIZER", "no-such-org/bert-base-uncased")
    with pytest.raises(
        RewardLoadError
    ) as e:  # no vocab.txt next to the weights: the hub id, offline
        build_reward("imagereward", model_paths={"imagereward": str(tmp_path)})
    assert "no-such-org/bert-base-uncased" in _one_line(e) and "imagereward_tokenizer" in _one_line(
        e
    )
    # some other BERT vocab
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\n")
    with pytest.raises(
        RewardLoadError, match="has 8 tokens with .DEC. and .ENC., its text encoder 41"
    ) as e:
        build_reward("imagereward", model_paths={"imagereward": str(tmp_path)})
    _one_line(e)


def test_imagereward_wrong_paths_give_one_clear_line(tmp_path):
    paths = {"imagereward": str(tmp_path), "imagereward_tokenizer": IMAGEREWARD}
    with pytest.raises(RewardLoadError) as e:  # an empty folder
        build_reward("imagereward", model_paths=paths)
    msg = _one_line(e)
    assert all(
        s in msg for s in ("ImageReward.pt", "med_config.json", "THUDM/ImageReward", str(tmp_path))
    ), msg
    shutil.copy(os.path.join(IMAGEREWARD, "ImageReward.pt"), tmp_path / "ImageReward.pt")
    with pytest.raises(RewardLoadError, match="no med_config.json in") as e:
        build_reward("imagereward", model_paths=paths)
    _one_line(e)
    with open(os.path.join(IMAGEREWARD, "med_config.json")) as f:
        med = json.load(f)
    # does not fit the weights
    (tmp_path / "med_config.json").write_text(json.dumps({**med, "hidden_size": 48}))
    with pytest.raises(RewardLoadError, match="not an ImageReward checkpoint.*size mismatch") as e:
        build_reward("imagereward", model_paths=paths)
    _one_line(e)
    # some other state dict
    torch.save({"layers.0.weight": torch.zeros(1, 768)}, tmp_path / "ImageReward.pt")
    with pytest.raises(RewardLoadError, match="not an ImageReward checkpoint") as e:
        build_reward("imagereward", model_paths=paths)
    _one_line(e)


def _importable(module):
    try:
        __import__(module)
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _importable("open_clip"), reason="open_clip_torch not installed (optional)")
def test_hpsv2_loads_tiny_open_clip_checkpoint(monkeypatch, tmp_path):
    import json

    import open_clip

    cfg = {
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "layers": 1,
            "width": 32,
            "head_width": 16,
            "patch_size": 8,
        },
        "text_cfg": {
            "context_length": 77,
            "vocab_size": 49408,
            "width": 32,
            "heads": 2,
            "layers": 1,
        },
    }
    (tmp_path / "tiny-hps-test.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path / "tiny-hps-test.json")
    monkeypatch.setattr(rewards, "HPSV2_ARCH", "tiny-hps-test")
    torch.manual_seed(0)
    torch.save(
        {"state_dict": open_clip.create_model("tiny-hps-test").state_dict()},
        tmp_path / rewards.HPSV2_FILE,
    )
    x, paths = images(5), {"hpsv2": str(tmp_path)}
    s = build_reward("hpsv2", DEVICE, paths, batch_size=4)(x, PROMPTS[:5])
    assert s.shape == (5, 1) and (s.abs() <= 1).all() and s.std() > 0
    torch.testing.assert_close(
        build_reward("hpsv2", DEVICE, paths, batch_size=1)(x, PROMPTS[:5]), s, rtol=1e-4, atol=1e-5
    )
    with pytest.raises(RewardLoadError, match="HPS_v2.1_compressed.pt.*xswu/HPSv2"):
        build_reward("hpsv2", model_paths={"hpsv2": str(tmp_path / "nowhere")})


# ----------------------------------------------------------------------------- toy world
def test_toyworld_prefers_a_correct_render():
    try:
        from common.toyworld import score  # noqa: F401
        from common.toyworld.render import render_batch
    except ImportError as e:
        pytest.skip(f"common.toyworld not available yet ({e})")
    prompt = "a photo of a red circle"
    rendered = torch.from_numpy(np.asarray(render_batch([prompt], [0]))).float() / 255
    if rendered.shape[-1] == 3:  # [B,H,W,3] -> [B,3,H,W]
        rendered = rendered.permute(0, 3, 1, 2)
    s = build_reward("toyworld")(
        torch.cat([rendered, torch.zeros_like(rendered)]), [prompt, prompt]
    )
    assert s.shape == (2, 1) and s[0, 0] > s[1, 0]


def test_toyworld_coverage_is_won_by_flooding_the_canvas():
    """The reward-hacking lab's proxy: a correct render scores its objects' share of the canvas; the canvas flooded
    with the prompt's colour scores 1 (more than the render) and is wrong for the strict scorer; a black canvas 0."""
    from common.toyworld import render_batch, score

    prompt = "a photo of a red circle left of a blue square"
    rendered = (
        torch.from_numpy(np.asarray(render_batch([prompt], [0])))
        .float()
        .div(255)
        .permute(0, 3, 1, 2)
    )
    flood = torch.zeros_like(rendered)
    flood[:, 0] = 1  # all red
    s = build_reward("toyworld_coverage")(
        torch.cat([rendered, flood, torch.zeros_like(rendered)]), [prompt] * 3
    )
    share = ((rendered[0, 0] > 0.5) & (rendered[0, 1] < 0.5)).float().mean() + (
        (rendered[0, 2] > 0.5) & (rendered[0, 0] < 0.5) & (rendered[0, 1] < 0.5)
    ).float().mean()  # red + blue px
    assert torch.allclose(
        s[:, 0], torch.stack([share, torch.tensor(1.0), torch.tensor(0.0)]), atol=1e-6
    )
    assert 0.04 < share < 0.25
    assert score(torch.cat([rendered, flood]), [prompt] * 2)[1].tolist() == [True, False]
