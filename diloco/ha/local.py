"""`diloco local --replicas N`: the local cluster with coordinator high availability (docs/ha.md). A real etcd
(`EtcdServer`: Debian's binary on loopback ports, its data in a temporary folder, its log in the run folder), N
coordinator replicas under its leadership (`coord-a`, `coord-b`, ...: `--etcd`, `--replica-id`, their own
checkpoint folders), healthd and the learners given every replica's address.

Start: etcd, healthd (port 0), every replica at once (each campaigns; the winner serves, the others follow it as hot
standbys), healthd again on its port with every replica's address, and once one replica leads with every other
following it, the learners.

While it runs, `follow()` finds the leader (the replica whose GetStatus says it leads, under the highest epoch:
`pick_leader`) and points the cluster's status calls at it, and `supervise()` does what a supervisor (compose's
`restart: on-failure`) does: a replica that ended because it lost leadership (exit 3), stepped down (exit 0) or was
killed by a signal is started again on its port and comes back as a standby; one that exited otherwise (a crash, a
configuration error) stays down (`restarts`). `stop()` stops the learners, the replicas and healthd, then etcd, each
by PID, and removes etcd's temporary folder; safe to call twice."""

from __future__ import annotations

import os
import shutil
import string
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from diloco.cluster import ClusterConfig, LocalCluster, LogFollower, coordinator_flags, wait_for
from diloco.errors import ConfigError
from diloco.ha.etcd_server import EtcdServer, etcd_binary
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.config import parse as parse_coordinator
from services.coordinator.ha import EXIT_RETIRED

MAX_REPLICAS = 5  # one leader and up to four standbys: each replica holds the model and its own process
NO_ETCD = (
    "--replicas N > 1 runs a real etcd and there is no etcd binary on PATH: install Debian's etcd-server "
    "(`make etcd`, or `sudo scripts/install_etcd.sh`), or run with --replicas 1"
)
STATUS_TIMEOUT_S = 1.0  # one replica's GetStatus while looking for the leader
REPLICATION_LOG = 4  # round-log entries each leader keeps for its standbys (model-sized each)


@dataclass(frozen=True)
class ReplicaPlan:
    """The replicas of a `diloco local` run: their names, the etcd binary, the flags each runs with on top of the
    cluster's coordinator flags (`--replication-log`, `--sync-replicas`, `--when-no-standby`)."""

    names: tuple[str, ...]
    etcd_binary: str
    args: tuple[str, ...]


def replica_plan(count: int, sync_replicas: int | None, when_no_standby: str | None) -> ReplicaPlan | None:
    """The plan for `--replicas count` (1..MAX_REPLICAS; 1: no replicas, None), each leader waiting for
    `sync_replicas` (0..count-1, default 1) standbys' acks and doing `when_no_standby` (default publish) when they
    do not come; `ConfigError` naming the flag otherwise, or when there is no etcd binary (NO_ETCD)."""
    if not 1 <= count <= MAX_REPLICAS:
        raise ConfigError(f"--replicas must be between 1 and {MAX_REPLICAS}, got {count}")
    if count == 1:
        given = [
            f for f, v in (("--sync-replicas", sync_replicas), ("--when-no-standby", when_no_standby)) if v is not None
        ]
        if given:
            raise ConfigError(f"{' and '.join(given)} set how a leader waits for its standbys: needs --replicas >= 2")
        return None
    sync_replicas = 1 if sync_replicas is None else sync_replicas
    if not 0 <= sync_replicas < count:
        raise ConfigError(
            f"--sync-replicas {sync_replicas}: a leader of {count} replicas has {count - 1} standby(s) to wait for; "
            f"give 0..{count - 1}"
        )
    binary = etcd_binary()
    if binary is None:
        raise ConfigError(NO_ETCD)
    names = tuple(f"coord-{string.ascii_lowercase[i]}" for i in range(count))
    args = ("--replication-log", str(REPLICATION_LOG), "--sync-replicas", str(sync_replicas))
    return ReplicaPlan(names, binary, (*args, "--when-no-standby", when_no_standby or "publish"))


def check_replica_flags(cfg: ClusterConfig, plan: ReplicaPlan) -> None:
    """Parse the flags a replica of `cfg` will get, with the coordinator's own parser and rules (under this
    environment, which the replicas inherit), so that a combination it refuses is refused here, before anything
    starts: `ConfigError` with its message (addresses and files stand in for those made at the start)."""
    argv = [
        *coordinator_flags(cfg, 0, "127.0.0.1:1", str(cfg.run_dir / f"checkpoints-{plan.names[0]}")),
        *("--etcd", "http://127.0.0.1:2379", "--replica-id", plan.names[0]),
        *cfg.task_args,
        *cfg.coordinator_args,
        *plan.args,
        "--insecure",
    ]
    try:
        parse_coordinator(argv, env=os.environ)
    except ConfigError as e:
        raise ConfigError(f"a coordinator replica refuses this combination: {e}") from None


def restarts(returncode: int) -> bool:
    """Whether a replica that exited with `returncode` is started again: it lost leadership (EXIT_RETIRED), stepped
    down (0) or was killed by a signal (negative); not after a crash or a refused configuration."""
    return returncode in (0, EXIT_RETIRED) or returncode < 0


def pick_leader(answers: Mapping[str, coordinator_pb2.HaStatus]) -> str | None:
    """The replica that leads among those that answered GetStatus (their `ha`): one that says it leads, the highest
    leadership epoch first (a fenced leader not yet retired may still say so under its older epoch); None if none."""
    leading = [(ha.leader_epoch, name) for name, ha in answers.items() if ha.is_leader]
    return max(leading)[1] if leading else None


