"""Stand-in reward servers and scorers that tests/test_reward_server.py starts and breaks on purpose.

python tests/reward_stub.py MODE [ARG] [--port P]   serve on loopback (port 0: a free one); the first line on stdout
                                                   is "serving on http://127.0.0.1:PORT". Standard library (and
                                                   Pillow to read images), so it starts in a blink.
  ok                this project's protocol: one score per image, its mean brightness in [0, 1]
  slow S            as ok, after S seconds
  count             one score too few
  nan               the first score NaN
  status CODE       answers CODE with {"error": ...}
  malformed         answers 200 with an HTML page
  oversized         answers 200 with 17 MiB and no Content-Length
  reset             resets the connection (RST) without a reply
  flaky N           resets the first N requests, then as ok
  die-after N       answers N requests as ok, then exits without a reply
  flowgrpo          flow_grpo's reward-server (app_geneval.py): a pickled {"images": [JPEG], "meta_datas", ...} in,
                    a pickled {"scores", "rewards", "strict_rewards", "group_rewards", ...} out
  evil PATH         flow_grpo's protocol, answering a pickle that creates PATH when loaded
Each request, and each reply, is appended to $STUB_LOG (if set) as a JSON line: what the request held (method, n,
...), the reply's bytes (reply, base64).

The scorers, for `python -m common.plumbing.reward_server --scorer NAME=tests.reward_stub:FACTORY`:
  brightness        the mean brightness, plus the metadata's "bonus" (0 without one)
  toyworld_until    the registry's toyworld, until call $STUB_DIE_AFTER + 1, where the process exits
"""

import base64
import io
import json
import os
import pickle
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def brightness_of(image) -> float:
    from PIL import ImageStat

    return sum(ImageStat.Stat(image.convert("RGB")).mean) / (3 * 255)


# ---------------------------------------------------------------------------------------------- scorers
def brightness():
    return lambda images, prompts, metadata: [
        brightness_of(im) + (m or {}).get("bonus", 0) for im, m in zip(images, metadata)
    ]


def toyworld_until():
    from common.plumbing.reward_server import registry_scorer

    score, left = registry_scorer("toyworld"), [int(os.environ["STUB_DIE_AFTER"])]

    def scorer(images, prompts, metadata):
        if left[0] == 0:
            os._exit(0)  # the server dies mid-run: this request gets no reply
        left[0] -= 1
        return score(images, prompts, metadata)

    return scorer


# ---------------------------------------------------------------------------------------------- servers
class Evil:
    """Pickles as `io.open(path, "w")`: loading it with pickle.loads creates the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def main(argv):
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 0
    argv = [a for i, a in enumerate(argv) if a != "--port" and (i == 0 or argv[i - 1] != "--port")]
    mode, arg = argv[0], (argv[1] if len(argv) > 1 else None)
    seen, lock = [0], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _log(self, **entry):
            if os.environ.get("STUB_LOG"):
                with open(os.environ["STUB_LOG"], "a") as f:
                    f.write(json.dumps(entry) + "\n")

        def _send(self, status, body: bytes, length=True):
            self._log(reply=base64.b64encode(body).decode())
            self.send_response(status)
            if length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                pass

        def _reset(self):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()

        def do_GET(self):
            self._log(method="GET", path=self.path)
            if mode in ("flowgrpo", "evil"):  # Flask, with a POST-only route
                self._send(405, b"Method Not Allowed")
            else:
                self._send(
                    200, json.dumps({"protocol": "flow-rl-reward/1", "scorers": ["stub"]}).encode()
                )

        def do_POST(self):
            from PIL import Image

            with lock:
                seen[0] += 1
                n = seen[0]
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received = {"method": "POST", "path": self.path, "n": n}
            if mode in ("flowgrpo", "evil"):
                data = pickle.loads(body)  # flow_grpo's server does this with every request
                images = [Image.open(io.BytesIO(d), formats=["jpeg"]) for d in data["images"]]
                received.update(
                    keys=sorted(data),
                    meta_datas=data["meta_datas"],
                    only_strict=data["only_strict"],
                    prompts=data.get("prompts"),
                    formats=[im.format for im in images],
                )
                self._log(**received)
                if mode == "evil":
                    return self._send(200, pickle.dumps(Evil(arg)))
                scores = [brightness_of(im) for im in images]
                reply = {
                    "scores": scores,
                    "rewards": [0.0] * len(scores),
                    "strict_rewards": [0.0] * len(scores),
                    "group_rewards": {"counting": [-10.0] * len(scores)},
                    "group_strict_rewards": {},
                }
                return self._send(200, pickle.dumps(reply))
            request = json.loads(body)
            self._log(**received, prompts=request["prompts"], metadata=request.get("metadata"))
            if mode == "reset" or (mode == "flaky" and n <= int(arg)):
                return self._reset()
            if mode == "die-after" and n > int(arg):
                os._exit(0)
            if mode == "slow":
                time.sleep(float(arg))
            if mode == "status":
                return self._send(
                    int(arg), json.dumps({"error": "CUDA out of memory (stand-in)"}).encode()
                )
            if mode == "malformed":
                return self._send(200, b"<html><body>Bad Gateway</body></html>")
            if mode == "oversized":
                self.close_connection = True
                return self._send(200, b"0" * (17 << 20), length=False)
            scores = [
                brightness_of(Image.open(io.BytesIO(base64.b64decode(im))))
                for im in request["images"]
            ]
            if mode == "count":
                scores = scores[:-1]
            if mode == "nan":
                scores[0] = float("nan")
            self._send(200, json.dumps({"scores": scores}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)  # a retry arrives while one sleeps
    print(f"serving on http://127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
