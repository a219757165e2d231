"""A loopback server that answers every request with the same raw bytes, as a careless or hostile reward server
would: any status line, headers and body, optionally a byte at a time (tests/test_reward_server.py and
benchmarks/sweep_bad_input.py point a client at it).

    with scripted(b"HTTP/1.0 302 Found\\r\\nLocation: http://elsewhere:1/\\r\\n\\r\\n") as (url, requests):
        ...   # requests: (method, path, body) of each request it read, in order
"""

import contextlib
import pickle
import re
import socketserver
import threading


def http_reply(body: bytes, status: str = "200 OK", headers: str | None = None) -> bytes:
    """A raw HTTP/1.0 reply: the status line, `headers` (default: its Content-Length) and the body."""
    headers = f"Content-Length: {len(body)}\r\n" if headers is None else headers
    return f"HTTP/1.0 {status}\r\n{headers}\r\n".encode() + body


@contextlib.contextmanager
def scripted(reply: bytes, trickle_s: float = 0.0):
    """Serve `reply` to every request (after reading it whole), `trickle_s` seconds between its bytes; yields
    (its URL http://127.0.0.1:PORT, the list of requests it read)."""
    requests, stop = [], threading.Event()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = self.rfile.readline(65537)
                if not line:
                    return
                head += line
            size = re.search(rb"(?im)^content-length: *(\d+)", head)
            body = self.rfile.read(int(size[1])) if size else b""
            method, path = head.split(b" ")[:2]
            requests.append((method.decode(), path.decode(), body))
            try:
                if not trickle_s:
                    self.wfile.write(reply)
                for i in range(len(reply) if trickle_s else 0):
                    if stop.wait(trickle_s):
                        return
                    self.wfile.write(reply[i : i + 1])
                    self.wfile.flush()
            except OSError:  # the client gave up: what a trickle is for
                pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def cyclic_pickle() -> bytes:
    """flow_grpo's reply format, its score list holding itself (29 bytes)."""
    scores: list = []
    scores.append(scores)
    return pickle.dumps({"scores": scores}, 4)


def shared_pickle(levels: int = 60) -> bytes:
    """A reply whose scores nest one shared list `levels` deep: 2**levels paths, a few hundred bytes."""
    x: list = [0.5]
    for _ in range(levels):
        x = [x, x]
    return pickle.dumps({"scores": x}, 4)


def memo_bomb(index: int = 10**7) -> bytes:
    """A 9-byte pickle (an empty list, memoized at `index`): the C unpickler sizes its memo by the index."""
    return b"\x80\x04]r" + index.to_bytes(4, "little") + b"."
