"""The bulk data plane (`diloco.rpc.bulk`) over real sockets on 127.0.0.1 (port 0): framing, errors as status
codes, interruption and resume, hostile input, admission (in total and per client), what idle connections cost,
stopping with uploads in flight, serving on the caller's event loop, mutual TLS."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.core.learner import Reaction, Rpc, react
from diloco.errors import ConfigError, DilocoError, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from diloco.rpc import bulk
from diloco.rpc.bulk import BulkError, BulkServer, BulkSink, bulk_upload
from diloco.rpc.retry import RetryConfig, call_with_retry, is_retryable
from diloco.rpc.tls import write_bundle
from diloco.v1 import common_pb2, coordinator_pb2
from tests.support import wait_for

pytestmark = pytest.mark.timeout(60)

Request = coordinator_pb2.SubmitPseudoGradientRequest
Response = coordinator_pb2.SubmitPseudoGradientResponse
TOKEN = b"join-token"
U32 = struct.Struct(">I")


class Unauthenticated(DilocoError):
    code = "UNAUTHENTICATED"


# --- a handler that behaves like the coordinator's upload state --------------------------------------------------
class Store:
    """Bytes held per submission (resumable from the bytes held), idempotent by submission id, with faults to
    inject."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.held: dict[str, bytearray] = {}
        self.done: set[str] = set()
        self.events: list[tuple[str, str]] = []
        self.feed_sizes: list[int] = []
        self.opened = 0
        self.identities: list[str | None] = []  # the client certificate's name per upload (None: plaintext)
        self.fail_open: DilocoError | None = None
        self.fail_feed_at: int | None = None  # raise once this many bytes are held
        self.fail_finish: DilocoError | None = None
        self.block_feed: threading.Event | None = None

    def record(self, sid: str, event: str) -> None:
        with self.cv:
            self.events.append((sid, event))
            self.cv.notify_all()

    def wait_event(self, sid: str, event: str, timeout_s: float = 10.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: (sid, event) in self.events, timeout_s), (sid, event, self.events)

    def of(self, sid: str) -> list[str]:
        with self.cv:
            return [e for s, e in self.events if s == sid]

    def open(self, token: bytes, request: Request, identity: str | None) -> BulkSink | Response:
        self.identities.append(identity)
        if token != TOKEN:
            raise Unauthenticated("missing or unknown token; pass the join token")
        if self.fail_open is not None:
            raise self.fail_open
        h = request.header
        with self.cv:
            self.opened += 1
            if h.submission_id in self.done:
                return Response(outcome=coordinator_pb2.SUBMISSION_OUTCOME_APPLIED, version=7)
            held = self.held.setdefault(h.submission_id, bytearray())
            if h.resume_offset != len(held):
                raise FailedPrecondition(f"resume from offset {len(held)}, not {h.resume_offset}")
        return Sink(self, h.submission_id, h.payload.encoded_bytes)


class Sink:
    def storage(self) -> None:
        return None  # received into the server's buffers, copied here

    def __init__(self, store: Store, sid: str, total: int) -> None:
        self.store = store
        self.sid = sid
        self.total = total
        self.held = store.held[sid]
        self.expected_bytes = total - len(self.held)
        store.record(sid, "open")

    def feed(self, data: memoryview) -> None:
        s = self.store
        if s.block_feed is not None:
            s.block_feed.wait(10)
        if s.fail_feed_at is not None and len(self.held) + len(data) >= s.fail_feed_at:
            raise InvalidArgument("payload is not valid int8: bad scale; re-encode and send it again")
        with s.cv:
            self.held += data
            s.feed_sizes.append(len(data))

    def finish(self) -> Response:
        if self.store.fail_finish is not None:
            raise self.store.fail_finish
        assert len(self.held) == self.total
        with self.store.cv:
            self.store.done.add(self.sid)
        self.store.record(self.sid, "finish")
        return Response(outcome=coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED, version=zlib.crc32(self.held), round=3)

    def interrupted(self) -> None:
        self.store.record(self.sid, "interrupted")

    def close(self) -> None:
        self.store.record(self.sid, "close")


def request(sid: str, total: int, offset: int = 0) -> Request:
    return Request(
        header=coordinator_pb2.SubmissionHeader(
            worker_id="w0",
            submission_id=sid,
            payload=common_pb2.PayloadSpec(encoded_bytes=total),
            resume_offset=offset,
        )
    )


