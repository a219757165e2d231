"""Rewards from a server (common/plumbing/remote_reward.py, common/plumbing/reward_server.py): the spelling, the start-up check, every
fault with a real server process on loopback (tests/reward_stub.py), flow_grpo's wire format and a reply that would
run code, a wrapped scorer, the overlap, and the scripts: a served reward gives the in-process run's numbers and
weights, and a run stopped by a dying server resumes to them exactly."""

import base64
import contextlib
import io
import json
import os
import pickle
import re
import resource
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, read_metrics, run_main, script_env, write_prompts
from hostile_server import cyclic_pickle, http_reply, memo_bomb, scripted, shared_pickle
from PIL import Image
from reward_stub import brightness_of

import common.plumbing.harness
from common.plumbing.checks import ConfigError
from common.plumbing.remote_reward import RemoteReward, parse_remote
from common.plumbing.reward_flags import (
    build_reward,
    check_rewards,
    parse_model_paths,
    parse_reward_spec,
)
from common.plumbing.safe_decode import safe_unpickle

STUB = os.path.join(ROOT, "tests", "reward_stub.py")
PROMPTS = ["a photo of a red circle", "a photo of two blue squares", "a photo of a green triangle"]
FAST = "?timeout=5&retries=1&backoff=0.05"  # faults end in a second, not in the defaults' minute
# the project's server wrapping the stand-in scorer (the mean brightness, plus the metadata's bonus)
BRIGHT = [
    "-m",
    "common.plumbing.reward_server",
    "--scorer",
    "bright=tests.reward_stub:brightness",
    "--port",
    "0",
]


