"""Server wiring shared by the services: a `grpc.aio` server on its own event loop, with health checking,
reflection and admission limits, bound to a port (0 picks a free one), with an idempotent start/stop; and the
client channel with the same options."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from diloco.rpc.admission import Admission, AdmissionInterceptor, AdmissionLimits
from diloco.rpc.auth import BearerTokenInterceptor
from diloco.rpc.status import ParseRequests

T = TypeVar("T")
MiB = 1 << 20
# Bulk payloads travel as ~1 MiB chunks; messages above this are refused by gRPC itself.
MAX_MESSAGE_BYTES = 8 * MiB
STOP_SLACK_S = 2.0  # how long `GrpcService.stop` waits for gRPC's shutdown beyond the grace period

# HTTP/2 frames default to 16 KiB: a 1 MiB chunk would be cut into 64 frames, each parsed on its own. Large
# frames let the transport move a chunk in fewer pieces.
_LARGE_FRAMES = [("grpc.http2.max_frame_size", (16 * MiB) - 1)]

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
    *_LARGE_FRAMES,
]


class GrpcService:
    """A running `grpc.aio` server on an event loop of its own (one thread): an open stream costs a coroutine, not
    a thread. `add` registers servicers (async ones run on the loop; sync ones in a small thread pool); `start()`
    binds and serves; `stop(grace)` drains. Both are safe to call more than once, from any thread but the loop's.

    Every call passes `admission` first (`diloco.rpc.admission`): beyond its limits, RESOURCE_EXHAUSTED with a
    retry hint. Health reports SERVING for every named service after start and NOT_SERVING as soon as stop begins,
    so load balancers and healthchecks see the drain.
    """

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Sequence[str],
        *,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),  # type: ignore[type-arg]
        admission: AdmissionLimits = AdmissionLimits(),
        sync_threads: int = 4,
    ) -> None:
        """`credentials`: serve TLS (`diloco.rpc.tls.server_credentials`), else plaintext; `interceptors`: e.g.
        the token check (`diloco.rpc.auth.TokenAuthInterceptor`), run before admission; `sync_threads`: the pool
        that runs sync servicer methods (the diloco services have none; benchmarks' sinks do)."""
        self.host = host
        self.requested_port = port
        self.service_names = list(service_names)
        self.credentials = credentials
        self.admission = Admission(admission)
        self._interceptors = [*interceptors, AdmissionInterceptor(self.admission), ParseRequests()]
        self._sync_threads = sync_threads
        self._registrations: list[Callable[[grpc.aio.Server], None]] = []
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self.port = 0
        self._lock = threading.Lock()
        self._started = False
        self._stopped = threading.Event()

    def add(self, register: Callable[[grpc.aio.Server], None]) -> None:
        """`register(server)` runs at `start`, on the loop (e.g. `add_FooServicer_to_server(servicer, server)`)."""
        self._registrations.append(register)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the server's loop from another thread and return its result."""
        if self.loop is None:
            raise RuntimeError("the server is not started")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> int:
        with self._lock:
            if self._started:
                return self.port
            loop = asyncio.new_event_loop()
            self.loop = loop
            self._thread = threading.Thread(
                target=loop.run_forever, name=f"grpc-{self.service_names[0] if self.service_names else 'server'}"
            )
            self._thread.daemon = True
            self._thread.start()
            try:
                self.port = self.run(self._start())
            except BaseException:
                self._close_loop()
                raise
            self._started = True
            return self.port

    async def _start(self) -> int:
        self._pool = futures.ThreadPoolExecutor(max_workers=self._sync_threads, thread_name_prefix="grpc-sync")
        server = grpc.aio.server(
            migration_thread_pool=self._pool, options=SERVER_OPTIONS, interceptors=self._interceptors
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection([*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        for register in self._registrations:
            register(server)
        target = f"{self.host}:{self.requested_port}"
        try:
            if self.credentials is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, self.credentials)
        except RuntimeError as e:  # grpc.aio raises where grpc.server returned 0
            raise OSError(f"cannot bind {target}; is the port in use? ({e})") from None
        if port == 0:
            raise OSError(f"cannot bind {target}; is the port in use?")
        await server.start()
        self._server = server
        await self._set_serving(True)
        return port

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    def set_serving(self, serving: bool) -> None:
        if self.loop is not None and not self._stopped.is_set():
            self.run(self._set_serving(serving), STOP_SLACK_S)

    def stop(self, grace_s: float = 5.0) -> None:
        with self._lock:
            if not self._started or self._stopped.is_set():
                self._stopped.set()
                return
            try:
                self.run(self._stop(grace_s), grace_s + STOP_SLACK_S)
            except (futures.TimeoutError, TimeoutError):
                pass  # every call is cancelled by now; only grpc's own bookkeeping is late
            finally:
                self._close_loop()
                self._stopped.set()

    async def _stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)

    def _close_loop(self) -> None:
        loop, thread = self.loop, self._thread
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(STOP_SLACK_S)
        if not loop.is_running():
            loop.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until `stop` has finished (or the timeout passes)."""
        return self._stopped.wait(timeout_s)


class LoopSignal:
    """Wakes coroutines on one event loop when something changes in another thread: `notify()` from any thread;
    `waiter()` on the loop, taken *before* reading the state it guards, then awaited."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def waiter(self) -> asyncio.Event:
        if self._event is None:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        return self._event

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        if event is not None:
            event.set()

    def notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(self._fire)


# The cyclic garbage collector's thresholds for a serving process (`tune_gc`): young collections every 50,000
# net allocations instead of 700 (each stays a few ms), so far fewer short-lived objects (a call's messages,
# futures) are caught alive and promoted, and full collections become rare.
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc() -> None:
    """Set up the garbage collector of a long-running service, once it has started: everything allocated so far
    (modules, the model, the task) is frozen out of future collections, and the thresholds are `GC_THRESHOLDS`.

    Why: a full collection stops every thread while it walks every tracked object; with a thousand learners that
    is a quarter of a million objects and 100-200 ms, every few seconds with the default thresholds, which showed
    as the p99 of every call (issue #11's load benchmark). Per process; tests leave their own process alone."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


MMAP_THRESHOLD_BYTES = 1 << 20  # blocks this large or larger get mappings of their own (`map_large_blocks`)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have the C library give every block of `threshold_bytes` or more a mapping of its own, unmapped when freed,
    before a service allocates its model-sized tensors. Returns False where the C library is not glibc (unchanged).

    Why: glibc's threshold moves up to the size of the largest mapped block freed so far (up to 32 MiB), so after
    the model built at start is freed (its layers are blocks of a few MiB), later blocks of up to that size come
    from the heap, and freed ones stay in the process's resident memory. At 100M parameters that was 0.2-0.4 GB
    more at the coordinator's peak, differing from run to run (issue #13 item 4's benchmark)."""
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # musl and others
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes))