def preamble(token: bytes, req: Request | bytes) -> bytes:
    body = req if isinstance(req, bytes) else req.SerializeToString()
    return bulk.MAGIC + U32.pack(len(token)) + token + U32.pack(len(body)) + body


def exchange(
    port: int, data: bytes, *, close_write: bool = True, timeout_s: float = 10.0, source: str = "127.0.0.1"
) -> tuple[int, bytes] | None:
    """Send `data` raw (from address `source`), half-close, read the server's frame (None: it closed without
    one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0)) as s:
        try:
            s.sendall(data)
            if close_write:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        buf = bytearray()
        try:
            while chunk := s.recv(1 << 16):
                buf += chunk
        except ConnectionResetError:
            pass
    if len(buf) < 5:
        return None
    status, n = struct.unpack(">BI", buf[:5])
    assert len(buf) == 5 + n, "one frame, then the server closes"
    return status, bytes(buf[5:])


def code_value(code: grpc.StatusCode) -> int:
    return int(code.value[0])


@pytest.fixture
def store() -> Store:
    return Store()


@pytest.fixture
def server(store: Store) -> Iterator[BulkServer]:
    srv = BulkServer("127.0.0.1", 0, store, idle_timeout_s=3.0, max_connections=4)
    srv.start()
    yield srv
    srv.stop()


def upload(srv: BulkServer, sid: str, payload: bytes, offset: int = 0, token: bytes = TOKEN, **kw: object) -> Response:
    return bulk_upload(
        f"127.0.0.1:{srv.port}",
        token,
        request(sid, len(payload), offset),
        memoryview(payload)[offset:],
        timeout_s=20,
        **kw,  # type: ignore[arg-type]
    )


def serves(srv: BulkServer, store: Store) -> None:
    """The server still takes an upload."""
    payload = os.urandom(300_000)
    sid = f"probe-{time.monotonic_ns()}"
    assert upload(srv, sid, payload).version == zlib.crc32(payload)
    assert bytes(store.held[sid]) == payload


# --- the happy path ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False])
def test_payload_arrives_in_order_exactly_once(store: Store, overlap: bool) -> None:
    srv = BulkServer("127.0.0.1", 0, store, overlap=overlap, buffer_bytes=1 << 20)
    srv.start()
    try:
        payload = os.urandom(5 * (1 << 20) + 12345)
        r = upload(srv, "s1", payload)
        assert r.outcome == coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED and r.round == 3
        assert r.version == zlib.crc32(payload)
        assert bytes(store.held["s1"]) == payload
        assert sum(store.feed_sizes) == len(payload) and max(store.feed_sizes) <= 1 << 20
        assert store.of("s1") == ["open", "finish", "close"]
    finally:
        srv.stop()


def test_empty_payload_and_start_stop_idempotent(store: Store) -> None:
    srv = BulkServer("127.0.0.1", 0, store)
    port = srv.start()
    assert srv.start() == port
    assert upload(srv, "empty", b"").version == zlib.crc32(b"")
    assert store.of("empty") == ["open", "finish", "close"]
    srv.stop()
    srv.stop()
    with pytest.raises(BulkError) as e:
        upload(srv, "after", b"x")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_duplicate_answered_without_payload(server: BulkServer, store: Store) -> None:
    store.done.add("dup")
    payload = bytes(64 << 20)  # far more than the socket buffers: the client must stop at the early answer
    t0 = time.monotonic()
    r = upload(server, "dup", payload)
    assert r.outcome == coordinator_pb2.SUBMISSION_OUTCOME_APPLIED and r.version == 7
    assert store.of("dup") == []  # no sink was opened
    assert time.monotonic() - t0 < 15
    serves(server, store)


# --- errors become status codes ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("where", "err", "code"),
    [
        ("open", FailedPrecondition("stale epoch; register again"), grpc.StatusCode.FAILED_PRECONDITION),
        ("open", NotFound("unknown worker w0; register"), grpc.StatusCode.NOT_FOUND),
        ("open", ResourceExhausted("payload too large; use int8"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("feed", None, grpc.StatusCode.INVALID_ARGUMENT),
        ("finish", InvalidArgument("crc mismatch; send it again"), grpc.StatusCode.INVALID_ARGUMENT),
        ("finish", RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_arrive_as_status_and_message(
    server: BulkServer, store: Store, where: str, err: Exception | None, code: grpc.StatusCode
) -> None:
    payload = os.urandom(20 << 20)  # the feed error comes early: the client stops sending at the answer
    if where == "open":
        assert isinstance(err, DilocoError)
        store.fail_open = err
    elif where == "feed":
        store.fail_feed_at = 1 << 20
    else:
        store.fail_finish = err  # type: ignore[assignment]
    with pytest.raises(BulkError) as e:
        upload(server, "bad", payload)
    assert e.value.code() == code
    if where == "feed":
        assert "re-encode" in e.value.details()
    elif isinstance(err, DilocoError):
        assert e.value.details() == str(err)
    else:
        assert "boom" in e.value.details()
    assert isinstance(e.value, grpc.RpcError) and not is_retryable(e.value)
    if where != "open":
        assert store.of("bad")[-1] == "close" and "interrupted" not in store.of("bad")
    store.fail_open = store.fail_finish = None
    store.fail_feed_at = None
    serves(server, store)


def test_bad_token_is_unauthenticated(server: BulkServer, store: Store) -> None:
    with pytest.raises(BulkError) as e:
        upload(server, "t", b"abc", token=b"wrong")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_connection_failures_are_unavailable_and_retryable(store: Store) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
    with pytest.raises(BulkError) as e:
        bulk_upload(f"127.0.0.1:{port}", TOKEN, request("x", 1), memoryview(b"x"), timeout_s=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and is_retryable(e.value)
    with pytest.raises(InvalidArgument):
        bulk_upload("no-port", TOKEN, request("x", 1), memoryview(b"x"), timeout_s=5)


def upload_to_a_frozen_server(reads: bool, **kwargs: Any) -> BulkError:
    """What `bulk_upload` (with `kwargs`) raises against a server that accepts and then neither reads (a frozen
    process: its kernel holds the connection) nor answers (`reads`: read everything, then froze)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        drained = threading.Event()

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                while reads and conn.recv(1 << 20):
                    pass
                drained.wait(120)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        payload = memoryview(bytes(64 << 20 if not reads else 1 << 20))
        try:
            with pytest.raises(BulkError) as e:
                address = f"127.0.0.1:{listener.getsockname()[1]}"
                bulk_upload(address, TOKEN, request("fz", len(payload)), payload, timeout_s=120, **kwargs)
        finally:
            drained.set()
            t.join(timeout=10)
    return e.value


