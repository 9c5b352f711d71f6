"""Every status code of every learner RPC, answered by a real coordinator: the learner does what
`diloco.core.learner.REACTIONS` says (retry, re-register, resync, drop the upload, stop) and never dies of it.

A `FaultProxy` (a gRPC server on port 0) stands in front of a real in-process coordinator: it forwards every call
unchanged, except the next calls of a method it was told to fail. Pointing it at a freshly started coordinator is
a coordinator restart under the same address (a new epoch that knows no learner)."""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import structlog

from diloco.core import learner as core
from diloco.core.broadcast import Refusal
from diloco.core.learner import REACTIONS, STATUS_CODES, Reaction, Rpc
from diloco.rpc.bulk import BulkError
from diloco.rpc.coordinators import Coordinators
from diloco.rpc.retry import Backoff, BackoffConfig, retry_while
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc, healthd_pb2
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.server import CoordinatorServer
from services.healthd.config import HealthdConfig
from services.healthd.server import HealthdServer
from services.worker.config import WorkerConfig
from services.worker.session import SessionLost
from services.worker.watcher import Delivered, Watcher, WatchFailed
from services.worker.worker import Worker
from tests.support import tiny_task, wait_for

pytestmark = pytest.mark.timeout(120)
UNKNOWN = "unknown worker; register first"