@contextlib.contextmanager
def server(*cmd, env=None, wait_s=60, max_bytes=None):
    """A server process on loopback; yields (its URL, the process). Killed on exit. max_bytes: its address space
    (RLIMIT_AS), so that a server that would exhaust the machine fails instead."""
    err = open(os.devnull, "w")
    limit = (
        (lambda: resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes)))
        if max_bytes
        else None
    )
    proc = subprocess.Popen(
        [sys.executable, *cmd],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        cwd=ROOT,
        env={**script_env(), **(env or {})},
        preexec_fn=limit,
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(wait_s) else ""
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, f"the server did not start: {cmd} printed {line!r}"
        yield url[0], proc
    finally:
        proc.kill()
        proc.wait()
        err.close()


def stub(mode, *args, env=None):
    return server(STUB, mode, *args, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def images(n=3, size=16, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def brightness(x, fmt="PNG"):
    """What the stub scores: the mean of the 8-bit image, after the wire format's round trip."""
    out = []
    for a in (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format=fmt)
        out.append(brightness_of(Image.open(io.BytesIO(buf.getvalue()))))
    return torch.tensor(out, dtype=torch.float32)


def one_line(e) -> str:
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def stub_log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# ============================================================ the spelling
def test_spelling_mixes_with_local_rewards_and_bad_ones_are_one_line():
    assert parse_reward_spec("toyworld:0.5, remote:geneval@http://127.0.0.1:8000:2") == [
        ("toyworld", 0.5),
        ("remote:geneval@http://127.0.0.1:8000", 2.0),
    ]
    spec, weight = parse_remote("remote:ocr@flowgrpo+http://[::1]:18085/x?timeout=30&retries=0")
    assert (spec.scorer, spec.url, spec.wire, spec.timeout, spec.retries, spec.backoff) == (
        "ocr",
        "http://[::1]:18085/x",
        "flowgrpo",
        30.0,
        0,
        1.0,
    )
    assert weight is None and spec.name == "remote:ocr"
    assert parse_model_paths("remote:geneval=/data/m.jsonl") == {"remote:geneval": "/data/m.jsonl"}
    for bad, said in [
        ("remote:geneval@http://127.0.0.1", "the port is required"),
        ("remote:g@ftp://h:1", "the port is required"),
        ("remote:g@http://h:1?tmeout=3", "bad option 'tmeout'"),
        ("remote:g@http://h:1?timeout=0", "bad timeout=0"),
        ("remote:g@http://h:1?retries=-1", "bad retries=-1"),
        ("remote:g@http://h:1:abc", "bad weight 'abc'"),
        ("remote:g@http://h:1,remote:g@http://h:2", "reward 'remote:g' appears twice"),
    ]:
        with pytest.raises(ValueError, match=re.escape(said)) as e:
            parse_reward_spec(bad)
        assert "\n" not in str(e.value)


# ============================================================ the start-up check
@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(common.plumbing.harness, "load_backbone", refuse)  # the name setup() calls


def test_a_server_down_at_start_is_one_line_in_seconds_before_the_model_loads(
    tmp_path, no_model_load
):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:2])
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        run_main(
            "flowgrpo_baseline.py",
            *("--output-dir", str(tmp_path), "--prompts-file", prompts, "--eval-prompts", prompts),
            *("--reward", f"remote:toyworld@{url}"),
        )
    assert one_line(e) == (
        f"error: remote reward 'remote:toyworld' at {url}: no server answers (ConnectionRefusedError: "
        "Connection refused): start it (e.g. `python -m common.plumbing.reward_server --reward toyworld --port "
        "8000`) or fix the URL in --reward"
    )
    assert time.monotonic() - start < 10 and os.listdir(tmp_path) == ["p.txt"]  # no run folder yet


def test_the_start_up_check_names_what_the_server_serves_and_what_is_missing(tmp_path):
    meta = tmp_path / "meta.jsonl"
    meta.write_text(json.dumps({"prompt": PROMPTS[0], "tag": "single_object"}) + "\n")
    files = {"--prompts-file": PROMPTS[:1], "--eval-prompts": PROMPTS[:2]}
    with stub("ok") as (url, _):
        check_rewards(f"remote:stub@{url}", "", "", files)  # it answers and serves "stub"
        with pytest.raises(ConfigError) as e:
            check_rewards("toyworld", f"remote:geneval@{url}", "", files)  # guard rewards too
        assert one_line(e).endswith(
            "the server serves stub, not 'geneval': use one of those names, or start it with that scorer"
        )
        with pytest.raises(ConfigError) as e:
            check_rewards(f"remote:stub@{url}", "", f"remote:stub={meta}", files)
        assert one_line(e) == (
            f"error: --eval-prompts, prompt 2 ('{PROMPTS[1]}'): no metadata line for it in the file given "
            "with --reward-model-paths remote:stub=...: remote:stub sends each prompt's metadata, so every "
            "prompt needs one"
        )
        with pytest.raises(ConfigError, match="no reward remote:geneval@URL in --reward"):
            check_rewards(f"remote:stub@{url}", "", f"remote:geneval={meta}", files)
    with stub("flowgrpo") as (url, _):
        check_rewards(
            f"remote:geneval@flowgrpo+{url}", "", "", files
        )  # Flask's 405 to a GET: it answers
        with pytest.raises(ConfigError) as e:
            check_rewards(f"remote:geneval@{url}", "", "", files)
        assert one_line(e).endswith(
            f"not a flow-rl-reward/1 server (GET {url}/health answered 405 b'Method Not Allowed'): a flow_grpo reward-server "
            f"is spelled remote:geneval@flowgrpo+{url}"
        )


# ============================================================ faults, each against a real server process
FAULTS = [
    # mode and its argument, spec options, what the line says after "at URL", tries the stub saw
    (
        ("slow", "3"),
        "?timeout=0.3&retries=1&backoff=0.05",
        ": no complete reply within the timeout of 0.3 s (2 tries",
        2,
    ),
    (
        ("count",),
        FAST,
        ": the reply has 2 scores for 3 images: the server must return one score per image",
        1,
    ),
    (("nan",), FAST, ": score 0 of 3 is nan: a reward must be a finite number", 1),
    (
        ("status", "500"),
        FAST,
        " answered 500 Internal Server Error: CUDA out of memory (stand-in)",
        1,
    ),
    (
        ("status", "503"),
        FAST,
        ": answered 503 Service Unavailable: CUDA out of memory (stand-in) (2 tries",
        2,
    ),
    (
        ("malformed",),
        FAST,
        " sent a reply that is not JSON (b'<html><body>Bad Gateway</body></html>')",
        1,
    ),
    (
        ("oversized",),
        FAST,
        " sent a reply of more than 1024 KiB (1048577 bytes): a reply holds one score",
        1,
    ),
    (("reset",), FAST, ": no reply (ConnectionResetError: Connection reset by peer) (2 tries", 2),
]


@pytest.mark.parametrize(
    "mode,options,said,tries", FAULTS, ids=[f[0][0] + "".join(f[0][1:]) for f in FAULTS]
)
def test_each_fault_is_one_line_naming_the_server_and_what_it_sent(
    tmp_path, mode, options, said, tries
):
    log = tmp_path / "log.jsonl"
    with stub(*mode, env={"STUB_LOG": str(log)}) as (url, _):
        model = build_reward(f"remote:stub@{url}{options}")
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            model(images(), PROMPTS)
        assert time.monotonic() - start < 5
    assert one_line(e).startswith(f"error: remote reward 'remote:stub' at {url}{said}")
    assert len([r for r in stub_log(log) if r.get("method") == "POST"]) == tries


def test_a_server_that_dies_mid_run_is_one_line_and_one_that_comes_back_is_retried(tmp_path):
    with stub("die-after", "1") as (url, proc):
        model = build_reward(f"remote:stub@{url}{FAST}")
        assert torch.equal(model(images(), PROMPTS)[:, 0], brightness(images()))
        with pytest.raises(SystemExit) as e:
            model(images(), PROMPTS)
        assert one_line(e).startswith(f"error: remote reward 'remote:stub' at {url}: no reply (")
        assert proc.wait(5) == 0  # it did die
    log = tmp_path / "log.jsonl"
    with stub("flaky", "2", env={"STUB_LOG": str(log)}) as (url, _):
        x = images()
        scores = build_reward(f"remote:stub@{url}?retries=3&backoff=0.05")(x, PROMPTS)
        assert torch.equal(scores[:, 0], brightness(x))
        # two requests reset, the third answered
        assert [r.get("n", "reply") for r in stub_log(log)] == [1, 2, 3, "reply"]


# ============================================================ flow_grpo's wire format, and a reply that runs code
def test_flowgrpo_format_jpeg_in_scores_out_with_the_prompts_metadata(tmp_path):
    meta = [
        {"prompt": p, "tag": "single_object", "include": [{"class": "cat", "count": 1}]}
        for p in PROMPTS
    ]
    (tmp_path / "meta.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
    log = tmp_path / "log.jsonl"
    with stub("flowgrpo", env={"STUB_LOG": str(log)}) as (url, _):
        spec = f"remote:geneval@flowgrpo+{url}"
        paths = f"remote:geneval={tmp_path / 'meta.jsonl'}"
        check_rewards(spec, "", paths, {"--prompts-file": PROMPTS})
        model = build_reward(spec, model_paths=parse_model_paths(paths))
        x = images(70)  # two requests: 64 + 6 (flow_grpo's batch of 64)
        scores = model(x, PROMPTS * 23 + PROMPTS[:1])
    torch.testing.assert_close(scores[:, 0], brightness(x, "JPEG"), rtol=0, atol=1e-6)
    first, second = [r for r in stub_log(log) if r.get("method") == "POST"]
    assert (
        first["keys"] == ["images", "meta_datas", "only_strict", "prompts"]
        and first["only_strict"] is True
    )
    assert first["formats"] == ["JPEG"] * 64 and len(second["formats"]) == 6
    assert first["meta_datas"] == (meta * 22)[:64] and first["prompts"] == [
        m["prompt"] for m in (meta * 22)[:64]
    ]


def test_a_reply_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    target, log = tmp_path / "created-by-the-reply", tmp_path / "log.jsonl"
    with stub("evil", str(target), env={"STUB_LOG": str(log)}) as (url, _):
        with pytest.raises(SystemExit) as e:
            build_reward(f"remote:geneval@flowgrpo+{url}{FAST}")(images(), PROMPTS)
    assert one_line(e) == (
        f"error: remote reward 'remote:geneval' at {url} sent a pickle that was refused: UnpicklingError: "
        "it needs the global 'io.open'; only dict, list, str, int, float, bool and None are accepted, since "
        "anything else could run code on loading (a server that sends numpy numbers: have it send .tolist())"
    )
    assert not target.exists()
    # the same bytes, loaded the usual way, do run: this test would fail if the client loaded them so
    pickle.loads(base64.b64decode(stub_log(log)[-1]["reply"]))
    assert target.exists()


def test_safe_unpickle_takes_only_plain_types():
    plain = {"scores": [0.5, 1, -2.0], "ok": True, "none": None, "nested": {"a": ["x"]}}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert safe_unpickle(pickle.dumps(plain, protocol)) == plain
    for other, said in [((1, 2), "it holds a tuple"), (b"x", "it holds a bytes"), ({1.0}, "set")]:
        with pytest.raises(ValueError, match=said):
            safe_unpickle(pickle.dumps({"scores": other}, 4))
    with pytest.raises(
        ValueError, match="needs the global '__builtin__.set'"
    ):  # protocol 2 builds sets by a call
        safe_unpickle(pickle.dumps({1.0}, 2))
    with pytest.raises(ValueError, match="opcode b'n' unknown"):
        safe_unpickle(b"not a pickle")


# ============================================================ the project's server, wrapping another scorer
def test_a_wrapped_scorer_is_served_with_its_metadata_and_bad_requests_are_one_line(tmp_path):
    (tmp_path / "meta.jsonl").write_text(json.dumps({"prompt": PROMPTS[1], "bonus": 10}) + "\n")
    with server(*BRIGHT, "--max-request-mb", "0.02") as (url, _):
        health = json.loads(urllib_get(f"{url}/health"))
        assert health == {"protocol": "flow-rl-reward/1", "scorers": ["bright"]}
        model = build_reward(
            f"jpeg_compressibility:0.5,remote:bright@{url}:2",
            model_paths=parse_model_paths(f"remote:bright={tmp_path / 'meta.jsonl'}"),
        )
        assert model.names == [
            "jpeg_compressibility",
            "remote:bright",
        ] and model.weights.tolist() == [0.5, 2]
        x = images(2)
        scores = model(x, PROMPTS[:2])  # a prompt without metadata: None, so no bonus
        assert torch.equal(scores[:, 0], build_reward("jpeg_compressibility")(x, PROMPTS[:2])[:, 0])
        assert torch.equal(scores[:, 1], brightness(x) + torch.tensor([0.0, 10.0]))
        for body, status, said in [
            (b"{not json", 400, "the body is not JSON ("),
            (
                json.dumps({"scorer": "nope", "images": [], "prompts": []}).encode(),
                404,
                "no scorer 'nope' here",
            ),
            (
                json.dumps({"scorer": "bright", "images": ["!!"], "prompts": ["a"]}).encode(),
                400,
                "image 0 is not",
            ),
        ]:
            code, error = post(f"{url}/score", body)
            assert code == status and error.startswith(said) and "\n" not in error, (body, error)
        # over --max-request-mb: refused before its body is read, and the client says so in one line
        with pytest.raises(SystemExit) as e:
            model(images(8, 64), PROMPTS[:1] * 8)
        assert re.fullmatch(
            rf"error: remote reward 'remote:bright' at {url} answered 413 Request Entity Too Large: a request of "
            r"\d+ bytes is over this server's limit of 0.02 MiB \(--max-request-mb\): send fewer images",
            one_line(e),
        )
    # the server imports no torch, so it runs in a scorer's own environment
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, common.plumbing.reward_server; print('torch' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def urllib_get(url) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def post(url, body) -> tuple[int, str]:
    """(status, error line) of a raw POST that the server refuses."""
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, body, method="POST"), timeout=10)
    return e.value.code, json.loads(e.value.read())["error"]


# ============================================================ the overlap
def test_submit_returns_at_once_and_overlapped_scores_equal_sequential_ones(monkeypatch):
    with stub("slow", "0.5") as (url, _):
        model = build_reward(f"remote:stub@{url}")
        batches = [images(2, seed=s) for s in range(3)]
        start = time.monotonic()
        pending = [model.submit(x, PROMPTS[:2]) for x in batches]
        submitted = time.monotonic() - start
        overlapped = model.gather(pending)
        assert submitted < 0.3 and time.monotonic() - start >= 1.5  # queued at once, scored in turn
        monkeypatch.setattr(RemoteReward, "overlap", False)
        start = time.monotonic()
        pending = [model.submit(x, PROMPTS[:2]) for x in batches]
        assert time.monotonic() - start >= 1.5  # each scored before submit returns
        assert torch.equal(model.gather(pending), overlapped)
    assert torch.equal(overlapped[:, 0], brightness(torch.cat(batches)))


# ============================================================ the scripts: served = in process, and a stop resumes
TOY = [
    "--num-steps",
    "3",
    "--eval-num-steps",
    "2",
    "--eval-seeds-per-prompt",
    "1",
    "--eval-every",
    "100",
]
TWO_BY_TWO = ["--groups-per-iteration", "2", "--group-size", "2", "--rollout-batch-size", "2"]
SCRIPT_FLAGS = {
    "flowgrpo_baseline.py": TWO_BY_TWO,
    "diffusionnft.py": TWO_BY_TWO,
    "g2rpo.py": [
        *("--groups-per-iteration", "2", "--group-size", "3", "--rollout-batch-size", "4"),
        *("--branch-steps", "0", "1", "--granularities", "1", "2", "--noise-level", "1.0"),
    ],
    "densegrpo.py": [
        *("--groups-per-iteration", "2", "--group-size", "2", "--rollout-batch-size", "2"),
        *(
            "--calibration-iterations",
            "2",
            "--calibration-trajectories",
            "2",
            "--completion-batch-size",
            "4",
        ),
    ],
}


def toy_run(script, out, name, reward, guard, *extra):
    """A tiny run of `script` on the shipped toy model; returns its metrics rows and final trained weights."""
    prompts = write_prompts(out / "prompts.txt", PROMPTS[:2])
    flags = [
        *(
            "--output-dir",
            str(out),
            "--run-name",
            name,
            "--prompts-file",
            prompts,
            "--eval-prompts",
            prompts,
        ),
        *(
            "--reward",
            reward,
            "--guard-rewards",
            guard,
            "--learning-rate",
            "1e-2",
            "--save-every",
            "1",
        ),
        *TOY,
        *SCRIPT_FLAGS[script],
        *extra,
    ]
    run_main(script, *flags)
    return flags


def final_state(run_dir):
    last = max(int(d.split("-")[1]) for d in os.listdir(run_dir) if d.startswith("checkpoint-"))
    return torch.load(
        os.path.join(run_dir, f"checkpoint-{last}", "trainer_state.pt"), weights_only=False
    )


def without_timings(rows, rename=()):
    return [
        {dict(rename).get(k, k): v for k, v in r.items() if not k.startswith("time/")} for r in rows
    ]


@pytest.fixture(scope="module")
def toy_server():
    """The project's server with the toy scorer and JPEG compressibility, for the module's runs."""
    cmd = [
        "-m",
        "common.plumbing.reward_server",
        "--reward",
        "toyworld,jpeg_compressibility",
        "--port",
        "0",
    ]
    with server(*cmd) as (url, _):
        yield url


@pytest.mark.parametrize("script", list(SCRIPT_FLAGS))
def test_a_served_reward_gives_the_in_process_rewards_metrics_and_weights(
    script, toy_server, tmp_path
):
    """Target and guard reward served over HTTP (loopback): every metrics row (but its timings) and the final weights
    are those of the in-process run from the same seed (2 iterations of Flow-GRPO, 1 of the others: each rollout's
    scoring runs at least once, DenseGRPO's calibration too)."""
    iterations = "2" if script == "flowgrpo_baseline.py" else "1"
    toy_run(
        script,
        tmp_path,
        "local",
        "toyworld",
        "jpeg_compressibility",
        "--num-iterations",
        iterations,
    )
    remote = f"remote:toyworld@{toy_server}", f"remote:jpeg_compressibility@{toy_server}"
    toy_run(script, tmp_path, "served", *remote, "--num-iterations", iterations)
    local, served = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "served")
    rename = [("eval/guard/remote:jpeg_compressibility", "eval/guard/jpeg_compressibility")]
    assert without_timings(served, rename) == without_timings(local)
    assert "eval/guard/jpeg_compressibility" in local[0] and len(local) == int(iterations) + 1
    a, b = final_state(tmp_path / "local"), final_state(tmp_path / "served")
    assert a["iteration"] == b["iteration"] == int(iterations)
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert any(v.abs().sum() > 0 for k, v in a["params"].items() if "lora_B" in k)  # it did train


