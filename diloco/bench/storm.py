"""The kill storm (issue #16 item 4 and its measurements): real processes of `diloco.cluster.LocalCluster`
(healthd, the coordinator and the learners, mutual TLS and tokens), killed again and again while the learners run
without any supervisor. One driver for the test (`tests/test_kill_storm.py`: coordinator kills only, every learner
must live through all of them) and the benchmark section (`--only kill-storm`: a longer storm that also kills
healthd and learners, with recovery times).

Faults, in a fixed interleaved schedule (`schedule`):

- `coordinator-after-round`: SIGKILL the coordinator as soon as its log says `round.closed` (before or while
  that round's checkpoint is written), then start it again on the same port with the same checkpoint folder: it
  resumes from its newest checkpoint under a new epoch. Learners find their session gone and register again.
- `coordinator-mid-upload`: the same, as soon as a learner's log says `worker.submitted` (the coordinator holds
  a submission of the open round; the other learners are training towards or sending theirs). How many uploads
  met the outage is counted afterwards: a learner logs `worker.upload_retry` for each one it resumes or re-sends.
- `healthd`: SIGKILL healthd and start it again on the same port.
- `learner`: SIGKILL the learner owning the most shards, and once they moved start it again (as a supervisor
  would; it registers as a new incarnation). Never two learners down at once: rounds need the quorum.

Measured per fault, each from the SIGKILL: coordinator: to its `coordinator.serving` line, and to the first
`round.closed` of the new incarnation (the job advancing again); healthd: to its `healthd.started` line, and until
`ListNodes` lists every learner the coordinator counts live as alive (its table rebuilt); learner: until the ledger
shows every shard the victim owned owned by a live learner (its shards reassigned), and until the restarted
process logs `worker.registered`.

Each fault waits for the job to advance after the previous one (a round closed since), so every kill meets a
running job. The job has no target while the faults run (`--target-outer-steps 0`: the storm cannot outlast it,
however fast the rounds go). The final fault is always a coordinator kill (`schedule`), and its restart sets the
target, `StormSettings.finish_rounds` versions past the coordinator's newest at the kill, the way an operator changes
a running job's target: the coordinator restarted with another `--target-outer-steps`, resuming from its checkpoint
(no RPC changes it). So the job's finish at a known target is still exercised, after every fault.

Waits poll the children's log files (`LogFollower`, every `poll_s`) or the services' RPCs with a deadline; an RPC
error while a service restarts means "not yet". A learner that exits without being killed is recorded (with its
log's tail), never restarted. After the faults the job must reach the target the final kill set; learners then exit
0 with reason `finished`, as they should; any other exit is a failure.

    python -m diloco.bench.storm [--quick] [--json]
"""

from __future__ import annotations

import enum
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from diloco.bench.section import Context, Log, quick_flag, standalone, table
from diloco.cluster import (
    TINY_TASK_ARGS,
    ClusterConfig,
    LocalCluster,
    LogFollower,
    LogLine,
    ledger_problems,
    ledger_shards,
    seconds_until,
)
from diloco.core.states import LIVE_STATES
from diloco.errors import ConfigError
from diloco.rpc.vocab import WORKER_STATES
from diloco.v1 import healthd_pb2


class Fault(enum.Enum):
    COORDINATOR_AFTER_ROUND = "coordinator-after-round"
    COORDINATOR_MID_UPLOAD = "coordinator-mid-upload"
    HEALTHD = "healthd"
    LEARNER = "learner"

    @property
    def coordinator(self) -> bool:
        return self in (Fault.COORDINATOR_AFTER_ROUND, Fault.COORDINATOR_MID_UPLOAD)


