"""Fuzz every RPC of the coordinator and healthd through real in-process servers (port 0, real channels).

The RPCs come from the service descriptors, so a new RPC is fuzzed without touching this file. Three kinds of input:
random messages built from the descriptor, one-field mutations of valid requests (a real learner's registration,
upload header and chunks, heartbeats...), and raw request bodies (garbage, and mutated wire bytes of valid requests).

Properties after every example: the call ends within its deadline with OK or a proper status (never UNKNOWN, which
means an uncaught exception; INTERNAL only for a body that is not protobuf, which gRPC itself refuses); the server
still serves (health check and a status call); the global parameters, their version and the committed ledger are
unchanged unless the call was a legitimate, valid submission (and then the ledger gained exactly its ranges).

More examples: DILOCO_FUZZ_EXAMPLES=500 (per test and RPC); a fresh random seed each run: DILOCO_FUZZ_RANDOM=1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from diloco.core.states import ACTIVE, EVICTED
from diloco.rpc.server import channel
from diloco.task.params import param_specs
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, healthd_pb2
from services.coordinator.server import CoordinatorServer
from services.healthd.server import HealthdServer
from tests.proto_fuzz import Outcome, Rpc, call, garbage, messages, mutated, mutated_bytes, parses, rpcs
from tests.support import CoordinatorEndpoint, Env, config, healthd_config, make_upload, register, requests

pytestmark = pytest.mark.timeout(120)

pb = coordinator_pb2
EXAMPLES = int(os.environ.get("DILOCO_FUZZ_EXAMPLES", "30"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("DILOCO_FUZZ_RANDOM"),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
UNARY_S = 5.0  # deadline of a unary or client-streaming call: running past it is a hang
STREAM_S = 0.5  # deadline of a server stream: a follow stream legitimately runs until it
MAX_REPLIES = 4
COORDINATOR_RPCS = rpcs(pb.DESCRIPTOR.services_by_name["Coordinator"])
HEALTHD_RPCS = rpcs(healthd_pb2.DESCRIPTOR.services_by_name["HealthDaemon"])
C = grpc.StatusCode
PROPER = {
    C.OK,
    C.INVALID_ARGUMENT,
    C.FAILED_PRECONDITION,
    C.NOT_FOUND,
    C.ALREADY_EXISTS,
    C.RESOURCE_EXHAUSTED,
    C.OUT_OF_RANGE,
    C.UNAVAILABLE,
    C.UNAUTHENTICATED,
    C.PERMISSION_DENIED,
}
NOT_PROTOBUF = "the request body is not a valid message for"  # INVALID_ARGUMENT (diloco.rpc.status.ParseRequests)


def check_outcome(rpc: Rpc, out: Outcome, bodies: Sequence[Message | bytes]) -> None:
    """A proper status, in time; a body that is not a valid message gets INVALID_ARGUMENT saying so."""
    note(f"{rpc}: {out}")
    unparseable = any(isinstance(b, bytes) and not parses(rpc.input, b) for b in bodies)
    if out.code == C.INVALID_ARGUMENT and unparseable and out.details.startswith(NOT_PROTOBUF):
        return
    if out.code == C.DEADLINE_EXCEEDED and rpc.server_streaming:
        return  # a following stream waits for news; it ended at our short deadline, as asked
    assert out.code in PROPER, f"{rpc} ended with {out.code.name}: {out.details!r}"
    if out.code != C.OK:
        assert out.details, f"{rpc}: {out.code.name} without a message telling the caller what to do"
    assert out.seconds < (STREAM_S if rpc.server_streaming else UNARY_S) + 2.0, out


def checked_call(chan: grpc.Channel, rpc: Rpc, bodies: Sequence[Message | bytes]) -> Outcome:
    timeout = STREAM_S if rpc.server_streaming else UNARY_S
    out = call(chan, rpc, bodies, timeout_s=timeout, max_replies=MAX_REPLIES)
    check_outcome(rpc, out, bodies)
    return out


def request_lists(rpc: Rpc, one: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """One request for a unary request, a few for a client stream."""
    return st.lists(one, min_size=0, max_size=4) if rpc.client_streaming else st.lists(one, min_size=1, max_size=1)


def serving(chan: grpc.Channel, service: str) -> None:
    resp = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=service), timeout=UNARY_S)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING, f"{service} stopped serving"


# --- the coordinator ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frozen:
    params: torch.Tensor
    version: int
    committed: dict[int, tuple[tuple[int, int, int], ...]]  # shard -> (epoch, start, end) of each committed range


@dataclass
class Coordinator:
    env: Env
    worker: pb.RegisterResponse | None = None
    sids: Iterator[int] = field(default_factory=lambda: iter(range(1, 10**9)))

    @property
    def chan(self) -> grpc.Channel:
        return self.env.chan

    def frozen(self) -> Frozen:
        ledger = self.env.stub.GetLedger(pb.GetLedgerRequest(), timeout=UNARY_S)
        committed = {s.shard_id: tuple((r.epoch, r.start, r.end) for r in s.committed_ranges) for s in ledger.shards}
        return Frozen(self.env.server.core.params.clone(), ledger.version, committed)

    def still_serving(self) -> None:
        serving(self.chan, "diloco.v1.Coordinator")
        assert self.env.stub.GetStatus(pb.GetStatusRequest(), timeout=UNARY_S).coordinator_epoch
        assert bool(torch.isfinite(self.env.server.core.params).all()), "non-finite global parameters"

    def assert_unchanged(self, before: Frozen) -> None:
        after = self.frozen()
        assert after.version == before.version, "the global version moved"
        assert torch.equal(after.params, before.params), "the global parameters changed"
        assert after.committed == before.committed, "the committed ledger changed"

    def live_worker(self) -> pb.RegisterResponse:
        """The one learner the mutations start from, registered again when a fuzzed call removed it."""
        core = self.env.server.core
        if self.worker is None or core.workers[self.worker.worker_id].state != ACTIVE:
            self.worker = register(self.env, "fuzz")
        return self.worker

    def tidy(self) -> None:
        """Undo what legitimate calls did to membership: one live learner, not paused (so a valid submission
        applies at once and the next example starts from the same kind of state)."""
        state = self.env.server.state
        keep = self.worker.worker_id if self.worker else None
        for rec in [r for r in state.core.workers.values() if r.state == ACTIVE or r.state == "draining"]:
            if rec.worker_id != keep:
                state.remove(rec.worker_id, EVICTED, "fuzz tidy-up")
        state.set_paused(False)


def _start_coordinator() -> Iterator[Coordinator]:
    srv = CoordinatorServer(config())
    srv.start()
    chan = channel(srv.address)
    env = Env(srv, coordinator_pb2_grpc.CoordinatorStub(chan), chan, param_specs(srv.task.model_fn(0)))
    try:
        yield Coordinator(env)
    finally:
        chan.close()
        srv.stop(0)


@pytest.fixture(scope="module")
def coord() -> Iterator[Coordinator]:
    """Random and raw input: one coordinator for the module (starting one per example is far too slow)."""
    yield from _start_coordinator()


@pytest.fixture(scope="module")
def coord_mut() -> Iterator[Coordinator]:
    """Mutations of valid requests: a coordinator with exactly one live learner between examples."""
    yield from _start_coordinator()


@pytest.mark.parametrize("rpc", COORDINATOR_RPCS, ids=str)
def test_coordinator_random_messages(coord: Coordinator, rpc: Rpc) -> None:
    @FUZZ
    @given(bodies=request_lists(rpc, messages(rpc.input.DESCRIPTOR)))
    def run(bodies: list[Message]) -> None:
        before = coord.frozen()
        checked_call(coord.chan, rpc, bodies)
        coord.still_serving()
        coord.assert_unchanged(before)  # random input is never a valid full submission
        coord.tidy()

    run()


@pytest.mark.parametrize("rpc", COORDINATOR_RPCS, ids=str)
def test_coordinator_raw_bytes(coord: Coordinator, rpc: Rpc) -> None:
    wire = messages(rpc.input.DESCRIPTOR).map(lambda m: m.SerializeToString())
    body = st.one_of(garbage(), wire, wire.flatmap(mutated_bytes))

    @FUZZ
    @given(bodies=request_lists(rpc, body))
    def run(bodies: list[bytes]) -> None:
        before = coord.frozen()
        checked_call(coord.chan, rpc, bodies)
        coord.still_serving()
        coord.assert_unchanged(before)
        coord.tidy()

    run()


def valid_request(c: Coordinator, rpc: Rpc) -> Message:
    """A request a well-behaved client would send. RPCs not listed get the empty request with `worker_id` set
    when the request has one, so a new RPC is still fuzzed from something plausible."""
    wid = c.live_worker().worker_id
    tp = common_pb2.Throughput(tokens_per_s=1000.0, step_time_s=0.1, device_kind="cpu")
    now = time.time()
    known: dict[str, Message] = {
        "Register": pb.RegisterRequest(
            worker_name="fuzz-new", throughput=tp, model_fingerprint=c.env.server.task.fingerprint
        ),
        "WatchParameters": pb.WatchParametersRequest(worker_id=wid, after_version=0, follow=False),
        "GetUploadStatus": pb.GetUploadStatusRequest(worker_id=wid, submission_id="s-0"),
        "Deregister": pb.DeregisterRequest(worker_id=wid, reason="fuzz"),
        "ReportNodeFailure": pb.ReportNodeFailureRequest(
            worker_id=wid, reason="fuzz", last_seen_unix_s=now - 1.0, declared_dead_unix_s=now
        ),
        "ReportThroughput": pb.ReportThroughputRequest(worker_id=wid, throughput=tp),
        "EvictWorker": pb.EvictWorkerRequest(worker_id=wid, reason="fuzz"),
        "StepDown": pb.StepDownRequest(reason="fuzz"),
    }
    if rpc.name in known:
        return known[rpc.name]
    msg = rpc.input()
    if "worker_id" in msg.DESCRIPTOR.fields_by_name:
        msg.worker_id = wid  # type: ignore[attr-defined]
    return msg


@pytest.mark.parametrize("rpc", [r for r in COORDINATOR_RPCS if r.name != "SubmitPseudoGradient"], ids=str)
def test_coordinator_mutated_requests(coord_mut: Coordinator, rpc: Rpc) -> None:
    c = coord_mut

    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        c.tidy()
        valid = valid_request(c, rpc)
        body: Message | bytes
        if data.draw(st.integers(0, 4), label="raw") == 0:
            body = data.draw(mutated_bytes(valid.SerializeToString()), label="wire")
        else:
            body, change = data.draw(mutated(valid), label="mutation")
            note(change)
        before = c.frozen()
        checked_call(c.chan, rpc, [body] * (2 if rpc.client_streaming else 1))
        c.still_serving()
        c.assert_unchanged(before)  # only a submission may move the parameters or the ledger

    run()


# --- submissions: mutations of a valid upload ---------------------------------------------------------------------
Stream = list[pb.SubmitPseudoGradientRequest]
CODECS = ["fp32", "bf16", "int8", "int4", "topk", "sparse"]


def _swap(msgs: Stream, i: int, j: int) -> Stream:
    out = list(msgs)
    out[i], out[j] = out[j], out[i]
    return out


@st.composite
def mutated_upload(draw: st.DrawFn, header: pb.SubmissionHeader, data: bytes) -> tuple[list[Message | bytes], str]:
    """A valid upload (header, then chunks) with one thing wrong: a header field, a chunk's bytes, the order or
    number of messages, or the wire bytes of the header."""
    msgs = requests(header, data)
    kind = draw(st.sampled_from(["header"] * 6 + ["chunk", "structure", "wire"]), label="kind")
    if kind == "header":
        h, change = draw(mutated(header), label="header")
        return list(requests(h, data)), f"header {change}"  # type: ignore[arg-type]
    if kind == "chunk":
        i = 1 + draw(st.integers(0, 2**16)) % (len(msgs) - 1)
        out = list(msgs)
        out[i] = pb.SubmitPseudoGradientRequest(data=draw(mutated_bytes(msgs[i].data)))
        return list(out), f"chunk {i} bytes"
    if kind == "wire":
        return [draw(mutated_bytes(msgs[0].SerializeToString())), *msgs[1:]], "header wire bytes"
    last = len(msgs) - 1
    changes: dict[str, Callable[[], Stream]] = {
        "drop-chunk": lambda: msgs[:1] + msgs[2:],
        "duplicate-chunk": lambda: [*msgs[:2], msgs[1], *msgs[2:]],
        "swap-chunks": lambda: _swap(msgs, 1, last) if last > 1 else [*msgs, msgs[1]],
        "header-twice": lambda: [msgs[0], *msgs],
        "header-at-end": lambda: [*msgs[1:], msgs[0]],
        "header-midway": lambda: [*msgs[:2], msgs[0], *msgs[2:]],
        "empty-chunk": lambda: [*msgs[:2], pb.SubmitPseudoGradientRequest(data=b""), *msgs[2:]],
        "empty-message": lambda: [*msgs[:2], pb.SubmitPseudoGradientRequest(), *msgs[2:]],
        "only-header": lambda: msgs[:1],
        "nothing": lambda: [],
    }
    name = draw(st.sampled_from(sorted(changes)), label="structure")
    return list(changes[name]()), name


def _tile(
    committed: Sequence[tuple[int, int, int]], new: Sequence[tuple[int, int, int]]
) -> tuple[tuple[int, int, int], ...]:
    """The committed ranges after appending `new`, merged as the ledger merges them (adjacent, same epoch); each
    new range must start where the shard's committed tokens end (no gap, nothing counted twice)."""
    out = list(committed)
    for epoch, start, end in new:
        assert start == (out[-1][2] if out else start), f"range {start}..{end} does not continue {out[-1:]}"
        if out and out[-1][0] == epoch and out[-1][2] == start:
            out[-1] = (epoch, out[-1][1], end)
        else:
            out.append((epoch, start, end))
    return tuple(out)