class FaultProxy(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Forwards every call of `service` to `backend`; `fail(method, code, times)` makes the next `times` calls of
    `method` answer `code` instead."""

    def __init__(self, backend: str, service: str = "Coordinator") -> None:
        found = coordinator_pb2.DESCRIPTOR.services_by_name.get(service)
        self.methods = found or healthd_pb2.DESCRIPTOR.services_by_name[service]
        self._lock = threading.Lock()
        self._faults: dict[str, list[tuple[grpc.StatusCode, str]]] = {}
        self._rewrites: dict[str, list[Callable[[bytes], bytes]]] = {}
        self.calls: dict[str, int] = {}
        self._chan: grpc.Channel | None = None
        self.point(backend)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def point(self, backend: str) -> None:
        old, self._chan = self._chan, grpc.insecure_channel(backend)
        if old is not None:
            old.close()

    def fail(self, method: str, code: grpc.StatusCode, times: int = 1, details: str = "") -> None:
        with self._lock:
            self._faults.setdefault(method, []).extend([(code, details or f"injected {code.name}")] * times)

    def rewrite(self, method: str, fn: Callable[[bytes], bytes]) -> None:
        """The next reply of unary `method` goes through `fn` (e.g. a field this build does not know)."""
        with self._lock:
            self._rewrites.setdefault(method, []).append(fn)

    def _rewritten(self, name: str, reply: bytes) -> bytes:
        with self._lock:
            pending = self._rewrites.get(name)
            fn = pending.pop(0) if pending else None
        return reply if fn is None else fn(reply)

    def close(self) -> None:
        self.server.stop(0)
        if self._chan is not None:
            self._chan.close()

    def _fault(self, name: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            pending = self._faults.get(name)
            fault = pending.pop(0) if pending else None
        if fault is not None:
            context.abort(*fault)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        path: str = details.method
        name = path.rsplit("/", 1)[-1]
        m = self.methods.methods_by_name.get(name)
        if m is None:
            return None
        chan = self._chan
        assert chan is not None

        def abort_as(e: grpc.RpcError, context: grpc.ServicerContext) -> None:
            context.abort(e.code(), e.details() or "")

        def unary(req: bytes, context: grpc.ServicerContext) -> Any:
            self._fault(name, context)
            try:
                return self._rewritten(name, chan.unary_unary(path, None, None)(req, timeout=30))
            except grpc.RpcError as e:
                abort_as(e, context)

        def client_stream(it: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            self._fault(name, context)
            try:
                return chan.stream_unary(path, None, None)(it, timeout=30)
            except grpc.RpcError as e:
                abort_as(e, context)

        def relay_stream(call: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            context.add_callback(call.cancel)
            try:
                yield from call
            except grpc.RpcError as e:
                if context.is_active():
                    abort_as(e, context)

        def server_stream(req: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
            self._fault(name, context)
            return relay_stream(chan.unary_stream(path, None, None)(req), context)

        def bidi(it: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            self._fault(name, context)
            return relay_stream(chan.stream_stream(path, None, None)(it), context)

        if m.client_streaming and m.server_streaming:
            return grpc.stream_stream_rpc_method_handler(bidi)
        if m.client_streaming:
            return grpc.stream_unary_rpc_method_handler(client_stream)
        if m.server_streaming:
            return grpc.unary_stream_rpc_method_handler(server_stream)
        return grpc.unary_unary_rpc_method_handler(unary)


def coordinator(**kw: Any) -> CoordinatorServer:
    base: dict[str, Any] = {
        "task": tiny_task(),
        "eval_every": 0,
        "min_quorum": 1,
        "local_steps": 2,
        "min_local_steps": 1,
        "grace_max_s": 0.0,
        "bulk_port": -1,
    }
    srv = CoordinatorServer(CoordinatorServiceConfig(**{**base, **kw}))
    srv.start()
    return srv


@pytest.fixture(scope="module")
def backend() -> Iterator[CoordinatorServer]:
    srv = coordinator()
    yield srv
    srv.stop(0)


@pytest.fixture
def proxy(backend: CoordinatorServer) -> Iterator[FaultProxy]:
    p = FaultProxy(backend.address)
    yield p
    p.close()


@pytest.fixture
def worker(backend: CoordinatorServer, proxy: FaultProxy) -> Iterator[Worker]:
    w = Worker(WorkerConfig(coordinator=proxy.address, upload_path="grpc", rpc_timeout_s=5.0, retry_total_s=10.0))
    yield w
    w.close()
    leave(backend, w.reg.worker_id if w.reg else "")


def leave(srv: CoordinatorServer, worker_id: str) -> None:
    """Deregister a test's learner on the shared coordinator, so the next test's learner gets shards."""
    if not worker_id:
        return
    with grpc.insecure_channel(srv.address) as chan, contextlib.suppress(grpc.RpcError):  # gone already
        coordinator_pb2_grpc.CoordinatorStub(chan).Deregister(
            coordinator_pb2.DeregisterRequest(worker_id=worker_id), timeout=10
        )


def code(name: str) -> grpc.StatusCode:
    return grpc.StatusCode[name]


def registered(w: Worker) -> str:
    w._register()
    assert w.core.worker_id, w.core.exit
    return w.core.worker_id


def until_submit(w: Worker, timeout_s: float = 60.0) -> core.Submit:
    """Run the worker's own loop until the core asks for a submission."""
    deadline = time.monotonic() + timeout_s
    while not isinstance(a := w._next(), core.Submit):
        assert time.monotonic() < deadline and not isinstance(a, core.Exit), a
        w._do(a)
    return a


def cases(rpc: Rpc) -> list[tuple[str, Reaction]]:
    return [(c, REACTIONS[rpc][c]) for c in STATUS_CODES]


# --- one RPC, one code at a time -------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "reaction"), cases(Rpc.REGISTER))
def test_register(worker: Worker, proxy: FaultProxy, name: str, reaction: Reaction) -> None:
    proxy.fail("Register", code(name), details=UNKNOWN if name == "NOT_FOUND" else "")
    worker._register()
    assert reaction.retries  # no answer to Register ends a learner (issue #16)
    assert worker.core.worker_id and proxy.calls["Register"] == 2 and worker.core.exit is None


def test_a_register_reply_this_build_cannot_read_is_retried(
    backend: CoordinatorServer, worker: Worker, proxy: FaultProxy
) -> None:
    """A coordinator of a newer protocol (a round mode this build does not know) is waited out, never fatal."""
    unread: list[str] = []

    def newer_mode(reply: bytes) -> bytes:
        resp = coordinator_pb2.RegisterResponse.FromString(reply)
        unread.append(resp.worker_id)  # registered on the coordinator's side: leave it after the test
        resp.mode = 99  # type: ignore[assignment]
        return resp.SerializeToString()

    proxy.rewrite("Register", newer_mode)
    try:
        worker._register()
        assert worker.core.worker_id and worker.core.exit is None and proxy.calls["Register"] == 2
    finally:
        for wid in unread:
            leave(backend, wid)


@pytest.mark.parametrize(("name", "reaction"), cases(Rpc.GET_WORK_PLAN))
def test_get_work_plan(worker: Worker, proxy: FaultProxy, name: str, reaction: Reaction) -> None:
    wid = registered(worker)
    proxy.fail("GetWorkPlan", code(name))
    worker._fetch_plan()
    if reaction.retries:
        assert worker.core.worker_id == wid and worker.core.failing_since is None
        assert proxy.calls["GetWorkPlan"] == 2
    else:
        assert reaction is Reaction.REREGISTER
        assert worker.core.state is core.LearnerState.UNREGISTERED
        assert worker.core.next_action(time.monotonic()) == core.Register()


@pytest.mark.parametrize(("name", "reaction"), cases(Rpc.WATCH_PARAMETERS))
def test_watch_parameters(backend: CoordinatorServer, proxy: FaultProxy, name: str, reaction: Reaction) -> None:
    with grpc.insecure_channel(proxy.address) as chan:
        stub = coordinator_pb2_grpc.CoordinatorStub(chan)
        reg = stub.Register(coordinator_pb2.RegisterRequest(worker_name="watcher"), timeout=10)
        proxy.fail("WatchParameters", code(name))
        inbox: queue.Queue[object] = queue.Queue()
        numel = backend.core.params.numel()
        w = Watcher(stub, reg.worker_id, reg.coordinator_epoch, numel, inbox.put, structlog.get_logger())
        try:
            event = inbox.get(timeout=30)
            if reaction.retries:
                assert event == WatchFailed(reg.worker_id, name)  # counted toward giving up
                event = inbox.get(timeout=30)
        finally:
            w.close()
            leave(backend, reg.worker_id)
    expected = {Reaction.RETRY: Delivered, Reaction.FAILOVER: Delivered, Reaction.REREGISTER: SessionLost}[reaction]
    assert isinstance(event, expected), event


class MovedMeanwhile:
    """The leader-following client as a learner's threads see it, with one race made certain: the first time `method`
    is taken, another thread moves the client (closing the channel the method belongs to) before it is called."""

    def __init__(self, coords: Coordinators, method: str, to: str) -> None:
        self.coords, self.method, self.to, self.moved = coords, method, to, False

    def __getattr__(self, name: str) -> Any:
        rpc = getattr(self.coords, name)
        if name == self.method and not self.moved:
            self.moved = self.coords.failover(f"not the leader; leader is at {self.to}")
        return rpc


def test_a_watch_started_on_a_channel_a_move_closed_is_retried_at_the_new_address(
    backend: CoordinatorServer, proxy: FaultProxy
) -> None:
    """A failover closes the channel while the watcher is about to start a stream on it: grpc raises ValueError,
    which ended the watcher's thread, and the learner then waited for a version for good (the quick HA soak, CI
    of add1806: a learner still running a minute after the job finished). It is an UNAVAILABLE now, retried at the
    address moved to."""
    cfg = WorkerConfig(coordinator=f"{proxy.address},{backend.address}")
    coords = Coordinators(cfg.coordinators, cfg.security, who="worker")
    try:
        reg = coords.Register(coordinator_pb2.RegisterRequest(worker_name="watcher"), timeout=10)
        inbox: queue.Queue[object] = queue.Queue()
        stub = MovedMeanwhile(coords, "WatchParameters", backend.address)
        numel, log = backend.core.params.numel(), structlog.get_logger()
        w = Watcher(stub, reg.worker_id, reg.coordinator_epoch, numel, inbox.put, log, coords.failover)
        try:
            first = inbox.get(timeout=30)
            assert stub.moved and coords.address == backend.address
            assert first == WatchFailed(reg.worker_id, "UNAVAILABLE")
            assert isinstance(inbox.get(timeout=30), Delivered)
        finally:
            w.close()
            leave(backend, reg.worker_id)
    finally:
        coords.close()


def test_an_upload_started_on_a_channel_a_move_closed_is_retried_at_the_new_address(
    backend: CoordinatorServer, proxy: FaultProxy
) -> None:
    """The same race for the upload thread and for a control call on the training thread (a ValueError there ended
    the process)."""
    cfg = WorkerConfig(coordinator=f"{proxy.address},{backend.address}", upload_path="grpc", retry_total_s=10.0)
    w = Worker(cfg)
    try:
        w.control.stub = MovedMeanwhile(w.coordinators, "Register", backend.address)
        w._register()
        assert w.core.worker_id and w.coordinators.address == backend.address
        w.coordinators.failover(f"not the leader; leader is at {proxy.address}")
        w.uploader.stub = MovedMeanwhile(w.coordinators, "SubmitPseudoGradient", backend.address)
        result = w.uploader.upload(w._upload_job(until_submit(w)))
        assert result.reaction is None and w.uploader.stub.moved
    finally:
        w.close()
        leave(backend, w.reg.worker_id if w.reg else "")


@pytest.mark.parametrize(("name", "reaction"), cases(Rpc.SUBMIT))
def test_submit(worker: Worker, proxy: FaultProxy, name: str, reaction: Reaction) -> None:
    registered(worker)
    job = worker._upload_job(until_submit(worker))
    proxy.fail("SubmitPseudoGradient", code(name))
    result = worker.uploader.upload(job)
    assert result.reaction is (None if reaction.retries else reaction)
    if reaction.retries:
        assert proxy.calls["SubmitPseudoGradient"] == 2 and proxy.calls["GetUploadStatus"] == 1


@pytest.mark.parametrize(("name", "reaction"), cases(Rpc.GET_UPLOAD_STATUS))
def test_get_upload_status(worker: Worker, proxy: FaultProxy, name: str, reaction: Reaction) -> None:
    assert reaction.retries  # the upload goes on from byte 0
    registered(worker)
    job = worker._upload_job(until_submit(worker))
    proxy.fail("SubmitPseudoGradient", grpc.StatusCode.UNAVAILABLE)
    proxy.fail("GetUploadStatus", code(name))
    assert worker.uploader.upload(job).reaction is None


@pytest.mark.parametrize(("name", "reaction"), cases(Rpc.DEREGISTER))
def test_deregister(
    backend: CoordinatorServer, worker: Worker, proxy: FaultProxy, name: str, reaction: Reaction
) -> None:
    wid = registered(worker)
    worker.core.stop(time.monotonic())
    proxy.fail("Deregister", code(name))
    worker._deregister(wid)  # never raises
    assert worker.heartbeats.left.is_set()  # no healthd here: nothing to tell
    left = backend.core.worker(wid).state == "left"
    assert left is (reaction.retries), (name, backend.core.worker(wid).state)


@pytest.mark.parametrize(("name", "reaction"), cases(Rpc.HEARTBEAT))
def test_heartbeat(name: str, reaction: Reaction) -> None:
    assert reaction.retries
    healthd = HealthdServer(HealthdConfig(heartbeat_interval_s=0.1, dead_after_s=5.0, metrics_port=-1))
    healthd.start()
    proxy = FaultProxy(healthd.address, "HealthDaemon")
    srv = coordinator()
    w = Worker(WorkerConfig(coordinator=srv.address, healthd=proxy.address, heartbeat_interval_s=0.1))
    try:
        proxy.fail("Heartbeat", code(name))
        wid = registered(w)
        wait_for("a heartbeat through", lambda: wid in {n.node_id for n in healthd.nodes()}, timeout_s=30)
        assert proxy.calls["Heartbeat"] >= 2
    finally:
        w.close()
        proxy.close()
        srv.stop(0)
        healthd.stop(0)


def test_a_learner_still_building_its_model_is_heard_of_before_the_coordinator_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in the field (a 76M-parameter model, two learners on two cores): building the session after Register
    took 11 s, heartbeats started only after it, and the coordinator declared the learner dead (no heartbeat within
    `confirm_timeout_s` of registering), refused its first submission and made it register again. Heartbeats now
    name the registration from the moment Register answers, with healthd's address from that answer."""
    with socket.socket() as s:  # healthd's port, for the coordinator to name before healthd starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = coordinator(healthd_address=f"127.0.0.1:{port}", confirm_timeout_s=2.0)
    healthd = HealthdServer(
        HealthdConfig(
            port=port, coordinator_address=srv.address, heartbeat_interval_s=0.1, dead_after_s=5.0, metrics_port=-1
        )
    )
    healthd.start()
    w = Worker(WorkerConfig(coordinator=srv.address, heartbeat_interval_s=0.1))
    build = w.replica.start_session

    def slow_build(*args: Any, **kwargs: Any) -> None:
        time.sleep(5.0)  # over twice the confirm timeout
        build(*args, **kwargs)

    monkeypatch.setattr(w.replica, "start_session", slow_build)
    try:
        wid = registered(w)
        assert srv.core.worker(wid).state == "active", srv.core.worker(wid).state_reason
        assert wid in {n.node_id for n in healthd.nodes()}
    finally:
        w.close()
        srv.stop(0)
        healthd.stop(0)


def test_a_learner_that_dies_before_healthd_hears_of_it_is_declared_dead_before_the_registration_lease() -> None:
    """Found by the kill storm: a learner killed just after registering (again, with a restarted coordinator) never
    reached healthd under its new id, so healthd could not report it, and it was declared dead only at
    `--confirm-timeout-s` (10 s), past the 5 s reassignment window. With healthd reporting a live learner, the
    coordinator now declares it dead after `--unheard-after-s`; the live learner stays."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = coordinator(healthd_address=f"127.0.0.1:{port}", confirm_timeout_s=30.0, unheard_after_s=1.0)
    healthd = HealthdServer(
        HealthdConfig(
            port=port, coordinator_address=srv.address, heartbeat_interval_s=0.1, dead_after_s=5.0, metrics_port=-1
        )
    )
    healthd.start()
    w = Worker(WorkerConfig(coordinator=srv.address, heartbeat_interval_s=0.1))
    try:
        live = registered(w)
        with grpc.insecure_channel(srv.address) as ch:  # registers, then never heartbeats: killed at once
            ghost = (
                coordinator_pb2_grpc.CoordinatorStub(ch)
                .Register(
                    coordinator_pb2.RegisterRequest(worker_name="ghost", model_fingerprint=srv.task.fingerprint),
                    timeout=5,
                )
                .worker_id
            )
        wait_for("the ghost declared dead", lambda: srv.core.worker(ghost).state == "dead", timeout_s=20)
        assert "healthd reported other learners for 1 s" in srv.core.worker(ghost).state_reason
        assert srv.core.worker(live).state == "active", srv.core.worker(live).state_reason
    finally:
        w.close()
        srv.stop(0)
        healthd.stop(0)


# --- sequences found in the field ------------------------------------------------------------------------------
def test_not_found_inside_the_retry_of_an_unavailable_plan_call_means_register_again(
    worker: Worker, proxy: FaultProxy
) -> None:
    """GetWorkPlan gets UNAVAILABLE, retries, and the restarted coordinator answers NOT_FOUND: the learner
    registers again (it used to re-raise the NOT_FOUND and exit 1)."""
    registered(worker)
    fresh = coordinator()
    try:
        proxy.fail("GetWorkPlan", grpc.StatusCode.UNAVAILABLE, times=2)
        threading.Timer(0.15, proxy.point, args=(fresh.address,)).start()  # restarted while the call is retried
        worker._fetch_plan()
        assert proxy.calls["GetWorkPlan"] >= 3
        assert worker.core.state is core.LearnerState.UNREGISTERED
        worker._register()
        assert worker.core.worker_id in {w.worker_id for w in fresh.core.workers.values()}
    finally:
        fresh.stop(0)


def test_a_learner_rides_through_a_coordinator_restart_and_exits_only_when_stopped(proxy: FaultProxy) -> None:
    first = coordinator()
    proxy.point(first.address)
    w = Worker(WorkerConfig(coordinator=proxy.address, upload_path="grpc", rpc_timeout_s=5.0))
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(w.run()), daemon=True)
    t.start()
    second: CoordinatorServer | None = None
    try:
        wait_for("a round on the first coordinator", lambda: first.core.version >= 2, timeout_s=60)
        for method in ("Register", "GetWorkPlan", "WatchParameters", "SubmitPseudoGradient", "GetUploadStatus"):
            proxy.fail(method, grpc.StatusCode.UNAVAILABLE, times=3)
        first.stop(0)
        second = coordinator()
        proxy.point(second.address)
        s = second
        wait_for("rounds on the restarted coordinator", lambda: s.core.version >= 2, timeout_s=60)
        assert t.is_alive()
        w.stop()
        t.join(timeout=40)
        assert codes == [0] and w.exit_reason == "stopped"
        assert [r.state for r in s.core.workers.values()] == ["left"]
    finally:
        w.stop()
        t.join(timeout=40)
        first.stop(0)
        if second is not None:
            second.stop(0)


def test_give_up_after_s_ends_an_unreachable_learner() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    w = Worker(WorkerConfig(coordinator=address, give_up_after_s=1.0, rpc_timeout_s=0.5))
    started = time.monotonic()
    assert w.run() == 1
    assert w.exit_reason == "gave_up" and time.monotonic() - started < 20


# --- the retry policy the learner's calls use ------------------------------------------------------------------
def test_backoff_is_capped_and_jittered() -> None:
    b = Backoff(BackoffConfig(initial_s=0.1, max_s=1.0, jitter=0.5), random.Random(1))
    delays = [b.next_s() for _ in range(8)]
    assert all(0.05 <= d <= 0.1 for d in delays[:1]) and all(0.5 <= d <= 1.0 for d in delays[4:])
    assert len(set(delays[4:])) == 4  # jittered, not in lockstep
    b.reset()
    assert b.next_s() <= 0.1


def test_retry_while_decides_on_every_attempt() -> None:
    """The bug of #16: a NOT_FOUND on the third attempt of an UNAVAILABLE call ends the retries there."""
    answers = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND]
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        raise BulkError(answers[len(calls) - 1], UNKNOWN)

    def retry(e: grpc.RpcError) -> bool:
        return REACTIONS[Rpc.GET_WORK_PLAN][e.code().name].retries

    fast = Backoff(BackoffConfig(0.001, 0.001))
    with pytest.raises(grpc.RpcError) as info:
        retry_while(call, "GetWorkPlan", retry=retry, wait=lambda s: False, backoff=fast)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND and len(calls) == 3

    def unavailable() -> str:
        raise BulkError(grpc.StatusCode.UNAVAILABLE, "down")

    sleeps: list[float] = []

    def stop_now(seconds: float) -> bool:
        sleeps.append(seconds)
        return True

    with pytest.raises(grpc.RpcError):  # a stop request ends the sleep and the retries
        retry_while(unavailable, "x", retry=lambda e: True, wait=stop_now)
    assert len(sleeps) == 1


