"""What a leader does when its standby goes (issue #14's follow-up, `--when-no-standby`), and what a standby's
metrics say, with real processes: a real etcd (diloco/ha/etcd_server.py), two coordinators started with `--etcd`,
`--sync-replicas 1` and `--metrics-port`, healthd and two learners given both addresses.

The standby is SIGKILLed mid-run. Under `publish` (the default: availability) the leader goes on publishing versions
no standby holds (`replication.degraded`), which a second failure would lose. Under `wait` (durability) it holds the
next version back: no learner receives it, however long (here well past `--replica-ack-timeout-s`), and the time is
counted; once the standby is restarted (as a supervisor would) and acknowledges it, the version goes out. In both, the
standby's metrics port says what it does (role, applied version, lag, epoch, snapshots), and after the leader is
killed the same port serves the promoted leader's metrics."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from diloco.cluster import LocalCluster, LogFollower, Proc, wait_for
from diloco.ha.etcd_server import EtcdServer
from diloco.rpc.server import channel
from diloco.v1 import coordinator_pb2 as pb
from diloco.v1 import coordinator_pb2_grpc
from services.coordinator.ha import free_port
from tests.support import Events, ha_cluster_config, healthd_for_replicas, scrape, spawn_replica

TARGET = 1000  # not reached: the test ends once the standby has taken over
ACK_TIMEOUT_S = 2.0  # spawn_replica's --replica-ack-timeout-s
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def roles(m: Samples) -> dict[str, float]:
    return {labels[0][1]: v for (name, labels), v in m.items() if name == "diloco_replica_role"}


def received(run_dir: Path, workers: int) -> list[list[int]]:
    """The versions each learner received, in order."""
    return [
        [
            int(str(x.fields["version"]))
            for x in LogFollower(run_dir / f"worker{i}.log").read()
            if x.event == "worker.broadcast_received"
        ]
        for i in range(workers)
    ]


def ha_status(address: str) -> pb.HaStatus:
    with channel(address) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5).ha


def newest_received(run_dir: Path, workers: int) -> int:
    return max((max(seen, default=0) for seen in received(run_dir, workers)), default=0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("when", ["publish", "wait"])
def test_a_leader_whose_standby_dies_publishes_or_waits_as_told_and_standby_metrics_follow_the_role(
    etcd_server: EtcdServer, tmp_path: Path, when: str
) -> None:
    cfg = ha_cluster_config(tmp_path, TARGET)
    run = cfg.run_dir
    with LocalCluster(cfg) as cluster:
        ports = healthd_for_replicas(cluster, "coord-a", "coord-b")
        metrics = {name: free_port("127.0.0.1") for name in ports}

        def replica(name: str) -> Proc:
            flags = ("--when-no-standby", when, "--metrics-port", str(metrics[name]))
            return spawn_replica(cluster, etcd_server, name, *flags, port=ports[name])

        a = Events(run / "coord-a.log", replica("coord-a"))
        promoted_a = wait_for("coord-a leads", lambda: a.first("replica.promoted"), timeout_s=60, interval_s=0.05)
        epoch_a, a_addr = int(str(promoted_a["epoch"])), str(promoted_a["address"])
        b = Events(run / "coord-b.log", replica("coord-b"))
        wait_for("coord-b follows coord-a", lambda: b.first("replication.snapshot_loaded"), timeout_s=60)
        b_addr = f"127.0.0.1:{ports['coord-b']}"
        cfg.worker_args.update({i: ("--coordinator", f"{a_addr},{b_addr}") for i in range(cfg.workers)})
        for i in range(cfg.workers):
            cluster.start_worker(i)

        # the standby's metrics: what it does, what it holds, whom it follows; none of a leader's
        def standby_at(version: int) -> Samples | None:
            try:
                m = scrape(metrics["coord-b"])
            except OSError:  # not bound yet (a restarted replica)
                return None
            held = m.get(("diloco_standby_version", ()), -1)
            return m if held >= version and ("diloco_standby_lag_versions", ()) in m else None

        m = wait_for("coord-b holds version 3", lambda: standby_at(3), timeout_s=90, interval_s=0.2)
        assert roles(m) == {"leader": 0.0, "standby": 1.0, "candidate": 0.0}
        assert m[("diloco_standby_epoch", ())] == epoch_a and m[("diloco_standby_snapshots_total", ())] >= 1
        assert 0 <= m[("diloco_standby_lag_versions", ())] <= 1 and m[("diloco_standby_resyncs_total", ())] == 0
        assert not [k for k in m if k[0].startswith("diloco_coordinator_") or k[0] == "diloco_is_leader"]
        m = scrape(metrics["coord-a"])  # the leader's port serves its role and the leader's metrics, one bind
        assert roles(m)["leader"] == 1 and m[("diloco_is_leader", ())] == 1
        assert ("diloco_coordinator_version", ()) in m and ("diloco_standby_version", ()) not in m

        # the standby dies
        b_proc = cluster.procs["coord-b"]
        os.kill(b_proc.popen.pid, signal.SIGKILL)
        b_proc.popen.wait(timeout=10)
        b_held = max(
            int(str(f["version"])) for f in b.all("replication.applied") + b.all("replication.snapshot_loaded")
        )
        degraded = ("diloco_coordinator_degraded_versions_total", ())
        before = scrape(metrics["coord-a"])
        # a loaded machine may have published versions degraded already (a standby late with its ack): judge only
        # versions published after this scrape, which no standby can hold
        degraded_before, published_before = before[degraded], int(before[("diloco_coordinator_version", ())])

        if when == "publish":  # today's behaviour: versions no standby holds reach the learners
            wait_for(
                "a learner receives a version coord-b never held, published after it died",
                lambda: newest_received(run, cfg.workers) > max(b_held + 1, published_before),
                timeout_s=60,
                interval_s=0.2,
            )
            assert scrape(metrics["coord-a"])[degraded] > degraded_before and a.all("replication.degraded")
            assert not a.all("replication.holding")
        else:  # held: nothing past the standby's last version reaches a learner, however long
            holding = wait_for("coord-a holds a version", lambda: a.first("replication.holding"), timeout_s=60)
            held = int(str(holding["version"]))
            assert held <= b_held + 1
            wait_for(
                f"{3 * ACK_TIMEOUT_S:g} s held, counted",
                lambda: scrape(metrics["coord-a"])[("diloco_coordinator_held_seconds_total", ())] >= 3 * ACK_TIMEOUT_S,
                timeout_s=60,
                interval_s=0.2,
            )
            m = scrape(metrics["coord-a"])
            assert m[("diloco_coordinator_holding", ())] == 1 and m[("diloco_coordinator_held_versions_total", ())] >= 1
            assert newest_received(run, cfg.workers) < held, "a learner received a version no standby holds"
            assert max(int(str(f["version"])) for f in a.all("round.closed")) < held
            assert m[degraded] == degraded_before
            ha = ha_status(a_addr)  # what `diloco ctl status` shows the operator
            assert ha.holding_version == held and ha.held_s >= 3 * ACK_TIMEOUT_S, ha

        # the standby comes back (a supervisor's restart) and catches up; a held version then goes out
        b.proc = replica("coord-b")
        if when == "wait":
            released = wait_for(
                "coord-a releases the held version",
                lambda: next((f for f in a.all("replication.released") if int(str(f["version"])) == held), None),
                timeout_s=90,
                interval_s=0.2,
            )
            assert float(str(released["held_s"])) >= 3 * ACK_TIMEOUT_S and released["acked"] == ["coord-b"]
            wait_for("a learner receives the held version", lambda: newest_received(run, cfg.workers) >= held, 60)
            assert scrape(metrics["coord-a"])[("diloco_coordinator_holding", ())] == 0
            assert ha_status(a_addr).holding_version != held
        newest_a = max(int(str(f["version"])) for f in a.all("round.closed"))
        m = wait_for("coord-b is back in step", lambda: standby_at(newest_a), timeout_s=90, interval_s=0.2)
        assert roles(m)["standby"] == 1

        # the leader dies: coord-b's same metrics port now serves a leader's metrics
        os.kill(cluster.procs["coord-a"].popen.pid, signal.SIGKILL)
        cluster.procs["coord-a"].popen.wait(timeout=10)
        promoted_b = wait_for("coord-b leads", lambda: b.first("replica.promoted"), timeout_s=30, interval_s=0.05)
        m = scrape(metrics["coord-b"])
        assert roles(m) == {"leader": 1.0, "standby": 0.0, "candidate": 0.0}
        assert m[("diloco_is_leader", ())] == 1 and m[("diloco_leader_epoch", ())] == int(str(promoted_b["epoch"]))
        assert m[("diloco_coordinator_version", ())] >= newest_a - 1
        # a standby's own series go with the following; its counters stay (the restarted one resumed from its
        # checkpoint: entries only, no snapshot)
        assert ("diloco_standby_version", ()) not in m and ("diloco_standby_snapshots_total", ()) in m

        for i, seen in enumerate(received(run, cfg.workers)):
            assert seen == sorted(seen), f"worker{i} received a version that went backwards: {seen}"
        print(
            f"when-no-standby {when}: coord-b killed holding version {b_held}"
            + (f"; version {held} held {released['held_s']} s until it was back" if when == "wait" else "")
        )
