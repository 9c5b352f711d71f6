"""Streams cost no threads, admission instead of collapse, and every request field bounded at the boundary, through
real gRPC servers (the coordinator and healthd in-process on port 0, `grpc.aio` clients holding many streams).

Each refusal: the right status, a short message that says what to do, the server still serving, state unchanged."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from diloco.rpc.admission import RETRY_AFTER_METADATA, Admission, AdmissionLimits
from diloco.rpc.limits import limits_markdown
from diloco.rpc.retry import Backoff, BackoffConfig, retry_hint_s
from diloco.rpc.server import MAX_MESSAGE_BYTES, SendSlots
from diloco.v1 import common_pb2, coordinator_pb2_grpc, healthd_pb2, healthd_pb2_grpc
from services.healthd.server import HealthdServer
from tests.support import Env, T, code_of, frozen, healthd_config, pb, register

pytestmark = pytest.mark.timeout(120)
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


# --- the pure rule --------------------------------------------------------------------------------------------------


def test_admission_counts_total_per_client_and_per_method() -> None:
    adm = Admission(AdmissionLimits(max_calls=3, max_calls_per_client=2, per_method={"Upload": 1}))
    assert adm.admit("/s/Watch", "a") is None
    assert adm.admit("/s/Watch", "a") is None
    refused = adm.admit("/s/Watch", "a")
    assert refused is not None and "one connection may run 2 calls" in refused.message
    assert refused.retry_after_ms == 1000 and "retry after 1 s" in refused.message
    assert adm.admit("/s/Upload", "b") is None
    refused = adm.admit("/s/Upload", "c")
    assert refused is not None and "the server runs 3 calls at once (--max-calls)" in refused.message
    adm.release("/s/Watch", "a")
    refused = adm.admit("/s/Upload", "c")
    assert refused is not None and "1 Upload calls at once" in refused.message
    assert adm.admit("/s/Watch", "c") is None
    assert adm.in_flight() == (3, 3) and adm.refused == 3
    for method, client in (("/s/Watch", "a"), ("/s/Upload", "b"), ("/s/Watch", "c")):
        adm.release(method, client)
    assert adm.in_flight() == (0, 0)


# --- many streams through a real coordinator ------------------------------------------------------------------------


class AioClient:
    """A `grpc.aio` client on a loop of its own (one thread), so a test can hold hundreds of streams cheaply."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aio-client", daemon=True)
        self.thread.start()

    def run(self, coro: object, timeout_s: float = 60.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def aio_client() -> Iterator[AioClient]:
    client = AioClient()
    yield client
    client.close()


async def _open_watches(address: str, n: int, channels: int) -> tuple[list[grpc.aio.Channel], list[object]]:
    """`n` following parameter watches over `channels` connections, each having received version 0's header."""
    chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    calls = []
    for i in range(n):
        stub = coordinator_pb2_grpc.CoordinatorStub(chans[i % channels])
        call = stub.WatchParameters(pb.WatchParametersRequest(follow=True))
        calls.append(call)
    for call in calls:
        first = await asyncio.wait_for(call.read(), 30)  # type: ignore[attr-defined]
        assert first.WhichOneof("kind") == "header"
    return chans, calls


def test_send_slots_bound_the_writes_in_progress_and_a_stalled_write_frees_its_slot_after_the_lease() -> None:
    async def scenario() -> tuple[float, list[str]]:
        slots = SendSlots(2, lease_s=0.2)
        busy, peak, order = 0, 0, []
        stalled = asyncio.Event()  # never set until the end: a write the network holds up

        async def write(name: str, stall: bool) -> None:
            nonlocal busy, peak
            async with slots.slot():
                busy += 1
                peak = max(peak, busy)
                await (stalled.wait() if stall else asyncio.sleep(0.01))
                busy -= 1
                order.append(name)

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        quick = [asyncio.ensure_future(write(f"w{i}", False)) for i in range(6)]
        await asyncio.gather(*quick)
        assert peak == 2  # never more than the slots at once
        peak, busy = 0, 0
        stuck = [asyncio.ensure_future(write(f"s{i}", True)) for i in range(2)]  # both slots taken by stalls
        await asyncio.sleep(0)
        t1 = loop.time()
        await write("after", False)  # gets a slot once a stalled write's lease runs out
        waited = loop.time() - t1
        stalled.set()
        await asyncio.gather(*stuck)
        assert loop.time() - t0 < 5
        return waited, order

    waited, order = asyncio.run(scenario())
    assert 0.15 <= waited < 2.0
    assert order[:6] == [f"w{i}" for i in range(6)] and "after" in order
    with pytest.raises(ValueError, match="slots"):
        SendSlots(0, 0.1)


@pytest.mark.parametrize(
    ("trailers", "expected"),
    [
        ((), 0.0),
        (((RETRY_AFTER_METADATA, "250"),), 0.25),
        (((RETRY_AFTER_METADATA, "x"),), 0.0),
        (((RETRY_AFTER_METADATA, "-5"),), 0.0),
        (((RETRY_AFTER_METADATA, str(10**12)),), 60.0),
    ],
)
def test_retry_hints_are_read_bounded_and_a_malformed_one_is_ignored(
    trailers: tuple[tuple[str, str], ...], expected: float
) -> None:
    class Refused(grpc.RpcError):
        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return trailers

    assert retry_hint_s(Refused()) == expected
    assert retry_hint_s(None) == 0.0 and retry_hint_s(ValueError()) == 0.0


async def _close(chans: list[grpc.aio.Channel], calls: list[object]) -> None:
    for call in calls:
        call.cancel()  # type: ignore[attr-defined]
    for ch in chans:
        await ch.close()


def test_hundreds_of_open_watches_cost_no_threads_and_control_calls_answer(
    start: Callable[..., Env], aio_client: AioClient
) -> None:
    env = start(max_calls_per_client=512)
    threads_before = threading.active_count()
    chans, calls = aio_client.run(_open_watches(env.server.address, 300, channels=3))  # type: ignore[misc]
    try:
        # more than the old 64-thread pool could hold, and no thread per stream: at most the bounded work pool
        # (each watch takes its snapshot there) and the 2 of the client
        assert threading.active_count() <= threads_before + 2 + env.server.cfg.work_threads
        status = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
        assert status.version == 0
        assert env.server._grpc is not None and env.server._grpc.admission.in_flight()[0] >= 300
    finally:
        aio_client.run(_close(chans, calls))


def test_streams_beyond_the_per_connection_limit_are_refused_with_a_retry_hint(
    start: Callable[..., Env], aio_client: AioClient
) -> None:
    env = start(max_calls_per_client=4)
    chans, calls = aio_client.run(_open_watches(env.server.address, 4, channels=1))  # type: ignore[misc]
    try:

        async def one_more() -> tuple[grpc.StatusCode, str, dict[str, str]]:
            call = coordinator_pb2_grpc.CoordinatorStub(chans[0]).WatchParameters(
                pb.WatchParametersRequest(follow=True)
            )
            try:
                await call.read()
            except grpc.aio.AioRpcError as e:
                trailers = {k: str(v) for k, v in (e.trailing_metadata() or ())}
                # a learner's backoff waits at least what the server asked for (with up to +50% jitter)
                waits = [Backoff(BackoffConfig(initial_s=0.01, max_s=0.01)).next_s(e) for _ in range(20)]
                assert all(1.0 <= w <= 1.5 for w in waits) and len(set(waits)) > 1
                return e.code(), e.details() or "", trailers
            raise AssertionError("the fifth stream on one connection was admitted")

        code, details, trailers = aio_client.run(one_more())  # type: ignore[misc]
        assert code == EXHAUSTED
        assert "one connection may run 4 calls at once" in details and "retry after" in details
        assert trailers[RETRY_AFTER_METADATA] == "1000"
        # another connection is a different client, and the server keeps serving
        assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).version == 0
    finally:
        aio_client.run(_close(chans, calls))
    # once the streams end, their slots are free again
    chans, calls = aio_client.run(_open_watches(env.server.address, 4, channels=1))  # type: ignore[misc]
    aio_client.run(_close(chans, calls))


