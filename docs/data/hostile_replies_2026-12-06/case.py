"""One of issue #68's hostile replies (the helper's hidden cases, and a reply of a few hundred bytes sent slowly)
against the reward client of the repository in the current folder (run.sh runs them all, at two commits):
python case.py INDEX  -> one line: the case, seconds, requests the server read, what the client did."""

import json
import pickle
import sys
import time

sys.path.insert(0, "tests")
sys.path.insert(0, ".")
from hostile_server import http_reply, scripted

try:
    from common.plumbing.reward_flags import build_reward
except ImportError:
    from common.rewards import build_reward
import torch

x = torch.rand(3, 3, 16, 16)
P = ["a"] * 3
CASES = [
    ("garbage status", b"HELLO\r\n\r\n", ""),
    ("status 20", b"HTTP/1.0 20 OK\r\n\r\n", ""),
    ("200 headers forever", b"HTTP/1.0 200 OK\r\n" + b"X: y\r\n" * 200000, ""),
    ("one 100 KB header", b"HTTP/1.0 200 OK\r\nX: " + b"y" * 100000 + b"\r\n\r\n", ""),
    ("100-continue forever", b"HTTP/1.1 100 Continue\r\n\r\n" * 100000, ""),
    (
        "chunked endless trailer",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"T: x\r\n" * 500000,
        "",
    ),
    (
        "chunked huge size",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\n" + b"0" * 2000000,
        "",
    ),
    ("204", b"HTTP/1.0 204 No Content\r\n\r\n", ""),
    ("500 deep json", http_reply(b'{"error": ' + b"[" * 5000 + b"]" * 5000 + b"}", "500 Oops"), ""),
    ("500 error 10**5000", http_reply(b'{"error": 1' + b"0" * 5000 + b"}", "500 Oops"), ""),
    ("json 1e999", http_reply(b'{"scores": [1e999, 1, 1]}'), ""),
    ("json scores dicts", http_reply(json.dumps({"scores": [{"a": [1] * 1000}] * 3}).encode()), ""),
    (
        "pickle LONG4 1MB",
        http_reply(pickle.dumps({"scores": [2 ** (8 * 900000), 1, 1]})),
        "flowgrpo+",
    ),
    ("pickle bytearray p5", http_reply(pickle.dumps({"scores": bytearray(b"x")}, 5)), "flowgrpo+"),
    ("pickle 300k marks", http_reply(b"\x80\x04" + b"(" * 300000 + b"N."), "flowgrpo+"),
    ("pickle 1M GETs", http_reply(b"\x80\x04]\x94" + b"h\x00" * 400000 + b"."), "flowgrpo+"),
    ("Location 64 KB", http_reply(b"", "302 Found", "Location: " + "x" * 60000 + "\r\n"), ""),
    (
        "a few hundred bytes, a byte per 0.5 s",
        http_reply(b'{"scores": [0.1, 0.2, 0.3]}' + b" " * 300),
        "",
    ),
]
name, reply, wire = CASES[int(sys.argv[1])]
trickle = 0.5 if name.startswith("a few hundred") else 0
with scripted(reply, trickle) as (url, reqs):
    t = time.monotonic()
    try:
        build_reward(f"remote:stub@{wire}{url}?timeout=1&retries=1&backoff=0.05")(x, P)
        out = "RETURNED scores"
    except SystemExit as e:
        out = "one line: " + str(e.code).replace("\n", " | ")
    except BaseException as e:
        out = f"TRACEBACK {type(e).__name__}"
    print(f"{name:40s} {time.monotonic() - t:6.2f} s {len(reqs)} req  {out[:150]}", flush=True)
