"""Bulk data plane: pseudo-gradient payloads over a plain TCP (or TLS) byte stream, beside gRPC (the control
plane). Python gRPC copies every payload byte about three times; here the receiver `recv_into`s reused buffers and
hands memoryviews of them to the upload state machine, while the next buffer fills (double buffering: decoding in
torch and zlib releases the GIL). The upload itself (open, feed, finish, interrupted, resumable by byte offset,
idempotent by submission id) is the coordinator's one upload protocol (`diloco.core.uploads`), shared with the
gRPC path; only the framing is new.

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
preamble (magic, token, request) must arrive within `idle_timeout_s` as a whole; at most `max_connections`
connections are served at once (one more gets a RESOURCE_EXHAUSTED frame and is closed); a bad magic gets an
INVALID_ARGUMENT frame. A connection that ends (or stalls) inside the payload calls `BulkSink.interrupted()`: the
bytes fed so far stay with the coordinator, and the client resumes from the offset `GetUploadStatus` reports.

Errors reach the client as `BulkError`, a `grpc.RpcError` with `code()` and `details()`, so the retry policy
(`diloco.rpc.retry`) and the worker's handling treat it as it treats a gRPC error: a connection that fails, resets
or times out is UNAVAILABLE (retryable).

TLS: `server_ssl_context` requires a client certificate signed by the CA (mutual TLS, as the gRPC side does);
`client_ssl_context` verifies the server against the CA and presents the client's certificate. The files follow
`diloco.rpc.tls` (`ca.pem`, `<name>.pem`, `<name>.key` in a TLS folder).

Throughput against raw loopback TCP: `python -m diloco.bench.bench_bulk`.
"""

from __future__ import annotations

import contextlib
import math
import queue
import select
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf.message import DecodeError

from diloco.errors import ConfigError, DilocoError, InvalidArgument, ResourceExhausted
from diloco.rpc.retry import StatusError
from diloco.rpc.status import status_of
from diloco.rpc.tls import TlsFiles
from diloco.v1 import coordinator_pb2

MAGIC = b"DLB1"
MAX_TOKEN_BYTES = 4 << 10
MAX_HEADER_BYTES = 64 << 10
MAX_REPLY_BYTES = 64 << 10
STATUS_OK = 0
BUFFER_BYTES = 4 << 20  # one receive buffer; the server keeps `BUFFERS` of them per connection
BUFFERS = 2
SEND_PIECE_BYTES = 4 << 20  # the client looks for an early answer between pieces
LINGER_S = 2.0
STOP_JOIN_S = 30.0  # how long `stop` waits for connection threads once their sockets are shut down

Request = coordinator_pb2.SubmitPseudoGradientRequest
Response = coordinator_pb2.SubmitPseudoGradientResponse

_U32 = struct.Struct(">I")
_REPLY = struct.Struct(">BI")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
log = structlog.get_logger()


# --- errors -------------------------------------------------------------------------------------------------------


class BulkError(StatusError):
    """A failed bulk upload, shaped like a `grpc.RpcError`: `code()` is the status, `details()` the message."""


class _PeerGone(Exception):
    """The connection ended or stalled while the server was reading."""


# --- the server's interface to the upload state machine ----------------------------------------------------------


class BulkSink(Protocol):
    """One upload being received. The server calls `feed` with the payload bytes in order (a view into a buffer it
    reuses: copy what must outlive the call), then exactly one of `finish` (all `expected_bytes` arrived),
    `interrupted` (the connection ended or stalled first; the bytes fed stay for a resume) or nothing (a `feed`
    raised), and at last `close`, whatever happened. Errors are `DilocoError`s; they become error frames."""

    @property
    def expected_bytes(self) -> int: ...

    def feed(self, data: memoryview) -> None: ...

    def finish(self) -> Response: ...

    def interrupted(self) -> None: ...

    def close(self) -> None: ...


class BulkHandler(Protocol):
    """Checks the token and the header before any payload byte is read: returns the sink to feed, or a response to
    answer at once (a duplicate of a submission already accepted). Raises `DilocoError`s."""

    def open(self, token: bytes, request: Request, identity: str | None) -> BulkSink | Response:
        """`identity`: the common name of the client's verified certificate; None without TLS."""
        ...


# --- the server ---------------------------------------------------------------------------------------------------


