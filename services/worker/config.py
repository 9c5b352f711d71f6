"""Worker configuration: flags with `DILOCO_*` environment fallbacks, read here and nowhere else."""

from __future__ import annotations

import argparse
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diloco.errors import ConfigError
from diloco.rpc import security
from diloco.rpc.security import SecurityConfig

UPLOAD_PATHS = ("auto", "grpc")


@dataclass(frozen=True)
class WorkerConfig:
    coordinator: str  # host:port of the coordinator
    name: str = ""  # stable name; default hostname-pid
    healthd: str = ""  # host:port of healthd; "" = the one the coordinator names
    slowdown: float = 1.0  # >1 emulates older hardware (sleeps (slowdown-1) x step time)
    heartbeat_interval_s: float = 0.5
    rpc_timeout_s: float = 10.0
    upload_timeout_s: float = 300.0
    retry_total_s: float = 60.0  # give up on an unreachable coordinator after this long
    metrics_port: int = -1
    seed: int = 0
    device: str = ""  # "" = CUDA when present, else CPU
    upload_path: str = "auto"  # auto: the bulk upload path when the coordinator offers one, else gRPC; grpc: gRPC
    # FAULT INJECTION, for tests and chaos runs only: multiply every pseudo-gradient sent by this (1: off)
    fault_scale_updates: float = 1.0
    security: SecurityConfig = field(default_factory=SecurityConfig)  # in-process default: plaintext, loopback

    def __post_init__(self) -> None:
        if not self.coordinator or ":" not in self.coordinator:
            raise ConfigError(
                "coordinator: expected HOST:PORT (flag --coordinator or env DILOCO_COORDINATOR), "
                f"got {self.coordinator!r}"
            )
        if not self.slowdown >= 1.0:
            raise ConfigError(f"slowdown must be >= 1.0 (1 = full speed), got {self.slowdown}")
        for name in ("heartbeat_interval_s", "rpc_timeout_s", "upload_timeout_s", "retry_total_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.fault_scale_updates) and self.fault_scale_updates > 0):
            raise ConfigError(f"fault_scale_updates must be finite and > 0 (1: off), got {self.fault_scale_updates}")
        if self.upload_path not in UPLOAD_PATHS:
            raise ConfigError(f"upload_path: allowed {', '.join(UPLOAD_PATHS)}; got {self.upload_path!r}")
        if self.device not in ("", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: allowed '', cpu, cuda, cuda:N; got {self.device!r}")
        for address in (self.coordinator, self.healthd):
            if address:
                self.security.check_client(address)
        if self.security.tls and not self.security.join_token:
            raise ConfigError(
                "a worker needs the join token: --join-token-file FILE or DILOCO_JOIN_TOKEN "
                "(`diloco certs` writes join.token)"
            )

    @property
    def display_name(self) -> str:
        return self.name or f"{socket.gethostname()}-{os.getpid()}"


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> WorkerConfig:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog="diloco worker", description="Run one learner.")
    p.add_argument("--coordinator", default=env.get("DILOCO_COORDINATOR", ""), help="HOST:PORT")
    p.add_argument("--name", default=env.get("DILOCO_WORKER_NAME", ""))
    p.add_argument("--healthd", default=env.get("DILOCO_HEALTHD", ""), help="HOST:PORT (default: from coordinator)")
    p.add_argument("--slowdown", default=env.get("DILOCO_SLOWDOWN", "1.0"), help="emulate older hardware, >= 1")
    p.add_argument("--heartbeat-interval-s", default=env.get("DILOCO_HEARTBEAT_INTERVAL_S", "0.5"))
    p.add_argument("--rpc-timeout-s", default=env.get("DILOCO_RPC_TIMEOUT_S", "10"))
    p.add_argument("--retry-total-s", default=env.get("DILOCO_RETRY_TOTAL_S", "60"))
    p.add_argument("--metrics-port", default=env.get("DILOCO_METRICS_PORT", "-1"))
    p.add_argument("--seed", default=env.get("DILOCO_SEED", "0"))
    p.add_argument("--device", default=env.get("DILOCO_DEVICE", ""))
    p.add_argument(
        "--upload-path",
        default=env.get("DILOCO_UPLOAD_PATH", "auto"),
        help="auto: pseudo-gradients over the coordinator's bulk upload port when it offers one, else gRPC; "
        "grpc: always SubmitPseudoGradient",
    )
    p.add_argument(
        "--fault-scale-updates",
        default=env.get("DILOCO_FAULT_SCALE_UPDATES", "1"),
        help="FAULT INJECTION for tests and chaos runs: multiply every pseudo-gradient sent by this (1: off)",
    )
    security.add_flags(p, env, tls_name="worker", tokens=("join",))
    a = p.parse_args(argv)
    sec = security.from_args(a, env)
    try:
        return WorkerConfig(
            coordinator=a.coordinator,
            name=a.name,
            healthd=a.healthd,
            slowdown=float(a.slowdown),
            heartbeat_interval_s=float(a.heartbeat_interval_s),
            rpc_timeout_s=float(a.rpc_timeout_s),
            retry_total_s=float(a.retry_total_s),
            metrics_port=int(a.metrics_port),
            seed=int(a.seed),
            device=a.device,
            upload_path=a.upload_path,
            fault_scale_updates=float(a.fault_scale_updates),
            security=sec,
        )
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"worker: a numeric flag has a non-numeric value ({e})") from e
