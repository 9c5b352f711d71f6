"""docker/healthcheck.py, the containers' HEALTHCHECK: mutual TLS with the mounted certificates when a TLS folder is
set (no token needed), plaintext otherwise; a check that cannot connect reports unhealthy; the address the service
binds is the one checked; a coordinator replica under etcd leadership is healthy as a standby (NOT_SERVING)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from diloco.rpc.auth import TokenAuthInterceptor, Tokens
from diloco.rpc.server import GrpcService
from diloco.rpc.tls import TlsFiles, server_credentials, write_bundle

ROOT = Path(__file__).resolve().parents[1]


def load_healthcheck() -> ModuleType:
    # by path: `docker` is also the name of the Docker SDK package
    spec = importlib.util.spec_from_file_location("diloco_healthcheck", ROOT / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hc = load_healthcheck()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    write_bundle(d, hosts=["coordinator", "healthd"])  # no 127.0.0.1: the check names the server it expects
    return d


def serve(tls_dir: Path | None) -> GrpcService:
    """The services' server (health included) behind the token interceptor, over mutual TLS with `tls_dir`'s
    coordinator identity, else plaintext."""
    creds = None if tls_dir is None else server_credentials(TlsFiles.from_dir(tls_dir, "coordinator"))
    server = GrpcService(
        "127.0.0.1", 0, [], credentials=creds, interceptors=[TokenAuthInterceptor(Tokens("join-t", "admin-t"))]
    )
    server.start()
    return server


@pytest.fixture
def tls_server(pki: Path) -> Iterator[int]:
    server = serve(pki)
    port = server.port
    yield port
    server.stop(0)


def test_tls_check_with_the_mounted_certificates(tls_server: int, pki: Path) -> None:
    argv = ["diloco", "coordinator", "--port", str(tls_server)]
    assert hc.main(argv, {"DILOCO_TLS_DIR": str(pki), "DILOCO_TLS_NAME": "coordinator"}) == 0
    assert hc.main([*argv, "--tls-dir", str(pki)], {}) == 0  # flags work too; the name defaults to the service


def test_tls_check_fails_in_plaintext_or_with_another_ca(tls_server: int, tmp_path: Path) -> None:
    argv = ["diloco", "coordinator", "--port", str(tls_server)]
    assert hc.main(argv, {"DILOCO_INSECURE": "1"}) == 1
    write_bundle(tmp_path)
    assert hc.main(argv, {"DILOCO_TLS_DIR": str(tmp_path)}) == 1
    assert hc.main(argv, {"DILOCO_TLS_DIR": str(tmp_path / "missing")}) == 1


def test_plaintext_check_when_insecure() -> None:
    server = serve(None)
    port = server.port
    try:
        assert hc.main(["diloco", "healthd", "--port", str(port)], {"DILOCO_INSECURE": "1"}) == 0
    finally:
        server.stop(0)


def test_a_stopped_server_is_unhealthy(pki: Path) -> None:
    server = serve(pki)
    port = server.port
    assert hc.check_grpc(str(port), str(pki), "coordinator") == ""
    server.stop(0)
    assert hc.check_grpc(str(port), str(pki), "coordinator").startswith(f"health check on port {port}: ")


def test_the_bound_host_is_checked_and_a_standby_replica_is_healthy(pki: Path) -> None:
    server = serve(pki)
    port = str(server.port)
    tls = {"DILOCO_TLS_DIR": str(pki), "DILOCO_TLS_NAME": "coordinator"}
    argv = ["diloco", "coordinator", "--port", port]
    try:
        assert hc.main([*argv, "--host", "127.0.0.1"], tls) == 0
        assert hc.main(argv, {**tls, "DILOCO_HOST": "0.0.0.0"}) == 0  # a wildcard: checked on 127.0.0.1
        assert hc.main([*argv, "--host", "127.0.0.2"], tls) == 1  # bound elsewhere: nothing answers there
        server.set_serving(False)  # what a replica's stand-in answers while another replica leads
        assert hc.main(argv, tls) == 1
        assert hc.main([*argv, "--etcd", "http://etcd:2379"], tls) == 0
        assert hc.main(argv, {**tls, "DILOCO_ETCD": "http://etcd:2379"}) == 0
        assert hc.main(["diloco", "healthd", "--port", port], {**tls, "DILOCO_ETCD": "http://etcd:2379"}) == 1
    finally:
        server.stop(0)
