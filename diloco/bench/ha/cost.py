"""The cost of synchronous replication (`diloco.bench.bench_ha`'s docstring, step 3): the same `sync` job with one
plain coordinator and with two replicas under etcd and `--sync-replicas 1`, its rounds and closes timed from the
leader's log."""

from __future__ import annotations

import itertools
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diloco.bench.bench_load import cpu_s
from diloco.bench.ha.settings import REPLICAS, CostSettings
from diloco.bench.ha.summary import median, num
from diloco.bench.ha.supervisor import HaCluster, standby_lead_s
from diloco.bench.section import Log
from diloco.cluster import ClusterConfig, LocalCluster, LogFollower, LogLine, wait_for


def cost_run(c: CostSettings, replicated: bool, run_dir: Path) -> dict[str, Any]:
    """One `sync` job of `c.rounds` rounds: one plain coordinator, or two replicas with `--sync-replicas 1`."""
    cfg = ClusterConfig(
        workers=c.workers,
        mode="sync",
        outer_steps=c.rounds,
        local_steps=c.local_steps,
        min_local_steps=c.local_steps,
        min_quorum=c.workers,
        checkpoint_every=1000,
        run_dir=run_dir,
        task_args=c.task_args,
        insecure=True,
    )
    started = time.monotonic()
    lead: list[float] = []
    if replicated:
        args = ("--replication-log", str(c.replication_log), "--sync-replicas", "1")
        with HaCluster(cfg, args) as ha:
            ha.start(timeout_s=c.timeout_s)
            leader = ha.replicas[REPLICAS[0]]

            def reached(version: int) -> bool:
                ha.pump()
                return leader.newest >= version

            etcd = ha.etcd.proc.pid if ha.etcd.proc is not None else -1
            cores = cores_while(lambda: {**pids(ha.cluster), "etcd": etcd}, reached, c)
            lines = LogFollower(leader.log.path).read()
            lead = standby_lead_s(ha, 0.0, math.inf)
            exits = list(ha.unplanned)
    else:
        with LocalCluster(cfg) as cluster:
            cluster.start(timeout_s=c.timeout_s)
            follower, lines = cluster.follow("coordinator"), []

            def reached(version: int) -> bool:  # its `round.closed` line written
                lines.extend(follower.read())
                return any(x.event == "round.closed" and int(x.fields["version"]) >= version for x in lines)

            cores = cores_while(lambda: pids(cluster), reached, c)
            exits = []
    closed = sorted((x for x in lines if x.event == "round.closed"), key=lambda x: int(x.fields["version"]))
    times = [x.logged_at for x in closed]
    return {
        "replicated": replicated,
        "rounds": len(times),
        "intervals_s": [round(b - a, 4) for a, b in itertools.pairwise(times)][c.warmup_rounds :],
        "close_s": close_latencies(lines)[c.warmup_rounds :],
        "applied_to_published_s": lead,
        "cores": cores,
        "unplanned_exits": exits,
        "wall_s": round(time.monotonic() - started, 1),
    }


def pids(cluster: LocalCluster) -> dict[str, int]:
    return {name: p.popen.pid for name, p in cluster.procs.items() if p.alive}


def cores_while(
    processes: Callable[[], dict[str, int]], reached: Callable[[int], bool], c: CostSettings
) -> dict[str, float]:
    """Wait for the job's last round; returns the cores each process used over the timed rounds (after the first
    `warmup_rounds`): what shares the machine with the learners."""
    wait_for("the timed rounds to start", lambda: reached(c.warmup_rounds + 1), c.timeout_s, 0.1)
    before, t0 = {name: cpu_s(pid) for name, pid in processes().items()}, time.monotonic()
    wait_for("the job to finish", lambda: reached(c.rounds), c.timeout_s, 0.1)
    after, dt = {name: cpu_s(pid) for name, pid in processes().items()}, time.monotonic() - t0
    return {name: round((after[name] - x) / dt, 3) for name, x in before.items() if name in after and dt > 0}


def close_latencies(lines: list[LogLine]) -> list[float]:
    """Per round, in one coordinator's log: from the submission that closed it (the last accepted before its
    `round.closed`; `sync` rounds close on the last learner's) to its publication."""
    out, accepted = [], None
    for x in lines:
        if x.event == "submission.accepted":
            accepted = x.logged_at
        elif x.event == "round.closed" and accepted is not None:
            out.append(round(x.logged_at - accepted, 4))
            accepted = None
    return out


def cost(c: CostSettings, log: Log) -> dict[str, Any]:
    """`c.repeats` pairs of runs (one coordinator, then two replicas), pooled per kind."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    errors = []
    for _ in range(c.repeats):
        for replicated in (False, True):
            with tempfile.TemporaryDirectory(prefix="diloco-bench-ha-cost-") as tmp:
                try:
                    r = cost_run(c, replicated, Path(tmp))
                except (TimeoutError, RuntimeError) as e:  # reported, not raised: the soak still runs
                    errors.append(str(e))
                    log(f"  {c.label}: a run failed: {e}")
                    continue
            runs[replicated].append(r)
            what = "2 replicas, --sync-replicas 1" if replicated else "one coordinator"
            log(
                f"  {c.label}, {what}: round {num(median(r['intervals_s']), 3)} s, close "
                f"{num(median(r['close_s']), 4)} s (medians of {len(r['intervals_s'])}), {r['wall_s']} s"
            )

    def pooled(kind: bool) -> dict[str, Any]:
        intervals = [x for r in runs[kind] for x in r["intervals_s"]]
        close = [x for r in runs[kind] for x in r["close_s"]]
        return {
            "replicated": kind,
            "round_s": median(intervals),
            "close_s": median(close),
            "rounds_timed": len(intervals),
            "applied_to_published_s": [x for r in runs[kind] for x in r["applied_to_published_s"]],
            "cores": {n: statistics.fmean(r["cores"][n] for r in runs[kind]) for n in runs[kind][0]["cores"]}
            if runs[kind]
            else {},
            "wall_s": sum(r["wall_s"] for r in runs[kind]),
            "runs": runs[kind],
        }

    plain, repl = pooled(False), pooled(True)
    ratio = repl["round_s"] / plain["round_s"] if plain["round_s"] and repl["round_s"] else None
    extra = repl["close_s"] - plain["close_s"] if plain["close_s"] is not None and repl["close_s"] is not None else None
    return {
        "settings": asdict(c),
        "plain": plain,
        "replicated": repl,
        "errors": errors,
        "ratio": ratio,
        "close_extra_s": extra,  # the replication's own latency on the critical path
        "close_extra_fraction": extra / plain["round_s"] if extra is not None and plain["round_s"] else None,
    }
