"""Transport security: mutual TLS (certificates from `diloco certs`), bearer tokens with roles, and the
configuration rules (plaintext only on loopback, tokens required with TLS, tokens never logged). In-process
servers on port 0 through real channels; one healthd subprocess for the log check."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.cli.main import main
from diloco.cluster import wait_serving
from diloco.core.codecs import get_codec
from diloco.errors import ConfigError
from diloco.rpc.auth import METHOD_ROLES, Role
from diloco.rpc.bulk import BulkError, bulk_upload, client_ssl_context_from_dir
from diloco.rpc.payload import meta_to_proto
from diloco.rpc.security import SecurityConfig
from diloco.rpc.server import channel
from diloco.rpc.tls import ADMIN_TOKEN_FILE, JOIN_TOKEN_FILE, TlsFiles, channel_credentials, write_bundle
from diloco.task.params import param_specs
from diloco.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    healthd_pb2,
    healthd_pb2_grpc,
    replication_pb2,
)
from services.coordinator import config as coordinator_config
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.server import CoordinatorServer
from services.healthd import config as healthd_config
from services.healthd.config import HealthdConfig
from services.healthd.server import HealthdServer
from services.worker import config as worker_config
from tests.support import tiny_task, wait_for

T = 10.0
Code = grpc.StatusCode


# --- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    write_bundle(d, clients=["worker0", "worker1", "worker"])
    return d


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("other-tls")
    write_bundle(d, clients=["worker0"])
    return d


def tokens(d: Path) -> tuple[str, str]:
    return (d / JOIN_TOKEN_FILE).read_text().strip(), (d / ADMIN_TOKEN_FILE).read_text().strip()


def server_security(d: Path, name: str) -> SecurityConfig:
    join, admin = tokens(d)
    return SecurityConfig(tls_dir=str(d), tls_name=name, insecure=False, join_token=join, admin_token=admin)


@pytest.fixture(scope="module")
def coordinator(pki: Path) -> Iterator[CoordinatorServer]:
    cfg = CoordinatorServiceConfig(task=tiny_task(8), expected_workers=2, security=server_security(pki, "coordinator"))
    server = CoordinatorServer(cfg)
    server.start()
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def healthd(pki: Path) -> Iterator[HealthdServer]:
    server = HealthdServer(HealthdConfig(security=server_security(pki, "healthd")))
    server.start()
    yield server
    server.stop(0)


@pytest.fixture
def connect(pki: Path) -> Iterator[Callable[..., grpc.Channel]]:
    """A TLS channel presenting identity `name` of `tls_dir` (default: the deployment's own) with `token`."""
    made: list[grpc.Channel] = []

    def _connect(address: str, name: str = "admin", token: str = "", tls_dir: Path | None = None) -> grpc.Channel:
        ch = channel(address, credentials=channel_credentials(TlsFiles.from_dir(tls_dir or pki, name)), token=token)
        made.append(ch)
        return ch

    yield _connect
    for ch in made:
        ch.close()


def coord_stub(ch: grpc.Channel) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_pb2_grpc.CoordinatorStub(ch)


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    code: grpc.StatusCode = e.value.code()  # type: ignore[attr-defined]
    return code


# --- the method table -------------------------------------------------------------------------------------------


def test_every_rpc_of_every_service_is_in_the_role_table() -> None:
    services = [
        *coordinator_pb2.DESCRIPTOR.services_by_name.values(),
        *healthd_pb2.DESCRIPTOR.services_by_name.values(),
        *replication_pb2.DESCRIPTOR.services_by_name.values(),
    ]
    assert {s.full_name for s in services} == set(METHOD_ROLES)
    for s in services:
        declared = {m.name for m in s.methods}
        missing = declared - set(METHOD_ROLES[s.full_name])
        assert not missing, f"{s.full_name}: RPCs without a role in diloco.rpc.auth.METHOD_ROLES: {missing}"
        assert set(METHOD_ROLES[s.full_name]) == declared, f"{s.full_name}: stale entries in METHOD_ROLES"
    assert METHOD_ROLES["diloco.v1.Coordinator"]["ReportNodeFailure"] is Role.ADMIN


# --- diloco certs -----------------------------------------------------------------------------------------------


def test_certs_command_writes_a_verifiable_bundle(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    assert main(["certs", "--out", str(out), "--workers", "2", "--hosts", "coord.example,10.1.2.3,127.0.0.1"]) == 0
    names = ["ca", "coordinator", "healthd", "admin", "worker0", "worker1"]
    for name in names:
        assert (out / f"{name}.pem").is_file() and (out / f"{name}.key").is_file()
    for secret in [*(out / f"{n}.key" for n in names), out / JOIN_TOKEN_FILE, out / ADMIN_TOKEN_FILE]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    join, admin = tokens(out)
    assert len(join) >= 32 and len(admin) >= 32 and join != admin
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for name in names[1:]:
        cert = x509.load_pem_x509_certificate((out / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)  # raises when the chain does not verify
    server = x509.load_pem_x509_certificate((out / "coordinator.pem").read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"coordinator", "coord.example"} <= set(san.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"10.1.2.3", "127.0.0.1"}
    # a second run refuses to replace the CA unless asked
    assert main(["certs", "--out", str(out)]) == 2
    assert main(["certs", "--out", str(out), "--force", "--names", "a,b"]) == 0
    assert (out / "a.pem").is_file() and (out / "b.pem").is_file()
    assert not (out / "etcd.pem").exists()  # etcd's certificate only when asked


def test_certs_command_issues_etcd_a_server_certificate_when_asked(tmp_path: Path) -> None:
    """`--etcd`: etcd.pem/etcd.key from the same CA, for the hosts given, usable by etcd as a server and by its
    grpc gateway as a client of itself; no learner may be called etcd."""
    out = tmp_path / "tls"
    assert main(["certs", "--out", str(out), "--etcd", "--hosts", "etcd-a,127.0.0.1"]) == 0
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "etcd.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert stat.S_IMODE((out / "etcd.key").stat().st_mode) == 0o600
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"etcd", "etcd-a"} <= set(san.get_values_for_type(x509.DNSName))
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    assert main(["certs", "--out", str(tmp_path / "w"), "--names", "etcd"]) == 2


# --- mutual TLS -------------------------------------------------------------------------------------------------


def test_client_without_certificate_cannot_connect(coordinator: CoordinatorServer, pki: Path) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    _, admin = tokens(pki)
    with channel(coordinator.address, credentials=creds, token=admin) as ch:
        assert code_of(lambda: coord_stub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3)) == (
            Code.UNAVAILABLE
        )


def test_client_with_certificate_of_another_ca_cannot_connect(
    coordinator: CoordinatorServer, pki: Path, other_pki: Path
) -> None:
    foreign = TlsFiles(pki / "ca.pem", other_pki / "admin.pem", other_pki / "admin.key")
    _, admin = tokens(pki)
    with channel(coordinator.address, credentials=channel_credentials(foreign), token=admin) as ch:
        assert code_of(lambda: coord_stub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3)) == (
            Code.UNAVAILABLE
        )