@pytest.mark.parametrize("reads", [False, True])
def test_a_stalled_server_is_unavailable_after_stall_s(reads: bool) -> None:
    """A frozen server: the client gives up after `stall_s` without progress, not at its deadline."""
    t0 = time.monotonic()
    error = upload_to_a_frozen_server(reads, stall_s=0.5)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and is_retryable(error)
    assert time.monotonic() - t0 < 60, "gave up at its deadline, not after the stall"


@pytest.mark.parametrize("reads", [False, True])
def test_an_upload_is_abandoned_once_asked_not_at_the_stall(reads: bool) -> None:
    """A leader cut off the network (its kernel keeps the connection; no answer comes) while the learner already
    moved to the new one: `abandon` turning True ends the wait within a poll, long before `stall_s`, as
    UNAVAILABLE (the learner then resumes at the new leader)."""
    moved_at = time.monotonic() + 1.0
    error = upload_to_a_frozen_server(reads, stall_s=60, abandon=lambda: time.monotonic() >= moved_at)
    waited = time.monotonic() - moved_at
    assert error.code() == grpc.StatusCode.UNAVAILABLE and is_retryable(error)
    assert "abandoned" in (error.details() or ""), error.details()
    assert waited < 20, f"waited {waited:.1f} s after the move"


@contextlib.contextmanager
def unanswered(phase: str, tls_dir: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """An address (and `bulk_upload` keywords) at which an upload never gets past `phase`: `lookup` (the host's
    name never resolves: the resolver itself is held, as DNS for a host cut off the network can be), `connect` (a
    listener whose accept queue is full: the kernel drops the SYN) or `handshake` (a server that accepts and never
    answers the ClientHello)."""
    with socket.socket() as listener, contextlib.ExitStack() as stack:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address, kwargs = f"127.0.0.1:{listener.getsockname()[1]}", {}
        if phase == "lookup":
            held = threading.Event()
            stack.callback(held.set)
            real = socket.getaddrinfo
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                socket, "getaddrinfo", lambda *a, **k: held.wait(120) and real(*a, **k)
            )
        elif phase == "connect":
            while True:  # fill the accept queue; the connect that times out is the first dropped
                filler = stack.enter_context(socket.socket())
                filler.settimeout(0.3)
                try:
                    filler.connect(listener.getsockname())
                except TimeoutError:
                    break
        else:
            kwargs = {"ssl_context": bulk.client_ssl_context_from_dir(tls_dir, "worker")}
        yield address, kwargs


