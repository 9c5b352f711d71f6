"""Coordinator failover under etcd leadership (issue #14, ALGORITHM.md section 11), with real processes: a real etcd
(diloco/ha/etcd_server.py), two coordinators started with `--etcd` (each campaigns; the loser follows the winner as a
hot standby with `--sync-replicas 1`), healthd and two learners given both coordinator addresses
(`--coordinator A,B`). The leader is SIGKILLed mid-run: the standby must take over under a higher epoch without
any version going backwards, the learners must move to it by themselves, the job must reach its target and the
ledger must hold every committed range exactly once. The round log carries the learner table, so the learners go
on at the new leader under the ids they registered with at the old one: none registers again.

Nothing acknowledged is lost (issue #14 point 3): the leader crashes (`--fault-crash-before-answer`, a SIGKILL of
itself) right after applying a learner's submission, before answering it: the learner resends it to the new leader
and gets the same outcome (applied, in the same round), and it is not applied again; or right after accepting one
into a round still open: only the dead leader held it, so the new leader (which knows the learner from the round
log) takes the resent submission into its own round, once."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from diloco.cluster import (
    ClusterConfig,
    LocalCluster,
    LogFollower,
    LogLine,
    Proc,
    logged_at,
    wait_for,
)
from diloco.ha.etcd_server import EtcdServer
from diloco.rpc.server import channel
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support import Events, finish_and_check, ha_cluster_config, healthd_for_replicas, spawn_replica

TARGET = 16


@pytest.mark.timeout(150)
def test_standby_takes_over_when_the_leader_is_killed(etcd_server: EtcdServer, tmp_path: Path) -> None:
    cfg = ha_cluster_config(tmp_path, TARGET)
    with LocalCluster(cfg) as cluster:
        ports = healthd_for_replicas(cluster, "coord-a", "coord-b")

        def replica(name: str) -> Proc:
            return spawn_replica(cluster, etcd_server, name, port=ports[name])

        a_log = Events(cfg.run_dir / "coord-a.log", replica("coord-a"))
        promoted_a = wait_for("coord-a leads", lambda: a_log.first("replica.promoted"), timeout_s=60, interval_s=0.05)
        a_addr = str(promoted_a["address"])
        epoch_a = int(str(promoted_a["epoch"]))
        assert a_log.first("replica.started") is not None
        b_log = Events(cfg.run_dir / "coord-b.log", replica("coord-b"))
        wait_for("coord-b follows coord-a", lambda: b_log.first("replication.snapshot_loaded"), timeout_s=60)
        b_addr = str(wait_for("coord-b's address", lambda: b_log.first("replica.started"))["address"])
        assert b_addr != a_addr

        # a standby refuses learners, naming the leader
        with channel(b_addr) as ch, pytest.raises(grpc.RpcError) as refused:
            coordinator_pb2_grpc.CoordinatorStub(ch).Register(coordinator_pb2.RegisterRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"not the leader; leader is at {a_addr}" in (refused.value.details() or "")

        cfg.worker_args.update({i: ("--coordinator", f"{a_addr},{b_addr}") for i in range(cfg.workers)})
        for i in range(cfg.workers):
            cluster.start_worker(i)

        versions: list[int] = []

        def version_at(address: str) -> int:
            with channel(address) as ch:
                v = coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3)
            versions.append(v.version)
            return v.version

        wait_for("both learners registered", lambda: len(worker_events(cfg, "worker.registered")) == cfg.workers, 60)
        registered = settled_registrations(cfg, lambda: version_at(a_addr), at_least=5)
        killed_at = time.time()
        os.kill(cluster.procs["coord-a"].popen.pid, signal.SIGKILL)
        cluster.procs["coord-a"].popen.wait(timeout=10)
        last_a = versions[-1]

        promoted_b = wait_for("coord-b leads", lambda: b_log.first("replica.promoted"), timeout_s=30, interval_s=0.05)
        epoch_b = int(str(promoted_b["epoch"]))
        assert epoch_b > epoch_a
        # GetStatus names the applied version, which may be one the leader had not published yet (it waits for the
        # standby's ack first): the new leader may resume one below it, never below a version learners received
        assert int(str(promoted_b["version"])) >= last_a - 1
        status, _ = finish_and_check(cfg, b_addr, TARGET, timeout_s=90)
        assert status.coordinator_epoch == epoch_b
        moved: list[dict[str, object]] = []
        received_before_kill = [0]
        for i in range(cfg.workers):
            lines = LogFollower(cfg.run_dir / f"worker{i}.log").read()
            moved.extend(x.fields for x in lines if x.event == "worker.coordinator_moved")
            got = [x.fields for x in lines if x.event == "worker.broadcast_received"]
            received_before_kill += [int(str(f["version"])) for f in got if logged_at(f) < killed_at]
        assert any(m["address"] == b_addr for m in moved), moved
        # the learners went on at coord-b under their registrations at coord-a (the learner table was in the log)
        assert int(str(promoted_b["learners"])) == cfg.workers

        # a learner's watch finds coord-b after a backoff: on a busy machine the job may finish at coord-b (the other
        # learner closing rounds) before that learner's first header from it, so wait for it rather than read at once
        def all_taken_over() -> list[dict[str, object]] | None:
            taken = worker_events(cfg, "worker.taken_over")
            return taken if len(taken) >= cfg.workers else None

        taken = wait_for("every learner taken over by coord-b", all_taken_over, timeout_s=30)
        assert sorted(int(str(f["epoch"])) for f in taken) == [epoch_b] * cfg.workers, taken
        assert worker_events(cfg, "worker.registered") == registered
        assert not worker_events(cfg, "worker.reregister")
        # every version a learner received from coord-a is in coord-b's history (--sync-replicas 1)
        assert int(str(promoted_b["version"])) >= max(received_before_kill)
        takeover_s = logged_at(promoted_b) - killed_at
        b_log.first("")
        resumed = next(
            f
            for e, f in b_log.lines
            if e == "round.closed" and int(str(f["version"])) > int(str(promoted_b["version"]))
        )
        print(
            f"failover: coord-a killed at version {last_a}; coord-b leads epoch {epoch_b} (was {epoch_a}) at version "
            f"{promoted_b['version']} {takeover_s:.2f} s after the kill (promotion itself {promoted_b['seconds']} s); "
            f"its first round (version {resumed['version']}) closed {logged_at(resumed) - killed_at:.2f} s after the "
            "kill"
        )
        assert takeover_s < 10


@pytest.mark.timeout(150)
def test_learners_exit_when_the_new_leader_resumes_at_the_jobs_target(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """The standby runs with a target the leader has passed: promoted, it is finished at the version the learners
    hold and publishes nothing newer. The header of that version saying finished must end every learner (status 0,
    reason finished); before, they trained on and had each submission refused, never exiting."""
    cfg = ha_cluster_config(tmp_path, 1000)
    with LocalCluster(cfg) as cluster:
        ports = healthd_for_replicas(cluster, "coord-a", "coord-b")
        a_log = Events(
            cfg.run_dir / "coord-a.log", spawn_replica(cluster, etcd_server, "coord-a", port=ports["coord-a"])
        )
        a_addr = str(wait_for("coord-a leads", lambda: a_log.first("replica.promoted"), timeout_s=60)["address"])
        b = spawn_replica(cluster, etcd_server, "coord-b", "--target-outer-steps", "3", port=ports["coord-b"])
        b_log = Events(cfg.run_dir / "coord-b.log", b)
        wait_for("coord-b follows coord-a", lambda: b_log.first("replication.snapshot_loaded"), timeout_s=60)
        b_addr = str(wait_for("coord-b's address", lambda: b_log.first("replica.started"))["address"])
        cfg.worker_args.update({i: ("--coordinator", f"{a_addr},{b_addr}") for i in range(cfg.workers)})
        for i in range(cfg.workers):
            cluster.start_worker(i)

        def version() -> int:
            with channel(a_addr) as ch:
                stub = coordinator_pb2_grpc.CoordinatorStub(ch)
                return stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=3).version

        wait_for("version 6 at coord-a", lambda: version() >= 6, timeout_s=60, interval_s=0.1)
        os.kill(cluster.procs["coord-a"].popen.pid, signal.SIGKILL)
        promoted_b = wait_for("coord-b leads", lambda: b_log.first("replica.promoted"), timeout_s=30, interval_s=0.05)
        assert int(str(promoted_b["version"])) > 3  # resumed past its target: finished at once
        for i in range(cfg.workers):
            assert cluster.procs[f"worker{i}"].popen.wait(timeout=45) == 0, cluster.tail(f"worker{i}")
            exited = worker_lines(cfg, i, "worker.exited")
            assert [x.fields["reason"] for x in exited] == ["finished"], cluster.tail(f"worker{i}")


FRAGMENTS_TARGET = 14


@pytest.mark.timeout(180)
def test_with_fragments_the_standby_holds_the_leaders_bits_and_resumes_fragment_rounds_when_it_is_killed(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """`--fragments 2` on both replicas (docs/fragments.md, "Replicas"): each round-log entry names the fragments its
    round stepped and carries their Δ; the standby replays them and, version by version, holds the leader's digest
    (crc32 of Θ and of every fragment's outer state). The leader is SIGKILLed: the standby takes over and goes on
    with fragment rounds to the target, the ledger exactly once."""
    cfg = dataclasses.replace(ha_cluster_config(tmp_path, FRAGMENTS_TARGET), coordinator_args=("--fragments", "2"))
    with LocalCluster(cfg) as cluster:
        ports = healthd_for_replicas(cluster, "coord-a", "coord-b")
        a_log = Events(
            cfg.run_dir / "coord-a.log", spawn_replica(cluster, etcd_server, "coord-a", port=ports["coord-a"])
        )
        promoted_a = wait_for("coord-a leads", lambda: a_log.first("replica.promoted"), timeout_s=60, interval_s=0.05)
        b_log = Events(
            cfg.run_dir / "coord-b.log", spawn_replica(cluster, etcd_server, "coord-b", port=ports["coord-b"])
        )
        wait_for("coord-b follows coord-a", lambda: b_log.first("replication.snapshot_loaded"), timeout_s=60)
        b_addr = str(wait_for("coord-b's address", lambda: b_log.first("replica.started"))["address"])
        cfg.worker_args.update({i: ("--coordinator", f"{promoted_a['address']},{b_addr}") for i in range(cfg.workers)})
        for i in range(cfg.workers):
            cluster.start_worker(i)

        def applied_at_b() -> list[dict[str, object]]:
            return b_log.all("replication.applied")

        wait_for("coord-b applied 6 versions", lambda: len(applied_at_b()) >= 6, timeout_s=90, interval_s=0.2)
        appended = {int(str(f["version"])): f for f in a_log.all("replication.appended")}
        compared = 0
        for f in applied_at_b():
            leader = appended[int(str(f["version"]))]
            assert isinstance(f["fragments"], list) and f["fragments"], f  # every entry steps fragments
            assert f["fragments"] == leader["fragments"]
            assert (f["params_crc32"], f["outer_crc32"]) == (leader["params_crc32"], leader["outer_crc32"]), (f, leader)
            compared += 1
        assert compared >= 6
        assert {p for f in applied_at_b() for p in f["fragments"]} == {0, 1}  # type: ignore[attr-defined]
        assert not b_log.all("replication.resync")  # no digest ever differed, no entry was refused

        os.kill(cluster.procs["coord-a"].popen.pid, signal.SIGKILL)
        cluster.procs["coord-a"].popen.wait(timeout=10)
        promoted_b = wait_for("coord-b leads", lambda: b_log.first("replica.promoted"), timeout_s=30, interval_s=0.05)
        assert int(str(promoted_b["epoch"])) > int(str(promoted_a["epoch"]))
        took_over_at = int(str(promoted_b["version"]))

        status, _ = finish_and_check(cfg, b_addr, FRAGMENTS_TARGET)
        rounds_b = [f for f in b_log.all("round.closed") if int(str(f["version"])) > took_over_at]
        assert rounds_b, "coord-b closed no round of its own"
        assert all(isinstance(f["fragments"], list) and f["fragments"] for f in rounds_b), rounds_b
        print(
            f"fragments: {compared} versions compared, digests equal; coord-b took over at version {took_over_at} "
            f"and stepped fragments {[f['fragments'] for f in rounds_b]} to version {status.version}"
        )


CRASH_ROUND = 4


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["applied", "accepted"])
def test_a_submission_the_leader_took_before_it_crashed_is_answered_once_or_trained_again(
    kind: str, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """Two learners, rounds of both (K = 2: the second submission of a wave closes its round in its own call). The
    leader kills itself instead of answering the first submission it applied in round CRASH_ROUND or later
    (`applied`: with --sync-replicas 1 the standby holds that round) or the first it accepted into such a round
    (`accepted`: the round is open, only the dead leader held it)."""
    cfg = ha_cluster_config(tmp_path, 12, min_quorum=2)
    with LocalCluster(cfg) as cluster:
        ports = healthd_for_replicas(cluster, "coord-a", "coord-b")
        fault = ("--fault-crash-before-answer", f"{kind}@{CRASH_ROUND}")
        a_proc = spawn_replica(cluster, etcd_server, "coord-a", *fault, port=ports["coord-a"])
        a_log = Events(cfg.run_dir / "coord-a.log", a_proc)
        promoted_a = wait_for("coord-a leads", lambda: a_log.first("replica.promoted"), timeout_s=60, interval_s=0.05)
        b_log = Events(
            cfg.run_dir / "coord-b.log", spawn_replica(cluster, etcd_server, "coord-b", port=ports["coord-b"])
        )
        wait_for("coord-b follows coord-a", lambda: b_log.first("replication.snapshot_loaded"), timeout_s=60)
        b_addr = str(wait_for("coord-b's address", lambda: b_log.first("replica.started"))["address"])
        cfg.worker_args.update({i: ("--coordinator", f"{promoted_a['address']},{b_addr}") for i in range(2)})
        for i in range(cfg.workers):
            cluster.start_worker(i)

        assert a_proc.popen.wait(timeout=90) == -signal.SIGKILL
        a_log.proc = None  # it exited on purpose
        crash = a_log.first("fault.crash")
        assert crash is not None and crash["applied"] == (kind == "applied"), crash
        sid, round_ = str(crash["submission_id"]), int(str(crash["round"]))
        assert round_ >= CRASH_ROUND
        promoted_b = wait_for("coord-b leads", lambda: b_log.first("replica.promoted"), timeout_s=30, interval_s=0.05)
        assert int(str(promoted_b["epoch"])) > int(str(promoted_a["epoch"]))
        # applied: the standby held the round before the leader answered anyone; accepted: the round never closed
        assert int(str(promoted_b["version"])) == (round_ if kind == "applied" else round_ - 1)

        _, ledger = finish_and_check(cfg, b_addr, cfg.outer_steps, timeout_s=90)

        b_log.first("")
        at_b = [(e, f) for e, f in b_log.lines if f.get("submission_id") == sid]
        learner = int(str(crash["worker_id"]).rpartition("-")[0].removeprefix("worker"))
        mine = [x.fields for x in worker_lines(cfg, learner, "") if x.fields.get("submission_id") == sid]
        events = [f["event"] for f in mine]
        assert "worker.upload_retry" in events, events  # the answer never came: the learner sent it again
        if kind == "applied":
            # the new leader answered it from the round log: applied in the round it went into, not applied again
            dups = [f for e, f in at_b if e == "submission.duplicate"]
            assert dups, at_b
            dup = dups[0]
            assert dup["applied"] is True and int(str(dup["round"])) == round_
            assert int(str(dup["named_epoch"])) == int(str(promoted_a["epoch"]))
            assert not [e for e, _ in at_b if e == "submission.accepted"]
            answered = [f for f in mine if f["event"] == "worker.submitted"]
            assert answered and answered[-1]["applied"] is True and int(str(answered[-1]["round"])) == round_
        else:
            # only the dead leader held it; the new leader knows its learner (the learner table is in the round log)
            # and the ledger's cursor is where the standby had it: the resend is taken once, into coord-b's round
            assert [e for e, _ in at_b if e == "submission.accepted"] == ["submission.accepted"], at_b
            assert not [e for e, _ in at_b if e == "submission.duplicate"]
            assert not [f for f in mine if f["event"] == "worker.submission_refused"], mine
            answered = [f for f in mine if f["event"] == "worker.submitted"]
            assert answered and int(str(answered[-1]["round"])) > int(str(promoted_b["version"]))
            ranges = crash["ranges"]
            assert isinstance(ranges, list) and ranges
            for shard_id, _epoch, start, _end in ranges:
                committed = next(s for s in ledger.shards if s.shard_id == shard_id).committed
                assert committed > start, f"shard {shard_id}: [{start}, ...) was never committed"
        assert not worker_events(cfg, "worker.reregister")  # neither learner registered again
        print(
            f"{kind}: coord-a crashed before answering {sid} (round {round_}); coord-b leads at version "
            f"{promoted_b['version']} {logged_at(promoted_b) - logged_at(crash):.2f} s later; learner events for it: "
            f"{events}"
        )


def settled_registrations(cfg: ClusterConfig, version: Callable[[], int], at_least: int) -> list[dict[str, object]]:
    """Every learner's registrations, once two rounds (and `at_least` versions) passed since the newest of them: the
    learner table in the standby's newest entry then holds every live registration. (A learner the leader declared
    dead, say its first round outlasted the registration lease on a busy machine, registers again meanwhile.)"""
    registered = worker_events(cfg, "worker.registered")
    for _ in range(5):
        after = max(at_least, version() + 2)
        wait_for(f"version {after}", lambda: version() >= after, timeout_s=60, interval_s=0.1)  # noqa: B023
        now = worker_events(cfg, "worker.registered")
        if now == registered:
            return registered
        registered = now
    raise AssertionError(f"the learners kept registering again: {registered}")


def worker_events(cfg: ClusterConfig, event: str) -> list[dict[str, object]]:
    """Every learner's log lines of `event`, learner by learner."""
    return [x.fields for i in range(cfg.workers) for x in worker_lines(cfg, i, event)]


def worker_lines(cfg: ClusterConfig, i: int, event: str) -> list[LogLine]:
    """Learner `i`'s log lines of `event` ("": all)."""
    lines = LogFollower(cfg.run_dir / f"worker{i}.log").read()
    return [x for x in lines if not event or x.event == event]
