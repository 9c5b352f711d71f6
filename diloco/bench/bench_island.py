"""Islands: one learner as a 2-rank torchrun group against the same learner as one process, side by side.

Each run is a real cluster (`LocalCluster`: healthd, the coordinator and ONE learner, child processes on
loopback, plaintext) training the same task in `sync` mode for the same outer steps, so both consume exactly the
same tokens in the same order: the 1-rank learner trains each global batch alone; the 2-rank island (gloo, CPU)
trains half of each batch's rows on each rank and averages the gradients (DistributedDataParallel). Reported: the
validation loss at the end (the target: the island within 1% of the single process), tokens/s as the coordinator
measured it (the island's against one rank's), wall time, and where a round's time went, from the learner's
`worker.round` log lines (inner steps; the pseudo-gradient and its encoding; adopting new parameters; waiting for
the broadcast; control calls) and its `worker.submitted` lines (upload).

    python -m diloco.bench.bench_island [--outer-steps 8 --local-steps 20]
    diloco bench --only island

On this machine (2 CPU cores, a small model) an island's step is not faster: the two ranks share the cores and
the all-reduce costs more than half a small batch saves. The figure that transfers to GPUs is the loss.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diloco.bench.section import Context, Log, standalone, table
from diloco.cluster import ClusterConfig, LocalCluster, LogFollower, seconds_until

LOSS_TOLERANCE = 0.01  # the island's loss within 1% of the single process's (issue #12)
PHASES = ("inner", "encode", "rebase", "wait", "control")


@dataclass(frozen=True)
class IslandSettings:
    outer_steps: int = 8
    local_steps: int = 20
    ranks: tuple[int, ...] = (1, 2)
    sharded: bool = True  # also a 2-rank island with --shard-model (FSDP2)
    timeout_s: float = 600.0


FULL = IslandSettings()
QUICK = IslandSettings(outer_steps=3, local_steps=5, sharded=False)


def run_one(ranks: int, s: IslandSettings, log: Log, sharded: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="diloco-bench-island-") as tmp:
        cfg = ClusterConfig(
            workers=1,
            mode="sync",
            outer_steps=s.outer_steps,
            local_steps=s.local_steps,
            min_local_steps=s.local_steps,
            min_quorum=1,
            run_dir=Path(tmp),
            insecure=True,
            nproc_per_worker=ranks,
            worker_args={0: ("--shard-model", "true")} if sharded else {},
            coordinator_args=("--eval-tokens", "16384"),
        )
        started = time.monotonic()
        with LocalCluster(cfg) as cluster:
            cluster.start(timeout_s=120)
            seconds_until("the job to finish", lambda: cluster.status().finished, timeout_s=s.timeout_s, interval_s=0.5)
            wall = time.monotonic() - started
            status = cluster.final_status()
            (worker,) = [w for w in cluster.workers().workers]
            lines = [line.fields for line in LogFollower(cluster.run_dir / "worker0.log").read()]
    rounds = [f for f in lines if f.get("event") == "worker.round"]
    uploads = [float(f["seconds"]) for f in lines if f.get("event") == "worker.submitted" and "seconds" in f]
    phases: dict[str, list[float]] = defaultdict(list)
    for f in rounds[1:]:  # the first round also holds the start-up (task build, first download)
        for p in PHASES:
            phases[p].append(float(f.get(f"{p}_s", 0.0)))
    result = {
        "ranks": ranks,
        "sharded": sharded,
        "validation_loss": status.validation_loss,
        "tokens_applied": status.tokens_applied,
        "outer_steps": status.version,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(worker.measured_tokens_per_s, 1),
        "device_kind": worker.throughput.device_kind,
        "round_s": {p: statistics.fmean(v) for p, v in phases.items() if v},
        "upload_s": statistics.fmean(uploads) if uploads else None,
        "rounds_timed": max(0, len(rounds) - 1),
    }
    log(
        f"  {_label(result)}: loss {result['validation_loss']:.4f} at {result['tokens_applied']:,} tokens, "
        f"{result['tokens_per_s']:,.0f} tokens/s, {wall:.1f} s"
    )
    return result


def run(s: IslandSettings, log: Log) -> dict[str, Any]:
    runs = [run_one(n, s, log) for n in s.ranks]
    if s.sharded:
        runs.append(run_one(2, s, log, sharded=True))
    base = runs[0]
    out: dict[str, Any] = {"settings": asdict(s), "runs": runs, "checks": []}
    for r in runs[1:]:
        gap = abs(r["validation_loss"] - base["validation_loss"]) / base["validation_loss"]
        out["checks"].append(
            {
                "name": f"{_label(r)} vs 1 rank: validation loss at equal tokens",
                "target": f"within {LOSS_TOLERANCE:.0%}",
                "measured": f"{r['validation_loss']:.4f} vs {base['validation_loss']:.4f} ({gap:.3%}); "
                f"tokens {r['tokens_applied']:,} vs {base['tokens_applied']:,}",
                "pass": gap <= LOSS_TOLERANCE and r["tokens_applied"] == base["tokens_applied"],
            }
        )
    return out


def section(ctx: Context) -> dict[str, Any]:
    return run(QUICK if ctx.quick else FULL, ctx.log)


def _label(x: dict[str, Any]) -> str:
    if x["ranks"] == 1:
        return "1 rank"
    return f"{x['ranks']} ranks (torchrun" + (", FSDP2 --shard-model)" if x.get("sharded") else ", DDP)")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    head = (
        f"Command: `python -m diloco.bench.bench_island --outer-steps {s['outer_steps']} --local-steps "
        f"{s['local_steps']}`. One learner, `sync` rounds of H = {s['local_steps']} inner steps, "
        f"{s['outer_steps']} outer steps, the embedded task; the learner as one process, then as a torchrun group "
        "of 2 ranks (gloo on CPU; each rank trains half of every global batch) with DistributedDataParallel, and with "
        "the model sharded over the ranks (FSDP2, `--shard-model`: rank 0 gathers the parameters for each "
        "pseudo-gradient and scatters each new version). Round phases are means over the "
        "rounds after the first, in seconds, from the learner's `worker.round` and `worker.submitted` log lines."
    )
    rows = [
        [
            _label(x),
            f"{x['validation_loss']:.4f}",
            f"{x['tokens_applied']:,}",
            f"{x['tokens_per_s']:,.0f}",
            f"{x['wall_s']:.1f}",
            *(_s(x["round_s"].get(p)) for p in PHASES),
            _s(x["upload_s"]),
        ]
        for x in r["runs"]
    ]
    cols = ["learner", "val loss", "tokens", "tokens/s (measured)", "wall s", *(f"{p} s" for p in PHASES), "upload s"]
    return head + "\n\n" + table(cols, rows)


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--outer-steps", type=int, default=FULL.outer_steps)
    p.add_argument("--local-steps", type=int, default=FULL.local_steps)


def main(argv: Sequence[str] | None = None) -> int:
    def go(a: argparse.Namespace, log: Log) -> dict[str, Any]:
        return run(IslandSettings(outer_steps=a.outer_steps, local_steps=a.local_steps), log)

    return standalone(__doc__, _flags, go, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