SUBMIT = next(r for r in COORDINATOR_RPCS if r.name == "SubmitPseudoGradient")


@settings(FUZZ, max_examples=max(60, 5 * EXAMPLES))
@given(data=st.data())
def test_coordinator_mutated_uploads(coord_mut: Coordinator, data: st.DataObject) -> None:
    c = coord_mut
    c.tidy()
    reg = c.live_worker()
    codec = data.draw(st.sampled_from(CODECS), label="codec")
    header, payload, _ = make_upload(c.env, reg, f"s-{next(c.sids)}", codec=codec, seed=0)
    bodies, change = data.draw(mutated_upload(header, payload), label="upload")
    note(change)
    before = c.frozen()
    out = checked_call(c.chan, SUBMIT, bodies)
    c.still_serving()
    if out.code != C.OK:
        c.assert_unchanged(before)
        return
    # Accepted: it must have been a legitimate submission. With one live learner it applies at once (or it was
    # a duplicate of an earlier one and changes nothing); the ledger gains exactly its ranges, each where the
    # shard's committed cursor was.
    sent = pb.SubmitPseudoGradientRequest.FromString(
        bodies[0] if isinstance(bodies[0], bytes) else bodies[0].SerializeToString()
    ).header
    after = c.frozen()
    if after.version == before.version:
        c.assert_unchanged(before)
        return
    assert after.version == before.version + 1
    gained: dict[int, list[tuple[int, int, int]]] = {}
    for r in sent.ranges:
        gained.setdefault(r.shard_id, []).append((r.epoch, r.start, r.end))
    for shard, ranges in after.committed.items():
        old = before.committed.get(shard, ())
        want = _tile(old, gained.get(shard, []))
        assert ranges == want, f"shard {shard}: {old} -> {ranges}, expected {want}, for {change}"
    assert sum(end - start for _, start, end in (x for v in gained.values() for x in v)) == sent.tokens
    note(f"accepted with a mutation: {change}")


