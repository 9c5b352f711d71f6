"""Energy-aware placement through the real processes (issue #15): two learners declare very different watts
(--power-w) and one is also much slower; their power goes from the worker to healthd with every heartbeat and on to
the coordinator, whose `--placement energy` pauses the inefficient learner (registered, no shards) while the run
still finishes exactly once, and whose accounting counts both learners' energy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from diloco.v1 import common_pb2
from tests.support import assert_exactly_once, cluster_config, running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_energy_placement_pauses_a_power_hungry_slow_learner(tmp_path: Path) -> None:
    cfg = cluster_config(
        tmp_path,
        workers=2,
        # rounds slow enough (10x) that the pause, decided once the slow learner is measured, lasts seconds before the
        # run ends (at 1x the 12-round run ended 0.17 s after it on a loaded host, between two polls)
        outer_steps=24,
        local_steps=5,
        min_quorum=1,
        slowdowns=(10.0, 300.0),  # worker 1 delivers about 1/30 of worker 0's tokens: pausing it costs ~3% speed
        worker_args={0: ("--power-w", "100", "--power-meter", "declared"), 1: ("--power-w", "900")},
        coordinator_args=("--placement", "energy"),
    )
    with running(cfg) as c:

        def paused() -> list[common_pb2.Throughput] | None:
            ws = {w.worker_name: w for w in c.workers().workers}
            slow = next((w for n, w in ws.items() if n.endswith("1")), None)
            if slow is None or slow.placement_weight != 0.0 or slow.shards:
                return None
            return [w.throughput for w in ws.values()]

        throughputs = wait_for("the slow, power-hungry learner paused", paused, timeout_s=150, interval_s=0.2)
        status = c.status()
        assert status.placement == "energy" and "energy: paused" in status.placement_reason
        assert status.paused_workers == 1
        assert sorted(t.watts for t in throughputs) == [100.0, 900.0]
        assert {t.power_source for t in throughputs} <= {
            common_pb2.POWER_SOURCE_DECLARED,
            common_pb2.POWER_SOURCE_RAPL,  # worker 1 measures with RAPL where the host lets it
        }
        wait_for("training to finish", lambda: c.status().finished, timeout_s=150, interval_s=0.2)
        status = c.final_status()
        assert math.isfinite(status.validation_loss)
        used = {w.worker_name: w.energy_kwh for w in c.workers().workers}
        # the trained learner's accepted work drew energy; the slow one may be paused by its claimed speed before any
        # of its work is accepted (test_energy_accounting checks several learners' sums)
        assert len(used) == 2 and used["worker0"] > 0 and used["worker1"] >= 0
        assert status.energy_kwh == pytest.approx(sum(used.values()), rel=1e-9)
        assert_exactly_once(c)
        assert "placement.changed" in (tmp_path / "coordinator.log").read_text()
