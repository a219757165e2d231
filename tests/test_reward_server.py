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
import selectors
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import ROOT, read_metrics, run_main, script_env, write_prompts
from PIL import Image
from reward_stub import brightness_of

import common.plumbing.harness
from common.plumbing.checks import ConfigError
from common.plumbing.remote_reward import RemoteReward, parse_remote, safe_unpickle
from common.rewards import build_reward, check_rewards, parse_model_paths, parse_reward_spec

STUB = os.path.join(ROOT, "tests", "reward_stub.py")
PROMPTS = ["a photo of a red circle", "a photo of two blue squares", "a photo of a green triangle"]
FAST = "?timeout=5&retries=1&backoff=0.05"  # faults end in a second, not in the defaults' minute


@contextlib.contextmanager
def server(*cmd, env=None, wait_s=60):
    """A server process on loopback; yields (its URL, the process). Killed on exit."""
    err = open(os.devnull, "w")
    proc = subprocess.Popen(
        [sys.executable, *cmd],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        cwd=ROOT,
        env={**script_env(), **(env or {})},
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
            f"not a flow-rl-reward/1 server (GET {url}/health answered 405 b''): a flow_grpo reward-server "
            f"is spelled remote:geneval@flowgrpo+{url}"
        )


# ============================================================ faults, each against a real server process
FAULTS = [
    # mode and its argument, spec options, what the line says after "at URL", tries the stub saw
    (
        ("slow", "3"),
        "?timeout=0.3&retries=1&backoff=0.05",
        ": no reply within the timeout of 0.3 s (2 tries",
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
        " sent a reply of more than 16 MiB (16777217 bytes): a reply holds one score",
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
    with pytest.raises(ValueError, match="UnpicklingError"):
        safe_unpickle(b"not a pickle")


# ============================================================ the project's server, wrapping another scorer
def test_a_wrapped_scorer_is_served_with_its_metadata_and_bad_requests_are_one_line(tmp_path):
    (tmp_path / "meta.jsonl").write_text(json.dumps({"prompt": PROMPTS[1], "bonus": 10}) + "\n")
    cmd = [
        "-m",
        "common.plumbing.reward_server",
        "--scorer",
        "bright=tests.reward_stub:brightness",
        "--port",
        "0",
    ]
    with server(*cmd, "--max-request-mb", "0.02") as (url, _):
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
