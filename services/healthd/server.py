"""healthd wiring and lifecycle: the gRPC server (health + reflection), the monitor and its ticker, the
coordinator reporter and the metrics endpoint. `start()` and `stop()` are safe to call more than once.

healthd keeps no durable state: a restarted healthd rebuilds its table from the next heartbeats (a fresh
detector treats them as joins), and training never waits for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from diloco import log as dlog
from diloco.core.failure import NodeView
from diloco.rpc.metrics import serve_metrics
from diloco.rpc.server import GrpcService
from diloco.v1 import healthd_pb2_grpc
from services.healthd.config import HealthdConfig
from services.healthd.metrics import HealthdMetrics
from services.healthd.monitor import Monitor
from services.healthd.reporter import CoordinatorReporter
from services.healthd.servicer import SERVICE_NAME, HealthDaemonServicer


class HealthdServer:
    def __init__(self, cfg: HealthdConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.log = dlog.get("healthd")
        self.metrics = HealthdMetrics()
        self.reporter: CoordinatorReporter | None = None
        if cfg.coordinator_address:
            self.reporter = CoordinatorReporter(
                cfg.coordinators,
                cfg.security,
                cfg.report_timeout_s,
                self.metrics,
                self.log,
                clock=clock,
                retry_pause_s=min(1.0, cfg.heartbeat_interval_s * 2),
            )
        self.monitor = Monitor(cfg.detector(), self.metrics, self.log, self.reporter, clock)
        self.grpc = GrpcService(
            cfg.host,
            cfg.port,
            [SERVICE_NAME],
            credentials=cfg.security.server_credentials(),
            interceptors=cfg.security.server_interceptors(),
            admission=cfg.admission(),
        )
        self.servicer = servicer = HealthDaemonServicer(
            self.monitor,
            max_heartbeats_per_s=cfg.heartbeat_rate_factor / cfg.heartbeat_interval_s,
            burst=cfg.heartbeat_burst,
            on_leader=self.reporter.leader_announced if self.reporter is not None else lambda address: None,
        )
        self.grpc.add(lambda server: healthd_pb2_grpc.add_HealthDaemonServicer_to_server(servicer, server))
        self.metrics_port = -1
        self._metrics_server: Any = None
        self._lock = threading.Lock()
        self._state = "new"  # new -> started -> stopped

    @property
    def registry(self) -> Any:
        return self.metrics.registry

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def address(self) -> str:
        return self.grpc.address

    def nodes(self) -> list[NodeView]:
        return self.monitor.nodes()

    def start(self) -> int:
        """Start serving; returns the bound gRPC port."""
        with self._lock:
            if self._state == "started":
                return self.grpc.port
            if self._state == "stopped":
                raise RuntimeError("healthd was stopped; create a new HealthdServer to serve again")
            if self.reporter is not None:
                self.reporter.start()
            self.monitor.start()
            try:
                port = self.grpc.start()
                cfg = self.cfg
                self._metrics_server, self.metrics_port = serve_metrics(self.registry, cfg.host, cfg.metrics_port)
            except BaseException:
                self._shutdown(grace_s=0.0)
                self._state = "stopped"
                raise
            self._state = "started"
            return port

    def stop(self, grace_s: float | None = None) -> None:
        """Drain: health NOT_SERVING, end event watchers, stop the server (in-flight calls get `grace_s`), then
        the ticker, the reporter and the metrics endpoint. Safe to call more than once."""
        with self._lock:
            if self._state == "stopped":
                return
            self._state = "stopped"
            self._shutdown(self.cfg.shutdown_grace_s if grace_s is None else grace_s)

    def _shutdown(self, grace_s: float) -> None:
        self.grpc.set_serving(False)
        self.monitor.close_watchers()
        self.grpc.stop(grace_s)
        self.monitor.stop()
        if self.reporter is not None:
            self.reporter.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the gRPC server has stopped (or the timeout passes)."""
        return self.grpc.wait(timeout_s)
