"""healthd in process on port 0, through real channels. The coordinator side is a minimal real gRPC server (the
generated `CoordinatorServicer`) that records what healthd tells it, so the failure path can be measured.

Timings are short (heartbeat every 0.1 s, suspect after 0.2 s, dead after 0.6 s); every wait is on a condition
or a stream with a deadline."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import structlog

from diloco import log as dlog
from diloco.core.failure import NodeRole, NodeState
from diloco.core.leadership import ANNOUNCED_FOR_S
from diloco.errors import ConfigError
from diloco.v1 import common_pb2, healthd_pb2
from services.healthd.__main__ import main
from services.healthd.config import HealthdConfig, parse
from services.healthd.metrics import HealthdMetrics
from services.healthd.monitor import Monitor
from services.healthd.server import HealthdServer
from tests.support import (
    DEAD_AFTER_S,
    INTERVAL_S,
    WORKER,
    Beater,
    CoordinatorEndpoint,
    healthd_config,
    node_states,
    stub_for,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)

# --- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture
def coordinator() -> Iterator[CoordinatorEndpoint]:
    endpoint = CoordinatorEndpoint()
    yield endpoint
    endpoint.stop()


@pytest.fixture
def healthd(coordinator: CoordinatorEndpoint) -> Iterator[HealthdServer]:
    server = HealthdServer(healthd_config(coordinator_address=coordinator.address))
    server.start()
    yield server
    server.stop(0)


def metric(server: HealthdServer, name: str, **labels: str) -> float:
    value = server.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else float(value)


# --- tests -------------------------------------------------------------------------------------------------------


def test_heartbeats_are_acknowledged_with_state(healthd: HealthdServer) -> None:
    b = Beater(healthd.address, "w1", interval_s=None)
    try:
        for _ in range(3):
            b.send(version=7)
        acks = b.wait_acks(3)
        assert [a.sequence for a in acks] == [1, 2, 3]
        assert {a.state for a in acks} == {healthd_pb2.NODE_STATE_ALIVE}
        assert {a.dead_after_s for a in acks} == {DEAD_AFTER_S}
        assert metric(healthd, "diloco_healthd_heartbeats_total") == 3
        assert metric(healthd, "diloco_healthd_nodes", state="alive") == 1
        # A clean shutdown: the last heartbeat says so; the node is LEFT, never reported.
        b.send(leaving=True)
        assert b.wait_acks(4)[-1].state == healthd_pb2.NODE_STATE_LEFT
    finally:
        b.close()
    assert node_states(healthd) == {"w1": healthd_pb2.NODE_STATE_LEFT}


def test_silent_worker_is_reported_dead_within_the_window(
    healthd: HealthdServer, coordinator: CoordinatorEndpoint
) -> None:
    b = Beater(healthd.address, "w1")
    b.wait_acks(3)
    b.kill()
    killed_at = b.last_sent_at
    (report,) = coordinator.recorder.wait_failures(1, timeout_s=DEAD_AFTER_S + 5)
    detection_s = report.at - killed_at
    # The correctness window: dead_after_s plus scheduling slack, not a performance claim.
    assert DEAD_AFTER_S - 0.05 <= detection_s < DEAD_AFTER_S + 1.5, detection_s
    req = report.request
    assert req.worker_id == "w1" and "no heartbeat" in req.reason
    assert DEAD_AFTER_S <= req.declared_dead_unix_s - req.last_seen_unix_s < DEAD_AFTER_S + INTERVAL_S + 0.3
    assert abs(req.last_seen_unix_s - killed_at) < 0.3
    wait_for("reports_total", lambda: metric(healthd, "diloco_healthd_reports_total") == 1)
    assert metric(healthd, "diloco_healthd_deaths_total") == 1
    assert metric(healthd, "diloco_healthd_detection_seconds_count") == 1
    assert metric(healthd, "diloco_healthd_nodes", state="dead") == 1
    assert metric(healthd, "diloco_healthd_report_failures_total") == 0


def test_metrics_endpoint_serves_the_registry() -> None:
    server = HealthdServer(healthd_config(metrics_port=0))
    server.start()
    try:
        assert server.metrics_port > 0
        b = Beater(server.address, "w1", interval_s=None)
        b.send()
        b.wait_acks(1)
        b.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'diloco_healthd_nodes{state="alive"} 1.0' in text and "diloco_healthd_heartbeats_total 1.0" in text
    finally:
        server.stop(0)


def test_list_nodes_and_only_workers_are_reported(healthd: HealthdServer, coordinator: CoordinatorEndpoint) -> None:
    tp = common_pb2.Throughput(tokens_per_s=1234.5, step_time_s=0.25, device_kind="cpu")
    w = Beater(healthd.address, "w1", throughput=tp)
    c = Beater(healthd.address, "coord", role=healthd_pb2.NODE_ROLE_COORDINATOR)
    try:
        w.wait_acks(2)
        c.wait_acks(2)
        ch, stub = stub_for(healthd)
        with ch:
            nodes = {n.node_id: n for n in stub.ListNodes(healthd_pb2.ListNodesRequest(), timeout=5).nodes}
        assert set(nodes) == {"w1", "coord"}
        assert nodes["w1"].role == WORKER and nodes["coord"].role == healthd_pb2.NODE_ROLE_COORDINATOR
        assert nodes["w1"].state == healthd_pb2.NODE_STATE_ALIVE and nodes["w1"].heartbeats >= 2
        assert nodes["w1"].throughput == tp and not nodes["coord"].HasField("throughput")
        assert abs(nodes["w1"].last_seen_unix_s - time.time()) < 5
        c.kill()
        wait_for("coord dead", lambda: node_states(healthd).get("coord") == healthd_pb2.NODE_STATE_DEAD)
        wait_for("reporter idle", lambda: healthd.reporter is not None and healthd.reporter.idle())
        assert [r.request.worker_id for r in coordinator.recorder.failures] == []  # not a worker
        assert node_states(healthd)["w1"] in (healthd_pb2.NODE_STATE_ALIVE, healthd_pb2.NODE_STATE_SUSPECT)
    finally:
        w.close()
        c.kill()


def test_more_nodes_than_the_default_grpc_thread_pool(healthd: HealthdServer) -> None:
    """Each open heartbeat stream holds a server thread; 40 nodes must all be served at once."""
    beaters = [Beater(healthd.address, f"w{i}", interval_s=None) for i in range(40)]
    try:
        for b in beaters:
            b.send()
        for b in beaters:
            assert b.wait_acks(1)[0].state == healthd_pb2.NODE_STATE_ALIVE
        assert len(node_states(healthd)) == 40
    finally:
        for b in beaters:
            b.close()


def test_watch_node_events_sees_joined_suspect_dead_and_left(healthd: HealthdServer) -> None:
    ch, stub = stub_for(healthd)
    with ch:
        watch = stub.WatchNodeEvents(healthd_pb2.WatchNodeEventsRequest(), timeout=20)
        watch.initial_metadata()  # the subscription exists from here on
        a = Beater(healthd.address, "a")
        leaver = Beater(healthd.address, "b", interval_s=None)
        leaver.send()
        leaver.wait_acks(1)
        leaver.send(leaving=True)
        leaver.wait_acks(2)
        leaver.close()
        a.wait_acks(2)
        a.kill()
        seen: list[tuple[str, int, int, str]] = []
        for ev in watch:
            seen.append((ev.node_id, ev.previous_state, ev.state, ev.reason))
            assert abs(ev.at_unix_s - time.time()) < 5
            if ev.node_id == "a" and ev.state == healthd_pb2.NODE_STATE_DEAD:
                break
        watch.cancel()
    by_node = {n: [(p, s) for (m, p, s, _) in seen if m == n] for n in ("a", "b")}
    st = healthd_pb2
    # On a loaded machine a late heartbeat may add a (suspect, recovered) pair in between; the ends are fixed.
    assert by_node["a"][0] == (st.NODE_STATE_UNSPECIFIED, st.NODE_STATE_ALIVE)
    assert by_node["a"][-2:] == [
        (st.NODE_STATE_ALIVE, st.NODE_STATE_SUSPECT),
        (st.NODE_STATE_SUSPECT, st.NODE_STATE_DEAD),
    ]
    assert set(by_node["a"][1:-2]) <= {
        (st.NODE_STATE_ALIVE, st.NODE_STATE_SUSPECT),
        (st.NODE_STATE_SUSPECT, st.NODE_STATE_ALIVE),
    }
    assert by_node["b"] == [(st.NODE_STATE_UNSPECIFIED, st.NODE_STATE_ALIVE), (st.NODE_STATE_ALIVE, st.NODE_STATE_LEFT)]
    assert next(r for (m, _, _, r) in seen if m == "a") == "joined"
    wait_for("watcher unsubscribed after cancel", lambda: healthd.monitor.hub.subscriber_count() == 0)


def test_watchers_end_when_the_server_stops(coordinator: CoordinatorEndpoint) -> None:
    server = HealthdServer(healthd_config())
    server.start()
    ch, stub = stub_for(server)
    with ch:
        watch = stub.WatchNodeEvents(healthd_pb2.WatchNodeEventsRequest(), timeout=20)
        watch.initial_metadata()
        started = time.monotonic()
        server.stop(5.0)
        assert list(watch) == []  # ends cleanly, without waiting for the grace period
        assert watch.code() == grpc.StatusCode.OK
        assert time.monotonic() - started < 3.0
    server.stop()  # idempotent


def test_a_dead_node_that_heartbeats_again_is_told_to_reregister(
    healthd: HealthdServer, coordinator: CoordinatorEndpoint
) -> None:
    b = Beater(healthd.address, "w1", interval_s=None)
    try:
        b.send()
        b.wait_acks(1)
        coordinator.recorder.wait_failures(1, timeout_s=DEAD_AFTER_S + 5)  # hung, then declared dead
        b.send()
        b.send()
        acks = b.wait_acks(3)
        assert acks[1].state == healthd_pb2.NODE_STATE_DEAD  # "you were declared dead: register again"
        assert acks[2].state == healthd_pb2.NODE_STATE_ALIVE  # healthd only tracks
    finally:
        b.close()


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([{"node_id": "", "role": WORKER, "sequence": 1}], "node_id"),
        ([{"node_id": "w1", "role": healthd_pb2.NODE_ROLE_UNSPECIFIED, "sequence": 1}], "role"),
        ([{"node_id": "w1", "role": 9, "sequence": 1}], "role"),
        (
            [{"node_id": "w1", "role": WORKER, "sequence": 5}, {"node_id": "w1", "role": WORKER, "sequence": 5}],
            "sequence",
        ),
        (
            [{"node_id": "w1", "role": WORKER, "sequence": 5}, {"node_id": "w1", "role": WORKER, "sequence": 4}],
            "sequence",
        ),
        (
            [{"node_id": "w1", "role": WORKER, "sequence": 1}, {"node_id": "w2", "role": WORKER, "sequence": 2}],
            "stream",
        ),
        (
            [
                {
                    "node_id": "w1",
                    "role": WORKER,
                    "sequence": 1,
                    "throughput": common_pb2.Throughput(tokens_per_s=-1.0),
                }
            ],
            "tokens_per_s",
        ),
        (
            [{"node_id": "w1", "role": WORKER, "sequence": 1, "throughput": common_pb2.Throughput(watts=300.0)}],
            "power_source is required",
        ),
        (
            [
                {
                    "node_id": "w1",
                    "role": WORKER,
                    "sequence": 1,
                    "throughput": common_pb2.Throughput(watts=300.0, power_source=42),  # type: ignore[arg-type]
                }
            ],
            "unknown power source enum value 42",
        ),
        (
            [{"node_id": "w1", "role": WORKER, "sequence": 1, "throughput": common_pb2.Throughput(watts=2e5)}],
            "watts",
        ),
    ],
    ids=[
        "empty-node-id",
        "unspecified-role",
        "unknown-role",
        "repeated-sequence",
        "decreasing-sequence",
        "node-switch",
        "negative-throughput",
        "watts-without-source",
        "unknown-power-source",
        "absurd-watts",
    ],
)
def test_bad_heartbeats_are_invalid_argument(
    healthd: HealthdServer, requests: list[dict[str, Any]], message: str
) -> None:
    ch, stub = stub_for(healthd)
    with ch:
        call = stub.Heartbeat(iter([healthd_pb2.HeartbeatRequest(**r) for r in requests]), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
    # A new stream starts its own sequence.
    b = Beater(healthd.address, "w9", interval_s=None)
    b.send()
    assert b.wait_acks(1)[0].state == healthd_pb2.NODE_STATE_ALIVE
    b.close()


def test_coordinator_down_heartbeats_go_on_and_the_report_arrives_later() -> None:
    down = CoordinatorEndpoint()
    port = down.port
    down.stop()  # nothing listens on `port` now
    server = HealthdServer(healthd_config(coordinator_address=f"127.0.0.1:{port}"))
    server.start()
    healthy = Beater(server.address, "healthy")
    victim = Beater(server.address, "victim")
    back: CoordinatorEndpoint | None = None
    try:
        victim.wait_acks(2)
        victim.kill()
        wait_for("a failed report", lambda: metric(server, "diloco_healthd_report_failures_total") >= 1, timeout_s=10)
        # Heartbeats were never held up by the failing reports.
        before = len(healthy.wait_acks(1))
        healthy.wait_acks(before + 3, timeout_s=2.0)
        assert node_states(server)["healthy"] == healthd_pb2.NODE_STATE_ALIVE
        back = CoordinatorEndpoint(port)  # the coordinator comes back on the same address
        (report,) = back.recorder.wait_failures(1, timeout_s=10)
        assert report.request.worker_id == "victim"
        wait_for("reporter idle", lambda: server.reporter is not None and server.reporter.idle())
        assert [r.request.worker_id for r in back.recorder.failures] == ["victim"]  # delivered once
    finally:
        healthy.close()
        server.stop(0)
        if back is not None:
            back.stop()


def test_restarted_healthd_rebuilds_its_table_from_heartbeats(coordinator: CoordinatorEndpoint) -> None:
    first = HealthdServer(healthd_config(coordinator_address=coordinator.address))
    port = first.start()
    b = Beater(first.address, "w1")
    b.wait_acks(2)
    first.stop(0)
    first.stop(0)  # idempotent
    assert b.wait_done() is not None  # the stream broke
    b.pause()
    second = HealthdServer(healthd_config(port=port, coordinator_address=coordinator.address))
    assert second.start() == port
    try:
        ch, stub = stub_for(second)
        with ch:
            watch = stub.WatchNodeEvents(healthd_pb2.WatchNodeEventsRequest(), timeout=10)
            watch.initial_metadata()
            again = Beater(second.address, "w1")  # the node reconnects and keeps going
            ev = next(iter(watch))
            watch.cancel()
        assert (ev.node_id, ev.state, ev.reason) == ("w1", healthd_pb2.NODE_STATE_ALIVE, "joined")
        again.wait_acks(2)
        assert node_states(second) == {"w1": healthd_pb2.NODE_STATE_ALIVE}
        again.close()
        assert coordinator.recorder.failures == []  # nobody was declared dead by the restart
    finally:
        second.stop(0)


def test_throughput_is_forwarded_at_most_once_per_second(
    healthd: HealthdServer, coordinator: CoordinatorEndpoint
) -> None:
    tp = common_pb2.Throughput(
        tokens_per_s=500.0,
        step_time_s=0.5,
        device_kind="cuda:H200",
        watts=612.5,
        power_source=common_pb2.POWER_SOURCE_NVML,  # the learner's power goes along (issue #15)
    )
    b = Beater(healthd.address, "w1", interval_s=None, throughput=tp)
    started = time.monotonic()
    for _ in range(10):
        b.send()
    b.wait_acks(10)
    elapsed = time.monotonic() - started
    with coordinator.recorder.cond:
        assert coordinator.recorder.cond.wait_for(lambda: len(coordinator.recorder.throughput) >= 1, 5)
    wait_for("reporter idle", lambda: healthd.reporter is not None and healthd.reporter.idle())
    if elapsed < 1.0:  # all ten fell in one window
        assert len(coordinator.recorder.throughput) == 1
    got = coordinator.recorder.throughput[0].request
    assert got.worker_id == "w1" and got.throughput == tp
    b.close()


# --- configuration and the process ----------------------------------------------------------------------------


def test_parse_flags_win_over_environment() -> None:
    env = {"DILOCO_DEAD_AFTER_S": "3.5", "DILOCO_COORDINATOR_ADDRESS": "127.0.0.1:7000", "DILOCO_PORT": "7100"}
    env["DILOCO_INSECURE"] = "1"  # plaintext, allowed on loopback only (tests/test_security.py covers TLS)
    cfg = parse(["--port", "7200", "--heartbeat-interval-s", "0.25"], env)
    assert (cfg.port, cfg.heartbeat_interval_s, cfg.dead_after_s) == (7200, 0.25, 3.5)
    assert cfg.coordinator_address == "127.0.0.1:7000" and cfg.metrics_port == -1 and cfg.suspect_after_missed == 2
    assert cfg.detector().suspect_after_s == 0.5
    assert parse([], {"DILOCO_INSECURE": "1"}) == HealthdConfig()
    off = parse([], {"DILOCO_INSECURE": "1", "DILOCO_STALL_AFTER_S": "inf"}).detector()
    assert not off.detects_stalls and HealthdConfig().detector().detects_stalls


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--dead-after-s", "0.5"], {}, "dead_after_s"),
        (["--port", "70000"], {}, "port"),
        (["--port", "abc"], {}, "--port"),
        ([], {"DILOCO_DEAD_AFTER_S": "soon"}, "DILOCO_DEAD_AFTER_S"),
        (["--coordinator-address", "nohostport"], {}, "coordinator_address"),
        (["--report-timeout-s", "0"], {}, "report_timeout_s"),
        (["--log-level", "loud"], {}, "log_level"),
        (["--max-calls", "1"], {}, "max_calls"),
        (["--stall-after-s", "0.2"], {}, "stall_after_s"),  # not above --tick-interval-s (0.25)
        (["--tick-interval-s", "0"], {}, "tick_interval_s"),
        (["--unknown-flag"], {}, "unrecognized"),
    ],
)
def test_config_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv, env)


def test_main_exits_2_on_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dead-after-s", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "dead_after_s" in err


def test_process_starts_serves_and_stops_on_sigterm() -> None:
    env = {**os.environ, "DILOCO_DEAD_AFTER_S": "0.6", "DILOCO_HEARTBEAT_INTERVAL_S": "0.1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.healthd", "--port", "0", "--insecure"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read_lines() -> None:
        for line in stdout:
            lines.put(line)

    reader = threading.Thread(target=read_lines, daemon=True)
    reader.start()
    try:
        started = None
        deadline = time.monotonic() + 20
        while started is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            record = json.loads(line)
            if record.get("event") == "healthd.started":
                started = record
        assert started["service"] == "healthd" and started["dead_after_s"] == 0.6
        proc.send_signal(signal.SIGUSR1)  # every thread's stack to stderr (diloco.signals); the service goes on
        b = Beater(f"127.0.0.1:{started['port']}", "w1", interval_s=None)
        b.send()
        assert b.wait_acks(1)[0].state == healthd_pb2.NODE_STATE_ALIVE
        b.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert proc.stderr is not None and "(most recent call first)" in proc.stderr.read()
        reader.join(5)
        events = []
        while not lines.empty():
            events.append(json.loads(lines.get()).get("event"))
        assert "node.joined" in events and events[-1] == "healthd.stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_a_stall_of_healthd_is_logged_and_counted_and_declares_nobody_dead() -> None:
    """The monitor only passes its clock; when that clock jumps past stall_after_s between two calls (the process
    did not run), the stall is logged `healthd.stalled` with its length and observed in the stall histogram."""
    now = [1000.0]
    metrics = HealthdMetrics()
    cfg = healthd_config()
    with structlog.testing.capture_logs() as logs:
        monitor = Monitor(cfg.detector(), metrics, dlog.get("healthd"), clock=lambda: now[0])
        for node in ("w1", "w2"):
            monitor.heartbeat(node, NodeRole.WORKER)
        now[0] += 9.0  # nothing ran for 9 s; then w1's buffered heartbeat is the first call
        assert monitor.heartbeat("w1", NodeRole.WORKER) is NodeState.ALIVE
        assert {v.node_id: v.state for v in monitor.nodes()} == {"w1": NodeState.ALIVE, "w2": NodeState.ALIVE}
    (stalled,) = [r for r in logs if r["event"] == "healthd.stalled"]
    assert stalled["stall_s"] == 9.0 and stalled["nodes_given_a_fresh_window"] == 2
    assert stalled["resumed_unix_s"] == 1009.0 and stalled["log_level"] == "warning"
    assert not [r for r in logs if r["event"] in ("node.dead", "node.suspect")]
    assert metrics.registry.get_sample_value("diloco_healthd_stall_seconds_count") == 1.0
    assert metrics.registry.get_sample_value("diloco_healthd_stall_seconds_sum") == 9.0
    assert metrics.registry.get_sample_value("diloco_healthd_deaths_total") == 0.0


def test_the_newest_leader_announced_rides_on_every_heartbeat_reply(healthd: HealthdServer) -> None:
    """A replica that has come to lead announces itself; every heartbeat reply then names it, and a deposed
    leader's late announcement (an older epoch) changes nothing."""
    b = Beater(healthd.address, "w1", interval_s=None)
    ch, stub = stub_for(healthd)
    try:
        b.send()
        assert (b.wait_acks(1)[0].leader_epoch, b.acks[0].leader_address) == (0, "")  # none announced yet
        new = healthd_pb2.AnnounceLeaderRequest(epoch=10, address="coordinator-b:50051")
        late = healthd_pb2.AnnounceLeaderRequest(epoch=2, address="coordinator-a:50051")
        for request in (new, late, new):
            reply = stub.AnnounceLeader(request, timeout=5)
            assert (reply.epoch, reply.address) == (10, "coordinator-b:50051")
        b.send()
        ack = b.wait_acks(2)[-1]
        assert (ack.leader_epoch, ack.leader_address) == (10, "coordinator-b:50051")
    finally:
        ch.close()
        b.close()


