"""Serve rewards over HTTP for `--reward remote:NAME@http://HOST:PORT` (common/plumbing/remote_reward.py).

    python -m common.plumbing.reward_server --reward toyworld --port 8000         the toy scorer (default)
    python -m common.plumbing.reward_server --reward "pickscore,aesthetic" --device cuda --port 8000 \\
        --reward-model-paths pickscore=/models/PickScore_v1              any registry reward
    python -m common.plumbing.reward_server --scorer ocr=my_scorers:ocr --port 8001   any scorer, wrapped

A scorer is `fn(images, prompts, metadata) -> one float per image`: images a list of RGB PIL
images, prompts a list of strings, metadata a list of what the client sent for each prompt (a dict
or None). `--scorer NAME=MODULE:FACTORY` imports MODULE and calls FACTORY() once, at start (load the
models there), for the scorer; `serve({"ocr": fn}, port=8001)` does the same from Python. A registry
reward is served under its own name and scores the 8-bit image as the training scripts send it.

The wire format, "flow-rl-reward/1": JSON both ways, images in base64, nothing in it that can run
code on either side.

    GET  /health -> 200 {"protocol": "flow-rl-reward/1", "scorers": ["toyworld", ...]}
    POST /score  {"scorer": "toyworld", "images": ["<base64 PNG or JPEG>", ...],
                  "prompts": ["...", ...], "metadata": [{...} or null, ...]}  (metadata optional)
              -> 200 {"scores": [float, ...]}   one per image, in order
              -> 4xx or 5xx {"error": "one line"}

Scoring is one request at a time (a model is not shared between threads); requests are read and
their images decoded concurrently. A request body is refused above --max-request-mb (413).

Only the standard library and Pillow are imported at start (torch and the registry only for
--reward), so the module runs in a scorer's own environment, from a checkout of this repository:
`/envs/geneval/bin/python -m common.plumbing.reward_server --scorer geneval=my_scorers:geneval`.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import importlib
import io
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

PROTOCOL = "flow-rl-reward/1"
MAX_REQUEST_MB = 256  # 64 PNGs of 1024 px in base64 are ~150 MB


def registry_scorer(name: str, device: str = "cpu", model_paths: str = ""):
    """A registry reward (common/rewards.py) as a scorer: the 8-bit images, as floats in [0, 1]."""
    import numpy as np
    import torch

    from common.rewards import build_reward, parse_model_paths

    model = build_reward(name, device, parse_model_paths(model_paths))

    def score(images, prompts, metadata):
        pixels = torch.from_numpy(np.stack([np.asarray(im) for im in images]))
        return model(pixels.permute(0, 3, 1, 2).float() / 255, prompts)[:, 0].tolist()

    return score


def load_scorer(target: str):
    """'MODULE:FACTORY' -> FACTORY(), which must be a scorer (callable)."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"bad scorer '{target}': expected MODULE:FACTORY, e.g. my_scorers:ocr")
    factory = getattr(importlib.import_module(module), attr, None)
    if not callable(factory):
        raise ValueError(f"bad scorer '{target}': {module} has no callable '{attr}'")
    scorer = factory()
    if not callable(scorer):
        raise ValueError(
            f"bad scorer '{target}': {attr}() returned a {type(scorer).__name__}, not a function "
            "fn(images, prompts, metadata) -> scores"
        )
    return scorer


class _Refused(Exception):
    """A request that cannot be scored: (HTTP status, one line)."""


def _decode_image(text, i: int) -> Image.Image:
    try:
        data = base64.b64decode(text, validate=True)
        image = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])
        return image.convert("RGB")
    except (binascii.Error, TypeError, ValueError, OSError) as e:
        raise _Refused(
            400, f"image {i} is not a base64 PNG or JPEG ({type(e).__name__}: {e})"
        ) from None


def _parse(body: bytes, scorers: dict) -> tuple:
    """(scorer name, images, prompts, metadata) of a /score request, or _Refused."""
    try:
        request = json.loads(body)
    except ValueError as e:
        raise _Refused(400, f"the body is not JSON ({e})") from None
    if not isinstance(request, dict):
        raise _Refused(400, "the body is not a JSON object")
    name, images, prompts = request.get("scorer"), request.get("images"), request.get("prompts")
    if name not in scorers:
        raise _Refused(404, f"no scorer {name!r} here: this server serves {', '.join(scorers)}")
    if not isinstance(images, list) or not isinstance(prompts, list):
        raise _Refused(400, 'expected "images" and "prompts" lists')
    if len(images) != len(prompts) or not all(isinstance(p, str) for p in prompts):
        raise _Refused(400, f"{len(images)} images but {len(prompts)} prompts: one string each")
    metadata = request.get("metadata") or [None] * len(prompts)
    if not isinstance(metadata, list) or len(metadata) != len(prompts):
        raise _Refused(400, '"metadata" must be a list with one entry (or null) per prompt')
    return name, [_decode_image(im, i) for i, im in enumerate(images)], prompts, metadata


