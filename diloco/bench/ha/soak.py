"""The leader-kill soak (`diloco.bench.bench_ha`'s docstring, step 1): a steady phase, then the kills at drawn
points on the supervised cluster, then the job's end; and what must hold when it ends."""

from __future__ import annotations

import itertools
import math
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from diloco.bench.ha.settings import KillPoint, SoakSettings
from diloco.bench.ha.summary import median
from diloco.bench.ha.supervisor import HaCluster, Replica, SoakError, in_step, standby_lead_s
from diloco.bench.section import Log
from diloco.cluster import ClusterConfig, LogFollower, ledger_check

NEVER = 1_000_000_000  # the soak's job target until the soak sets the real one (`bench_ha`'s docstring)


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
        """Every kill, then the job's end (`bench_ha`'s docstring); returns the wall times of the first and the
        last kill."""
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
        back = median([k.standby_back_s for k in self.kills if k.standby_back_s is not None]) or 0.0
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
    """What the soak must not end with, besides the ledger and the job (`bench_ha`'s docstring)."""
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
        try:
            ha.until("the learners to exit", lambda: len(ha.learner_exits) == len(ha.learners), s.step_timeout_s, 0.1)
        except SoakError as e:  # which learners, what each last did and where it waits: the report shows this
            running = [name for name in ha.learners if name not in ha.learner_exits]
            raise SoakError(f"{e}; still running: {'; '.join(stuck(ha, n) for n in running)}") from None
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
            "ledger_problems": ledger_check(ledger),
            "invariant_problems": problems,
            "published_without_standby": sum(r.alone for r in ha.replicas.values()),
            "ack_timeouts": sum(r.ack_timeouts for r in ha.replicas.values()),
            "unplanned_replica_exits": list(ha.unplanned),
            "learner_exits": learner_problems(ha, soak.early_exits),
            "final_target": soak.target,
            "wall_s": time.monotonic() - started,
        }
    return result


def stuck(ha: HaCluster, name: str) -> str:
    """A learner that does not exit: its last log lines, then every thread's stack (SIGUSR1, `diloco.signals`)."""
    path = ha.cluster.procs[name].log_path
    before, size = ha.cluster.tail(name, 12), path.stat().st_size
    ha.cluster.signal(name, signal.SIGUSR1)
    time.sleep(1.0)
    with path.open("rb") as f:
        f.seek(size)
        stacks = f.read().decode(errors="replace")
    return f"{name}:\n{before}\nits threads:\n{stacks}"


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


def cycles(commits: list[tuple[float, int, int]], kills: list[KillRecord]) -> list[dict[str, float]]:
    """Each kill's cycle: from it to the next kill, with the tokens committed meanwhile."""
    return [
        {"start": a.at, "end": b.at, "tokens": tokens_between(commits, a.at, b.at)}
        for a, b in itertools.pairwise(kills)
    ]
