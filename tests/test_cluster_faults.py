"""Multi-process tests: real healthd, coordinator and worker processes on loopback, with faults injected by
signals (SIGKILL, SIGSTOP/SIGCONT) while training goes on. Each run must finish with a validation loss clearly
below the untrained model's, and the ledger must show every committed token range exactly once."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.cluster import LocalCluster, LogLine
from tests.support import assert_finished_and_learned, cluster_config, running, wait_for, worker_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    overrides = getattr(request, "param", {})
    # workers slowed down 8x, so a run lasts long enough (tens of seconds) to inject faults in the middle of it
    settings = dict(
        workers=3,
        slowdowns=(8.0, 8.0, 8.0),
        outer_steps=30,
        checkpoint_every=2,
    )
    with running(cluster_config(tmp_path, **{**settings, **overrides})) as c:
        yield c


# and once with the SparseLoCo-class upload codec, end to end: chunked top-k with 2-bit values and error feedback
@pytest.mark.parametrize("cluster", [{}, {"codec": "sparse"}], indirect=True, ids=["int8", "sparse"])
def test_sigkill_worker_is_reassigned_within_the_window(cluster: LocalCluster) -> None:
    wait_for("a first round", lambda: cluster.status().version >= 2, timeout_s=60)
    victim = "worker2"
    cluster.kill(victim)
    killed = time.monotonic()
    wait_for(f"{victim} declared dead", lambda: worker_state(cluster, victim) == "dead", timeout_s=10)
    reassigned = time.monotonic() - killed
    ledger = cluster.ledger()
    dead_ids = {w.worker_id for w in cluster.workers().workers if w.worker_name == victim}
    assert not any(s.owner in dead_ids for s in ledger.shards), "a dead worker still owns shards"
    assert reassigned < 5.0, f"reassignment took {reassigned:.2f} s (window 5 s)"
    version = cluster.status().version
    wait_for("training to go on", lambda: cluster.status().version > version, timeout_s=60)
    # SIGTERM drains: the worker hands its work back, deregisters and exits 0; its shards move at once
    cluster.signal("worker1", signal.SIGTERM)
    assert cluster.procs["worker1"].popen.wait(timeout=30) == 0
    wait_for("worker1 to have left", lambda: worker_state(cluster, "worker1") == "left", timeout_s=5)
    left_ids = {w.worker_id for w in cluster.workers().workers if w.worker_name == "worker1"}
    assert not any(s.owner in left_ids for s in cluster.ledger().shards)
    assert_finished_and_learned(cluster)


def test_sigstop_worker_is_reassigned_then_rejoins(cluster: LocalCluster) -> None:
    wait_for("a first round", lambda: cluster.status().version >= 2, timeout_s=60)
    victim = "worker1"
    cluster.signal(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(f"{victim} declared dead", lambda: worker_state(cluster, victim) == "dead", timeout_s=10)
    assert time.monotonic() - stopped < 5.0
    version = cluster.status().version
    wait_for("training to go on without it", lambda: cluster.status().version > version, timeout_s=60)
    cluster.signal(victim, signal.SIGCONT)
    wait_for(
        f"{victim} to rejoin as a new incarnation", lambda: worker_state(cluster, victim) == "active", timeout_s=30
    )
    incarnations = [w for w in cluster.workers().workers if w.worker_name == victim]
    assert len(incarnations) >= 2
    assert_finished_and_learned(cluster)


def test_coordinator_restart_resumes_from_checkpoint(cluster: LocalCluster) -> None:
    wait_for("a checkpoint", lambda: cluster.status().version >= 4, timeout_s=90)
    before = cluster.status().version
    cluster.kill("coordinator")
    cluster.start_coordinator()
    cluster.wait_serving(cluster.coordinator_address, timeout_s=30)
    resumed = cluster.status().version
    assert resumed >= before - 2, f"resumed at {resumed}, last checkpoint was at or after {before - before % 2}"
    assert resumed >= 2
    wait_for("workers to re-register", lambda: cluster.status().live_workers == 3, timeout_s=30)
    assert_finished_and_learned(cluster)


# the run must outlast healthd's restart plus the coordinator's 10 s lease: 30 rounds take about 10 s here
@pytest.mark.parametrize("cluster", [{"outer_steps": 120}], indirect=True)
def test_healthd_restart_never_stops_training(cluster: LocalCluster) -> None:
    wait_for("a first round", lambda: cluster.status().version >= 2, timeout_s=60)
    cluster.kill("healthd")
    version = cluster.status().version
    wait_for("rounds while healthd is down", lambda: cluster.status().version >= version + 2, timeout_s=60)
    # a worker dies while nobody watches: the restarted healthd never hears of it, so the coordinator declares it
    # dead once healthd has reported the others for its lease (10 s) without it
    cluster.kill("worker2")
    cluster.start_healthd()
    cluster.wait_serving(cluster.healthd_address, timeout_s=30)
    restarted = time.monotonic()
    wait_for("healthd to rebuild its table", lambda: len(cluster.nodes().nodes) >= 2, timeout_s=15)

    def declared_dead() -> bool:
        if worker_state(cluster, "worker2") == "dead":
            return True
        assert not cluster.status().finished, "the run ended before the lease ran out: make it longer"
        return False

    wait_for("worker2 declared dead", declared_dead, timeout_s=30)
    assert time.monotonic() - restarted < 10.0 + 10.0, "the lease is 10 s from healthd's first report"
    dead_ids = {w.worker_id for w in cluster.workers().workers if w.worker_name == "worker2"}
    assert not any(s.owner in dead_ids for s in cluster.ledger().shards), "a dead worker still owns shards"
    assert_finished_and_learned(cluster)


def test_a_restarted_child_s_first_line_is_not_glued_to_a_torn_last_line(tmp_path: Path) -> None:
    """A SIGKILLed child may leave its last log line unfinished; the incarnation started after it appends to the
    same file. Its first line (`healthd.started`, or a replica's `replica.started`, which the HA soak counts
    incarnations by) was read glued to the torn one, as one line that is not JSON: lost. The respawn ends the torn
    line first."""
    c = LocalCluster(cluster_config(tmp_path))
    follower = c.follow("healthd")
    try:
        c.start_healthd()
        wait_for("healthd started", lambda: any(x.event == "healthd.started" for x in follower.read()), 30.0)
        c.kill("healthd")
        with c.procs["healthd"].log_path.open("ab") as f:
            f.write(b'{"event": "healthd.torn", "ti')  # what a kill in the middle of a write leaves
        c.respawn("healthd")
        lines: list[LogLine] = []
        wait_for("healthd started again", lambda: lines.extend(follower.read()) or "healthd.started" in events(lines))
        assert lines[0].event == "" and lines[0].fields["text"] == '{"event": "healthd.torn", "ti'  # a line of its own
        assert "healthd.started" in events(lines[1:])
    finally:
        c.stop()


def events(lines: list[LogLine]) -> list[str]:
    return [x.event for x in lines]
