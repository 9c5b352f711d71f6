"""What the test modules share, in one place (a test module imports helpers from here or gets fixtures from
conftest.py, never from another test module):

- `wait_for` / `seconds_until` (from `diloco.cluster`, the one wait rule of tests and benchmarks): poll a
  condition until a deadline, transient RPC failures counting as "not yet";
- the tiny task that trains in milliseconds;
- an in-process coordinator on port 0 (`Env`, `config`) and what a learner sends it (`register`, `make_upload`,
  `requests`, `submit`), with the checks that a refused call changed nothing (`frozen`, `code_of`, `gauge`);
- healthd's side: a recording coordinator endpoint, a heartbeat client (`Beater`), `healthd_config`, `node_states`;
- a real multi-process cluster (`cluster_config`, `running`) and the checks the cluster tests share.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from diloco.cli.ctl import state_name
from diloco.cluster import (  # noqa: F401  (wait_for and the rest are re-exported for the tests)
    TINY_TASK_ARGS,
    TRANSIENT,
    ClusterConfig,
    LocalCluster,
    LogFollower,
    Proc,
    describe,
    ledger_check,
    ledger_problems,
    ledger_shards,
    seconds_until,
    transient,
    wait_for,
)
from diloco.core.codecs import get_codec
from diloco.ha.etcd_server import EtcdCluster, EtcdServer
from diloco.rpc.payload import meta_to_proto
from diloco.rpc.server import channel
from diloco.task.data import DataConfig
from diloco.task.factory import TaskConfig
from diloco.task.inner import InnerConfig
from diloco.task.model import ModelConfig
from diloco.task.params import ParamSpec
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, healthd_pb2, healthd_pb2_grpc
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.ha import free_port
from services.coordinator.server import CoordinatorServer
from services.healthd.config import HealthdConfig
from services.healthd.server import HealthdServer

V = TypeVar("V")

# --- coordinator replicas (real processes) --------------------------------------------------------------------


def ha_cluster_config(tmp_path: Path, outer_steps: int, min_quorum: int = 1) -> ClusterConfig:
    """The HA multi-process tests' cluster: two learners slowed 2x of the tiny task, decoupled rounds, a checkpoint
    every 2 rounds (the replicas are added with `spawn_replica`)."""
    return ClusterConfig(
        workers=2,
        mode="decoupled",
        slowdowns=(2.0, 2.0),
        outer_steps=outer_steps,
        local_steps=10,
        min_local_steps=2,
        min_quorum=min_quorum,
        checkpoint_every=2,
        run_dir=tmp_path / "run",
        task_args=TINY_TASK_ARGS,
        insecure=True,
    )


def spawn_replica(cluster: LocalCluster, etcd: EtcdServer | EtcdCluster, name: str, *extra: str, port: int = 0) -> Proc:
    """A coordinator replica under etcd leadership with a synchronous standby, on the cluster's task (`port`: the
    one it had, to start it again as a supervisor would). Given an `EtcdCluster`, every member in its order; over
    https when etcd serves it, with the CA and the coordinator's certificate of conftest's `etcd_pki`."""
    members = etcd.members if isinstance(etcd, EtcdCluster) else [etcd]
    tls = members[0].tls
    args = ["--replication-log", "16", "--sync-replicas", "1", "--replica-ack-timeout-s", "2", *extra]
    if tls is not None:
        pki = tls.ca_file.parent
        args += ["--etcd-ca-file", str(tls.ca_file)]
        args += ["--etcd-cert-file", str(pki / "coordinator.pem"), "--etcd-key-file", str(pki / "coordinator.key")]
    return cluster.start_replica(name, ",".join(m.url for m in members), port=port, args=args)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a Prometheus endpoint on this machine: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def healthd_for_replicas(cluster: LocalCluster, *names: str) -> dict[str, int]:
    """A free port for each replica in `names`, and healthd started reporting to all of them (as deployed: healthd
    is given every replica's address and follows the leader, so learners are confirmed alive at whichever leads)."""
    ports = {name: free_port("127.0.0.1") for name in names}
    coordinators = ",".join(f"127.0.0.1:{port}" for port in ports.values())
    cluster.healthd_port = cluster.bound_port(cluster.start_healthd(coordinators), "healthd.started", 30)
    return ports


# --- the tiny task ---------------------------------------------------------------------------------------------


def finish_and_check(
    cfg: ClusterConfig, address: str, target: int, timeout_s: float = 120.0
) -> tuple[pb.GetStatusResponse, pb.GetLedgerResponse]:
    """An HA job's end, judged at the replica `address`: it reaches `target` there (versions read meanwhile never go
    backwards) and finishes at it, its ledger is exactly once, and no learner received a version that went
    backwards. Returns the final status and ledger for the test's own checks."""
    seen: list[int] = []

    def reached() -> bool:
        with channel(address) as ch:
            v = coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(pb.GetStatusRequest(), timeout=3).version
        seen.append(int(v))
        return seen[-1] >= target

    wait_for(f"the job finishes at {address}", reached, timeout_s=timeout_s, interval_s=0.2)
    assert seen == sorted(seen), f"a version went backwards at {address}: {seen}"
    with channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
        ledger = stub.GetLedger(pb.GetLedgerRequest(), timeout=5)
    assert status.finished and status.version == target, status
    assert not ledger_check(ledger), "exactly-once ledger broken: " + "; ".join(ledger_check(ledger))
    for i in range(cfg.workers):
        lines = LogFollower(cfg.run_dir / f"worker{i}.log").read()
        received = [int(str(x.fields["version"])) for x in lines if x.event == "worker.broadcast_received"]
        assert received == sorted(received), f"worker{i} received a version that went backwards: {received}"
    return status, ledger


def tiny_task(num_shards: int = 8) -> TaskConfig:
    return TaskConfig(
        model=ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2),
        data=DataConfig(num_shards=num_shards, max_bytes=400_000),
        inner=InnerConfig(batch_size=4, warmup_steps=5, total_steps=400, lr=3e-3),
    )