@dataclass(frozen=True)
class StormSettings:
    workers: int = 3
    finish_rounds: int = 10  # the target the final coordinator kill sets: this many versions past its newest
    local_steps: int = 10
    min_local_steps: int = 2
    min_quorum: int = 2
    mode: str = "decoupled"
    codec: str = "int8"
    checkpoint_every: int = 1
    slowdown: float = 1.0  # every learner's (sleeps after each step): slower rounds, fewer versions per fault
    heartbeat_interval_s: float = 0.25
    dead_after_s: float = 2.0
    coordinator_kills: int = 12  # alternately right after a round and mid-upload; the last one sets the target
    healthd_kills: int = 0
    learner_kills: int = 0
    poll_s: float = 0.01  # log files are read this often while waiting for a trigger
    step_timeout_s: float = 60.0  # the longest wait for one trigger or one recovery
    finish_timeout_s: float = 120.0  # after the last fault, for the job to reach its target
    task_args: tuple[str, ...] = TINY_TASK_ARGS

    def __post_init__(self) -> None:
        if min(self.coordinator_kills, self.healthd_kills, self.learner_kills) < 0:
            raise ConfigError("storm: coordinator_kills, healthd_kills and learner_kills must be >= 0")
        if self.coordinator_kills < 1:
            raise ConfigError(
                "storm: coordinator_kills must be >= 1 (the final fault is a coordinator kill, whose restart sets the "
                "job's target)"
            )
        if self.finish_rounds < 1:
            raise ConfigError(
                f"storm: finish_rounds must be >= 1 (the job must advance after the final kill), got "
                f"{self.finish_rounds}"
            )
        if self.learner_kills and self.workers <= self.min_quorum:
            raise ConfigError(
                "storm: learner_kills need workers > min_quorum (rounds stop while a learner is down otherwise)"
            )

    def cluster_config(self, run_dir: Path) -> ClusterConfig:
        return ClusterConfig(
            workers=self.workers,
            mode=self.mode,
            slowdowns=(self.slowdown,) * self.workers,
            outer_steps=0,  # no target while the faults run: the final coordinator kill sets it (`_Storm.run`)
            local_steps=self.local_steps,
            min_local_steps=self.min_local_steps,
            min_quorum=self.min_quorum,
            codec=self.codec,
            dead_after_s=self.dead_after_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            checkpoint_every=self.checkpoint_every,
            run_dir=run_dir,
            task_args=self.task_args,
        )


def schedule(s: StormSettings) -> list[Fault]:
    """The faults in order: coordinator kills alternating between their two triggers, with the healthd and learner
    kills (alternating too) spread evenly among them, so the last fault is a coordinator kill (when there is one)."""
    coord = [
        Fault.COORDINATOR_AFTER_ROUND if i % 2 == 0 else Fault.COORDINATOR_MID_UPLOAD
        for i in range(s.coordinator_kills)
    ]
    others: list[Fault] = []
    h, n = s.healthd_kills, s.learner_kills
    while h or n:
        if h:
            others.append(Fault.HEALTHD)
            h -= 1
        if n:
            others.append(Fault.LEARNER)
            n -= 1
    before: dict[int, list[Fault]] = {}  # index into `coord` -> the other faults that come just before it
    for j, f in enumerate(others):
        before.setdefault((j + 1) * len(coord) // (len(others) + 1), []).append(f)
    out: list[Fault] = []
    for i in range(len(coord) + 1):
        out += before.get(i, [])
        out += coord[i : i + 1]
    return out


@dataclass
class KillRecord:
    fault: str
    at_s: float  # from the storm's start
    target: str  # the process killed
    trigger: str = ""  # what the kill waited for
    # coordinator
    last_version: int | None = None  # the killed incarnation's newest version (closed, or resumed at)
    resumed_version: int | None = None
    serving_s: float | None = None  # kill -> `coordinator.serving` (`healthd.started` for healthd)
    advanced_s: float | None = None  # kill -> the first `round.closed` of the new incarnation
    uploads_retried: int = 0  # submissions whose upload was retried (`worker.upload_retry`) by the job advancing
    reregistered: int = 0  # learners' `worker.registered` lines in the same interval
    # healthd
    rebuilt_s: float | None = None  # kill -> ListNodes lists every live learner
    # learner
    shards: list[int] = field(default_factory=list)  # the victim's shards at the kill
    reassigned_s: float | None = None  # kill -> every one of them owned by a live learner
    rejoined_s: float | None = None  # kill -> its restarted process registered (`worker.registered` in its log)


@dataclass
class StormResult:
    settings: dict[str, Any]
    kills: list[KillRecord]
    finished: bool
    version: int
    target_outer_steps: int  # the coordinator's, in its final status
    target_set: int  # what the final coordinator kill's restart set (0: the storm stopped before)
    tokens_applied: int
    ledger_problems: list[str]
    alive_after_faults: dict[str, bool]  # learner -> running when the last fault was over
    finished_exits: list[str]  # learners that exited 0 with reason `finished` once the job had finished
    unexpected_exits: dict[str, str]  # learner -> exit status and the tail of its log (any other exit)
    wall_s: float

    @property
    def coordinator_kills(self) -> int:
        return sum(1 for k in self.kills if k.fault.startswith("coordinator"))

    @property
    def exactly_once(self) -> bool:
        return not self.ledger_problems

    def failures(self) -> list[str]:
        """What the storm must not end with (empty: it survived): an exited learner, a job that did not finish, a
        ledger that is not exactly once."""
        out = [f"{name} exited without being killed: {why}" for name, why in self.unexpected_exits.items()]
        out += [f"{name} was not running after the faults" for name, up in self.alive_after_faults.items() if not up]
        if self.target_outer_steps != self.target_set:
            out.append(f"the coordinator's target is {self.target_outer_steps}, the storm set {self.target_set}")
        if not self.finished or self.version < self.target_outer_steps:
            out.append(f"the job did not finish: version {self.version} of {self.target_outer_steps}")
        out += [f"ledger: {p}" for p in self.ledger_problems]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "coordinator_kill_count": self.coordinator_kills, "exactly_once": self.exactly_once}


