"""Serve rewards over HTTP for `--reward remote:NAME@http://HOST:PORT` (remote_reward.py;
docs/usage.md, "Serving a scorer" and "What the server accepts").

    python -m common.plumbing.reward_server --reward toyworld --port 8000         the toy scorer (default)
    python -m common.plumbing.reward_server --reward "pickscore,aesthetic" --device cuda --port 8000
    python -m common.plumbing.reward_server --scorer ocr=my_scorers:ocr --port 8001   any scorer, wrapped

A scorer is fn(images: RGB PIL images, prompts, metadata: a dict or None each) -> one float per
image. The protocol, "flow-rl-reward/1": GET /health -> {"protocol", "scorers"}; POST /score
{"scorer", "images" (base64 PNG or JPEG), "prompts", "metadata"} -> {"scores"}, or a 4xx/5xx
{"error"}. A request is bounded before it is decoded, and one is scored at a time. It imports only
the standard library and Pillow at start (torch for --reward): it runs in a scorer's environment.
"""

from __future__ import annotations

import argparse
import base64
import errno
import importlib
import inspect
import io
import json
import math
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

from common.plumbing.checks import kind_of, parse_json
from common.plumbing.safe_decode import PROTOCOL, Watchdog

MAX_REQUEST_MB = 256  # 64 PNGs of 1024 px in base64 are ~150 MB
MAX_REQUEST_MB_LIMIT = 4096  # a request body is held whole in memory: past this is a typo
READ_TIMEOUT_S = 60.0  # to send a request (its line, headers and body): 256 MB at 5 MB/s
MAX_REQUEST_IMAGES = 256  # 4 times a client's batch (64, flow_grpo's)
MAX_IMAGE_PIXELS = 2**24  # 4096 x 4096
MAX_REQUEST_PIXELS = 2**26  # 64 images of 1024 x 1024: the client's batch at SD3.5's resolution
# about ten values per image: far above any request, and it bounds the objects json.loads builds
MAX_JSON_VALUES = 100_000
SCORER_NAME = re.compile(r"[\w.-]+")  # what a client can spell in remote:NAME@URL


def registry_scorer(name: str, device: str = "cpu", model_paths: str = ""):
    """A registry reward (common/rewards.py) as a scorer. The 8-bit images are held once and turned
    into floats one model batch at a time (a whole request in floats takes 12 bytes a pixel)."""
    import numpy as np
    import torch

    from common.plumbing.reward_flags import build_reward, parse_model_paths

    model = build_reward(name, device, parse_model_paths(model_paths))

    def score(images, prompts, metadata):
        if len({im.size for im in images}) > 1:
            raise ValueError("the images of one request must all be of one size")
        w, h = images[0].size if images else (0, 0)
        pixels = np.empty((len(images), h, w, 3), np.uint8)  # filled one image at a time
        for i, im in enumerate(images):
            pixels[i] = np.asarray(im)
        pixels = torch.from_numpy(pixels).permute(0, 3, 1, 2)
        step = model.batch_size
        return [
            s
            for i in range(0, len(images), step)
            for s in model(pixels[i : i + step].float() / 255, prompts[i : i + step])[:, 0].tolist()
        ]

    return score


def load_scorer(target: str):
    """'MODULE:FACTORY' -> FACTORY(), a callable. FACTORY must be a function defined in MODULE that
    takes no argument; anything else (a builtin such as os:system, a class, a name MODULE imported)
    is a one-line ValueError before it is called."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"bad scorer '{target}': expected MODULE:FACTORY, e.g. my_scorers:ocr")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - whatever importing it raises, it is one line
        raise ValueError(
            f"bad scorer '{target}': importing {module_name} failed ({_first(e)})"
        ) from None
    factory = getattr(module, attr, None)
    if not inspect.isfunction(factory) or factory.__module__ != module.__name__:
        what = "nothing" if factory is None else f"a {type(factory).__name__}"
        raise ValueError(
            f"bad scorer '{target}': {module_name}.{attr} is {what}, not a function defined in "
            f"{module_name}: FACTORY must be a `def` of MODULE that takes no argument and returns "
            "fn(images, prompts, metadata) -> scores"
        )
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ValueError(
            f"bad scorer '{target}': {attr}{inspect.signature(factory)} needs arguments: FACTORY "
            "is called with none"
        ) from None
    try:
        scorer = factory()
    except Exception as e:  # noqa: BLE001 - a factory's failure is one line, whatever it is
        raise ValueError(f"bad scorer '{target}': {attr}() failed ({_first(e)})") from None
    if not callable(scorer):
        raise ValueError(
            f"bad scorer '{target}': {attr}() returned a {type(scorer).__name__}, not a function "
            "fn(images, prompts, metadata) -> scores"
        )
    return scorer


def _first(e: BaseException) -> str:
    """'TypeError: its first line', at most 300 characters."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