# --- healthd ------------------------------------------------------------------------------------------------------
@dataclass
class Healthd:
    server: HealthdServer
    chan: grpc.Channel
    nodes: Iterator[int] = field(default_factory=lambda: iter(range(1, 10**9)))

    def still_serving(self) -> None:
        serving(self.chan, "diloco.v1.HealthDaemon")
        list_nodes = next(r for r in HEALTHD_RPCS if r.name == "ListNodes")
        out = call(self.chan, list_nodes, [healthd_pb2.ListNodesRequest()], timeout_s=UNARY_S)
        assert out.code == C.OK, out


@pytest.fixture(scope="module")
def healthd() -> Iterator[Healthd]:
    endpoint = CoordinatorEndpoint()
    server = HealthdServer(healthd_config(coordinator_address=endpoint.address))
    server.start()
    chan = channel(server.address)
    try:
        yield Healthd(server, chan)
    finally:
        chan.close()
        server.stop(0)
        endpoint.stop()


@pytest.mark.parametrize("rpc", HEALTHD_RPCS, ids=str)
def test_healthd_random_messages(healthd: Healthd, rpc: Rpc) -> None:
    @FUZZ
    @given(bodies=request_lists(rpc, messages(rpc.input.DESCRIPTOR)))
    def run(bodies: list[Message]) -> None:
        checked_call(healthd.chan, rpc, bodies)
        healthd.still_serving()

    run()