@pytest.mark.parametrize("phase", ["lookup", "connect", "handshake"])
def test_an_upload_that_cannot_connect_is_abandoned_once_asked(phase: str, tmp_path: Path) -> None:
    """A leader cut off the network before the upload began: its name may not resolve for tens of seconds, its
    kernel answers no SYN, or the connection is up and the TLS handshake gets no answer. Each wait is given up
    within a poll of `abandon` turning True, long before `stall_s`, as UNAVAILABLE."""
    write_bundle(tmp_path, clients=["worker"], tokens=False)
    with unanswered(phase, tmp_path) as (address, kwargs):
        moved_at = time.monotonic() + 1.0
        with pytest.raises(BulkError) as e:
            bulk_upload(
                address,
                TOKEN,
                request("cut", 1000),
                memoryview(bytes(1000)),
                timeout_s=120,
                stall_s=60,
                abandon=lambda: time.monotonic() >= moved_at,
                **kwargs,
            )
        waited = time.monotonic() - moved_at
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and is_retryable(e.value)
    assert "abandoned" in (e.value.details() or ""), e.value.details()
    assert waited < 20, f"waited {waited:.1f} s after the move"


@pytest.mark.parametrize("phase", ["connect", "handshake"])
def test_an_upload_that_cannot_connect_is_unavailable_after_stall_s(phase: str, tmp_path: Path) -> None:
    write_bundle(tmp_path, clients=["worker"], tokens=False)
    with unanswered(phase, tmp_path) as (address, kwargs):
        t0 = time.monotonic()
        with pytest.raises(BulkError) as e:
            bulk_upload(address, TOKEN, request("cut", 10), memoryview(bytes(10)), timeout_s=120, stall_s=1, **kwargs)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not a byte moved for 1 s" in (e.value.details() or "")
    assert time.monotonic() - t0 < 60, "gave up at its deadline, not after the stall"


def test_retry_policy_retries_an_unavailable_bulk_upload(server: BulkServer, store: Store) -> None:
    calls = []
    payload = os.urandom(1000)

    def attempt() -> Response:
        calls.append(1)
        if len(calls) == 1:
            raise BulkError(grpc.StatusCode.UNAVAILABLE, "connection reset")
        return upload(server, "r", payload)

    r = call_with_retry(attempt, "bulk", RetryConfig(max_attempts=3, initial_backoff_s=0.01))
    assert len(calls) == 2 and r.version == zlib.crc32(payload)


