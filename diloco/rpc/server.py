"""Server wiring shared by the services: a grpc.Server with health checking and reflection, bound to a port
(0 picks a free one), with an idempotent start/stop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from diloco.rpc.auth import BearerTokenInterceptor

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
    """A running gRPC server: `add` registers servicers; `start()` binds and serves; `stop(grace)` drains.

    Both are safe to call more than once. Health reports SERVING for every named service after start and
    NOT_SERVING as soon as stop begins, so load balancers and healthchecks see the drain.
    """

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Sequence[str],
        max_workers: int = 32,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.ServerInterceptor[Any, Any]] = (),
    ) -> None:
        """`credentials`: serve TLS (`diloco.rpc.tls.server_credentials`), else plaintext; `interceptors`: e.g.
        the token check (`diloco.rpc.auth.TokenAuthInterceptor`)."""
        self.host = host
        self.requested_port = port
        self.service_names = list(service_names)
        self.credentials = credentials
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS, interceptors=list(interceptors)
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0
        self._lock = threading.Lock()
        self._started = False
        self._stopped = threading.Event()

    def add(self, register: Callable[[grpc.Server], None]) -> None:
        register(self.server)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        with self._lock:
            if self._started:
                return self.port
            target = f"{self.host}:{self.requested_port}"
            if self.credentials is None:
                self.port = self.server.add_insecure_port(target)
            else:
                self.port = self.server.add_secure_port(target, self.credentials)
            if self.port == 0:
                raise OSError(f"cannot bind {self.host}:{self.requested_port}; is the port in use?")
            self.server.start()
            self._started = True
            self.set_serving(True)
            return self.port

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace_s: float = 5.0) -> None:
        with self._lock:
            if not self._started or self._stopped.is_set():
                self._stopped.set()
                return
            self.set_serving(False)
            # Bounded: after a streaming request that fails to deserialize, grpcio (1.85) sometimes never sets
            # the shutdown event, which would hang every later drain (tests/test_fuzz_rpc.py found it). By then
            # every call has been cancelled; only that event is missing.
            self.server.stop(grace_s).wait(grace_s + STOP_SLACK_S)
            self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until `stop` has finished (or the timeout passes)."""
        return self._stopped.wait(timeout_s)


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
