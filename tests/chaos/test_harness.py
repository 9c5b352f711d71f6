"""The chaos suite's own checks, without a Docker engine: a checker that cannot fail would let every scenario pass."""

from __future__ import annotations

import json
import math

from diloco.cluster import LedgerShard, ledger_problems
from tests.chaos.ha_cluster import Term, backwards, leadership_terms, overlapping_terms, received_versions, unix_s
from tests.chaos.harness import (
    ScenarioResult,
    error_lines,
    eval_losses,
    final_loss,
    median,
    render_table,
)


def test_ledger_exactly_once_passes() -> None:
    shards = [LedgerShard(0, 30, ((0, 10), (10, 30))), LedgerShard(1, 0, ())]
    assert ledger_problems(shards, 30) == []


def test_ledger_gap_overlap_and_totals_are_reported() -> None:
    lost = ledger_problems([LedgerShard(0, 30, ((0, 10), (15, 30)))], 30)
    assert any("lost" in p for p in lost)
    twice = ledger_problems([LedgerShard(0, 30, ((0, 20), (10, 30)))], 30)
    assert any("applied twice" in p for p in twice)
    short = ledger_problems([LedgerShard(0, 30, ((0, 20),))], 30)
    assert any("committed cursor is 30" in p for p in short)
    total = ledger_problems([LedgerShard(0, 30, ((0, 30),))], 40)
    assert any("applied 40" in p for p in total)


def test_error_lines_finds_errors_and_tracebacks_and_honours_the_allowlist() -> None:
    log = "\n".join(
        [
            json.dumps({"event": "round.closed", "level": "info"}),
            json.dumps({"event": "worker.coordinator_unreachable", "level": "error"}),
            json.dumps({"event": "disk.full", "level": "error"}),
            "Traceback (most recent call last):",
            "not json at all",
        ]
    )
    found = error_lines("worker0", log)
    assert len(found) == 3
    allowed = error_lines("worker0", log, {"worker.coordinator_unreachable"})
    assert len(allowed) == 2 and all("coordinator_unreachable" not in line for line in allowed)


def test_a_traceback_is_allowed_only_by_its_exception_line() -> None:
    log = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "ha.py", line 90, in __init__',
            "    bound = self._server.add_secure_port(where, creds)",
            "RuntimeError: Failed to bind to address coordinator-a:50051; set GRPC_VERBOSITY=debug",
            "Traceback (most recent call last):",
            '  File "state.py", line 1, in step',
            "ValueError: something else",
        ]
    )
    found = error_lines("coordinator-a", log)
    assert len(found) == 2 and "RuntimeError: Failed to bind" in found[0] and "ValueError" in found[1]
    allowed = error_lines("coordinator-a", log, allowed_exceptions={"Failed to bind to address coordinator-a"})
    assert len(allowed) == 1 and "ValueError" in allowed[0]
    assert len(error_lines("coordinator-a", log, allowed_exceptions={"Failed to bind to address other"})) == 2


def test_median_and_table() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0]) == 1.5
    assert math.isnan(median([]))
    base = ScenarioResult("baseline", "none", goodput_tokens_per_s=100.0, final_loss=2.5, wall_s=30.0)
    row = ScenarioResult("kill", "1x SIGKILL", [1.2, 2.4], 90.0, 0.9, 2.6, 2.5, 31.0)
    table = render_table([base, row]).splitlines()
    assert len(table) == 4
    assert "| kill " in table[3] and "2.40" in table[3] and "1.80" in table[3] and "90%" in table[3]


def test_final_loss_is_the_mean_of_the_last_evaluations_after_a_restart() -> None:
    def line(version: int, loss: float) -> str:
        return json.dumps({"event": "eval.done", "version": version, "val_loss": loss, "level": "info"})

    # versions 1-6, then a restart from the checkpoint at 4 evaluates 5 and 6 again, then 7
    log = [line(v, 5.0 - v * 0.1) for v in range(1, 7)] + ["garbage", line(5, 9.0), line(6, 9.0), line(7, 1.0)]
    losses = eval_losses("\n".join(log))
    assert losses[5] == 9.0 and losses[7] == 1.0 and len(losses) == 7
    assert final_loss(losses, last=3) == (9.0 + 9.0 + 1.0) / 3
    assert math.isnan(final_loss({}))


def _event(event: str, second: float, **fields: object) -> str:
    stamp = f"2026-01-01T00:00:{second:09.6f}Z"
    return json.dumps({"event": event, "level": "info", "timestamp": stamp, **fields})


def test_leadership_terms_follow_promotions_retirements_and_restarts() -> None:
    a = "\n".join(
        [
            _event("replica.started", 1.0),
            _event("replica.promoted", 1.5, epoch=2),
            _event("submission.accepted", 3.0),
            _event("round.closed", 4.0),
            _event("replica.retiring", 5.0, epoch=2),
            "Traceback (most recent call last):",  # not a log event: skipped
            _event("replica.started", 9.0),  # restarted: a standby now
            _event("replica.following", 9.1),
        ]
    )
    terms = leadership_terms("coordinator-a", a)
    at = unix_s("2026-01-01T00:00:00Z")
    assert terms == [Term("coordinator-a", 2, at + 1.5, at + 4.0, at + 5.0)]
    b = "\n".join([_event("replica.started", 1.2), _event("replica.promoted", 6.0, epoch=4), _event("round.closed", 7)])
    both = terms + leadership_terms("coordinator-b", b)
    assert overlapping_terms(both) == []
    late = "\n".join([_event("replica.promoted", 4.5, epoch=4)])  # promoted before a's last round (4.0 < 4.5 ok)
    assert overlapping_terms(terms + leadership_terms("coordinator-b", late)) == []
    early = "\n".join([_event("replica.promoted", 3.5, epoch=4)])  # a closed a round after b led: two leaders
    problems = overlapping_terms(terms + leadership_terms("coordinator-b", early))
    assert len(problems) == 1 and "accepted work 0.500 s after" in problems[0]
    lower = "\n".join([_event("replica.promoted", 6.0, epoch=2)])  # a later term under the same epoch
    assert any("led epoch 2 after" in p for p in overlapping_terms(terms + leadership_terms("coordinator-b", lower)))


def test_versions_going_backwards_and_what_a_learner_received() -> None:
    assert backwards([1, 2, 2, 5]) == []
    assert backwards([1, 3, 2, 4, 1]) == ["3 -> 2", "4 -> 1"]
    log = "\n".join(
        [
            _event("worker.broadcast_received", 1.0, version=3),
            _event("worker.broadcast_received", 2.0, version=4),
            _event("worker.reregister", 2.5),
            _event("worker.broadcast_received", 3.0, version=6),
        ]
    )
    assert received_versions(log) == [3, 4, 6]
    cut = unix_s("2026-01-01T00:00:02.500000Z")
    assert received_versions(log, before_unix_s=cut) == [3, 4]
