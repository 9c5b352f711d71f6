"""Operating coordinator replicas under etcd leadership (issue #14), with real processes: a real etcd
(diloco/ha/etcd_server.py), two coordinators started with `--etcd` (the second follows the first as a hot standby with
`--sync-replicas 1`), healthd and two learners, every one of them given both coordinator addresses. `diloco ctl`
(given the standby's address first) shows the leader, its epoch and the standby's lag, and the leader's metrics say
the same; `diloco ctl step-down` hands leadership to the standby, which takes over at the old leader's newest
version while the old leader exits 0; training goes on under the new leader, ctl and healthd follow it by themselves
(healthd reports a killed learner there), and with no standby left the new leader refuses to step down."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from diloco.cli.main import main
from diloco.cluster import (
    TINY_TASK_ARGS,
    ClusterConfig,
    LocalCluster,
    LogFollower,
    Proc,
    ledger_check,
    wait_for,
)
from diloco.ha.etcd_server import EtcdServer
from diloco.rpc.server import channel
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support import Events, scrape, spawn_replica

TARGET = 1000  # not reached: the test ends once the new leader has made rounds of its own


def ctl(capsys: pytest.CaptureFixture[str], addresses: str, *args: str) -> tuple[int, Any, str]:
    """`diloco ctl --json ...` in this process: its exit status, its reply (JSON) and what it said on stderr."""
    code = main(["ctl", "--coordinator", addresses, "--insecure", "--json", *args])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else None, out.err


@pytest.mark.timeout(150)
def test_step_down_moves_leadership_and_ctl_healthd_and_learners_follow(
    etcd_server: EtcdServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    cfg = ClusterConfig(
        workers=2,
        mode="decoupled",
        outer_steps=TARGET,
        local_steps=10,
        min_local_steps=2,
        min_quorum=1,
        checkpoint_every=4,
        run_dir=tmp_path / "run",
        task_args=TINY_TASK_ARGS,
        insecure=True,
    )
    with LocalCluster(cfg) as cluster:
        cluster.healthd_port = cluster.bound_port(cluster.start_healthd(), "healthd.started", 30)

        def replica(name: str) -> Proc:
            return spawn_replica(cluster, etcd_server, name, "--metrics-port", "0")

        a = Events(cfg.run_dir / "coord-a.log", replica("coord-a"))
        promoted_a = wait_for("coord-a leads", lambda: a.first("replica.promoted"), timeout_s=60, interval_s=0.05)
        a_addr, epoch_a = str(promoted_a["address"]), int(str(promoted_a["epoch"]))
        b = Events(cfg.run_dir / "coord-b.log", replica("coord-b"))
        wait_for("coord-b follows coord-a", lambda: b.first("replication.snapshot_loaded"), timeout_s=60)
        b_addr = str(wait_for("coord-b's address", lambda: b.first("replica.started"))["address"])
        standby_first, leader_first = f"{b_addr},{a_addr}", f"{a_addr},{b_addr}"

        cluster.stop_child("healthd", grace_s=10)  # again, on its port, reporting to both (the standby first)
        health = Events(cfg.run_dir / "healthd.log", cluster.start_healthd(standby_first))
        cluster.wait_serving(cluster.healthd_address, 30)
        cfg.worker_args.update({i: ("--coordinator", leader_first) for i in range(cfg.workers)})
        for i in range(cfg.workers):
            cluster.start_worker(i)

        # ctl asks the standby first and follows its hint: the leader, its epoch and the standby's lag
        def in_sync() -> Any:
            code, status, err = ctl(capsys, standby_first, "status")
            assert code == 0, err
            standbys = {r["replica_id"]: r for r in status["ha"]["replicas"]}
            lag = standbys.get("coord-b", {}).get("lag_versions")
            return status if int(status["version"]) >= 3 and lag is not None and int(lag) == 0 else None

        status = wait_for("version 3 at coord-a, coord-b in sync", in_sync, timeout_s=60, interval_s=0.2)
        ha = status["ha"]
        assert (ha["replica_id"], ha["leader_id"], ha["leader_address"]) == ("coord-a", "coord-a", a_addr)
        assert int(ha["leader_epoch"]) == epoch_a and ha["is_leader"] and ha["sync_replicas"] == 1
        metrics = scrape(int(str(wait_for("a's metrics", lambda: a.first("coordinator.serving"))["metrics_port"])))
        assert metrics[("diloco_leader_epoch", ())] == epoch_a and metrics[("diloco_is_leader", ())] == 1
        assert ("diloco_replica_lag_versions", (("replica", "coord-b"),)) in metrics

        # step down, asked through the standby's address
        asked_at = time.monotonic()
        code, handed, err = ctl(capsys, standby_first, "step-down", "--reason", "upgrade")
        step_down_s = time.monotonic() - asked_at
        assert code == 0, err
        assert handed["leader_id"] == "coord-b" and handed["leader_address"] == b_addr, handed
        epoch_b, version = int(handed["leader_epoch"]), int(handed["version"])
        assert epoch_b > epoch_a and handed["held_by"] == ["coord-b"]
        assert cluster.procs["coord-a"].popen.wait(timeout=30) == 0, "the old leader exits 0 after a step-down"
        assert a.first("replica.stepped_down") is not None
        promoted_b = wait_for("coord-b leads", lambda: b.first("replica.promoted"), timeout_s=10)
        assert int(str(promoted_b["version"])) == version, "the standby took over at the old leader's newest version"
        assert int(str(promoted_b["epoch"])) == epoch_b

        # training goes on at coord-b; ctl finds it past the old leader's address, now dead
        def after(v: int) -> Any:
            code, status, err = ctl(capsys, leader_first, "status")
            assert code == 0, err
            return status if int(status["version"]) >= v else None

        status = wait_for("two rounds at coord-b", lambda: after(version + 2), timeout_s=60, interval_s=0.2)
        ha = status["ha"]
        assert (ha["leader_id"], ha["leader_address"], int(ha["leader_epoch"])) == ("coord-b", b_addr, epoch_b)
        assert ha["is_leader"] and ha["replicas"] == []
        resumed_at = next(int(str(f["version"])) for f in b.all("round.closed") if int(str(f["version"])) > version)

        # healthd follows too: a learner killed now is reported to coord-b, which knows it
        cluster.kill("worker1")

        def reported() -> dict[str, object] | None:
            return next(
                (
                    f
                    for f in health.all("node.reported")
                    if str(f["node_id"]).startswith("worker1-") and f["known"] and f["coordinator"] == b_addr
                ),
                None,
            )

        wait_for("healthd reports worker1's death to coord-b", reported, timeout_s=30)

        # nobody follows coord-b: a step-down is refused and says what to do
        code, _, err = ctl(capsys, leader_first, "step-down")
        assert code == 1 and "FAILED_PRECONDITION" in err and "no standby follows" in err, err

        with channel(b_addr) as ch:
            ledger = coordinator_pb2_grpc.CoordinatorStub(ch).GetLedger(coordinator_pb2.GetLedgerRequest(), timeout=5)
        assert not ledger_check(ledger), "exactly-once ledger broken"
        for i in range(cfg.workers):
            lines = LogFollower(cfg.run_dir / f"worker{i}.log").read()
            seen = [int(str(x.fields["version"])) for x in lines if x.event == "worker.broadcast_received"]
            assert seen == sorted(seen), f"worker{i} received a version that went backwards: {seen}"
        print(
            f"step-down: coord-a (epoch {epoch_a}) handed version {version} to coord-b (epoch {epoch_b}); the call "
            f"took {step_down_s:.2f} s, coord-b promoted {promoted_b['seconds']} s, first round there version "
            f"{resumed_at}; whole test {time.monotonic() - started:.1f} s"
        )