# --- the coordinator in process --------------------------------------------------------------------------------

pb = coordinator_pb2
CHUNK = 16 << 10  # small chunks, so a tiny model's payload still spans several
T = 5.0  # deadline of every unary call to the in-process coordinator


def config(**kw: Any) -> CoordinatorServiceConfig:
    base: dict[str, Any] = {"task": tiny_task(), "eval_every": 0, "grace_max_s": 30.0, "min_quorum": 2}
    return CoordinatorServiceConfig(**{**base, **kw})


@dataclass
class Env:
    """A started in-process coordinator (`conftest.start`) and a channel to it."""

    server: CoordinatorServer
    stub: coordinator_pb2_grpc.CoordinatorStub
    chan: grpc.Channel
    specs: list[ParamSpec]

    @property
    def numel(self) -> int:
        return self.server.core.params.numel()


def gauge(env: Env, name: str) -> float | None:
    """A coordinator metric's value now (None: never set)."""
    value: float | None = env.server.metrics.registry.get_sample_value(f"diloco_coordinator_{name}")
    return value


def register(env: Env, name: str = "w", throughput: common_pb2.Throughput | None = None) -> pb.RegisterResponse:
    request = pb.RegisterRequest(worker_name=name, model_fingerprint=env.server.task.fingerprint, throughput=throughput)
    resp: pb.RegisterResponse = env.stub.Register(request, timeout=T)
    return resp