class StormError(RuntimeError):
    """The storm could not go on (a wait ran out, a service would not come back); the message says where."""


class _Storm:
    def __init__(self, cluster: LocalCluster, s: StormSettings, log: Log) -> None:
        self.c, self.s, self.log = cluster, s, log
        self.coordinator = cluster.follow("coordinator")
        self.healthd = cluster.follow("healthd")
        self.learners = {f"worker{i}": cluster.follow(f"worker{i}") for i in range(s.workers)}
        self.killed: set[str] = set()  # learners killed by the storm and not yet started again
        self.rejoining: dict[str, tuple[float, KillRecord]] = {}  # restarted learners not registered yet
        self.exits: dict[str, str] = {}
        self.version = 0  # the coordinator's newest version in its log (closed, or resumed at)
        self.target = 0  # the job's target, set by the final coordinator kill (0 before: none)
        self.t0 = time.monotonic()

    # --- log and process watching -------------------------------------------------------------------------------
    def _read(self, f: LogFollower) -> list[LogLine]:
        """New lines of one log; a restarted learner's first registration completes its fault's record."""
        lines = f.read()
        if f is self.coordinator:
            for x in lines:
                if x.event in ("round.closed", "coordinator.serving") and "version" in x.fields:
                    self.version = int(x.fields["version"])
        for name, (killed, rec) in list(self.rejoining.items()):
            if f is self.learners[name] and any(x.event == "worker.registered" for x in lines):
                rec.rejoined_s = next(x.read_at for x in lines if x.event == "worker.registered") - killed
                del self.rejoining[name]
        return lines

    def _drain(self) -> None:
        """Read every log up to now, so that only lines written from now on can trigger a kill."""
        for f in (self.coordinator, *self.learners.values()):
            self._read(f)

    def _check_learners(self) -> None:
        for name in self.learners:
            p = self.c.procs[name]
            if name not in self.killed and name not in self.exits and not p.alive:
                self.exits[name] = f"exit status {p.popen.returncode}; log tail:\n{self.c.tail(name)}"
                self.log(f"  {name} EXITED ({p.popen.returncode})")

    def classify_exits(self, job_finished: bool) -> list[str]:
        """After the storm: learners that exited since it ended. Exiting 0 with reason `finished` once the job
        finished is what a learner does; any other exit joins `exits`. Returns the learners that finished so."""
        done = []
        for name in self.learners:
            p = self.c.procs[name]
            if p.alive or name in self.exits:
                continue
            reasons = [x.fields.get("reason") for x in LogFollower(p.log_path).read() if x.event == "worker.exited"]
            if job_finished and p.popen.returncode == 0 and reasons[-1:] == ["finished"]:
                done.append(name)
            else:
                self.exits[name] = (
                    f"exit status {p.popen.returncode}, reason {reasons[-1:]}; log tail:\n{self.c.tail(name)}"
                )
        return done

    def _await(
        self, what: str, sources: Iterable[LogFollower], match: Callable[[LogLine], bool], watch: str = ""
    ) -> tuple[LogLine, list[LogLine]]:
        """Read `sources` until a line matches; returns it and every line read meanwhile. `watch`: a child whose
        exit ends the wait with its log."""
        deadline = time.monotonic() + self.s.step_timeout_s
        seen: list[LogLine] = []
        sources = list(sources)
        while True:
            for f in sources:
                for line in self._read(f):
                    seen.append(line)
                    if match(line):
                        return line, seen
            self._check_learners()
            if watch and not self.c.procs[watch].alive:
                raise StormError(f"{watch} exited while waiting for {what}:\n{self.c.tail(watch)}")
            if time.monotonic() > deadline:
                raise StormError(f"no {what} within {self.s.step_timeout_s:g} s{self._finished_note()}")
            time.sleep(self.s.poll_s)

    def _finished_note(self) -> str:
        try:
            st = self.c.status(timeout_s=2.0)
        except grpc.RpcError:
            return ""
        if st.finished:
            return f" (the job already finished at version {st.version} of its target {st.target_outer_steps})"
        return f" (coordinator at version {st.version}, {st.live_workers} live learners)"

    def _live_learner_ids(self) -> dict[str, str]:
        """worker id -> name of every learner the coordinator counts live."""
        live = {WORKER_STATES.to_proto(s) for s in LIVE_STATES}
        return {w.worker_id: w.worker_name for w in self.c.workers().workers if w.state in live}

    # --- faults ------------------------------------------------------------------------------------------------
    def run(self, faults: list[Fault]) -> list[KillRecord]:
        """Every fault in order; the last one, a coordinator kill (`schedule`), sets the job's target."""
        if not faults or not faults[-1].coordinator:
            raise StormError(f"the final fault must be a coordinator kill (it sets the job's target), got {faults}")
        self._await("a first round", [self.coordinator], lambda line: line.event == "round.closed", "coordinator")
        records = []
        for n, fault in enumerate(faults, 1):
            if fault.coordinator:
                rec = self._kill_coordinator(fault, final=n == len(faults))
            elif fault is Fault.HEALTHD:
                rec = self._kill_healthd()
            else:
                rec = self._kill_learner()
            records.append(rec)
            self.log(f"  fault {n}/{len(faults)}: {self._describe(rec)}")
            self._check_learners()
        self._rejoined()
        return records

    def _describe(self, r: KillRecord) -> str:
        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f} s"

        if r.fault.startswith("coordinator"):
            return (
                f"{r.fault} ({r.trigger}), closed v{r.last_version}, resumed v{r.resumed_version}: serving "
                f"{f(r.serving_s)}, advancing {f(r.advanced_s)}, {r.uploads_retried} upload(s) retried, "
                f"{r.reregistered} re-registration(s)"
            )
        if r.fault == Fault.HEALTHD.value:
            return f"healthd: serving {f(r.serving_s)}, table rebuilt {f(r.rebuilt_s)}"
        return f"learner {r.target} (shards {r.shards}): reassigned {f(r.reassigned_s)}, restarted"

    def _next_round(self) -> None:
        """Wait for a round closed after the previous fault (so every fault meets a job that advances)."""
        self._await("the job to advance", [self.coordinator], lambda x: x.event == "round.closed", "coordinator")

    def _kill_coordinator(self, fault: Fault, final: bool = False) -> KillRecord:
        """`final`: the restart sets the job's target, `finish_rounds` past the newest version at the kill (the job
        resumes at or below it, so at least that many rounds close after the last fault)."""
        c = self.c
        self._drain()
        if fault is Fault.COORDINATOR_AFTER_ROUND:
            trigger, _ = self._await("a round to close", [self.coordinator], lambda x: x.event == "round.closed")
            what = f"round.closed v{trigger.fields.get('version')}"
        else:
            trigger, _ = self._await(
                "an accepted upload", self.learners.values(), lambda x: x.event == "worker.submitted", "coordinator"
            )
            what = f"worker.submitted by {trigger.fields.get('worker')} for round {trigger.fields.get('round')}"
        killed = time.monotonic()
        c.kill("coordinator")
        self._read(self.coordinator)  # the rest of the killed incarnation's log
        rec = KillRecord(fault.value, killed - self.t0, "coordinator", what, self.version)
        if final:
            self.target = self.version + self.s.finish_rounds
            c.set_target(self.target)
            self.log(f"  the final kill's restart sets the job's target: version {self.target}")
        c.respawn("coordinator")
        serving, _ = self._await(
            "the restarted coordinator to serve",
            [self.coordinator],
            lambda x: x.event == "coordinator.serving",
            "coordinator",
        )
        rec.serving_s = serving.read_at - killed
        rec.resumed_version = int(serving.fields.get("version", 0))
        advanced, lines = self._await(
            "the job to advance after the restart",
            [self.coordinator, *self.learners.values()],
            lambda x: x.event == "round.closed",
            "coordinator",
        )
        rec.advanced_s = advanced.read_at - killed
        rec.uploads_retried = len({x.fields.get("submission_id") for x in lines if x.event == "worker.upload_retry"})
        rec.reregistered = sum(
            1 for x in lines if x.event == "worker.registered" and x.fields.get("service") == "worker"
        )
        return rec

    def _kill_healthd(self) -> KillRecord:
        c = self.c
        self._next_round()
        self._read(self.healthd)
        killed = time.monotonic()
        c.kill("healthd")
        rec = KillRecord(Fault.HEALTHD.value, killed - self.t0, "healthd")
        c.respawn("healthd")
        started, _ = self._await("healthd to start", [self.healthd], lambda x: x.event == "healthd.started", "healthd")
        rec.serving_s = started.read_at - killed

        def rebuilt() -> bool:
            if not c.procs["healthd"].alive:
                raise StormError(f"the restarted healthd exited:\n{c.tail('healthd')}")
            alive = {n.node_id for n in c.nodes(timeout_s=1.0).nodes if n.state == healthd_pb2.NODE_STATE_ALIVE}
            live = self._live_learner_ids()
            return bool(live) and set(live) <= alive

        self._wait("healthd to list every live learner", rebuilt)
        rec.rebuilt_s = time.monotonic() - killed
        return rec

    def _wait(self, what: str, predicate: Callable[[], bool]) -> float:
        def check() -> bool:
            self._check_learners()
            return predicate()

        try:
            return seconds_until(what, check, self.s.step_timeout_s, interval_s=0.02)
        except TimeoutError as e:
            raise StormError(f"{e}{self._finished_note()}") from e

    def _kill_learner(self) -> KillRecord:
        c = self.c
        self._rejoined()  # never two learners down at once: rounds need the quorum
        self._next_round()
        owned: dict[str, list[int]] = {}

        def victim_known() -> bool:
            live = self._live_learner_ids()
            owned.clear()
            for shard in c.ledger().shards:
                if shard.owner in live:
                    owned.setdefault(shard.owner, []).append(shard.shard_id)
            return bool(owned)

        self._wait("a learner owning shards", victim_known)
        live = self._live_learner_ids()
        victim_id = max(owned, key=lambda wid: (len(owned[wid]), wid))
        name = live[victim_id]
        shards = sorted(owned[victim_id])
        killed = time.monotonic()
        self.killed.add(name)
        c.kill(name)
        rec = KillRecord(Fault.LEARNER.value, killed - self.t0, name, shards=shards)

        def reassigned() -> bool:
            live_now = self._live_learner_ids()
            by_id = {s.shard_id: s.owner for s in c.ledger().shards}
            return all(by_id.get(i) != victim_id and by_id.get(i) in live_now for i in shards)

        self._wait(f"{name}'s shards to be reassigned", reassigned)
        rec.reassigned_s = time.monotonic() - killed
        self._read(self.learners[name])  # the killed incarnation's last lines: only the new one's count from here
        c.respawn(name)  # as a supervisor would; its registration is looked for in its log as the storm goes on
        self.killed.discard(name)
        self.rejoining[name] = (killed, rec)
        return rec

    def _rejoined(self) -> None:
        """Wait until every restarted learner registered again."""

        def registered() -> bool:
            for name in list(self.rejoining):
                self._read(self.learners[name])
            return not self.rejoining

        self._wait(f"{', '.join(self.rejoining) or 'restarted learners'} to register again", registered)


