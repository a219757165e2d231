"""Every side file a run rewrites is replaced atomically (issue #38, class 2, first part): args.json, the metrics
truncated on resume, DenseGRPO's psi.json all go through common.utils.atomic_write, and a metrics line cut by a kill
or a full disk no longer stops a resume. The helper is tested with the real mechanism: a writer SIGKILLed at random
instants."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

from helpers import ROOT, read_metrics, run_main, tiny_flags, write_prompts

WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from common.utils import atomic_write
    i = 0
    print("ready", flush=True)
    while True:
        i += 1
        atomic_write(sys.argv[1], chr(97 + i % 26) * 3_000_000)  # 3 MB of one letter: a torn file shows
""")


def test_a_writer_killed_at_random_instants_leaves_a_whole_file(tmp_path):
    path = tmp_path / "side.json"
    path.write_text("a" * 3_000_000)
    rng = random.Random(0)
    for _ in range(12):
        p = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), ROOT], stdout=subprocess.PIPE, text=True
        )
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        text = path.read_text()
        # the old file or the new one, never a mix or a cut
        assert len(text) == 3_000_000 and len(set(text)) == 1
    left = [n for n in os.listdir(tmp_path) if n != "side.json"]
    # only a killed writer's own temporary file remains
    assert all(n.startswith("side.tmp") and n.endswith(".json") for n in left)


def test_a_metrics_line_cut_mid_write_does_not_stop_a_resume(tiny_sd3, tmp_path):
    prompts = write_prompts(
        tmp_path / "p.txt", ["a photo of a red circle", "a photo of two blue squares"]
    )
    flags = tiny_flags(tiny_sd3, tmp_path, prompts)
    run_main("flowgrpo_baseline.py", *flags, "--num-iterations", "2")
    run = tmp_path / "run"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 2, "trajecto')  # a kill or a full disk in the middle of an append
    run_main("flowgrpo_baseline.py", *flags, "--num-iterations", "3", "--resume", str(run))
    assert [r["iteration"] for r in read_metrics(run)] == [0, 1, 2, 3]
