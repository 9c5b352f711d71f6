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
import enum
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from diloco.bench.bench_load import cpu_s
from diloco.bench.section import Context, Log, table
from diloco.cluster import (
    TINY_TASK_ARGS,
    ClusterConfig,
    LocalCluster,
    LogFollower,
    LogLine,
    ledger_problems,
    ledger_shards,
    wait_for,
)
from diloco.errors import ConfigError
from diloco.ha.etcd_server import EtcdServer, etcd_binary
from diloco.rpc.server import channel
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc

MEDIAN_TARGET_S = 5.0  # kill -> first round committed by the new leader (issue #14)
MAX_TARGET_S = 10.0
REPLICAS = ("coord-a", "coord-b")
NO_ETCD = "no etcd binary: install Debian's etcd-server (make etcd, or scripts/install_etcd.sh as root)"
NEVER = 1_000_000_000  # the soak's job target until the soak sets the real one (module docstring)


class KillPoint(enum.Enum):
    ROUND_CLOSED = "after round.closed"
    SUBMITTED = "after worker.submitted"
    DELAY = "random delay"


@dataclass(frozen=True)
class SoakSettings:
    kills: int = 50
    workers: int = 3
    local_steps: int = 10
    min_local_steps: int = 2
    min_quorum: int = 2
    slowdown: float = 2.0  # every learner's (sleeps after each step): less CPU contention on 2 cores
    checkpoint_every: int = 5
    replication_log: int = 16
    steady_s: float = 15.0  # the steady phase before the first kill (throughput and lag)
    lag_poll_s: float = 0.1
    max_delay_s: float = 1.5  # a DELAY kill waits uniformly in [0, this] once the standby is in step
    restart_delay_s: float = 0.0  # the supervisor's wait before starting an ended replica again
    finish_rounds: int = 10  # the job's target, set at the end: this many rounds past where the final kill should be
    seed: int = 14
    poll_s: float = 0.01
    step_timeout_s: float = 60.0  # the longest wait for one event
    task_args: tuple[str, ...] = TINY_TASK_ARGS

    def __post_init__(self) -> None:
        if self.kills < 1 or self.workers < self.min_quorum or self.finish_rounds < 2:
            raise ConfigError("ha soak: kills >= 1, workers >= min_quorum and finish_rounds >= 2")


@dataclass(frozen=True)
class CostSettings:
    label: str
    task_args: tuple[str, ...] = ()  # () : the coordinator's default model
    workers: int = 3
    local_steps: int = 10
    rounds: int = 20
    warmup_rounds: int = 3
    repeats: int = 2  # pairs of runs (one coordinator, then two replicas), alternating; figures pooled per kind
    replication_log: int = 4  # entries of Δ the leader keeps (model-sized each)
    target: float = 0.10  # the replication's latency on a round (close, replicated - plain) / the plain round
    timeout_s: float = 300.0


@dataclass(frozen=True)
class HaSettings:
    soak: SoakSettings = field(default_factory=SoakSettings)
    cost: tuple[CostSettings, ...] = ()


DEFAULT_MODEL = CostSettings("default model (`diloco coordinator` defaults)", ("--eval-tokens", "4096"))
# bench_large's model and shapes (2 learners, batch 4 x 128) with one inner step a round (bench_large: 2)
LARGE_MODEL = CostSettings(
    "hf:llama-100m (75.7 M parameters with the byte tokenizer)",
    ("--model", "hf:llama-100m", "--batch-size", "4", "--seq-len", "128", "--eval-every", "0"),
    workers=2,
    local_steps=1,
    rounds=6,
    warmup_rounds=1,
    repeats=1,
    replication_log=2,
    target=0.20,
    timeout_s=400.0,
)
FULL = HaSettings(SoakSettings(), (DEFAULT_MODEL, LARGE_MODEL))
QUICK = HaSettings(
    SoakSettings(kills=2, steady_s=3.0, finish_rounds=4),
    (CostSettings(DEFAULT_MODEL.label, DEFAULT_MODEL.task_args, workers=2, rounds=6, warmup_rounds=1, repeats=1),),
)


class SoakError(RuntimeError):
    """The soak could not go on (a wait ran out, a process would not come back); the message says where."""


# --- the replicated cluster ---------------------------------------------------------------------------------------