def test_plaintext_client_cannot_talk_to_a_tls_server(coordinator: CoordinatorServer) -> None:
    with channel(coordinator.address) as ch:
        assert code_of(lambda: coord_stub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3)) == (
            Code.UNAVAILABLE
        )


def test_correct_client_works_and_health_stays_open(
    coordinator: CoordinatorServer, connect: Callable[..., grpc.Channel], pki: Path
) -> None:
    _, admin = tokens(pki)
    status = coord_stub(connect(coordinator.address, token=admin)).GetStatus(
        coordinator_pb2.GetStatusRequest(), timeout=T
    )
    assert status.version == 0
    resp = health_pb2_grpc.HealthStub(connect(coordinator.address)).Check(health_pb2.HealthCheckRequest(), timeout=T)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING  # no token needed for health


# --- tokens -----------------------------------------------------------------------------------------------------


def test_missing_and_wrong_tokens_are_unauthenticated(
    coordinator: CoordinatorServer, connect: Callable[..., grpc.Channel]
) -> None:
    for token in ("", "not-the-token"):
        stub = coord_stub(connect(coordinator.address, token=token))
        with pytest.raises(grpc.RpcError) as e:
            stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=T)
        assert e.value.code() == Code.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert "token" in (e.value.details() or "")  # type: ignore[attr-defined]