def test_a_leader_that_stops_announcing_is_no_longer_named(healthd: HealthdServer) -> None:
    """healthd names a leader only `ANNOUNCED_FOR_S` after its last announcement (a leader repeats it every 5 s):
    then none, and a lower epoch may announce (a leadership store whose epochs started over)."""
    skew = [0.0]
    healthd.servicer.clock = lambda: time.monotonic() + skew[0]
    b = Beater(healthd.address, "w1", interval_s=None)
    ch, stub = stub_for(healthd)
    try:
        stub.AnnounceLeader(healthd_pb2.AnnounceLeaderRequest(epoch=10, address="coordinator-b:50051"), timeout=5)
        b.send()
        assert (b.wait_acks(1)[-1].leader_epoch, b.acks[-1].leader_address) == (10, "coordinator-b:50051")
        skew[0] = ANNOUNCED_FOR_S + 1.0  # it went quiet
        b.send()
        assert (b.wait_acks(2)[-1].leader_epoch, b.acks[-1].leader_address) == (0, "")
        restarted = healthd_pb2.AnnounceLeaderRequest(epoch=2, address="coordinator-a:50051")
        reply = stub.AnnounceLeader(restarted, timeout=5)
        assert (reply.epoch, reply.address) == (2, "coordinator-a:50051")
        b.send()
        assert (b.wait_acks(3)[-1].leader_epoch, b.acks[-1].leader_address) == (2, "coordinator-a:50051")
    finally:
        ch.close()
        b.close()


