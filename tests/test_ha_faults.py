"""Coordinator HA under faults other than a kill of the leader (issue #14), with real processes: a real etcd
(diloco/ha/etcd_server.py), two coordinators started with `--etcd` (the loser follows the winner as a hot standby
with `--sync-replicas 1`), healthd and two learners given both coordinator addresses.

- The leader frozen (SIGSTOP) past its lease (a long pause: GC, a migrated VM): the standby takes over under a
  higher epoch; the old leader, resumed (SIGCONT) once that happened, is fenced by its clock alone, closes no round
  and exits 3 within a bound (every etcd call is bounded, and a retiring leader drains only briefly).
- etcd killed while training runs, then restarted on the same data: the leader cannot renew, fences itself and
  retires (exit 3; the test restarts it, as a supervisor would); once etcd is back a replica leads again and the
  job finishes.

Both: the job reaches its target, no learner's received versions go backwards, the ledger holds every committed
range exactly once."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from diloco.cluster import (
    ClusterConfig,
    LocalCluster,
    Proc,
    logged_at,
    wait_for,
)
from diloco.ha.etcd_server import EtcdServer
from diloco.rpc.server import channel
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support import Events, finish_and_check, ha_cluster_config, healthd_for_replicas, spawn_replica

TARGET = 14
# fenced at once after SIGCONT (its lease ran out while it was frozen), then: 1 s drain, final checkpoint, a bounded
# resignation (two etcd calls of at most 0.5 s), process exit; generous for two busy cores
RETIRE_BOUND_S = 8.0
EXIT_RETIRED = 3


@dataclass
class Pair:
    a: Events
    b: Events
    a_addr: str
    b_addr: str
    epoch_a: int


def config(tmp_path: Path) -> ClusterConfig:
    return ha_cluster_config(tmp_path, TARGET)


def start(cluster: LocalCluster, etcd: EtcdServer) -> Pair:
    """healthd, coord-a leading, coord-b following it, and the learners given both addresses."""
    cfg = cluster.cfg
    ports = healthd_for_replicas(cluster, "coord-a", "coord-b")
    a = Events(cfg.run_dir / "coord-a.log", spawn_replica(cluster, etcd, "coord-a", port=ports["coord-a"]))
    promoted = wait_for("coord-a leads", lambda: a.first("replica.promoted"), timeout_s=60, interval_s=0.05)
    b = Events(cfg.run_dir / "coord-b.log", spawn_replica(cluster, etcd, "coord-b", port=ports["coord-b"]))
    wait_for("coord-b follows coord-a", lambda: b.first("replication.snapshot_loaded"), timeout_s=60)
    b_addr = str(wait_for("coord-b's address", lambda: b.first("replica.started"))["address"])
    a_addr = str(promoted["address"])
    cfg.worker_args.update({i: ("--coordinator", f"{a_addr},{b_addr}") for i in range(cfg.workers)})
    for i in range(cfg.workers):
        cluster.start_worker(i)
    return Pair(a, b, a_addr, b_addr, int(str(promoted["epoch"])))


def version_at(address: str) -> int:
    with channel(address) as ch:
        status = coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3)
    return int(status.version)


def freeze_leader(cluster: LocalCluster, p: Pair) -> tuple[Proc, dict[str, object], float]:
    """Once coord-a has published version 4: SIGSTOP it and wait for coord-b to lead under a higher epoch. Returns
    coord-a's process (frozen: the caller resumes or kills it), coord-b's `replica.promoted` line and the time of
    the freeze. coord-a is resumed when coord-b never leads."""
    wait_for("version 4 at coord-a", lambda: version_at(p.a_addr) >= 4, timeout_s=60, interval_s=0.1)
    a_proc = cluster.procs["coord-a"]
    os.kill(a_proc.popen.pid, signal.SIGSTOP)
    frozen_at = time.time()
    try:
        promoted = wait_for("coord-b leads", lambda: p.b.first("replica.promoted"), timeout_s=30, interval_s=0.05)
        assert int(str(promoted["epoch"])) > p.epoch_a
    except BaseException:
        os.kill(a_proc.popen.pid, signal.SIGCONT)
        raise
    return a_proc, promoted, frozen_at


@pytest.mark.timeout(180)
def test_a_leader_frozen_past_its_lease_is_replaced_and_retires_within_a_bound_once_resumed(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    cfg = config(tmp_path)
    with LocalCluster(cfg) as cluster:
        p = start(cluster, etcd_server)
        a_proc, promoted, frozen_at = freeze_leader(cluster, p)
        os.kill(a_proc.popen.pid, signal.SIGCONT)  # at once: a learner's call in flight is answered (not the leader)
        resumed_at, resumed = time.time(), time.monotonic()
        assert a_proc.popen.wait(timeout=RETIRE_BOUND_S + 5) == EXIT_RETIRED
        exited_s = time.monotonic() - resumed
        p.a.proc = None  # it exited on purpose
        retiring = p.a.first("replica.retiring")
        assert retiring is not None and retiring["role"] == "fenced", retiring
        p.a.first("")
        # A check of the lease and the act it guards are two steps: a freeze can fall between them, and no process
        # can close that gap. What must hold is the fence's promise: a round the resumed leader publishes is one the
        # new leader already held when promoted (the standby acked it before the step was published), so no learner
        # gets parameters the new leader lacks; and only the round in flight at the freeze, not a new one.
        late = [f for e, f in p.a.lines if e == "round.closed" and logged_at(f) >= resumed_at]
        held = int(str(promoted["version"]))
        assert len(late) <= 1, f"the frozen leader closed rounds after it was resumed: {late}"
        assert all(int(str(f["version"])) <= held for f in late), (
            f"the frozen leader published a version the new leader (at v{held}) does not hold: {late}"
        )
        assert exited_s < RETIRE_BOUND_S, f"the resumed old leader took {exited_s:.2f} s to exit"
        finish_and_check(cfg, p.b_addr, TARGET)
        print(
            f"frozen leader: coord-b leads {logged_at(promoted) - frozen_at:.2f} s after the SIGSTOP; coord-a, "
            f"resumed, exited 3 after {exited_s:.2f} s"
        )


@pytest.mark.timeout(180)
def test_learners_move_to_a_new_leader_by_healthds_word_while_the_old_one_stays_frozen(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """A frozen leader answers nothing and resets nothing (its kernel still acknowledges every byte), so a learner's
    own calls find it gone only by a keepalive timeout, 10 to 15 s. The new leader announces itself to healthd,
    which names it in every heartbeat reply: each learner moves at its next heartbeat, and the job finishes at the
    new leader while the old one stays frozen."""
    cfg = config(tmp_path)
    with LocalCluster(cfg) as cluster:
        p = start(cluster, etcd_server)
        a_proc, promoted, _ = freeze_leader(cluster, p)
        try:
            announced = wait_for("coord-b announced", lambda: p.b.first("replica.announced"), timeout_s=10)
            assert announced["epoch"] == promoted["epoch"] and announced["address"] == p.b_addr, announced
            learners = [Events(cfg.run_dir / f"worker{i}.log") for i in range(cfg.workers)]
            for i, w in enumerate(learners):
                told = wait_for(f"worker{i} told of coord-b", lambda w=w: w.first("worker.leader_announced"), 10)
                assert told["address"] == p.b_addr and told["epoch"] == promoted["epoch"], told
                moved = wait_for(  # logged just after the line above: it may not be written yet
                    f"worker{i} moved to coord-b",
                    lambda w=w: [f for f in w.all("worker.coordinator_moved") if f["address"] == p.b_addr],
                    timeout_s=5,
                )
                assert moved[0]["hinted"] is True, moved
            finish_and_check(cfg, p.b_addr, TARGET)
        finally:
            os.kill(a_proc.popen.pid, signal.SIGKILL)
        p.a.proc = None  # killed on purpose


@pytest.mark.timeout(180)
def test_etcd_killed_and_restarted_while_training_runs(etcd_server: EtcdServer, tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with LocalCluster(cfg) as cluster:
        p = start(cluster, etcd_server)
        wait_for("version 4 at coord-a", lambda: version_at(p.a_addr) >= 4, timeout_s=60, interval_s=0.1)
        a_proc = cluster.procs["coord-a"]
        a_port = int(p.a_addr.rsplit(":", 1)[1])
        etcd_server.kill()
        killed = time.monotonic()
        # the leader cannot renew: fenced by its clock, it retires; nobody can be elected while etcd is down
        assert a_proc.popen.wait(timeout=RETIRE_BOUND_S + 5) == EXIT_RETIRED
        retired_s = time.monotonic() - killed
        p.a.proc = None
        assert p.b.first("replica.promoted") is None
        etcd_server.start()
        restarted = time.monotonic()
        spawn_replica(cluster, etcd_server, "coord-a", port=a_port)  # the supervisor's restart
        # the standby, in step with coord-a until it retired, takes over; the restarted one joins as a standby
        promoted = wait_for("coord-b leads", lambda: p.b.first("replica.promoted"), timeout_s=60, interval_s=0.1)
        led_s = time.monotonic() - restarted
        assert int(str(promoted["epoch"])) > p.epoch_a
        address = p.b_addr
        finish_and_check(cfg, address, TARGET)
        print(
            f"etcd killed: coord-a retired after {retired_s:.2f} s; after etcd's restart coord-b led within "
            f"{led_s:.2f} s"
        )
