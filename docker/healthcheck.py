"""Container HEALTHCHECK: exit 0 when the service in this container is healthy, 1 when not.

coordinator, healthd: `grpc.health.v1.Health/Check` on localhost:PORT must answer SERVING, PORT being the
`--port` flag of the container's command or `DILOCO_PORT`.
worker (no gRPC server): its Prometheus endpoint on localhost:PORT must answer, PORT being `--metrics-port` or
`DILOCO_METRICS_PORT`; a worker without a metrics endpoint is healthy while it runs.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence

TIMEOUT_S = 3.0


def command_line() -> list[str]:
    """The container's main command (PID 1), e.g. `diloco coordinator --port 50051`."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def flag(argv: Sequence[str], name: str, env: Mapping[str, str], env_name: str) -> str:
    """The value of `--name V` or `--name=V` in argv, else the environment variable, else ''."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return env.get(env_name, "")


def service_of(argv: Sequence[str]) -> str:
    for arg in argv:
        if arg in ("coordinator", "healthd", "worker"):
            return arg
        if arg.startswith("services."):
            return arg.removeprefix("services.")
    return ""


def check_grpc(port: str) -> str:
    """'' when SERVING, else what is wrong."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            return f"health check on port {port}: {e.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"port {port}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return ""


def check_http(port: str) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as reply:
            return "" if reply.status == 200 else f"metrics on port {port}: HTTP {reply.status}"
    except OSError as e:
        return f"metrics on port {port}: {e}"


def main(argv: Sequence[str], env: Mapping[str, str]) -> int:
    service = service_of(argv)
    if service in ("coordinator", "healthd"):
        port = flag(argv, "--port", env, "DILOCO_PORT")
        problem = check_grpc(port) if port.isdigit() and port != "0" else f"{service}: no fixed --port to check"
    elif service == "worker":
        port = flag(argv, "--metrics-port", env, "DILOCO_METRICS_PORT")
        problem = check_http(port) if port.isdigit() and port != "0" else ""
    else:
        problem = ""  # not a service (a `diloco ctl` or `simulate` container): running is healthy
    if problem:
        print(f"unhealthy: {problem}")
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main(command_line(), os.environ))
