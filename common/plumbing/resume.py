"""Loading a checkpoint back: trainer_state.pt with torch.load(weights_only=True), checked against
its marker before anything is restored, then restored exactly, whole (DDP) or by shard (FSDP2).
`python -m common.plumbing.resume --convert-trusted FOLDER` converts one from before 2026-12-05."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re

import torch

from common.plumbing.checkpoint import (
    MARKER,
    PREFIX,
    SHARDED_DIR,
    STATE_FILE,
    _first_line,
    _is_count,
    _listdir,
    _plain_numpy_state,
    _sha256,
    read_marker,
    set_rng_state,
    trainer_state,
    verify_checkpoint,
)
from common.plumbing.checks import ConfigError, pickled_global
from common.plumbing.parallel import is_sharded
from common.plumbing.run_folder import hold_run_folder, release_run_folder
from common.plumbing.utils import atomic_file, atomic_write


def load_checkpoint(folder: str) -> dict:
    """trainer_state.pt via torch.load(weights_only=True): only tensors and plain values, never an
    object whose unpickling could run code, so a received run folder is safe to --resume."""
    path = os.path.join(folder, STATE_FILE)

    def unreadable(e):
        return ConfigError(
            f"--resume: {path} is unreadable ({e.__class__.__name__}: {_first_line(e)}); resume "
            "from an older checkpoint-N folder"
        )

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if pickled_global(e) is None:  # not a checkpoint at all
            raise unreadable(e) from None
        # weights_only refused a global: a checkpoint from before 2026-12-05 (numpy's RNG state
        # pickled as an ndarray), or a file built to run code; both are refused unloaded
        raise ConfigError(
            f"--resume: {path} holds Python objects ({pickled_global(e)}) "
            "that only pickle restores, and unpickling a file can run code, so it was not loaded; "
            "a checkpoint this project wrote before 2026-12-05 is like that: if you trust where it "
            f"came from, convert it once with `python -m common.plumbing.resume --convert-trusted "
            f"{folder}`, else start a new run"
        ) from None
    except Exception as e:  # noqa: BLE001 - any unreadable zip is the same fault for the user
        raise unreadable(e) from None


def _refuse_layout(folder: str, state) -> None:
    problem = trainer_state_problem(state)
    if problem:
        raise ConfigError(
            f"--resume: {os.path.join(folder, STATE_FILE)} is not a trainer state this code wrote "
            f"({problem}); resume from an older checkpoint-N folder, or start a new run"
        )


def _refuse_disagreement(folder: str, state: dict) -> None:
    """The iteration agrees with COMPLETE.json and the folder's name (a re-sealed iteration 10**18
    would end the run at once, "finished"); counters and clocks are finite counts >= 0."""
    marker = read_marker(folder)
    named = re.fullmatch(rf"\.?{PREFIX}(\d+)", os.path.basename(folder.rstrip("/")))
    says = {"its COMPLETE.json": marker["iteration"]}
    if named:
        says["its folder's name"] = int(named.group(1))
    wrong = [f"{where} says {n}" for where, n in says.items() if n != state["iteration"]]
    for field in ("script", "args"):
        ours = json.dumps(state.get(field), default=str, sort_keys=True)
        theirs = json.dumps(marker.get(field), sort_keys=True)
        if field in state and marker.get(field) is not None and ours != theirs:
            wrong.append(f"its '{field}' differs from its COMPLETE.json's")
    numbers = [*state.get("counts", {}).items(), *state.get("clocks", {}).items()]
    wrong += [
        f"its '{k}' is {v if abs(v) < 1e30 else 'out of range'}"
        for k, v in numbers
        if isinstance(v, bool) or v < 0 or not (isinstance(v, int) or math.isfinite(v))
    ]
    if wrong:
        iteration = state["iteration"]
        shown = iteration if iteration < 2**63 else f"an integer of {iteration.bit_length()} bits"
        raise ConfigError(
            f"--resume {folder}: its {STATE_FILE} (iteration {shown}) does not agree with its "
            f"checkpoint: {'; '.join(wrong)}; it was changed after it was saved: resume from "
            "another checkpoint-N folder, or start a new run"
        )


def trainer_state_problem(state) -> str | None:
    """What is wrong with a loaded trainer state's types (None: nothing), before the restore relies
    on them; shapes are checked against the model during the restore."""
    if not isinstance(state, dict):
        return f"{type(state).__name__}, not a dict"
    if not _is_count(state.get("iteration")):
        return "its 'iteration' is not an integer >= 0"
    for field in ("counts", "clocks"):
        numbers = state.get(field, {})
        if not isinstance(numbers, dict) or not all(
            isinstance(v, (int, float)) for v in numbers.values()
        ):
            return f"its '{field}' are not a dict of numbers"
    rngs = state.get("rng")
    if not isinstance(rngs, list) or not rngs or not all(_rng_ok(r) for r in rngs):
        return "its 'rng' is not a list of RNG states (python, numpy, torch)"
    whole = "sharded_state" not in state
    if whole and not _tensor_dict(state.get("params")):
        return "its 'params' are not a dict of tensors"
    optim = state.get("optimizer")
    if whole and not (
        isinstance(optim, dict)
        and isinstance(optim.get("state"), dict)
        and isinstance(optim.get("param_groups"), list)
        and all(isinstance(v, dict) for v in optim["state"].values())
        and all(
            isinstance(g, dict)
            and isinstance(g.get("params"), list)
            and all(_is_count(i) for i in g["params"])
            for g in optim["param_groups"]
        )
    ):
        return "its 'optimizer' is not an optimizer state_dict (state, param_groups)"
    for name, ema in [("ema", state.get("ema")), *(state.get("extras") or {}).items()]:
        if ema is None and name == "ema":
            continue
        if not (isinstance(ema, dict) and _is_count(ema.get("steps"))):
            return f"its '{name}' is not an EMA state (shadow, steps)"
        if whole and not _tensor_dict(ema.get("shadow")):
            return f"its '{name}' shadow is not a dict of tensors"
    if not isinstance(state.get("extras", {}), dict):
        return "its 'extras' are not a dict"
    return None


def _tensor_dict(d) -> bool:
    return isinstance(d, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items()
    )


def _rng_ok(r) -> bool:
    """One rank's RNG state as rng_state writes it (random.setstate and numpy check the values)."""
    r = r if isinstance(r, dict) else {}
    py, n = r.get("python"), r.get("numpy")
    return (
        isinstance(py, tuple)
        and len(py) == 3
        and isinstance(py[1], tuple)
        and isinstance(n, dict)
        and isinstance(n.get("keys"), torch.Tensor)
        and n["keys"].shape == (624,)
        and isinstance(r.get("torch"), torch.Tensor)
        and r["torch"].dtype == torch.uint8
    )