# --- interruption and resume -------------------------------------------------------------------------------------
def test_disconnect_mid_payload_then_resume(server: BulkServer, store: Store) -> None:
    payload = os.urandom(3 * (1 << 20) + 7)
    half = len(payload) // 2
    assert exchange(server.port, preamble(TOKEN, request("res", len(payload))) + payload[:half]) is not None
    store.wait_event("res", "close")
    assert store.of("res") == ["open", "interrupted", "close"]
    assert bytes(store.held["res"]) == payload[:half]  # everything received was fed before interrupted()
    with pytest.raises(BulkError) as e:  # resuming from the wrong offset: the handler says where
        upload(server, "res", payload, offset=0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and str(half) in e.value.details()
    r = upload(server, "res", payload, offset=half)
    assert r.version == zlib.crc32(payload) and bytes(store.held["res"]) == payload


def test_payload_stall_is_interrupted(store: Store) -> None:
    srv = BulkServer("127.0.0.1", 0, store, idle_timeout_s=0.3)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(preamble(TOKEN, request("stall", 1000)) + b"x" * 10)
            store.wait_event("stall", "close")
            frame = s.recv(1 << 16)
        status, _ = struct.unpack(">BI", frame[:5])
        assert status == code_value(grpc.StatusCode.UNAVAILABLE) and b"10 of 1000" in frame[5:]
        assert store.of("stall") == ["open", "interrupted", "close"]
        serves(srv, store)
    finally:
        srv.stop()


def test_stop_cuts_a_running_upload_as_interrupted(store: Store) -> None:
    srv = BulkServer("127.0.0.1", 0, store, idle_timeout_s=30)
    srv.start()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(preamble(TOKEN, request("cut", 1000)) + b"x" * 10)
        store.wait_event("cut", "open")
        t0 = time.monotonic()
        srv.stop(grace_s=0.1)
        assert time.monotonic() - t0 < 5
    assert store.of("cut") == ["open", "interrupted", "close"]
    assert len(store.held["cut"]) == 10
    assert srv.active_connections == 0


# --- hostile input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", grpc.StatusCode.INVALID_ARGUMENT, "magic"),
        (bulk.MAGIC + U32.pack(bulk.MAX_TOKEN_BYTES + 1), grpc.StatusCode.RESOURCE_EXHAUSTED, "token"),
        (bulk.MAGIC + U32.pack(0) + U32.pack(0xFFFFFFFF), grpc.StatusCode.RESOURCE_EXHAUSTED, "request"),
        (bulk.MAGIC + U32.pack(0) + U32.pack(3) + b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "serialized"),
        (preamble(TOKEN, Request(data=b"abc")), grpc.StatusCode.INVALID_ARGUMENT, "header"),
        (b"DL", grpc.StatusCode.UNAVAILABLE, "ended"),
        (bulk.MAGIC + U32.pack(10) + b"abc", grpc.StatusCode.UNAVAILABLE, "ended"),
        (preamble(TOKEN, request("t", 10))[:-3], grpc.StatusCode.UNAVAILABLE, "ended"),
        (preamble(TOKEN, request("short", 100)) + b"x" * 40, grpc.StatusCode.UNAVAILABLE, "40 of 100"),
    ],
    ids=[
        "magic",
        "token-len",
        "header-len",
        "header-bytes",
        "data-first",
        "cut-magic",
        "cut-token",
        "cut-header",
        "short-payload",
    ],
)
def test_bad_streams_get_an_error_frame(
    server: BulkServer, store: Store, data: bytes, code: grpc.StatusCode, words: str
) -> None:
    frame = exchange(server.port, data)
    assert frame is not None
    assert frame[0] == code_value(code) and words in frame[1].decode(), frame
    if b"short" in data:
        store.wait_event("short", "close")
        assert store.of("short") == ["open", "interrupted", "close"] and len(store.held["short"]) == 40
    wait_for("every connection closed", lambda: server.active_connections == 0)
    serves(server, store)