def run_storm(s: StormSettings, run_dir: Path, log: Log = lambda line: None) -> StormResult:
    """Start a cluster in `run_dir`, run the storm's faults, wait for the job to finish and check what it must
    end with (`StormResult.failures()`). Every child is reaped on return, whatever happens."""
    cluster = LocalCluster(s.cluster_config(run_dir))
    started = time.monotonic()
    with cluster:
        cluster.start(timeout_s=s.step_timeout_s)
        storm = _Storm(cluster, s, log)
        kills = storm.run(schedule(s))

        alive = {name: cluster.procs[name].alive for name in storm.learners}
        storm._check_learners()
        try:
            seconds_until("the job to finish", lambda: bool(cluster.status(timeout_s=2.0).finished), s.finish_timeout_s)
        except TimeoutError as e:
            log(f"  {e}")
        final: list[Any] = []

        def read_final() -> bool:
            final[:] = [cluster.status(), cluster.ledger()]
            return True

        seconds_until("the final status and ledger", read_final, timeout_s=30.0)
        status, ledger = final
        finished_exits = storm.classify_exits(status.finished)
        result = StormResult(
            settings=asdict(s),
            kills=kills,
            finished=status.finished,
            version=status.version,
            target_outer_steps=status.target_outer_steps,
            target_set=storm.target,
            tokens_applied=status.tokens_applied,
            ledger_problems=ledger_problems(ledger_shards(ledger), status.tokens_applied),
            alive_after_faults=alive,
            finished_exits=finished_exits,
            unexpected_exits=dict(storm.exits),
            wall_s=time.monotonic() - started,
        )
    return result


