"""Coordinator high availability, measured (issue #14): a soak of leader kills, the standby's lag, and what
synchronous replication costs a round. Every process is real and on loopback, in plaintext: a real etcd
(`diloco.ha.etcd_server`), coordinator replicas under its leadership (`diloco coordinator --etcd`, docs/ha.md),
healthd and learners, each given every replica's address (`--coordinator-address A,B`, `--coordinator A,B`).

1. **Soak.** Two replicas (`--replication-log 16 --sync-replicas 1`), healthd and `workers` tiny-task learners in
   decoupled rounds. The benchmark is the replicas' supervisor: a
   replica that exits, or that it killed, is started again on its port and checkpoint folder after
   `restart_delay_s` (it comes back as a standby). After a steady phase the leader is SIGKILLed `kills` times. Each
   kill waits until the standby holds the leader's newest version under its epoch (`replication.applied` or
   `replication.snapshot_loaded` in its log): killing a leader with no standby in step measures nothing of
   failover. Then it kills at a point drawn with a seeded generator (`KillPoint`): right after the leader's
   `round.closed` (a fresh round, its checkpoint maybe being written), right after a learner's
   `worker.submitted` (mid-round: the leader holds an accepted submission of the open round), or after a random
   delay. Measured from the SIGKILL (this process's clock) to the survivor's own log timestamps: elected
   (`leadership.changed` to leader), serving (`replica.promoted`), first round committed (its first
   `round.closed`). The job's end is not known in advance (the kills' pace sets how many rounds the soak takes),
   so the soak ends it as an operator would change a target: the standby is restarted with `--target-outer-steps`
   about `finish_rounds` past the version the final kill should meet, and one more kill (measured like the others)
   hands it the lead.
   Throughput: the tokens each `round.closed` applied, per kill cycle (from one kill to the next) against the
   steady phase's rate. Invariants at the end: every learner received non-decreasing versions; each new leader
   resumed at or above every version any learner had received before the kill; no version was committed twice and
   commits never went backwards; epochs rose at every promotion; the ledger is exactly once
   (`diloco.cluster.ledger_problems`); the job finished at its target and no learner exited before.
2. **Standby lag** during the steady phase: every `lag_poll_s`, the standby's lag in versions as the leader's
   GetStatus reports it (what `diloco ctl status` shows: the newest version in the round log minus the newest
   the standby acknowledged); and per version, from the standby applying it to the leader publishing it.
3. **Cost of synchronous replication**: the same cluster shape in `sync` rounds (every learner H steps, then the
   round closes on the last learner's submission) with one plain coordinator, then with two replicas and
   `--sync-replicas 1`, alternating `repeats` times; round time is the interval between two `round.closed` lines,
   median over the rounds after the first `warmup_rounds`. The target is checked on the replication's own latency
   on a round: the leader's close (the closing submission accepted → the version published: merge, outer step
   and, replicated, the log entry and the wait for the standby's ack), replicated minus plain, over the plain
   round. Whole round times are reported beside it, but on a shared 2-core machine two runs of the same kind
   differ by more than the effect. On the default model and on a larger one (`FULL`).

    python -m diloco.bench.bench_ha [--quick] [--kills 50] [--json]
    diloco bench --only ha
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from diloco.bench.ha.cost import cost
from diloco.bench.ha.report import markdown
from diloco.bench.ha.settings import NO_ETCD, CostSettings, HaSettings, KillPoint, SoakSettings
from diloco.bench.ha.soak import run_soak
from diloco.bench.ha.summary import checks, summarize
from diloco.bench.ha.supervisor import SoakError
from diloco.bench.section import Context, Log, quick_flag, standalone
from diloco.ha.etcd_server import etcd_binary

# The parts live in `diloco.bench.ha` (its docstring lists them); these are the names the suite and the docs use.
__all__ = [
    "DEFAULT_MODEL",
    "FULL",
    "LARGE_MODEL",
    "QUICK",
    "CostSettings",
    "HaSettings",
    "KillPoint",
    "SoakSettings",
    "main",
    "markdown",
    "measure",
    "section",
]

DEFAULT_MODEL = CostSettings("default model (`diloco coordinator` defaults)", ("--eval-tokens", "4096"))
# bench_large's model and shapes (2 learners, batch 4 x 128) with one inner step a round (bench_large: 2)
LARGE_MODEL = CostSettings(
    "hf:llama-100m (75.7 M parameters with the byte tokenizer)",
    ("--model", "hf:llama-100m", "--batch-size", "4", "--seq-len", "128", "--eval-every", "0"),
    workers=2,
    local_steps=1,
    rounds=6,
    warmup_rounds=1,
    repeats=2,  # one pair decided the row alone until fa4bcb3 (+16.5% at 852ca20, +20.2% at fa4bcb3: the same code)
    replication_log=2,
    target=0.20,
    timeout_s=400.0,
)
FULL = HaSettings(SoakSettings(), (DEFAULT_MODEL, LARGE_MODEL))
QUICK = HaSettings(
    SoakSettings(kills=2, steady_s=3.0, finish_rounds=4),
    (CostSettings(DEFAULT_MODEL.label, DEFAULT_MODEL.task_args, workers=2, rounds=6, warmup_rounds=1, repeats=1),),
)


def measure(h: HaSettings, log: Log, run_dir: Path | None = None) -> dict[str, Any]:
    """The whole section; a soak that cannot go on is reported, not raised. `run_dir`: keep the soak's logs
    there (default: a temporary folder)."""
    load = list(os.getloadavg())
    error, soak, summary, costs = "", {}, {}, []
    if etcd_binary() is None:
        error = f"not run: {NO_ETCD}"
        log(f"  {error}")
    else:
        costs = [cost(c, log) for c in h.cost]
        with tempfile.TemporaryDirectory(prefix="diloco-bench-ha-") as tmp:
            try:
                soak = run_soak(h.soak, run_dir or Path(tmp), log)
                summary = summarize(soak)
            except (SoakError, TimeoutError) as e:
                error = str(e)
                log(f"  the soak stopped: {e}")
    return {
        "settings": {"soak": asdict(h.soak), "cost": [asdict(c) for c in h.cost]},
        "load_average": load,
        "error": error,
        "soak": soak,
        "summary": summary,
        "cost": costs,
        "checks": checks(soak, summary, costs, error),
    }


def section(ctx: Context) -> dict[str, Any]:
    return measure(QUICK if ctx.quick else FULL, ctx.log)


def _flags(p: argparse.ArgumentParser) -> None:
    quick_flag(p)
    p.add_argument("--kills", type=int, default=None, help="leader kills in the soak (default: the profile's)")
    p.add_argument("--no-cost", action="store_true", help="only the soak (no replication-cost runs)")
    p.add_argument("--run-dir", type=Path, default=None, help="keep the soak's logs in this folder")


def _settings(a: argparse.Namespace) -> HaSettings:
    h = QUICK if a.quick else FULL
    if a.kills is not None:
        h = HaSettings(replace(h.soak, kills=a.kills), h.cost)
    return HaSettings(h.soak, ()) if a.no_cost else h


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, _flags, lambda a, log: measure(_settings(a), log, a.run_dir), markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