def test_admin_commands_need_the_admin_token(
    coordinator: CoordinatorServer, connect: Callable[..., grpc.Channel], pki: Path
) -> None:
    join, admin = tokens(pki)
    as_worker = coord_stub(connect(coordinator.address, name="worker0", token=join))
    as_admin = coord_stub(connect(coordinator.address, token=admin))
    refused: list[Callable[[], Any]] = [
        lambda: as_worker.Pause(coordinator_pb2.PauseRequest(), timeout=T),
        lambda: as_worker.Resume(coordinator_pb2.ResumeRequest(), timeout=T),
        lambda: as_worker.Checkpoint(coordinator_pb2.CheckpointRequest(), timeout=T),
        lambda: as_worker.DrainWorker(coordinator_pb2.DrainWorkerRequest(worker_id="x"), timeout=T),
        lambda: as_worker.EvictWorker(coordinator_pb2.EvictWorkerRequest(worker_id="x"), timeout=T),
        lambda: as_worker.ReleaseWorker(coordinator_pb2.ReleaseWorkerRequest(worker_id="x"), timeout=T),
        lambda: as_worker.ReportNodeFailure(coordinator_pb2.ReportNodeFailureRequest(worker_id="x"), timeout=T),
        lambda: as_worker.StepDown(coordinator_pb2.StepDownRequest(), timeout=T),
    ]
    for call in refused:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == Code.PERMISSION_DENIED  # type: ignore[attr-defined]
        assert "admin token" in (e.value.details() or "")  # type: ignore[attr-defined]
    assert not coordinator.core.paused
    as_admin.Pause(coordinator_pb2.PauseRequest(), timeout=T)
    assert coordinator.core.paused
    as_admin.Resume(coordinator_pb2.ResumeRequest(), timeout=T)
    assert not coordinator.core.paused
    # read-only RPCs take either token
    assert as_worker.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=T).version == 0
    as_admin.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=T)


def test_worker_rpcs_need_a_token_and_work_with_the_join_token(
    coordinator: CoordinatorServer, healthd: HealthdServer, connect: Callable[..., grpc.Channel], pki: Path
) -> None:
    anon = coord_stub(connect(coordinator.address, name="worker0"))
    h_anon = healthd_pb2_grpc.HealthDaemonStub(connect(healthd.address, name="worker0"))
    calls: list[Callable[[], Any]] = [
        lambda: anon.Register(coordinator_pb2.RegisterRequest(worker_name="w"), timeout=T),
        lambda: next(iter(anon.WatchParameters(coordinator_pb2.WatchParametersRequest(worker_id="w"), timeout=T))),
        lambda: anon.SubmitPseudoGradient(iter([coordinator_pb2.SubmitPseudoGradientRequest()]), timeout=T),
        lambda: anon.GetUploadStatus(coordinator_pb2.GetUploadStatusRequest(), timeout=T),
        lambda: anon.GetWorkPlan(coordinator_pb2.GetWorkPlanRequest(worker_id="w"), timeout=T),
        lambda: anon.Deregister(coordinator_pb2.DeregisterRequest(worker_id="w"), timeout=T),
        lambda: anon.ReportThroughput(coordinator_pb2.ReportThroughputRequest(worker_id="w"), timeout=T),
        lambda: next(iter(h_anon.Heartbeat(iter([healthd_pb2.HeartbeatRequest(node_id="w")]), timeout=T))),
        lambda: h_anon.ListNodes(healthd_pb2.ListNodesRequest(), timeout=T),
    ]
    for call in calls:
        assert code_of(call) == Code.UNAUTHENTICATED
    join, _ = tokens(pki)
    stub = coord_stub(connect(coordinator.address, name="worker0", token=join))
    resp = stub.Register(
        coordinator_pb2.RegisterRequest(worker_name="worker0", model_fingerprint=coordinator.task.fingerprint),
        timeout=T,
    )
    assert resp.worker_id
    beats = healthd_pb2_grpc.HealthDaemonStub(connect(healthd.address, name="worker0", token=join))
    ack = next(iter(beats.Heartbeat(iter([beat(resp.worker_id)]), timeout=T)))
    assert ack is not None
    assert resp.worker_id in [n.node_id for n in beats.ListNodes(healthd_pb2.ListNodesRequest(), timeout=T).nodes]


