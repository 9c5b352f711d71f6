"""Prometheus metrics over HTTP. Each service owns a registry, so several services can share a process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


@dataclass(frozen=True)
class ServedMetrics:
    """A registry someone already serves on `port` (`serve_metrics`): a service given one registers its metrics there
    and binds no port of its own (a coordinator replica serves one port from its start, through its promotion)."""

    registry: CollectorRegistry
    port: int


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """Serve `registry` on http://host:port/metrics (port 0: a free port). Returns (server, bound port);
    call `server.shutdown()` to stop. A negative port disables metrics and returns (None, -1)."""
    if port < 0:
        return None, -1
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_port)
