"""Bulk data plane: pseudo-gradient payloads over a plain TCP (or TLS) byte stream, beside gRPC (the control
plane). Python gRPC copies every payload byte about three times; here the event loop `recv_into`s the buffer the
coordinator keeps the upload in (`BulkSink.storage`; else reused buffers of its own), an `asyncio.BufferedProtocol`,
and the upload state machine is fed memoryviews of it on a small thread pool, checking the bytes where they lie,
while the next piece arrives (decoding in torch and zlib releases the GIL). The upload itself
(open, feed, finish, interrupted, resumable by byte offset, idempotent by submission id) is the coordinator's one
upload protocol (`diloco.core.uploads`), shared with the gRPC path; only the framing is new.

Wire format, one upload per connection, integers big-endian:

    client -> server
        b"DLB1"                   magic (4 bytes)
        u32 len, token            bearer token, at most MAX_TOKEN_BYTES (may be empty)
        u32 len, request          a serialized diloco.v1.SubmitPseudoGradientRequest with `header` set, at most
                                  MAX_HEADER_BYTES
        payload                   exactly N raw bytes: the encoded payload from header.resume_offset on. N is what
                                  the header implies (payload.encoded_bytes - resume_offset); the server's handler
                                  computes it (`BulkSink.expected_bytes`) and the server tells the client nothing
                                  before the payload.
    server -> client, one frame, then the server closes
        u8 status                 0: OK; else the numeric gRPC status code (grpc.StatusCode.X.value[0])
        u32 len, body             OK: a serialized SubmitPseudoGradientResponse; else a UTF-8 message saying what
                                  to do; at most MAX_REPLY_BYTES

The server may answer before the payload is complete: at once for a duplicate submission (OK, no payload read),
or with an error. The client looks for an early answer between the pieces it sends and stops sending when one
arrives. After answering, the server keeps reading (and discards) what is still in flight until the client closes,
for at most LINGER_S, so that a TCP reset does not destroy its answer.

Bounds: every length is checked before anything is allocated; every read waits at most `idle_timeout_s`, and the
preamble (magic, token, request) must arrive within `idle_timeout_s` as a whole (so must the TLS handshake); a bad
magic gets an INVALID_ARGUMENT frame. A connection that ends (or stalls) inside the payload calls
`BulkSink.interrupted()`: the bytes fed so far stay with the coordinator, and the client resumes from the offset
`GetUploadStatus` reports.

Admission, never a silent queue: at most `max_connections` connections are served at once, and at most
`max_connections_per_client` from one client: the name on its verified TLS certificate when there is one, else its
IP address (learners that share a certificate or an address count as one client). A connection beyond either
limit gets a RESOURCE_EXHAUSTED frame ("overloaded: ...; retry after 1 s, or upload over gRPC") and is closed; at
most `max_connections` such refusals run at once, and one more is closed without a frame.

Cost: the server is one asyncio event loop (its own thread, or a loop the caller runs, e.g. the grpc.aio
server's): a connection, idle or slow, costs a coroutine and about 16 KiB, not a thread. Every call into the handler
(`open`, `feed`, `finish`, `interrupted`, `close`: CPU work that takes locks) runs on a bounded thread pool
(`handler_threads`, or an executor the caller shares), never on the loop. The loop pauses reading a connection
while no buffer is free for it, so a slow handler slows its client down through TCP instead of buffering.

Errors reach the client as `BulkError`, a `grpc.RpcError` with `code()` and `details()`, so the retry policy
(`diloco.rpc.retry`) and the worker's handling treat it as it treats a gRPC error: a connection that fails, resets
or times out is UNAVAILABLE (retryable); RESOURCE_EXHAUSTED is retried by the worker's uploader
(`diloco.core.learner.REACTIONS`), over gRPC.

TLS: `server_ssl_context` requires a client certificate signed by the CA (mutual TLS, as the gRPC side does);
`client_ssl_context` verifies the server against the CA and presents the client's certificate. The files follow
`diloco.rpc.tls` (`ca.pem`, `<name>.pem`, `<name>.key` in a TLS folder).

Throughput against raw loopback TCP: `python -m diloco.bench.bench_bulk`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import math
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError

from diloco.errors import ConfigError, DilocoError, InvalidArgument, ResourceExhausted
from diloco.rpc.limits import clip_details
from diloco.rpc.retry import StatusError
from diloco.rpc.status import details_of, status_of
from diloco.rpc.tls import TlsFiles
from diloco.v1 import coordinator_pb2

MAGIC = b"DLB1"
MAX_TOKEN_BYTES = 4 << 10
MAX_HEADER_BYTES = 64 << 10
MAX_REPLY_BYTES = 64 << 10
STATUS_OK = 0
BUFFER_BYTES = 4 << 20  # one receive buffer; the server keeps two per upload (one filling, one being fed)
SEND_PIECE_BYTES = 4 << 20  # the client looks for an early answer between pieces
STALL_S = 30.0  # an upload in which no byte moved for this long is given up (UNAVAILABLE) and resumed
ABANDON_POLL_S = 0.5  # a client waiting on the socket asks this often whether to abandon the upload (`bulk_upload`)
LINGER_S = 2.0
STOP_JOIN_S = 30.0  # how long `stop` waits for connections once they are cut (a handler call cannot be cut)
RETRY_AFTER_S = 1.0  # the hint a refused connection gets
_SCRATCH_BYTES = 16 << 10  # bytes read when no buffer waits (discarded while lingering)
_READ_AHEAD_BYTES = 16 << 10  # a preamble field is read with up to this much more; the rest waits in `_pending`

Request = coordinator_pb2.SubmitPseudoGradientRequest
Response = coordinator_pb2.SubmitPseudoGradientResponse

_U32 = struct.Struct(">I")
_REPLY = struct.Struct(">BI")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_T = TypeVar("_T")
log = structlog.get_logger()


# --- errors -------------------------------------------------------------------------------------------------------


class BulkError(StatusError):
    """A failed bulk upload, shaped like a `grpc.RpcError`: `code()` is the status, `details()` the message."""


class _PeerGone(Exception):
    """The connection ended or stalled while the server was reading."""


# --- the server's interface to the upload state machine ----------------------------------------------------------


class BulkSink(Protocol):
    """One upload being received. The server calls `feed` with the payload bytes in order, then exactly one of
    `finish` (all `expected_bytes` arrived), `interrupted` (the connection ended or stalled first; the bytes fed
    stay for a resume) or nothing (a `feed` raised), and at last `close`, whatever happened. The calls come one at
    a time, each on one of the server's handler threads. Errors are `DilocoError`s; they become error frames."""

    @property
    def expected_bytes(self) -> int: ...

    def storage(self) -> memoryview | None:
        """Where the sink keeps the payload, from this stream's first byte (at least `expected_bytes`): the server
        receives straight into it, and `feed` gets views of it, in place. None: the server receives into buffers of
        its own, which it reuses, and `feed` copies what must outlive the call. Asked once, before the first
        `feed`; the sink keeps no view of its own (the server lets go of its views before `finish`)."""
        ...

    def feed(self, data: memoryview) -> None: ...

    def finish(self) -> Response: ...

    def interrupted(self) -> None: ...

    def close(self) -> None: ...