def test_give_up_after_s_also_while_training_and_waiting(proxy: FaultProxy) -> None:
    """The coordinator goes away for good after the learner joined: the stream, the uploads and the plan calls
    all fail, and the learner exits 1 once nothing succeeded for give_up_after_s (not before)."""
    first = coordinator()
    proxy.point(first.address)
    cfg = WorkerConfig(coordinator=proxy.address, upload_path="grpc", give_up_after_s=2.0, retry_total_s=1.0)
    w = Worker(cfg)
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(w.run()), daemon=True)
    t.start()
    try:
        wait_for("a round", lambda: first.core.version >= 1, timeout_s=60)
        for method in ("Register", "GetWorkPlan", "WatchParameters", "SubmitPseudoGradient", "GetUploadStatus"):
            proxy.fail(method, grpc.StatusCode.UNAVAILABLE, times=100_000)
        gone = time.monotonic()
        t.join(timeout=60)
        assert codes == [1] and w.exit_reason == "gave_up"
        assert time.monotonic() - gone >= 2.0
    finally:
        w.stop()
        t.join(timeout=40)
        first.stop(0)


@pytest.fixture
def alone() -> Iterator[Worker]:
    """A learner with a coordinator of its own (every shard is its)."""
    srv = coordinator()
    w = Worker(WorkerConfig(coordinator=srv.address, upload_path="grpc", rpc_timeout_s=5.0, retry_total_s=10.0))
    yield w
    w.close()
    srv.stop(0)


