"""healthd configuration: flags with `DILOCO_*` environment fallbacks, read here and nowhere else.

Every flag `--some-name` falls back to the environment variable `DILOCO_SOME_NAME` (e.g. `--dead-after-s` and
`DILOCO_DEAD_AFTER_S`), then to the default below. A flag given on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diloco.core.failure import DetectorConfig
from diloco.core.leadership import coordinator_addresses
from diloco.errors import ConfigError, InvalidArgument
from diloco.flags import Flag, config_from_flags
from diloco.flags import build_parser as build_flag_parser
from diloco.rpc import security
from diloco.rpc.admission import AdmissionLimits
from diloco.rpc.security import SecurityConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class HealthdConfig:
    """Everything healthd needs; validated at construction (`ConfigError` names the field)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    metrics_port: int = -1  # -1: no metrics endpoint; 0: a free port
    # HOST:PORT to report dead workers and throughput to, or every replica's, comma-separated (healthd follows the
    # leader among them); "": track only
    coordinator_address: str = ""
    heartbeat_interval_s: float = 0.5
    suspect_after_missed: int = 2
    dead_after_s: float = 2.0
    forget_after_s: float = 3600.0  # dead/left nodes leave the table this long after their last heartbeat
    tick_interval_s: float = 0.25  # the detector's ticker runs at least this often while nodes are watched
    stall_after_s: float = 1.0  # a ticker gap above this is healthd's own stall: silence windows restart
    report_timeout_s: float = 2.0  # deadline of each call to the coordinator
    shutdown_grace_s: float = 2.0  # how long SIGTERM waits for in-flight calls
    # gRPC calls running at once: each heartbeat stream and each event watcher is one for its lifetime (a coroutine,
    # a few KB), so this bounds the nodes plus watchers; more get RESOURCE_EXHAUSTED with a retry hint.
    max_calls: int = 8192
    max_calls_per_client: int = 64  # the same for one connection
    # a stream sending more than heartbeat_rate_factor x the expected rate (after a burst) ends RESOURCE_EXHAUSTED
    heartbeat_rate_factor: float = 10.0
    heartbeat_burst: int = 20
    log_level: str = "info"
    security: SecurityConfig = field(default_factory=SecurityConfig)  # in-process default: plaintext, loopback

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host must be a non-empty address, got {self.host!r}")
        _int_in("port", self.port, 0, 65535)
        _int_in("metrics_port", self.metrics_port, -1, 65535)
        addr = self.coordinator_address
        try:
            if not isinstance(addr, str) or addr != addr.strip():
                raise InvalidArgument("expected HOST:PORT, comma-separated HOST:PORTs, or '' (no reporting)")
            self.coordinators  # noqa: B018 - parsed here to refuse a bad list at start
        except InvalidArgument as e:
            raise ConfigError(f"coordinator_address (--coordinator-address): {e}; got {addr!r:.80}") from None
        _positive("report_timeout_s", self.report_timeout_s)
        if not (isinstance(self.shutdown_grace_s, (int, float)) and math.isfinite(self.shutdown_grace_s)) or (
            self.shutdown_grace_s < 0
        ):
            raise ConfigError(f"shutdown_grace_s must be a finite number >= 0, got {self.shutdown_grace_s!r}")
        _int_in("max_calls", self.max_calls, 16, 1_000_000)
        _int_in("max_calls_per_client", self.max_calls_per_client, 4, self.max_calls)
        _positive("heartbeat_rate_factor", self.heartbeat_rate_factor)
        _int_in("heartbeat_burst", self.heartbeat_burst, 1, 100_000)
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: unknown value {self.log_level!r}; allowed: {', '.join(LOG_LEVELS)}")
        self.detector()  # the detector's own checks (dead_after_s above the suspect threshold, ...)
        self.security.check_server(self.host)  # last: field errors first, then TLS or loopback plaintext
        for address in self.coordinators:
            self.security.check_client(address)

    @property
    def coordinators(self) -> tuple[str, ...]:
        """The coordinator addresses to report to (every replica's under etcd leadership; none: track only)."""
        return coordinator_addresses(self.coordinator_address) if self.coordinator_address else ()

    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_calls, self.max_calls_per_client)

    def detector(self) -> DetectorConfig:
        """The pure failure detector's configuration."""
        return DetectorConfig(
            heartbeat_interval_s=self.heartbeat_interval_s,
            suspect_after_missed=self.suspect_after_missed,
            dead_after_s=self.dead_after_s,
            forget_after_s=self.forget_after_s,
            tick_interval_s=self.tick_interval_s,
            stall_after_s=self.stall_after_s,
        )


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _positive(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(f"{name} must be a finite number > 0 (seconds), got {value!r}")


# --- flags and environment ------------------------------------------------------------------------------------


_d = HealthdConfig()
_FLAGS: list[Flag] = [
    ("--host", str, _d.host, "address to bind"),
    ("--port", int, _d.port, "gRPC port (0: a free port)"),
    ("--metrics-port", int, _d.metrics_port, "Prometheus port (-1: disabled, 0: a free port)"),
    (
        "--coordinator-address",
        str,
        _d.coordinator_address,
        "HOST:PORT of the coordinator, or of each replica comma-separated (it follows the leader; '': do not report)",
    ),
    ("--heartbeat-interval-s", float, _d.heartbeat_interval_s, "expected time between heartbeats"),
    ("--suspect-after-missed", int, _d.suspect_after_missed, "missed heartbeats before a node is suspect"),
    ("--dead-after-s", float, _d.dead_after_s, "silence before a node is declared dead"),
    ("--forget-after-s", float, _d.forget_after_s, "silence before a dead or left node leaves the table"),
    ("--tick-interval-s", float, _d.tick_interval_s, "the ticker runs at least this often while nodes are watched"),
    (
        "--stall-after-s",
        float,
        _d.stall_after_s,
        "a ticker gap above this is healthd's own stall: nobody is declared dead for it (inf: off)",
    ),
    ("--report-timeout-s", float, _d.report_timeout_s, "deadline of each call to the coordinator"),
    ("--shutdown-grace-s", float, _d.shutdown_grace_s, "how long SIGTERM waits for in-flight calls"),
    (
        "--max-calls",
        int,
        _d.max_calls,
        "gRPC calls at once: heartbeat streams plus watchers (more: RESOURCE_EXHAUSTED)",
    ),
    ("--max-calls-per-client", int, _d.max_calls_per_client, "gRPC calls one connection may run at once"),
    ("--heartbeat-rate-factor", float, _d.heartbeat_rate_factor, "a stream may send this x the expected rate"),
    ("--heartbeat-burst", int, _d.heartbeat_burst, "heartbeats a stream may send at once above that rate"),
    ("--log-level", str, _d.log_level, f"log level: {', '.join(LOG_LEVELS)}"),
]


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = build_flag_parser(
        "python -m services.healthd", "Run healthd, the failure detector.", [("healthd", _FLAGS)], env
    )
    security.add_flags(p, env, tls_name="healthd", tokens=("join", "admin"))
    return p


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> HealthdConfig:
    """Read the configuration from flags (`argv`, default `sys.argv[1:]`) with environment fallbacks (`env`,
    default `os.environ`). Raises `ConfigError` with a message naming the flag or field."""
    env = os.environ if env is None else env
    a = build_parser(env).parse_args(argv)
    return config_from_flags(HealthdConfig, a, security=security.from_args(a, env))