class _Refused(Exception):
    """A request that cannot be scored: (HTTP status, one line)."""


def _decode_images(texts: list, max_pixels: int) -> list:
    """The RGB images of a request; each size is read from its header first, so an image over
    MAX_IMAGE_PIXELS, or all together over `max_pixels`, is refused (413) before it is decoded."""
    out, total = [], 0
    for i, text in enumerate(texts):
        try:
            data = base64.b64decode(text, validate=True)
            image = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])  # reads the header only
            w, h = image.size
            total += w * h
            if w * h > MAX_IMAGE_PIXELS or total > max_pixels:
                raise _Refused(
                    413,
                    f"image {i} is {w}x{h} pixels: a request may hold images of at most "
                    f"{MAX_IMAGE_PIXELS:,} pixels each and {max_pixels:,} in all "
                    "(--max-request-pixels): send smaller images, or fewer",
                )
            out.append(image.convert("RGB"))
        except _Refused:
            raise
        except Image.DecompressionBombError as e:  # Image.open's own check, past twice its limit
            raise _Refused(
                413,
                f"image {i} declares more than {MAX_IMAGE_PIXELS:,} pixels, the most an image may "
                f"have ({_first(e)})",
            ) from None
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds on a malformed file
            raise _Refused(400, f"image {i} is not a base64 PNG or JPEG ({_first(e)})") from None
    return out


def _parse(body: bytes, scorers: dict) -> tuple:
    """(scorer name, base64 images, prompts, metadata) of a /score request, or _Refused."""
    values = body.count(b",") + body.count(b"[") + body.count(b"{")  # at least the values - 1
    if values > MAX_JSON_VALUES:
        raise _Refused(
            413, f"the body holds about {values:,} JSON values, at most {MAX_JSON_VALUES:,}"
        )
    try:
        request = parse_json(body)  # a JSON object, at most MAX_JSON_DEPTH deep
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Refused(400, f"the body is not JSON ({e})") from None
    except ValueError as e:  # nested too deep, or not an object
        raise _Refused(400, f"the body is {e}: expected a JSON object") from None
    name, images, prompts = request.get("scorer"), request.get("images"), request.get("prompts")
    if not isinstance(name, str):
        raise _Refused(400, f'"scorer" is {kind_of(name)}, not a string: a scorer\'s name')
    if name not in scorers:
        raise _Refused(
            404, f"no scorer {name[:80]!r} here: this server serves {', '.join(scorers)}"
        )
    if not isinstance(images, list) or not isinstance(prompts, list):
        raise _Refused(400, 'expected "images" and "prompts" lists')
    if len(images) != len(prompts) or not all(isinstance(p, str) for p in prompts):
        raise _Refused(400, f"{len(images)} images but {len(prompts)} prompts: one string each")
    if len(images) > MAX_REQUEST_IMAGES:
        raise _Refused(413, f"{len(images)} images in one request, at most {MAX_REQUEST_IMAGES}")
    metadata = request.get("metadata")
    metadata = [None] * len(prompts) if metadata is None else metadata
    if (
        not isinstance(metadata, list)
        or len(metadata) != len(prompts)
        or not all(m is None or isinstance(m, dict) for m in metadata)
    ):
        raise _Refused(400, '"metadata" must be a list with one object (or null) per prompt')
    return name, images, prompts, metadata