def test_the_total_limit_refuses_every_connection_and_health_still_answers(
    start: Callable[..., Env], aio_client: AioClient
) -> None:
    env = start(max_calls=16, max_calls_per_client=16)
    chans, calls = aio_client.run(_open_watches(env.server.address, 16, channels=4))  # type: ignore[misc]
    try:
        code, details = code_of(lambda: env.stub.GetStatus(pb.GetStatusRequest(), timeout=T))
        assert code == EXHAUSTED and "the server runs 16 calls at once (--max-calls)" in details
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(env.chan).Check(health_pb2.HealthCheckRequest(), timeout=T)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        aio_client.run(_close(chans, calls))
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).version == 0


# --- bounded fields at the boundary ---------------------------------------------------------------------------------


def test_a_megabyte_device_kind_is_refused_and_lists_stay_readable(start: Callable[..., Env]) -> None:
    env = start()
    before = frozen(env)
    huge = "x" * (1 << 20)
    for _ in range(9):  # nine such learners once made ListWorkers fail for everyone
        code, details = code_of(lambda: register(env, "big", common_pb2.Throughput(device_kind=huge)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "device_kind" in details and "the limit is 128" in details and len(details) < 300
    assert list(env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers) == []
    params, ledger, version = frozen(env)
    assert (params.equal(before[0]), ledger, version) == (True, before[1], before[2])


@pytest.mark.parametrize("claim", [1e308, float("inf"), float("nan"), -5.0])
def test_an_absurd_throughput_claim_is_refused(start: Callable[..., Env], claim: float) -> None:
    env = start()
    code, details = code_of(lambda: register(env, "liar", common_pb2.Throughput(tokens_per_s=claim)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokens_per_s" in details
    assert list(env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers) == []


def test_error_details_never_echo_a_long_input(start: Callable[..., Env]) -> None:
    env = start()
    long_id = "w" * 200_000
    code, details = code_of(lambda: env.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=long_id), timeout=T))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 300 and long_id[:300] not in details


def test_upload_header_fields_are_bounded_on_the_stream(start: Callable[..., Env]) -> None:
    env = start()
    reg = register(env)
    header = pb.SubmissionHeader(worker_id=reg.worker_id, submission_id="s" * 10_000)
    code, details = code_of(
        lambda: env.stub.SubmitPseudoGradient(iter([pb.SubmitPseudoGradientRequest(header=header)]), timeout=T)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "submission_id" in details and len(details) < 300
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).pending_submissions == 0


def test_a_megabyte_node_id_heartbeat_is_refused_and_healthd_keeps_serving() -> None:
    server = HealthdServer(healthd_config())
    server.start()
    ch = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    try:
        stub = healthd_pb2_grpc.HealthDaemonStub(ch)
        hb = healthd_pb2.HeartbeatRequest(node_id="n" * (1 << 20), role=healthd_pb2.NODE_ROLE_WORKER, sequence=1)
        code, details = code_of(lambda: list(stub.Heartbeat(iter([hb]), timeout=T)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "node_id" in details and len(details) < 300
        assert list(stub.ListNodes(healthd_pb2.ListNodesRequest(), timeout=T).nodes) == []
    finally:
        ch.close()
        server.stop(0)


async def _heartbeats(address: str, n: int) -> tuple[grpc.aio.Channel, list[object]]:
    ch = grpc.aio.insecure_channel(address)
    stub = healthd_pb2_grpc.HealthDaemonStub(ch)
    calls = []
    for i in range(n):

        async def one(node: str = f"node-{i}") -> AsyncIterator[healthd_pb2.HeartbeatRequest]:
            yield healthd_pb2.HeartbeatRequest(node_id=node, role=healthd_pb2.NODE_ROLE_WORKER, sequence=1)
            await asyncio.sleep(3600)  # hold the stream open

        call = stub.Heartbeat(one())
        calls.append(call)
    for call in calls:
        reply = await asyncio.wait_for(call.read(), 30)  # type: ignore[attr-defined]
        assert reply.sequence == 1
    return ch, calls


def test_healthd_holds_hundreds_of_heartbeat_streams_without_a_thread_each(aio_client: AioClient) -> None:
    server = HealthdServer(healthd_config(dead_after_s=60.0, max_calls_per_client=1024))
    server.start()
    threads_before = threading.active_count()
    ch, calls = aio_client.run(_heartbeats(server.address, 300))  # type: ignore[misc]
    try:
        assert threading.active_count() <= threads_before + 2
        assert len(server.nodes()) == 300
    finally:
        for call in calls:
            call.cancel()  # type: ignore[attr-defined]
        aio_client.run(ch.close())
        server.stop(0)


def test_the_readme_lists_every_bound_of_the_table() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- limits:begin", 1)[1].split("-->", 1)[1].split("<!-- limits:end -->", 1)[0]
    assert block.strip() == limits_markdown().strip(), "README limits table is stale: paste limits_markdown()"


def test_registrations_beyond_max_workers_are_refused_and_change_nothing(start: Callable[..., Env]) -> None:
    env = start(max_workers=2)
    a = register(env, "a")
    register(env, "b")
    before = frozen(env)
    code, details = code_of(lambda: register(env, "c"))
    assert code == EXHAUSTED and "--max-workers" in details
    names = sorted(w.worker_name for w in env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers)
    assert names == ["a", "b"]
    params, ledger, version = frozen(env)
    assert (params.equal(before[0]), ledger, version) == (True, before[1], before[2])
    env.stub.Deregister(pb.DeregisterRequest(worker_id=a.worker_id), timeout=T)
    assert register(env, "c").worker_id  # a slot freed by a departure is taken at once
