"""healthd's Prometheus metrics, in a registry of its own (several services may share a process in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from diloco.core.failure import NodeState

DETECTION_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 30.0, 60.0)
STALL_BUCKETS = (1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class HealthdMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.nodes = Gauge("diloco_healthd_nodes", "Known nodes by state", ["state"], registry=r)
        for state in NodeState:
            self.nodes.labels(state=state.value).set(0)
        self.heartbeats = Counter("diloco_healthd_heartbeats", "Heartbeats received", registry=r)
        self.deaths = Counter("diloco_healthd_deaths", "Nodes declared dead", registry=r)
        self.detection_seconds = Histogram(
            "diloco_healthd_detection_seconds",
            "Silence of a node when it was declared dead",
            buckets=DETECTION_BUCKETS,
            registry=r,
        )
        self.stall_seconds = Histogram(
            "diloco_healthd_stall_seconds",
            "Stalls of healthd itself (its process or host did not run): each one's length",
            buckets=STALL_BUCKETS,
            registry=r,
        )
        self.reports = Counter("diloco_healthd_reports", "Dead workers reported to the coordinator", registry=r)
        self.report_failures = Counter(
            "diloco_healthd_report_failures",
            "Failed attempts (each after its retries) to report a dead worker to the coordinator",
            registry=r,
        )
        self.throughput_forwarded = Counter(
            "diloco_healthd_throughput_forwarded", "Throughput reports forwarded to the coordinator", registry=r
        )
        self.throughput_dropped = Counter(
            "diloco_healthd_throughput_dropped", "Throughput reports dropped (coordinator unreachable)", registry=r
        )

    def set_counts(self, counts: dict[NodeState, int]) -> None:
        for state, n in counts.items():
            self.nodes.labels(state=state.value).set(n)
