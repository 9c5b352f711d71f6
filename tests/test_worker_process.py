"""The real worker process with a real coordinator and healthd: SIGTERM drains it, and its last heartbeat says
it is leaving, so healthd reports it LEFT (never DEAD) and the coordinator shows it left."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from diloco.cli.ctl import state_name
from diloco.cluster import LocalCluster
from diloco.core.failure import NodeState
from diloco.rpc.vocab import NODE_STATES
from diloco.v1 import healthd_pb2, healthd_pb2_grpc
from tests.support import cluster_config, running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
DEAD_AFTER_S = 2.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cfg = cluster_config(
        tmp_path,
        workers=2,
        outer_steps=10_000,  # it never finishes on its own here
        local_steps=5,
        min_quorum=1,
        dead_after_s=DEAD_AFTER_S,
    )
    with running(cfg) as c:
        yield c


def test_sigterm_drains_and_healthd_reports_left_never_dead(cluster: LocalCluster) -> None:
    events: list[healthd_pb2.NodeEvent] = []
    chan = cluster.security.channel(cluster.healthd_address, admin=True)
    watch = healthd_pb2_grpc.HealthDaemonStub(chan).WatchNodeEvents(healthd_pb2.WatchNodeEventsRequest())

    def record() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for event in watch:
                events.append(event)

    recorder = threading.Thread(target=record, daemon=True)
    recorder.start()
    try:
        wait_for("rounds with both learners", lambda: cluster.status().version >= 3, timeout_s=90)
        ids = {w.worker_name: w.worker_id for w in cluster.workers().workers}
        victim = ids["worker1"]
        wait_for("healthd to know the learner", lambda: victim in {n.node_id for n in cluster.nodes().nodes}, 30)

        cluster.signal("worker1", signal.SIGTERM)
        assert cluster.procs["worker1"].popen.wait(timeout=60) == 0, cluster.tail("worker1")
        exited = time.monotonic()

        def left_in_healthd() -> bool:
            states = {n.node_id: NODE_STATES.from_proto(n.state) for n in cluster.nodes().nodes}
            return states.get(victim) is NodeState.LEFT

        wait_for("healthd to report the learner LEFT", left_in_healthd, timeout_s=10)
        # watch for longer than dead_after: a learner that only went silent would be declared dead by now
        version = cluster.status().version
        wait_for(
            "dead_after to pass with rounds going on",
            lambda: time.monotonic() - exited > 2 * DEAD_AFTER_S and cluster.status().version > version,
            timeout_s=60,
        )
        assert left_in_healthd()
        states = [w for w in cluster.workers().workers if w.worker_id == victim]
        assert [state_name(w.state) for w in states] == ["left"]
        assert cluster.procs["worker0"].alive
        assert "worker.deregistered" in cluster.tail("worker1", 200)
    finally:
        watch.cancel()
        recorder.join(timeout=10)
        chan.close()
    seen = [NODE_STATES.from_proto(e.state) for e in events if e.node_id == victim]
    assert NodeState.LEFT in seen and NodeState.DEAD not in seen, seen
