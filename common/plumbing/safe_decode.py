"""What the reward client (remote_reward.py) and server (reward_server.py) share, standard library
only (the server runs without torch): the protocol's name, the socket watchdog, and the client's
decoding of replies in time and memory bounded by their bytes (a refusal: ValueError saying why)."""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import threading

from common.plumbing.checks import MAX_JSON_DEPTH

PROTOCOL = "flow-rl-reward/1"
PLAIN_TYPES = (dict, list, str, int, float, bool, type(None))
# The opcodes Python's pickler writes for dicts, lists, strings, numbers, booleans and None in
# protocols 0-5; any other opcode builds something else (a tuple, bytes, a set) or calls something.
PLAIN_OPCODES = frozenset(
    "PROTO FRAME STOP MARK EMPTY_DICT DICT EMPTY_LIST LIST APPEND APPENDS SETITEM SETITEMS "
    "NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT "
    "UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8 "
    "PUT BINPUT LONG_BINPUT MEMOIZE GET BINGET LONG_BINGET".split()
)
_BUILDS = {  # what the other opcodes that build data build, for the refusal
    **dict.fromkeys(("EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"), "tuple"),
    **dict.fromkeys(("SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"), "bytes"),
    **dict.fromkeys(("STRING", "BINSTRING", "SHORT_BINSTRING"), "bytes"),
    **dict.fromkeys(("EMPTY_SET", "ADDITEMS", "FROZENSET"), "set"),
}


class Watchdog:
    """Shuts a socket down (`how`: socket.SHUT_RD or SHUT_RDWR) `seconds` from now unless cancelled,
    so a read or write blocked on it returns however slowly the other side trickles its bytes (a
    socket timeout bounds each read, not their sum). `sock`: the socket, or a function returning it."""

    def __init__(self, seconds: float, sock, how: int):
        self.fired = False
        self._sock, self._how = sock, how
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self._sock() if callable(self._sock) else self._sock
        if sock is not None:
            try:
                sock.shutdown(self._how)
            except OSError:  # already closed
                pass

    def cancel(self) -> None:
        self._timer.cancel()


class _NoGlobals(pickle.Unpickler):
    """Resolves no global, so no class or function (the way a pickle runs code) can be built."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it needs the global '{module}.{name}'")


def _scan_pickle(data: bytes) -> None:
    """Reads every opcode without building anything: only PLAIN_OPCODES, and memo indices below the
    pickle's length (the C unpickler sizes its memo by the largest index: a 9-byte pickle naming
    index 10**8 takes 1.5 GB), else UnpicklingError naming what it would build."""
    texts: list[str] = []  # the last strings pushed: what STACK_GLOBAL names
    for op, arg, pos in pickletools.genops(data):
        name = op.name
        if isinstance(arg, str):
            texts = [*texts[-1:], arg]
        if name in ("GLOBAL", "STACK_GLOBAL", "INST"):
            what = arg.replace(" ", ".") if isinstance(arg, str) else ".".join(texts[-2:])
            raise pickle.UnpicklingError(f"it needs the global '{what}'")
        if name in _BUILDS:
            raise pickle.UnpicklingError(f"it holds a {_BUILDS[name]}")
        if name not in PLAIN_OPCODES:
            raise pickle.UnpicklingError(
                f"its opcode {name} at byte {pos} builds or calls an object"
            )
        if name in ("PUT", "BINPUT", "LONG_BINPUT") and arg >= len(data):
            raise pickle.UnpicklingError(
                f"its opcode {name} at byte {pos} names memo entry {arg} in {len(data)} bytes"
            )


def safe_unpickle(data: bytes):
    """The plain value a pickle holds (nested at most MAX_JSON_DEPTH deep), or ValueError naming what
    else it holds; its opcodes are checked before anything is built, and nothing is called."""
    try:
        _scan_pickle(data)
        value = _NoGlobals(io.BytesIO(data)).load()
    except Exception as e:  # genops and the C unpickler raise several kinds on malformed input
        raise ValueError(f"{type(e).__name__}: {str(e)[:160]}") from None
    problem = plain_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def plain_problem(value) -> str | None:
    """What keeps a decoded value from being plain data nested at most MAX_JSON_DEPTH deep (None:
    nothing). Each container is visited once, so self-containing or shared lists take linear time."""
    seen: set[int] = set()
    todo = [(value, 1)]
    while todo:
        x, depth = todo.pop()
        if type(x) not in PLAIN_TYPES:
            return f"it holds a {type(x).__name__}"
        if not isinstance(x, (dict, list)) or id(x) in seen:
            continue
        if depth > MAX_JSON_DEPTH:
            return f"it nests deeper than {MAX_JSON_DEPTH} levels"
        seen.add(id(x))
        items = [*x.keys(), *x.values()] if isinstance(x, dict) else x
        todo.extend((v, depth + 1) for v in items)
    return None


def decode_reply(reply: bytes, wire: str):
    """A reply's plain value ("json" or flow_grpo's pickle), or ValueError naming what it is instead."""
    if wire == "flowgrpo":
        try:
            return safe_unpickle(reply)
        except ValueError as e:
            raise ValueError(
                f"a pickle that was refused: {e}; only dict, list, str, int, float, bool and "
                "None are accepted, since anything else could run code on loading (a server "
                "that sends numpy numbers: have it send .tolist())"
            ) from None
    try:
        value = json.loads(reply)
    except ValueError:
        raise ValueError(f"a reply that is not JSON ({_excerpt(reply)})") from None
    except RecursionError:
        value, problem = None, "it nests deeper than Python's parser goes"
    else:
        problem = plain_problem(value)
    if problem:
        raise ValueError(f"a JSON reply that {problem[3:]} ({_excerpt(reply)})")
    return value


def _json(body: bytes):
    """A JSON reply, or ValueError (nesting deep enough to exhaust the parser's stack included)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError(f"nested deeper than Python's parser goes ({_excerpt(body)})") from None


def _excerpt(body: bytes) -> str:
    return repr(body[:80]) + ("..." if len(body) > 80 else "")