def peer_identity(sock: socket.socket) -> str | None:
    """The common name of the certificate the client presented (the handshake verified it against the CA; ''
    when it names none); None on a plaintext connection."""
    if not isinstance(sock, ssl.SSLSocket):
        return None
    cert: dict[str, Any] = dict(sock.getpeercert() or {})
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def _recv_exact(sock: socket.socket, n: int, deadline: float, idle_timeout_s: float) -> bytes:
    """`n` bytes, waiting at most `idle_timeout_s` per read and until `deadline` in all."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _PeerGone(f"the preamble did not arrive within {idle_timeout_s:g} s")
        sock.settimeout(min(left, idle_timeout_s))
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise _PeerGone(f"the preamble did not arrive within {idle_timeout_s:g} s") from None
        except OSError as e:
            raise _PeerGone(f"connection failed: {e}") from None
        if k == 0:
            raise _PeerGone(f"the stream ended inside the preamble ({got} of {n} bytes of a field)")
        got += k
    return bytes(buf)


def _send_reply(sock: socket.socket, status: int, body: bytes) -> None:
    """Best effort: the peer may be gone already."""
    body = body[:MAX_REPLY_BYTES]
    try:
        sock.settimeout(LINGER_S)
        sock.sendall(_REPLY.pack(status, len(body)) + body)
    except (OSError, ValueError):
        pass


def _send_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
    _send_reply(sock, code.value[0], message.encode("utf-8", "replace"))


def _linger(sock: socket.socket, seconds: float) -> None:
    """Read and discard what the client still sends until it closes (at most `seconds`), so that closing with
    unread data (a TCP reset) does not destroy the answer before the client reads it."""
    scratch = bytearray(1 << 16)
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv_into(scratch) == 0:
                return
    except (OSError, ValueError):
        pass


@dataclass
class _Conn:
    sock: socket.socket
    thread: threading.Thread


class BulkServer:
    """Accepts bulk uploads on `host:port` (0: a free port) and feeds them to `handler`: an accept thread and a
    thread per connection (with a second one feeding the sink while the next buffer is received, when `overlap`).
    `start()` and `stop()` are idempotent; `stop` gives running uploads `grace_s`, then cuts them (they are
    interrupted, hence resumable) and joins every thread."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: BulkHandler,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 16,
        idle_timeout_s: float = 30.0,
        buffer_bytes: int = BUFFER_BYTES,
        overlap: bool = True,
    ) -> None:
        if max_connections < 1:
            raise ConfigError(f"bulk max_connections must be >= 1, got {max_connections}")
        if not idle_timeout_s > 0 or not math.isfinite(idle_timeout_s):
            raise ConfigError(f"bulk idle_timeout_s must be a positive number of seconds, got {idle_timeout_s}")
        if buffer_bytes < 4096:
            raise ConfigError(f"bulk buffer_bytes must be >= 4096, got {buffer_bytes}")
        if not 0 <= port <= 65535:
            raise ConfigError(f"bulk port must be in 0..65535, got {port}")
        self.host = host
        self.handler = handler
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.buffer_bytes = buffer_bytes
        self.overlap = overlap
        self._requested_port = port
        self._port = 0
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._cv = threading.Condition()
        self._conns: dict[int, _Conn] = {}
        self._refusing = 0
        self._next_id = 0
        self._stopping = threading.Event()
        self._stopped = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def active_connections(self) -> int:
        with self._cv:
            return len(self._conns)

    def start(self) -> int:
        """Listen and accept (a second call does nothing). Returns the port."""
        with self._cv:
            if self._stopped:
                raise RuntimeError("this BulkServer was stopped; make a new one")
            if self._listener is not None:
                return self._port
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.create_server((self.host, self._requested_port), family=family, backlog=128)
            listener.settimeout(0.5)  # the accept loop notices `stop` within this, even where close does not wake it
            self._listener = listener
            self._port = listener.getsockname()[1]
            self._accept_thread = threading.Thread(target=self._accept_loop, name="bulk-accept", daemon=True)
            self._accept_thread.start()
            log.info("bulk.listening", host=self.host, port=self._port, tls=self.ssl_context is not None)
            return self._port

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop accepting, wait up to `grace_s` for running uploads, cut the rest, join every thread."""
        with self._cv:
            if self._stopped:
                return
            self._stopped = True
            listener, accept_thread = self._listener, self._accept_thread
        self._stopping.set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept on Linux
            listener.close()
        if accept_thread is not None:
            accept_thread.join()
        deadline = time.monotonic() + grace_s
        with self._cv:
            while self._conns and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            conns = list(self._conns.values())
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        join_deadline = time.monotonic() + STOP_JOIN_S
        for c in conns:
            c.thread.join(max(0.0, join_deadline - time.monotonic()))
        with self._cv:
            while self._refusing and (left := join_deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            stuck = [c.thread.name for c in self._conns.values()] + ["bulk-refuse"] * self._refusing
        if stuck:  # a handler blocked in its own code; the threads are daemons
            log.warning("bulk.stop_timeout", threads=stuck)

    # --- accepting ---------------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue  # e.g. EMFILE, ECONNABORTED: keep serving
            try:
                self._dispatch(sock, peer)
            except Exception as e:  # e.g. the peer reset already, or no thread could start: drop this one only
                log.warning("bulk.accept_failed", peer=str(peer), error=str(e))
                sock.close()

    def _dispatch(self, sock: socket.socket, peer: object) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cv:
            if len(self._conns) >= self.max_connections:
                if self._refusing >= self.max_connections:
                    sock.close()  # flooded: not even a frame
                    return
                conn_id = -1
                target, name = self._refuse, "bulk-refuse"
            else:
                conn_id = self._next_id
                self._next_id += 1
                target, name = self._serve, f"bulk-conn-{conn_id}"
            t = threading.Thread(target=target, args=(conn_id, sock, peer), name=name, daemon=True)
            t.start()
            if conn_id >= 0:
                self._conns[conn_id] = _Conn(sock, t)
            else:
                self._refusing += 1

    def _wrap(self, sock: socket.socket) -> socket.socket:
        sock.settimeout(self.idle_timeout_s)
        if self.ssl_context is None:
            return sock
        return self.ssl_context.wrap_socket(sock, server_side=True)  # the handshake, bounded by the timeout

    def _refuse(self, conn_id: int, raw: socket.socket, peer: object) -> None:
        sock = raw
        try:
            sock = self._wrap(raw)
            log.warning("bulk.refused", peer=str(peer), max_connections=self.max_connections)
            _send_error(
                sock,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the bulk server serves at most {self.max_connections} uploads at once; retry later or upload "
                "over gRPC",
            )
            _linger(sock, min(LINGER_S, self.idle_timeout_s))
        except (OSError, ValueError):
            pass
        finally:
            sock.close()
            raw.close()
            with self._cv:
                self._refusing -= 1
                self._cv.notify_all()

    def _serve(self, conn_id: int, raw: socket.socket, peer: object) -> None:
        sock = raw
        try:
            sock = self._wrap(raw)
            if self._stopping.is_set():
                return
            self._handle(sock, str(peer))
        except (OSError, ValueError) as e:  # TLS handshake refused, reset, ...
            log.info("bulk.connection_failed", peer=str(peer), error=str(e))
        finally:
            sock.close()
            raw.close()
            with self._cv:
                self._conns.pop(conn_id, None)
                self._cv.notify_all()

    # --- one upload ----------------------------------------------------------------------------------------------
    def _handle(self, sock: socket.socket, peer: str) -> None:
        try:
            answered = self._upload(sock, peer)
        except DilocoError as e:
            _send_error(sock, status_of(e), str(e))
        except _PeerGone as e:
            _send_error(sock, grpc.StatusCode.UNAVAILABLE, str(e))
            return
        except Exception as e:
            log.exception("bulk.handler_failed", peer=peer)
            _send_error(sock, grpc.StatusCode.INTERNAL, f"the bulk server failed: {type(e).__name__}: {e}")
        else:
            if not answered:
                return
        _linger(sock, min(LINGER_S, self.idle_timeout_s))

    def _upload(self, sock: socket.socket, peer: str) -> bool:
        """Read the preamble, open the upload, receive its payload and answer. Returns False when the client left
        before the end (nothing to linger for)."""
        deadline = time.monotonic() + self.idle_timeout_s

        def recv(n: int) -> bytes:
            return _recv_exact(sock, n, deadline, self.idle_timeout_s)

        magic = recv(len(MAGIC))
        if magic != MAGIC:
            raise InvalidArgument(
                f"not a diloco bulk upload (magic {magic!r}, expected {MAGIC!r}); upload over gRPC or update the client"
            )
        (n,) = _U32.unpack(recv(_U32.size))
        if n > MAX_TOKEN_BYTES:
            raise ResourceExhausted(f"token of {n} bytes exceeds the limit of {MAX_TOKEN_BYTES} bytes")
        token = recv(n)
        (n,) = _U32.unpack(recv(_U32.size))
        if n > MAX_HEADER_BYTES:
            raise ResourceExhausted(f"request of {n} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes")
        try:
            request = Request.FromString(recv(n))
        except DecodeError:
            raise InvalidArgument("the request is not a serialized SubmitPseudoGradientRequest") from None
        if request.WhichOneof("kind") != "header":
            raise InvalidArgument("the request must carry the upload's header (SubmissionHeader), not data")
        opened = self.handler.open(token, request, peer_identity(sock))
        if isinstance(opened, Response):
            _send_reply(sock, STATUS_OK, opened.SerializeToString())
            return True
        sink = opened
        try:
            expected = sink.expected_bytes
            if expected < 0:
                raise InvalidArgument(f"the upload expects a negative byte count ({expected})")
            got, why = self._receive(sock, sink, expected)
            if got < expected:
                sink.interrupted()
                log.info("bulk.interrupted", peer=peer, received_bytes=got, expected_bytes=expected, reason=why)
                _send_error(
                    sock,
                    grpc.StatusCode.UNAVAILABLE,
                    f"payload ended after {got} of {expected} bytes ({why}); resume from the offset GetUploadStatus "
                    "reports",
                )
                return False
            response = sink.finish()
        finally:
            sink.close()
        _send_reply(sock, STATUS_OK, response.SerializeToString())
        return True

    def _fill(self, sock: socket.socket, view: memoryview) -> tuple[int, str]:
        """Receive into `view` until it is full, the peer ends, stalls or the server stops. Returns (bytes, why it
        stopped early or "")."""
        got = 0
        try:
            while got < len(view):
                k = sock.recv_into(view[got:])
                if k == 0:
                    return got, "stopping" if self._stopping.is_set() else "the client closed the connection"
                got += k
        except TimeoutError:
            return got, f"no data for {self.idle_timeout_s:g} s"
        except (OSError, ValueError) as e:
            return got, "stopping" if self._stopping.is_set() else f"connection failed: {e}"
        return got, ""

    def _receive(self, sock: socket.socket, sink: BulkSink, expected: int) -> tuple[int, str]:
        """Receive `expected` bytes into reused buffers and feed them. Returns (bytes fed, why it stopped early)."""
        sock.settimeout(self.idle_timeout_s)
        size = min(self.buffer_bytes, max(expected, 1))
        if not self.overlap or expected <= size:
            return self._receive_serial(sock, sink, expected, size)
        return self._receive_overlapped(sock, sink, expected, size)

    def _receive_serial(self, sock: socket.socket, sink: BulkSink, expected: int, size: int) -> tuple[int, str]:
        view = memoryview(bytearray(size))
        got = 0
        while got < expected:
            k, why = self._fill(sock, view[: min(size, expected - got)])
            if k:
                sink.feed(view[:k])
                got += k
            if why:
                return got, why
        return got, ""

    def _receive_overlapped(self, sock: socket.socket, sink: BulkSink, expected: int, size: int) -> tuple[int, str]:
        free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        full: queue.SimpleQueue[tuple[memoryview, int] | None] = queue.SimpleQueue()
        for _ in range(BUFFERS):
            free.put(memoryview(bytearray(size)))
        failure: list[BaseException] = []

        def feeder() -> None:
            while (item := full.get()) is not None:
                view, k = item
                if not failure:
                    try:
                        sink.feed(view[:k])
                    except BaseException as e:  # re-raised by the receiving thread
                        failure.append(e)
                free.put(view)

        t = threading.Thread(target=feeder, name="bulk-feed", daemon=True)
        t.start()
        got, why = 0, ""
        try:
            while got < expected and not failure:
                view = free.get()
                k, why = self._fill(sock, view[: min(size, expected - got)])
                full.put((view, k))
                got += k
                if why:
                    break
        finally:
            full.put(None)
            t.join()
        if failure:
            raise failure[0]
        return got, why


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


def _read_answer(sock: socket.socket, head: bytes, deadline: float) -> Response:
    buf = bytearray(head)

    def need(n: int) -> None:
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the bulk server in time")
            sock.settimeout(left)
            data = sock.recv(max(n - len(buf), 1 << 12))
            if not data:
                raise ConnectionError("the bulk server closed the connection without an answer")
            buf.extend(data)

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
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> Response:
    """Upload `payload` (already sliced from `request.header.resume_offset`) to the bulk server at `address`
    (HOST:PORT) within `timeout_s` in all. Raises `BulkError`: the server's status for an error frame,
    UNAVAILABLE when the connection fails, resets or times out (then ask GetUploadStatus and resume)."""
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

    def left() -> float:
        s = deadline - time.monotonic()
        if s <= 0:
            raise TimeoutError(f"bulk upload did not finish within {timeout_s:g} s")
        return s

    try:
        raw = socket.create_connection((host, port), timeout=left())
    except OSError as e:
        raise BulkError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to the bulk server at {address}: {e}") from e
    sock = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent_error: OSError | None = None
        head: bytes = b""
        try:
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(raw, server_hostname=server_hostname or host)
            sock.settimeout(left())
            sock.sendall(MAGIC + _U32.pack(len(token)) + token + _U32.pack(len(encoded)) + encoded)
            pos = 0
            while pos < len(view):
                early = _poll_answer(sock)
                if early is not None:
                    head = early
                    break
                sock.settimeout(left())
                sock.sendall(view[pos : pos + SEND_PIECE_BYTES])
                pos += SEND_PIECE_BYTES
        except OSError as e:  # includes timeouts, resets and TLS failures: the server may have answered first
            sent_error = e
        try:
            answer_deadline = deadline if sent_error is None else min(deadline, time.monotonic() + 1.0)
            return _read_answer(sock, head, answer_deadline)
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
