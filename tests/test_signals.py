"""`diloco.signals.on_stop_signal`: a stop signal never runs service code on the interrupted main thread."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from diloco.signals import STOP_SIGNALS, on_stop_signal


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_signal_caught_while_the_main_thread_holds_the_log_lock_stops_the_service(
    sig: signal.Signals, restore_handlers: None
) -> None:
    # the lock stands for the log's write lock (not re-entrant), held by the main thread when the signal lands: a
    # handler that logged would wait for it on the main thread itself, for ever
    log_lock = threading.Lock()
    stopped: list[tuple[str, str]] = []
    done = threading.Event()

    def stop(name: str) -> None:
        with log_lock:  # "logs" the signal
            stopped.append((name, threading.current_thread().name))
        done.set()

    on_stop_signal(stop, "test-stop")
    with log_lock:
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # the handler runs on this thread meanwhile, between two bytecodes
        assert not done.is_set()  # the stop is waiting for the lock, not holding up this thread
    assert done.wait(10.0)
    assert stopped == [(sig.name, "test-stop")]


def test_a_stderr_without_a_file_descriptor_still_gets_the_stop_handlers(
    restore_handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGUSR1's stack dump (faulthandler) needs stderr's file descriptor; a service whose stderr has none (an
    embedding process, a test capturing it) starts anyway, with its stop handlers, and without the dump."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    on_stop_signal(lambda _name: None, "test-stop")
    assert all(signal.getsignal(sig) not in (signal.SIG_DFL, signal.default_int_handler) for sig in STOP_SIGNALS)