# --- the benchmark section (`diloco bench --only kill-storm`) ------------------------------------------------------
# four learners, so one can be down while the quorum (2) still closes rounds
FULL = StormSettings(workers=4, coordinator_kills=12, healthd_kills=4, learner_kills=4, slowdown=3.0)
# one fault of each kind (the learner's restart overlaps the coordinator's), for the `--quick` suite's time budget
QUICK = StormSettings(workers=3, coordinator_kills=1, healthd_kills=1, learner_kills=1, slowdown=3.0)
RECOVERIES: tuple[tuple[str, str, str], ...] = (  # (label, fault prefix, KillRecord field)
    ("coordinator kill → serving again (`coordinator.serving`)", "coordinator", "serving_s"),
    ("coordinator kill → job advancing again (next version)", "coordinator", "advanced_s"),
    ("… right after `round.closed`", Fault.COORDINATOR_AFTER_ROUND.value, "advanced_s"),
    ("… right after `worker.submitted`", Fault.COORDINATOR_MID_UPLOAD.value, "advanced_s"),
    ("healthd kill → serving again (`healthd.started`)", Fault.HEALTHD.value, "serving_s"),
    ("healthd kill → table rebuilt (every live learner listed)", Fault.HEALTHD.value, "rebuilt_s"),
    ("learner kill → its shards reassigned", Fault.LEARNER.value, "reassigned_s"),
    ("learner kill → restarted learner registered", Fault.LEARNER.value, "rejoined_s"),
)
REASSIGN_WINDOW_S = 5.0  # ALGORITHM.md section 8: from a learner's death to its shards' reassignment


