"""Real-cluster section of the suite (4): `LocalCluster` (healthd, coordinator, workers as separate processes on
loopback), one worker slowed down, `sync` against `decoupled` on the same token budget, then the same with a
full-speed worker SIGKILLed mid-run.

A recorder thread polls GetStatus and ListWorkers every `poll_s` for the timeline and the throughput series.
Around the kill the main thread polls faster: the kill-to-reassignment time ends when the killed incarnation is
`dead` and owns no shard in the ledger. The bench then restarts the worker, as a supervisor would, and measures
when the applied-token rate is back: the first `window_s` window that starts after the kill and whose rate is
at least `recovered_fraction` of the rate in the `window_s` before the kill.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from diloco.bench.section import Context, Log
from diloco.bench.settings import ClusterSettings
from diloco.cluster import ClusterConfig, LocalCluster
from diloco.v1 import common_pb2


def state_name(value: int) -> str:
    """A worker state as the report and plots name it (`active`, `dead`, ...)."""
    return common_pb2.WorkerState.Name(value).removeprefix("WORKER_STATE_").lower()


class Recorder(threading.Thread):
    """Samples coordinator status and worker states until stopped."""

    def __init__(self, cluster: LocalCluster, t0: float, poll_s: float) -> None:
        super().__init__(daemon=True, name="bench-recorder")
        self.cluster = cluster
        self.t0 = t0
        self.poll_s = poll_s
        self.samples: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                status = self.cluster.status(timeout_s=2.0)
                workers = self.cluster.workers(timeout_s=2.0)
            except grpc.RpcError:
                self.halt.wait(self.poll_s)
                continue
            self.samples.append(
                {
                    "t": round(time.monotonic() - self.t0, 3),
                    "version": status.version,
                    "tokens": status.tokens_applied,
                    "loss": status.validation_loss if math.isfinite(status.validation_loss) else None,
                    "workers": [
                        [
                            w.worker_name,
                            w.worker_id,
                            state_name(w.state),
                            w.tokens,
                            round(w.throughput.tokens_per_s, 1),
                            w.registered_unix_s,
                        ]
                        for w in workers.workers
                    ],
                }
            )
            self.halt.wait(self.poll_s)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)


def tokens_at(samples: list[dict[str, Any]], t: float) -> float:
    """Applied tokens at time `t`, linear between samples."""
    prev = samples[0]
    for s in samples:
        if s["t"] >= t:
            if s["t"] == prev["t"]:
                return float(s["tokens"])
            w = (t - prev["t"]) / (s["t"] - prev["t"])
            return float(prev["tokens"] + w * (s["tokens"] - prev["tokens"]))
        prev = s
    return float(samples[-1]["tokens"])


def rate(samples: list[dict[str, Any]], start: float, end: float) -> float:
    return (tokens_at(samples, end) - tokens_at(samples, start)) / (end - start) if end > start else math.nan


def recovery_s(
    samples: list[dict[str, Any]], kill_t: float, end_t: float, window_s: float, fraction: float
) -> tuple[float, float | None]:
    """(pre-kill rate, seconds from the kill to the start of the first post-kill window back at `fraction` of it)."""
    pre = rate(samples, max(samples[0]["t"], kill_t - window_s), kill_t)
    for t in _window_starts(samples, kill_t, end_t, window_s):
        if rate(samples, t, t + window_s) >= fraction * pre:
            return pre, t - kill_t
    return pre, None


def lowest_rate(samples: list[dict[str, Any]], kill_t: float, end_t: float, window_s: float) -> float:
    """The lowest applied-token rate over the `window_s` windows that start after the kill."""
    rates = [rate(samples, t, t + window_s) for t in _window_starts(samples, kill_t, end_t, window_s)]
    return min(rates, default=math.nan)


def _window_starts(samples: list[dict[str, Any]], kill_t: float, end_t: float, window_s: float) -> list[float]:
    return [s["t"] for s in samples if kill_t <= s["t"] and s["t"] + window_s <= end_t]


def _wait(what: str, predicate: Callable[[], bool], deadline: float, interval_s: float = 0.05) -> float:
    while time.monotonic() < deadline:
        try:
            if predicate():
                return time.monotonic()
        except grpc.RpcError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"timed out waiting for {what}")


def _wait_budget(
    cluster: LocalCluster, s: ClusterSettings, t0: float, deadline: float, events: dict[str, float]
) -> bool:
    """Wait until the token budget is applied (False) or no tokens were applied for `stall_s` (True)."""
    last_tokens, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        try:
            tokens = cluster.status().tokens_applied
        except grpc.RpcError:
            tokens = last_tokens
        now = time.monotonic()
        if tokens >= s.token_budget:
            events["budget_reached"] = now - t0
            return False
        if tokens != last_tokens:
            last_tokens, last_change = tokens, now
        elif now - last_change > s.stall_s:
            events["last_progress"] = last_change - t0
            events["stalled"] = now - t0
            return True
        time.sleep(0.1)
    raise TimeoutError(f"the cluster run did not reach {s.token_budget:,} tokens within {s.timeout_s:g} s")


def _incarnation(cluster: LocalCluster, name: str) -> Any:
    ws = [w for w in cluster.workers().workers if w.worker_name == name]
    return max(ws, key=lambda w: w.registered_unix_s) if ws else None


def run_cluster(s: ClusterSettings, mode: str, kill: bool, run_dir: Path, log: Log) -> dict[str, Any]:
    cfg = ClusterConfig(
        workers=s.workers,
        mode=mode,
        slowdowns=s.slowdowns,
        outer_steps=0,  # the bench stops the run at the token budget
        local_steps=s.local_steps,
        min_local_steps=s.min_local_steps,
        min_quorum=s.min_quorum,
        codec=s.codec,
        dead_after_s=s.dead_after_s,
        heartbeat_interval_s=s.heartbeat_interval_s,
        checkpoint_every=50,
        run_dir=run_dir,
        task_args=s.task_args,
    )
    victim = f"worker{s.victim}"
    events: dict[str, float] = {}
    t0 = time.monotonic()
    deadline = t0 + s.timeout_s
    with LocalCluster(cfg) as cluster:
        cluster.start(timeout_s=60)
        recorder = Recorder(cluster, t0, s.poll_s)
        recorder.start()
        try:
            events["all_registered"] = (
                _wait("every worker to register", lambda: cluster.status().live_workers >= s.workers, deadline) - t0
            )
            if kill:
                _wait(
                    "the kill point",
                    lambda: cluster.status().tokens_applied >= s.kill_fraction * s.token_budget,
                    deadline,
                )
                doomed = _incarnation(cluster, victim)
                cluster.kill(victim)
                events["kill"] = time.monotonic() - t0

                def reassigned() -> bool:
                    w = next(w for w in cluster.workers().workers if w.worker_id == doomed.worker_id)
                    owners = {shard.owner for shard in cluster.ledger().shards}
                    return w.state == common_pb2.WORKER_STATE_DEAD and doomed.worker_id not in owners

                events["reassigned"] = _wait("the reassignment", reassigned, deadline, interval_s=0.02) - t0
                cluster.start_worker(s.victim)
                events["restarted"] = time.monotonic() - t0
                events["rejoined"] = (
                    _wait(
                        "the restarted worker to register",
                        lambda: (
                            (w := _incarnation(cluster, victim)) is not None
                            and w.worker_id != doomed.worker_id
                            and w.state == common_pb2.WORKER_STATE_ACTIVE
                        ),
                        deadline,
                    )
                    - t0
                )
            stalled = _wait_budget(cluster, s, t0, deadline, events)
            status, workers = cluster.status(), cluster.workers()
        finally:
            recorder.stop()
    samples = recorder.samples
    end = events["stalled"] if stalled else events["budget_reached"]
    wall = end - events["all_registered"]
    per_worker: dict[str, dict[str, float]] = {}
    for w in workers.workers:
        entry = per_worker.setdefault(w.worker_name, {"tokens": 0, "incarnations": 0})
        entry["tokens"] += w.tokens
        entry["incarnations"] += 1
    for name, entry in per_worker.items():
        entry["tokens_per_s"] = entry["tokens"] / wall
        speeds = [x[4] for smp in samples for x in smp["workers"] if x[0] == name and x[4] > 0]
        entry["measured_tokens_per_s"] = sum(speeds) / len(speeds) if speeds else 0.0
    out: dict[str, Any] = {
        "mode": mode,
        "kill": kill,
        "wall_s": wall,
        "tokens": status.tokens_applied,
        "rounds": status.version,
        "final_loss": status.validation_loss,
        "stalled": stalled,
        "rejected": status.rejected_submissions,
        "bytes": status.bytes_received + status.bytes_sent,
        "tokens_per_s": status.tokens_applied / wall,
        "workers": dict(sorted(per_worker.items())),
        "events": events,
        "samples": samples,
    }
    if kill:
        pre, rec = recovery_s(samples, events["kill"], end, s.window_s, s.recovered_fraction)
        out["victim"] = victim
        out["reassign_s"] = events["reassigned"] - events["kill"]
        out["pre_kill_tokens_per_s"] = pre
        out["recovery_s"] = rec
        out["lowest_post_kill_tokens_per_s"] = lowest_rate(samples, events["kill"], end, s.window_s)
    log(
        f"  {mode}{' + SIGKILL' if kill else ''}: {wall:.1f} s to {status.tokens_applied:,} tokens"
        f"{' (STALLED: no round for ' + format(s.stall_s, 'g') + ' s)' if stalled else ''}, "
        f"loss {status.validation_loss:.4f}"
        + (
            f", reassigned in {out['reassign_s']:.2f} s, throughput back after "
            + ("never" if out["recovery_s"] is None else f"{out['recovery_s']:.1f} s")
            if kill
            else ""
        )
    )
    return out


def cluster(s: ClusterSettings, run_root: Path, log: Log) -> dict[str, Any]:
    runs = []
    for kill in s.kill_runs:
        for mode in s.modes:
            runs.append(run_cluster(s, mode, kill, run_root / f"{mode}{'-kill' if kill else ''}", log))
    checks = []
    for r in runs:
        checks.append(
            {
                "name": f"{r['mode']}{' + SIGKILL' if r['kill'] else ''} reaches the token budget",
                "target": f"no stall (a round at least every {s.stall_s:g} s)",
                "measured": f"stalled at {r['tokens']:,} tokens"
                if r["stalled"]
                else f"{r['tokens']:,} tokens in {r['wall_s']:.1f} s",
                "pass": not r["stalled"],
            }
        )
        if r["kill"]:
            checks.append(
                {
                    "name": f"kill to reassignment ({r['mode']})",
                    "target": "within the 5 s window (ALGORITHM.md section 8)",
                    "measured": f"{r['reassign_s']:.2f} s",
                    "pass": r["reassign_s"] <= 5.0,
                }
            )
    settings = dict(vars(s))
    return {"settings": settings, "runs": runs, "checks": checks}


def section(ctx: Context) -> dict[str, Any]:
    """The suite's `cluster` section: every run's logs in a temp folder, kept only when a run fails."""
    run_root = Path(tempfile.mkdtemp(prefix="diloco-bench-cluster-"))
    try:
        result = cluster(ctx.profile.cluster, run_root, ctx.log)
    except BaseException:
        ctx.log(f"  the cluster logs are kept in {run_root}")
        raise
    shutil.rmtree(run_root, ignore_errors=True)
    return result
