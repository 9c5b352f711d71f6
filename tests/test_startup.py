"""Fast start (#16.3): every entry point as a real process. healthd (`diloco healthd`, `python -m services.healthd`)
and `diloco ctl` must never import torch; the coordinator and the worker, which need it, must at least start
through the `diloco` command and stop on SIGTERM.

Each child runs under a small wrapper that reports, at exit, whether `torch` (or numpy, which only torch's side
uses), or the etcd client (only a coordinator given --etcd needs it), is in `sys.modules`: what the process
imported while it served, not only at import time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from diloco.cluster import TINY_TASK_ARGS, wait_serving
from services.coordinator.server import CoordinatorServer

pytestmark = pytest.mark.timeout(180)

# Runs `diloco ...` (argv[1] == "cli") or `python -m <module>` (argv[1] == module) and reports the heavy modules
# loaded when the process ends, however it ends (return, sys.exit, SIGTERM handled by the service).
WRAPPER = """
import atexit, runpy, sys
def report():
    # on a line of its own: a service thread may be part way through a log line as the process exits
    print("\\nHEAVY=" + ",".join(m for m in ("torch", "numpy", "etcd3gw") if m in sys.modules), flush=True)
atexit.register(report)
target, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
if target == "cli":
    from diloco.cli.main import main
    sys.exit(main(sys.argv[1:]))
runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def heavy_of(output: str) -> list[str]:
    lines = [line for line in output.splitlines() if line.startswith("HEAVY=")]
    assert lines, f"the wrapper reported nothing; output:\n{output[-3000:]}"
    return [m for m in lines[-1].removeprefix("HEAVY=").split(",") if m]


class Child:
    """A child process with its output in a file; always reaped."""

    def __init__(self, argv: Sequence[str], log: Path) -> None:
        self.log = log
        self._file = log.open("wb")
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT (see `stop`) prints every thread's stack
        self.popen = subprocess.Popen(
            list(argv), stdout=self._file, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_event(self, event: str, timeout_s: float = 90.0) -> dict[str, Any]:
        """The first JSON log line with `event` (polled until a deadline; fails early if the child exits)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if line.startswith("{") and f'"{event}"' in line:
                    doc: dict[str, Any] = json.loads(line)
                    if doc.get("event") == event:
                        return doc
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {event} (exit {self.popen.poll()}); output:\n{self.output()[-3000:]}")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then its exit status. A child still running after `timeout_s` is sent SIGABRT, so that the
        failure shows where each of its threads hung."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGABRT)
            self.popen.wait(timeout=30)
            raise AssertionError(
                f"still running {timeout_s:g} s after SIGTERM; output:\n{self.output()[-6000:]}"
            ) from None
        finally:
            self.close()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)
        self._file.close()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for c in started:
        c.close()


def wrapped(target: str, *args: str) -> list[str]:
    return [sys.executable, "-c", WRAPPER, target, *args]


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["healthd", "--help"], ["ctl", "--help"], ["certs", "--help"], ["nonsense"]],
    ids=["diloco", "healthd", "ctl", "certs", "unknown-command"],
)
def test_help_and_usage_import_no_torch(argv: list[str]) -> None:
    proc = subprocess.run(wrapped("cli", *argv), capture_output=True, text=True, timeout=60)
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    assert heavy_of(proc.stdout) == []


@pytest.mark.parametrize("target", ["cli", "services.healthd"], ids=["diloco healthd", "python -m services.healthd"])
def test_healthd_serves_without_torch(target: str, tmp_path: Path, children: list[Child]) -> None:
    argv = ["healthd"] if target == "cli" else []
    child = Child(wrapped(target, *argv, "--port", "0", "--insecure"), tmp_path / "healthd.log")
    children.append(child)
    port = child.wait_event("healthd.started")["port"]
    wait_serving(f"127.0.0.1:{port}", 60.0)
    assert child.stop() == 0, child.output()[-3000:]
    assert heavy_of(child.output()) == []


def test_ctl_status_round_trip_without_torch(plain_coordinator: CoordinatorServer) -> None:
    argv = wrapped("cli", "ctl", "--coordinator", plain_coordinator.address, "--insecure", "--json", "status")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.lstrip().startswith("{"), proc.stdout[-2000:]  # the reply as JSON
    assert heavy_of(proc.stdout) == []


def test_a_coordinator_without_etcd_never_loads_the_etcd_client(tmp_path: Path, children: list[Child]) -> None:
    argv = wrapped("services.coordinator", "--port", "0", "--bulk-port", "-1", "--insecure", *TINY_TASK_ARGS)
    child = Child(argv, tmp_path / "coordinator.log")
    children.append(child)
    wait_serving(child.wait_event("coordinator.started")["address"], 60.0)
    assert child.stop() == 0, child.output()[-3000:]
    assert heavy_of(child.output()) == ["torch", "numpy"]


@pytest.mark.slow
def test_coordinator_and_worker_start_through_the_cli(tmp_path: Path, children: list[Child]) -> None:
    diloco = [sys.executable, "-m", "diloco.cli.main"]
    coordinator = Child(
        [*diloco, "coordinator", "--port", "0", "--bulk-port", "-1", "--insecure", *TINY_TASK_ARGS],
        tmp_path / "coordinator.log",
    )
    children.append(coordinator)
    address = coordinator.wait_event("coordinator.started")["address"]
    wait_serving(address, 60.0)
    worker = Child(
        [*diloco, "worker", "--coordinator", address, "--name", "worker0", "--insecure"], tmp_path / "worker.log"
    )
    children.append(worker)
    assert worker.wait_event("worker.registered")["version"] >= 0
    worker.stop()  # a learner stopped mid-round exits on its own terms; that it stops at all is the point here
    assert coordinator.stop() == 0, coordinator.output()[-3000:]