@pytest.mark.parametrize("rpc", HEALTHD_RPCS, ids=str)
def test_healthd_raw_bytes(healthd: Healthd, rpc: Rpc) -> None:
    wire = messages(rpc.input.DESCRIPTOR).map(lambda m: m.SerializeToString())

    @FUZZ
    @given(bodies=request_lists(rpc, st.one_of(garbage(), wire, wire.flatmap(mutated_bytes))))
    def run(bodies: list[bytes]) -> None:
        checked_call(healthd.chan, rpc, bodies)
        healthd.still_serving()

    run()


HEARTBEAT = next(r for r in HEALTHD_RPCS if r.name == "Heartbeat")


@settings(FUZZ, max_examples=max(30, 3 * EXAMPLES))
@given(data=st.data())
def test_healthd_mutated_heartbeats(healthd: Healthd, data: st.DataObject) -> None:
    """A node's valid heartbeat stream (increasing sequence, one node id) with one message changed, dropped,
    repeated or moved: refused with a proper status or acknowledged one reply per heartbeat."""
    node = f"fuzz-node-{next(healthd.nodes)}"
    tp = common_pb2.Throughput(tokens_per_s=500.0, step_time_s=0.2, device_kind="cpu")
    beats = [
        healthd_pb2.HeartbeatRequest(
            node_id=node, role=healthd_pb2.NODE_ROLE_WORKER, sequence=i, throughput=tp, version=3, steps_done=10 * i
        )
        for i in range(1, 4)
    ]
    beats[-1].leaving = data.draw(st.booleans(), label="leaving")
    i = data.draw(st.integers(0, len(beats) - 1), label="which")
    kind = data.draw(st.sampled_from(["field", "field", "wire", "drop", "repeat", "swap"]), label="kind")
    bodies: list[Message | bytes] = list(beats)
    if kind == "field":
        bodies[i], change = data.draw(mutated(beats[i]), label="mutation")
        note(change)
    elif kind == "wire":
        bodies[i] = data.draw(mutated_bytes(beats[i].SerializeToString()), label="wire")
    elif kind == "drop":
        del bodies[i]
    elif kind == "repeat":
        bodies.insert(i, beats[i])
    else:
        bodies[i], bodies[-1] = bodies[-1], bodies[i]
    out = call(healthd.chan, HEARTBEAT, bodies, timeout_s=UNARY_S, max_replies=len(bodies) + 1)
    check_outcome(HEARTBEAT, out, bodies)
    assert out.code != C.DEADLINE_EXCEEDED, "a finite heartbeat stream must end when the node closes it"
    if out.code == C.OK:
        assert out.replies == len(bodies), f"{out.replies} acks for {len(bodies)} heartbeats"
        # healthd reports these nodes' deaths to the coordinator: it must accept only ids the coordinator accepts
        for b in bodies:
            beat = healthd_pb2.HeartbeatRequest.FromString(b if isinstance(b, bytes) else b.SerializeToString())
            nid = beat.node_id
            assert nid and nid.isprintable() and len(nid) <= 256, f"healthd accepted node id {nid!r}"
    healthd.still_serving()


