"""A real etcd on this machine, for the tests and the benchmarks: Debian's `etcd` binary (package etcd-server) as a
child process on free loopback ports, with its data in a folder of the caller's. The tests' `etcd_server` fixture
(tests/conftest.py) starts one per test and the `ha` benchmark one per run; both always reap it.

`kill()` ends it with SIGKILL (a crash), `pause()`/`resume()` freeze it with SIGSTOP/SIGCONT (a hang: calls time
out instead of being refused), `start()` again restarts it on the same ports with the same data (leases and
revisions survive, as after a real restart).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

from diloco.cluster import wait_for

ETCD_BINARY_DEBIAN = "/usr/bin/etcd"  # Debian's etcd-server package
START_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    """The etcd binary on PATH, or Debian's (sbin-less PATHs), or None."""
    return shutil.which("etcd") or (ETCD_BINARY_DEBIAN if os.access(ETCD_BINARY_DEBIAN, os.X_OK) else None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EtcdServer:
    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.log_path = workdir / "etcd.log"
        self.host = "127.0.0.1"
        self.port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start (or restart on the same ports) and wait until etcd reports healthy. A first start that loses
        its ports to another process tries fresh ones, up to three times."""
        fresh = self.port == 0
        for attempt in range(3):
            if fresh:
                self.port, self.peer_port = _free_port(), _free_port()
            self._spawn()
            try:
                wait_for(f"etcd healthy at {self.url}", self._healthy, timeout_s=START_TIMEOUT_S, interval_s=0.05)
                return
            except (TimeoutError, RuntimeError):
                self.kill()
                if not fresh or attempt == 2:
                    raise RuntimeError(f"etcd did not start; its log ends with:\n{self.log_tail()}") from None

    def _spawn(self) -> None:
        assert self.proc is None, "already running"
        peer = f"http://{self.host}:{self.peer_port}"
        args = [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}  # no settings from outside
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def _healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("etcd exited")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL and reap; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a paused process must run to die
            proc.kill()
        proc.wait(timeout=30)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; always reaped; idempotent."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self.kill()  # reaps; SIGKILL first if it did not end

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"
