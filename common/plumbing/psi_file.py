"""DenseGRPO's psi.json: the calibrated psi(t) a run writes (with its picture, psi.png) and a later
run reads back with --psi-file or --resume, checked against that run's schedule before any model
loads. The calibration itself (Algorithm 1) is the algorithm's, in densegrpo.py."""

import json
import math
import os

import numpy as np
import torch

from common.plumbing.checkpoint import writing
from common.plumbing.checks import ConfigError, kind_of, read_json
from common.plumbing.plots import line_plot
from common.plumbing.utils import atomic_write


def load_psi(path: str, num_steps: int, psi_scale: str, sde_type: str = "sde") -> dict:
    """A psi.json written by save_psi, checked against this run's schedule and step type (psi means
    another noise)."""
    try:
        info = read_json(path)  # an object, not nested deeper than a psi.json is
        psi = info["psi"]
        if not isinstance(psi, list) or not psi:
            raise ValueError(f"its 'psi' is {kind_of(psi)}, not a list of numbers")
        psi = [float(p) for p in psi]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"--psi-file '{path}' is not a psi.json ({e.__class__.__name__}: {e}): expected JSON "
            "with a list 'psi' of one noise level per step, as a DenseGRPO run writes it; pass "
            "that file, or calibrate"
        ) from None
    if not all(math.isfinite(p) and p >= 0 for p in psi) or (sde_type == "cps" and max(psi) > 1):
        raise ConfigError(
            f"--psi-file '{path}': psi {psi} must be finite and >= 0 (at most 1 for --sde-type "
            "cps, where it is a in sin(a pi / 2)); pass a psi.json written by a DenseGRPO run, or "
            "calibrate"
        )
    have = len(psi), info.get("psi_scale"), info.get("sde_type", "sde")  # files before CPS: the SDE
    if have != (num_steps, psi_scale, sde_type):
        raise ConfigError(
            f"--psi-file '{path}' holds {have[0]} steps on the {have[1]} scale for --sde-type "
            f"{have[2]}; this run has --num-steps {num_steps}, --psi-scale {psi_scale} and "
            f"--sde-type {sde_type}: recalibrate or match"
        )
    return info


def save_psi(run_dir: str, info: dict, psi0: torch.Tensor, average: int) -> None:
    """psi.json (reused with --psi-file) and psi.png: psi(t) and the fraction of positive DeltaR_t
    in calibration. Both atomic; a full disk is one line."""
    T, last = len(info["psi"]), info["history"][-average:]
    ts = list(range(T, 0, -1))  # paper timestep of code step j
    series = {"psi(t) calibrated": (ts, info["psi"]), "psi(t) initial": (ts, psi0.tolist())}
    if last:
        # positive share of the nonzero DeltaR_t over the averaged iterations (None: none was nonzero)
        counts = [
            np.sum([[h["pos"][j], h["pos"][j] + h["neg"][j]] for h in last], 0) for j in range(T)
        ]
        frac = [float(p / n) if n else None for p, n in counts]
        series["positive fraction of nonzero dR"] = (ts, frac)
    with writing(run_dir):
        atomic_write(os.path.join(run_dir, "psi.json"), json.dumps(info, indent=1))
        png = os.path.join(run_dir, "psi.png")
        title = f"calibration, rule {info.get('balance_test')}"
        line_plot(series, png, "paper timestep t (T = first step)", "psi / fraction", title)
