"""The service side of coordinator leadership (issue #14), in-process on port 0: the state's fencing (a replica
that may not lead accepts no registration or submission and closes no round, answering UNAVAILABLE naming the
leader), the standby's stand-in server, the --etcd configuration, and the learner's coordinator addresses moving on
FAILOVER."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.cluster import TINY_TASK_ARGS, wait_for
from diloco.errors import ConfigError, not_leader
from diloco.ha.etcd import EtcdAuth, EtcdTls
from diloco.rpc.coordinators import MIN_DWELL_S, Coordinators
from diloco.rpc.server import channel
from diloco.rpc.tls import write_bundle
from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc
from services.coordinator.config import CoordinatorServiceConfig, parse, parse_etcd_endpoints
from services.coordinator.ha import EXIT_UNBOUND, NotLeaderServer, free_port
from services.worker.config import WorkerConfig
from tests.support import Clock, Env, code_of, frozen, make_upload, register, submit, tiny_task

LEADER = "127.0.0.1:7001"


class Fence:
    """The state's `fence`: raises NotLeader while `leading` is False."""

    def __init__(self) -> None:
        self.leading = True

    def __call__(self) -> None:
        if not self.leading:
            raise not_leader(LEADER)


def test_a_fenced_replica_refuses_registrations_and_submissions_naming_the_leader(
    start: Callable[..., Env],
) -> None:
    env = start(min_quorum=1, expected_workers=1)
    fence = Fence()
    env.server.state.fence = fence
    reg = register(env, "a")
    header, data, _ = make_upload(env, reg, "s1")
    fence.leading = False
    before = frozen(env)
    code, details = code_of(lambda: submit(env, header, data))
    assert code == grpc.StatusCode.UNAVAILABLE and details == f"not the leader; leader is at {LEADER}"
    code, details = code_of(lambda: register(env, "b"))
    assert code == grpc.StatusCode.UNAVAILABLE and LEADER in details
    after = frozen(env)
    assert after[0].equal(before[0]) and after[1:] == before[1:], "a refused call changed the state"
    fence.leading = True
    assert submit(env, header, data).version == 1  # leading again: taken, and the round closed (quorum 1)


def test_a_fenced_replica_closes_no_round_and_publishes_nothing(start: Callable[..., Env]) -> None:
    clock = Clock()
    env = start(clock=clock, min_quorum=1, expected_workers=2, grace_max_s=5.0)
    fence = Fence()
    env.server.state.fence = fence
    a, _b = register(env, "a"), register(env, "b")
    header, data, _ = make_upload(env, a, "s1")
    submit(env, header, data)  # quorum: the round waits for b until its grace deadline
    fence.leading = False
    clock.t += 3600.0  # far past every deadline
    assert env.server.state.poll() is None
    assert env.server.core.version == 0 and env.server.state.published().version == 0
    fence.leading = True
    env.server.state.poll()  # (or the poller thread, whichever comes first)
    wait_for("the round closes once leading", lambda: env.server.state.published().version == 1, timeout_s=10)


