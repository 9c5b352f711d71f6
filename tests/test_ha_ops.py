"""Operating coordinator replicas (issue #14), in process on port 0 through real channels: `diloco ctl` and healthd
follow the leader among several addresses (a replica's stand-in naming the leader, an address nobody listens on),
GetStatus and the metrics show leadership and the standbys with their lag, and StepDown's refusals, including those
of a replica leading under a real etcd (no standby; a standby that does not catch up in time: it goes on leading).
The step-down itself, with real replicas as processes, is in tests/test_ha_stepdown.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from diloco.cli.ctl import render_ha
from diloco.cli.main import main
from diloco.errors import ConfigError, not_leader
from diloco.ha.etcd_server import EtcdServer
from diloco.rpc.server import channel
from diloco.task.params import flatten_params
from diloco.v1 import coordinator_pb2_grpc, replication_pb2_grpc
from diloco.v1 import replication_pb2 as rpb
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.ha import HaReplica, NotLeaderServer, free_port
from services.coordinator.server import CoordinatorServer
from services.coordinator.standby import StandbyConfig, StandbyFollower
from services.healthd.server import HealthdServer
from tests.support import (
    DEAD_AFTER_S,
    Beater,
    CoordinatorEndpoint,
    Env,
    code_of,
    healthd_config,
    make_upload,
    pb,
    register,
    submit,
    tiny_task,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)
LEADER_ELSEWHERE = "127.0.0.1:7001"


@pytest.fixture
def standin() -> Iterator[Callable[[str], str]]:
    """`make(hint)`: a replica's stand-in answering UNAVAILABLE "not the leader; leader is at <hint>"; its address."""
    made: list[NotLeaderServer] = []

    def make(hint: str) -> str:
        cfg = CoordinatorServiceConfig(task=tiny_task(), port=free_port("127.0.0.1"))
        server = NotLeaderServer(cfg, lambda: hint)
        server.start()
        made.append(server)
        return f"127.0.0.1:{cfg.port}"

    yield make
    for server in made:
        server.stop()


def nobody() -> str:
    """An address nobody listens on (connection refused: UNAVAILABLE)."""
    return f"127.0.0.1:{free_port('127.0.0.1')}"


def ctl(addresses: str, *args: str, timeout_s: str = "5") -> list[str]:
    return ["ctl", "--coordinator", addresses, "--insecure", "--timeout-s", timeout_s, *args]


def reply(out: str) -> dict[str, object]:
    """The pretty-printed JSON reply, after any JSON log lines the in-process server wrote to stdout."""
    doc: dict[str, object] = json.loads(out[out.index("{\n") :])
    return doc


# --- diloco ctl -----------------------------------------------------------------------------------------------------


def test_ctl_follows_the_leader_named_by_a_standby_or_past_an_unreachable_address(
    plain_coordinator: CoordinatorServer, standin: Callable[[str], str], capsys: pytest.CaptureFixture[str]
) -> None:
    leader = plain_coordinator.address
    standby = standin(leader)
    plain_coordinator.core.register("w0", 0.0)
    for addresses in (f"{standby},{leader}", f"{nobody()},{leader}", f"{nobody()},{standby}", standby):
        assert main(ctl(addresses, "status", "--json")) == 0, capsys.readouterr().err
        out = capsys.readouterr()
        assert reply(out.out)["live_workers"] == 1
        assert "ctl.coordinator_moved" in out.err  # said on stderr: stdout holds the reply alone
    assert main(ctl(f"{standby},{nobody()}", "pause")) == 0  # an admin call follows the hint too
    assert plain_coordinator.core.paused


def test_ctl_says_why_when_no_address_leads(standin: Callable[[str], str], capsys: pytest.CaptureFixture[str]) -> None:
    lost = standin("")  # "the leader is not known yet"
    assert main(ctl(f"{lost},{nobody()}", "status", timeout_s="1")) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err
    with pytest.raises(SystemExit, match=r"--coordinator: .*'nohost' is not one"):
        main(ctl("127.0.0.1:1,nohost", "status"))
    with pytest.raises(SystemExit, match="--timeout-s"):
        main(ctl("127.0.0.1:1", "status", timeout_s="nan"))


# --- GetStatus, metrics ---------------------------------------------------------------------------------------------