def test_idle_preamble_times_out(store: Store) -> None:
    srv = BulkServer("127.0.0.1", 0, store, idle_timeout_s=0.3)
    srv.start()
    try:
        t0 = time.monotonic()
        frame = exchange(srv.port, bulk.MAGIC, close_write=False)  # then nothing: a slow or dead client
        assert frame is not None and frame[0] == code_value(grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - t0 < 5
    finally:
        srv.stop()


def test_connection_cap_is_resource_exhausted(store: Store) -> None:
    srv = BulkServer("127.0.0.1", 0, store, max_connections=2, idle_timeout_s=10)
    srv.start()
    held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(2)]
    try:
        for s in held:
            s.sendall(bulk.MAGIC)
        wait_for("two connections open", lambda: srv.active_connections == 2)
        with pytest.raises(BulkError) as e:
            upload(srv, "over", os.urandom(1000))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 2" in e.value.details()
        frame = exchange(srv.port, b"")
        assert frame is not None and frame[0] == code_value(grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        for s in held:
            s.close()
    wait_for("every connection closed", lambda: srv.active_connections == 0)
    serves(srv, store)
    srv.stop()


def hold(
    store: Store, port: int, sid: str, source: str = "127.0.0.1", ctx: ssl.SSLContext | None = None
) -> socket.socket:
    """A slow upload: the preamble and 10 of its 1000 bytes, then nothing; returns once the server opened it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if ctx is not None:
        s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
    s.sendall(preamble(TOKEN, request(sid, 1000)) + b"x" * 10)
    store.wait_event(sid, "open")
    return s


def read_frame(s: socket.socket) -> tuple[int, bytes]:
    buf = bytearray()
    while len(buf) < 5 or len(buf) < 5 + struct.unpack(">I", buf[1:5])[0]:
        chunk = s.recv(1 << 16)
        assert chunk, f"the server closed after {len(buf)} bytes of its frame"
        buf += chunk
    return buf[0], bytes(buf[5:])


def threads_since(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads alive now that were not in `before`: threads an earlier test left behind may end meanwhile."""
    return set(threading.enumerate()) - before


def test_idle_connections_cost_no_threads(store: Store) -> None:
    before = set(threading.enumerate())
    srv = BulkServer("127.0.0.1", 0, store, max_connections=256, max_connections_per_client=256, idle_timeout_s=30)
    srv.start()
    held: list[socket.socket] = []
    try:
        serves(srv, store)  # the loop's thread and the handler threads it used exist from here on
        threads = threads_since(before)
        assert len(threads) <= 1 + srv.handler_threads
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(bulk.MAGIC)  # then nothing: a slow client inside its preamble
            held.append(s)
        wait_for("200 connections open", lambda: srv.active_connections == 200)
        assert threads_since(before) <= threads
        serves(srv, store)  # and the server still serves
        assert len(threads_since(before)) <= 1 + srv.handler_threads
        wait_for("the upload's connection closed", lambda: srv.active_connections == 200)
    finally:
        for s in held:
            s.close()
    wait_for("every connection closed", lambda: srv.active_connections == 0)
    srv.stop()
    assert not threads_since(before)  # the loop's thread and the handler threads are gone


def test_per_client_and_total_limits_refuse_with_a_retry_hint(store: Store) -> None:
    srv = BulkServer("127.0.0.1", 0, store, max_connections=3, max_connections_per_client=2, idle_timeout_s=10)
    srv.start()
    held = [hold(store, srv.port, f"h{i}") for i in range(2)]  # client 127.0.0.1 at its limit
    try:
        with pytest.raises(BulkError) as e:
            upload(srv, "mine", os.urandom(1000))
        details = e.value.details()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 2 uploads at once from one client (127.0.0.1)" in details and "retry after 1 s" in details
        assert react(Rpc.SUBMIT, e.value.code().name) is Reaction.RETRY  # the worker's uploader tries again
        assert store.of("mine") == []
        payload = os.urandom(5000)  # another client (another address) still gets in
        frame = exchange(srv.port, preamble(TOKEN, request("theirs", len(payload))) + payload, source="127.0.0.2")
        assert frame is not None and frame[0] == bulk.STATUS_OK
        assert Response.FromString(frame[1]).version == zlib.crc32(payload)
        held.append(hold(store, srv.port, "h2", source="127.0.0.2"))  # 3 in all: the total is reached
        frame = exchange(srv.port, b"", source="127.0.0.2")
        assert frame is not None and frame[0] == code_value(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "at most 3 uploads at once; retry after 1 s" in frame[1].decode()
        assert srv.active_connections == 3
    finally:
        for s in held:
            s.close()
    wait_for("every connection closed", lambda: srv.active_connections == 0)
    for sid in ("h0", "h1", "h2"):
        store.wait_event(sid, "close")
        assert store.of(sid) == ["open", "interrupted", "close"]
    serves(srv, store)
    srv.stop()


def test_stop_lets_a_slow_upload_finish_within_grace(store: Store) -> None:
    before = set(threading.enumerate())
    srv = BulkServer("127.0.0.1", 0, store, idle_timeout_s=30)
    port = srv.start()

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except (ConnectionRefusedError, ConnectionResetError):  # reset: closed with our connect in its backlog
            return True
        return False

    with hold(store, port, "slow") as s:
        stopper = threading.Thread(target=srv.stop, kwargs={"grace_s": 30})
        stopper.start()
        wait_for("the server stops accepting", refused)
        assert stopper.is_alive()  # stop waits for the upload in flight
        s.sendall(b"x" * 990)
        status, body = read_frame(s)
        assert status == bulk.STATUS_OK and Response.FromString(body).version == zlib.crc32(b"x" * 1000)
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert store.of("slow") == ["open", "finish", "close"]
    assert srv.active_connections == 0 and not threads_since(before)


def test_serves_on_the_callers_event_loop(store: Store) -> None:
    async def main() -> None:
        srv = BulkServer("127.0.0.1", 0, store)
        await srv.start_async()
        assert not threads_since(before)  # no thread of its own until a handler call
        payload = os.urandom(3 << 20)
        r = await asyncio.to_thread(upload, srv, "on-loop", payload)
        assert r.version == zlib.crc32(payload)
        assert srv.start() == srv.port  # started already
        with pytest.raises(RuntimeError):
            srv.stop()  # would wait on the loop it blocks
        await srv.stop_async(grace_s=1)
        await srv.stop_async()

    before = set(threading.enumerate())
    asyncio.run(main())
    assert not threads_since(before)

    loop = asyncio.new_event_loop()  # a loop another thread runs (as the gRPC server's), passed in
    t = threading.Thread(target=loop.run_forever)
    t.start()
    pool = concurrent.futures.ThreadPoolExecutor(2, "shared")  # and a thread pool shared with other work
    try:
        srv = BulkServer("127.0.0.1", 0, store, loop=loop, executor=pool)
        srv.start()
        serves(srv, store)
        srv.stop()
        assert loop.is_running()  # the caller's loop and pool are the caller's to stop
        assert pool.submit(lambda: 7).result() == 7
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join()
        loop.close()
        pool.shutdown()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix=st.sampled_from([b"", bulk.MAGIC, bulk.MAGIC + U32.pack(len(TOKEN)) + TOKEN, "preamble"]),
    junk=st.binary(max_size=2048),
    close_write=st.booleans(),
)
def test_random_bytes_never_crash_or_hang(
    fuzz_server: tuple[BulkServer, Store], prefix: object, junk: bytes, close_write: bool
) -> None:
    srv, store = fuzz_server
    start = preamble(TOKEN, request(f"fz-{len(junk)}", 1000)) if prefix == "preamble" else prefix
    assert isinstance(start, bytes)
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        try:
            s.sendall(start + junk)
            if close_write:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if close_write:  # the server answers (or closes) by itself, within its timeouts
            try:
                while s.recv(1 << 16):
                    pass
            except ConnectionResetError:
                pass
    assert time.monotonic() - t0 < 10
    serves(srv, store)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[tuple[BulkServer, Store]]:
    store = Store()
    srv = BulkServer("127.0.0.1", 0, store, idle_timeout_s=1.0, max_connections=8)
    srv.start()
    yield srv, store
    srv.stop()
    assert srv.active_connections == 0


# --- mutual TLS --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    good = tmp_path_factory.mktemp("tls")
    other = tmp_path_factory.mktemp("tls-other")
    write_bundle(good, clients=["worker"], tokens=False)
    write_bundle(other, clients=["worker"], tokens=False)  # another CA
    return good, other


@pytest.fixture
def tls_server(store: Store, tls_dirs: tuple[Path, Path]) -> Iterator[BulkServer]:
    good, _ = tls_dirs
    srv = BulkServer(
        "127.0.0.1", 0, store, ssl_context=bulk.server_ssl_context_from_dir(good, "coordinator"), idle_timeout_s=3
    )
    srv.start()
    yield srv
    srv.stop()


def test_tls_upload(tls_server: BulkServer, store: Store, tls_dirs: tuple[Path, Path]) -> None:
    good, _ = tls_dirs
    ctx = bulk.client_ssl_context_from_dir(good, "worker")
    payload = os.urandom(6 << 20)
    r = upload(tls_server, "tls", payload, ssl_context=ctx)
    assert r.version == zlib.crc32(payload) and bytes(store.held["tls"]) == payload
    store.done.add("tls-dup")
    assert upload(tls_server, "tls-dup", payload, ssl_context=ctx).version == 7
    r = upload(tls_server, "tls-host", b"abc", ssl_context=ctx, server_hostname="coordinator")
    assert r.version == zlib.crc32(b"abc")
    assert store.identities == ["worker"] * 3  # the handler learns who the verified certificate names


def test_tls_client_is_its_certificate(store: Store, tls_dirs: tuple[Path, Path]) -> None:
    good, _ = tls_dirs
    srv = BulkServer(
        "127.0.0.1",
        0,
        store,
        ssl_context=bulk.server_ssl_context_from_dir(good, "coordinator"),
        max_connections_per_client=1,
    )
    srv.start()
    ctx = bulk.client_ssl_context_from_dir(good, "worker")
    try:
        with hold(store, srv.port, "tls-slow", ctx=ctx):
            with pytest.raises(BulkError) as e:  # the same certificate, from another connection
                upload(srv, "tls-more", b"abc", ssl_context=ctx)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "from one client (certificate 'worker')" in e.value.details()
        store.wait_event("tls-slow", "close")
        assert upload(srv, "tls-more", b"abc", ssl_context=ctx).version == zlib.crc32(b"abc")
    finally:
        srv.stop()


def test_a_slow_tls_handshake_goes_on_across_polls(
    tls_server: BulkServer, store: Store, tls_dirs: tuple[Path, Path]
) -> None:
    """A handshake that takes several `ABANDON_POLL_S` (a long link) resumes after each poll and completes."""
    good, _ = tls_dirs
    with socket.create_server(("127.0.0.1", 0)) as front:

        def relay() -> None:  # holds the client's first bytes back, then passes everything through
            conn, _ = front.accept()
            with conn, socket.create_connection(("127.0.0.1", tls_server.port)) as back:
                time.sleep(3 * bulk.ABANDON_POLL_S)
                pumps = [threading.Thread(target=pump, args=ab, daemon=True) for ab in ((conn, back), (back, conn))]
                for t in pumps:
                    t.start()
                for t in pumps:
                    t.join(20)

        def pump(a: socket.socket, b: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := a.recv(1 << 16):
                    b.sendall(data)
                b.shutdown(socket.SHUT_WR)

        threading.Thread(target=relay, daemon=True).start()
        r = bulk_upload(
            f"127.0.0.1:{front.getsockname()[1]}",
            TOKEN,
            request("slow-hello", 3),
            memoryview(b"abc"),
            timeout_s=20,
            ssl_context=bulk.client_ssl_context_from_dir(good, "worker"),
            server_hostname="127.0.0.1",
        )
    assert r.version == zlib.crc32(b"abc")


def _no_cert(ca: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(ca))
    return ctx


@pytest.mark.parametrize("client", ["no-cert", "other-ca-cert", "untrusted-server"])
def test_tls_refuses_unknown_clients(
    tls_server: BulkServer, store: Store, tls_dirs: tuple[Path, Path], client: str
) -> None:
    good, other = tls_dirs
    if client == "no-cert":
        ctx = _no_cert(good / "ca.pem")
    elif client == "other-ca-cert":  # trusts the server, but its certificate comes from another CA
        ctx = bulk.client_ssl_context(good / "ca.pem", other / "worker.pem", other / "worker.key")
    else:  # the client does not trust the server's CA
        ctx = bulk.client_ssl_context(other / "ca.pem", other / "worker.pem", other / "worker.key")
    with pytest.raises(BulkError) as e:
        upload(tls_server, "intruder", os.urandom(2 << 20), ssl_context=ctx)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert store.opened == 0 and store.of("intruder") == []
    wait_for("every connection closed", lambda: tls_server.active_connections == 0)
    r = upload(tls_server, "ok", b"fine", ssl_context=bulk.client_ssl_context_from_dir(good, "worker"))
    assert r.version == zlib.crc32(b"fine")


def test_plaintext_client_on_tls_server_is_refused(tls_server: BulkServer, store: Store) -> None:
    with pytest.raises(BulkError) as e:
        upload(tls_server, "plain", os.urandom(1000))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and store.opened == 0


def test_config_is_validated(store: Store) -> None:
    for kw in (
        {"max_connections": 0},
        {"max_connections_per_client": 0},
        {"idle_timeout_s": 0.0},
        {"buffer_bytes": 10},
        {"handler_threads": 0},
        {"retry_after_s": 0.0},
    ):
        with pytest.raises(ConfigError):
            BulkServer("127.0.0.1", 0, store, **kw)
