"""Kill storm (issue #16 item 4): the real processes of `LocalCluster` (healthd, the coordinator, three learners,
mutual TLS), the coordinator SIGKILLed ten times, alternately right after a round closed and right after a learner's
upload was accepted, and started again each time on its port from its newest checkpoint (a new epoch). No
supervisor runs the learners: every one must live through every kill, the job must reach its target, and the
ledger must hold every committed range exactly once. The job has no target until the final kill, whose restart sets
one a fixed number of versions ahead: the storm cannot outlast the job however fast its rounds go. The driver is
`diloco.bench.storm`, which the benchmark section `kill-storm` runs longer (with healthd and learner kills too).

The pure parts of the driver (the schedule, the ledger check, the log follower) are tested here too."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench.storm import Fault, StormSettings, run_storm, schedule
from diloco.cluster import LedgerShard, LogFollower, ledger_problems, ledger_shards
from diloco.errors import ConfigError
from diloco.v1 import common_pb2, coordinator_pb2

# Three learners slowed down 3x (they sleep after each step: rounds of about half a second, and CPU left for the
# restarts). The final kill sets the target 10 versions past the coordinator's newest at that kill.
STORM = StormSettings(workers=3, coordinator_kills=10, finish_rounds=10, slowdown=3.0, local_steps=10)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_learners_live_through_a_storm_of_coordinator_kills(tmp_path: Path) -> None:
    result = run_storm(STORM, tmp_path, log=print)
    kills = result.kills
    assert result.coordinator_kills >= 10
    assert {k.fault for k in kills} == {Fault.COORDINATOR_AFTER_ROUND.value, Fault.COORDINATOR_MID_UPLOAD.value}
    assert not result.failures(), "\n".join(result.failures())
    # no target while the faults ran; the final kill's restart set one, and the job finished there
    assert kills[-1].last_version is not None and kills[-1].last_version + STORM.finish_rounds == result.target_set
    assert result.finished and result.version == result.target_outer_steps == result.target_set
    assert result.exactly_once and result.tokens_applied > 0
    assert all(result.alive_after_faults.values()) and not result.unexpected_exits
    for k in kills:
        assert k.resumed_version is not None and k.advanced_s is not None, k
        # a restart resumes from a checkpoint it wrote: never a version its predecessor did not reach
        assert k.last_version is not None and k.resumed_version <= k.last_version, k
    assert sum(k.reregistered for k in kills) >= len(kills), "learners should have registered again after kills"


def test_schedule_alternates_coordinator_triggers_and_spreads_the_other_faults() -> None:
    faults = schedule(StormSettings(coordinator_kills=4, healthd_kills=1, learner_kills=1, workers=3))
    assert faults.count(Fault.HEALTHD) == 1 and faults.count(Fault.LEARNER) == 1 and len(faults) == 6
    coordinator = [f for f in faults if f.coordinator]
    assert coordinator == [Fault.COORDINATOR_AFTER_ROUND, Fault.COORDINATOR_MID_UPLOAD] * 2
    assert faults[0].coordinator and faults[-1].coordinator, "the other faults sit between coordinator kills"
    with pytest.raises(ConfigError, match="workers > min_quorum"):
        StormSettings(workers=2, min_quorum=2, learner_kills=1)


def test_the_job_has_no_target_until_the_final_fault_a_coordinator_kill(tmp_path: Path) -> None:
    s = StormSettings(coordinator_kills=3, healthd_kills=2, learner_kills=2, workers=3)
    assert s.cluster_config(tmp_path).outer_steps == 0, "the coordinator starts with no target"
    assert schedule(s)[-1].coordinator, "the final fault is the coordinator kill that sets the target"
    assert schedule(StormSettings(coordinator_kills=1, healthd_kills=2, learner_kills=1, workers=3)) == [
        Fault.HEALTHD,
        Fault.LEARNER,
        Fault.HEALTHD,
        Fault.COORDINATOR_AFTER_ROUND,
    ]
    with pytest.raises(ConfigError, match="coordinator_kills must be >= 1"):
        StormSettings(coordinator_kills=0, healthd_kills=2)
    with pytest.raises(ConfigError, match="finish_rounds must be >= 1"):
        StormSettings(finish_rounds=0)


def ledger(*ranges: list[tuple[int, int]], committed: dict[int, int] | None = None) -> list[LedgerShard]:
    """Shard i holds ranges[i]; its committed cursor is where they end unless `committed` says otherwise."""
    entries = []
    for i, rs in enumerate(ranges):
        cursor = (committed or {}).get(i, rs[-1][1] if rs else 0)
        spans = [common_pb2.ShardRange(shard_id=i, start=a, end=b) for a, b in rs]
        entries.append(coordinator_pb2.ShardLedgerEntry(shard_id=i, committed=cursor, committed_ranges=spans))
    return ledger_shards(coordinator_pb2.GetLedgerResponse(shards=entries))  # as read from GetLedger


def test_ledger_problems_name_gaps_overlaps_and_a_wrong_total() -> None:
    assert ledger_problems(ledger([(0, 10), (10, 30)], []), 30) == []
    gap = ledger_problems(ledger([(0, 10), (12, 30)]), 30)
    assert len(gap) == 1 and "leaves a gap" in gap[0] and "shard 0" in gap[0]
    assert any("overlaps" in p for p in ledger_problems(ledger([(0, 10), (8, 30)]), 30))
    assert any("committed cursor is 40" in p for p in ledger_problems(ledger([(0, 30)], committed={0: 40}), 40))
    assert any("applied 31" in p for p in ledger_problems(ledger([(0, 30)]), 31))


def test_log_follower_returns_complete_lines_once(tmp_path: Path) -> None:
    path = tmp_path / "child.log"
    follower = LogFollower(path)
    assert follower.read() == []  # no file yet
    with open(path, "ab") as f:
        f.write(b'{"event": "round.closed", "version": 3}\nTraceback (most recent call last):\n{"event": "par')
        f.flush()
        first = follower.read()
        assert [x.event for x in first] == ["round.closed", ""]
        assert first[0].fields["version"] == 3 and first[1].fields["text"].startswith("Traceback")
        f.write(b'tial"}\n')
        f.flush()
        assert [x.event for x in follower.read()] == ["partial"]
        assert follower.read() == []
