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
    kills = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    t = time.time()
    with tempfile.TemporaryDirectory() as d:
        figures = kill_loop(os.path.join(d, "run"), kills, seed)
    print({**figures, "seconds": round(time.time() - t, 1)})
    assert figures["lost"] == 0
