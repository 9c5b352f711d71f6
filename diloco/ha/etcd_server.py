"""A real etcd on this machine, for the tests and the benchmarks: Debian's `etcd` binary (package etcd-server) as a
child process on free loopback ports, with its data in a folder of the caller's. The tests' `etcd_server` fixture
(tests/conftest.py) starts one per test, the `ha` benchmark one per run and `diloco local --replicas N`
(`diloco.ha.local`) one per job; all always reap it. It runs in a session of its own, so a Ctrl-C at the terminal
reaches the process that started it, which stops it last (after the replicas that resign there).

`kill()` ends it with SIGKILL (a crash), `pause()`/`resume()` freeze it with SIGSTOP/SIGCONT (a hang: calls time
out instead of being refused), `start()` again restarts it on the same ports with the same data (leases and
revisions survive, as after a real restart).

With `ServerTls` it serves its clients over https only, with `--client-cert-auth`: a client must present a
certificate signed by the CA (its own certificate, which `diloco.rpc.tls` issues for client use too, is what the
health probe presents). Peers speak plain HTTP on loopback.

`EtcdCluster` starts several members of one cluster (`--initial-cluster` naming them all), each an `EtcdServer`
that can be killed and restarted on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ServerTls:
    """etcd's certificate and key, and the CA that signed them and must sign its clients' certificates (PEM)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def args(self) -> list[str]:
        return [
            f"--cert-file={self.cert_file}",
            f"--key-file={self.key_file}",
            f"--trusted-ca-file={self.ca_file}",
            "--client-cert-auth",
        ]

    def context(self) -> ssl.SSLContext:
        """A client's context: trusts the CA and presents etcd's own certificate."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx


class EtcdServer:
    def __init__(self, binary: str, workdir: Path, tls: ServerTls | None = None, name: str = "test") -> None:
        self.binary = binary
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.log_path = workdir / "etcd.log"
        self.host = "127.0.0.1"
        self.port = 0
        self.peer_port = 0
        self.tls = tls
        self.name = name
        self.initial_cluster = ""  # --initial-cluster; "": this member alone (EtcdCluster sets it)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        """Start (or restart on the same ports) and wait until etcd reports healthy. A first start that loses
        its ports to another process tries fresh ones, up to three times."""
        fresh = self.port == 0
        for attempt in range(3):
            if fresh:
                self.port, self.peer_port = _free_port(), _free_port()
            self.spawn()
            try:
                self.wait_healthy()
                return
            except RuntimeError:
                self.kill()
                if not fresh or attempt == 2:
                    raise

    def wait_healthy(self) -> None:
        """Wait until etcd reports healthy (a member: until its cluster has a leader); RuntimeError with its log's
        end when it does not within START_TIMEOUT_S or it exits."""
        try:
            wait_for(f"etcd healthy at {self.url}", self._healthy, timeout_s=START_TIMEOUT_S, interval_s=0.05)
        except (TimeoutError, RuntimeError):
            raise RuntimeError(f"etcd did not start; its log ends with:\n{self.log_tail()}") from None

    def spawn(self) -> None:
        """Start the process on the ports set (without waiting for it)."""
        assert self.proc is None, "already running"
        args = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={self.peer_url}'}",
            "--logger=zap",
            "--log-outputs=stderr",
            *(self.tls.args() if self.tls else ()),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}  # no settings from outside
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("etcd exited")
        context = self.tls.context() if self.tls else None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0, context=context) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def status(self) -> dict[str, object]:
        """This member's answer to etcd's maintenance status call (its id in header.member_id, its raft leader's in
        leader; ids as strings)."""
        context = self.tls.context() if self.tls else None
        req = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=2.0, context=context) as r:
            reply: dict[str, object] = json.loads(r.read())
            return reply

    def member_id(self) -> str:
        header = self.status()["header"]
        assert isinstance(header, dict)
        return str(header["member_id"])

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


class EtcdCluster:
    """`size` members of one etcd cluster on free loopback ports (`members[i]`, named m0, m1, ..., data and log in
    `workdir/m<i>`), started together; `urls` lists their client URLs comma-separated (what `--etcd` takes)."""

    def __init__(self, binary: str, workdir: Path, size: int = 3, tls: ServerTls | None = None) -> None:
        self.members = [EtcdServer(binary, workdir / f"m{i}", tls=tls, name=f"m{i}") for i in range(size)]

    @property
    def urls(self) -> str:
        return ",".join(m.url for m in self.members)

    def start(self) -> None:
        """Start every member and wait until each is healthy (the cluster has a leader)."""
        for m in self.members:
            m.workdir.mkdir(parents=True, exist_ok=True)
            m.port, m.peer_port = _free_port(), _free_port()
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
            m.spawn()
        for m in self.members:
            m.wait_healthy()

    def member_at(self, endpoint: str) -> EtcdServer:
        """The member serving HOST:PORT."""
        return next(m for m in self.members if f"{m.host}:{m.port}" == endpoint)

    def raft_leader(self) -> EtcdServer | None:
        """The member the running members name as their raft leader (None: they do not agree on a running one)."""
        named = {m.member_id(): m for m in self.members if m.proc is not None}
        leaders = {m.status().get("leader") for m in named.values()}
        return named.get(str(leaders.pop())) if len(leaders) == 1 else None

    def lead_first(self) -> EtcdServer:
        """Order the members so that the raft leader comes first (the endpoint a replica given `urls` uses until it
        fails); returns it."""
        leader = self.raft_leader()
        if leader is None:
            raise RuntimeError("the members do not agree on a raft leader")
        self.members.sort(key=lambda m: m is not leader)
        return leader

    def stop(self) -> None:
        for m in self.members:
            m.stop()
