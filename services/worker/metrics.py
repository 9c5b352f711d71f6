"""The worker's Prometheus metrics (served on `--metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("diloco_worker_steps", "Inner steps trained", registry=r)
        self.tokens = Counter("diloco_worker_tokens", "Tokens trained", registry=r)
        self.uploads = Counter("diloco_worker_uploads", "Pseudo-gradients uploaded", ["outcome"], registry=r)
        self.upload_bytes = Counter("diloco_worker_upload_bytes", "Bytes uploaded", registry=r)
        self.rebases = Counter("diloco_worker_rebases", "Rebases onto new global parameters", registry=r)
        self.resyncs = Counter("diloco_worker_resyncs", "Resyncs after a refused submission", registry=r)
        self.version = Gauge("diloco_worker_version", "Global version trained on", registry=r)
        self.seconds = Counter(
            "diloco_worker_seconds",
            "Time spent, by phase of the round (services.worker.worker.PHASES)",
            ["phase"],
            registry=r,
        )
        self.tokens_per_s = Gauge("diloco_worker_tokens_per_second", "Measured throughput", registry=r)
        self.power_windows_dropped = Counter(
            "diloco_worker_power_windows_dropped",
            "Power meter windows dropped (the counter unreadable, or a figure out of range); the last figure stayed",
            ["reason"],
            registry=r,
        )