def follow_silently(env: Env, replica_id: str) -> grpc.Future:  # type: ignore[type-arg]
    """A standby that opens the round log and never acknowledges anything (a stalled one)."""
    stub = replication_pb2_grpc.ReplicationStub(env.chan)
    req = rpb.FollowLogRequest(replica_id=replica_id, fingerprint=env.server.task.fingerprint)
    call = stub.FollowLog(req)
    next(call)  # the snapshot's header: the leader counts it as a follower now
    return call  # type: ignore[no-any-return]


def test_status_and_metrics_show_each_standby_and_its_lag(
    start: Callable[..., Env], capsys: pytest.CaptureFixture[str]
) -> None:
    env = start(replication_log=4, min_quorum=1, expected_workers=1)
    metric = env.server.metrics.registry.get_sample_value
    ha = env.stub.GetStatus(pb.GetStatusRequest(), timeout=5).ha
    assert ha.is_leader and ha.leader_address == env.server.address and ha.leader_epoch == 0 and not ha.replicas
    assert metric("diloco_is_leader") == 1 and metric("diloco_leader_epoch") == 0

    numel = flatten_params(env.server.task.model_fn(0)).numel()
    chan = channel(env.server.address)
    standby = StandbyFollower(StandbyConfig("standby-1"), chan, fingerprint=env.server.task.fingerprint, numel=numel)
    stalled = follow_silently(env, "standby-2")
    standby.start()
    try:

        def replicas() -> dict[str, pb.ReplicaStatus]:
            return {r.replica_id: r for r in env.stub.GetStatus(pb.GetStatusRequest(), timeout=5).ha.replicas}

        wait_for(
            "standby-1 acknowledges version 0",
            lambda: "standby-1" in replicas() and replicas()["standby-1"].HasField("acked_version"),
        )
        reg = register(env, "a")
        for i in range(2):
            header, data, _ = make_upload(env, reg, f"s{i}", seed=i)
            submit(env, header, data)
        wait_for("standby-1 holds version 2", lambda: replicas()["standby-1"].acked_version == 2)
        got = replicas()
        assert got["standby-1"].lag_versions == 0 and not got["standby-1"].lagging
        assert not got["standby-2"].HasField("acked_version") and got["standby-2"].lag_versions == 3  # holds none
        assert metric("diloco_replica_lag_versions", {"replica": "standby-1"}) == 0
        assert metric("diloco_replica_lag_versions", {"replica": "standby-2"}) == 3
        ha = env.stub.GetStatus(pb.GetStatusRequest(), timeout=5).ha
        assert ha.log_version == 2
        # the default byte cap is a snapshot's tensors, Θ and the momentum: two entries (Δ and bookkeeping each)
        # are more, so the log holds the newest alone
        assert ha.log_max_bytes == metric("diloco_replication_log_max_bytes") == 2 * 4 * numel
        assert (ha.log_oldest_version, ha.log_entries) == (1, 1) and metric("diloco_replication_log_entries") == 1
        assert 4 * numel < ha.log_bytes == metric("diloco_replication_log_bytes") < 2 * 4 * numel

        assert main(ctl(env.server.address, "status")) == 0
        out = capsys.readouterr().out
        assert "high availability" in out and "standby-1" in out and "in sync" in out
        assert "version 2 (1 entry)" in out and "kept at most" in out
    finally:
        stalled.cancel()
        standby.stop()
        chan.close()
    wait_for("the standbys leave", lambda: not env.stub.GetStatus(pb.GetStatusRequest(), timeout=5).ha.replicas)
    assert metric("diloco_replica_lag_versions", {"replica": "standby-1"}) is None  # no series for one gone


def test_a_coordinator_without_standbys_or_etcd_shows_no_ha(plain_coordinator: CoordinatorServer) -> None:
    with channel(plain_coordinator.address) as ch:
        status = coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
    assert not status.HasField("ha")
    assert plain_coordinator.metrics.registry.get_sample_value("diloco_is_leader") is None


def test_ctl_status_says_which_version_is_held_back_for_a_standby() -> None:
    """--when-no-standby wait: a version too few standbys acknowledged is held back; ctl status names it and for how
    long, and what the operator can do (the field is filled by the leader: tests/test_ha_durability.py)."""
    console = Console(record=True, width=200)
    render_ha(console, pb.HaStatus(replica_id="a", is_leader=True, leader_epoch=3, holding_version=7, held_s=12.5))
    out = console.export_text()
    assert "held back" in out and "version 7 for 12.5 s" in out and "start or mend a standby" in out
    render_ha(console, pb.HaStatus(replica_id="a", is_leader=True, leader_epoch=3))
    assert "held back" not in console.export_text()