def summary(kills: list[dict[str, Any]], prefix: str, key: str) -> dict[str, Any]:
    runs = [float(k[key]) for k in kills if k["fault"].startswith(prefix) and k.get(key) is not None]
    if not runs:
        return {"n": 0, "median_s": None, "max_s": None, "runs_s": []}
    return {"n": len(runs), "median_s": statistics.median(runs), "max_s": max(runs), "runs_s": runs}


def measure(s: StormSettings, log: Log) -> dict[str, Any]:
    """Run the storm and summarise it for the report (a storm that cannot go on is reported, not raised)."""
    load = list(os.getloadavg())
    error, result, failures = "", {}, []
    with tempfile.TemporaryDirectory(prefix="diloco-bench-storm-") as tmp:
        try:
            storm = run_storm(s, Path(tmp), log)
            result, failures = storm.to_dict(), storm.failures()
        except StormError as e:
            error = str(e)
            log(f"  the storm stopped: {e}")
    kills: list[dict[str, Any]] = result.get("kills", [])
    rows = [{"label": label, **summary(kills, prefix, key)} for label, prefix, key in RECOVERIES]
    reassigned = summary(kills, Fault.LEARNER.value, "reassigned_s")
    checks = [
        {
            "name": "learners live through every coordinator kill, unsupervised",
            "target": "no learner exits before the job finishes",
            "measured": "storm aborted" if error else f"{len(result['unexpected_exits'])} exited",
            "pass": not error and not result["unexpected_exits"],
        },
        {
            "name": "the job finishes after the storm",
            "target": f"the target the final coordinator kill set ({s.finish_rounds} versions past the kill's)",
            "measured": "storm aborted"
            if error
            else f"version {result['version']} of {result['target_outer_steps']} (set: {result['target_set']})",
            "pass": not error
            and result["finished"]
            and result["target_outer_steps"] == result["target_set"] > 0
            and result["version"] >= result["target_set"],
        },
        {
            "name": "ledger exactly once after the storm",
            "target": "contiguous ranges, cursors = tokens applied",
            "measured": "storm aborted" if error else f"{len(result['ledger_problems'])} problem(s)",
            "pass": not error and result["exactly_once"],
        },
        {
            "name": "learner kill → shards reassigned (max over the storm)",
            "target": f"≤ {REASSIGN_WINDOW_S:g} s",
            "measured": "n/a" if reassigned["max_s"] is None else f"{reassigned['max_s']:.2f} s",
            "pass": None if reassigned["max_s"] is None else reassigned["max_s"] <= REASSIGN_WINDOW_S,
        },
    ]
    return {
        "settings": asdict(s),
        "load_average": load,
        "error": error,
        "failures": failures,
        "storm": result,
        "rows": rows,
        "checks": checks,
    }