def test_every_rpc_is_enumerated() -> None:
    """The parametrizations above cover every method the descriptors declare, streaming ones included."""
    assert {r.name for r in COORDINATOR_RPCS} == set(pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name)
    assert {(r.client_streaming, r.server_streaming) for r in HEALTHD_RPCS} >= {(True, True), (False, True)}
    assert any(r.client_streaming and not r.server_streaming for r in COORDINATOR_RPCS)


# --- auth: random and garbage `authorization` metadata ------------------------------------------------------------
JOIN, ADMIN = "fuzz-join-token-0123456789", "fuzz-admin-token-9876543210"
ASCII = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
AUTH_VALUES = st.one_of(
    ASCII,
    ASCII.map(lambda t: f"Bearer {t}"),
    st.sampled_from(["", "Bearer", "Bearer ", "bearer  ", f"Basic {JOIN}", f"Bearer {JOIN}x", f"Bearer {JOIN[:-1]}"]),
    st.sampled_from([f"Token {ADMIN}", f"Bearer{ADMIN}", f"{JOIN}", f"Bearer {ADMIN.upper()}", "Bearer " + "A" * 4000]),
)
METADATA = st.lists(
    st.tuples(st.sampled_from(["authorization", "x-authorization", "authorisation", "auth"]), AUTH_VALUES), max_size=2
).filter(lambda md: not any(v.split() in (["Bearer", JOIN], ["Bearer", ADMIN]) for _, v in md))


