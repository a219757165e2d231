"""A reward scored by a server over HTTP: the client behind `--reward remote:NAME@URL`.

    --reward "remote:geneval@http://127.0.0.1:8000"                  this project's server
    --reward "remote:geneval@flowgrpo+http://127.0.0.1:18085:2.0"    flow_grpo's reward-server, weight 2
    --reward "toyworld:1,remote:ocr@http://gpu-box:8001?timeout=30"  mixed with local rewards

NAME is the scorer's name on the server (and the reward's name in metrics: `remote:NAME`); the URL
needs its port, so that a trailing `:WEIGHT` is never mistaken for one. The scheme picks the wire
format (docs/usage.md, "Rewards from a server"):

- `http://` (or https): this project's, common/plumbing/reward_server.py: JSON both ways, PNG images in
  base64. A reply is data only: it can give wrong scores, never run code here.
- `flowgrpo+http://`: flow_grpo's reward-server (github.com/yifan123/reward-server, app_geneval.py
  and app_deqa.py at 7131478; its client, github.com/yifan123/flow_grpo flow_grpo/rewards.py
  `geneval_score` at 54809b5): one POST to the URL of a pickled {"images": [JPEG bytes],
  "meta_datas": [...], "only_strict": ...} (plus "prompts", which those servers ignore), answered
  with a pickled dict whose "scores" (GenEval) or "outputs" (DeQA) holds one score per image. The server
  unpickles what it is sent, so it must trust every client that can reach it; the reply is decoded
  here by an unpickler that resolves no global at all (`safe_unpickle`), so it can hold only plain
  dicts, lists, strings, numbers, booleans and None: anything else, and any pickle that would run
  code, is refused in one line.

Query parameters after the URL: timeout (seconds per request, default 120, flow_grpo's), retries
(tries after the first, default 5) and backoff (seconds before the first retry, doubled each time,
default 1). Connection failures, timeouts and the statuses 429/502/503/504 are retried; any other
status, and a reply that is malformed, too big (16 MiB), of the wrong length or not finite, is not
(it would only come again) and stops with one line naming the server and what it sent.

A prompt's metadata (GenEval's task spec: tag, include, ...) comes from JSON lines, each an object
with the "prompt" it belongs to: `--reward-model-paths remote:NAME=FILE.jsonl` (or a folder of
them, e.g. flow_grpo's dataset/geneval/ with train_metadata.jsonl and test_metadata.jsonl). Without
it a request carries the prompts only.

Requests hold at most 64 images (flow_grpo's batch). A reward submitted by RewardModel.submit is
sent by one background thread per server, in order, so the next rollout batch samples while this
one is scored; `overlap = False` does the same requests in the caller's thread instead (the
sequential arm of benchmarks/bench_reward_server.py): same requests, same scores.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import pickle
import queue
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass
from http.client import HTTPException

import torch
from PIL import Image

from common.plumbing.reward_server import PROTOCOL

MAX_REQUEST_IMAGES = 64  # flow_grpo's geneval_score sends batches of 64
MAX_REPLY_BYTES = 16 << 20  # a reply is one score (or a few) per image: far less than this
CHECK_TIMEOUT_S = 5.0  # the start-up check: a wrong URL is one line in seconds
RETRIED_STATUSES = (429, 502, 503, 504)  # busy or restarting; anything else would come again
DEFAULTS = {"timeout": 120.0, "retries": 5, "backoff": 1.0}
SPELLING = (
    "remote:NAME@http://HOST:PORT[/PATH][?timeout=S&retries=N&backoff=S][:WEIGHT], or "
    "flowgrpo+http://... for a flow_grpo reward-server"
)
_SPEC = re.compile(
    r"remote:(?P<scorer>[\w.-]+)@(?P<wire>flowgrpo\+)?(?P<url>https?://"
    r"(?:\[[0-9A-Fa-f:.]+\]|[^/:?@\[\]\s]+):\d+(?:/[^:?\s]*)?)(?:\?(?P<query>[^:\s]*))?"
    r"(?::(?P<weight>[^:]*))?"
)
PLAIN_TYPES = (dict, list, str, int, float, bool, type(None))


class RemoteRewardError(SystemExit):
    """A reward server failed or sent something unusable: one line (a SystemExit, no traceback)
    naming the server and what it sent."""

    def __init__(self, detail: str):
        super().__init__(f"error: {detail}")
        self.detail = detail

    def stopping(self) -> RemoteRewardError:
        """The same line, ending with what the run stopping here can go on from (when a run is
        under way in this process)."""
        from common.plumbing.run import continue_hint_of_this_run

        hint = continue_hint_of_this_run()
        if not hint:
            return self
        return RemoteRewardError(f"{self.detail}; the run stops ({hint} once the server answers)")


# ----------------------------------------------------------------------------- the spelling
@dataclass(frozen=True)
class RemoteSpec:
    """One `remote:NAME@URL` item of --reward, without its weight."""

    text: str  # as spelled, without the weight: the reward's key in caches
    scorer: str
    url: str  # http(s)://host:port[/path], no query
    wire: str  # "json" (this project's) or "flowgrpo"
    timeout: float
    retries: int
    backoff: float

    @property
    def name(self) -> str:
        return f"remote:{self.scorer}"


def is_remote(item: str) -> bool:
    return item.strip().startswith("remote:")


def parse_remote(item: str) -> tuple[RemoteSpec, str | None]:
    """'remote:NAME@URL[?query][:WEIGHT]' -> (its spec, the weight as written or None); a
    malformed one is a ValueError of one line."""
    m = _SPEC.fullmatch(item.strip())
    if not m:
        raise ValueError(
            f"bad remote reward '{item.strip()}': expected {SPELLING}, e.g. "
            "'remote:geneval@http://127.0.0.1:8000' (the port is required)"
        )
    options = dict(DEFAULTS)
    try:
        pairs = urllib.parse.parse_qsl(m["query"] or "", strict_parsing=bool(m["query"]))
    except ValueError:
        pairs = [("", "")]
    for key, value in pairs:
        if key not in DEFAULTS:
            raise ValueError(
                f"bad option '{key}' in remote reward '{item.strip()}': expected timeout, "
                "retries or backoff, e.g. '?timeout=30&retries=3'"
            )
        try:
            number = int(value) if key == "retries" else float(value)
        except ValueError:
            number = -1
        if not (0 <= number < math.inf) or (key == "timeout" and number == 0):
            raise ValueError(
                f"bad {key}={value} in remote reward '{item.strip()}': expected "
                + (
                    "an integer >= 0"
                    if key == "retries"
                    else "seconds > 0"
                    if key == "timeout"
                    else "seconds >= 0"
                )
            )
        options[key] = number
    weight = m["weight"]
    text = item.strip()[: m.start("weight") - 1] if weight is not None else item.strip()
    spec = RemoteSpec(text, m["scorer"], m["url"], "flowgrpo" if m["wire"] else "json", **options)
    return spec, weight


# ----------------------------------------------------------------------------- metadata
def load_metadata(path: str) -> dict[str, dict]:
    """{prompt: its metadata} from a JSON-lines file (or every *.jsonl of a folder), one object a
    line with its "prompt" (GenEval's train_metadata.jsonl as it is). A line that is not such an
    object, or a prompt given two different metadata, is a ValueError of one line."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".jsonl"))
    else:
        files = [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise ValueError(
            f"prompt metadata '{path}' does not exist or holds no .jsonl file: expected a JSON-lines "
            'file (or a folder of them), one object a line with its "prompt"'
        )
    out: dict[str, dict] = {}
    for file in files:
        with open(file, encoding="utf-8-sig") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    meta = json.loads(line)
                except ValueError as e:
                    meta = e
                if not isinstance(meta, dict) or not isinstance(meta.get("prompt"), str):
                    raise ValueError(
                        f'{file}, line {i}: not a JSON object with a "prompt" string: expected '
                        'one object a line, e.g. {"prompt": "a photo of a cat", "tag": ...}'
                    )
                prompt = meta["prompt"].strip()
                if out.get(prompt, meta) != meta:
                    raise ValueError(
                        f"{file}, line {i}: prompt '{prompt}' has other metadata on an earlier "
                        "line: give each prompt one metadata"
                    )
                out[prompt] = meta
    return out


# ----------------------------------------------------------------------------- decoding replies
class _NoGlobals(pickle.Unpickler):
    """Resolves no global: a pickle can then build only what its opcodes make by themselves (dicts,
    lists, strings, numbers, ...); every class or function, the way a pickle runs code, is refused.
    The Python docs' "Restricting Globals", with nothing allowed."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it needs the global '{module}.{name}'")


def safe_unpickle(data: bytes):
    """The plain value a pickle holds (dict, list, str, int, float, bool, None, nested), or
    ValueError naming what else it holds. Nothing in it is called."""
    try:
        value = _NoGlobals(io.BytesIO(data)).load()
    except Exception as e:  # the C unpickler raises several kinds on malformed input
        raise ValueError(f"{type(e).__name__}: {str(e)[:160]}") from None
    todo = [value]
    while todo:
        x = todo.pop()
        if type(x) not in PLAIN_TYPES:
            raise ValueError(f"it holds a {type(x).__name__}")
        if isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return value


def _scores_of(reply, n: int, wire: str) -> list[float]:
    """The reply's list of n finite scores, or ValueError saying what it holds instead."""
    key = "scores" if wire == "json" or "scores" in reply else "outputs"
    if not isinstance(reply, dict) or not isinstance(reply.get(key), list):
        keys = sorted(map(str, reply)) if isinstance(reply, dict) else type(reply).__name__
        raise ValueError(
            f'the reply has no "{key}" list (it holds {keys}): expected '
            + ('{"scores": [one float per image]}' if wire == "json" else 'a dict with "scores"')
        )
    scores = reply[key]
    if len(scores) != n:
        raise ValueError(
            f"the reply has {len(scores)} scores for {n} images: the server must return one "
            "score per image, in order"
        )
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise ValueError(f"score {i} of {n} is {s!r}: a reward must be a number")
        if not math.isfinite(s):
            raise ValueError(f"score {i} of {n} is {s}: a reward must be a finite number")
    return [float(s) for s in scores]


# ----------------------------------------------------------------------------- the client
class _Retry(Exception):
    """A failure worth trying again (the server busy, restarting, slow or not yet up)."""


class RemoteReward:
    """One scorer on a reward server. `score` runs the requests in the caller's thread; `submit`
    queues them on this reward's background thread and returns a Future of the scores."""

    overlap = True  # False: submit scores at once, in the caller's thread (the sequential arm)

    def __init__(self, spec: RemoteSpec, metadata: dict[str, dict] | None = None):
        self.spec, self.metadata = spec, metadata
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def __repr__(self):
        return f"RemoteReward({self.spec.text})"

    def _where(self) -> str:
        return f"remote reward '{self.spec.name}' at {self.spec.url}"

    # ---- start-up
    def check(self, prompt_files: dict[str, list[str]]) -> None:
        """That the server answers (this project's: that it serves the scorer), and that the
        metadata, if any, has every prompt; else ValueError, one line. One try, CHECK_TIMEOUT_S."""
        if self.metadata is not None:
            for flag, prompts in prompt_files.items():
                for i, p in enumerate(prompts, 1):
                    if p.strip() not in self.metadata:
                        raise ValueError(
                            f"{flag}, prompt {i} ('{p}'): no metadata line for it in the file given "
                            f"with --reward-model-paths {self.spec.name}=...: {self.spec.name} sends "
                            "each prompt's metadata, so every prompt needs one"
                        )
        health = self.spec.url.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(
                health if self.spec.wire == "json" else self.spec.url,
                timeout=min(self.spec.timeout, CHECK_TIMEOUT_S),
            ) as r:
                body, status = r.read(MAX_REPLY_BYTES), r.status
        except urllib.error.HTTPError as e:  # it answers: enough for flow_grpo's (POST only)
            if self.spec.wire == "flowgrpo":
                return
            body, status = b"", e.code
        except (OSError, HTTPException) as e:
            raise ValueError(
                f"{self._where()}: no server answers ({_reason(e)}): start it (e.g. `python -m "
                "common.plumbing.reward_server --reward toyworld --port 8000`) or fix the URL in --reward"
            ) from None
        if self.spec.wire == "flowgrpo":
            return
        try:
            info = json.loads(body)
            ok = info.get("protocol") == PROTOCOL and isinstance(info.get("scorers"), list)
        except (ValueError, AttributeError):
            ok = False
        if status != 200 or not ok:
            raise ValueError(
                f"{self._where()}: not a {PROTOCOL} server (GET {health} answered {status} "
                f"{_excerpt(body)}): a flow_grpo reward-server is spelled "
                f"remote:{self.spec.scorer}@flowgrpo+{self.spec.url}"
            )
        if self.spec.scorer not in info["scorers"]:
            raise ValueError(
                f"{self._where()}: the server serves {', '.join(map(str, info['scorers']))}, not "
                f"'{self.spec.scorer}': use one of those names, or start it with that scorer"
            )

    # ---- scoring
    def submit(self, images: torch.Tensor, prompts: list[str], cancel: threading.Event) -> Future:
        """Future of `score(images, prompts)`, run on this reward's thread after the batches
        submitted before it (or at once, in this thread, when overlap is False). `cancel` set: it
        stops before its next try."""
        future: Future = Future()
        job = (future, lambda: self.score(images, prompts, cancel))
        if not self.overlap:
            _run(*job)
            return future
        if self._worker is None or not self._worker.is_alive():
            # a daemon: a run that stops on a failed reply exits without waiting for queued ones
            self._worker = threading.Thread(target=self._work, name=repr(self), daemon=True)
            self._worker.start()
        self._jobs.put(job)
        return future

    def _work(self):
        while True:
            _run(*self._jobs.get())

    def score(
        self, images: torch.Tensor, prompts: list[str], cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """images uint8 [B,3,H,W] on the CPU -> float32 scores [B], in requests of at most
        MAX_REQUEST_IMAGES images; a failure is RemoteRewardError, one line."""
        out: list[float] = []
        for i in range(0, len(images), MAX_REQUEST_IMAGES):
            chunk = images[i : i + MAX_REQUEST_IMAGES].permute(0, 2, 3, 1).numpy()
            chunk_prompts = prompts[i : i + MAX_REQUEST_IMAGES]
            body = self._request(chunk, chunk_prompts)
            reply = self._post(body, cancel or threading.Event())
            try:
                decoded = json.loads(reply) if self.spec.wire == "json" else safe_unpickle(reply)
            except ValueError as e:
                what = (
                    f"a reply that is not JSON ({_excerpt(reply)})"
                    if self.spec.wire == "json"
                    else f"a pickle that was refused: {e}; only dict, list, str, int, float, "
                    "bool and None are accepted, since anything else could run code on loading "
                    "(a server that sends numpy numbers: have it send .tolist())"
                )
                raise RemoteRewardError(f"{self._where()} sent {what}") from None
            try:
                out += _scores_of(decoded, len(chunk), self.spec.wire)
            except ValueError as e:
                raise RemoteRewardError(f"{self._where()}: {e}") from None
        return torch.tensor(out, dtype=torch.float32)

    def _request(self, images, prompts: list[str]) -> bytes:
        """The body of one request: this project's JSON (lossless PNG, base64) or flow_grpo's
        pickle (JPEG at PIL's default quality 75, as its client)."""
        metadata = [self.metadata.get(p.strip()) if self.metadata else None for p in prompts]
        if self.spec.wire == "json":
            return json.dumps(
                {
                    "scorer": self.spec.scorer,
                    "images": [base64.b64encode(_encode(a, "PNG")).decode() for a in images],
                    "prompts": prompts,
                    "metadata": metadata,
                }
            ).encode()
        return pickle.dumps(
            {
                "images": [_encode(a, "JPEG") for a in images],
                "prompts": prompts,
                # GenEval reads meta_datas; without a metadata file each carries its prompt
                "meta_datas": [
                    m if m is not None else {"prompt": p} for m, p in zip(metadata, prompts)
                ],
                # scores do not depend on it; True skips GenEval's non-strict check, unused here
                "only_strict": True,
            },
            protocol=4,
        )

    def _post(self, body: bytes, cancel: threading.Event) -> bytes:
        """POST with retries; the reply's body, or RemoteRewardError naming what went wrong."""
        s = self.spec
        url = s.url.rstrip("/") + "/score" if s.wire == "json" else s.url
        kind = "application/json" if s.wire == "json" else "application/octet-stream"
        start, delay = time.monotonic(), s.backoff
        for attempt in range(1, s.retries + 2):
            try:
                return self._post_once(url, body, kind)
            except _Retry as e:
                last = str(e)
            if attempt > s.retries or cancel.is_set() or cancel.wait(delay):
                break
            delay *= 2
        tries = (
            f"{attempt} tr{'y' if attempt == 1 else 'ies'} over {time.monotonic() - start:.1f} s"
        )
        raise RemoteRewardError(f"{self._where()}: {last} ({tries})")

    def _post_once(self, url: str, body: bytes, kind: str) -> bytes:
        request = urllib.request.Request(url, body, {"Content-Type": kind}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.spec.timeout) as r:
                size = int(r.headers.get("Content-Length") or 0)
                reply = r.read(MAX_REPLY_BYTES + 1) if size <= MAX_REPLY_BYTES else b""
                if size > MAX_REPLY_BYTES or len(reply) > MAX_REPLY_BYTES:
                    raise RemoteRewardError(
                        f"{self._where()} sent a reply of more than {MAX_REPLY_BYTES >> 20} MiB "
                        f"({size or len(reply)} bytes): a reply holds one score per image"
                    )
                return reply
        except urllib.error.HTTPError as e:
            detail = f"answered {e.code} {e.reason}: {_error_text(e)}"
            if e.code in RETRIED_STATUSES:
                raise _Retry(detail) from None
            hint = ""
            if self.spec.wire == "flowgrpo" and self.metadata is None:
                hint = (
                    f" (a GenEval server needs each prompt's metadata: --reward-model-paths "
                    f"{self.spec.name}=train_metadata.jsonl)"
                )
            raise RemoteRewardError(f"{self._where()} {detail}{hint}") from None
        except TimeoutError:
            raise _Retry(f"no reply within the timeout of {self.spec.timeout:g} s") from None
        except (OSError, HTTPException) as e:  # refused, reset, closed without a reply, ...
            raise _Retry(f"no reply ({_reason(e)})") from None


def _run(future: Future, fn) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as e:  # RemoteRewardError is a SystemExit: handed over, not lost
            future.set_exception(e)


def _encode(array, fmt: str) -> bytes:
    buf = io.BytesIO()
    # PNG: lossless, so a served reward scores exactly the pixels an in-process one would;
    # compress_level 1: a third of level 6's time for ~10 % more bytes
    Image.fromarray(array).save(buf, format=fmt, **({"compress_level": 1} if fmt == "PNG" else {}))
    return buf.getvalue()


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None)  # URLError wraps the socket's error
    e = reason if isinstance(reason, BaseException) else e
    text = getattr(e, "strerror", None) or str(e) or "no detail"
    return f"{type(e).__name__}: {text}"


def _excerpt(body: bytes) -> str:
    return repr(body[:80]) + ("..." if len(body) > 80 else "")


def _error_text(e: urllib.error.HTTPError) -> str:
    """The first line of an error reply: this project's {"error": ...}, else its text."""
    try:
        body = e.read(4096)
    except (OSError, HTTPException):
        body = b""
    try:
        text = str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    # a Python traceback ends with the exception's own line: the one worth showing
    line = lines[-1] if lines and lines[0].startswith("Traceback") else (lines or ["(no body)"])[0]
    return line[:300]
