"""The coordinator under etcd leadership in containers (issue #14, ALGORITHM.md section 11): `HaDockerCluster` is a
`DockerCluster` with an etcd container and two coordinator replicas (`--etcd`) instead of one coordinator, and
learners given both replicas' addresses. Plus the pure checks of what the replicas logged (`leadership_terms`,
`overlapping_terms`, `backwards`), unit-tested without an engine in tests/chaos/test_harness.py.

The replicas bind their container name (`--host`): a replica advertises `--host:--port` in etcd, and that is the
address the standby and the learners dial, so it cannot be 0.0.0.0. etcd is reached by its container name over the
cluster's private network (`--etcd-private-network true`). A replica restarts on failure (`on-failure`, no limit),
as under compose: a leader that lost leadership exits with status 3 and comes back as a standby.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.cluster import coordinator_flags, wait_for
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.chaos.harness import (
    CHECKPOINT_DIR,
    COORDINATOR_PORT,
    HEALTHD_PORT,
    LABEL,
    TASK_ARGS,
    ChaosConfig,
    DockerCluster,
    security_of,
    write_tls,
)

ETCD_IMAGE = os.environ.get("DILOCO_ETCD_IMAGE", "diloco-etcd:latest")  # scripts/build_images.sh builds it
ETCD_PORT = 2379
REPLICAS = ("coordinator-a", "coordinator-b")
# Events a leader logs only when it accepts work: a registration, a submission, a round closed and published.
ACCEPTING = frozenset({"worker.registered", "submission.accepted", "round.closed"})

T = TypeVar("T")


class NoLeader(grpc.RpcError):
    """No replica answers SERVING right now: transient (UNAVAILABLE), so the suite's waits ask again."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.detail