def make_server(
    scorers: dict,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_request_mb: float = MAX_REQUEST_MB,
    read_timeout: float = READ_TIMEOUT_S,
    max_request_pixels: int = MAX_REQUEST_PIXELS,
) -> ThreadingHTTPServer:
    """An HTTP server (bound, not yet serving; port 0: a free one) for `scorers` ({name: fn}), which
    is read at each request, so it may be filled after this returns."""
    lock = threading.Lock()  # one request read, decoded and scored at a time
    limit = int(max_request_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        # each read and write; longer than the watchdog's deadline, so a request that stops coming
        # is cut by the watchdog, which answers 408, not by a read's timeout, which answers nothing
        timeout = read_timeout + 5

        def setup(self):
            super().setup()
            # the request line and headers arrive within read_timeout, however slowly trickled
            self.watchdog = Watchdog(read_timeout, self.connection, socket.SHUT_RD)

        def finish(self):
            self.watchdog.cancel()
            super().finish()

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()  # a non-finite score goes out as NaN: the client
            # (refuses it, naming this server); headers even to a request line without a version
            self.request_version = "HTTP/1.0"
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if status == 405:
                self.send_header("Allow", "GET, POST")
            if status >= 400:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _refuse(self, status: int, message: str) -> None:
            self.log_message("refused (%d): %s", status, message)
            self._reply(status, {"error": message})

        def _late(self) -> bool:
            """True, after answering 408, when the watchdog cut the request line or headers."""
            self.watchdog.cancel()
            if self.watchdog.fired:
                message = f"the request did not arrive within {read_timeout:g} s (--read-timeout)"
                self._refuse(408, message)
            return self.watchdog.fired

        def send_error(self, code, message=None, explain=None):
            """http.server's own refusals (a malformed request line, too long a header, a method
            with no do_ handler), as the documented JSON error instead of an HTML page."""
            if self._late():
                return
            if code == 501:  # a method this server has no handler for
                code, message = 405, f"no {str(self.command)[:40]} here"
            text = message or self.responses.get(code, ("error",))[0]
            self.log_message("refused (%d): %s", code, text)
            self._reply(code, {"error": f"{text}: GET /health or POST /score"})

        def do_GET(self):
            if self._late():
                return
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"protocol": PROTOCOL, "scorers": list(scorers)})
            else:
                self._reply(
                    404, {"error": f"no {self.path[:200]} here: GET /health or POST /score"}
                )

        def _content_length(self) -> int:
            """The body's size: one Content-Length of digits, at most the limit (a negative one
            would read to the end of the connection), or _Refused."""
            if self.headers.get("Transfer-Encoding") is not None:
                raise _Refused(411, "a chunked request is not read: send it with a Content-Length")
            given = self.headers.get_all("Content-Length") or []
            if not given:
                raise _Refused(411, "a request needs its Content-Length")
            if len(set(given)) != 1 or not re.fullmatch(r"[0-9]{1,20}", given[0]):
                shown = ", ".join(given)[:80]
                raise _Refused(400, f"Content-Length {shown!r} is not one byte count")
            size = int(given[0])
            if size > limit:
                raise _Refused(
                    413,
                    f"a request of {size} bytes is over this server's limit of "
                    f"{max_request_mb:g} MiB (--max-request-mb): send fewer images",
                )
            return size

        def do_POST(self):
            if self._late():
                return
            try:
                if self.path.rstrip("/") != "/score":
                    raise _Refused(404, f"no {self.path[:200]} here: POST /score")
                size = self._content_length()
                with lock:
                    # its turn: the body arrives within read_timeout from now
                    self.watchdog = Watchdog(read_timeout, self.connection, socket.SHUT_RD)
                    body = bytearray()  # what arrived, kept when a read times out
                    try:
                        while len(body) < size and (chunk := self.rfile.read1(size - len(body))):
                            body += chunk
                    except OSError:  # the per-read timeout
                        pass
                    self.watchdog.cancel()
                    if len(body) < size:
                        raise _Refused(
                            408,
                            f"the request's body did not arrive within {read_timeout:g} s (got "
                            f"{len(body)} of its {size} bytes)",
                        )
                    name, texts, prompts, metadata = _parse(body, scorers)
                    del body
                    images = _decode_images(texts, max_request_pixels)
                    start = time.perf_counter()
                    try:
                        scores = [float(s) for s in scorers[name](images, prompts, metadata)]
                    except Exception as e:
                        raise _Refused(500, f"scorer {name!r}: {_first(e)}") from e
                    seconds = time.perf_counter() - start
                if len(scores) != len(images):
                    raise _Refused(
                        500,
                        f"scorer {name!r} returned {len(scores)} scores for {len(images)} images",
                    )
                self.log_message("%s: %d images in %.3f s", name, len(images), seconds)
                self._reply(200, {"scores": scores})
            except _Refused as e:
                self._refuse(*e.args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class _OneLineParser(argparse.ArgumentParser):
    """argparse's mistakes (an unknown flag, a value that does not parse) in one line."""

    def error(self, message):
        raise SystemExit(f"error: {message} (see python -m common.plumbing.reward_server --help)")


# flag -> (lowest, highest, what it is): each checked before the server binds its port
LIMITS = {
    "port": (0, 65535, "a TCP port; 0: any free one"),
    "max_request_mb": (2**-20, MAX_REQUEST_MB_LIMIT, "MiB of one request's body, held in memory"),
    "read_timeout": (0.001, 3600, "seconds a client has to send a request"),
    "max_request_pixels": (1, 2**31, "pixels of one request's images together"),
}


def _bind(a, scorers: dict) -> ThreadingHTTPServer:
    """The server of --host and --port, its flags checked, or one line saying why it cannot be."""
    for name, (lo, hi, what) in LIMITS.items():
        value = getattr(a, name)
        if not (math.isfinite(value) and lo <= value <= hi):
            raise SystemExit(
                f"error: --{name.replace('_', '-')} {value}: must be in [{lo:g}, {hi:g}] ({what})"
            )
    for item in a.scorer:
        name, eq, target = item.partition("=")
        if not eq or not SCORER_NAME.fullmatch(name) or not target:
            raise SystemExit(
                f"error: --scorer {item}: expected NAME=MODULE:FACTORY, NAME of letters, digits, "
                "'_', '.' and '-' (as a client spells remote:NAME@URL)"
            )
    try:
        return make_server(
            scorers, a.host, a.port, a.max_request_mb, a.read_timeout, a.max_request_pixels
        )
    except OSError as e:
        fix = {
            errno.EADDRINUSE: "another process serves on that port: stop it, or pick another "
            "--port (0: any free one)",
            errno.EADDRNOTAVAIL: "that address is not one of this machine's: use 127.0.0.1, "
            "0.0.0.0 (every interface) or an address of one of its interfaces",
            errno.EACCES: "ports below 1024 need privileges: pick a port from 1024 up",
        }.get(e.errno, "check --host and --port")
        raise SystemExit(
            f"error: cannot serve on {a.host}:{a.port} ({type(e).__name__}: {e.strerror or e}): "
            f"{fix}"
        ) from None


def main(argv: list[str] | None = None) -> None:
    p = _OneLineParser(
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
        help="serve FACTORY() of MODULE as NAME (repeatable): FACTORY is a function defined in "
        "MODULE that takes no argument and returns fn(images, prompts, metadata) -> scores",
    )
    p.add_argument("--reward-model-paths", default="", help="as the training scripts' flag")
    p.add_argument("--device", default="cpu", help="device of the registry rewards")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to be reached from other machines")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB)
    p.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, help="seconds")
    p.add_argument("--max-request-pixels", type=int, default=MAX_REQUEST_PIXELS)
    a = p.parse_args(argv)
    scorers: dict = {}  # filled after the port is bound: a busy port is one line in a blink
    server = _bind(a, scorers)
    try:
        if a.reward or not a.scorer:
            from common.plumbing.remote_reward import is_remote
            from common.plumbing.reward_flags import parse_reward_spec

            for name, _ in parse_reward_spec(a.reward or "toyworld"):
                if is_remote(name):
                    raise ValueError(f"--reward {name}: a server serves local rewards")
                scorers[name] = registry_scorer(name, a.device, a.reward_model_paths)
        for item in a.scorer:
            name, _, target = item.partition("=")
            if name in scorers:
                raise ValueError(f"--scorer {item}: {name} is served already")
            scorers[name] = load_scorer(target)
    except SystemExit:
        server.server_close()
        raise
    except Exception as e:  # noqa: BLE001 - a scorer that cannot load is one line, whatever it is
        server.server_close()
        text = str(e) if isinstance(e, ValueError) else _first(e)
        raise SystemExit(f"error: {text}") from None
    print(
        f"serving {', '.join(scorers)} on http://{a.host}:{server.server_port} ({PROTOCOL})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
