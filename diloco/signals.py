"""Stopping a service on SIGTERM or SIGINT, the one way every service does it.

A Python signal handler runs on the main thread between two bytecodes, possibly while that thread holds a lock it
took itself: the log's write lock above all (structlog's `PrintLogger` serialises writes with a lock that is not
re-entrant), so a handler that logs can deadlock the process for good. Seen: healthd, SIGTERMed right after it
logged `healthd.started`, hung once in about 25 runs on a loaded machine. So the handler does one thing, start a
thread, and that thread logs and stops the service (which may block, e.g. for a drain's grace period).

SIGUSR1 writes every thread's stack to stderr (`faulthandler`, from C: no Python lock is taken), without stopping
anything: `kill -USR1 PID` shows where a service that seems stuck waits (the HA soak does it to a learner that does
not exit).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def on_stop_signal(stop: Callable[[str], None], name: str = "stop-signal") -> None:
    """On SIGTERM or SIGINT, `stop(signal name)` runs on a daemon thread of its own; SIGUSR1 dumps the stacks (call
    from the main thread)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        threading.Thread(target=stop, args=(signal.Signals(signum).name,), name=name, daemon=True).start()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):  # stderr with no file descriptor
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # a diagnostic: never a reason not to start
