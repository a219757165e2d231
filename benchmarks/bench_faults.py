"""The long randomised kill loop (not part of the suite): SIGKILL a saving process at random instants, many times.

    python benchmarks/bench_faults.py [KILLS] [SEED]      (default 500 kills, seed 0)

Prints the figures: kills, resumes, kills that landed inside a save, saves completed, lost iterations (must be 0).
"""

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the kill loop is the test suite's own, run longer

from test_faults import kill_loop  # noqa: E402

if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kills", nargs="?", type=int, default=500, help="SIGKILLs to send (default 500)")
    p.add_argument("seed", nargs="?", type=int, default=0, help="seed of the kill instants")
    args = p.parse_args()
    t = time.time()
    with tempfile.TemporaryDirectory() as d:
        figures = kill_loop(os.path.join(d, "run"), args.kills, args.seed)
    print({**figures, "seconds": round(time.time() - t, 1)})
    assert figures["lost"] == 0