class HaDockerCluster(DockerCluster):
    """etcd, two coordinator replicas, healthd and N learners, one container each, on a network of their own.
    The host reaches each replica through its own published port and asks whichever serves (the leader)."""

    def __init__(self, client: Any, cfg: ChaosConfig, name: str, etcd_image: str = ETCD_IMAGE) -> None:
        super().__init__(client, cfg, name)
        self.etcd_image = etcd_image
        self._leader = ""  # the replica that answered SERVING last; "": ask again
        self._leader_address = ""  # its published address on the host
        self.seen: list[tuple[float, int, int]] = []  # (monotonic time, epoch, version) of every GetStatus answer

    # --- names and addresses ----------------------------------------------------------------------------------
    @property
    def hosts(self) -> tuple[str, ...]:
        return (*(self.cname(r) for r in REPLICAS), self.cname("healthd"), "localhost", "127.0.0.1")

    @property
    def replica_addresses(self) -> str:
        return ",".join(f"{self.cname(r)}:{COORDINATOR_PORT}" for r in REPLICAS)

    @property
    def coordinator_address(self) -> str:
        """The leader's published address (looked for again after a refusal, a restart or a network change)."""
        if not self._leader:
            self._leader_address = f"127.0.0.1:{self.published_port(self.leader(), COORDINATOR_PORT)}"
        return self._leader_address

    def worker_command(self, name: str, seed: int) -> list[str]:
        command = super().worker_command(name, seed)
        command[command.index("--coordinator") + 1] = self.replica_addresses
        return command

    def replica_command(self, role: str) -> list[str]:
        c = self.cfg
        return [
            "coordinator",
            *coordinator_flags(c, COORDINATOR_PORT, f"{self.cname('healthd')}:{HEALTHD_PORT}", CHECKPOINT_DIR),
            *("--host", self.cname(role), "--replica-id", role),
            *("--etcd", f"http://{self.cname('etcd')}:{ETCD_PORT}", "--etcd-private-network", "true"),
            *("--replication-log", "16", "--sync-replicas", "1", "--replica-ack-timeout-s", "2"),
            *TASK_ARGS,
        ]

    # --- containers -------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 90.0) -> None:
        c = self.cfg
        self.tls_dir = write_tls(self.hosts, self.worker_names)
        self._security = security_of(self.tls_dir)
        self.network = self.client.networks.create(self.prefix, driver="bridge", labels=self.labels)
        self.start_etcd()
        self._run(
            "healthd",
            [
                "healthd",
                *("--port", str(HEALTHD_PORT), "--coordinator-address", self.replica_addresses),  # follows the leader
                *("--heartbeat-interval-s", str(c.heartbeat_interval_s), "--dead-after-s", str(c.dead_after_s)),
            ],
            "healthd",
            ports={f"{HEALTHD_PORT}/tcp": ("127.0.0.1",)},
        )
        # the first replica leads, the second follows it: which is which does not depend on a race
        self.start_replica(REPLICAS[0])
        self.healthd_port = self.published_port("healthd", HEALTHD_PORT)
        self.wait_serving("healthd", self.healthd_address, timeout_s)
        self.wait_event(REPLICAS[0], "replica.promoted", timeout_s)
        self.start_replica(REPLICAS[1])
        self.wait_event(REPLICAS[1], "replication.snapshot_loaded", timeout_s)
        for i, name in enumerate(self.worker_names):
            self._run(name, self.worker_command(name, seed=i), name)
        self.started_at = time.monotonic()
        self.wait_version(1, timeout_s)
        self.training_since = time.monotonic()

    def start_etcd(self) -> None:
        """One etcd member, reached by the replicas at its container name; nothing published to the host."""
        peer = "http://127.0.0.1:2380"  # one member: its peer port stays inside its container
        self.containers["etcd"] = self.client.containers.run(
            self.etcd_image,
            command=[
                "/usr/local/bin/etcd",
                *("--name", "etcd", "--data-dir", "/var/lib/etcd/data"),
                *("--listen-client-urls", f"http://0.0.0.0:{ETCD_PORT}"),
                *("--advertise-client-urls", f"http://{self.cname('etcd')}:{ETCD_PORT}"),
                *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
                *("--initial-cluster", f"etcd={peer}"),
            ],
            name=self.cname("etcd"),
            hostname="etcd",
            network=self.network.name,
            labels={**self.labels, f"{LABEL}.role": "etcd"},
            detach=True,
        )

    def start_replica(self, role: str) -> Any:
        volume = self.client.volumes.create(name=f"{self.prefix}-{role}", labels=self.labels)
        return self._run(
            role,
            self.replica_command(role),
            "coordinator",  # both replicas: the coordinator identity, valid for both names
            ports={f"{COORDINATOR_PORT}/tcp": ("127.0.0.1",)},
            volumes={volume.name: {"bind": "/var/lib/diloco", "mode": "rw"}},
            restart_policy={"Name": "on-failure", "MaximumRetryCount": 0},  # no limit: a retired leader comes back
        )

    def read_ports(self) -> None:
        self.healthd_port = self.published_port("healthd", HEALTHD_PORT)
        self._leader = ""

    def restart(self, role: str) -> None:
        super().restart(role)
        self._leader = ""

    def disconnect(self, role: str) -> None:
        """Cut `role` off the cluster's network (it keeps running, reaching nothing and reached by nobody)."""
        self.network.disconnect(self.containers[role], force=True)
        self._leader = ""

    def connect(self, role: str) -> None:
        self.network.connect(self.containers[role])
        self._leader = ""

    # --- the leader -------------------------------------------------------------------------------------------
    def serving(self, role: str) -> bool:
        """Whether replica `role` answers SERVING (leads) through its published port."""
        container = self.containers[role]
        container.reload()
        bindings = (container.ports or {}).get(f"{COORDINATOR_PORT}/tcp") or []
        if container.status != "running" or not bindings:
            return False
        with self.security.channel(f"127.0.0.1:{bindings[0]['HostPort']}", admin=True) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def leader(self) -> str:
        """The replica that serves; `NoLeader` (transient) when none does right now."""
        self._leader = ""
        for role in REPLICAS:
            if self.serving(role):
                self._leader = role
                return role
        raise NoLeader("no coordinator replica answers SERVING")

    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        previous = self._leader_address
        address = self.coordinator_address
        if self._channel is None or address != previous:
            if self._channel is not None:
                self._channel.close()
            self._channel = self.security.channel(address, admin=True)
        return coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def _at_leader(self, call: Callable[[coordinator_pb2_grpc.CoordinatorStub], T]) -> T:
        """`call` on the leader's stub; a refusal or an outage makes the next call look for the leader again."""
        try:
            return call(self.stub)
        except grpc.RpcError:
            self._leader = ""
            raise

    def status(self) -> coordinator_pb2.GetStatusResponse:
        reply = self._at_leader(lambda s: s.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3.0))
        self.seen.append((time.monotonic(), reply.coordinator_epoch, reply.version))
        return reply

    def workers(self) -> list[coordinator_pb2.WorkerInfo]:
        return list(self._at_leader(lambda s: s.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=3.0)).workers)

    def ledger(self) -> coordinator_pb2.GetLedgerResponse:
        return self._at_leader(lambda s: s.GetLedger(coordinator_pb2.GetLedgerRequest(), timeout=5.0))

    # --- logs -------------------------------------------------------------------------------------------------
    def coordinator_logs(self) -> str:
        return "\n".join(self.logs(role) for role in REPLICAS)

    def events(self, role: str, event: str, since_unix_s: float = 0.0) -> list[dict[str, Any]]:
        """Every `event` line of `role`'s log stamped at or after `since_unix_s`, oldest first."""
        return [f for f in log_events(self.logs(role)) if f["event"] == event and f["unix_s"] >= since_unix_s]

    def wait_event(self, role: str, event: str, timeout_s: float, since_unix_s: float = 0.0) -> dict[str, Any]:
        """The first `event` in `role`'s log at or after `since_unix_s`, waiting for it up to `timeout_s`."""

        def found() -> dict[str, Any] | None:
            seen = self.events(role, event, since_unix_s)
            return seen[0] if seen else None

        return wait_for(f"{event} from {role}", found, timeout_s, interval_s=0.2)