def test_a_run_stopped_by_a_dying_server_keeps_its_checkpoint_and_resumes_exactly(tmp_path):
    """The server dies in iteration 1 (at its 5th request: 1 at the first evaluation, 2 per iteration): the run stops in
    one line naming the server and the checkpoint; resumed with the server back on the same port, it ends with the
    metrics and weights of an uninterrupted in-process run."""
    script, port = "flowgrpo_baseline.py", free_port()
    toy_run(script, tmp_path, "local", "toyworld", "", "--num-iterations", "3")
    spec = f"remote:toyworld@http://127.0.0.1:{port}?retries=1&backoff=0.1"
    dying = [
        "-m",
        "common.plumbing.reward_server",
        "--scorer",
        "toyworld=tests.reward_stub:toyworld_until",
    ]
    with server(*dying, "--port", str(port), env={"STUB_DIE_AFTER": "4"}) as (url, proc):
        with pytest.raises(SystemExit) as e:
            toy_run(script, tmp_path, "split", spec, "", "--num-iterations", "3")
        assert proc.wait(10) == 0
    run = tmp_path / "split"
    assert re.fullmatch(
        rf"error: remote reward 'remote:toyworld' at {url}: no reply \(.*\) \(2 tries over 0\.\d s\); the run stops "
        rf"\(the last complete checkpoint is {run}/checkpoint-1: continue with --resume {run} once the server "
        r"answers\)",
        one_line(e),
    )
    assert [d for d in sorted(os.listdir(run)) if d.startswith("checkpoint-")] == ["checkpoint-1"]
    with server("-m", "common.plumbing.reward_server", "--reward", "toyworld", "--port", str(port)):
        toy_run(script, tmp_path, "split", spec, "", "--num-iterations", "3", "--resume", str(run))
    a, b = final_state(tmp_path / "local"), final_state(run)
    assert a["iteration"] == b["iteration"] == 3 and a["counts"] == b["counts"]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert without_timings(read_metrics(run)) == without_timings(read_metrics(tmp_path / "local"))


