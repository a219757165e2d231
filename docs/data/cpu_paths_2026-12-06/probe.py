"""Which kernels compute torch's bf16 and fp16 on this CPU, and whether .ci/run's capped setting changes them
(issue #67). `python docs/data/cpu_paths_2026-12-06/probe.py`: for each setting a child
process computes the ops the tiny models use on fixed inputs and prints a digest of each output's bits, and the
oneDNN primitives it ran (ONEDNN_VERBOSE=1). A digest that differs from the native column's is another kernel:
another rounding or summation order. The output of 2026-12-06 is probe.txt beside this file."""

import hashlib
import os
import subprocess
import sys
from collections import Counter

SETTINGS = {
    "native": {},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "both (.ci/run)": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "default"},
}


def child() -> None:
    """The ops on fixed inputs (numpy's generator: torch's own may draw differently per kernel), one line each."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rng = np.random.RandomState(0)

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    a, b, x, w, q = t(128, 1024), t(1024, 128), t(2, 64, 32, 32), t(64, 64, 3, 3), t(1, 4, 64, 64)
    print("capability", torch.backends.cpu.get_cpu_capability())
    for dtype in (torch.bfloat16, torch.float16):
        a16, b16, x16, w16, q16 = (v.to(dtype) for v in (a, b, x, w, q))
        outputs = {
            "matmul": a16 @ b16,
            "conv2d": F.conv2d(x16, w16, padding=1),
            "softmax": torch.softmax(a16, -1),
            "layer_norm": F.layer_norm(a16, (1024,)),
            "gelu": F.gelu(a16, approximate="tanh"),
            "attention": F.scaled_dot_product_attention(q16, q16, q16),
        }
        for name, out in outputs.items():
            bits = out.float().numpy().tobytes()
            print("digest", f"{str(dtype)[6:]} {name}", hashlib.sha256(bits).hexdigest()[:8])


def main() -> None:
    flags = open("/proc/cpuinfo").read().split("\nflags")[1].split("\n")[0].split()
    model = open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t")
    isa = [
        f
        for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
        if f in flags
    ]
    print(f"CPU: {model}, {os.cpu_count()} cores; flags: {' '.join(isa)}")
    digests, primitives = {}, {}
    for label, env in SETTINGS.items():
        full = {**os.environ, **env, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, __file__, "--child"],
            env=full,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        digests[label] = {
            " ".join(ln.split()[1:-1]): ln.split()[-1] for ln in out if ln.startswith("digest")
        }
        digests[label]["ATen capability"] = next(
            ln.split()[1] for ln in out if ln.startswith("capability")
        )
        ran = Counter(
            f"{f[5]} {f[6]}"
            for f in (ln.split(",") for ln in out)
            if f[0] == "onednn_verbose" and f[3] == "exec"
        )
        primitives[label] = ", ".join(f"{k} ×{n}" for k, n in sorted(ran.items())) or "none"
    labels = list(SETTINGS)
    print("\n| output | " + " | ".join(labels) + " |\n|" + "---|" * (len(labels) + 1))
    for op, native in digests["native"].items():
        cells = [native] + [d[op] if d[op] != native else "=" for d in list(digests.values())[1:]]
        print(f"| {op} | " + " | ".join(cells) + " |")
    print("\noneDNN primitives run (ONEDNN_VERBOSE=1):")
    for label in labels:
        print(f"- {label}: {primitives[label]}")


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