# --- pure checks of what the replicas and learners logged -------------------------------------------------------
def unix_s(timestamp: str) -> float:
    """An ISO timestamp of a log line (UTC, `Z`) as unix seconds."""
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def log_events(text: str) -> list[dict[str, Any]]:
    """The structured lines of one container's log, each with its time as `unix_s`; other lines are skipped."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
            entry["unix_s"] = unix_s(str(entry["timestamp"]))
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(entry.get("event"), str):
            found.append(entry)
    return found


@dataclass(frozen=True)
class Term:
    """One leadership term as a replica's log tells it: promoted under `epoch` at `start`; the last work it accepted
    at `last_accept` (`start` when none); `end`: when it retired, or nan (killed, or still leading)."""

    role: str
    epoch: int
    start: float
    last_accept: float
    end: float


def leadership_terms(role: str, text: str) -> list[Term]:
    """The terms in one replica container's log, across its restarts (each process starts with `replica.started`):
    from `replica.promoted` to `replica.retiring` or the end of that process."""
    terms: list[Term] = []
    current: dict[str, Any] | None = None

    def close(end: float) -> None:
        nonlocal current
        if current is not None:
            terms.append(Term(role, current["epoch"], current["start"], current["last"], end))
        current = None

    for e in log_events(text):
        name, at = e["event"], e["unix_s"]
        if name == "replica.started":
            close(float("nan"))
        elif name == "replica.promoted":
            close(float("nan"))
            current = {"epoch": int(e["epoch"]), "start": at, "last": at}
        elif name == "replica.retiring":
            close(at)
        elif name in ACCEPTING and current is not None:
            current["last"] = max(current["last"], at)
    close(float("nan"))
    return terms


def overlapping_terms(terms: Sequence[Term]) -> list[str]:
    """What breaks "never two leaders accepting at once": by promotion time, epochs must rise, and a term must have
    accepted its last work before the next one was promoted."""
    problems = []
    ordered = sorted(terms, key=lambda t: t.start)
    for before, after in itertools.pairwise(ordered):
        if after.epoch <= before.epoch:
            problems.append(f"{after.role} led epoch {after.epoch} after {before.role}'s epoch {before.epoch}")
        if before.last_accept >= after.start:
            problems.append(
                f"{before.role} (epoch {before.epoch}) accepted work {before.last_accept - after.start:.3f} s after "
                f"{after.role} was promoted (epoch {after.epoch})"
            )
    return problems


def backwards(versions: Sequence[int]) -> list[str]:
    """Where a sequence of versions, in the order they were seen, goes backwards."""
    return [f"{a} -> {b}" for a, b in itertools.pairwise(versions) if b < a]


def received_versions(worker_log: str, before_unix_s: float = float("inf")) -> list[int]:
    """The versions a learner received (`worker.broadcast_received`), in order, stamped before `before_unix_s`."""
    return [
        int(e["version"])
        for e in log_events(worker_log)
        if e["event"] == "worker.broadcast_received" and e["unix_s"] < before_unix_s
    ]
