"""Coordinator leadership on a real three-member etcd cluster over https (issue #14), with real processes: three etcd
members on loopback serving their clients over TLS with --client-cert-auth (conftest's `etcd_cluster`), two
coordinators started with `--etcd A,B,C` (every member, the raft leader first) and the CA and client certificate
(`--etcd-ca-file`, `--etcd-cert-file`, `--etcd-key-file`), healthd and two learners given both coordinators.

The member the leading coordinator's etcd client uses (its `leadership.changed` lines name it; here also the raft
leader, so the cluster elects another while the coordinators move on) is SIGKILLed mid-run. The clients move to the
next member within one bounded call (`call_timeout_s`); the leader either keeps its leadership (renewed in time
through another member) or is fenced and the standby takes over under a higher epoch. Either way: the job goes on
to its target, no two leadership terms overlap (by promotion time epochs rise, and a term accepted its last work
before the next was promoted), no learner's received versions go backwards, and the ledger is exactly once."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from diloco.cluster import LocalCluster, LogFollower, ledger_check, logged_at, wait_for
from diloco.ha.etcd_server import EtcdCluster
from diloco.rpc.server import channel
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support import Events, ha_cluster_config, healthd_for_replicas, spawn_replica

pytestmark = pytest.mark.timeout(120)

TARGET = 7
KILL_AT = 3  # the version the leader has applied when its etcd member is killed
REPLICAS = ("coord-a", "coord-b")
ACCEPTING = ("worker.registered", "submission.accepted", "round.closed")  # work only a leader accepts


def status_at(address: str) -> coordinator_pb2.GetStatusResponse | None:
    """The coordinator's status; None from a standby (UNAVAILABLE) or a replica that is gone."""
    try:
        with channel(address) as ch:
            return coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3)
    except grpc.RpcError:
        return None


def terms(logs: dict[str, Events]) -> list[tuple[float, int, float, str]]:
    """Every leadership term in the replicas' logs as (promoted at, epoch, last work accepted at, replica), by
    promotion time."""
    found = []
    for name, log in logs.items():
        log.first("")  # read what is new
        term: list[float | int] | None = None
        for event, fields in [*log.lines, ("", {})]:
            if event in ("replica.promoted", "replica.retiring", "") and term is not None:
                found.append((float(term[0]), int(term[1]), float(term[2]), name))
                term = None
            if event == "replica.promoted":
                term = [logged_at(fields), int(str(fields["epoch"])), logged_at(fields)]
            elif event in ACCEPTING and term is not None:
                term[2] = logged_at(fields)
    return sorted(found)