def beat(node_id: str, role: int = healthd_pb2.NODE_ROLE_WORKER) -> healthd_pb2.HeartbeatRequest:
    return healthd_pb2.HeartbeatRequest(node_id=node_id, role=role)  # type: ignore[arg-type]


def test_a_learner_certificate_acts_only_as_its_own_learner(
    coordinator: CoordinatorServer, healthd: HealthdServer, connect: Callable[..., grpc.Channel], pki: Path
) -> None:
    """worker0's certificate cannot register, plan, watch, upload (gRPC or bulk port), ask upload status, leave or
    heartbeat as worker1; the shared `worker` certificate may act as any learner."""
    join, _ = tokens(pki)
    fp = coordinator.task.fingerprint
    w0 = coord_stub(connect(coordinator.address, name="worker0", token=join))
    w1 = coord_stub(connect(coordinator.address, name="worker1", token=join))
    shared = coord_stub(connect(coordinator.address, name="worker", token=join))
    deny = Code.PERMISSION_DENIED
    assert code_of(lambda: w0.Register(coordinator_pb2.RegisterRequest(worker_name="worker1"), timeout=T)) == deny
    admin = coord_stub(connect(coordinator.address, name="admin", token=join))  # the operator is not a learner
    assert code_of(lambda: admin.Register(coordinator_pb2.RegisterRequest(worker_name="admin"), timeout=T)) == deny
    victim = w1.Register(coordinator_pb2.RegisterRequest(worker_name="worker1", model_fingerprint=fp), timeout=T)
    vid = victim.worker_id
    calls: list[Callable[[], Any]] = [
        lambda: w0.GetWorkPlan(coordinator_pb2.GetWorkPlanRequest(worker_id=vid), timeout=T),
        lambda: next(iter(w0.WatchParameters(coordinator_pb2.WatchParametersRequest(worker_id=vid), timeout=T))),
        lambda: w0.GetUploadStatus(coordinator_pb2.GetUploadStatusRequest(worker_id=vid, submission_id="s"), timeout=T),
        lambda: w0.Deregister(coordinator_pb2.DeregisterRequest(worker_id=vid), timeout=T),
        lambda: w0.SubmitPseudoGradient(iter([upload_header(coordinator, victim)]), timeout=T),
    ]
    for call in calls:
        assert code_of(call) == deny
    with pytest.raises(BulkError) as e:
        bulk_upload(
            f"127.0.0.1:{victim.bulk_port}",
            join.encode(),
            upload_header(coordinator, victim),
            b"",
            timeout_s=T,
            ssl_context=client_ssl_context_from_dir(pki, "worker0"),
            server_hostname="localhost",
        )
    assert e.value.code() == deny and "worker0" in (e.value.details() or "")
    h0 = healthd_pb2_grpc.HealthDaemonStub(connect(healthd.address, name="worker0", token=join))
    assert code_of(lambda: next(iter(h0.Heartbeat(iter([beat(vid, healthd_pb2.NODE_ROLE_WORKER)]), timeout=T)))) == deny
    leave = healthd_pb2.HeartbeatRequest(node_id=vid, role=healthd_pb2.NODE_ROLE_WORKER, leaving=True)
    assert code_of(lambda: next(iter(h0.Heartbeat(iter([leave]), timeout=T)))) == deny
    as_coordinator = beat("coordinator", healthd_pb2.NODE_ROLE_COORDINATOR)
    assert code_of(lambda: next(iter(h0.Heartbeat(iter([as_coordinator]), timeout=T)))) == deny
    # the victim is untouched; its own certificate and the shared one both act as it
    assert w1.GetWorkPlan(coordinator_pb2.GetWorkPlanRequest(worker_id=vid), timeout=T).plan.shards
    assert shared.GetWorkPlan(coordinator_pb2.GetWorkPlanRequest(worker_id=vid), timeout=T).plan.shards
    assert shared.Register(coordinator_pb2.RegisterRequest(worker_name="any-name", model_fingerprint=fp), timeout=T)
    hs = healthd_pb2_grpc.HealthDaemonStub(connect(healthd.address, name="worker", token=join))
    assert next(iter(hs.Heartbeat(iter([beat(vid)]), timeout=T))).state


