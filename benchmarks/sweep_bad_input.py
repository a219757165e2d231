"""Benchmark (not a test): a sweep of bad inputs over the four scripts, in one process, counting the clean ones.

    python benchmarks/sweep_bad_input.py            # every case of every script; one line per case, then a count

A case is clean when the script stops with one line that starts with "error:" (or tyro's usage error for a flag
that does not parse), no traceback, before any model is loaded, and writes nothing into its output folder. The
model load is replaced by a function that raises, so a case that reaches it is counted as late. A case that does
not end within CASE_S seconds is counted as hung (issue #68: reward servers that answer badly at the start-up
check, served from loopback by tests/hostile_server.py).
"""

import contextlib
import io
import os
import runpy
import sys
import tempfile
import threading
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
SCRIPTS = ("flowgrpo_baseline.py", "g2rpo.py", "densegrpo.py", "diffusionnft.py")
CASE_S = 30
HUGE = "99999999999999999999"
# issue #68: what a reward server answers to the start-up check (GET /health), raw; (reply, seconds between bytes)
HEALTH = '{"protocol": "flow-rl-reward/1", "scorers": ["stub"]}'
HOSTILE = {
    "health 100,000 deep": ("[" * 100_000, 0),
    "health redirected": ("", 0, "301 Moved Permanently", "Location: http://127.0.0.1:1/\r\n"),
    "health with Content-Length abc": (HEALTH, 0, "200 OK", "Content-Length: abc\r\n"),
    "health trickled a byte every 50 ms": (HEALTH, 0.05),
}


@contextlib.contextmanager
def hostile_servers():
    """{case name: the URL of a loopback server answering as HOSTILE says}, while the sweep runs."""
    from hostile_server import http_reply, scripted

    with contextlib.ExitStack() as stack:
        urls = {}
        for name, (text, trickle_s, *status) in HOSTILE.items():
            reply = http_reply(text.encode(), *status)
            urls[name] = stack.enter_context(scripted(reply, trickle_s))[0]
        yield urls


def issue_68(urls: dict) -> list[tuple[str, list[str]]]:
    """The cases of issue #68 every script shares: sizes past what a run holds (a traceback after the model
    loaded), a remote reward's options, and reward servers (`urls`, from hostile_servers) that answer the start-up
    check badly."""
    return [
        ("decode batch of 10**20 images", ["--decode-batch-size", HUGE]),
        (
            "decode batch past every batch decoded",
            ["--decode-batch-size", "65", "--eval-batch-size", "64"],
        ),
        ("training batch of 10**20", ["--train-batch-size", HUGE]),
        ("evaluation batch of 10**20", ["--eval-batch-size", HUGE]),
        ("rollout batch of 10**20", ["--rollout-batch-size", HUGE]),
        ("10**20 denoising steps", ["--num-steps", HUGE]),
        ("10**20 evaluation steps", ["--eval-num-steps", HUGE]),
        ("remote timeout 1e300", ["--reward", "remote:g@http://127.0.0.1:1?timeout=1e300"]),
        ("remote backoff 1e300", ["--reward", "remote:g@http://127.0.0.1:1?backoff=1e300"]),
        ("remote timeout nan", ["--reward", "remote:g@http://127.0.0.1:1?timeout=nan"]),
        ("remote retries 10**9", ["--reward", f"remote:g@http://127.0.0.1:1?retries={10**9}"]),
        (
            "remote budget past an hour",
            ["--reward", "remote:g@http://127.0.0.1:1?timeout=900&retries=4"],
        ),
        ("remote port 99999", ["--reward", "remote:g@http://127.0.0.1:99999"]),
        *[
            (f"remote server: {name}", ["--reward", f"remote:stub@{url}?timeout=1"])
            for name, url in urls.items()
        ],
    ]


OWN_68 = {
    "densegrpo.py": [("10**20 calibration trajectories", ["--calibration-trajectories", HUGE])]
}


