"""Processes that tests/test_faults.py (and bench_faults.py) start and then break on purpose.

python tests/fault_worker.py dist die|hang     (under torchrun, 2 ranks) all-reduce in a loop; at step 3 rank 1
                                               SIGKILLs itself (die) or stops taking part (hang)
python tests/fault_worker.py save RUN_DIR N    save a tiny checkpoint for iterations N+1, N+2, ... forever,
                                               printing each iteration once its save has returned
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def tiny_state(iteration: int) -> dict:
    g = torch.Generator().manual_seed(iteration)
    return {
        "params": {"w": torch.randn(128, 128, generator=g)},
        "optimizer": {},
        "ema": None,
        "iteration": iteration,
        "nfe": 10 * iteration,
        "rng": [],
        "args": {"seed": 1, "group_size": 2},
        "script": "fault_worker.py",
    }


def tiny_weights(iteration: int):
    def save(folder):
        with open(os.path.join(folder, "pytorch_lora_weights.safetensors"), "wb") as f:
            f.write(bytes([iteration % 256]) * 40_000)

    return save


def save_loop(run_dir: str, start: int, report=None, keep: int = 2) -> None:
    """Save iterations start+1, start+2, ... forever; report(i) after save i has returned."""
    from common.plumbing.checkpoint import save_checkpoint

    i = start
    while True:
        i += 1
        save_checkpoint(run_dir, tiny_state(i), tiny_weights(i), keep)
        if report:
            report(i)


def dist_main(mode: str) -> None:
    from common.plumbing.utils import setup_distributed

    rank, world, _ = setup_distributed()
    for step in range(1000):
        if rank == 1 and step == 3:
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # hang: alive, but never joins the next collective
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        time.sleep(0.02)


if __name__ == "__main__":
    if sys.argv[1] == "dist":
        dist_main(sys.argv[2])
    else:
        save_loop(sys.argv[2], int(sys.argv[3]), report=lambda i: print(i, flush=True))