def test_the_standby_stand_in_refuses_every_coordinator_call_and_is_not_serving() -> None:
    hint = [""]
    cfg = CoordinatorServiceConfig(task=tiny_task(), port=free_port("127.0.0.1"))
    standin = NotLeaderServer(cfg, lambda: hint[0])
    standin.start()
    try:
        with channel(f"127.0.0.1:{cfg.port}") as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            code, details = code_of(lambda: stub.Register(pb.RegisterRequest(worker_name="w"), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE and details == "not the leader; the leader is not known yet"
            hint[0] = LEADER
            code, details = code_of(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE and details == f"not the leader; leader is at {LEADER}"
            reqs = iter([pb.SubmitPseudoGradientRequest(data=b"x")])
            code, _ = code_of(lambda: stub.SubmitPseudoGradient(reqs, timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        standin.stop()


def test_a_replica_that_cannot_bind_its_port_says_so_in_one_line_and_exits_4(tmp_path: Path) -> None:
    """The stand-in binds the replica's advertised port first; a taken port (or, cut off, a host name that does not
    resolve) ends the process at once with one log line saying what to do, not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--insecure", "--etcd", "http://127.0.0.1:9", "--port", str(port), "--checkpoint-dir", str(tmp_path)]
        args += ["--replication-log", "4", *TINY_TASK_ARGS]
        done = subprocess.run(
            [sys.executable, "-m", "services.coordinator", *args], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == EXIT_UNBOUND, done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "replica.bind_failed" in x]
    assert f"cannot serve on 127.0.0.1:{port}: another process holds the port" in line and "--port" in line


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ()),
        ("http://127.0.0.1:2379", (("127.0.0.1", 2379),)),
        ("http://localhost:1/", (("localhost", 1),)),
        ("http://[::1]:2379", (("::1", 2379),)),
        (
            "http://127.0.0.1:1, http://127.0.0.2:2,http://localhost:3",
            (("127.0.0.1", 1), ("127.0.0.2", 2), ("localhost", 3)),
        ),
    ],
)
def test_etcd_endpoints_parse(value: str, expected: tuple[tuple[str, int], ...]) -> None:
    assert parse_etcd_endpoints(value) == ("http" if value else "", expected)
    if value:
        assert parse_etcd_endpoints(value.replace("http:", "https:")) == ("https", expected)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("127.0.0.1:2379", "http\\(s\\)://HOST:PORT"),
        ("ftp://127.0.0.1:2379", "http\\(s\\)://HOST:PORT"),
        ("http://10.0.0.1:2379", "loopback"),
        ("https://10.0.0.1:2379", "https without a client certificate"),
        ("http://127.0.0.1:1,https://127.0.0.1:2", "the same scheme"),
        ("http://127.0.0.1:99999", "1..65535"),
        (
            ",".join(f"http://127.0.0.1:{p}" for p in range(1, 7)),
            "6 endpoints given; give http\\(s\\)://HOST:PORT, or up to 5",
        ),
        ("http://127.0.0.1:1,http://127.0.0.1:1", "given twice"),
        ("http://127.0.0.1:1,", "got ''"),
        ("http://127.0.0.1:1,http://10.0.0.1:2", "loopback"),
        ("http://127.0.0.1:1" + "0" * 600, "512"),
    ],
)
def test_bad_etcd_endpoints_are_refused(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_etcd_endpoints(value)


def test_etcd_needs_checkpoints_and_the_replication_log_and_excludes_follow(tmp_path: Path) -> None:
    etcd = ["--insecure", "--etcd", "http://127.0.0.1:2379"]
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        parse([*etcd, "--replication-log", "4"], {})
    with pytest.raises(ConfigError, match="replication_log"):
        parse([*etcd, "--checkpoint-dir", str(tmp_path)], {})
    with pytest.raises(ConfigError, match="exclude"):
        parse([*etcd, "--checkpoint-dir", str(tmp_path), "--replication-log", "4", "--follow", "127.0.0.1:1"], {})
    cfg = parse([*etcd, "--checkpoint-dir", str(tmp_path), "--replication-log", "4", "--replica-id", "r1"], {})
    reached = cfg.etcd_config()
    assert reached is not None and reached.endpoints == (("127.0.0.1", 2379),) and reached.tls is None
    assert cfg.replica_id == "r1"


def test_etcd_off_loopback_needs_the_private_network_flag(tmp_path: Path) -> None:
    """Containers reach etcd by its service name: allowed only when the operator says the network is private (the
    adapter speaks plain HTTP without auth)."""
    flags = ["--etcd", "http://etcd:2379", "--checkpoint-dir", str(tmp_path), "--replication-log", "4"]
    with pytest.raises(ConfigError, match="--etcd-private-network true"):
        parse(["--insecure", *flags], {})
    for cfg in (
        parse(["--insecure", *flags, "--etcd-private-network", "true"], {}),
        parse(["--insecure", *flags], {"DILOCO_ETCD_PRIVATE_NETWORK": "1"}),
    ):
        etcd = cfg.etcd_config()
        assert etcd is not None and etcd.endpoints == (("etcd", 2379),)
    assert parse_etcd_endpoints("http://10.0.0.1:2379", private_network=True) == ("http", (("10.0.0.1", 2379),))
    with pytest.raises(ConfigError, match="HOST:PORT"):  # still one well-formed endpoint
        parse_etcd_endpoints("etcd:2379", private_network=True)
    with pytest.raises(ConfigError, match="etcd_private_network"):
        CoordinatorServiceConfig(etcd_private_network="yes")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`diloco certs --etcd`'s folder, and a file that is no PEM at all."""
    d = tmp_path_factory.mktemp("pki")
    write_bundle(d, clients=[], hosts=("localhost", "127.0.0.1"), tokens=False, etcd=True)
    (d / "garbage.pem").write_text("not a certificate\n")
    return d


def replica_flags(tmp_path: Path, etcd: str, *extra: str) -> list[str]:
    return ["--insecure", "--etcd", etcd, "--checkpoint-dir", str(tmp_path), "--replication-log", "4", *extra]


def test_etcd_over_https_takes_its_ca_and_a_client_certificate(tmp_path: Path, pki: Path) -> None:
    """https: etcd's certificate is checked against --etcd-ca-file; a client certificate (etcd with
    --client-cert-auth) lets etcd tell who writes, so it may then be off loopback without --etcd-private-network."""
    ca, cert, key = str(pki / "ca.pem"), str(pki / "coordinator.pem"), str(pki / "coordinator.key")
    mutual = ("--etcd-ca-file", ca, "--etcd-cert-file", cert, "--etcd-key-file", key)
    etcd = parse(replica_flags(tmp_path, "https://127.0.0.1:2379, https://localhost:2380", *mutual), {}).etcd_config()
    assert etcd is not None and etcd.scheme == "https" and etcd.tls == EtcdTls(ca, cert, key)
    assert etcd.endpoints == (("127.0.0.1", 2379), ("localhost", 2380))
    etcd = parse(replica_flags(tmp_path, "https://etcd:2379", *mutual), {}).etcd_config()
    assert etcd is not None and etcd.endpoints == (("etcd", 2379),) and etcd.tls is not None
    env = {"DILOCO_ETCD_CA_FILE": ca}  # the CA alone (etcd without client certificates), from the environment
    etcd = parse(replica_flags(tmp_path, "https://127.0.0.1:2379"), env).etcd_config()
    assert etcd is not None and etcd.tls == EtcdTls(ca) and etcd.tls.client_cert is None


@pytest.mark.parametrize(
    ("etcd", "files", "match"),
    [
        ("https://127.0.0.1:2379", {}, "etcd over https needs the CA .* --etcd-ca-file FILE"),
        ("https://127.0.0.1:2379", {"cert": "coordinator.pem", "key": "coordinator.key"}, "--etcd-ca-file FILE"),
        ("http://127.0.0.1:2379", {"ca": "ca.pem"}, "^--etcd-ca-file: for etcd over https"),
        ("", {"cert": "coordinator.pem", "key": "coordinator.key"}, "--etcd-cert-file, --etcd-key-file: for etcd"),
        ("https://127.0.0.1:2379", {"ca": "missing.pem"}, "--etcd-ca-file: cannot read .*missing.pem"),
        ("https://127.0.0.1:2379", {"ca": "."}, "--etcd-ca-file: cannot read"),  # a folder: unreadable as a file
        ("https://127.0.0.1:2379", {"ca": "garbage.pem"}, "--etcd-ca-file: .*garbage.pem' holds no PEM CA"),
        ("https://127.0.0.1:2379", {"ca": "ca.pem", "cert": "coordinator.pem"}, "without --etcd-key-file"),
        ("https://127.0.0.1:2379", {"ca": "ca.pem", "key": "coordinator.key"}, "^--etcd-key-file is given without"),
        (
            "https://127.0.0.1:2379",
            {"ca": "ca.pem", "cert": "missing.pem", "key": "coordinator.key"},
            "--etcd-cert-file: cannot read",
        ),
        (
            "https://127.0.0.1:2379",
            {"ca": "ca.pem", "cert": "coordinator.pem", "key": "etcd.key"},  # another certificate's key
            "--etcd-cert-file/--etcd-key-file: .* not a PEM certificate and its own private key",
        ),
        ("https://10.0.0.1:2379", {"ca": "ca.pem"}, "https without a client certificate"),
    ],
)
def test_bad_etcd_tls_settings_are_refused_naming_the_flag(
    tmp_path: Path, pki: Path, etcd: str, files: dict[str, str], match: str
) -> None:
    flags = [a for kind, name in files.items() for a in (f"--etcd-{kind}-file", str(pki / name))]
    if not etcd:
        flags = ["--insecure", *flags]
    with pytest.raises(ConfigError, match=match):
        parse(replica_flags(tmp_path, etcd, *flags) if etcd else flags, {})


def test_learner_addresses_move_to_the_named_leader_else_round_robin() -> None:
    a, b, c = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"
    now = [100.0]
    cfg = WorkerConfig(coordinator=f"{a}, {b},{c}")
    coords = Coordinators(cfg.coordinators, cfg.security, who="worker", log=lambda: _Log(), clock=lambda: now[0])
    try:
        assert coords.address == a and coords.addresses == (a, b, c)
        assert coords.failover("connection refused", tried=a)  # True: the next try goes elsewhere
        assert coords.address == b
        # the same outage seen by another thread: not moved again, but its next try goes to another address too
        assert coords.failover("connection refused", tried=a) and coords.address == b
        now[0] += MIN_DWELL_S
        # past the dwell too: an error from the address already left says nothing of b, hint or not
        assert coords.failover("connection refused", tried=a) and coords.address == b
        assert coords.failover(f"not the leader; leader is at {c}", tried=a) and coords.address == b
        assert coords.moves == 1
        now[0] -= MIN_DWELL_S
        assert not coords.failover("connection refused", tried=b)  # within the dwell: b again, backoff grows
        now[0] += MIN_DWELL_S
        assert coords.failover("", tried=b)
        assert coords.address == c
        coords.failover(f"not the leader; leader is at {a}")  # a named leader: at once
        assert coords.address == a and coords.moves == 3
        assert not coords.failover(f"not the leader; leader is at {a}", tried=a)  # already there
        assert coords.address == a and coords.moves == 3
        assert callable(coords.Register)  # the RPCs are the current stub's
    finally:
        coords.close()
    with pytest.raises(ConfigError, match="up to 8"):
        WorkerConfig(coordinator=",".join(f"127.0.0.1:{p}" for p in range(1, 10)))
    with pytest.raises(ConfigError, match="HOST:PORT"):
        WorkerConfig(coordinator=f"{a},nohost")


class _Log:
    def warning(self, *_a: object, **_k: object) -> None:
        pass


def test_a_leader_hint_that_breaks_the_security_rules_is_not_followed() -> None:
    a, b = "127.0.0.1:7001", "127.0.0.1:7002"
    warnings: list[str] = []

    class Log:
        def warning(self, event: str, **_k: object) -> None:
            warnings.append(event)

    cfg = WorkerConfig(coordinator=f"{a},{b}")
    coords = Coordinators(cfg.coordinators, cfg.security, who="worker", log=lambda: Log())  # type: ignore[arg-type,return-value]
    try:
        coords.failover("not the leader; leader is at 10.1.2.3:7000")  # plaintext off loopback: refused
        assert coords.address == b and "worker.leader_hint_refused" in warnings
    finally:
        coords.close()


def password_file(tmp_path: Path, content: bytes | str = "a pass phrase\n", name: str = "etcd.password") -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def test_an_etcd_user_reads_its_password_from_a_file(tmp_path: Path, pki: Path) -> None:
    """--etcd-user and --etcd-password-file (or DILOCO_ETCD_USER/_PASSWORD_FILE): the file is read at start, its
    newline dropped; the password is in no repr. Over https a user lets etcd tell who writes, like a client
    certificate, so it may be off loopback without --etcd-private-network."""
    path = password_file(tmp_path)
    user = ("--etcd-user", "coordinator", "--etcd-password-file", path)
    cfg = parse(replica_flags(tmp_path, "http://127.0.0.1:2379", *user), {})
    etcd = cfg.etcd_config()
    assert etcd is not None and etcd.auth == EtcdAuth("coordinator", path) and etcd.auth.password == "a pass phrase"
    assert "a pass phrase" not in repr(etcd) and "a pass phrase" not in repr(cfg)
    env = {"DILOCO_ETCD_USER": "coordinator", "DILOCO_ETCD_PASSWORD_FILE": password_file(tmp_path, "pw\r\n", "crlf")}
    etcd = parse(replica_flags(tmp_path, "https://etcd:2379", "--etcd-ca-file", str(pki / "ca.pem")), env).etcd_config()
    assert etcd is not None and etcd.endpoints == (("etcd", 2379),) and etcd.tls == EtcdTls(str(pki / "ca.pem"))
    assert etcd.auth is not None and etcd.auth.user == "coordinator" and etcd.auth.password == "pw"
    etcd = parse(replica_flags(tmp_path, "http://127.0.0.1:2379"), {}).etcd_config()
    assert etcd is not None and etcd.auth is None


@pytest.mark.parametrize(
    ("etcd", "user", "content", "match"),
    [
        ("http://127.0.0.1:2379", "coordinator", None, "--etcd-user is given without --etcd-password-file"),
        ("http://127.0.0.1:2379", "", "pw\n", "--etcd-password-file is given without --etcd-user"),
        ("", "coordinator", "pw\n", "--etcd-user and --etcd-password-file are for etcd leadership; give --etcd"),
        ("http://127.0.0.1:2379", "coordinator", "missing", r"--etcd-password-file: cannot read .*missing.* \(No such"),
        ("http://127.0.0.1:2379", "coordinator", "folder", "--etcd-password-file: .* is not a file"),
        ("http://127.0.0.1:2379", "coordinator", "", "--etcd-password-file: .* is empty; write etcd's password"),
        ("http://127.0.0.1:2379", "coordinator", "\n", "--etcd-password-file: .* is empty"),
        ("http://127.0.0.1:2379", "coordinator", "x" * 5000, "holds more than 4096 bytes"),
        ("http://127.0.0.1:2379", "coordinator", "secret\nsecond line\n", "alone, on one line of printable"),
        ("http://127.0.0.1:2379", "coordinator", b"\xff\xfe\n", "is not UTF-8 text"),
        ("http://127.0.0.1:2379", " coordinator", "pw\n", "--etcd-user must be printable, without spaces around"),
        ("http://10.0.0.1:2379", "coordinator", "pw\n", "plain HTTP, even with --etcd-user .*travel in clear"),
    ],
    ids=[
        "user-without-file",
        "file-without-user",
        "without-etcd",
        "missing-file",
        "folder",
        "empty",
        "only-a-newline",
        "too-large",
        "two-lines",
        "not-utf8",
        "user-with-spaces",
        "http-off-loopback",
    ],
)
def test_bad_etcd_user_settings_are_refused_naming_the_flag(
    tmp_path: Path, etcd: str, user: str, content: bytes | str | None, match: str
) -> None:
    """Each refused at start (exit 2 from `python -m services.coordinator`, before anything is served), the message
    naming the flag and never the file's content."""
    flags = ["--etcd-user", user] if user else []
    if content == "missing":
        flags += ["--etcd-password-file", str(tmp_path / "missing")]
    elif content == "folder":
        flags += ["--etcd-password-file", str(tmp_path)]
    elif content is not None:
        flags += ["--etcd-password-file", password_file(tmp_path, content)]
    argv = replica_flags(tmp_path, etcd, *flags) if etcd else ["--insecure", *flags]
    with pytest.raises(ConfigError, match=match) as refused:
        parse(argv, {})
    assert "secret" not in str(refused.value)


def test_a_bad_password_file_exits_2_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.coordinator.__main__ import main

    flags = ("--etcd-user", "coordinator", "--etcd-password-file", password_file(tmp_path, ""))
    assert main(replica_flags(tmp_path, "http://127.0.0.1:2379", *flags), {}) == 2
    assert "configuration error: --etcd-password-file: " in capsys.readouterr().err
