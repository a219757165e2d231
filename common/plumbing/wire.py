"""What the reward client (common/plumbing/remote_reward.py) and the reward server
(common/plumbing/reward_server.py) share: the protocol's name and the socket watchdog. Standard
library only: the server runs in a scorer's own environment, without torch."""

from __future__ import annotations

import threading

PROTOCOL = "flow-rl-reward/1"


class Watchdog:
    """Shuts a socket down (`how`: socket.SHUT_RD or SHUT_RDWR) `seconds` from now unless cancelled
    first: a read or write blocked on it then returns at once, however slowly the other side
    trickles its bytes (a socket timeout bounds each read, not their sum). `sock` is the socket, or
    a function that returns it (None while it is not yet connected)."""

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
