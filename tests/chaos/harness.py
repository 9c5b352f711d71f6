"""A Decoupled DiLoCo cluster in containers, driven with the Docker SDK, and the checks the chaos tests share.

Each `DockerCluster` gets its own user-defined bridge network, checkpoint volume and container names, all labelled
with the run id, and removes them all in `stop()`. The host reaches the coordinator and healthd only through ports
published on 127.0.0.1; the containers talk to one another on their own network and nowhere else.

Every connection is mutual TLS with tokens, as in production: each cluster writes a CA, certificates (SANs: the
containers' names and 127.0.0.1) and tokens into a temporary folder on the host (`diloco.rpc.tls.write_bundle`),
bind-mounted read-only at /certs in every container; the host's own channels use the admin identity and token.

The pure helpers (`error_lines`, `median`, `render_table`) take plain data and are unit-tested
without an engine (tests/chaos/test_harness.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.cli.ctl import state_name
from diloco.cluster import TINY_TASK_ARGS, coordinator_flags, ledger_check
from diloco.rpc.security import SecurityConfig
from diloco.rpc.tls import ADMIN_TOKEN_FILE, JOIN_TOKEN_FILE, write_bundle
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc, healthd_pb2, healthd_pb2_grpc
from tests.support import seconds_until

IMAGE = os.environ.get("DILOCO_IMAGE", "diloco:latest")
REQUIRE = os.environ.get("DILOCO_CHAOS_REQUIRE", "") not in ("", "0", "false", "no")  # CI: fail, never skip
SESSION = uuid.uuid4().hex[:12]  # labels everything this pytest session creates
LABEL = "org.diloco.chaos"  # every object a chaos run creates carries it, with the run id as value
SESSION_LABEL = "org.diloco.chaos.session"
COORDINATOR_PORT = 50051
HEALTHD_PORT = 50052
CHECKPOINT_DIR = "/var/lib/diloco/checkpoints"
TLS_MOUNT = "/certs"  # where every container finds its TLS folder (read-only)
IMAGE_UID = 10001  # the image's user (docker/Dockerfile), who must be able to read the keys and tokens
UNTRAINED_LOSS = math.log(256)  # a byte-level model that knows nothing
# How much worse than the fault-free run of the same length a run with faults may end, in nats of validation loss.
# Measured (2026-12-02): fault-free runs of this configuration end at 2.18-2.50 (8 runs) from an untrained 5.55;
# asynchronous rounds make every run's trajectory its own, so two fault-free runs differ by up to ~0.3. Faults cost
# on top of that: kills ~0.1-0.2; one learner behind 1 Mbit/s with 3% drops (netem-worker) ended above its own
# baseline in all 5 runs measured, by 0.12-0.47 (mean 0.25), its uploads nearly all fresh, and failed a CI run at the
# former 0.4. A run that lost its way (diverged, poisoned, updates applied twice) ends a nat or more above. See
# tests/chaos/README.md.
LOSS_MARGIN = 0.6
FINAL_EVALS = 5  # "final loss": the mean of the last 5 evaluations

# The tiny task of tests/test_cluster_faults.py: one layer, 32 wide; a round takes a fraction of a second. Every
# evaluation scores the whole validation split (~16k tokens), not TINY_TASK_ARGS' 2,048: on 2,048 tokens the final
# losses of 4 fault-free runs spread 2.19-2.55, enough for the former 0.3 margin to fail on noise alone.
TASK_ARGS = (*TINY_TASK_ARGS, "--eval-tokens", "0")


@dataclass(frozen=True)
class ChaosConfig:
    image: str
    session: str  # the value of SESSION_LABEL on everything this configuration's clusters create
    workers: int = 3
    # learners 16x slower than the machine (they sleep), so a run lasts ~40 s, long enough to break it repeatedly
    slowdown: float = 16.0
    outer_steps: int = 60
    local_steps: int = 10
    min_local_steps: int = 2
    min_quorum: int = 2
    dead_after_s: float = 2.0
    heartbeat_interval_s: float = 0.25
    checkpoint_every: int = 2
    mode: str = "decoupled"
    codec: str = "int8"
    net_admin_worker: int = -1  # the one worker given NET_ADMIN (for tc/iptables inside it); -1: none


def unavailable(reason: str) -> None:
    """Skip with the reason, or fail with it when DILOCO_CHAOS_REQUIRE is set."""
    if REQUIRE:
        pytest.fail(f"{reason} (DILOCO_CHAOS_REQUIRE is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def write_tls(hosts: Sequence[str], workers: Sequence[str]) -> Path:
    """A temporary TLS folder for one cluster (`diloco certs` layout): a CA, certificates for the services (SANs:
    `hosts`), `admin` and each name in `workers`, and fresh tokens, readable by the containers' user. The caller
    removes it."""
    d = Path(tempfile.mkdtemp(prefix="diloco-chaos-tls-"))
    write_bundle(d, clients=list(workers), hosts=list(hosts))
    share_with_image_user(d)
    return d


def share_with_image_user(d: Path) -> None:
    """Make the TLS folder `d` readable inside the containers (uid IMAGE_UID): as root, hand it over with the modes
    kept (keys 0600); otherwise (a rootless engine's user) open the throwaway test keys to everyone."""
    if os.geteuid() == 0:
        for path in (d, *d.iterdir()):
            os.chown(path, IMAGE_UID, IMAGE_UID)
        return
    d.chmod(0o755)
    for path in d.iterdir():
        path.chmod(0o644)


def security_of(tls_dir: Path, name: str = "admin") -> SecurityConfig:
    """The host's client side of a chaos cluster: identity `name` of `tls_dir` and both tokens."""
    return SecurityConfig(
        tls_dir=str(tls_dir),
        tls_name=name,
        insecure=False,
        join_token=(tls_dir / JOIN_TOKEN_FILE).read_text().strip(),
        admin_token=(tls_dir / ADMIN_TOKEN_FILE).read_text().strip(),
    )


class DockerCluster:
    """healthd, the coordinator and N workers, one container each, on a network of their own."""

    def __init__(self, client: Any, cfg: ChaosConfig, name: str) -> None:
        self.client = client
        self.cfg = cfg
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.prefix = f"diloco-chaos-{self.run_id}"
        self.labels = {LABEL: self.run_id, SESSION_LABEL: cfg.session}
        # host ports docker picked for the published gRPC ports (read back in start() and after a restart)
        self.coordinator_port = 0
        self.healthd_port = 0
        self.containers: dict[str, Any] = {}
        self.network: Any = None
        self.volume: Any = None
        self.tls_dir: Path | None = None  # written by start()
        self._security: SecurityConfig | None = None
        self._channel: grpc.Channel | None = None
        self.started_at = 0.0  # workers started
        self.training_since = 0.0  # first round applied

    # --- names and addresses ----------------------------------------------------------------------------------
    def cname(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    @property
    def coordinator_address(self) -> str:
        return f"127.0.0.1:{self.coordinator_port}"

    @property
    def healthd_address(self) -> str:
        return f"127.0.0.1:{self.healthd_port}"

    @property
    def worker_names(self) -> list[str]:
        return [f"worker{i}" for i in range(self.cfg.workers)]

    @property
    def security(self) -> SecurityConfig:
        """The host's TLS identity (admin) and tokens for this cluster."""
        if self._security is None:
            raise RuntimeError("the cluster is not started: no TLS folder yet")
        return self._security

    # --- containers -------------------------------------------------------------------------------------------
    def _run(
        self,
        role: str,
        command: list[str],
        tls_name: str,
        tls_dir: Path | None = None,
        environment: dict[str, str] | None = None,
        volumes: dict[str, dict[str, str]] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Start container `role` with identity `tls_name` of the TLS folder `tls_dir` (default: the cluster's) at
        /certs; tokens come from that folder unless `environment` says otherwise."""
        certs = tls_dir or self.tls_dir
        assert certs is not None
        container = self.client.containers.run(
            self.cfg.image,
            command=command,
            name=self.cname(role),
            hostname=role,
            network=self.network.name,
            labels={**self.labels, f"{LABEL}.role": role},
            environment={"DILOCO_TLS_DIR": TLS_MOUNT, "DILOCO_TLS_NAME": tls_name, **(environment or {})},
            volumes={str(certs): {"bind": TLS_MOUNT, "mode": "ro"}, **(volumes or {})},
            detach=True,
            **kwargs,
        )
        self.containers[role] = container
        return container

    def worker_command(self, name: str, seed: int) -> list[str]:
        c = self.cfg
        return [
            "worker",
            "--coordinator",
            f"{self.cname('coordinator')}:{COORDINATOR_PORT}",
            "--healthd",
            f"{self.cname('healthd')}:{HEALTHD_PORT}",
            "--name",
            name,
            "--slowdown",
            str(c.slowdown),
            "--heartbeat-interval-s",
            str(c.heartbeat_interval_s),
            "--seed",
            str(seed),
        ]

    def start_worker(
        self,
        name: str,
        seed: int,
        tls_name: str,
        tls_dir: Path | None = None,
        environment: dict[str, str] | None = None,
    ) -> Any:
        """One more learner container, `name`, with identity `tls_name` of `tls_dir` (default: the cluster's)."""
        return self._run(name, self.worker_command(name, seed), tls_name, tls_dir, environment)

    @property
    def hosts(self) -> tuple[str, ...]:
        """What the services' certificates are valid for: their container names (from the other containers) and
        127.0.0.1 (from the host, through the published ports)."""
        return (self.cname("coordinator"), self.cname("healthd"), "localhost", "127.0.0.1")

    def start(self, timeout_s: float = 90.0) -> None:
        c = self.cfg
        self.tls_dir = write_tls(self.hosts, self.worker_names)
        self._security = security_of(self.tls_dir)
        self.network = self.client.networks.create(self.prefix, driver="bridge", labels=self.labels)
        self.volume = self.client.volumes.create(name=f"{self.prefix}-checkpoints", labels=self.labels)
        self._run(
            "healthd",
            [
                "healthd",
                "--port",
                str(HEALTHD_PORT),
                "--coordinator-address",
                f"{self.cname('coordinator')}:{COORDINATOR_PORT}",
                "--heartbeat-interval-s",
                str(c.heartbeat_interval_s),
                "--dead-after-s",
                str(c.dead_after_s),
            ],
            "healthd",
            ports={f"{HEALTHD_PORT}/tcp": ("127.0.0.1",)},  # a free host port that docker picks
        )
        self._run(
            "coordinator",
            [
                "coordinator",
                *coordinator_flags(c, COORDINATOR_PORT, f"{self.cname('healthd')}:{HEALTHD_PORT}", CHECKPOINT_DIR),
                *TASK_ARGS,
            ],
            "coordinator",
            ports={f"{COORDINATOR_PORT}/tcp": ("127.0.0.1",)},
            volumes={self.volume.name: {"bind": "/var/lib/diloco", "mode": "rw"}},
        )
        self.read_ports()
        self.wait_serving("healthd", self.healthd_address, timeout_s)  # both were started above, in parallel
        self.wait_serving("coordinator", self.coordinator_address, timeout_s)
        for i, name in enumerate(self.worker_names):
            self._run(
                name,
                self.worker_command(name, seed=i),
                name,
                cap_add=["NET_ADMIN"] if i == c.net_admin_worker else None,
            )
        self.started_at = time.monotonic()
        self.wait_version(1, timeout_s)  # the learners are in: goodput counts from here, not from cold starts
        self.training_since = time.monotonic()

    def published_port(self, role: str, port: int) -> int:
        """The host port docker published container `role`'s `port` on."""
        container = self.containers[role]
        container.reload()
        bindings = (container.ports or {}).get(f"{port}/tcp") or []
        if not bindings or not bindings[0].get("HostPort"):
            raise AssertionError(
                f"{role} publishes no host port for {port} ({container.status}):\n{self.logs(role, 30)}"
            )
        return int(bindings[0]["HostPort"])

    def read_ports(self) -> None:
        """Learn the host ports of healthd and the coordinator (docker may give a restarted container another)."""
        coordinator_port = self.published_port("coordinator", COORDINATOR_PORT)
        if coordinator_port != self.coordinator_port and self._channel is not None:
            self._channel.close()
            self._channel = None
        self.coordinator_port = coordinator_port
        self.healthd_port = self.published_port("healthd", HEALTHD_PORT)

    def wait_serving(self, role: str, address: str, timeout_s: float) -> float:
        """Wait for SERVING on grpc.health.v1 through the published port; fails early if the container exits."""

        def serving() -> bool:
            container = self.containers[role]
            container.reload()
            if container.status in ("exited", "dead"):
                raise AssertionError(f"{role} exited:\n{self.logs(role, tail=30)}")
            with self.security.channel(address, admin=True) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        return seconds_until(f"{role} to serve on {address}", serving, timeout_s, interval_s=0.1)

    def logs(self, role: str, tail: int | str = "all") -> str:
        return str(self.containers[role].logs(tail=tail).decode(errors="replace"))

    def coordinator_logs(self) -> str:
        """What the coordinator logged (every replica's, in a cluster of several)."""
        return self.logs("coordinator")

    def all_logs(self) -> dict[str, str]:
        return {role: self.logs(role) for role in self.containers}

    def save_logs(self, folder: Path) -> None:
        """Every container's `docker logs` into `folder/<run>/<role>.log`, for a look after the run (pass or fail)."""
        out = folder / self.run_id
        out.mkdir(parents=True, exist_ok=True)
        for role, text in self.all_logs().items():
            (out / f"{role}.log").write_text(text)

    def stop(self) -> None:
        """Remove every container, the network and the volume of this run; safe to call twice."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        remove_labelled(self.client, {LABEL: self.run_id})
        self.containers.clear()
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)
            self.tls_dir = None

    # --- faults -----------------------------------------------------------------------------------------------
    def kill(self, role: str) -> None:
        self.containers[role].kill()  # SIGKILL
        self.containers[role].wait(timeout=30)

    def restart(self, role: str) -> None:
        """Start a killed container again: same name, network and volume; its published port may change (docker
        picks the host ports), so the addresses are read again."""
        self.containers[role].start()
        if role in ("coordinator", "healthd"):
            self.read_ports()

    def exec_root(self, role: str, cmd: Sequence[str]) -> tuple[int, str]:
        code, out = self.containers[role].exec_run(list(cmd), user="root")
        return int(code), out.decode(errors="replace")

    # --- RPCs -------------------------------------------------------------------------------------------------
    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        if self._channel is None:
            self._channel = self.security.channel(self.coordinator_address, admin=True)
        return coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def status(self) -> coordinator_pb2.GetStatusResponse:
        return self.stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3.0)

    def workers(self) -> list[coordinator_pb2.WorkerInfo]:
        return list(self.stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=3.0).workers)

    def ledger(self) -> coordinator_pb2.GetLedgerResponse:
        return self.stub.GetLedger(coordinator_pb2.GetLedgerRequest(), timeout=5.0)

    def nodes(self) -> list[healthd_pb2.NodeInfo]:
        with self.security.channel(self.healthd_address, admin=True) as ch:
            stub = healthd_pb2_grpc.HealthDaemonStub(ch)
            return list(stub.ListNodes(healthd_pb2.ListNodesRequest(), timeout=3.0).nodes)

    def incarnation(self, name: str) -> coordinator_pb2.WorkerInfo | None:
        """The newest registration of worker `name`."""
        mine = [w for w in self.workers() if w.worker_name == name]
        return max(mine, key=lambda w: w.registered_unix_s) if mine else None

    def worker_state(self, worker_id: str) -> tuple[str, int]:
        """(state, shards held) of one incarnation."""
        for w in self.workers():
            if w.worker_id == worker_id:
                return state_name(w.state), len(w.shards)
        return "unknown", 0

    def wait_active(self, name: str, timeout_s: float, not_id: str = "") -> str:
        """Wait until worker `name` has an active incarnation other than `not_id`; returns its id."""
        found: list[str] = []

        def active() -> bool:
            w = self.incarnation(name)
            if w is not None and w.worker_id != not_id and state_name(w.state) == "active":
                found.append(w.worker_id)
                return True
            return False

        seconds_until(f"{name} active" + (f" again (not {not_id})" if not_id else ""), active, timeout_s, 0.1)
        return found[-1]

    def wait_heartbeating(self, worker_id: str, timeout_s: float) -> None:
        """Wait until healthd tracks incarnation `worker_id` as alive. A learner killed between its registration and
        its first heartbeat is unknown to healthd, so nothing declares it dead (see tests/chaos/README.md); the
        scenarios break learners in steady state."""

        def alive() -> bool:
            return any(
                n.node_id == worker_id and n.state == healthd_pb2.NODE_STATE_ALIVE and n.heartbeats >= 2
                for n in self.nodes()
            )

        seconds_until(f"healthd to track {worker_id}", alive, timeout_s, 0.05)

    def wait_reassigned(self, worker_id: str, since: float, timeout_s: float) -> float:
        """Seconds from `since` (a `time.monotonic()` reading taken just before the fault) until incarnation
        `worker_id` is dead and holds no shard: its shards went to the others."""

        seen: list[tuple[str, int]] = [("unknown", 0)]

        def gone() -> bool:
            seen[0] = self.worker_state(worker_id)
            return seen[0] == ("dead", 0)

        try:
            seconds_until(f"{worker_id} declared dead and its shards reassigned", gone, timeout_s, 0.05)
        except TimeoutError as e:
            raise AssertionError(f"{e}; it is {seen[0][0]} with {seen[0][1]} shards, status: {self.status()}") from e
        return time.monotonic() - since

    def wait_version(self, version: int, timeout_s: float) -> float:
        return seconds_until(f"version {version}", lambda: self.status().version >= version, timeout_s, 0.1)

    def wait_finished(self, timeout_s: float) -> float:
        return seconds_until("training to finish", lambda: self.status().finished, timeout_s, 0.2)


def remove_labelled(client: Any, labels: dict[str, str]) -> None:
    """Force-remove the containers (with their anonymous volumes), networks and volumes carrying `labels`."""
    filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
    for container in client.containers.list(all=True, filters=filters):
        try:
            container.remove(force=True, v=True)
        except Exception as e:
            if getattr(e, "status_code", None) != 404:
                raise
    for network in client.networks.list(filters=filters):
        network.remove()
    for volume in client.volumes.list(filters=filters):
        volume.remove(force=True)


# --- pure checks -----------------------------------------------------------------------------------------------
def error_lines(
    role: str, text: str, allowed_events: Iterable[str] = (), allowed_exceptions: Iterable[str] = ()
) -> list[str]:
    """Error-level JSON log lines and tracebacks in one container's log, less the events the fault explains and the
    tracebacks whose exception line (the first unindented line after it) contains one of `allowed_exceptions`."""
    allowed = set(allowed_events)
    exceptions = tuple(allowed_exceptions)
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("{"):
            try:
                entry = json.loads(stripped)
            except ValueError:
                continue
            level = str(entry.get("level", "")).lower()
            if level in ("error", "critical", "fatal") and entry.get("event") not in allowed:
                found.append(f"{role}: {stripped[:400]}")
        elif stripped.startswith("Traceback"):
            raised = exception_line(lines[i + 1 :])
            if not any(e in raised for e in exceptions):
                found.append(f"{role}: {stripped} {raised[:300]}")
    return found


def exception_line(after: Sequence[str]) -> str:
    """The exception a traceback ends with: the first unindented line after its `Traceback` line."""
    for line in after:
        if line.strip() and not line[0].isspace():
            return line.strip()
    return ""


def eval_losses(coordinator_log: str) -> dict[int, float]:
    """Validation loss by version from the coordinator's `eval.done` lines; a later line for the same version (after
    a restart from a checkpoint) replaces the earlier one."""
    losses: dict[int, float] = {}
    for line in coordinator_log.splitlines():
        if '"eval.done"' not in line:
            continue
        try:
            entry = json.loads(line)
            losses[int(entry["version"])] = float(entry["val_loss"])
        except (ValueError, KeyError, TypeError):
            continue
    return losses


def final_loss(losses: dict[int, float], last: int = FINAL_EVALS) -> float:
    """Mean validation loss of the last `last` evaluated versions: one evaluation is noisy (a round may merge a stale
    pseudo-gradient), so the end of the curve is compared, not its last point."""
    versions = sorted(losses)[-last:]
    return sum(losses[v] for v in versions) / len(versions) if versions else math.nan


def median(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass
class ScenarioResult:
    """One row of the summary table."""

    scenario: str
    faults: str  # what was injected, e.g. "3x SIGKILL worker"
    recovery_s: list[float] = field(default_factory=list)
    goodput_tokens_per_s: float = math.nan
    goodput_vs_baseline: float = math.nan
    final_loss: float = math.nan
    baseline_loss: float = math.nan
    wall_s: float = math.nan
    notes: str = ""


RESULTS: list[ScenarioResult] = []  # this session's rows, printed by the conftest at the end


def render_table(results: Sequence[ScenarioResult]) -> str:
    """The summary table: one row per scenario, fixed-width text (also valid Markdown)."""
    header = (
        "scenario",
        "faults injected",
        "recovery max s",
        "recovery median s",
        "goodput tok/s",
        "vs baseline",
        "final loss",
        "baseline loss",
        "wall s",
        "notes",
    )

    def num(x: float, digits: int = 2) -> str:
        return "-" if math.isnan(x) else f"{x:.{digits}f}"

    rows = [header]
    for r in results:
        rows.append(
            (
                r.scenario,
                r.faults,
                num(max(r.recovery_s)) if r.recovery_s else "-",
                num(median(r.recovery_s)),
                num(r.goodput_tokens_per_s, 0),
                "-" if math.isnan(r.goodput_vs_baseline) else f"{r.goodput_vs_baseline:.0%}",
                num(r.final_loss, 3),
                num(r.baseline_loss, 3),
                num(r.wall_s, 1),
                r.notes,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def allowed_for(role: str, allowed: dict[str, set[str]] | None) -> set[str]:
    """What `allowed` (role prefix -> names) allows in container `role`'s log."""
    return {name for prefix, names in (allowed or {}).items() if role.startswith(prefix) for name in names}


# --- the invariants every scenario ends with -------------------------------------------------------------------
def finish_and_check(
    cluster: DockerCluster,
    result: ScenarioResult,
    baseline: ScenarioResult | None,
    *,
    allowed_errors: dict[str, set[str]] | None = None,
    allowed_tracebacks: dict[str, set[str]] | None = None,
    timeout_s: float = 180.0,
) -> ScenarioResult:
    """The invariants every scenario ends with: the job finishes; the ledger holds every committed range exactly
    once and no incarnation that is gone owns a shard; no error-level log line nor traceback but those the fault
    explains (`allowed_errors`: role prefix -> event names; `allowed_tracebacks`: role prefix -> text of the
    exception line); the final loss is within `LOSS_MARGIN` of the baseline's (the
    baseline itself must end at least 1 nat below an untrained model). Fills in `result`'s loss, goodput (tokens
    applied per second from the first round to the end) and wall time."""
    cluster.wait_finished(timeout_s)
    result.wall_s = time.monotonic() - cluster.training_since
    # the registry before the ledger: learners leave once the job finished, and one that left between the two
    # reads would look like a gone owner (its shards are released when it leaves, never handed back to it)
    gone = {w.worker_id for w in cluster.workers() if state_name(w.state) in ("dead", "evicted", "left")}
    status = cluster.status()
    ledger = cluster.ledger()
    problems = ledger_check(ledger)
    assert not problems, "ledger: " + "; ".join(problems)
    stale_owners = {s.owner for s in ledger.shards if s.owner in gone}
    assert not stale_owners, f"incarnations that are gone still own shards: {stale_owners}"
    result.final_loss = final_loss(eval_losses(cluster.coordinator_logs()))
    result.goodput_tokens_per_s = status.tokens_applied / result.wall_s
    errors = []
    for role, text in cluster.all_logs().items():
        events = allowed_for(role, allowed_errors)
        errors += error_lines(role, text, events, allowed_for(role, allowed_tracebacks))
    assert not errors, "error-level log lines not explained by the injected fault:\n" + "\n".join(errors[:20])
    assert math.isfinite(result.final_loss), "no validation loss"
    if baseline is None:
        assert result.final_loss < UNTRAINED_LOSS - 1.0, f"the fault-free run did not learn: {result.final_loss}"
    else:
        result.baseline_loss = baseline.final_loss
        result.goodput_vs_baseline = result.goodput_tokens_per_s / baseline.goodput_tokens_per_s
        assert result.final_loss <= baseline.final_loss + LOSS_MARGIN, (
            f"final loss {result.final_loss:.3f} is more than {LOSS_MARGIN} above the fault-free "
            f"{baseline.final_loss:.3f}"
        )
    return result