# --- StepDown's refusals --------------------------------------------------------------------------------------------


def test_step_down_is_refused_without_etcd_on_a_replica_that_does_not_lead_and_with_a_bad_reason(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    code, details = code_of(lambda: env.stub.StepDown(pb.StepDownRequest(reason="upgrade"), timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--etcd" in details
    code, details = code_of(lambda: env.stub.StepDown(pb.StepDownRequest(reason="x" * 2000), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "StepDownRequest.reason" in details

    def fenced() -> None:
        raise not_leader(LEADER_ELSEWHERE)

    env.server.state.fence = fenced
    code, details = code_of(lambda: env.stub.StepDown(pb.StepDownRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE and details == f"not the leader; leader is at {LEADER_ELSEWHERE}"
    env.server.state.fence = None
    assert main(ctl(env.server.address, "step-down")) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err


def test_a_leader_refuses_to_step_down_when_no_standby_could_take_over_and_goes_on_leading(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    cfg = CoordinatorServiceConfig(
        task=tiny_task(),
        eval_every=0,
        etcd=etcd_server.url,
        replica_id="solo",
        checkpoint_dir=str(tmp_path / "ckpt"),
        replication_log=4,
        replica_ack_timeout_s=0.5,
    )
    replica = HaReplica(cfg)
    runner = threading.Thread(target=replica.run, name="replica")
    runner.start()
    try:
        wait_for("the replica leads", lambda: replica.server is not None, timeout_s=30)
        assert replica.server is not None
        with channel(replica.address) as ch:
            env = Env(replica.server, coordinator_pb2_grpc.CoordinatorStub(ch), ch, [])
            code, details = code_of(lambda: env.stub.StepDown(pb.StepDownRequest(reason="upgrade"), timeout=10))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("no standby follows")
            stalled = follow_silently(env, "stalled")  # follows, never acknowledges
            try:
                code, details = code_of(lambda: env.stub.StepDown(pb.StepDownRequest(), timeout=10))
                assert code == grpc.StatusCode.FAILED_PRECONDITION
                assert "no standby acknowledged version 0 within 0.5 s (stalled lag 1)" in details
            finally:
                stalled.cancel()
            register(env, "after")  # the fence is lifted: it takes learners again
            ha = env.stub.GetStatus(pb.GetStatusRequest(), timeout=5).ha
            assert ha.is_leader and ha.replica_id == ha.leader_id == "solo" and ha.leader_epoch >= 1
        assert not replica.stepped_down and runner.is_alive()
    finally:
        replica.stop()
        runner.join(30)


# --- healthd ---------------------------------------------------------------------------------------------------------


def test_healthd_reports_deaths_to_the_leader_a_standby_names(standin: Callable[[str], str]) -> None:
    coordinator = CoordinatorEndpoint()
    standby = standin(coordinator.address)
    server = HealthdServer(healthd_config(coordinator_address=f"{standby},{coordinator.address}"))
    server.start()
    b = Beater(server.address, "w1")
    try:
        b.wait_acks(3)
        b.kill()
        (report,) = coordinator.recorder.wait_failures(1, timeout_s=DEAD_AFTER_S + 5)
        assert report.request.worker_id == "w1"
        assert server.reporter is not None and server.reporter.addresses == (standby, coordinator.address)
    finally:
        b.close()
        server.stop(0)
        coordinator.stop()


def test_healthd_takes_a_list_of_coordinator_addresses() -> None:
    cfg = healthd_config(coordinator_address="127.0.0.1:1,127.0.0.1:2")
    assert cfg.coordinators == ("127.0.0.1:1", "127.0.0.1:2")
    assert healthd_config(coordinator_address="").coordinators == ()
    for bad in ("127.0.0.1:1,nohost", " 127.0.0.1:1", ",".join(f"127.0.0.1:{p}" for p in range(1, 10))):
        with pytest.raises(ConfigError, match="coordinator_address"):
            healthd_config(coordinator_address=bad)