class ReplicatedCluster:
    """etcd and the replicas of `plan` around `cluster` (its healthd and learners)."""

    def __init__(self, cluster: LocalCluster, plan: ReplicaPlan) -> None:
        self.cluster = cluster
        self.names = plan.names
        self.replica_args = plan.args
        self.workdir = Path(tempfile.mkdtemp(prefix="diloco-etcd-"))  # etcd's data: removed by stop()
        self.etcd = EtcdServer(plan.etcd_binary, self.workdir, name="local")
        self.etcd.log_path = cluster.run_dir / "etcd.log"
        self.ports: dict[str, int] = {}
        self.down: dict[str, int] = {}  # replicas that exited for good: their exit status
        self.leader: str | None = None
        self._channels: dict[str, grpc.Channel] = {}

    @property
    def addresses(self) -> str:
        """Every replica's HOST:PORT, comma-separated (what healthd, the learners and `diloco ctl` are given)."""
        return ",".join(f"127.0.0.1:{self.ports[n]}" for n in self.names)

    def start(self, timeout_s: float = 120.0) -> None:
        """etcd, healthd, the replicas, healthd again with their addresses; once one leads and every other
        follows it, the learners."""
        deadline = time.monotonic() + timeout_s
        c = self.cluster
        self.etcd.start()
        c.healthd_port = c.bound_port(c.start_healthd(), "healthd.started", timeout_s)
        for name in self.names:
            c.start_replica(name, self.etcd.url, 0, self.replica_args)
        for name in self.names:
            self.ports[name] = self._started_port(name, deadline - time.monotonic())
        c.stop_child("healthd", grace_s=10)
        c.start_healthd(self.addresses)
        c.wait_serving(c.healthd_address, deadline - time.monotonic())
        wait_for(
            "one replica to lead with every other following it",
            self._ready,
            timeout_s=deadline - time.monotonic(),
            interval_s=0.1,
        )
        for i in range(c.cfg.workers):
            c.cfg.worker_args[i] = (*c.cfg.worker_args.get(i, ()), "--coordinator", self.addresses)
            c.start_worker(i)

    def _started_port(self, name: str, timeout_s: float) -> int:
        """The port replica `name` advertises, from its `replica.started` line."""
        log = LogFollower(self.cluster.procs[name].log_path)

        def started() -> int:  # 0: not yet
            for x in log.read():
                if x.event == "replica.started":
                    return int(str(x.fields["address"]).rsplit(":", 1)[1])
            self._require_running(name)
            return 0

        return wait_for(f"{name} to start", started, timeout_s=timeout_s, interval_s=0.05)

    def _require_running(self, name: str) -> None:
        p = self.cluster.procs[name]
        if not p.alive:
            raise RuntimeError(f"{name} exited with {p.popen.returncode}:\n{self.cluster.tail(name)}")

    def _ready(self) -> bool:
        for name in self.names:
            self._require_running(name)
        found = self.follow()
        return found is not None and len(found.ha.replicas) >= len(self.names) - 1

    def follow(self) -> coordinator_pb2.GetStatusResponse | None:
        """Ask every running replica for its status; point the cluster's calls at the leader (`self.leader`) and
        return its status (None: no replica says it leads now)."""
        statuses: dict[str, coordinator_pb2.GetStatusResponse] = {}
        for name in self.names:
            if not self.cluster.procs[name].alive:
                continue
            try:
                statuses[name] = self._stub(name).GetStatus(
                    coordinator_pb2.GetStatusRequest(), timeout=STATUS_TIMEOUT_S
                )
            except grpc.RpcError:
                continue  # a standby's stand-in refuses (UNAVAILABLE, naming the leader), or it is (re)starting
        leader = pick_leader({n: s.ha for n, s in statuses.items() if s.HasField("ha")})
        if leader is None:
            return None
        self.leader = leader
        self.cluster.coordinator_port = self.ports[leader]
        return statuses[leader]

    def _stub(self, name: str) -> coordinator_pb2_grpc.CoordinatorStub:
        if name not in self._channels:
            address = f"127.0.0.1:{self.ports[name]}"
            self._channels[name] = self.cluster.security.channel(address, admin=True)
        return coordinator_pb2_grpc.CoordinatorStub(self._channels[name])

    def supervise(self) -> list[str]:
        """Start again each replica that ended and `restarts` allows (on its port, from its checkpoints: it comes
        back as a standby); what happened, one line each."""
        said = []
        for name in self.names:
            p = self.cluster.procs[name]
            if p.alive or name in self.down:
                continue
            code = p.popen.returncode
            if restarts(code):
                self.cluster.start_replica(name, self.etcd.url, self.ports[name], self.replica_args)
                said.append(f"{name} exited ({exit_reason(code)}); started it again: it comes back as a standby")
            else:
                self.down[name] = code
                said.append(f"{name} exited with status {code} and stays down:\n{self.cluster.tail(name)}")
        return said

    def running(self) -> bool:
        """Some replica is running (or will be: `supervise` starts again those that may come back)."""
        return any(n not in self.down for n in self.names)

    def stop(self) -> None:
        """The learners, the replicas and healthd (`LocalCluster.stop`: SIGTERM, SIGKILL after the grace), then etcd
        (SIGTERM, SIGKILL after 10 s), each by PID; then etcd's folder is removed. Idempotent."""
        try:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            self.cluster.stop()
        finally:
            self.etcd.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ReplicatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by signal {-code}"
    if code == EXIT_RETIRED:
        return "it lost leadership"
    return "it stepped down" if code == 0 else f"status {code}"
