"""The replicated cluster as real processes (etcd, healthd, two coordinator replicas, the learners) and its
supervisor: `HaCluster.pump()` reads every replica's log into its `Replica` (what each incarnation holds, when it
was elected and promoted, what it committed) and starts again a replica that ended."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from diloco.bench.ha.settings import NO_ETCD, REPLICAS
from diloco.cluster import ClusterConfig, LocalCluster, LogFollower, LogLine
from diloco.errors import ConfigError
from diloco.ha.etcd_server import EtcdServer, etcd_binary
from diloco.rpc.server import channel
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc


class SoakError(RuntimeError):
    """The soak could not go on (a wait ran out, a process would not come back); the message says where."""


@dataclass
class Replica:
    """One replica as the supervisor sees it, from its log (every incarnation appends to one file)."""

    name: str
    log: LogFollower
    port: int = 0
    args: tuple[str, ...] = ()  # its replication flags (and, at the end of the soak, the new target)
    incarnation: int = 0  # `replica.started` lines seen
    held: tuple[int, int] | None = None  # (epoch, version) this incarnation holds as a standby
    elected: LogLine | None = None  # this incarnation's `leadership.changed` to leader
    promoted: LogLine | None = None  # this incarnation's `replica.promoted`
    closed: list[LogLine] = field(default_factory=list)  # this incarnation's `round.closed` lines
    applied: list[LogLine] = field(default_factory=list)  # every `replication.applied` line (all incarnations)
    commits: list[LogLine] = field(default_factory=list)  # every `round.closed` line (all incarnations)
    # versions published with no standby following (`replication.degraded`, nobody lagging; the quiet ones of a
    # degraded run are counted when it ends, `replication.restored`: a run a kill cut short counts its first only)
    alone: int = 0
    ack_timeouts: int = 0  # versions published when a following standby's ack did not come in time
    restart_at: float | None = None  # when the supervisor starts it again (monotonic)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def take(self, lines: list[LogLine]) -> None:
        for x in lines:
            e, f = x.event, x.fields
            if e == "replica.started":
                self.incarnation += 1
                self.port = self.port or int(str(f["address"]).rsplit(":", 1)[1])
                self.held, self.elected, self.promoted, self.closed = None, None, None, []
            elif e == "leadership.changed" and f.get("role") == "leader":
                self.elected = x
            elif e == "replica.promoted":
                self.promoted = x
            elif e == "round.closed":
                self.closed.append(x)
                self.commits.append(x)
            elif e in ("replication.applied", "replication.snapshot_loaded"):
                self.held = (int(f["epoch"]), int(f["version"]))
                if e == "replication.applied":
                    self.applied.append(x)
            elif e == "replication.degraded" and f.get("lagging"):
                self.ack_timeouts += 1
            elif e == "replication.degraded":
                self.alone += 1
            elif e == "replication.restored":  # the degraded versions after the first that were not logged
                self.alone += int(str(f.get("quiet_versions", 0)))

    @property
    def newest(self) -> int:
        """The newest version this incarnation committed as leader (its promoted version before any)."""
        if self.closed:
            return int(self.closed[-1].fields["version"])
        return int(self.promoted.fields["version"]) if self.promoted else -1

    @property
    def epoch(self) -> int:
        return int(self.promoted.fields["epoch"]) if self.promoted else -1


class HaCluster:
    """etcd, healthd, two replicas and the learners of `cfg`; `pump()` reads every log and restarts ended
    replicas (the supervisor). Every child, etcd included, is reaped on exit."""

    def __init__(self, cfg: ClusterConfig, replica_args: Sequence[str], restart_delay_s: float = 0.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise ConfigError(NO_ETCD)
        self.cluster = LocalCluster(cfg)
        self.etcd = EtcdServer(binary, cfg.run_dir / "etcd")
        self.replica_args = tuple(replica_args)
        self.replicas = {n: Replica(n, self.cluster.follow(n), args=self.replica_args) for n in REPLICAS}
        self.learners = {f"worker{i}": self.cluster.follow(f"worker{i}") for i in range(cfg.workers)}
        self.restart_delay_s = restart_delay_s
        self.killed: set[str] = set()  # replicas this process ended (SIGKILL, SIGTERM) and not yet restarted
        self.unplanned: list[str] = []  # replica exits nobody asked for (status, log tail)
        self.learner_exits: dict[str, str] = {}

    def __enter__(self) -> HaCluster:
        self.etcd.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.cluster.stop()
        finally:
            self.etcd.stop()

    def start(self, timeout_s: float) -> None:
        """healthd, coord-a until it leads, coord-b until it follows, healthd again with both addresses (it follows
        the leader), then the learners."""
        c = self.cluster
        c.healthd_port = c.bound_port(c.start_healthd(), "healthd.started", timeout_s)
        a, b = self.replicas.values()
        self._start(a)
        self.until("coord-a to lead", lambda: a.promoted is not None, timeout_s)
        self._start(b)
        self.until("coord-b to follow coord-a", lambda: b.held is not None, timeout_s)
        both = f"{a.address},{b.address}"
        c.stop_child("healthd", grace_s=10)
        c.start_healthd(both)
        c.cfg.worker_args.update({i: ("--coordinator", both) for i in range(c.cfg.workers)})
        for i in range(c.cfg.workers):
            c.start_worker(i)

    def _start(self, r: Replica) -> None:
        self.cluster.start_replica(r.name, self.etcd.url, r.port, r.args)
        self.killed.discard(r.name)
        r.restart_at = None

    def pump(self) -> None:
        """Read every log; start again a replica that ended (after `restart_delay_s`); note learners that exited."""
        for r in self.replicas.values():
            r.take(r.log.read())
            p = self.cluster.procs.get(r.name)
            if p is None or p.alive:
                continue
            now = time.monotonic()
            if r.restart_at is None:
                r.take(r.log.read())  # the rest of the ended incarnation's lines
                if r.name not in self.killed:
                    self.unplanned.append(f"{r.name} exited with {p.popen.returncode}:\n{self.cluster.tail(r.name)}")
                r.restart_at = now + self.restart_delay_s
            if now >= r.restart_at:
                self._start(r)
        for name in self.learners:
            p = self.cluster.procs.get(name)
            if p is not None and not p.alive and name not in self.learner_exits:
                self.learner_exits[name] = f"exit status {p.popen.returncode}:\n{self.cluster.tail(name)}"

    def until(self, what: str, predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.01) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            if predicate():
                return
            if time.monotonic() > deadline:
                raise SoakError(f"gave up waiting {timeout_s:g} s for {what}")
            time.sleep(poll_s)

    def leader(self) -> Replica | None:
        """The replica serving now (a live one whose incarnation was promoted), the newest epoch first."""
        live = [
            r
            for r in self.replicas.values()
            if r.promoted is not None and r.name in self.cluster.procs and self.cluster.procs[r.name].alive
        ]
        return max(live, key=lambda r: r.epoch, default=None)

    def kill(self, r: Replica) -> float:
        """SIGKILL replica `r`; returns the wall time just before the signal."""
        self.killed.add(r.name)
        at = time.time()
        self.cluster.kill(r.name)
        self._gone(r)
        return at

    def stop_replica(self, r: Replica) -> None:
        """SIGTERM (a standby exits 0); the supervisor starts it again."""
        self.killed.add(r.name)
        self.cluster.stop_child(r.name, grace_s=15)
        self._gone(r)

    def _gone(self, r: Replica) -> None:
        """`r`'s process exited: read the rest of its log, then forget what it held as a standby, which says
        nothing of its next incarnation (else a stopped standby counted as in step with a leader that went on
        publishing without it, until the next incarnation's first line was read)."""
        self.pump()
        r.held = None

    def status(self, r: Replica, timeout_s: float = 3.0) -> coordinator_pb2.GetStatusResponse:
        with channel(r.address) as ch:
            return coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(
                coordinator_pb2.GetStatusRequest(), timeout=timeout_s
            )

    def finished(self, r: Replica) -> bool:
        """The job finished at replica `r` (False while it does not answer)."""
        try:
            return self.status(r).finished
        except grpc.RpcError:
            return False

    def ledger(self, r: Replica, timeout_s: float = 5.0) -> coordinator_pb2.GetLedgerResponse:
        with channel(r.address) as ch:
            return coordinator_pb2_grpc.CoordinatorStub(ch).GetLedger(
                coordinator_pb2.GetLedgerRequest(), timeout=timeout_s
            )


def in_step(standby: Replica, leader: Replica) -> bool:
    """The standby holds the leader's newest committed version (or a newer one it stepped) under its epoch."""
    return standby.held is not None and standby.held[0] == leader.epoch and standby.held[1] >= leader.newest


def standby_lead_s(ha: HaCluster, start: float, end: float) -> list[float]:
    """Per version committed in [start, end): seconds from the standby applying it to the leader publishing it."""
    applied = {int(x.fields["version"]): x.logged_at for r in ha.replicas.values() for x in r.applied}
    out = []
    for r in ha.replicas.values():
        for x in r.commits:
            v, t = int(x.fields["version"]), x.logged_at
            if start <= t < end and v in applied:
                out.append(round(t - applied[v], 4))
    return out