# ============================================================ hostile servers (issue #68): one line, in bounded time
# Each case runs in a thread that must end within BOUND_S: on the code before #68 the trickle, the cyclic and the
# shared pickles never ended (the test fails, it does not hang), and the rest were tracebacks or a redirect followed.
BOUND_S = 20


def bounded(fn, seconds=BOUND_S):
    """What fn() raised (or returned), from a daemon thread that must end within `seconds`."""
    box = {}

    def run():
        try:
            box["returned"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test looks at what it was
            box["raised"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return box


def stopped_with(box, url) -> str:
    """The one line a call stopped with, naming the server."""
    e = box.get("raised")
    assert isinstance(e, SystemExit), f"expected one line, got {box}"
    msg = str(e.code)
    assert msg.startswith(f"error: remote reward 'remote:stub' at {url}") and "\n" not in msg, msg
    return msg


BIG = 10**400
HOSTILE_REPLIES = [
    # wire, raw reply, what the line says
    ("flowgrpo", http_reply(cyclic_pickle()), "the reply has 1 scores for 3 images"),
    ("flowgrpo", http_reply(shared_pickle()), "it nests deeper than 32 levels"),
    ("flowgrpo", http_reply(pickle.dumps(5)), "the reply is 5, not a dict"),
    ("flowgrpo", http_reply(pickle.dumps(None)), "the reply is None, not a dict"),
    (
        "flowgrpo",
        http_reply(pickle.dumps({"scores": [BIG, 0.5, 0.5]})),
        "score 0 of 3 is an integer of 1329 bits: a reward must be a finite number",
    ),
    (
        "json",
        http_reply(b'{"scores": [' + str(BIG).encode() + b", 0.5, 0.5]}"),
        "score 0 of 3 is an integer of 1329 bits: a reward must be a finite number",
    ),
    (
        "json",
        http_reply(b"[" * 100_000),
        "sent a JSON reply that nests deeper than Python's parser",
    ),
    (
        "json",
        http_reply(b'{"scores": [0.5]}', headers="Content-Length: abc\r\n"),
        "sent a reply with Content-Length 'abc': expected one byte count",
    ),
    (
        "json",
        http_reply(b"", "302 Found", "Location: ftp://127.0.0.1:1/scores\r\n"),
        "answered 302 Found, a redirect to 'ftp://127.0.0.1:1/scores' that is not followed",
    ),
    ("json", b"HELLO\r\n\r\n", "no reply (BadStatusLine: HELLO) (2 tries"),
]


HOSTILE_IDS = [
    "cyclic-pickle",
    "shared-pickle",
    "pickle-of-5",
    "pickle-of-None",
    "pickle-10**400",
    "json-10**400",
    "json-100000-deep",
    "content-length-abc",
    "redirect-to-ftp",
    "status-line-with-a-newline",
]


@pytest.mark.parametrize("wire,reply,said", HOSTILE_REPLIES, ids=HOSTILE_IDS)
def test_a_hostile_reply_is_one_line_naming_the_server_in_bounded_time(wire, reply, said):
    with scripted(reply) as (url, requests):
        model = build_reward(f"remote:stub@{'flowgrpo+' if wire == 'flowgrpo' else ''}{url}{FAST}")
        msg = stopped_with(bounded(lambda: model(images(), PROMPTS)), url)
    assert said in msg, msg
    assert len(requests) == (
        2 if "(2 tries" in said else 1
    )  # FAST: one retry, of what is worth retrying


@pytest.mark.parametrize("wire", ["json", "flowgrpo"])
def test_a_redirect_is_not_followed(wire):
    """A 301/302 turned the POST into a bodiless GET to whatever the server named, and took that answer as the
    scores: now the status is one line, and the other server sees nothing."""
    with scripted(http_reply(b'{"scores": [0.5, 0.5, 0.5]}')) as (elsewhere, seen_there):
        moved = http_reply(b"", "301 Moved Permanently", f"Location: {elsewhere}/score\r\n")
        with scripted(moved) as (url, _):
            spec = f"remote:stub@{'flowgrpo+' if wire == 'flowgrpo' else ''}{url}{FAST}"
            msg = stopped_with(bounded(lambda: build_reward(spec)(images(), PROMPTS)), url)
    assert (
        f"answered 301 Moved Permanently, a redirect to '{elsewhere}/score' that is not followed"
        in msg
    )
    assert seen_there == []


@pytest.mark.parametrize("wire", ["json", "flowgrpo"])
def test_a_reply_trickled_a_byte_at_a_time_ends_at_the_deadline(wire):
    """A socket timeout bounds each read, not the request: a server that sends one byte every 50 ms never reached it.
    Each try now ends at its deadline, and all tries within the budget."""
    reply = http_reply(b"0" * 100_000)
    with scripted(reply, trickle_s=0.05) as (url, requests):
        spec = f"remote:stub@{'flowgrpo+' if wire == 'flowgrpo' else ''}{url}?timeout=1&retries=1&backoff=0.1"
        start = time.monotonic()
        msg = stopped_with(bounded(lambda: build_reward(spec)(images(), PROMPTS)), url)
        took = time.monotonic() - start
    assert ": no complete reply within the timeout of 1 s (2 tries over " in msg, msg
    assert len(requests) == 2 and took < 2.1 + 2  # two tries of 1 s and a wait of 0.1 s, plus slack


def test_a_pickle_that_names_a_huge_memo_index_is_refused_before_it_is_built():
    """9 bytes that make the C unpickler allocate 8 bytes for each index below the one they name (160 MB for
    10**7): refused from its opcodes, before anything is allocated."""
    with scripted(http_reply(memo_bomb(10**7))) as (url, _):
        model = build_reward(f"remote:stub@flowgrpo+{url}{FAST}")
        tracemalloc.start()
        try:
            box = bounded(lambda: model(images(), PROMPTS))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 20 * 2**20, f"decoding took {peak / 2**20:.0f} MiB"
    assert "its opcode LONG_BINPUT at byte 3 names memo entry 10000000 in 9 bytes" in stopped_with(
        box, url
    )


BAD_OPTIONS = [
    ("timeout=1e300", "bad timeout=1e300 in remote reward"),
    ("backoff=1e300", "bad backoff=1e300 in remote reward"),
    (f"retries={10**9}", f"bad retries={10**9} in remote reward"),
    (
        "timeout=600&retries=5",
        "timeout=600, retries=5 and backoff=1 let one request take 3631 s (6 tries and the waits between them), "
        "over the limit of 3600 s",
    ),
    ("", "bad remote reward 'remote:g@http://127.0.0.1:99999?': its port must be in 1..65535"),
]


@pytest.mark.parametrize("query,said", BAD_OPTIONS, ids=[q or "port=99999" for q, _ in BAD_OPTIONS])
def test_the_options_are_range_checked_when_the_reward_is_parsed(query, said):
    """Each was accepted before, then an OverflowError traceback (timeout or backoff 1e300), or a run that
    never stopped against a dead server (retries 10**9), or one request that could take hours, or a port past
    65535 (a ValueError from urllib at the first request)."""
    with pytest.raises(ValueError, match=re.escape(said)) as e:
        parse_reward_spec(f"remote:g@http://127.0.0.1:{99999 if not query else 1}?{query}")
    assert "\n" not in str(e.value)
    assert parse_remote("remote:g@http://127.0.0.1:1?timeout=3600&retries=0")[0].budget == 3600


def test_gather_never_waits_past_the_request_budget(monkeypatch):
    """A request stuck where no socket timeout reaches (here every connect hangs, as a name lookup can): gather
    stops with one line shortly after the request's budget (0.5 s) and GRACE_S (set to 0.5 s)."""
    import http.client

    import common.plumbing.remote_reward

    monkeypatch.setattr(common.plumbing.remote_reward, "GRACE_S", 0.5, raising=False)
    monkeypatch.setattr(
        http.client.HTTPConnection, "connect", lambda self: threading.Event().wait()
    )
    model = build_reward(f"remote:stub@http://127.0.0.1:{free_port()}?timeout=0.5&retries=0")
    start = time.monotonic()
    msg = stopped_with(bounded(lambda: model.gather([model.submit(images(), PROMPTS)])), "http://")
    assert "no reply within the request's budget of 0.5 s and 0.5 s more" in msg
    assert time.monotonic() - start < 5


def test_the_start_up_check_of_a_hostile_server_is_one_line_in_seconds():
    files = {"--prompts-file": PROMPTS[:1]}
    for reply, trickle_s, said in [
        (http_reply(b"[" * 100_000), 0, "not a flow-rl-reward/1 server (GET "),
        (
            http_reply(b"{}", "301 Moved Permanently", "Location: http://x:1/\r\n"),
            0,
            "answered 301",
        ),
        (
            http_reply(b'{"protocol": "flow-rl-reward/1", "scorers": ["stub"]}'),
            0.05,
            "no server answers (no ",
        ),
    ]:
        with scripted(reply, trickle_s) as (url, _):
            box = bounded(lambda: check_rewards(f"remote:stub@{url}?timeout=1", "", "", files))
        e = box.get("raised")
        assert isinstance(e, ConfigError), box
        assert said in one_line(SimpleNamespace(value=e)), e


# ============================================================ the project's server bounds what it decodes (issue #68)
def exchange(url, data: bytes, wait_s=10) -> bytes:
    """All the server answers to `data` sent raw over one connection (left open), until it closes it; a server that
    answers nothing within wait_s gives b''."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as conn:
        conn.sendall(data)
        out = b""
        with contextlib.suppress(OSError):  # the timeout, or a reset
            while chunk := conn.recv(65536):
                out += chunk
    return out


def refusal(answer: bytes) -> tuple[int, str]:
    """(status, error line) of a JSON error answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head, answer[:300]
    error = json.loads(body)["error"]
    assert "\n" not in error
    return int(head.split(b" ")[1]), error


def post_raw(url, body: bytes, wait_s=10) -> tuple[int, str]:
    return refusal(
        exchange(
            url, b"POST /score HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body, wait_s
        )
    )


def png_of(w, h) -> bytes:
    """A 1-bit PNG of w x h black pixels, made here (zlib of its rows), in a blink whatever its size."""
    rows = zlib.compress(b"\0" * ((w + 7) // 8 + 1) * h, 9)

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def declaring(fmt, w, h) -> bytes:
    """A small PNG or JPEG whose header declares w x h pixels."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, fmt)
    data = bytearray(buf.getvalue())
    if fmt == "PNG":
        data[16:24] = struct.pack(">II", w, h)
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    else:
        sof = data.index(b"\xff\xc0")
        data[sof + 5 : sof + 9] = struct.pack(">HH", h, w)
    return bytes(data)


def score_request(pictures, scorer="bright", **fields) -> bytes:
    body = {"scorer": scorer, "images": [base64.b64encode(p).decode() for p in pictures]}
    return json.dumps({**body, "prompts": ["a"] * len(pictures), **fields}).encode()


def peak_rss_mb(proc) -> float:
    with open(f"/proc/{proc.pid}/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read())[1]) / 1024


def test_the_issues_79_kb_request_is_refused_from_its_headers_without_decoding():
    """Six 9000x9000 1-bit PNGs in 79 KB took the server from 242 MB to 15 GB: now refused (413) from the first
    image's header, its peak memory what it was. The server's address space is capped at 1.5 GiB, so that on the
    code before #68 it fails (no reply) instead of exhausting the machine."""
    body = score_request([png_of(9000, 9000)] * 6)
    assert 70_000 < len(body) < 90_000
    with server(*BRIGHT, max_bytes=3 * 2**29) as (url, proc):
        before = peak_rss_mb(proc)
        status, error = post_raw(url, body, wait_s=60)
        after = peak_rss_mb(proc)
    assert status == 413 and error.startswith(
        "image 0 is 9000x9000 pixels: a request may hold images of at most "
    )
    assert after - before < 50, f"the server's peak grew from {before:.0f} to {after:.0f} MB"


@pytest.fixture(scope="module")
def bright_server():
    """The project's server wrapping the stand-in scorer, with a read timeout of 1 s and a 1 MiB request limit."""
    with server(*BRIGHT, "--read-timeout", "1", "--max-request-mb", "1") as (url, _):
        yield url


@pytest.mark.parametrize(
    "body,status,said",
    [
        (
            score_request([declaring("PNG", 60000, 60000)]),
            413,
            "image 0 declares more than 16,777,216 pixels",
        ),
        (
            score_request([declaring("JPEG", 60000, 60000)]),
            413,
            "image 0 declares more than 16,777,216 pixels",
        ),
        (score_request([png_of(5000, 5000)]), 413, "image 0 is 5000x5000 pixels"),
        (
            score_request([png_of(4000, 4000)] * 5),
            413,
            "image 4 is 4000x4000 pixels: a request may hold",
        ),
        (score_request([png_of(1, 1)] * 257), 413, "257 images in one request, at most 256"),
        (b"[" * 100_000, 400, "the body is nested deeper than 32 levels: expected a JSON object"),
        (
            score_request([png_of(2, 2)], metadata=[{"a": json.loads("[" * 40 + "]" * 40)}]),
            400,
            "the body is nested deeper than 32 levels",
        ),
        (score_request([], scorer=["bright"]), 400, '"scorer" is a list, not a string'),
        (score_request([], scorer={}), 400, '"scorer" is an object, not a string'),
        (
            score_request([png_of(2, 2)], metadata=[5]),
            400,
            '"metadata" must be a list with one object',
        ),
        (
            b'{"scorer": "bright", "images": [], "prompts": [], "x": ['
            + b"[]," * 200_000
            + b"[]]}",
            413,
            "the body holds about 400,00",
        ),
    ],
    ids=[
        "png-bomb",
        "jpeg-bomb",
        "image-pixels",
        "request-pixels",
        "image-count",
        "deep-json",
        "deep-metadata",
        "scorer-list",
        "scorer-object",
        "metadata-int",
        "json-values",
    ],
)
def test_what_a_request_may_hold_is_bounded_before_it_is_decoded(bright_server, body, status, said):
    """Before #68: the bombs and the deep JSON were an uncaught exception (no reply), a list or dict scorer a
    TypeError (no reply), the large images decoded in full and scored (200), 257 tiny ones scored, an int
    metadata handed to the scorer (500), 200,000 JSON values built."""
    got, error = post_raw(bright_server, body)
    assert (got, error[: len(said)]) == (status, said), error


def test_a_bad_content_length_or_a_slow_client_is_answered_in_bounded_time(bright_server):
    """Content-Length -1 made the server read to the end of the connection, past --max-request-mb (a client that
    keeps it open was never answered); a client that sends part of its body and waits held its thread forever."""
    start = time.monotonic()
    head = b"POST /score HTTP/1.0\r\nContent-Length: %s\r\n\r\n"
    # (headers only: a body the server leaves unread could make its close a reset, losing its answer)
    status, error = refusal(exchange(bright_server, head % b"-1"))
    assert (status, error) == (400, "Content-Length '-1' is not one byte count")
    assert refusal(exchange(bright_server, head % b"abc"))[0] == 400
    both = b"POST /score HTTP/1.0\r\nContent-Length: 2\r\nContent-Length: 9\r\n\r\n"
    assert refusal(exchange(bright_server, both)) == (
        400,
        "Content-Length '2, 9' is not one byte count",
    )
    chunked = b"POST /score HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert refusal(exchange(bright_server, chunked))[0] == 411
    # a body that stops coming: 408 once the read timeout (1 s) is up
    status, error = refusal(exchange(bright_server, head % b"100" + b'{"scorer"'))
    assert (status, error) == (
        408,
        "the request's body did not arrive within 1 s (got 9 of its 100 bytes)",
    )
    assert time.monotonic() - start < 1 + 5  # one wait of the read timeout (1 s), and slack


def test_a_request_that_never_ends_is_cut_at_the_read_timeout(bright_server):
    """Headers that stop coming, or a request line: 408 at the read timeout (1 s); before #68 nothing ended them."""
    for partial in (b"POST /score HTTP/1.0\r\nX-Slow: 1", b"GET /hea"):
        start = time.monotonic()
        answer = exchange(bright_server, partial, wait_s=10)
        assert time.monotonic() - start < 5, answer
        assert refusal(answer) == (408, "the request did not arrive within 1 s (--read-timeout)")


def test_every_method_and_path_gets_the_documented_json_error(bright_server):
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "BREW"):
        status, error = refusal(
            exchange(bright_server, f"{method} /score HTTP/1.0\r\n\r\n".encode())
        )
        assert (status, error) == (405, f"no {method} here: GET /health or POST /score")
    head = exchange(bright_server, b"HEAD /health HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 405") and head.endswith(b"\r\n\r\n")  # no body to a HEAD
    assert refusal(exchange(bright_server, b"GARBAGE\r\n\r\n"))[0] == 400
    assert refusal(exchange(bright_server, b"GET /nowhere HTTP/1.0\r\n\r\n")) == (
        404,
        "no /nowhere here: GET /health or POST /score",
    )
    assert (
        refusal(exchange(bright_server, b"POST /health HTTP/1.0\r\nContent-Length: 0\r\n\r\n"))[0]
        == 404
    )


def start_up(*flags, timeout=30) -> str:
    """The one line `python -m common.plumbing.reward_server FLAGS` stopped with, before it served anything."""
    r = subprocess.run(
        [sys.executable, "-m", "common.plumbing.reward_server", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=script_env(),
        timeout=timeout,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "serving" not in r.stdout and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def taken_port():
    """A loopback port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield str(taken.getsockname()[1])


START_UP_MISTAKES = [
    (["--port", "99999"], "error: --port 99999: must be in [0, 65535]"),
    (["--port", "abc"], "error: argument --port: invalid int value: 'abc'"),
    (
        ["--port", "TAKEN"],
        "error: cannot serve on 127.0.0.1:TAKEN (OSError: Address already in use)",
    ),
    (["--host", "10.255.255.1"], "error: cannot serve on 10.255.255.1:0 (OSError: Cannot assign"),
    (["--max-request-mb", "nan"], "error: --max-request-mb nan: must be in "),
    (["--max-request-mb", "-5"], "error: --max-request-mb -5.0: must be in "),
    (["--read-timeout", "0"], "error: --read-timeout 0.0: must be in "),
    (
        ["--scorer", "x=os:system"],
        "error: bad scorer 'os:system': os.system is a builtin_function_or",
    ),
    (
        ["--scorer", "x=tests.reward_stub:Evil"],
        "tests.reward_stub.Evil is a type, not a function defined in",
    ),
    (
        ["--scorer", "x=tests.reward_stub:brightness_of"],
        "needs arguments: FACTORY is called with none",
    ),
    (
        ["--scorer", "a b=tests.reward_stub:brightness"],
        "error: --scorer a b=tests.reward_stub:brightness: ",
    ),
]


@pytest.mark.parametrize(
    "flags,said", START_UP_MISTAKES, ids=[" ".join(f) for f, _ in START_UP_MISTAKES]
)
def test_every_start_up_mistake_is_one_line(flags, said, taken_port):
    """13 to 21 lines of traceback each before #68; --max-request-mb -5 and --read-timeout 0 started a server (that
    refused every request), and so does --scorer a b=... (a name no client can spell)."""
    flags = [f.replace("TAKEN", taken_port) for f in flags]
    port = [] if "--port" in flags else ["--port", "0"]
    scorer = [] if "--scorer" in flags else ["--scorer", "x=tests.reward_stub:brightness"]
    line = start_up(*flags, *port, *scorer)
    assert said.replace("TAKEN", taken_port) in line, line
