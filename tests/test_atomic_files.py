"""Every side file a run rewrites is replaced atomically (issue #38, class 2, first part): args.json, the metrics
truncated on resume, DenseGRPO's psi.json all go through common.plumbing.utils.atomic_write, and a metrics line cut by a kill
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

# One process pays the imports (torch, through common.plumbing.utils) once and forks a writer per round: each writer is a
# real process running atomic_write in a loop until it is SIGKILLed (a fresh interpreter per round cost 12 imports).
WRITERS = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from common.plumbing.utils import atomic_write
    print("ready", flush=True)
    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:  # the writer
            i = 0
            while True:
                i += 1
                atomic_write(sys.argv[1], chr(97 + i % 26) * 3_000_000)  # 3 MB of one letter: a torn file shows
        print(pid, flush=True)
        os.waitpid(pid, 0)  # until the test kills it
        print("dead", flush=True)
""")


def test_a_writer_killed_at_random_instants_leaves_a_whole_file(tmp_path):
    path = tmp_path / "side.json"
    path.write_text("a" * 3_000_000)
    rng = random.Random(0)
    server = subprocess.Popen(
        [sys.executable, "-c", WRITERS, str(path), ROOT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        for _ in range(12):
            server.stdin.write("go\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            assert server.stdout.readline().strip() == "dead"
            text = path.read_text()
            # the old file or the new one, never a mix or a cut
            assert len(text) == 3_000_000 and len(set(text)) == 1
    finally:
        server.kill()
        server.wait()
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
