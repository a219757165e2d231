"""Several training runs in ONE torchrun launch, for tests/test_parallel.py: each rank imports torch, diffusers and
peft once (most of a tiny run's time on 2 cores) and then runs the scripts in-process, one after the other, exactly
as `torchrun ... script.py FLAGS` would, except that the process group is made once and kept (gloo cannot be set up
again under the same torchrun rendezvous once it is torn down): the scripts' setup_distributed returns the live one
and their destroy_process_group is skipped until the last run; and the end-of-run pictures are not drawn
(matplotlib: most of a tiny run's time; tests/conftest.py skips them the same way).

    torchrun --nproc-per-node 2 tests/parallel_worker.py RUNS.json [--smooth-reward]

RUNS.json: a list of [script, flag, ...]; a run whose list starts with "RECORD" runs under a recorder of the device
type of every tensor that reaches a collective (`collective_devices` in its RESULT). --smooth-reward replaces the JPEG size behind the jpeg_* rewards by a smooth
stand-in (the mean difference of neighbouring pixels, in the same direction): comparing FSDP with DDP needs rewards
that move by 1e-7 when the weights do, and a JPEG's byte count jumps (it flips advantages, hence the updates). After each run every rank prints one line

    RESULT {"run": i, "rank": r, "digest": ..., "param_bytes": ..., "optimizer_bytes": ...}

with the run's sha256 of the whole trained weights (its `final weights` line) and the bytes THIS rank holds of the transformer's parameters
(trained and frozen: what DDP replicates and FSDP shards) and of the optimizer state.
"""

import contextlib
import io
import json
import os
import re
import runpy
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def local_bytes(tensors) -> int:
    """Bytes this rank stores: a DTensor's local shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


class Tee(io.TextIOBase):
    """stdout as it was, and a copy to read the run's `final weights` line from."""

    def __init__(self, out):
        self.out, self.copy = out, io.StringIO()

    def write(self, s):
        self.copy.write(s)
        return self.out.write(s)

    def flush(self):
        self.out.flush()


def smooth_jpeg_kb(images):
    return (images[..., 1:] - images[..., :-1]).abs().mean((1, 2, 3)) * 100


def collective_recorder(seen: set):
    """A dispatch mode that adds to `seen` the device type of every tensor handed to a collective: the
    process-group API's ops (c10d::allreduce_, allgather_, ...) and the functional ones DTensor's reductions use
    (_c10d_functional::all_reduce, ...), whatever Python or C++ code calls them."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                stack = [args, list((kwargs or {}).values())]
                while stack:
                    a = stack.pop()
                    if isinstance(a, torch.Tensor):
                        seen.add(a.device.type)
                    elif isinstance(a, (list, tuple)):
                        stack.extend(a)
            return func(*args, **(kwargs or {}))

    return Record()


def main(runs_file: str, smooth_reward: bool) -> None:
    import torch
    import torch.distributed as dist

    import common.plumbing.run
    import common.plumbing.utils
    import common.rewards

    if smooth_reward:
        common.rewards._jpeg_kb = smooth_jpeg_kb
    # as in tests/conftest.py: the pictures, most of a tiny run's time
    common.plumbing.run.run_pictures = lambda *a, **k: []

    with open(runs_file) as f:
        runs = json.load(f)
    rank, world_size, device = common.plumbing.utils.setup_distributed()
    import common.plumbing.harness  # the set-up calls setup_distributed by the name it imported

    keep = [
        mock.patch.object(
            common.plumbing.harness, "setup_distributed", lambda: (rank, world_size, device)
        ),
        mock.patch.object(dist, "destroy_process_group", lambda *a, **k: None),
    ]
    for i, run in enumerate(runs):
        seen, record = set(), run[0] == "RECORD"
        script, *flags = run[1:] if record else run
        tee = Tee(sys.stdout)
        with (
            mock.patch.object(sys, "argv", [script, *flags]),
            contextlib.redirect_stdout(tee),
            keep[0],
            keep[1],
            collective_recorder(seen) if record else contextlib.nullcontext(),
        ):
            g = runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        digest = re.findall(r"final weights: rank \d+ sha256 (\w+)", tee.copy.getvalue())[-1]
        state = [
            v
            for s in g["optimizer"].state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ]
        # one write: a line of its own
        sys.stdout.write(
            "RESULT "
            + json.dumps(
                {
                    "run": i,
                    "rank": g["h"].rank,
                    "digest": digest,
                    "param_bytes": local_bytes(g["h"].backbone.transformer.parameters()),
                    "optimizer_bytes": local_bytes(state),
                    **({"collective_devices": sorted(seen)} if record else {}),
                }
            )
            + "\n"
        )
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], "--smooth-reward" in sys.argv[2:])