def cases(tmp: str, urls: dict | None = None) -> list[tuple[str, list[str]]]:
    empty = os.path.join(tmp, "empty.txt")
    open(empty, "w").close()
    a_file = os.path.join(tmp, "a_file")
    open(a_file, "w").write("x")
    # issue #57: files too large or of the wrong shape, and folders a resume must not guess about
    huge = os.path.join(tmp, "huge_prompt.txt")
    open(huge, "w").write("a photo of a red circle\n" + "x" * 10_000_000 + "\n")
    deep = os.path.join(tmp, "deep.json")
    open(deep, "w").write("[" * 200_000 + "]" * 200_000)

    def folder(name, files):
        path = os.path.join(tmp, name)
        for rel, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
            open(os.path.join(path, rel), "w").write(text)
        return path

    leading_zero = folder("leading_zero", {"args.json": "{}", "checkpoint-02/COMPLETE.json": "{}"})
    args_list = folder("args_list", {"args.json": "[1, 2]"})
    args_deep = folder("args_deep", {"args.json": "[" * 200_000})
    other_script = folder("other_script", {"args.json": '{"script": "someone_else.py"}'})
    common = [
        ("negative iterations", ["--num-iterations", "-1"]),
        ("nan learning rate", ["--learning-rate", "nan"]),
        ("negative seed", ["--seed", "-5"]),
        ("seed past 32 bits", ["--seed", str(2**32)]),
        ("run name with a path", ["--run-name", "../x"]),
        ("run name '.'", ["--run-name", "."]),
        ("resume of nothing", ["--resume", os.path.join(tmp, "nothing")]),
        ("resume of a file", ["--resume", a_file]),
        ("reward weight 0", ["--reward", "toyworld:0"]),
        ("empty reward", ["--reward", ""]),
        ("unknown reward", ["--reward", "nonsense"]),
        ("T5 length past the model", ["--max-sequence-length", "100000"]),
        ("LoRA rank 0", ["--lora-rank", "0"]),
        ("LoRA rank past the layers", ["--lora-rank", "100000"]),
        ("missing prompt file", ["--prompts-file", os.path.join(tmp, "none.txt")]),
        ("empty evaluation prompts", ["--eval-prompts", empty]),
        ("model path not a model", ["--model-path", tmp]),
        ("resolution not a multiple", ["--resolution", "33"]),
        ("negative guidance", ["--guidance-scale", "-1"]),
        ("zero group size", ["--group-size", "1"]),
        ("inf max grad norm", ["--max-grad-norm", "-inf"]),
        ("a derived value as a flag", ["--world-size", "2"]),
        ("unknown flag", ["--learning-rat", "1e-3"]),
        ("evaluation of 400 million images", ["--eval-seeds-per-prompt", "200000000"]),
        ("a 10 MB prompt line", ["--eval-prompts", huge]),
        ("run name with a newline", ["--run-name", "two\nlines"]),
        ("wandb project name with a slash", ["--track", "--wandb-project-name", "team/project"]),
        ("resume beside checkpoint-02", ["--resume", leading_zero]),
        ("resume with args.json a list", ["--resume", args_list]),
        ("resume with args.json 200k deep", ["--resume", args_deep]),
        ("resume of another script's folder", ["--resume", other_script]),
        *issue_68(urls or {}),
    ]
    own = {
        "diffusionnft.py": [
            ("beta 0", ["--nft-beta", "0"]),
            ("negative KL weight", ["--kl-weight", "-1"]),
            ("no trained timestep", ["--timestep-fraction", "0.01"]),
            ("unknown decay schedule", ["--old-decay-schedule", "bogus"]),
        ],
        "densegrpo.py": [
            ("psi file a folder", ["--psi-file", tmp]),
            ("psi file 200k deep", ["--psi-file", deep]),
            ("zero completion steps", ["--completion-steps", "0"]),
        ],
        "g2rpo.py": [
            ("branch step listed twice", ["--branch-steps", "0", "0"]),
            ("granularity 0", ["--granularities", "0"]),
        ],
        "flowgrpo_baseline.py": [
            ("window without size", ["--sde-window-range", "0", "3"]),
            ("clip range 1", ["--clip-range", "1"]),
        ],
    }
    return [
        (s, name, flags) for s in SCRIPTS for name, flags in common + own[s] + OWN_68.get(s, [])
    ]


def run_case(script: str, flags: list[str], out: str) -> tuple[bool, str]:
    """(clean?, the first line it printed on stderr or its exit message); a case still running after CASE_S is not
    clean (it is left running in a daemon thread)."""
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(r=_run_case(script, flags, out)), daemon=True
    )
    thread.start()
    thread.join(CASE_S)
    return box.get("r", (False, f"hung: still running after {CASE_S} s"))


def _run_case(script: str, flags: list[str], out: str) -> tuple[bool, str]:
    import common.plumbing.harness

    def no_load(*a, **k):
        raise RuntimeError("the model was loaded before the bad input was refused")

    err = io.StringIO()
    argv = [script, "--output-dir", out, *flags]
    with (
        mock.patch.object(sys, "argv", argv),
        mock.patch.object(common.plumbing.harness, "load_backbone", no_load),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
            return False, "ran to the end"
        except SystemExit as e:
            msg = e.code if isinstance(e.code, str) else err.getvalue().strip().splitlines()[-1:]
            msg = msg if isinstance(msg, str) else (msg[0] if msg else f"exit {e.code}")
        except Exception as e:  # noqa: BLE001 - a traceback is what the sweep counts
            return False, f"{e.__class__.__name__}: {e}"
    written = os.listdir(out) if os.path.isdir(out) else []
    one_line = "\n" not in msg.strip() and "Traceback" not in err.getvalue()
    usage = ("Unrecognized", "Invalid choice")  # tyro's one box for a flag that does not parse
    parsed = msg.startswith("error:") or any(u in err.getvalue() for u in usage)
    return one_line and parsed and not written, msg.strip()[:150]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, hostile_servers() as urls:
        results = []
        for k, (script, name, flags) in enumerate(cases(tmp, urls)):
            clean, msg = run_case(script, flags, os.path.join(tmp, f"out{k}"))
            results.append(clean)
            print(f"{'clean' if clean else 'NOT CLEAN'}  {script}  {name}: {msg}", flush=True)
        print(f"{sum(results)} of {len(results)} cases clean")


if __name__ == "__main__":
    main()