def test_a_delta_refused_where_it_is_applied_means_register_again(alone: Worker) -> None:
    """The learner's `Θ̂` is brought to a version in place when it adopts it (`HeldParams.at`); a delta that fails
    there (its checksum: tests/test_broadcast.py) leaves `Θ̂` partly written, so the learner registers again and
    starts over from the coordinator's parameters, with fresh error feedback."""
    worker = alone
    registered(worker)
    worker._do(until_submit(worker))
    deadline = time.monotonic() + 60
    while not isinstance(a := worker._next(), (core.Load, core.Rebase)):
        assert time.monotonic() < deadline and not isinstance(a, core.Exit), a
        worker._do(a)
    assert worker.replica.params is not None
    held = worker.replica.params[1]
    held.broken = Refusal.CHECKSUM  # as `at` leaves it when Θ̂'s checksum differs after the delta
    worker._do(a)
    assert worker.core.state is core.LearnerState.UNREGISTERED
    old = worker.core.worker_id
    worker._register()
    assert worker.core.worker_id != old
    deadline = time.monotonic() + 60
    while not isinstance(a := worker._next(), core.Load):
        assert time.monotonic() < deadline and not isinstance(a, core.Exit), a
        worker._do(a)
    worker._do(a)
    assert worker.replica.params is not None and worker.replica.params[1] is not held  # a fresh Θ̂