def section(ctx: Context) -> dict[str, Any]:
    return measure(QUICK if ctx.quick else FULL, ctx.log)


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _target_text(s: dict[str, Any]) -> str:
    """The job's target in the settings sentence (a result measured before the final kill set it had a fixed one)."""
    if "finish_rounds" not in s:
        return f"a target of {s['outer_steps']} outer steps"
    return (
        "no target while the faults run; the final fault, a coordinator kill, restarts it with a target "
        f"{s['finish_rounds']} versions past its newest at the kill (`--target-outer-steps`, as an operator changes "
        "a running job's target), so the storm cannot outlast the job and the job still finishes at a known target"
    )


def _target_set_text(storm: dict[str, Any]) -> str:
    kills = storm.get("kills", [])
    if "target_set" not in storm or not kills:
        return ""
    return f", the target the final kill set at version {kills[-1]['last_version']},"


def markdown(r: dict[str, Any]) -> str:
    s, storm = r["settings"], r["storm"]
    parts = [
        f"Settings: `LocalCluster` (healthd, the coordinator and {s['workers']} learners as separate processes, "
        f"mutual TLS), mode `{s['mode']}`, K = {s['min_quorum']}, H = {s['local_steps']}, the tiny task "
        f"(`diloco.cluster.TINY_TASK_ARGS`), learners slowed {s['slowdown']:g}x (they sleep after each step), a "
        f"checkpoint every {s['checkpoint_every']} round(s), heartbeats every {s['heartbeat_interval_s']:g} s, "
        f"`dead_after` {s['dead_after_s']:g} s, {_target_text(s)}. No supervisor restarts "
        f"anything but the storm: {s['coordinator_kills']} coordinator SIGKILLs (alternately as soon as its log says "
        "`round.closed` and as soon as a learner's log says `worker.submitted`; each restarted at once on the same "
        f"port from its newest checkpoint, under a new epoch), {s['healthd_kills']} healthd SIGKILLs (restarted at "
        f"once on its port) and {s['learner_kills']} learner SIGKILLs (the learner owning the most shards; started "
        "again once its shards moved, as a supervisor would), interleaved, each after a round closed since the "
        "previous one (`diloco/bench/storm.py`, the same driver as `tests/test_kill_storm.py`). Times run from the "
        "SIGKILL; the storm's driver reads the children's JSON logs every "
        f"{s['poll_s'] * 1000:g} ms and polls RPCs every 20 ms. Load average when the section started: "
        f"{', '.join(f'{x:.1f}' for x in r['load_average'])} (1, 5, 15 min): a restart's time is mostly the new "
        "process importing torch and building the task, which grows with the load.",
    ]
    if r["error"]:
        parts.append(f"**The storm stopped before its end:** {r['error']}")
    parts.append(
        table(
            ["recovery", "kills", "median (s)", "max (s)"],
            [[row["label"], str(row["n"]), _s(row["median_s"]), _s(row["max_s"])] for row in r["rows"]],
        )
    )
    coordinator = [k for k in storm.get("kills", []) if k["fault"].startswith("coordinator")]
    if coordinator:
        parts.append(
            table(
                [
                    "#",
                    "trigger",
                    "version at the kill",
                    "resumed at",
                    "serving (s)",
                    "advancing (s)",
                    "uploads retried",
                    "re-registrations",
                ],
                [
                    [
                        str(i),
                        k["trigger"],
                        str(k["last_version"]),
                        str(k["resumed_version"]),
                        _s(k["serving_s"]),
                        _s(k["advanced_s"]),
                        str(k["uploads_retried"]),
                        str(k["reregistered"]),
                    ]
                    for i, k in enumerate(coordinator, 1)
                ],
            )
        )
    if storm:
        exits = storm["unexpected_exits"]
        parts.append(
            f"After the storm: {sum(storm['alive_after_faults'].values())} of {s['workers']} learners running and "
            f"{len(exits)} exited unexpectedly{' (' + ', '.join(exits) + ')' if exits else ''}; the job "
            f"{'finished' if storm['finished'] else 'did NOT finish'} at version {storm['version']} of "
            f"{storm['target_outer_steps']}{_target_set_text(storm)} ({storm['wall_s']:.0f} s in all); the ledger is "
            + ("exactly once" if storm["exactly_once"] else "NOT exactly once: " + "; ".join(storm["ledger_problems"]))
            + f" ({storm['tokens_applied']:,} tokens applied)."
            + (" Failures: " + "; ".join(r["failures"]) if r["failures"] else "")
        )
    parts.append(
        'A version "resumed at" below the one at the kill is a round whose checkpoint was not written yet: '
        "its submissions are lost compute, retrained from the committed cursors (the ledger above stays exactly "
        "once). The tiny model's upload is about 22 KB, so a kill rarely lands inside one's bytes; \"uploads "
        'retried" counts the submissions that met the outage and were resumed or re-sent. Process start → '
        "serving for each service on its own is the Start-up time section (`--only startup`)."
    )
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, quick_flag, lambda a, log: measure(QUICK if a.quick else FULL, log), markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
