"""The chaos suite's own checks, without a Docker engine: a checker that cannot fail would let every scenario pass."""

from __future__ import annotations

import json
import math

from diloco.cluster import LedgerShard, ledger_problems
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
