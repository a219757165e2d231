"""A reward scored by a server over HTTP: the client behind `--reward remote:NAME@URL`, e.g.
"remote:geneval@http://127.0.0.1:8000" (this project's reward_server.py: JSON, PNG in base64) or
"remote:geneval@flowgrpo+http://127.0.0.1:18085:2.0" (flow_grpo's reward-server at 7131478,
github.com/yifan123/reward-server: pickles both ways); docs/usage.md, "Rewards from a server". A
reply is decoded only as plain data (safe_decode.py): it can give wrong scores, never run code here;
each try ends at its deadline however slowly the reply comes. `submit` scores on one background
thread per server, so the next rollout batch samples while this one is scored.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import os
import pickle
import queue
import re
import socket
import threading
import time
import urllib.parse
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch
from PIL import Image

from common.plumbing.safe_decode import PROTOCOL, Watchdog, _excerpt, _json, decode_reply

MAX_REQUEST_IMAGES = 64  # flow_grpo's geneval_score sends batches of 64
# flow_grpo's GenEval reply for 64 images is a few KB; the cap bounds what decoding one can cost
MAX_REPLY_BYTES = 1 << 20
ERROR_BYTES = 4096  # of an error reply: its first line is shown
CHECK_TIMEOUT_S = 5.0  # the start-up check: a wrong URL is one line in seconds
RETRIED_STATUSES = (429, 502, 503, 504)  # busy or restarting; anything else would come again
# option -> (default, lowest, highest, what is expected): checked when --reward is parsed
OPTIONS = {
    "timeout": (120.0, 0, 3600, "seconds in (0, 3600]"),
    "retries": (5, 0, 100, "an integer in [0, 100]"),
    "backoff": (1.0, 0, 3600, "seconds in [0, 3600]"),
}
MAX_BUDGET_S = 3600  # a request's tries and waits: a run its server stops resumes bit for bit
GRACE_S = 10.0  # past a request's budget, for decoding its reply, before gather gives up on it
SPELLING = (
    "remote:NAME@http://HOST:PORT[/PATH][?timeout=S&retries=N&backoff=S][:WEIGHT], or "
    "flowgrpo+http://... for a flow_grpo reward-server"
)
_SPEC = re.compile(
    r"remote:(?P<scorer>[\w.-]+)@(?P<wire>flowgrpo\+)?(?P<url>https?://"
    r"(?:\[[0-9A-Fa-f:.]+\]|[^/:?@\[\]\s]+):\d+(?:/[^:?\s]*)?)(?:\?(?P<query>[^:\s]*))?"
    r"(?::(?P<weight>[^:]*))?"
)


class RemoteRewardError(SystemExit):
    """A reward server failed or sent something unusable: one line, no traceback."""

    def __init__(self, detail: str):
        super().__init__(f"error: {detail}")
        self.detail = detail

    def stopping(self) -> RemoteRewardError:
        """The same line, ending with how to go on when a run is under way in this process."""
        from common.plumbing.run import continue_hint_of_this_run

        hint = continue_hint_of_this_run()
        if not hint:
            return self
        return RemoteRewardError(f"{self.detail}; the run stops ({hint} once the server answers)")


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

    @property
    def budget(self) -> float:
        """Seconds that all tries of one request and the waits between them take at most."""
        return (self.retries + 1) * self.timeout + self.backoff * (2**self.retries - 1)


def is_remote(item: str) -> bool:
    return item.strip().startswith("remote:")


def parse_remote(item: str) -> tuple[RemoteSpec, str | None]:
    """'remote:NAME@URL[?query][:WEIGHT]' -> (its spec, the weight as written or None), or a
    ValueError of one line."""
    item = item.strip()
    m = _SPEC.fullmatch(item)
    if not m:
        raise ValueError(
            f"bad remote reward '{item}': expected {SPELLING}, e.g. "
            "'remote:geneval@http://127.0.0.1:8000' (the port is required)"
        )
    try:
        port = urllib.parse.urlsplit(m["url"]).port
    except ValueError:  # past 65535
        port = None
    if not port:
        raise ValueError(
            f"bad remote reward '{item[:200]}': its port must be in 1..65535, e.g. "
            "'remote:geneval@http://127.0.0.1:8000'"
        )
    options = {key: default for key, (default, *_) in OPTIONS.items()}
    try:
        pairs = urllib.parse.parse_qsl(m["query"] or "", strict_parsing=bool(m["query"]))
    except ValueError:
        pairs = [("", "")]
    for key, value in pairs:
        if key not in OPTIONS:
            raise ValueError(
                f"bad option '{key}' in remote reward '{item}': expected timeout, "
                "retries or backoff, e.g. '?timeout=30&retries=3'"
            )
        _, lo, hi, expected = OPTIONS[key]
        try:
            number = int(value) if key == "retries" else float(value)
        except ValueError:  # also an integer of more than 4300 digits
            number = math.nan
        # (nan fails every comparison; timeout 0 would never wait)
        if not (lo <= number <= hi) or (key == "timeout" and number == 0):
            raise ValueError(
                f"bad {key}={value[:40]} in remote reward '{item[:200]}': expected {expected}"
            )
        options[key] = number
    weight = m["weight"]
    text = item[: m.start("weight") - 1] if weight is not None else item
    spec = RemoteSpec(text, m["scorer"], m["url"], "flowgrpo" if m["wire"] else "json", **options)
    if spec.budget > MAX_BUDGET_S:
        raise ValueError(
            f"remote reward '{item[:200]}': timeout={spec.timeout:g}, retries={spec.retries} and "
            f"backoff={spec.backoff:g} let one request take {spec.budget:.0f} s ({spec.retries + 1} "
            f"tries and the waits between them), over the limit of {MAX_BUDGET_S} s: lower one of "
            "them (a run its server stops resumes bit for bit with --resume)"
        )
    return spec, weight


def load_metadata(path: str) -> dict[str, dict]:
    """{prompt: its metadata} from a JSON-lines file (or every *.jsonl of a folder), one object with
    its "prompt" a line (GenEval's train_metadata.jsonl as it is), or a ValueError of one line."""
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


class _Retry(Exception):
    """A failure worth trying again (busy, restarting, slow, not yet up); `reason`: what the
    connection said, for the start-up check's line (the message, unless given)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class _Scores(Future):
    """The Future `submit` returns: result() waits no longer than the request's budget and GRACE_S,
    wherever its thread is stuck (a name lookup, which no socket timeout bounds)."""

    def __init__(self, reward: RemoteReward):
        super().__init__()
        self._reward = reward

    def result(self, timeout=None):
        while timeout is None and not wait([self], 1.0).done:
            self._reward.raise_if_stuck()
        return super().result(timeout)


class RemoteReward:
    """One scorer on a reward server: `score` in the caller's thread, or `submit` on this reward's
    background thread, returning a Future of the scores."""

    overlap = True  # False: submit scores at once, in the caller's thread (the sequential arm)

    def __init__(self, spec: RemoteSpec, metadata: dict[str, dict] | None = None):
        self.spec, self.metadata = spec, metadata
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._give_up_at: float | None = None  # the request under way: its budget's end + GRACE_S

    def __repr__(self):
        return f"RemoteReward({self.spec.text})"

    def _where(self) -> str:
        return f"remote reward '{self.spec.name}' at {self.spec.url}"

    def check(self, prompt_files: dict[str, list[str]]) -> None:
        """That the server answers (this project's: that it serves the scorer) within
        CHECK_TIMEOUT_S, and that the metadata, if any, has every prompt; else one-line ValueError."""
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
        url = health if self.spec.wire == "json" else self.spec.url
        try:
            status, _, _, body = self._exchange(
                "GET", url, None, {}, min(self.spec.timeout, CHECK_TIMEOUT_S)
            )
        except _Retry as e:
            raise ValueError(
                f"{self._where()}: no server answers ({e.reason}): start it (e.g. `python -m "
                "common.plumbing.reward_server --reward toyworld --port 8000`) or fix the URL in --reward"
            ) from None
        if self.spec.wire == "flowgrpo":  # it answers: enough for flow_grpo's (POST only)
            return
        try:
            info = _json(body) if status == 200 else None
        except ValueError:
            info = None
        scorers = info.get("scorers") if isinstance(info, dict) else None
        if not isinstance(scorers, list) or info.get("protocol") != PROTOCOL:
            raise ValueError(
                f"{self._where()}: not a {PROTOCOL} server (GET {health} answered {status} "
                f"{_excerpt(body)}): a flow_grpo reward-server is spelled "
                f"remote:{self.spec.scorer}@flowgrpo+{self.spec.url}"
            )
        if self.spec.scorer not in scorers:
            names = ", ".join(
                _printable(x, 80) if isinstance(x, str) else show(x) for x in scorers[:20]
            )
            raise ValueError(
                f"{self._where()}: the server serves {names}, not "
                f"'{self.spec.scorer}': use one of those names, or start it with that scorer"
            )

    def submit(self, images: torch.Tensor, prompts: list[str], cancel: threading.Event) -> Future:
        """Future of `score(images, prompts)`, run on this reward's thread after the batches
        submitted before it (overlap False: at once, here); `cancel` set stops it before a retry."""
        future = _Scores(self)
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

    def raise_if_stuck(self) -> None:
        """RemoteRewardError when the request under way is past its budget and GRACE_S."""
        give_up_at = self._give_up_at
        if give_up_at is not None and time.monotonic() > give_up_at:
            raise RemoteRewardError(
                f"{self._where()}: no reply within the request's budget of "
                f"{self.spec.budget:g} s and {GRACE_S:g} s more (its thread is stuck, e.g. in a "
                "name lookup): check the server's host"
            )

    def score(
        self, images: torch.Tensor, prompts: list[str], cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """images uint8 [B,3,H,W] on the CPU -> float32 scores [B], in requests of at most
        MAX_REQUEST_IMAGES images; a failure is RemoteRewardError, one line."""
        out: list[float] = []
        for i in range(0, len(images), MAX_REQUEST_IMAGES):
            chunk = images[i : i + MAX_REQUEST_IMAGES].permute(0, 2, 3, 1).numpy()
            body = self._request(chunk, prompts[i : i + MAX_REQUEST_IMAGES])
            reply = self._post(body, cancel or threading.Event())
            try:
                decoded = decode_reply(reply, self.spec.wire)
            except ValueError as e:
                raise RemoteRewardError(f"{self._where()} sent {e}") from None
            try:
                out += _scores_of(decoded, len(chunk), self.spec.wire)
            except ValueError as e:
                raise RemoteRewardError(f"{self._where()}: {e}") from None
        return torch.tensor(out, dtype=torch.float32)

    def _request(self, images, prompts: list[str]) -> bytes:
        """One request's body: this project's JSON (lossless PNG, base64) or flow_grpo's pickle
        (JPEG at PIL's default quality 75, as its client)."""
        metadata = [self.metadata.get(p.strip()) if self.metadata else None for p in prompts]
        if self.spec.wire == "json":
            images = [base64.b64encode(_encode(a, "PNG")).decode() for a in images]
            request = dict(
                scorer=self.spec.scorer, images=images, prompts=prompts, metadata=metadata
            )
            return json.dumps(request).encode()
        # GenEval reads meta_datas: without a metadata file each carries its prompt; scores do not
        # depend on only_strict (True skips GenEval's non-strict check, unused here)
        meta_datas = [m if m is not None else {"prompt": p} for m, p in zip(metadata, prompts)]
        images = [_encode(a, "JPEG") for a in images]
        request = dict(images=images, prompts=prompts, meta_datas=meta_datas, only_strict=True)
        return pickle.dumps(request, protocol=4)

    def _post(self, body: bytes, cancel: threading.Event) -> bytes:
        """POST with retries, all within the spec's budget: the reply's body, or RemoteRewardError."""
        s = self.spec
        url = s.url.rstrip("/") + "/score" if s.wire == "json" else s.url
        kind = "application/json" if s.wire == "json" else "application/octet-stream"
        start, delay = time.monotonic(), s.backoff
        self._give_up_at = start + s.budget + GRACE_S
        try:
            for attempt in range(1, s.retries + 2):
                try:
                    return self._post_once(url, body, kind, s.timeout)
                except _Retry as e:
                    last = str(e)
                if attempt > s.retries or cancel.is_set() or cancel.wait(delay):
                    break
                delay *= 2
        finally:
            self._give_up_at = None
        tries = (
            f"{attempt} tr{'y' if attempt == 1 else 'ies'} over {time.monotonic() - start:.1f} s"
        )
        raise RemoteRewardError(f"{self._where()}: {last} ({tries})")

    def _post_once(self, url: str, body: bytes, kind: str, seconds: float) -> bytes:
        status, reason, headers, reply = self._exchange(
            "POST", url, body, {"Content-Type": kind}, seconds
        )
        if status == 200:
            return reply
        detail = f"answered {status} {_printable(reason, 80)}"
        if 300 <= status < 400:
            raise RemoteRewardError(
                f"{self._where()} {detail}, a redirect to {show(headers.get('Location'))} that "
                "is not followed (a reward request goes only to the URL in --reward): give the "
                "server's own URL"
            )
        detail += f": {_error_text(reply)}"
        if status in RETRIED_STATUSES:
            raise _Retry(detail)
        hint = ""
        if self.spec.wire == "flowgrpo" and self.metadata is None:
            hint = (
                f" (a GenEval server needs each prompt's metadata: --reward-model-paths "
                f"{self.spec.name}=train_metadata.jsonl)"
            )
        raise RemoteRewardError(f"{self._where()} {detail}{hint}")

    def _exchange(
        self, method: str, url: str, body: bytes | None, headers: dict, seconds: float
    ) -> tuple[int, str, http.client.HTTPMessage, bytes]:
        """One HTTP exchange that ends within `seconds` whatever the server does: (status, reason,
        headers, body: at most MAX_REPLY_BYTES of a 200, ERROR_BYTES of any other; a 3xx as it
        is). A failure to connect or a reply cut short or late is _Retry; a bad Content-Length,
        or a 200 over MAX_REPLY_BYTES, is RemoteRewardError."""
        parts = urllib.parse.urlsplit(url)
        within = f"no complete reply within the timeout of {seconds:g} s"
        connection = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        conn = connection(parts.hostname, parts.port, timeout=seconds)
        watchdog = Watchdog(seconds, lambda: conn.sock, socket.SHUT_RDWR)
        try:
            conn.request(method, parts.path or "/", body, headers)
            r = conn.getresponse()
            given = r.headers.get_all("Content-Length") or []
            if given and (len(set(given)) != 1 or not re.fullmatch(r"[0-9]{1,20}", given[0])):
                raise RemoteRewardError(
                    f"{self._where()} sent a reply with Content-Length "
                    f"{show(', '.join(given))}: expected one byte count"
                )
            cap = MAX_REPLY_BYTES if r.status == 200 else ERROR_BYTES
            size = int(given[0]) if given else None
            if r.status == 200 and size is not None and size > cap:
                raise RemoteRewardError(_too_big(self._where(), size))
            # read() with a length: a reply cut short is IncompleteRead; without: up to the cap
            reply = r.read() if size is not None and size <= cap else r.read(cap + 1)[:cap]
            if watchdog.fired:  # cut at the deadline: what was read may look whole, and is not
                raise _Retry(within)
            if r.status == 200 and size is None and len(reply) >= cap:
                raise RemoteRewardError(_too_big(self._where(), cap + 1))
            return r.status, r.reason, r.headers, reply
        # refused, reset, cut short, late, ... (ValueError: a host name idna cannot encode)
        except (OSError, http.client.HTTPException, ValueError) as e:
            if watchdog.fired or isinstance(e, TimeoutError):
                raise _Retry(within) from None
            raise _Retry(f"no reply ({_reason(e)})", _reason(e)) from None
        finally:
            watchdog.cancel()
            conn.close()


def _too_big(where: str, size: int) -> str:
    return (
        f"{where} sent a reply of more than {MAX_REPLY_BYTES >> 10} KiB ({size} bytes): a reply "
        "holds one score per image"
    )


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
    return (
        f"{type(e).__name__}: {_printable(getattr(e, 'strerror', None) or str(e) or 'no detail')}"
    )


def _error_text(body: bytes) -> str:
    """The first line of an error reply: this project's {"error": ...}, else its text."""
    try:
        reply = _json(body)
        text = reply["error"] if isinstance(reply["error"], str) else show(reply["error"])
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    # a Python traceback ends with the exception's own line: the one worth showing
    line = lines[-1] if lines and lines[0].startswith("Traceback") else (lines or ["(no body)"])[0]
    return _printable(line, 300)


def show(x) -> str:
    """A decoded value in a few words, whatever it is (a repr of a list that shares itself down 60
    levels would never end, str of a 5000-digit int raises)."""
    if isinstance(x, (dict, list)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 64:
        return f"an integer of {x.bit_length()} bits"
    text = repr(x)
    return text[:80] + ("..." if len(text) > 80 else "")


def _scores_of(reply, n: int, wire: str) -> list[float]:
    """The reply's list of n finite scores, or ValueError saying what it holds instead."""
    expected = '{"scores": [one float per image]}' if wire == "json" else 'a dict with "scores"'
    if not isinstance(reply, dict):
        raise ValueError(f"the reply is {show(reply)}, not a dict: expected {expected}")
    key = "scores" if wire == "json" or "scores" in reply else "outputs"
    if not isinstance(reply.get(key), list):
        keys = ", ".join(show(k) for k in list(reply)[:10]) + (", ..." if len(reply) > 10 else "")
        raise ValueError(f'the reply has no "{key}" list (it holds {keys}): expected {expected}')
    scores = reply[key]
    if len(scores) != n:
        raise ValueError(
            f"the reply has {len(scores)} scores for {n} images: the server must return one "
            "score per image, in order"
        )
    out = []
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise ValueError(f"score {i} of {n} is {show(s)}: a reward must be a number")
        try:
            value = float(s)
        except OverflowError:  # an int past 1.8e308
            value = math.inf
        if not math.isfinite(value):
            raise ValueError(f"score {i} of {n} is {show(s)}: a reward must be a finite number")
        out.append(value)
    return out


def _printable(text: str, limit: int = 200) -> str:
    """A server's text on one line: control characters (a newline in a bad status line) as spaces."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 2]).split())
    return text[:limit] + ("..." if len(text) > limit else "")