@dataclass
class Replica:
    """One replica as the supervisor sees it, from its log (every incarnation appends to one file)."""

    name: str
    log: LogFollower
    port: int = 0
    args: tuple[str, ...] = ()  # its replication flags (and, at the end of the soak, the new target)
    incarnation: int = 0  # `replica.started` lines seen
    held: tuple[int, int] | None = None  # (epoch, version) this incarnation holds as a standby
    elected: LogLine | None = None  # this incarnation's `leadership.changed` to leader
    promoted: LogLine | None = None  # this incarnation's `replica.promoted`
    closed: list[LogLine] = field(default_factory=list)  # this incarnation's `round.closed` lines
    applied: list[LogLine] = field(default_factory=list)  # every `replication.applied` line (all incarnations)
    commits: list[LogLine] = field(default_factory=list)  # every `round.closed` line (all incarnations)
    # versions published with no standby following (`replication.degraded`, nobody lagging; the quiet ones of a
    # degraded run are counted when it ends, `replication.restored`: a run a kill cut short counts its first only)
    alone: int = 0
    ack_timeouts: int = 0  # versions published when a following standby's ack did not come in time
    restart_at: float | None = None  # when the supervisor starts it again (monotonic)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def take(self, lines: list[LogLine]) -> None:
        for x in lines:
            e, f = x.event, x.fields
            if e == "replica.started":
                self.incarnation += 1
                self.port = self.port or int(str(f["address"]).rsplit(":", 1)[1])
                self.held, self.elected, self.promoted, self.closed = None, None, None, []
            elif e == "leadership.changed" and f.get("role") == "leader":
                self.elected = x
            elif e == "replica.promoted":
                self.promoted = x
            elif e == "round.closed":
                self.closed.append(x)
                self.commits.append(x)
            elif e in ("replication.applied", "replication.snapshot_loaded"):
                self.held = (int(f["epoch"]), int(f["version"]))
                if e == "replication.applied":
                    self.applied.append(x)
            elif e == "replication.degraded" and f.get("lagging"):
                self.ack_timeouts += 1
            elif e == "replication.degraded":
                self.alone += 1
            elif e == "replication.restored":  # the degraded versions after the first that were not logged
                self.alone += int(str(f.get("quiet_versions", 0)))

    @property
    def newest(self) -> int:
        """The newest version this incarnation committed as leader (its promoted version before any)."""
        if self.closed:
            return int(self.closed[-1].fields["version"])
        return int(self.promoted.fields["version"]) if self.promoted else -1

    @property
    def epoch(self) -> int:
        return int(self.promoted.fields["epoch"]) if self.promoted else -1