def make_upload(
    env: Env,
    reg: pb.RegisterResponse,
    sid: str,
    *,
    codec: str = "fp32",
    delta: torch.Tensor | None = None,
    tokens: int = 128,
    seed: int = 0,
) -> tuple[pb.SubmissionHeader, bytes, torch.Tensor]:
    """A valid submission against the learner's current plan: (header, encoded payload, the delta)."""
    got = env.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=reg.worker_id), timeout=T)
    lease = got.plan.shards[0]
    if delta is None:
        delta = torch.randn(env.numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
    data, meta = get_codec(codec).encode(delta)
    header = pb.SubmissionHeader(
        worker_id=reg.worker_id,
        coordinator_epoch=reg.coordinator_epoch,
        submission_id=sid,
        base_version=got.version,
        tokens=tokens,
        steps=1,
        ranges=[
            common_pb2.ShardRange(
                shard_id=lease.shard_id, epoch=lease.epoch, start=lease.cursor, end=lease.cursor + tokens
            )
        ],
        payload=meta_to_proto(meta, env.specs),
        plan_seq=got.plan.plan_seq,
    )
    return header, bytes(data), delta  # payloads may be any bytes-like; tests slice, mutate and join bytes


def requests(
    header: pb.SubmissionHeader | None, data: bytes | bytearray | memoryview, offset: int = 0
) -> list[pb.SubmitPseudoGradientRequest]:
    msgs = [pb.SubmitPseudoGradientRequest(header=header)] if header is not None else []
    msgs += [pb.SubmitPseudoGradientRequest(data=bytes(data[i : i + CHUNK])) for i in range(offset, len(data), CHUNK)]
    return msgs


def submit(env: Env, header: pb.SubmissionHeader, data: bytes) -> pb.SubmitPseudoGradientResponse:
    resp: pb.SubmitPseudoGradientResponse = env.stub.SubmitPseudoGradient(iter(requests(header, data)), timeout=T)
    return resp


def frozen(env: Env) -> tuple[torch.Tensor, bytes, int]:
    """Global parameters, the ledger and the version, to check that a refused call changed nothing."""
    ledger = env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    return env.server.core.params.clone(), ledger.SerializeToString(deterministic=True), ledger.version


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    return err.code(), err.details()


class Clock:
    """A coordinator clock the test moves (`CoordinatorServer(clock=...)`): unix seconds, from 1000."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# --- a carbon provider (--carbon-provider tests.support:carbon_provider) ---------------------------------------


class CarbonScript:
    """What `carbon_provider` does when called: answer `values[zone]`, answer `values` whole (a grid's mapping,
    which may leave the zone out), raise, hang until `release` is set, or return `bad` (a value that is no
    intensity). `calls` counts the calls."""

    def __init__(self) -> None:
        self.mode = "answer"  # answer | grid | raise | hang | bad
        self.values: dict[str, float | None] = {}
        self.bad: object = float("nan")
        self.release = threading.Event()
        self.calls = 0


CARBON = CarbonScript()


def carbon_provider(zone: str, unix_s: float) -> object:
    CARBON.calls += 1
    if CARBON.mode == "raise":
        raise RuntimeError(f"the grid API is down for {zone}")
    if CARBON.mode == "hang":
        CARBON.release.wait(30)
    if CARBON.mode == "bad":
        return CARBON.bad
    if CARBON.mode == "grid":
        return dict(CARBON.values)
    return CARBON.values[zone]


# --- healthd's side --------------------------------------------------------------------------------------------

INTERVAL_S = 0.1  # heartbeat interval of the in-process healthd
DEAD_AFTER_S = 0.6
WORKER = healthd_pb2.NODE_ROLE_WORKER


@dataclass
class Received:
    request: Any
    at: float


class RecordingCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.failures: list[Received] = []
        self.throughput: list[Received] = []

    def ReportNodeFailure(
        self, request: coordinator_pb2.ReportNodeFailureRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ReportNodeFailureResponse:
        with self.cond:
            self.failures.append(Received(request, time.time()))
            self.cond.notify_all()
        return coordinator_pb2.ReportNodeFailureResponse(known=True, reassigned_shards=[3, 5])

    def ReportThroughput(
        self, request: coordinator_pb2.ReportThroughputRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ReportThroughputResponse:
        singles = [request] if request.worker_id else []
        singles += [  # healthd's batch, recorded as single reports
            coordinator_pb2.ReportThroughputRequest(worker_id=r.worker_id, throughput=r.throughput)
            for r in request.reports
        ]
        with self.cond:
            self.throughput += [Received(r, time.time()) for r in singles]
            self.cond.notify_all()
        return coordinator_pb2.ReportThroughputResponse()

    def wait_failures(self, n: int, timeout_s: float) -> list[Received]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.failures) >= n, timeout_s)
            assert ok, f"coordinator got {len(self.failures)} failure reports, expected {n}"
            return list(self.failures)


class CoordinatorEndpoint:
    """A minimal real gRPC server (the generated `CoordinatorServicer`) on loopback: by default one that records what
    healthd tells it (`recorder`), else `servicer`."""

    def __init__(self, port: int = 0, servicer: coordinator_pb2_grpc.CoordinatorServicer | None = None) -> None:
        self.recorder = RecordingCoordinator()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer or self.recorder, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        assert self.port, f"cannot bind 127.0.0.1:{port}"
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0).wait()


class Beater:
    """One heartbeat stream. With `interval_s`, a thread sends a heartbeat at that pace until `pause`/`kill`."""

    def __init__(
        self,
        address: str,
        node_id: str,
        role: healthd_pb2.NodeRole = WORKER,
        interval_s: float | None = INTERVAL_S,
        throughput: common_pb2.Throughput | None = None,
    ) -> None:
        self.node_id, self.role, self.throughput = node_id, role, throughput
        self.channel = channel(address)
        self._q: queue.SimpleQueue[healthd_pb2.HeartbeatRequest | None] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.acks: list[healthd_pb2.HeartbeatResponse] = []
        self.error: grpc.RpcError | None = None
        self.done = False
        self.seq = 0
        self.last_sent_at = 0.0
        self.call = healthd_pb2_grpc.HealthDaemonStub(self.channel).Heartbeat(self._requests(), timeout=30)
        self._rx = threading.Thread(target=self._receive, daemon=True)
        self._rx.start()
        self._paused = threading.Event()
        self._tx: threading.Thread | None = None
        if interval_s is not None:
            self._tx = threading.Thread(target=self._pace, args=(interval_s,), daemon=True)
            self._tx.start()

    def _requests(self) -> Iterator[healthd_pb2.HeartbeatRequest]:
        while (item := self._q.get()) is not None:
            yield item

    def _receive(self) -> None:
        try:
            for resp in self.call:
                with self.cond:
                    self.acks.append(resp)
                    self.cond.notify_all()
        except grpc.RpcError as e:
            self.error = e
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def _pace(self, interval_s: float) -> None:
        while not self._paused.is_set():
            self.send()
            self._paused.wait(interval_s)

    def send(self, leaving: bool = False, **fields: Any) -> int:
        self.seq += 1
        req = healthd_pb2.HeartbeatRequest(
            node_id=self.node_id, role=self.role, sequence=self.seq, leaving=leaving, throughput=self.throughput
        )
        for name, value in fields.items():
            setattr(req, name, value)
        self.last_sent_at = time.time()
        self._q.put(req)
        return self.seq

    def wait_acks(self, n: int, timeout_s: float = 5.0) -> list[healthd_pb2.HeartbeatResponse]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.acks) >= n or self.done, timeout_s)
            assert ok and len(self.acks) >= n, f"{self.node_id}: {len(self.acks)} acks, expected {n} ({self.error})"
            return list(self.acks)

    def wait_done(self, timeout_s: float = 5.0) -> grpc.RpcError | None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.done, timeout_s), "stream did not end"
        return self.error

    def pause(self) -> None:
        """Stop sending; the stream stays open (a hung process)."""
        self._paused.set()
        if self._tx is not None and self._tx is not threading.current_thread():
            self._tx.join(5)

    def kill(self) -> None:
        """The process dies: no more heartbeats, the stream breaks."""
        self.pause()
        self.call.cancel()
        self.channel.close()

    def close(self) -> None:
        self.pause()
        self._q.put(None)
        self.wait_done()
        self.channel.close()


def healthd_config(**overrides: Any) -> HealthdConfig:
    fields: dict[str, Any] = {
        "heartbeat_interval_s": INTERVAL_S,
        "suspect_after_missed": 2,
        "dead_after_s": DEAD_AFTER_S,
        "report_timeout_s": 1.0,
        "shutdown_grace_s": 0.2,
        "metrics_port": -1,  # the registry still counts; the HTTP endpoint is tested once (its stop is slow)
    }
    fields.update(overrides)
    return HealthdConfig(**fields)


def stub_for(server: HealthdServer) -> tuple[grpc.Channel, healthd_pb2_grpc.HealthDaemonStub]:
    ch = channel(server.address)
    return ch, healthd_pb2_grpc.HealthDaemonStub(ch)


def node_states(server: HealthdServer) -> dict[str, int]:
    ch, stub = stub_for(server)
    with ch:
        return {n.node_id: n.state for n in stub.ListNodes(healthd_pb2.ListNodesRequest(), timeout=5).nodes}


# --- a real multi-process cluster ------------------------------------------------------------------------------

UNTRAINED_LOSS = math.log(256)  # a byte-level model that knows nothing


def cluster_config(run_dir: Path, **overrides: Any) -> ClusterConfig:
    """A small cluster of the tiny task with the settings the multi-process tests share (rounds of 10 local steps,
    a quorum of 2, heartbeats every 0.25 s, dead after 2 s); `overrides` on top."""
    settings: dict[str, Any] = {
        "local_steps": 10,
        "min_local_steps": 2,
        "min_quorum": 2,
        "dead_after_s": 2.0,
        "heartbeat_interval_s": 0.25,
        "run_dir": run_dir,
        "task_args": TINY_TASK_ARGS,
    }
    return ClusterConfig(**{**settings, **overrides})


@contextmanager
def running(cfg: ClusterConfig, start_timeout_s: float = 60.0) -> Iterator[LocalCluster]:
    """healthd, the coordinator and the workers of `cfg` as real processes on loopback, stopped (and every child
    reaped) on the way out."""
    c = LocalCluster(cfg)
    try:
        c.start(timeout_s=start_timeout_s)
        yield c
    finally:
        c.stop(grace_s=10)


class Events:
    """Every structured line of a child's log, read as it grows; `first(event)` raises once the child has exited
    without writing it."""

    def __init__(self, path: Path, proc: Proc | None = None) -> None:
        self._follower = LogFollower(path)
        self.proc = proc
        self.lines: list[tuple[str, dict[str, object]]] = []

    def first(self, event: str) -> dict[str, object] | None:
        return next(iter(self.all(event)), None)

    def all(self, event: str) -> list[dict[str, object]]:
        self.lines.extend((x.event, x.fields) for x in self._follower.read())
        found = [f for e, f in self.lines if e == event]
        if not found and self.proc is not None and not self.proc.alive:
            raise RuntimeError(f"{self.proc.name} exited with {self.proc.popen.returncode}: {self.lines[-5:]}")
        return found


def worker_state(c: LocalCluster, name: str) -> str:
    """The coordinator's state of worker `name`'s newest incarnation ("unknown": never registered)."""
    ws = [w for w in c.workers().workers if w.worker_name == name]
    return state_name(max(ws, key=lambda w: w.registered_unix_s).state) if ws else "unknown"


def assert_exactly_once(c: LocalCluster) -> None:
    problems = ledger_check(c.ledger())
    assert not problems, "the ledger is not exactly once:\n" + "\n".join(problems)


def assert_finished_and_learned(c: LocalCluster) -> None:
    wait_for("training to finish", lambda: c.status().finished, timeout_s=150, interval_s=0.2)
    status = c.final_status()
    assert status.validation_loss < UNTRAINED_LOSS - 1.0, f"loss {status.validation_loss} did not drop"
    assert_exactly_once(c)


def resident_kb(tensor: torch.Tensor) -> int:
    """The resident kB of the mapping of this process that holds `tensor`'s first byte (/proc/self/smaps)."""
    address, rss, inside = tensor.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            rss = int(line.split()[1])
    assert rss is not None, "no mapping holds the tensor"
    return rss
