"""SIGINT and SIGTERM stop a run with one line naming what exists to go on from: during the set-up
(stop_on_signals_in_setup) and during training (stop_training_on_signals, via Run.stop_on_signals).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading

from common.plumbing.checkpoint import continue_hint
from common.plumbing.run_folder import run_outputs

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# the handlers the process had before the set-up installed its own (Run.finish puts them back)
_before_setup: dict = {}
# the run folder once the set-up knows it, and the signal that stopped the set-up (a library that
# swallows the SystemExit does not make the run go on: setup_reached raises it again)
_setup_state: dict = {"run_dir": None, "signal": None}


def stop_by_signal(signum: int, when: str, hint, show: bool) -> None:
    """Exit with code 128 + the signal; if `show` (rank 0), first the one line (`hint()`: what
    exists to go on from)."""
    if show:
        name = signal.Signals(signum).name
        print(f"stopped by {name} {when}; {hint()}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def stop_on_signals_in_setup(setup):
    """Decorates the set-up: from its first line, SIGINT and SIGTERM stop the process with one line
    and exit code 128 + the signal; a second signal while the first unwinds leaves at once. A set-up
    that stops puts the previous handlers back, for a process that goes on (a test runner)."""

    def stop(signum, frame):
        if _setup_state["signal"] is not None:
            os._exit(128 + signum)
        _setup_state["signal"] = signum
        show = int(os.environ.get("RANK", "0")) == 0
        stop_by_signal(signum, "during the set-up, before training started", _setup_hint, show)

    @functools.wraps(setup)
    def guarded(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return setup(*args, **kwargs)  # signal handlers belong to the main thread
        _setup_state.update(run_dir=None, signal=None)
        for sig in SIGNALS:
            _before_setup.setdefault(sig, signal.signal(sig, stop))
        try:
            return setup(*args, **kwargs)
        except BaseException:
            for sig in SIGNALS:
                if sig in _before_setup:
                    signal.signal(sig, _before_setup.pop(sig))
            raise

    return guarded


def setup_reached(run_dir: str) -> None:
    """The set-up knows its run folder; a stop whose SystemExit some library caught is raised again."""
    _setup_state["run_dir"] = run_dir
    if _setup_state["signal"] is not None:
        raise SystemExit(128 + _setup_state["signal"])


def _setup_hint() -> str:
    run_dir = _setup_state["run_dir"]
    if run_dir and run_outputs(run_dir):
        return continue_hint(run_dir)
    return "nothing was written: run the same command again"


def stop_training_on_signals(run) -> dict:
    """From the training loop on, SIGINT and SIGTERM stop the run with one line: the iteration, the
    last complete checkpoint and the command that continues (a write in progress, to a temporary
    name, is abandoned). Returns the handlers from before the set-up, for Run.finish."""

    def stop(signum, frame):
        hint = functools.partial(continue_hint, run.dir)
        stop_by_signal(signum, f"at iteration {run.iteration}", hint, run.is_main)

    # install ours; hand back the handler from before the set-up, else the one just replaced
    return {sig: _before_setup.pop(sig, signal.signal(sig, stop)) for sig in SIGNALS}