@pytest.mark.parametrize(
    ("epoch", "address", "message"),
    [
        (0, "coordinator-b:50051", "epoch must be"),
        (1 << 63, "coordinator-b:50051", "epoch must be"),
        (1, "", "address must be the leader's HOST:PORT"),
        (1, "coordinator-b", "address must be the leader's HOST:PORT"),
        (1, "coordinator-b:5005100", "address must be the leader's HOST:PORT"),
        (1, "a:1,b:2", "address must be the leader's HOST:PORT"),
        (1, "bad host:1", "address must be the leader's HOST:PORT"),
        (1, "h" * 400 + ":1", "the limit is 260"),
    ],
)
def test_bad_announcements_are_invalid_argument_and_change_nothing(
    healthd: HealthdServer, epoch: int, address: str, message: str
) -> None:
    ch, stub = stub_for(healthd)
    with ch:
        with pytest.raises(grpc.RpcError) as err:
            stub.AnnounceLeader(healthd_pb2.AnnounceLeaderRequest(epoch=epoch, address=address), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
        reply = stub.AnnounceLeader(healthd_pb2.AnnounceLeaderRequest(epoch=1, address="h:1"), timeout=5)
        assert (reply.epoch, reply.address) == (1, "h:1")  # the bad one was not taken


def test_healthds_own_reports_go_to_the_leader_announced() -> None:
    """healthd reports to the first of two replicas until the other announces that it leads; the next death goes
    there at once, with no call failing first (a leader cut off the network would answer none)."""
    a, b = CoordinatorEndpoint(), CoordinatorEndpoint()
    server = HealthdServer(healthd_config(coordinator_address=f"{a.address},{b.address}"))
    server.start()
    try:
        first = Beater(server.address, "w1")
        first.wait_acks(2)
        first.kill()
        assert [r.request.worker_id for r in a.recorder.wait_failures(1, timeout_s=DEAD_AFTER_S + 5)] == ["w1"]
        ch, stub = stub_for(server)
        with ch:
            stub.AnnounceLeader(healthd_pb2.AnnounceLeaderRequest(epoch=5, address=b.address), timeout=5)
        second = Beater(server.address, "w2")
        second.wait_acks(2)
        second.kill()
        assert [r.request.worker_id for r in b.recorder.wait_failures(1, timeout_s=DEAD_AFTER_S + 5)] == ["w2"]
        assert len(a.recorder.failures) == 1  # nothing more went to the replica that no longer leads
    finally:
        server.stop(0)
        a.stop()
        b.stop()