def make_server(
    scorers: dict, host: str = "127.0.0.1", port: int = 8000, max_request_mb: float = MAX_REQUEST_MB
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for `scorers` ({name: fn}); port 0 picks a free one."""
    lock = threading.Lock()  # one scoring at a time
    limit = int(max_request_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()  # a non-finite score goes out as NaN: the client
            self.send_response(status)  # refuses it, naming this server
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"protocol": PROTOCOL, "scorers": list(scorers)})
            else:
                self._reply(404, {"error": f"no {self.path} here: GET /health or POST /score"})

        def do_POST(self):
            try:
                if self.path.rstrip("/") != "/score":
                    raise _Refused(404, f"no {self.path} here: POST /score")
                try:
                    size = int(self.headers["Content-Length"])
                except (TypeError, ValueError):
                    raise _Refused(411, "a request needs its Content-Length") from None
                if size > limit:
                    self.close_connection = True  # its body is not read
                    raise _Refused(
                        413,
                        f"a request of {size} bytes is over this server's limit of "
                        f"{max_request_mb:g} MiB (--max-request-mb): send fewer images",
                    )
                name, images, prompts, metadata = _parse(self.rfile.read(size), scorers)
                with lock:
                    start = time.perf_counter()
                    try:
                        scores = [float(s) for s in scorers[name](images, prompts, metadata)]
                    except Exception as e:
                        first = (str(e).strip().splitlines() or [""])[0][:300]
                        raise _Refused(500, f"scorer {name!r}: {type(e).__name__}: {first}") from e
                    seconds = time.perf_counter() - start
                if len(scores) != len(images):
                    raise _Refused(
                        500,
                        f"scorer {name!r} returned {len(scores)} scores for {len(images)} images",
                    )
                self.log_message("%s: %d images in %.3f s", name, len(images), seconds)
                self._reply(200, {"scores": scores})
            except _Refused as e:
                status, message = e.args
                self.log_message("refused (%d): %s", status, message)
                self._reply(status, {"error": message})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(
    scorers: dict, host: str = "127.0.0.1", port: int = 8000, max_request_mb: float = MAX_REQUEST_MB
) -> None:
    """Serve `scorers` ({name: fn(images, prompts, metadata) -> scores}) until interrupted. The
    first line on stdout gives the URL (with port 0, the port picked)."""
    server = make_server(scorers, host, port, max_request_mb)
    print(
        f"serving {', '.join(scorers)} on http://{host}:{server.server_port} ({PROTOCOL})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m common.plumbing.reward_server",
        description="Serve registry rewards, or any scorer, for --reward remote:NAME@http://HOST:PORT",
    )
    p.add_argument(
        "--reward",
        help="registry rewards to serve, each under its own name, e.g. 'toyworld,jpeg_compressibility' "
        "(default: toyworld, unless --scorer is given)",
    )
    p.add_argument(
        "--scorer",
        action="append",
        default=[],
        metavar="NAME=MODULE:FACTORY",
        help="serve FACTORY() of MODULE as NAME (repeatable)",
    )
    p.add_argument("--reward-model-paths", default="", help="as the training scripts' flag")
    p.add_argument("--device", default="cpu", help="device of the registry rewards")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to be reached from other machines")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB)
    a = p.parse_args(argv)
    scorers = {}
    try:
        if a.reward or not a.scorer:
            from common.rewards import is_remote, parse_reward_spec

            for name, _ in parse_reward_spec(a.reward or "toyworld"):
                if is_remote(name):
                    raise ValueError(f"--reward {name}: a server serves local rewards")
                scorers[name] = registry_scorer(name, a.device, a.reward_model_paths)
        for item in a.scorer:
            name, eq, target = item.partition("=")
            if not eq or not name or name in scorers:
                raise ValueError(
                    f"--scorer {item}: expected NAME=MODULE:FACTORY with a NAME not served yet"
                )
            scorers[name] = load_scorer(target)
    except (ValueError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None
    serve(scorers, a.host, a.port, a.max_request_mb)


if __name__ == "__main__":
    sys.exit(main())