def _check_tensors(folder: str, what: str, saved: dict, expected: dict) -> None:
    """Every tensor of `expected` is in `saved` with its shape (copy_ would broadcast a (1,)
    tensor into a whole weight without a word)."""
    for n, p in expected.items():
        got = saved.get(n)
        if got is None or tuple(got.shape) != tuple(p.shape):
            shown = "missing" if got is None else f"of shape {tuple(got.shape)}"
            raise ConfigError(
                f"--resume {folder}: {what} {n} is {shown} in the checkpoint, the model has "
                f"{tuple(p.shape)}: resume with the model and LoRA flags it was trained with"
            )


def _check_optimizer(folder: str, saved: dict, optimizer) -> None:
    """As many groups and parameters, and every per-parameter tensor (Adam's moments) of its
    parameter's shape (load_state_dict checks only the counts, with a traceback)."""
    now = optimizer.param_groups
    sizes = [len(g["params"]) for g in now]
    got = [len(g["params"]) for g in saved["param_groups"]]  # (trainer_state_problem checked them)
    if got != sizes:
        raise ConfigError(
            f"--resume {folder}: its optimizer state has parameter groups of {got} parameters, "
            f"this optimizer {sizes}: resume with the flags it was trained with"
        )
    params = [p for g in now for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    for index, p in zip(ids, params):
        for key, v in (saved["state"].get(index) or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise ConfigError(
                    f"--resume {folder}: its optimizer's {key} of parameter {index} has shape "
                    f"{tuple(v.shape)}, the parameter {tuple(p.shape)}: resume with the flags it "
                    "was trained with"
                )


def convert_trusted(folder: str) -> None:
    """Rewrite a checkpoint-N's trainer_state.pt written before 2026-12-05 (numpy's RNG state
    pickled as an ndarray) into the form `load_checkpoint` reads, and re-seal its marker. It
    unpickles the file: only for a file you trust. It holds the run's lock and refuses links."""
    folder = os.path.normpath(os.path.abspath(folder))
    run_dir, name = os.path.split(folder)
    if not re.fullmatch(rf"{PREFIX}\d+", name):
        raise SystemExit(
            f"error: {folder} is not a checkpoint-N folder: --convert-trusted takes a run's "
            "checkpoint folder, e.g. runs/r/checkpoint-20; nothing was converted"
        )
    if not os.path.lexists(folder):
        raise SystemExit(f"error: {folder} does not exist; nothing was converted")
    hold_run_folder(run_dir)  # one line if a run holds it, or if it holds a link
    try:
        problem = verify_checkpoint(folder)
        if problem:
            raise SystemExit(f"error: {problem}; nothing was converted")
        path = os.path.join(folder, STATE_FILE)
        with contextlib.suppress(Exception):  # else converted below (the user trusts it)
            torch.load(path, weights_only=True, map_location="cpu")
            print(f"{path} already loads with weights_only=True: left as it is")
            return
        state = torch.load(path, weights_only=False, map_location="cpu")  # the user trusts it
        for r in state.get("rng") or []:
            if isinstance(r.get("numpy"), tuple):  # (kind, keys ndarray, pos, has_gauss, cached)
                r["numpy"] = _plain_numpy_state(r["numpy"])
        atomic_file(path, lambda tmp: torch.save(state, tmp))
        marker = read_marker(folder)
        marker["files"][STATE_FILE] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
        atomic_write(os.path.join(folder, MARKER), json.dumps(marker, indent=1))
        load_checkpoint(folder)  # what a resume will do: it must load now
        print(f"converted {path}: it loads with weights_only=True")
    finally:
        release_run_folder(run_dir)


def restore_checkpoint(
    folder: str,
    rank: int,
    params: dict,
    optimizer,
    ema,
    model=None,
    extras: dict | None = None,
    scaler=None,
) -> tuple[int, dict]:
    """Load a verified checkpoint into params, optimizer, EMA, extras, fp16's loss scaler and this
    rank's RNG, in place; returns (iteration, counts + clocks + skips_in_a_row). FSDP (DTensor
    `params`, `model` the sharded transformer): every rank reads its shards (a collective)."""
    state = load_checkpoint(folder)
    if not isinstance(state, dict):
        _refuse_layout(folder, state)
    saved_as = "fsdp" if "sharded_state" in state else "ddp"
    now = "fsdp" if is_sharded(params) else "ddp"
    if saved_as != now:
        raise ConfigError(
            f"--resume {folder} was saved with --parallel {saved_as} and this run has --parallel "
            f"{now}; their trainer states are laid out differently: resume it with --parallel "
            f"{saved_as}"
        )
    extras = extras or {}
    missing = sorted(set(extras) - set(state.get("extras") or {}))
    if missing:
        raise ConfigError(
            f"--resume {folder} holds no {', '.join(missing)} (a checkpoint of another script or "
            "an older one): resume it with the script that wrote it, or start a new run"
        )
    _refuse_layout(folder, state)  # (a checkpoint of another script is named as such above)
    _refuse_disagreement(folder, state)
    scaling = loss_scaling_state(folder, state)  # checked before anything is copied in
    had_ema = ema is not None and state.get("ema") is not None
    if now == "fsdp":
        _restore_sharded(folder, state, params, optimizer, ema if had_ema else None, model, extras)
    else:
        _restore_whole(folder, state, params, optimizer, ema if had_ema else None, extras)
    if ema is not None and not had_ema:
        # the EMA starts now (--resume-override of a run without one): from the resumed weights
        for n in ema.shadow:
            ema.shadow[n].copy_(params[n].detach())
    if scaler is not None and scaler.is_enabled() and scaling.get("scaler"):
        scaler.load_state_dict(scaling["scaler"])
    rngs = state["rng"]
    try:  # fewer ranks saved: only with --resume-override
        set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise ConfigError(
            f"--resume {folder}: its RNG state is not one this code wrote ({e.__class__.__name__}: "
            f"{_first_line(e)}); resume from an older checkpoint"
        ) from None
    # only the counts are reproduced exactly (a resume replays the iterations after the
    # checkpoint); checkpoints before 2026-12-03 have no clocks
    skips = {"skips_in_a_row": int(scaling.get("skips_in_a_row", 0))}
    return state["iteration"], {**state["counts"], **state.get("clocks", {}), **skips}


def loss_scaling_state(folder: str, state: dict) -> dict:
    """fp16's loss scaler state and its skips in a row, checked (plain numbers only): {} for a
    checkpoint from before 2026-12-05, when no run scaled its loss."""
    scaling = state.get("loss_scaling") or {}
    scaler = scaling.get("scaler", {}) if isinstance(scaling, dict) else None
    skips = scaling.get("skips_in_a_row", 0) if isinstance(scaling, dict) else None
    numbers = isinstance(scaler, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for v in scaler.values()
    )
    if not numbers or not _is_count(skips):
        raise ConfigError(
            f"--resume {folder}: its loss_scaling state is not one this code wrote (expected "
            "plain numbers: the scaler's scale and growth tracker, the skips in a row); resume "
            "from an older checkpoint"
        )
    return scaling


def _emas(state: dict, ema, extras: dict) -> list[tuple[str, object, dict]]:
    """(label, object, saved state) of the EMA (None: none saved) and every extra."""
    found = [("EMA", ema, state["ema"])] if ema is not None else []
    return found + [(k, x, state["extras"][k]) for k, x in extras.items()]


def _restore_whole(folder: str, state: dict, params: dict, optimizer, ema, extras: dict) -> None:
    """Everything is checked against the model before any of it is copied in, so a refused
    checkpoint leaves the model as it was."""
    _check_tensors(folder, "trained weight", state["params"], params)
    _check_optimizer(folder, state["optimizer"], optimizer)
    for label, x, saved in _emas(state, ema, extras):
        _check_tensors(folder, f"{label} weight", saved["shadow"], x.shadow)
    for n, p in params.items():
        p.data.copy_(state["params"][n])
    optimizer.load_state_dict(state["optimizer"])
    for _, x, saved in _emas(state, ema, extras):
        x.load_state_dict(saved)


def _restore_sharded(folder: str, state: dict, params: dict, optimizer, ema, model, extras) -> None:
    """dcp.load fills this rank's shards in place (the layout `trainer_state` saves), and
    set_state_dict hands the optimizer state back by parameter name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    box = trainer_state(params, optimizer, ema, model, extras)["sharded"]
    check_sharded_metadata(os.path.join(folder, SHARDED_DIR))
    try:
        dcp.load(box, checkpoint_id=os.path.join(folder, SHARDED_DIR))
    except Exception as e:  # noqa: BLE001 - a missing key or shape is the same fault for the user
        raise ConfigError(
            f"--resume {folder}: its sharded trainer state does not fit this model "
            f"({_first_line(e, 200, e.__class__.__name__)}): resume with the model and LoRA flags "
            "it was trained with"
        ) from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=box["model"],
        optim_state_dict=box["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    for _, x, saved in _emas(state, ema, extras):  # dcp.load filled their shadows in place
        x.steps = saved["steps"]


# torch.distributed.checkpoint reads its .metadata with plain pickle.load, which would run whatever
# a received file asks for: it is first read here by an unpickler that builds only what a metadata
# file holds (the classes of torch.distributed.checkpoint's metadata, torch.Size, dtypes, paths).
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout")}
_DCP_GLOBALS |= {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath")}


def check_sharded_metadata(dcp_dir: str) -> None:
    """Every *.metadata file of a trainer_state.dcp/ folder unpickles with the allow-list above;
    anything else is refused in one line before torch.distributed.checkpoint opens it."""

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _DCP_GLOBALS:
                return super().find_class(module, name)
            if module in _DCP_MODULES or module == "torch":
                obj = super().find_class(module, name)
                if isinstance(obj, torch.dtype if module == "torch" else type):
                    return obj
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")

    for name in sorted(n for n in _listdir(dcp_dir) if n.endswith(".metadata")):
        path = os.path.join(dcp_dir, name)
        try:
            with open(path, "rb") as f:
                Restricted(f).load()
        except Exception as e:  # noqa: BLE001 - whatever it is, it is not loaded
            raise ConfigError(
                f"--resume: {path} is not a torch.distributed.checkpoint metadata file "
                f"({e.__class__.__name__}: {_first_line(e)}); it was not loaded (unpickling it "
                "could run code): resume from an older checkpoint"
            ) from None


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=convert_trusted.__doc__)
    ap.add_argument("--convert-trusted", metavar="CHECKPOINT_FOLDER", required=True)
    convert_trusted(ap.parse_args().convert_trusted)
