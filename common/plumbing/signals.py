"""SIGINT and SIGTERM stop a run with one line: during the set-up (stop_on_signals_in_setup, which
decorates it) and during training (Run.stop_on_signals); the line names what exists to go on from.
Also where this process's run folder is recorded once the set-up knows it (the one-line stops name
its checkpoints)."""

from __future__ import annotations

import os
import signal
import sys

from common.plumbing.checkpoint import continue_hint

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# the handlers the process had before the set-up installed its own (Run.finish puts them back)
_before_setup: dict = {}
# where the set-up stands, for the line a signal prints: the run folder once it is known, and the
# signal that stopped it (a library that swallows the SystemExit does not make the run go on)
_setup_state: dict = {"run_dir": None, "signal": None}


def stop_by_signal(signum: int, when: str, hint, show: bool) -> None:
    """The one line a signal stops the process with (rank 0 prints it; `hint()` names what exists
    to go on from), and exit code 128 + the signal."""
    if show:
        print(
            f"stopped by {signal.Signals(signum).name} {when}; {hint()}",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(128 + signum)


def stop_on_signals_in_setup(setup):
    """Decorates the set-up: SIGINT and SIGTERM from its first line (checks, reward and model loads)
    stop the process with one line and exit code 128 + the signal, as they do during training
    (where `Run.stop_on_signals` takes over). A second signal while the first unwinds leaves at
    once. A set-up that stops (bad input, a signal) puts the previous handlers back, for a process
    that goes on (a test runner, a notebook)."""
    import functools
    import threading

    def stop(signum, frame):
        if _setup_state["signal"] is not None:
            os._exit(128 + signum)
        _setup_state["signal"] = signum
        stop_by_signal(
            signum,
            "during the set-up, before training started",
            _setup_hint,
            int(os.environ.get("RANK", "0")) == 0,
        )

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
    """The set-up knows its run folder (a signal's line names it), and has not been stopped: a
    stop whose SystemExit some library caught is raised again here."""
    _setup_state["run_dir"] = run_dir
    if _setup_state["signal"] is not None:
        raise SystemExit(128 + _setup_state["signal"])


def _setup_hint() -> str:
    from common.plumbing.run_folder import run_outputs

    run_dir = _setup_state["run_dir"]
    if run_dir and run_outputs(run_dir):
        return continue_hint(run_dir)
    return "nothing was written: run the same command again"


def stop_training_on_signals(run) -> dict:
    """From the training loop on (Run.stop_on_signals), SIGINT (Ctrl-C) and SIGTERM stop the run with
    one line: the iteration reached, the last complete checkpoint and the command that continues. A
    write in progress is abandoned whole (every write goes to a temporary name first). Returns the
    handlers the process had before its set-up, which `Run.finish` puts back."""

    def stop(signum, frame):
        stop_by_signal(
            signum, f"at iteration {run.iteration}", lambda: continue_hint(run.dir), run.is_main
        )

    handlers = {}
    for sig in SIGNALS:
        previous = signal.signal(sig, stop)
        handlers[sig] = _before_setup.pop(sig, previous)
    return handlers