def test_killing_the_etcd_member_the_leader_uses_keeps_one_leader_and_the_job_going(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    raft_leader = etcd_cluster.lead_first()
    cfg = ha_cluster_config(tmp_path, TARGET)
    with LocalCluster(cfg) as cluster:
        ports = healthd_for_replicas(cluster, *REPLICAS)
        logs = {name: Events(cfg.run_dir / f"{name}.log", None) for name in REPLICAS}
        logs["coord-a"].proc = spawn_replica(cluster, etcd_cluster, "coord-a", port=ports["coord-a"])
        promoted = wait_for("coord-a leads", lambda: logs["coord-a"].first("replica.promoted"), 60, interval_s=0.05)
        logs["coord-b"].proc = spawn_replica(cluster, etcd_cluster, "coord-b", port=ports["coord-b"])
        wait_for("coord-b follows", lambda: logs["coord-b"].first("replication.snapshot_loaded"), timeout_s=60)
        addresses = {name: f"127.0.0.1:{ports[name]}" for name in REPLICAS}
        cfg.worker_args.update({i: ("--coordinator", ",".join(addresses.values())) for i in range(cfg.workers)})
        for i in range(cfg.workers):
            cluster.start_worker(i)

        def leader_version() -> int:
            status = status_at(addresses["coord-a"])
            return status.version if status is not None else -1

        wait_for(f"version {KILL_AT} at coord-a", lambda: leader_version() >= KILL_AT, timeout_s=60, interval_s=0.1)
        assert promoted is not None
        epoch_a = int(str(promoted["epoch"]))
        used = str([f["etcd"] for f in logs["coord-a"].all("leadership.changed") if f.get("role") == "leader"][-1])
        member = etcd_cluster.member_at(used)
        assert member is raft_leader, f"coord-a's etcd client uses {used}, not the first endpoint it was given"
        killed_at = time.time()
        assert member.pid is not None
        os.kill(member.pid, signal.SIGKILL)
        member.kill()  # reaps it
        version_at_kill = leader_version()

        # the remaining two members elect a raft leader; the coordinators' clients moved on to them
        wait_for("a new raft leader", lambda: etcd_cluster.raft_leader() not in (None, member), timeout_s=15)
        seen: list[tuple[str, int]] = []

        def serving(at_least: int) -> bool:
            for name, address in addresses.items():
                status = status_at(address)
                if status is not None:
                    seen.append((name, status.version))
                    return status.version >= at_least
            return False

        further = min(version_at_kill + 2, TARGET)
        wait_for("the job goes on past the kill", lambda: serving(further), timeout_s=45, interval_s=0.2)
        going_on_s = time.time() - killed_at
        wait_for("the job finishes", lambda: serving(TARGET), timeout_s=60, interval_s=0.2)
        for log in logs.values():
            log.proc = None  # read what they wrote, whether they run or retired
        leader = seen[-1][0]
        final = status_at(addresses[leader])
        assert final is not None and final.finished and final.version == TARGET
        with channel(addresses[leader]) as ch:
            ledger = coordinator_pb2_grpc.CoordinatorStub(ch).GetLedger(coordinator_pb2.GetLedgerRequest(), timeout=5)
        assert not ledger_check(ledger), "exactly-once ledger broken"

        # no split brain: by promotion time epochs rise, and each term accepted its last work before the next began
        led = terms(logs)
        for (_, epoch, last, name), (next_start, next_epoch, _, next_name) in itertools.pairwise(led):
            assert next_epoch > epoch, f"{next_name} led epoch {next_epoch} after {name}'s epoch {epoch}"
            assert last < next_start, f"{name} (epoch {epoch}) accepted work after {next_name} was promoted"
        assert final.coordinator_epoch == led[-1][1] and led[0][1] == epoch_a
        kept = len(led) == 1
        if kept:  # leadership kept through another member while the job ran: the same term, never fenced then
            assert leader == "coord-a" and final.coordinator_epoch == epoch_a
            closed = [f for f in logs["coord-a"].all("round.closed") if int(str(f["version"])) == TARGET]
            # a fence after the last round (its lease unrenewed while the members still elect, on a loaded machine)
            # ends no work: nobody needed a leader by then
            assert not [f for f in logs["coord-a"].all("replica.retiring") if logged_at(f) <= logged_at(closed[0])]
        else:
            assert final.coordinator_epoch > epoch_a
        per_version = [v for name, v in seen if name == leader]
        assert per_version == sorted(per_version), f"a version went backwards at {leader}: {per_version}"
        for i in range(cfg.workers):
            got = [x.fields for x in LogFollower(cfg.run_dir / f"worker{i}.log").read()]
            received = [int(str(f["version"])) for f in got if f.get("event") == "worker.broadcast_received"]
            assert received == sorted(received), f"worker{i} received a version that went backwards: {received}"
        # coord-a's client found the member gone (one call, answered at once: refused) and moved to another
        failed = [f for f in logs["coord-a"].all("leadership.call_failed") if logged_at(f) > killed_at]
        assert failed and used in str(failed[0]["error"]) and failed[0]["etcd"] != used, failed
        changes = [
            (f["role"], f["etcd"]) for f in logs["coord-a"].all("leadership.changed") if logged_at(f) > killed_at
        ]
        print(
            f"etcd member {used} (raft leader) killed at coord-a's version {version_at_kill}: coord-a's "
            f"{failed[0]['action']} failed {logged_at(failed[0]) - killed_at:.2f} s after, its next call went to "
            f"{failed[0]['etcd']}; leadership "
            f"{'kept by coord-a, epoch ' + str(epoch_a) if kept else f'handed over, epochs {[t[1] for t in led]}'}; "
            f"the job went on ({further} reached) {going_on_s:.2f} s after the kill; coord-a's leadership "
            f"changes after it: {changes}"
        )