class BulkHandler(Protocol):
    """Checks the token and the header before any payload byte is read: returns the sink to feed, or a response to
    answer at once (a duplicate of a submission already accepted). Raises `DilocoError`s. Called on one of the
    server's handler threads."""

    def open(self, token: bytes, request: Request, identity: str | None) -> BulkSink | Response:
        """`identity`: the common name of the client's verified certificate; None without TLS."""
        ...


# --- one connection -----------------------------------------------------------------------------------------------


class _Stop(Enum):
    """Why a read ended before its buffer was full."""

    EOF = "eof"  # the client closed (or half-closed) the connection
    FAILED = "failed"  # reset, TLS error, or cut by `stop`
    IDLE = "idle"  # no byte for the idle timeout
    DEADLINE = "deadline"  # the read's overall deadline passed


def _common_name(cert: dict[str, Any] | None) -> str:
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


class _Conn(asyncio.BufferedProtocol):
    """One connection, read on demand: `fill` has the loop receive straight into the caller's buffer; reading is
    paused whenever no `fill` waits, so the client is slowed by TCP, not buffered for. Loop-confined."""

    def __init__(self, server: BulkServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.raw: asyncio.Transport | None = None  # the TCP transport
        self.transport: asyncio.Transport | None = None  # what the upload is read from: raw, or TLS over it
        self.peer = ""
        self.ip = ""
        self.identity: str | None = None  # the client certificate's common name (TLS only)
        self.stop: _Stop | None = None  # set once the stream can give no more bytes
        self.error = ""  # why, for FAILED
        self.lost: asyncio.Future[None] = loop.create_future()
        self._target: memoryview | None = None
        self._pos = 0
        self._need = 0  # wake the `fill` once this many bytes are in its buffer
        self._waiter: asyncio.Future[_Stop | None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0  # loop time of the last bytes
        self._scratch: memoryview | None = None
        self._pending = bytearray()  # bytes that arrived while no `fill` waited (TLS: just after the handshake)

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.raw = transport
        if self.server.ssl_context is None:
            self.transport = transport  # with TLS: the TLS transport, once the handshake is done
        transport.pause_reading()  # nothing is read before a `fill` (or the TLS handshake) asks
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.ip, self.peer = str(peer[0]), f"{peer[0]}:{peer[1]}"
        else:
            self.ip = self.peer = str(peer)
        self.server._accepted(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        t = self._target
        if t is not None and self._pos < len(t):
            return t[self._pos :]
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._last = self.loop.time()
        t = self._target
        if t is not None and self._pos < len(t):
            self._pos += nbytes
            if self._pos >= self._need:
                self._wake(None)
        elif self._scratch is not None:  # nobody asked: keep it for the next `fill`, and stop reading
            self._pending += self._scratch[:nbytes]
            if self.transport is not None:
                self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._end(_Stop.EOF, "")
        return self.server.ssl_context is None  # keep a plain connection open: the answer still goes out

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(_Stop.FAILED if exc is not None else _Stop.EOF, str(exc) if exc is not None else "")
        if not self.lost.done():
            self.lost.set_result(None)

    # used by the server's coroutines
    def _end(self, why: _Stop, error: str) -> None:
        if self.stop is None:
            self.stop, self.error = why, error
        self._wake(self.stop)

    def _wake(self, why: _Stop | None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(why)

    def _check_time(self, idle_s: float, deadline: float) -> None:
        now = self.loop.time() + 1e-3  # timer callbacks may run a clock tick early
        if now >= deadline:
            self._wake(_Stop.DEADLINE)
        elif now >= self._last + idle_s:
            self._wake(_Stop.IDLE)
        else:
            self._timer = self.loop.call_at(min(deadline, self._last + idle_s), self._check_time, idle_s, deadline)

    async def fill(
        self, view: memoryview, idle_s: float, deadline: float = math.inf, need: int | None = None
    ) -> tuple[int, _Stop | None]:
        """Receive into `view` until it holds `need` bytes (default: until it is full; then None), or the stream
        ends, stalls for `idle_s` or passes `deadline` (loop time) first. Returns (bytes received, why it ended
        early). Bytes kept in `_pending` come first."""
        need = len(view) if need is None else need
        got = min(len(self._pending), len(view))
        if got:
            view[:got] = self._pending[:got]
            del self._pending[:got]
        if got >= need:
            return got, None
        transport = self.transport
        if self.stop is not None or transport is None:
            return got, self.stop or _Stop.FAILED
        self._target, self._pos, self._need = view, got, need
        self._waiter = waiter = self.loop.create_future()
        self._last = self.loop.time()
        self._timer = self.loop.call_at(min(deadline, self._last + idle_s), self._check_time, idle_s, deadline)
        transport.resume_reading()
        try:
            why = await waiter
        finally:
            self._timer.cancel()
            got = self._pos
            self._target, self._waiter = None, None
            if not transport.is_closing():
                transport.pause_reading()
        return got, why

    async def read_exact(self, n: int, idle_s: float, deadline: float) -> tuple[bytes, _Stop | None]:
        """`n` bytes (with the reason when fewer came), reading ahead: what arrived beyond them stays in `_pending`
        for the next read, so a preamble that arrives in one piece costs one wake-up, not one per field."""
        buf = memoryview(bytearray(max(n, _READ_AHEAD_BYTES)))
        got, why = await self.fill(buf, idle_s, deadline, need=n)
        if got > n:
            self._pending[0:0] = buf[n:got]
        return bytes(buf[: min(got, n)]), None if got >= n else why

    async def linger(self, seconds: float) -> None:
        """Read and discard what the client still sends until it closes (at most `seconds`), so that closing with
        unread data (a TCP reset) does not destroy the answer before the client reads it."""
        deadline = self.loop.time() + seconds
        sink = memoryview(bytearray(1 << 16))
        while self.stop is None and self.loop.time() < deadline:
            _, why = await self.fill(sink, seconds, deadline)
            if why is not None:
                return

    def reply(self, status: int, body: bytes) -> None:
        """Best effort: the peer may be gone already."""
        body = body[:MAX_REPLY_BYTES]
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_REPLY.pack(status, len(body)) + body)

    def reply_error(self, code: grpc.StatusCode, message: str) -> None:
        self.reply(code.value[0], message.encode("utf-8", "replace"))

    def abort(self) -> None:
        for t in (self.transport, self.raw):
            if t is not None:
                t.abort()

    async def close(self) -> None:
        """Close after the answer went out (at most LINGER_S, then abort)."""
        if self.transport is None:  # the TLS handshake failed; start_tls closed the socket
            if self.raw is not None:
                self.raw.abort()
            return
        if not self.transport.is_closing():
            self.transport.close()
        if not self.lost.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.lost), LINGER_S)
            except TimeoutError:
                self.abort()


# --- the server ---------------------------------------------------------------------------------------------------


def _end(sink: BulkSink, box: list[memoryview], complete: bool) -> Response | None:
    """Feed the last piece received (taken out of `box`, and let go of before `finish`: a view of the sink's
    `storage` would keep the upload's buffer from the pool while a round closes in `finish`), `finish` (None:
    `interrupted` instead), then `close`: one call on a handler thread, not three. A `feed` that raises skips
    `finish` and `interrupted`."""
    try:
        last = box.pop()
        if len(last):
            sink.feed(last)
        del last
        if complete:
            return sink.finish()
        sink.interrupted()
        return None
    finally:
        sink.close()


class _State(Enum):
    NEW = "new"
    SERVING = "serving"
    STOPPING = "stopping"
    STOPPED = "stopped"


class BulkServer:
    """Accepts bulk uploads on `host:port` (0: a free port) and feeds them to `handler`.

    One asyncio event loop serves every connection: `start()` runs it in one background thread, or, with `loop`
    (an event loop running in another thread, e.g. the grpc.aio server's), on that loop; a coroutine on a running
    loop can instead `await start_async()` (the server then lives on that loop) and `await stop_async(grace_s)`.
    The handler's calls run on `handler_threads` threads of the server's own, or on `executor` (shared with other
    work, e.g. the gRPC servicer's blocking calls, so one bound covers both; the server does not shut it down).
    Admission: `max_connections` in all, `max_connections_per_client` from one client (its certificate's name
    with TLS, else its IP address); a refusal is a RESOURCE_EXHAUSTED frame saying "retry after `retry_after_s`".
    `start()` and `stop()` are idempotent; `stop` stops accepting, gives running uploads `grace_s`, then cuts them
    (they are interrupted, hence resumable), waits for their handler calls, shuts its own thread pool down and,
    when it owns the loop, ends the loop's thread."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: BulkHandler,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 32,
        max_connections_per_client: int = 16,
        idle_timeout_s: float = 30.0,
        buffer_bytes: int = BUFFER_BYTES,
        overlap: bool = True,
        handler_threads: int = 4,
        executor: concurrent.futures.Executor | None = None,
        retry_after_s: float = RETRY_AFTER_S,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if max_connections < 1:
            raise ConfigError(f"bulk max_connections must be >= 1, got {max_connections}")
        if max_connections_per_client < 1:
            raise ConfigError(f"bulk max_connections_per_client must be >= 1, got {max_connections_per_client}")
        if not idle_timeout_s > 0 or not math.isfinite(idle_timeout_s):
            raise ConfigError(f"bulk idle_timeout_s must be a positive number of seconds, got {idle_timeout_s}")
        if buffer_bytes < 4096:
            raise ConfigError(f"bulk buffer_bytes must be >= 4096, got {buffer_bytes}")
        if handler_threads < 1:
            raise ConfigError(f"bulk handler_threads must be >= 1, got {handler_threads}")
        if not 0 < retry_after_s <= 60:
            raise ConfigError(f"bulk retry_after_s must be in (0, 60] seconds, got {retry_after_s}")
        if not 0 <= port <= 65535:
            raise ConfigError(f"bulk port must be in 0..65535, got {port}")
        self.host = host
        self.handler = handler
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.idle_timeout_s = idle_timeout_s
        self.buffer_bytes = buffer_bytes
        self.overlap = overlap
        self.handler_threads = handler_threads
        self.retry_after_s = retry_after_s
        self._requested_port = port
        self._port = 0
        self._lock = threading.Lock()  # guards _state and _loop across threads
        self._state = _State.NEW
        self._loop = loop
        self._thread: threading.Thread | None = None  # the loop's, when the server owns it
        self._server: asyncio.AbstractServer | None = None
        self._executor: concurrent.futures.Executor | None = executor
        self._own_executor = executor is None
        # loop-confined:
        self._tasks: dict[_Conn, asyncio.Task[None]] = {}  # every connection, served or refused
        self._served: set[_Conn] = set()  # admitted: counted against max_connections
        self._by_client: dict[str, int] = {}
        self._refusing = 0
        self._stopped: asyncio.Event | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def active_connections(self) -> int:
        """Connections admitted and not yet closed (refused ones not counted)."""
        return len(self._served)

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> int:
        """Listen and accept (a second call does nothing). Returns the port. Call it from any thread but the
        loop's own (there, `await start_async()`)."""
        with self._lock:
            if self._state is _State.SERVING:
                return self._port
            if self._state is not _State.NEW:
                raise RuntimeError("this BulkServer was stopped; make a new one")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run_loop, args=(loop,), name="bulk-loop", daemon=True)
                self._thread.start()
                self._loop = loop
            loop = self._loop
        try:
            return self._on_loop(loop, self.start_async())
        except BaseException:
            if self._thread is not None:  # e.g. the port is taken: end the loop's thread
                loop.call_soon_threadsafe(loop.stop)
                self._thread.join()
                self._thread = None
                with self._lock:
                    self._loop, self._state = None, _State.NEW
            raise

    async def start_async(self) -> int:
        """`start` for a coroutine on a running loop: the server serves on this loop (the one given, if any)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is None:
                self._loop = loop
            elif self._loop is not loop:
                raise RuntimeError("this BulkServer serves on another event loop; call start() from a thread")
            if self._state is _State.SERVING:
                return self._port
            if self._state is not _State.NEW:
                raise RuntimeError("this BulkServer was stopped; make a new one")
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.create_server((self.host, self._requested_port), family=family, backlog=128)
            self._port = listener.getsockname()[1]
            if self._own_executor:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.handler_threads, "bulk-handler")
            self._stopped = asyncio.Event()
            self._state = _State.SERVING
        listener.setblocking(False)
        self._server = await loop.create_server(lambda: _Conn(self, loop), sock=listener, backlog=128)
        log.info(
            "bulk.listening",
            host=self.host,
            port=self._port,
            tls=self.ssl_context is not None,
            max_connections=self.max_connections,
            max_connections_per_client=self.max_connections_per_client,
        )
        return self._port

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop accepting, wait up to `grace_s` for running uploads, cut the rest, wait for them, shut the handler
        threads down (and the loop's thread, when the server started it). Safe to call twice."""
        with self._lock:
            loop, state = self._loop, self._state
            if state is _State.NEW:
                self._state = _State.STOPPED
        if state is not _State.NEW and loop is not None and not loop.is_closed():
            self._on_loop(loop, self.stop_async(grace_s))
        if self._thread is not None and loop is not None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(loop.stop)
            self._thread.join()

    async def stop_async(self, grace_s: float = 0.0) -> None:
        """`stop` for a coroutine on the server's loop (it leaves the loop running)."""
        with self._lock:
            state = self._state
            if state is _State.NEW:
                self._state = _State.STOPPED
                return
            if state is _State.SERVING:
                self._state = _State.STOPPING
        if state is not _State.SERVING:  # another stop runs or ran
            if self._stopped is not None:
                await self._stopped.wait()
            return
        assert self._stopped is not None
        try:
            await self._stop(grace_s)
        finally:
            with self._lock:
                self._state = _State.STOPPED
            self._stopped.set()

    async def _stop(self, grace_s: float) -> None:
        if self._server is not None:
            self._server.close()  # no new connections
        served = [self._tasks[c] for c in self._served if c in self._tasks]
        if served and grace_s > 0:
            await asyncio.wait(served, timeout=grace_s)
        for conn in list(self._tasks):
            conn.abort()  # their reads end: uploads are interrupted, refusals end
        stuck: set[asyncio.Task[None]] = set()
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks.values()), timeout=STOP_JOIN_S)
        if stuck:  # a handler call that did not return; its thread stays until it does
            log.warning("bulk.stop_timeout", connections=len(stuck))
        if self._server is not None:
            await self._server.wait_closed()
        if self._executor is not None and self._own_executor:
            self._executor.shutdown(wait=not stuck, cancel_futures=True)
        log.info("bulk.stopped", port=self._port)

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    @staticmethod
    def _on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run `coro` on `loop` (running in another thread) and wait for its result."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("BulkServer.start/stop called on its own event loop; await start_async/stop_async")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    # --- admission ---------------------------------------------------------------------------------------------
    def _accepted(self, conn: _Conn) -> None:
        """A new connection (on the loop, before any byte is read): serve it, refuse it, or drop it."""
        if self._state is not _State.SERVING:
            conn.abort()
            return
        if len(self._served) < self.max_connections:
            self._served.add(conn)
            self._spawn(conn, self._serve(conn))
            return
        self._refuse_later(
            conn, f"the bulk server serves at most {self.max_connections} uploads at once", "max_connections"
        )

    def _refuse_later(self, conn: _Conn, what: str, limit: str) -> None:
        if self._refusing >= self.max_connections or self._state is not _State.SERVING:  # flooded: not a frame
            conn.abort()
            return
        self._refusing += 1
        message = f"overloaded: {what}; retry after {self.retry_after_s:g} s, or upload over gRPC"
        self._spawn(conn, self._refuse(conn, message, limit))

    def _spawn(self, conn: _Conn, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks[conn] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._tasks.get(conn) is t:  # a refusal may have taken the connection over
                del self._tasks[conn]

        task.add_done_callback(done)

    async def _secure(self, conn: _Conn) -> bool:
        """The TLS handshake (none without TLS). False: it failed (logged; the connection is closed)."""
        if self.ssl_context is None:
            return True
        assert self._loop is not None and conn.raw is not None
        try:
            tls = await self._loop.start_tls(
                conn.raw, conn, self.ssl_context, server_side=True, ssl_handshake_timeout=self.idle_timeout_s
            )
        except Exception as e:  # refused certificate, plaintext client, reset, timeout, cut by stop
            log.info("bulk.connection_failed", peer=conn.peer, error=f"{type(e).__name__}: {e}")
            return False
        if tls is None or tls.is_closing():
            return False
        assert isinstance(tls, asyncio.Transport)
        conn.transport = tls
        tls.pause_reading()
        conn.identity = _common_name(tls.get_extra_info("peercert"))
        return True

    async def _refuse(self, conn: _Conn, message: str, limit: str) -> None:
        try:
            if conn.transport is not None or await self._secure(conn):
                log.warning("bulk.refused", peer=conn.peer, identity=conn.identity, limit=limit)
                conn.reply_error(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
                await conn.linger(min(LINGER_S, self.idle_timeout_s))
        finally:
            await conn.close()
            self._refusing -= 1

    async def _serve(self, conn: _Conn) -> None:
        handed_over = False  # to a refusal, which closes the connection
        try:
            if not await self._secure(conn):
                return
            client = f"ip:{conn.ip}" if conn.identity is None else f"cert:{conn.identity}"
            if self._by_client.get(client, 0) >= self.max_connections_per_client:
                self._served.discard(conn)
                handed_over = True
                who = conn.ip if conn.identity is None else f"certificate {conn.identity!r}"
                self._refuse_later(
                    conn,
                    f"the bulk server serves at most {self.max_connections_per_client} uploads at once from one "
                    f"client ({who})",
                    "max_connections_per_client",
                )
                return
            self._by_client[client] = self._by_client.get(client, 0) + 1
            try:
                await self._handle(conn)
            finally:
                left = self._by_client[client] - 1
                if left:
                    self._by_client[client] = left
                else:
                    del self._by_client[client]
        except Exception as e:  # a bug here must not end the server
            log.exception("bulk.connection_failed", peer=conn.peer, error=str(e))
            conn.abort()
        finally:
            if not handed_over:
                await conn.close()
                self._served.discard(conn)

    # --- one upload ----------------------------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """`fn(*args)` on a handler thread."""
        assert self._loop is not None
        return self._loop.run_in_executor(self._executor, fn, *args)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await self._submit(fn, *args)

    async def _handle(self, conn: _Conn) -> None:
        try:
            answered = await self._upload(conn)
        except DilocoError as e:
            conn.reply_error(status_of(e), details_of(e))
        except _PeerGone as e:
            conn.reply_error(grpc.StatusCode.UNAVAILABLE, str(e))
            return
        except Exception as e:
            log.exception("bulk.handler_failed", peer=conn.peer)
            conn.reply_error(grpc.StatusCode.INTERNAL, clip_details(f"the bulk server failed: {type(e).__name__}: {e}"))
        else:
            if not answered:
                return
        await conn.linger(min(LINGER_S, self.idle_timeout_s))

    async def _read_exact(self, conn: _Conn, n: int, deadline: float) -> bytes:
        data, why = await conn.read_exact(n, self.idle_timeout_s, deadline)
        if why is None:
            return data
        got = len(data)
        if why in (_Stop.IDLE, _Stop.DEADLINE):
            raise _PeerGone(f"the preamble did not arrive within {self.idle_timeout_s:g} s")
        if why is _Stop.FAILED and conn.error:
            raise _PeerGone(f"connection failed: {conn.error}")
        raise _PeerGone(f"the stream ended inside the preamble ({got} of {n} bytes of a field)")

    async def _upload(self, conn: _Conn) -> bool:
        """Read the preamble, open the upload, receive its payload and answer. Returns False when the client left
        before the end (nothing to linger for)."""
        assert self._loop is not None
        deadline = self._loop.time() + self.idle_timeout_s
        magic = await self._read_exact(conn, len(MAGIC), deadline)
        if magic != MAGIC:
            raise InvalidArgument(
                f"not a diloco bulk upload (magic {magic!r}, expected {MAGIC!r}); upload over gRPC or update the client"
            )
        (n,) = _U32.unpack(await self._read_exact(conn, _U32.size, deadline))
        if n > MAX_TOKEN_BYTES:
            raise ResourceExhausted(f"token of {n} bytes exceeds the limit of {MAX_TOKEN_BYTES} bytes")
        token = await self._read_exact(conn, n, deadline)
        (n,) = _U32.unpack(await self._read_exact(conn, _U32.size, deadline))
        if n > MAX_HEADER_BYTES:
            raise ResourceExhausted(f"request of {n} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes")
        try:
            request = Request.FromString(await self._read_exact(conn, n, deadline))
        except DecodeError:
            raise InvalidArgument("the request is not a serialized SubmitPseudoGradientRequest") from None
        if request.WhichOneof("kind") != "header":
            raise InvalidArgument("the request must carry the upload's header (SubmissionHeader), not data")
        if self._state is not _State.SERVING:
            raise _PeerGone("the bulk server is stopping; upload again (over gRPC: the bulk port may change)")
        opened = await self._call(self.handler.open, token, request, conn.identity)
        if isinstance(opened, Response):
            conn.reply(STATUS_OK, opened.SerializeToString())
            return True
        sink = opened
        ended = False  # `_end` ran: it called `close`
        try:
            expected = sink.expected_bytes
            if expected < 0:
                raise InvalidArgument(f"the upload expects a negative byte count ({expected})")
            got, why, box = await self._receive(conn, sink, expected)
            ended = True
            response = await self._call(_end, sink, box, got >= expected)
        finally:
            if not ended:
                await self._call(sink.close)
        if response is None:
            log.info("bulk.interrupted", peer=conn.peer, received_bytes=got, expected_bytes=expected, reason=why)
            conn.reply_error(
                grpc.StatusCode.UNAVAILABLE,
                f"payload ended after {got} of {expected} bytes ({why}); resume from the offset GetUploadStatus "
                "reports",
            )
            return False
        conn.reply(STATUS_OK, response.SerializeToString())
        return True

    def _why(self, conn: _Conn, stop: _Stop) -> str:
        if self._state is not _State.SERVING and stop in (_Stop.EOF, _Stop.FAILED):
            return "stopping"
        if stop is _Stop.EOF:
            return "the client closed the connection"
        if stop is _Stop.FAILED:
            return f"connection failed: {conn.error or 'aborted'}"
        return f"no data for {self.idle_timeout_s:g} s"

    async def _receive(self, conn: _Conn, sink: BulkSink, expected: int) -> tuple[int, str, list[memoryview]]:
        """Receive `expected` bytes, `buffer_bytes` at a time, and feed them in order, one `feed` at a time; with
        `overlap`, the next piece arrives while the previous one is fed. The pieces are received straight into the
        sink's `storage` when it has one, else into two reused buffers. Returns (bytes received, why it stopped
        early or "", the last piece received, in a list that `_end` empties): that piece is not fed yet; `_end`
        feeds it in the same handler call as `finish` or `interrupted` (a payload of one buffer costs two handler
        calls in all with `open`, three with `storage`)."""
        size = min(self.buffer_bytes, max(expected, 1))
        overlap = self.overlap and expected > size
        storage = await self._call(sink.storage) if expected else None
        if storage is not None and len(storage) < expected:
            storage = None
        buffers = [] if storage is not None else [memoryview(bytearray(size)) for _ in range(2 if overlap else 1)]
        feeding: asyncio.Future[None] | None = None
        got, turn = 0, 0
        try:
            while True:
                view = storage[got:] if storage is not None else buffers[turn % len(buffers)]
                turn += 1
                k, stop = await conn.fill(view[: min(size, expected - got)], self.idle_timeout_s)
                if feeding is not None:  # the other buffer's feed: its errors end the upload here
                    done, feeding = feeding, None
                    await done
                got += k
                if stop is not None or got >= expected:
                    return got, "" if stop is None else self._why(conn, stop), [view[:k]]
                feeding = self._submit(sink.feed, view[:k])
                if not overlap:
                    done, feeding = feeding, None
                    await done
        finally:
            if feeding is not None:  # leaving on an error: the feed in flight ends before `close` is called
                await asyncio.wait([feeding])


# --- the client ---------------------------------------------------------------------------------------------------


def _split_address(address: str) -> tuple[str, int]:
    a = address.strip()
    if a.startswith("["):
        host, _, rest = a[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = a.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"bulk address {address!r}: use HOST:PORT or [V6]:PORT")
    return host, int(port)


def _poll_answer(sock: socket.socket) -> bytes | None:
    """Bytes of an answer that arrived while sending (b"": the server closed), or None when there is none."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return sock.recv(sock.pending())
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return None
    sock.setblocking(False)
    try:
        return sock.recv(MAX_REPLY_BYTES)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
        return None  # TLS housekeeping (e.g. a session ticket), no data
    finally:
        sock.setblocking(True)


class _Waits:
    """How long one blocking socket call may wait: until `deadline` (monotonic; past it, TimeoutError(`late`)),
    `stall_s` after the last byte moved, and `ABANDON_POLL_S` at a time, between which `abandon()` is asked (True:
    give up now, ConnectionError)."""

    def __init__(self, deadline: float, late: str, stall_s: float, abandon: Callable[[], bool]) -> None:
        self.deadline, self.late, self.stall_s, self.abandon = deadline, late, stall_s, abandon
        self.moved_at = time.monotonic()

    def left(self) -> float:
        s = self.deadline - time.monotonic()
        if s <= 0:
            raise TimeoutError(self.late)
        return s

    def timeout(self) -> float:
        idle = time.monotonic() - self.moved_at
        if idle >= self.stall_s:
            raise TimeoutError(f"not a byte moved for {self.stall_s:g} s")
        if self.abandon():
            raise ConnectionError("the upload was abandoned: the learner moved to another coordinator")
        return min(self.left(), self.stall_s - idle, ABANDON_POLL_S)

    def moved(self) -> None:
        self.moved_at = time.monotonic()


def _connect(host: str, port: int, waits: _Waits) -> socket.socket:
    """A TCP connection to host:port in which every wait is `waits`' (a poll at a time, up to the stall; abandoned
    at once): the name lookup runs on a daemon thread (a cut-off host's name can take tens of seconds to fail), the
    connect is non-blocking (a host that drops the SYN is never answered)."""
    found: list[list[Any] | OSError] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as e:  # UnicodeError for a malformed name, say
            found.append(e if isinstance(e, OSError) else OSError(f"{type(e).__name__}: {e}"))

    looking = threading.Thread(target=lookup, name="bulk-lookup", daemon=True)
    looking.start()
    while not found:  # left running when given up on: the lookup ends on its own
        looking.join(waits.timeout())
    if isinstance(found[0], OSError):
        raise found[0]
    failed: OSError = OSError(f"{host} resolves to no address")
    for family, kind, proto, _, addr in found[0]:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            err = sock.connect_ex(addr)
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            while err in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
                if poller.poll(waits.timeout() * 1000):
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except BaseException:
            sock.close()
            raise
        if err == 0:
            sock.setblocking(True)
            waits.moved()
            return sock
        sock.close()
        failed = OSError(err, os.strerror(err))
    raise failed


def _handshake(sock: ssl.SSLSocket, waits: _Waits) -> ssl.SSLSocket:
    """`sock`'s TLS handshake, waited on a poll at a time (a server that accepted and froze never answers it)."""
    while True:
        sock.settimeout(waits.timeout())
        try:
            sock.do_handshake()
        except TimeoutError:
            continue  # the handshake resumes where it stopped; the next `timeout()` decides
        waits.moved()
        return sock


def _send_piece(sock: socket.socket, piece: memoryview, waits: _Waits) -> None:
    """`sendall` that times out only when no byte went out for the stall time (or the upload's deadline passed, or
    it is abandoned): a slow link makes progress, a frozen server does not."""
    sent = 0
    while sent < len(piece):
        sock.settimeout(waits.timeout())
        try:
            sent += sock.send(piece[sent:])
        except TimeoutError:
            continue  # the next `timeout()` decides: stalled, abandoned, or wait on
        waits.moved()


def _read_answer(sock: socket.socket, head: bytes, waits: _Waits) -> Response:
    buf = bytearray(head)

    def need(n: int) -> None:
        while len(buf) < n:
            sock.settimeout(waits.timeout())
            try:
                data = sock.recv(max(n - len(buf), 1 << 12))
            except TimeoutError:
                continue
            if not data:
                raise ConnectionError("the bulk server closed the connection without an answer")
            buf.extend(data)
            waits.moved()

    need(_REPLY.size)
    status, n = _REPLY.unpack_from(buf)
    if n > MAX_REPLY_BYTES:
        raise ConnectionError(f"the bulk server sent a {n}-byte answer (limit {MAX_REPLY_BYTES}); not a bulk server?")
    need(_REPLY.size + n)
    body = bytes(buf[_REPLY.size : _REPLY.size + n])
    if status != STATUS_OK:
        raise BulkError(_CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode("utf-8", "replace"))
    try:
        return Response.FromString(body)
    except DecodeError:
        raise ConnectionError("the bulk server's answer is not a SubmitPseudoGradientResponse") from None


def bulk_upload(
    address: str,
    token: bytes,
    request: Request,
    payload: bytes | bytearray | memoryview,
    *,
    timeout_s: float,
    stall_s: float = STALL_S,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    abandon: Callable[[], bool] = lambda: False,
) -> Response:
    """Upload `payload` (already sliced from `request.header.resume_offset`) to the bulk server at `address`
    (HOST:PORT) within `timeout_s` in all, and with no `stall_s` during which not a byte moved (a server frozen or
    cut off: its kernel may keep the connection open). `abandon`, asked every `ABANDON_POLL_S` while the socket
    waits: True gives up at once (a learner that moved to a new leader stops waiting on one cut off). Raises
    `BulkError`: the server's status for an error frame, UNAVAILABLE when the connection fails, resets, stalls, times
    out or is abandoned (then ask GetUploadStatus and resume)."""
    if request.WhichOneof("kind") != "header":
        raise InvalidArgument("a bulk upload's request must carry the header (SubmissionHeader)")
    encoded = request.SerializeToString()
    if len(token) > MAX_TOKEN_BYTES or len(encoded) > MAX_HEADER_BYTES:
        raise InvalidArgument(
            f"token ({len(token)} bytes) or header ({len(encoded)} bytes) too large for the bulk protocol "
            f"(limits {MAX_TOKEN_BYTES} and {MAX_HEADER_BYTES})"
        )
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    waits = _Waits(deadline, f"bulk upload did not finish within {timeout_s:g} s", stall_s, abandon)
    try:
        raw = _connect(host, port, waits)
    except OSError as e:
        raise BulkError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to the bulk server at {address}: {e}") from e
    sock = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent_error: OSError | None = None
        head: bytes = b""
        try:
            if ssl_context is not None:
                sock = _handshake(
                    ssl_context.wrap_socket(
                        raw, server_hostname=server_hostname or host, do_handshake_on_connect=False
                    ),
                    waits,
                )
            _send_piece(
                sock, memoryview(MAGIC + _U32.pack(len(token)) + token + _U32.pack(len(encoded)) + encoded), waits
            )
            pos = 0
            while pos < len(view):
                early = _poll_answer(sock)
                if early is not None:
                    head = early
                    break
                _send_piece(sock, view[pos : pos + SEND_PIECE_BYTES], waits)
                pos += SEND_PIECE_BYTES
        except OSError as e:  # includes timeouts, resets and TLS failures: the server may have answered first
            sent_error = e
        try:
            answer_deadline = deadline if sent_error is None else min(deadline, time.monotonic() + 1.0)
            answer = _Waits(answer_deadline, "no answer from the bulk server in time", stall_s, abandon)
            return _read_answer(sock, head, answer)
        except (OSError, ValueError) as e:
            cause = sent_error or e
            raise BulkError(
                grpc.StatusCode.UNAVAILABLE, f"bulk upload to {address} failed: {type(cause).__name__}: {cause}"
            ) from cause
    finally:
        sock.close()
        raw.close()


# --- TLS ----------------------------------------------------------------------------------------------------------


def server_ssl_context(ca: str | Path, cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """A server context that presents `cert`/`key` and requires a client certificate signed by `ca`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    ctx.num_tickets = 0  # one upload per connection: nothing to resume, and no stray bytes after the handshake
    return ctx


def client_ssl_context(ca: str | Path, cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """A client context that verifies the server (certificate and host name) against `ca` and presents
    `cert`/`key`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def server_ssl_context_from_dir(tls_dir: str | Path, name: str) -> ssl.SSLContext:
    """`server_ssl_context` from a TLS folder (`diloco certs`): ca.pem, <name>.pem, <name>.key."""
    f = TlsFiles.from_dir(tls_dir, name)
    return server_ssl_context(f.ca, f.cert, f.key)


def client_ssl_context_from_dir(tls_dir: str | Path, name: str) -> ssl.SSLContext:
    f = TlsFiles.from_dir(tls_dir, name)
    return client_ssl_context(f.ca, f.cert, f.key)