def upload_header(
    coordinator: CoordinatorServer, reg: coordinator_pb2.RegisterResponse
) -> coordinator_pb2.SubmitPseudoGradientRequest:
    """The header of a valid fp32 upload for learner `reg` (no payload is needed: the identity check comes first)."""
    lease = reg.plan.shards[0]
    model = coordinator.task.model_fn(0)
    _, meta = get_codec("fp32").encode(torch.zeros(sum(p.numel() for p in model.parameters())))
    return coordinator_pb2.SubmitPseudoGradientRequest(
        header=coordinator_pb2.SubmissionHeader(
            worker_id=reg.worker_id,
            coordinator_epoch=reg.coordinator_epoch,
            submission_id=uuid.uuid4().hex,
            base_version=reg.version,
            tokens=16,
            steps=1,
            ranges=[
                common_pb2.ShardRange(
                    shard_id=lease.shard_id, epoch=lease.epoch, start=lease.cursor, end=lease.cursor + 16
                )
            ],
            payload=meta_to_proto(meta, param_specs(model)),
        )
    )


def test_ctl_uses_tls_and_the_admin_token(
    coordinator: CoordinatorServer, pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["ctl", "--coordinator", coordinator.address, "--tls-dir", str(pki)]
    assert main([*base, "pause"]) == 0  # admin.pem and admin.token from the TLS folder
    assert coordinator.core.paused
    assert main([*base, "--admin-token-file", str(pki / JOIN_TOKEN_FILE), "resume"]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert main([*base, "resume"]) == 0
    assert not coordinator.core.paused
    assert main(["ctl", "--coordinator", coordinator.address, "status"]) == 2  # neither TLS nor --insecure
    assert "diloco certs" in capsys.readouterr().err


# --- configuration ----------------------------------------------------------------------------------------------


def test_plaintext_is_refused_off_loopback(pki: Path) -> None:
    with pytest.raises(ConfigError, match="diloco certs"):
        CoordinatorServiceConfig(task=tiny_task(8), host="0.0.0.0")
    with pytest.raises(ConfigError, match="--insecure on loopback"):
        coordinator_config.parse(["--host", "0.0.0.0", "--insecure"], env={})
    with pytest.raises(ConfigError, match="--tls-dir"):
        coordinator_config.parse(["--host", "127.0.0.1"], env={})  # TLS is the default: no silent plaintext
    with pytest.raises(ConfigError, match="loopback"):
        healthd_config.parse(["--insecure", "--coordinator-address", "10.0.0.5:50051"], env={})
    with pytest.raises(ConfigError, match="loopback"):
        worker_config.parse(["--coordinator", "10.0.0.5:50051"], env={"DILOCO_INSECURE": "1"})
    assert healthd_config.parse(["--insecure"], env={}).security.join_token == ""  # local dev stays easy
    cfg = coordinator_config.parse(["--host", "0.0.0.0"], env={"DILOCO_TLS_DIR": str(pki)})
    assert cfg.security.tls and cfg.security.join_token  # tokens from the TLS folder
    assert cfg.security.join_token not in repr(cfg)


def test_tokens_are_required_with_tls_and_validated(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="requires tokens"):
        HealthdConfig(security=SecurityConfig(tls_dir=str(pki), tls_name="healthd", insecure=False))
    empty = tmp_path / "empty.token"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        healthd_config.parse(["--tls-dir", str(pki), "--join-token-file", str(empty)], env={})
    bare = tmp_path / "no-tokens"
    write_bundle(bare, tokens=False)
    with pytest.raises(ConfigError, match="join token"):
        worker_config.parse(["--coordinator", "127.0.0.1:1", "--tls-dir", str(bare)], env={})
    with pytest.raises(ConfigError, match="missing"):
        worker_config.parse(
            ["--coordinator", "127.0.0.1:1", "--tls-dir", str(tmp_path)], env={"DILOCO_JOIN_TOKEN": "x"}
        )
    w = worker_config.parse(
        ["--coordinator", "127.0.0.1:1", "--tls-dir", str(pki), "--tls-name", "worker0"],
        env={"DILOCO_JOIN_TOKEN": "t0k"},
    )
    assert w.security.join_token == "t0k" and w.security.admin_token == ""


def test_tokens_never_appear_in_service_logs(pki: Path, tmp_path: Path) -> None:
    join, admin = tokens(pki)
    log_path = tmp_path / "healthd.log"
    argv = [sys.executable, "-m", "services.healthd", "--log-level", "debug", "--tls-dir", str(pki)]
    argv += ["--join-token-file", str(pki / JOIN_TOKEN_FILE), "--admin-token-file", str(pki / ADMIN_TOKEN_FILE)]
    argv += ["--coordinator-address", "127.0.0.1:1", "--port", "0"]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            admin_sec = server_security(pki, "admin")
            address = wait_for_address(log_path, proc)
            wait_serving(address, 30, make_channel=lambda a: admin_sec.channel(a, admin=True))
            with server_security(pki, "worker0").channel(address) as ch:  # join token: a heartbeat
                stub = healthd_pb2_grpc.HealthDaemonStub(ch)
                next(iter(stub.Heartbeat(iter([beat("worker0-1")]), timeout=T)))
            with channel(address, credentials=channel_credentials(TlsFiles.from_dir(pki, "admin")), token="bad") as ch:
                code_of(
                    lambda: healthd_pb2_grpc.HealthDaemonStub(ch).ListNodes(healthd_pb2.ListNodesRequest(), timeout=T)
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    text = log_path.read_text()
    assert "healthd.started" in text
    assert join not in text and admin not in text


def wait_for_address(log_path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> str:
    """The address healthd logs in `healthd.started` (it binds port 0)."""

    def logged() -> str:
        assert proc.poll() is None, log_path.read_text()
        for line in log_path.read_text().splitlines():
            if '"healthd.started"' in line:
                return str(json.loads(line)["address"])
        return ""

    return wait_for("healthd to log its address", logged, timeout_s)


def test_only_the_coordinators_certificate_with_the_admin_token_announces_a_leader(
    healthd: HealthdServer, connect: Callable[..., grpc.Channel], pki: Path
) -> None:
    """A learner (join token) or the operator (admin token, its own certificate) cannot name the leader every
    learner moves to; the coordinator's certificate with the admin token can."""
    join, admin = tokens(pki)
    announce = healthd_pb2.AnnounceLeaderRequest(epoch=3, address="localhost:50051")

    def as_(name: str, token: str) -> Callable[[], Any]:
        stub = healthd_pb2_grpc.HealthDaemonStub(connect(healthd.address, name=name, token=token))
        return lambda: stub.AnnounceLeader(announce, timeout=T)

    assert code_of(as_("worker0", join)) == Code.PERMISSION_DENIED
    assert code_of(as_("coordinator", join)) == Code.PERMISSION_DENIED
    assert code_of(as_("admin", admin)) == Code.PERMISSION_DENIED
    reply = as_("coordinator", admin)()
    assert (reply.epoch, reply.address) == (3, "localhost:50051")
