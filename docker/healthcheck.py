"""Container HEALTHCHECK: exit 0 when the service in this container is healthy, 1 when not.

coordinator, healthd: `grpc.health.v1.Health/Check` on HOST:PORT must answer SERVING, PORT being the `--port` flag
of the container's command or `DILOCO_PORT`, HOST the address it binds (`--host` or `DILOCO_HOST`; 127.0.0.1 for a
wildcard address). A coordinator replica under etcd leadership (`--etcd` or `DILOCO_ETCD`) is healthy also when it
answers NOT_SERVING: that is a standby (docker-compose.ha.yml). With a TLS folder (`--tls-dir` or `DILOCO_TLS_DIR`) the
check is mutual TLS as the service's own identity (`--tls-name` or `DILOCO_TLS_NAME`, else the service's name),
checking the server certificate against that name (every certificate `diloco certs` issues names itself); health
checks need no token. Without one (`--insecure`, `DILOCO_INSECURE=1`), plaintext.
worker (no gRPC server): its Prometheus endpoint on localhost:PORT must answer, PORT being `--metrics-port` or
`DILOCO_METRICS_PORT`; a worker without a metrics endpoint is healthy while it runs.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

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


def grpc_channel(address: str, tls_dir: str, tls_name: str) -> grpc.Channel:
    """Mutual TLS with `<tls_dir>/ca.pem` and `<tls_dir>/<tls_name>.{pem,key}` when `tls_dir`, else plaintext."""
    import grpc

    if not tls_dir:
        return grpc.insecure_channel(address)
    d = Path(tls_dir)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.pem").read_bytes(),
        private_key=(d / f"{tls_name}.key").read_bytes(),
        certificate_chain=(d / f"{tls_name}.pem").read_bytes(),
    )
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", tls_name)])


WILDCARDS = ("", "0.0.0.0", "::", "[::]")  # addresses a server binds to listen on every interface


def check_grpc(port: str, tls_dir: str = "", tls_name: str = "", host: str = "", standby_ok: bool = False) -> str:
    """'' when SERVING (or NOT_SERVING with `standby_ok`: a standby replica) on `host` (a wildcard address or '':
    127.0.0.1), else what is wrong."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if host in WILDCARDS:
        host = "127.0.0.1"
    try:
        channel = grpc_channel(f"{host}:{port}", tls_dir, tls_name)
    except OSError as e:
        return f"TLS files in {tls_dir} for {tls_name!r}: {e}"
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            return f"health check on port {port}: {e.code().name}"
    serving = (health_pb2.HealthCheckResponse.SERVING,)
    if standby_ok:
        serving += (health_pb2.HealthCheckResponse.NOT_SERVING,)
    if reply.status not in serving:
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
        tls_dir = flag(argv, "--tls-dir", env, "DILOCO_TLS_DIR")
        tls_name = flag(argv, "--tls-name", env, "DILOCO_TLS_NAME") or service
        host = flag(argv, "--host", env, "DILOCO_HOST")
        standby_ok = service == "coordinator" and bool(flag(argv, "--etcd", env, "DILOCO_ETCD"))
        if not (port.isdigit() and port != "0"):
            problem = f"{service}: no fixed --port to check"
        else:
            problem = check_grpc(port, tls_dir, tls_name, host, standby_ok)
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