class HaCluster:
    """etcd, healthd, two replicas and the learners of `cfg`; `pump()` reads every log and restarts ended
    replicas (the supervisor). Every child, etcd included, is reaped on exit."""

    def __init__(self, cfg: ClusterConfig, replica_args: Sequence[str], restart_delay_s: float = 0.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise ConfigError(NO_ETCD)
        self.cluster = LocalCluster(cfg)
        self.etcd = EtcdServer(binary, cfg.run_dir / "etcd")
        self.replica_args = tuple(replica_args)
        self.replicas = {n: Replica(n, self.cluster.follow(n), args=self.replica_args) for n in REPLICAS}
        self.learners = {f"worker{i}": self.cluster.follow(f"worker{i}") for i in range(cfg.workers)}
        self.restart_delay_s = restart_delay_s
        self.killed: set[str] = set()  # replicas this process ended (SIGKILL, SIGTERM) and not yet restarted
        self.unplanned: list[str] = []  # replica exits nobody asked for (status, log tail)
        self.learner_exits: dict[str, str] = {}

    def __enter__(self) -> HaCluster:
        self.etcd.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.cluster.stop()
        finally:
            self.etcd.stop()

    def start(self, timeout_s: float) -> None:
        """healthd, coord-a until it leads, coord-b until it follows, healthd again with both addresses (it follows
        the leader), then the learners."""
        c = self.cluster
        c.healthd_port = c.bound_port(c.start_healthd(), "healthd.started", timeout_s)
        a, b = self.replicas.values()
        self._start(a)
        self.until("coord-a to lead", lambda: a.promoted is not None, timeout_s)
        self._start(b)
        self.until("coord-b to follow coord-a", lambda: b.held is not None, timeout_s)
        both = f"{a.address},{b.address}"
        c.stop_child("healthd", grace_s=10)
        c.start_healthd(both)
        c.cfg.worker_args.update({i: ("--coordinator", both) for i in range(c.cfg.workers)})
        for i in range(c.cfg.workers):
            c.start_worker(i)

    def _start(self, r: Replica) -> None:
        self.cluster.start_replica(r.name, self.etcd.url, r.port, r.args)
        self.killed.discard(r.name)
        r.restart_at = None

    def pump(self) -> None:
        """Read every log; start again a replica that ended (after `restart_delay_s`); note learners that exited."""
        for r in self.replicas.values():
            r.take(r.log.read())
            p = self.cluster.procs.get(r.name)
            if p is None or p.alive:
                continue
            now = time.monotonic()
            if r.restart_at is None:
                r.take(r.log.read())  # the rest of the ended incarnation's lines
                if r.name not in self.killed:
                    self.unplanned.append(f"{r.name} exited with {p.popen.returncode}:\n{self.cluster.tail(r.name)}")
                r.restart_at = now + self.restart_delay_s
            if now >= r.restart_at:
                self._start(r)
        for name in self.learners:
            p = self.cluster.procs.get(name)
            if p is not None and not p.alive and name not in self.learner_exits:
                self.learner_exits[name] = f"exit status {p.popen.returncode}:\n{self.cluster.tail(name)}"

    def until(self, what: str, predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.01) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            if predicate():
                return
            if time.monotonic() > deadline:
                raise SoakError(f"no {what} within {timeout_s:g} s")
            time.sleep(poll_s)

    def leader(self) -> Replica | None:
        """The replica serving now (a live one whose incarnation was promoted), the newest epoch first."""
        live = [
            r
            for r in self.replicas.values()
            if r.promoted is not None and r.name in self.cluster.procs and self.cluster.procs[r.name].alive
        ]
        return max(live, key=lambda r: r.epoch, default=None)

    def kill(self, r: Replica) -> float:
        """SIGKILL replica `r`; returns the wall time just before the signal."""
        self.killed.add(r.name)
        at = time.time()
        self.cluster.kill(r.name)
        self._gone(r)
        return at

    def stop_replica(self, r: Replica) -> None:
        """SIGTERM (a standby exits 0); the supervisor starts it again."""
        self.killed.add(r.name)
        self.cluster.stop_child(r.name, grace_s=15)
        self._gone(r)

    def _gone(self, r: Replica) -> None:
        """`r`'s process exited: read the rest of its log, then forget what it held as a standby, which says
        nothing of its next incarnation (else a stopped standby counted as in step with a leader that went on
        publishing without it, until the next incarnation's first line was read)."""
        self.pump()
        r.held = None

    def status(self, r: Replica, timeout_s: float = 3.0) -> coordinator_pb2.GetStatusResponse:
        with channel(r.address) as ch:
            return coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(
                coordinator_pb2.GetStatusRequest(), timeout=timeout_s
            )

    def finished(self, r: Replica) -> bool:
        """The job finished at replica `r` (False while it does not answer)."""
        try:
            return self.status(r).finished
        except grpc.RpcError:
            return False

    def ledger(self, r: Replica, timeout_s: float = 5.0) -> coordinator_pb2.GetLedgerResponse:
        with channel(r.address) as ch:
            return coordinator_pb2_grpc.CoordinatorStub(ch).GetLedger(
                coordinator_pb2.GetLedgerRequest(), timeout=timeout_s
            )


def in_step(standby: Replica, leader: Replica) -> bool:
    """The standby holds the leader's newest committed version (or a newer one it stepped) under its epoch."""
    return standby.held is not None and standby.held[0] == leader.epoch and standby.held[1] >= leader.newest


# --- the soak -----------------------------------------------------------------------------------------------------


@dataclass
class KillRecord:
    point: str
    at: float  # wall time of the SIGKILL
    victim: str
    version: int  # the victim's newest committed version
    epoch: int
    delay_s: float = 0.0  # DELAY kills: the drawn delay
    new_leader: str = ""
    new_epoch: int = 0
    resumed: int = 0  # the new leader's version at promotion
    elected_s: float | None = None
    serving_s: float | None = None
    first_round_s: float | None = None
    first_round: int = 0
    standby_back_s: float | None = None  # the kill -> the victim's restart in step with the new leader


class Soak:
    def __init__(self, ha: HaCluster, s: SoakSettings, log: Log) -> None:
        self.ha, self.s, self.log = ha, s, log
        self.rng = random.Random(s.seed)
        self.kills: list[KillRecord] = []
        self.lag: list[int] = []  # sampled: the standby's lag as the leader's GetStatus says (`ctl status`)
        self.rounds_per_s = 0.0  # in the steady phase
        self.early_exits: dict[str, str] = {}  # learners that exited before the job could finish
        self.target = 0  # the job's target, set for the final kill

    def _pair(self) -> tuple[Replica, Replica]:
        leader = self.ha.leader()
        if leader is None:
            raise SoakError("no replica leads")
        (standby,) = [r for r in self.ha.replicas.values() if r is not leader]
        return leader, standby

    def wait_in_step(self) -> tuple[Replica, Replica]:
        """Until a leader committed a round and the standby holds its newest version; returns them."""
        pair: list[Replica] = []

        def ready() -> bool:
            leader = self.ha.leader()
            if leader is None or not leader.closed:
                return False
            (standby,) = [r for r in self.ha.replicas.values() if r is not leader]
            pair[:] = [leader, standby]
            return standby.name not in self.ha.killed and in_step(standby, leader)

        self.ha.until("the standby in step with the leader", ready, self.s.step_timeout_s, self.s.poll_s)
        return pair[0], pair[1]

    def steady(self) -> tuple[float, float]:
        """The steady phase: sample the standby's lag; returns its (start, end) wall times."""
        leader, standby = self.wait_in_step()
        start, first = time.time(), leader.newest
        end_mono = time.monotonic() + self.s.steady_s
        while time.monotonic() < end_mono:
            self.ha.pump()
            try:
                status = self.ha.status(leader, timeout_s=1.0).ha
            except grpc.RpcError:
                continue
            self.lag += [r.lag_versions for r in status.replicas if r.replica_id == standby.name]
            time.sleep(self.s.lag_poll_s)
        end = time.time()
        self.rounds_per_s = (leader.newest - first) / (end - start)
        return start, end

    def _trigger(self, point: KillPoint, leader: Replica) -> float:
        """Wait for the kill point; returns the drawn delay (DELAY) or 0."""
        if point is KillPoint.DELAY:
            delay = self.rng.uniform(0.0, self.s.max_delay_s)
            end = time.monotonic() + delay
            self.ha.until("the delay", lambda: time.monotonic() >= end, delay + 5, self.s.poll_s)
            return delay
        if point is KillPoint.ROUND_CLOSED:
            seen = len(leader.closed)
            self.ha.until("a round to close", lambda: len(leader.closed) > seen, self.s.step_timeout_s, 0.002)
            return 0.0
        for f in self.ha.learners.values():
            f.read()  # only submissions from now on

        def submitted() -> bool:
            return any(x.event == "worker.submitted" for f in self.ha.learners.values() for x in f.read())

        self.ha.until("a learner's accepted submission", submitted, self.s.step_timeout_s, 0.002)
        return 0.0

    def kill_once(self, point: KillPoint) -> KillRecord:
        leader, _ = self.wait_in_step()
        delay = self._trigger(point, leader)
        at = self.ha.kill(leader)
        self.ha.pump()  # reads the rest of the victim's log
        rec = KillRecord(point.value, at, leader.name, leader.newest, leader.epoch, delay_s=round(delay, 3))
        winner: list[Replica] = []

        def promoted() -> bool:  # the standby, or (a finding) the victim's own restarted incarnation
            winner[:] = [r for r in self.ha.replicas.values() if r.promoted and r.promoted.logged_at > at]
            return bool(winner)

        self.ha.until("a new leader to serve", promoted, self.s.step_timeout_s)
        new = winner[0]
        assert new.promoted is not None
        rec.new_leader, rec.new_epoch, rec.resumed = new.name, new.epoch, int(new.promoted.fields["version"])
        rec.serving_s = new.promoted.logged_at - at
        rec.elected_s = new.elected.logged_at - at if new.elected is not None else None
        if self.ha.finished(new):  # the final kill's new leader may resume at the job's target already
            return rec
        self.ha.until("the new leader's first round", lambda: bool(new.closed), self.s.step_timeout_s)
        first = new.closed[0]
        rec.first_round_s, rec.first_round = first.logged_at - at, int(first.fields["version"])
        self.wait_in_step()
        rec.standby_back_s = time.time() - at
        return rec

    def run(self) -> tuple[float, float]:
        """Every kill, then the job's end (module docstring); returns the wall times of the first and last kill."""
        points = list(KillPoint)
        for n in range(1, self.s.kills + 1):
            rec = self.kill_once(self.rng.choice(points))
            self.kills.append(rec)
            self.log(f"  kill {n}/{self.s.kills}: {describe(rec)}")
        self.early_exits = dict(self.ha.learner_exits)  # the job cannot finish before this last failover
        self._set_target()
        rec = self.kill_once(KillPoint.DELAY)
        self.kills.append(rec)
        self.log(f"  final kill (the new leader ends the job at version {self.target}): {describe(rec)}")
        return self.kills[0].at, rec.at

    def _set_target(self) -> None:
        """Restart the standby with the job's target: far enough ahead that the final kill meets a running job
        (`finish_rounds` past the version when the standby is back in step, plus the rounds of the kill's longest
        delay), guessed from the rounds a restart took so far and raised by another restart when too close."""
        back = _median([k.standby_back_s for k in self.kills if k.standby_back_s is not None]) or 0.0
        margin = self.s.finish_rounds + math.ceil(self.rounds_per_s * self.s.max_delay_s)
        for _ in range(3):
            leader, standby = self.wait_in_step()
            self.target = leader.newest + margin + math.ceil(self.rounds_per_s * back)
            for r in self.ha.replicas.values():
                r.args = (*r.args[: len(self.ha.replica_args)], "--target-outer-steps", str(self.target))
            self.ha.stop_replica(standby)
            leader, _ = self.wait_in_step()
            if self.target - leader.newest >= margin:
                return
            back *= 2


def describe(r: KillRecord) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    return (
        f"{r.victim} ({r.point}) at v{r.version}; {r.new_leader} leads epoch {r.new_epoch} at v{r.resumed}: elected "
        f"{f(r.elected_s)}, serving {f(r.serving_s)}, first round (v{r.first_round}) {f(r.first_round_s)}"
    )


def commits_of(ha: HaCluster) -> list[tuple[float, int, int]]:
    """Every committed round of every replica, in log time: (wall time, version, tokens)."""
    lines = [x for r in ha.replicas.values() for x in r.commits]
    return sorted((x.logged_at, int(x.fields["version"]), int(x.fields.get("tokens", 0))) for x in lines)


def tokens_between(commits: list[tuple[float, int, int]], start: float, end: float) -> int:
    return sum(tokens for t, _, tokens in commits if start <= t < end)


def invariant_problems(ha: HaCluster, kills: list[KillRecord], commits: list[tuple[float, int, int]]) -> list[str]:
    """What the soak must not end with, besides the ledger and the job (module docstring)."""
    out: list[str] = []
    received: list[tuple[float, int]] = []
    for name in ha.learners:
        got = [
            x for x in LogFollower(ha.cluster.run_dir / f"{name}.log").read() if x.event == "worker.broadcast_received"
        ]
        seen = [int(x.fields["version"]) for x in got]
        if seen != sorted(seen):
            back = next(i for i in range(1, len(seen)) if seen[i] < seen[i - 1])
            out.append(f"{name} received version {seen[back]} after {seen[back - 1]}")
        received += [(x.logged_at, int(x.fields["version"])) for x in got]
    for k in kills:
        before = max((v for t, v in received if t < k.at), default=0)
        if k.resumed < before:
            out.append(f"the leader after the kill at v{k.version} resumed at v{k.resumed}, below v{before} received")
    versions = [v for _, v, _ in commits]
    if len(set(versions)) != len(versions):
        twice = sorted({v for v in versions if versions.count(v) > 1})
        out.append(f"versions committed twice: {twice[:10]}")
    if any(b <= a for a, b in itertools.pairwise(versions)):
        out.append("committed versions went backwards in log time")
    epochs = [k.epoch for k in kills] + [kills[-1].new_epoch] if kills else []
    if any(b <= a for a, b in itertools.pairwise(epochs)):
        out.append(f"epochs did not rise at every promotion: {epochs}")
    return out


def run_soak(s: SoakSettings, run_dir: Path, log: Log) -> dict[str, Any]:
    cfg = ClusterConfig(
        workers=s.workers,
        mode="decoupled",
        slowdowns=(s.slowdown,) * s.workers,
        outer_steps=NEVER,
        local_steps=s.local_steps,
        min_local_steps=s.min_local_steps,
        min_quorum=s.min_quorum,
        checkpoint_every=s.checkpoint_every,
        run_dir=run_dir,
        task_args=s.task_args,
        insecure=True,
    )
    replica_args = ("--replication-log", str(s.replication_log), "--sync-replicas", "1")
    started = time.monotonic()
    with HaCluster(cfg, replica_args, s.restart_delay_s) as ha:
        ha.start(timeout_s=s.step_timeout_s)
        soak = Soak(ha, s, log)
        steady_start, steady_end = soak.steady()
        log(f"  steady phase: {len(soak.lag)} lag samples")
        first_kill, last_kill = soak.run()
        leader = ha.leader()
        assert leader is not None
        ha.until("the job to finish", lambda: ha.finished(leader), s.step_timeout_s, 0.2)
        status, ledger = ha.status(leader), ha.ledger(leader)
        ha.until("the learners to exit", lambda: len(ha.learner_exits) == len(ha.learners), s.step_timeout_s, 0.1)
        commits = commits_of(ha)
        problems = invariant_problems(ha, soak.kills, commits)
        applied_to_published = standby_lead_s(ha, steady_start, steady_end)
        result = {
            "kills": [asdict(k) for k in soak.kills],
            "lag_samples": soak.lag,
            "applied_to_published_s": applied_to_published,
            "steady": {
                "start": steady_start,
                "end": steady_end,
                "tokens": tokens_between(commits, steady_start, steady_end),
            },
            "cycles": cycles(commits, soak.kills),
            "soak_tokens": tokens_between(commits, first_kill, last_kill),
            "soak_s": last_kill - first_kill,
            "finished": status.finished,
            "version": status.version,
            "target": status.target_outer_steps,
            "tokens_applied": status.tokens_applied,
            "ledger_problems": ledger_problems(ledger_shards(ledger), status.tokens_applied),
            "invariant_problems": problems,
            "published_without_standby": sum(r.alone for r in ha.replicas.values()),
            "ack_timeouts": sum(r.ack_timeouts for r in ha.replicas.values()),
            "unplanned_replica_exits": list(ha.unplanned),
            "learner_exits": learner_problems(ha, soak.early_exits),
            "final_target": soak.target,
            "wall_s": time.monotonic() - started,
        }
    return result


def learner_problems(ha: HaCluster, early: dict[str, str]) -> dict[str, str]:
    """Learners that exited before the job could finish, or later without status 0 and reason `finished`."""
    out = dict(early)
    for name in ha.learners:
        if name in out:
            continue
        p = ha.cluster.procs[name]
        reasons = [x.fields.get("reason") for x in LogFollower(p.log_path).read() if x.event == "worker.exited"]
        if p.popen.returncode != 0 or reasons[-1:] != ["finished"]:
            out[name] = f"exit status {p.popen.returncode}, reason {reasons[-1:]}:\n{ha.cluster.tail(name)}"
    return out


def standby_lead_s(ha: HaCluster, start: float, end: float) -> list[float]:
    """Per version committed in [start, end): seconds from the standby applying it to the leader publishing it."""
    applied = {int(x.fields["version"]): x.logged_at for r in ha.replicas.values() for x in r.applied}
    out = []
    for r in ha.replicas.values():
        for x in r.commits:
            v, t = int(x.fields["version"]), x.logged_at
            if start <= t < end and v in applied:
                out.append(round(t - applied[v], 4))
    return out


def cycles(commits: list[tuple[float, int, int]], kills: list[KillRecord]) -> list[dict[str, float]]:
    """Each kill's cycle: from it to the next kill, with the tokens committed meanwhile."""
    return [
        {"start": a.at, "end": b.at, "tokens": tokens_between(commits, a.at, b.at)}
        for a, b in itertools.pairwise(kills)
    ]


# --- the cost of synchronous replication ----------------------------------------------------------------------------


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
                f"  {c.label}, {what}: round {_s(_median(r['intervals_s']), 3)} s, close "
                f"{_s(_median(r['close_s']), 4)} s (medians of {len(r['intervals_s'])}), {r['wall_s']} s"
            )

    def pooled(kind: bool) -> dict[str, Any]:
        intervals = [x for r in runs[kind] for x in r["intervals_s"]]
        close = [x for r in runs[kind] for x in r["close_s"]]
        return {
            "replicated": kind,
            "round_s": _median(intervals),
            "close_s": _median(close),
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


# --- the section ----------------------------------------------------------------------------------------------------


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _s(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def spread(xs: Sequence[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": _median(xs), "p90": _quantile(xs, 0.9), "max": max(xs, default=None)}


def summarize(soak: dict[str, Any]) -> dict[str, Any]:
    """The soak's figures for the report: recovery times, throughput, lag."""
    kills = soak["kills"]
    times = {
        key: spread([k[key] for k in kills if k[key] is not None])
        for key in ("elected_s", "serving_s", "first_round_s", "standby_back_s")
    }
    by_point = {
        p.value: spread([k["first_round_s"] for k in kills if k["point"] == p.value and k["first_round_s"] is not None])
        for p in KillPoint
    }
    st = soak["steady"]
    steady_rate = st["tokens"] / (st["end"] - st["start"]) if st["end"] > st["start"] else None
    lost = [c["end"] - c["start"] - c["tokens"] / steady_rate for c in soak["cycles"]] if steady_rate else []
    rates = [c["tokens"] / (c["end"] - c["start"]) / steady_rate for c in soak["cycles"]] if steady_rate else []
    lag = soak["lag_samples"]
    return {
        "times": times,
        "first_round_by_point": by_point,
        "steady_tokens_per_s": steady_rate,
        "soak_tokens_per_s": soak["soak_tokens"] / soak["soak_s"] if soak["soak_s"] > 0 else None,
        "cycle_rate_ratio": spread(rates),
        "lost_steady_s_per_failover": {**spread(lost), "mean": statistics.fmean(lost) if lost else None},
        "cycle_s": spread([c["end"] - c["start"] for c in soak["cycles"]]),
        "lag_versions": {
            "samples": len(lag),
            "histogram": {str(v): lag.count(v) for v in sorted(set(lag))},
            "max": max(lag, default=None),
            "mean": statistics.fmean(lag) if lag else None,
        },
        "applied_to_published_s": spread(soak["applied_to_published_s"]),
        "stale_wins": sum(1 for k in kills if k["new_leader"] == k["victim"]),
    }


def checks(
    soak: dict[str, Any], summary: dict[str, Any], costs: list[dict[str, Any]], error: str
) -> list[dict[str, Any]]:
    first = summary["times"]["first_round_s"] if summary else {"n": 0, "median": None, "max": None}
    n = first["n"]
    out = [
        {
            "name": f"leader SIGKILL → first round committed by the new leader, median over {n} kills",
            "target": f"≤ {MEDIAN_TARGET_S:g} s",
            "measured": "not measured (see the section)" if error else f"{_s(first['median'])} s",
            "pass": None if error else first["median"] is not None and first["median"] <= MEDIAN_TARGET_S,
        },
        {
            "name": f"leader SIGKILL → first round committed by the new leader, max over {n} kills",
            "target": f"≤ {MAX_TARGET_S:g} s",
            "measured": "not measured (see the section)" if error else f"{_s(first['max'])} s",
            "pass": None if error else first["max"] is not None and first["max"] <= MAX_TARGET_S,
        },
    ]
    if not error:
        problems = invariant_list(soak)
        out.append(
            {
                "name": "after the soak: versions never backwards, ledger exactly once, job finished, no learner lost",
                "target": "no problem",
                "measured": f"{len(problems)} problem(s)" + (": " + "; ".join(problems)[:300] if problems else ""),
                "pass": not problems,
            }
        )
    for c in costs:
        s, share = c["settings"], c["close_extra_fraction"]
        raw = "" if c["ratio"] is None else f"; whole rounds {c['ratio'] - 1:+.1%}, see the section"
        closes = f"close {_s(ms(c['replicated']['close_s']), 1)} vs {_s(ms(c['plain']['close_s']), 1)} ms"
        out.append(
            {
                "name": f"synchronous replication (1 standby): its latency on a round, {s['label']}",
                "target": f"≤ +{s['target']:.0%} of the round",
                "measured": "n/a" if share is None else f"{share:+.1%} ({closes}{raw})",
                "pass": None if share is None else share <= s["target"],
            }
        )
    return out


def invariant_list(soak: dict[str, Any]) -> list[str]:
    out = list(soak["invariant_problems"])
    out += [f"ledger: {p}" for p in soak["ledger_problems"]]
    if not soak["finished"] or soak["version"] < soak["target"]:
        out.append(f"the job did not finish: version {soak['version']} of {soak['target']}")
    out += [f"{name} exited: {why.splitlines()[0]}" for name, why in soak["learner_exits"].items()]
    return out


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


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]["soak"]
    soak, m = r["soak"], r["summary"]
    parts = [
        "Command: `python -m diloco.bench.bench_ha` (`diloco/bench/bench_ha.py`; its docstring says what each step "
        "waits for). Real processes on loopback, plaintext: etcd (Debian's etcd-server), two coordinator replicas "
        f"under its leadership (`--etcd`, `--replication-log {s['replication_log']} --sync-replicas 1`, lease TTL "
        f"2 s), healthd and {s['workers']} learners of the tiny task (`diloco.cluster.TINY_TASK_ARGS`), all given both "
        f"addresses, decoupled rounds (K = {s['min_quorum']}, H = {s['local_steps']}, learners slowed "
        f"{s['slowdown']:g}x), a checkpoint every {s['checkpoint_every']} rounds. The benchmark supervises the "
        f"replicas: one that ends is started again on its port {s['restart_delay_s']:g} s later, and comes back as "
        f"a standby. After a {s['steady_s']:g} s steady phase, {s['kills']} leader SIGKILLs (seed {s['seed']}), each "
        "once the standby holds the leader's newest version, at a drawn point: right after the leader's "
        f"`round.closed`, right after a learner's `worker.submitted` (mid-round), or after a delay in [0, "
        f"{s['max_delay_s']:g}] s; then one more kill hands the lead to a standby restarted with the job's target "
        f"set ahead (version {soak.get('final_target', '–')}), which ends the job. Times run from the SIGKILL to the "
        "new leader's own log timestamps. Load average when the section started: "
        f"{', '.join(f'{x:.1f}' for x in r['load_average'])} (1, 5, 15 min).",
    ]
    if r["error"]:
        parts.append(f"**The soak stopped before its end:** {r['error']}")
    if m:
        t = m["times"]

        def row(label: str, x: dict[str, Any]) -> list[str]:
            return [label, str(x["n"]), _s(x["median"]), _s(x["p90"]), _s(x["max"])]

        rows = [
            row("kill → new leader elected (`leadership.changed`)", t["elected_s"]),
            row("kill → new leader serving (`replica.promoted`)", t["serving_s"]),
            row("kill → first round committed by the new leader", t["first_round_s"]),
            *(row(f"… kill {p}", x) for p, x in m["first_round_by_point"].items()),
            row("kill → the killed replica restarted and in step again (a standby)", t["standby_back_s"]),
        ]
        parts.append(table(["failover", "kills", "median (s)", "p90 (s)", "max (s)"], rows))
        lost, ratio = m["lost_steady_s_per_failover"], m["cycle_rate_ratio"]
        parts.append(
            f"Throughput: {_s(m['steady_tokens_per_s'], 0)} tokens/s applied in the steady phase; "
            f"{_s(m['soak_tokens_per_s'], 0)} tokens/s over the soak (first to last kill, a kill every "
            f"{_s(m['cycle_s']['median'], 1)} s in the median). Per kill cycle (a kill to the next), the rate was "
            f"{_s(ratio['median'])}x the steady one in the median (lowest {_s(min_ratio(soak, m))}x): each failover "
            f"cost {_s(lost['mean'], 1)} s of steady-state throughput on average (median {_s(lost['median'], 1)} s, "
            f"max {_s(lost['max'], 1)} s). That includes the killed replica's restart (a new Python process importing "
            "torch and building the task) competing with the learners for the 2 cores."
        )
        lag = m["lag_versions"]
        hist = ", ".join(f"{k} behind: {v}" for k, v in lag["histogram"].items())
        a2p = m["applied_to_published_s"]
        parts.append(
            f"Standby lag in the steady phase ({lag['samples']} samples every {s['lag_poll_s']:g} s of the lag the "
            "leader's GetStatus reports, as `diloco ctl status` shows it: the round log's newest version minus the "
            f"standby's newest acknowledged): {hist}; max {lag['max']}, mean {_s(lag['mean'])} versions. With "
            "`--sync-replicas 1` the leader publishes a version only once the standby acknowledged it, so the standby "
            "is never behind a published version; the version it lags is the one the leader has stepped and is "
            "waiting on. Standby applied a version → the leader "
            f"published it: median {_s(ms(a2p['median']), 1)} ms, p90 {_s(ms(a2p['p90']), 1)} ms, max "
            f"{_s(ms(a2p['max']), 1)} ms ({a2p['n']} versions)."
        )
        problems = invariant_list(soak)
        parts.append(
            f"After the soak: the job {'finished' if soak['finished'] else 'did NOT finish'} at version "
            f"{soak['version']} of {soak['target']} ({soak['tokens_applied']:,} tokens, {soak['wall_s']:.0f} s in "
            f"all); {soak['published_without_standby']} version(s) published with no standby following (while the "
            f"killed replica restarted: `replication.degraded`, nobody lagging) and {soak['ack_timeouts']} after a "
            "standby's ack timed out; "
            f"{m['stale_wins']} election(s) won by the killed replica's own restart; "
            f"{len(soak['unplanned_replica_exits'])} replica exit(s) nobody caused. Invariants (every learner's "
            "received versions non-decreasing; each new leader at or above every version received before its kill; "
            "no version committed twice, commits in order; epochs rising; ledger exactly once; job at its target; "
            "no learner exit before the end): "
            + ("all hold." if not problems else "**broken**: " + "; ".join(problems))
        )
    if r["cost"]:
        rows = []
        for c in r["cost"]:
            cs = c["settings"]
            for run in (c["plain"], c["replicated"]):
                repl = run["replicated"]
                rows.append(
                    [
                        cs["label"],
                        "2 replicas, `--sync-replicas 1`" if repl else "one coordinator",
                        f"{cs['workers']} × H = {cs['local_steps']}",
                        ", ".join(_s(_median(x["intervals_s"]), 3) for x in run["runs"]),
                        _s(run["round_s"], 3),
                        "–" if not repl or c["ratio"] is None else f"{c['ratio'] - 1:+.1%}",
                        _s(ms(run["close_s"]), 1),
                        "–" if not repl or c["close_extra_fraction"] is None else f"{c['close_extra_fraction']:+.1%}",
                        _s(ms(_median(run["applied_to_published_s"])), 1) if repl else "–",
                        f"{run['wall_s']:.0f}",
                    ]
                )
        parts.append(
            "Cost of synchronous replication: the same job in `sync` rounds (every learner H steps, the round "
            "closes on the last learner's submission, learners wait for the new version), with one plain "
            "coordinator and with two replicas under etcd and `--sync-replicas 1`, alternating in this run. Round: "
            "median interval between the leader's `round.closed` lines after the first rounds (per run, and pooled "
            "over the runs of a kind). Close: median time from the submission that closed a round to its "
            "publication (merge, outer step and, replicated, the log entry and the wait for the standby's ack); its "
            "increase over one coordinator, as a share of the plain round, is the replication's own latency on a "
            "round, and what the target is checked on: whole rounds are mostly the learners' compute, which on this "
            "shared 2-core machine varies between two runs of the same kind by more than the effect (compare the "
            "per-run medians). Ack wait: the standby applied a version → the leader published it. The standby here "
            "shares the cores with the learners and the leader; on its own machine its work (receiving, replaying "
            "and checking each version) would not slow them."
        )
        parts.append(
            table(
                [
                    "model",
                    "coordinator",
                    "learners",
                    "round, per run (s)",
                    "round, pooled (s)",
                    "vs one",
                    "close (ms)",
                    "close over one, / round",
                    "ack wait (ms)",
                    "wall s",
                ],
                rows,
            )
        )
        parts.append(cores_text(r["cost"]))
        parts += [
            f"**{c['settings']['label']}: a run failed:** {'; '.join(c['errors'])}" for c in r["cost"] if c["errors"]
        ]
    return "\n\n".join(parts)


def cores_text(costs: list[dict[str, Any]]) -> str:
    """What shared the machine with the learners while the rounds were timed, in cores (of 2)."""

    def learners(cores: dict[str, float]) -> str:
        xs = [v for n, v in cores.items() if n.startswith("worker")]
        return f"learners {statistics.fmean(xs):.2f} each" if xs else "learners –"

    out = []
    for c in costs:
        p, q = c["plain"]["cores"], c["replicated"]["cores"]
        if not p or not q:
            continue
        out.append(
            f"{c['settings']['label']}: one coordinator {p.get('coordinator', math.nan):.2f}, {learners(p)}; "
            f"replicated: leader {q.get(REPLICAS[0], math.nan):.2f}, standby {q.get(REPLICAS[1], math.nan):.2f}, "
            f"etcd {q.get('etcd', math.nan):.2f}, {learners(q)}"
        )
    return (
        "CPU while the rounds were timed, in cores of the 2 (mean over the runs; the rest of the machine's load is "
        "other jobs): " + "; ".join(out) + "."
        if out
        else ""
    )


def ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def min_ratio(soak: dict[str, Any], m: dict[str, Any]) -> float | None:
    rate = m["steady_tokens_per_s"]
    xs = [c["tokens"] / (c["end"] - c["start"]) / rate for c in soak["cycles"]] if rate else []
    return min(xs, default=None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the short variant of `diloco bench --quick`")
    p.add_argument("--kills", type=int, default=None, help="leader kills in the soak (default: the profile's)")
    p.add_argument("--no-cost", action="store_true", help="only the soak (no replication-cost runs)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the Markdown")
    p.add_argument("--run-dir", type=Path, default=None, help="keep the soak's logs in this folder")
    a = p.parse_args(argv)
    h = QUICK if a.quick else FULL
    if a.kills is not None:
        h = HaSettings(replace(h.soak, kills=a.kills), h.cost)
    if a.no_cost:
        h = HaSettings(h.soak, ())
    result = measure(h, lambda line: print(line, file=sys.stderr, flush=True), a.run_dir)
    print(json.dumps(result, indent=1) if a.json else markdown(result))
    return 0 if all(c["pass"] is not False for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