@dataclass
class Guarded:
    coordinator: CoordinatorServer
    healthd: HealthdServer
    chans: dict[str, grpc.Channel]


@pytest.fixture(scope="module")
def guarded() -> Iterator[Guarded]:
    """A coordinator and healthd that require tokens (plaintext on loopback, as the in-process tests run them)."""
    from diloco.rpc.security import SecurityConfig

    sec = SecurityConfig(insecure=True, join_token=JOIN, admin_token=ADMIN)
    endpoint = CoordinatorEndpoint()
    coordinator = CoordinatorServer(config(security=sec))
    healthd = HealthdServer(healthd_config(coordinator_address=endpoint.address, security=sec))
    coordinator.start()
    healthd.start()
    chans = {"diloco.v1.Coordinator": channel(coordinator.address), "diloco.v1.HealthDaemon": channel(healthd.address)}
    try:
        yield Guarded(coordinator, healthd, chans)
    finally:
        for ch in chans.values():
            ch.close()
        healthd.stop(0)
        coordinator.stop(0)
        endpoint.stop()


@pytest.mark.parametrize("rpc", COORDINATOR_RPCS + HEALTHD_RPCS, ids=lambda r: f"{r.service.split('.')[-1]}.{r}")
def test_garbage_authorization_is_unauthenticated(guarded: Guarded, rpc: Rpc) -> None:
    chan = guarded.chans[rpc.service]
    core = guarded.coordinator.core

    @settings(FUZZ, max_examples=max(5, EXAMPLES // 2))
    @given(metadata=METADATA, bodies=request_lists(rpc, messages(rpc.input.DESCRIPTOR)))
    def run(metadata: list[tuple[str, str]], bodies: list[Message]) -> None:
        version, workers = core.version, len(core.workers)
        timeout = STREAM_S if rpc.server_streaming else UNARY_S
        out = call(chan, rpc, bodies, timeout_s=timeout, max_replies=MAX_REPLIES, metadata=metadata)
        note(f"{rpc}: {out}")
        too_big = out.code == C.RESOURCE_EXHAUSTED and "metadata size" in out.details  # gRPC's own header limit
        assert (out.code == C.UNAUTHENTICATED and out.details) or too_big, out
        assert (core.version, len(core.workers)) == (version, workers), "a refused call changed the coordinator"
        serving(chan, rpc.service)

    run()


# --- regression: a body that is not protobuf must not wedge the server's shutdown ----------------------------------
def test_healthd_stops_promptly_after_garbage_heartbeats() -> None:
    """grpcio sometimes never completes shutdown after a streaming request that failed to deserialize; the drain
    must still end (found by test_healthd_raw_bytes: one heartbeat stream carrying b'\\xff', then stop hung)."""
    endpoint = CoordinatorEndpoint()
    server = HealthdServer(healthd_config(coordinator_address=endpoint.address))
    server.start()
    chan = channel(server.address)
    try:
        for _ in range(5):
            out = call(chan, HEARTBEAT, [b"\xff"], timeout_s=UNARY_S)
            assert out.code == C.INVALID_ARGUMENT and out.details.startswith(NOT_PROTOBUF), out
    finally:
        chan.close()
        started = time.monotonic()
        server.stop(0)
        endpoint.stop()
    assert time.monotonic() - started < 5.0