class SendSlots:
    """Paces many streams' writes on one event loop: at most `slots` writes in progress at once, each holding its
    slot for at most `lease_s`.

    Without it, a new version wakes every parameter watch together and their writes fill the loop's ready queue;
    a control call (`GetStatus`) then waits behind all of them at each of its steps. With it, the queue holds at
    most `slots` writes, so control calls interleave, while a write the network holds up (a slow or stalled peer)
    gives its slot back after `lease_s` and cannot starve the others."""

    def __init__(self, slots: int, lease_s: float) -> None:
        if slots < 1 or not lease_s > 0:
            raise ValueError(f"slots must be >= 1 and lease_s > 0, got {slots} and {lease_s}")
        self.slots, self.lease_s = slots, lease_s
        self._sem: asyncio.Semaphore | None = None  # made on the loop, at first use

    async def turn(self) -> None:
        """Wait until a slot is free (and give it back at once): many coroutines woken together go on in
        order, a few at a time, instead of all in one turn of the loop."""
        async with self.slot():
            pass

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body (a write), or for `lease_s` when the body takes longer."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        sem = self._sem
        await sem.acquire()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                sem.release()

        lease = asyncio.get_running_loop().call_later(self.lease_s, release)
        try:
            yield
        finally:
            lease.cancel()
            release()


def channel(
    address: str,
    credentials: grpc.ChannelCredentials | None = None,
    token: str = "",
    server_name: str = "",
) -> grpc.Channel:
    """A client channel with the same message limits and keepalive as the servers.

    `credentials`: TLS (`diloco.rpc.tls.channel_credentials`), else plaintext; `token`: sent as
    `authorization: Bearer <token>` on every call; `server_name`: the name to check the server certificate
    against when it is not the host in `address` (grpc.ssl_target_name_override)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.enable_retries", 0),
        # reconnect quickly after a peer restarts (gRPC's default backoff grows to two minutes)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        *_LARGE_FRAMES,  # for what the channel receives (parameter streams), as the servers do for uploads
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if credentials is None:
        ch = grpc.insecure_channel(address, options=options)
    else:
        ch = grpc.secure_channel(address, credentials, options=options)
    if token:
        ch = grpc.intercept_channel(ch, BearerTokenInterceptor(token))
    return ch
