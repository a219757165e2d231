"""Sign flips and a 1e-30 learning rate in copies of the repository; each script's learning test run on each."""

import json
import os
import re
import shutil
import subprocess
import sys

SRC = sys.argv[1]
OUT = sys.argv[2]


def lr_default(script):
    return (script, re.compile(r"(learning_rate: float = )[0-9.e-]+"), r"\g<1>1e-30")


CASES = {
    "flowgrpo_baseline": (
        "tests/test_flowgrpo_baseline.py::test_learning_on_the_toy_world",
        [
            (
                "rollout",
                "flowgrpo_baseline.py",
                "advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)",
                "advantages = -advantages.clamp(-args.adv_clip_max, args.adv_clip_max)",
            ),
            (
                "group_advantages",
                "common/rewards.py",
                "    return adv.float()",
                "    return -adv.float()",
            ),
            (
                "loss",
                "flowgrpo_baseline.py",
                "policy_loss = torch.maximum(-adv * ratio, -adv * clipped)",
                "policy_loss = torch.maximum(adv * ratio, adv * clipped)",
            ),
            (
                "lr 1e-30",
                "tests/test_flowgrpo_baseline.py",
                '"--eval-num-steps", "10", "--learning-rate", "1e-3"',
                '"--eval-num-steps", "10", "--learning-rate", "1e-30"',
            ),
        ],
    ),
    "g2rpo": (
        "tests/test_g2rpo.py::test_learning_on_the_toy_world",
        [
            (
                "rollout",
                "g2rpo.py",
                "advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)",
                "advantages = -advantages.clamp(-args.adv_clip_max, args.adv_clip_max)",
            ),
            (
                "mgai_advantages",
                "g2rpo.py",
                "    return advantage_mix(z.reshape(-1, z.shape[-1]), weights).view(z.shape[:-1])",
                "    return -advantage_mix(z.reshape(-1, z.shape[-1]), weights).view(z.shape[:-1])",
            ),
            (
                "loss",
                "g2rpo.py",
                "policy_loss = torch.maximum(-adv * ratio, -adv * clipped)",
                "policy_loss = torch.maximum(adv * ratio, adv * clipped)",
            ),
            ("lr 1e-30", None, "g2rpo.py", None),
        ],
    ),
    "densegrpo": (
        "tests/test_densegrpo.py::test_learning_on_the_toy_world",
        [
            (
                "rollout",
                "densegrpo.py",
                "advantages = advantages.clamp(-args.adv_clip_max, args.adv_clip_max)",
                "advantages = -advantages.clamp(-args.adv_clip_max, args.adv_clip_max)",
            ),
            (
                "per_step_advantages",
                "densegrpo.py",
                # the function itself since 2026-12-06 16:00 (its call became `adv(dR)`, a partial)
                "    return torch.stack(\n        [group_advantages(dR[:, j], group, global_std, eps)",
                "    return -torch.stack(\n        [group_advantages(dR[:, j], group, global_std, eps)",
            ),
            (
                "loss",
                "densegrpo.py",
                "policy_loss = torch.maximum(-adv * ratio, -adv * clipped)",
                "policy_loss = torch.maximum(adv * ratio, adv * clipped)",
            ),
            (
                "lr 1e-30",
                "tests/test_densegrpo.py",
                '"--eval-num-steps", "10", "--learning-rate", "1e-3"',
                '"--eval-num-steps", "10", "--learning-rate", "1e-30"',
            ),
        ],
    ),
    "diffusionnft": (
        "tests/test_diffusionnft.py::test_learning_on_the_toy_world",
        [
            (
                "rollout (1 - r)",
                "diffusionnft.py",
                "r = optimality_weight(advantages, args.adv_clip_max)  # (N2)",
                "r = 1 - optimality_weight(advantages, args.adv_clip_max)  # (N2)",
            ),
            (
                "optimality_weight",
                "diffusionnft.py",
                "    return (advantages / (2 * adv_clip_max) + 0.5).clamp(0, 1)",
                "    return (-advantages / (2 * adv_clip_max) + 0.5).clamp(0, 1)",
            ),
            (
                "loss (r, 1 - r swapped)",
                "diffusionnft.py",
                "args.adv_clip_max * (r * loss[0] + (1 - r) * loss[1])",
                "args.adv_clip_max * ((1 - r) * loss[0] + r * loss[1])",
            ),
            ("lr 1e-30", None, "diffusionnft.py", None),
        ],
    ),
    "awm": (
        "tests/test_awm.py::test_learning_on_the_toy_world",
        [
            (
                "rollout",
                "awm.py",
                "adv = advantage_weight(advantages, args.adv_clip_max, args.advantage_max)",
                "adv = -advantage_weight(advantages, args.adv_clip_max, args.advantage_max)",
            ),
            (
                "advantage_weight",
                "awm.py",
                "    return advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max",
                "    return -advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max",
            ),
            ("loss", "awm.py", "    policy_loss = -adv * lp", "    policy_loss = adv * lp"),
            ("lr 1e-30", None, "awm.py", None),
        ],
    ),
}
results = []
only = sys.argv[3:] or list(CASES)
for script in only:
    test, muts = CASES[script]
    skip = set(os.environ.get("SKIP", "").split(";"))
    for name, f, old, new in [("unflipped", None, None, None)] + muts:
        if f"{script}:{name}" in skip:
            continue
        d = os.path.join(OUT, f"{script}__{name.split()[0]}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(
            SRC, d, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "runs")
        )
        if name.startswith("lr") and f is None:  # the script's default learning rate
            p = os.path.join(d, old)
            t0 = open(p).read()
            t = re.sub(r"(learning_rate: float = )[0-9.e-]+", r"\g<1>1e-30", t0, count=1)
            if t == t0:  # a mutation that edits nothing would report its unflipped result
                raise SystemExit(f"{script} {name}: no learning_rate default to replace")
            open(p, "w").write(t)
        elif f:
            p = os.path.join(d, f)
            t0 = open(p).read()
            if old not in t0:
                raise SystemExit(f"{script} {name}: {old!r} is not in {f}")
            open(p, "w").write(t0.replace(old, new))
        tp = os.path.join(d, test.split("::")[0])
        ts = open(tp).read()
        open(tp, "w").write(
            ts.replace(
                "    assert end > start + ",
                '    print("GAIN", start, end)\n    assert end > start + ',
            )
        )
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "disabled",
        }
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-n", "0", "-q", "-s", "-p", "no:cacheprovider", test],
            cwd=d,
            env=env,
            capture_output=True,
            text=True,
        )
        m = re.findall(r"GAIN (-?[0-9.]+) (-?[0-9.]+)", r.stdout)
        passed = r.returncode == 0
        results.append(
            dict(
                script=script,
                case=name,
                passed=passed,
                numbers=m[-1] if m else None,
                tail=r.stdout.strip().splitlines()[-1],
            )
        )
        print(json.dumps(results[-1]), flush=True)
        shutil.rmtree(d, ignore_errors=True)
