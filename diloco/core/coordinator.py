"""The coordinator's state machine: registry, round policy, shard ledger, merge buffer and outer optimizer.

Pure: no gRPC, no clock reads (`now` is an argument), no file I/O. The gRPC coordinator service and the
simulator drive the same object, so what the simulator measures is what the service does.

Submissions arrive as `(header fields, decoded pseudo-gradient)`. `admit` checks everything that can be checked
before the payload is read (membership, staleness, fencing); `accept` folds the pseudo-gradient into the merge
buffer, moves the ledger's accepted cursors and may close a round. A closed round applies the outer step,
commits the round's ledger receipts and bumps the version.

Shard placement and H_m follow speed (ALGORITHM.md section 6): the speed the coordinator *measures* from the
submissions it accepts, a learner's claimed figure being only a bounded prior until its first accepted
submission (the rules are written in `diloco.core.placement`; `WorkerRecord.measured_speed` holds the
measurement, `WorkerRecord.speed` the last claim). Shards are placed again on a membership change and when a
learner's share of the planning speed moved by more than `placement.REPLACE_TOLERANCE`. A shard of a dead or
departed learner moves at once. A shard moved away from a *live* learner (rebalancing after a join, or a
learner that delivers less than it was placed for) is handed off: the learner's plan stops listing it, and the
ledger moves it only after accepting a submission that learner made under that plan (`plan_seq`), so the
learner never loses a submission to a move it could not know about.

The registry is bounded: at most `max_workers` live learners (one more is refused with `ResourceExhausted`,
nothing changed), and the records of departed ones (left, dead, evicted) are kept for operators only for the
`max_departed` most recent departures: older ones are dropped, oldest departure first, when a learner
registers, so the registry never holds more than `max_workers + max_departed` records. A departed learner owns
no shard (its shards moved when it departed), and accepted submissions are remembered apart from the
records (`applied`, `receipts`), so dropping a record changes neither the ledger nor duplicate detection.

Outcomes of applied submissions (`Accepted`, the most recent `APPLIED_KEPT`) are part of the state: in every
checkpoint (`snapshot`, `restore`) and, through the round log, on every standby (`diloco.core.replication`). So a
coordinator resumed from either answers a duplicate of a submission applied before it took over as the first one
was answered (applied, in the same round, with the same staleness), and never applies it twice (ALGORITHM.md
section 11: "Submission ids are in the log").

The learner table (every live learner's record, `learners_to_json`; the plan sequence; the registration count) is
part of the state too, and so rides in every round-log entry (ALGORITHM.md section 11: "ledger and learner table
changes"). A replica promoted from a standby restores it (`restore(..., learners_at=now)`): its learners keep their
ids, shards, epochs and cursors and go on without registering again; their clocks start at the promotion and they
count as unconfirmed until healthd reports them or they submit (`confirm_timeout_s`), so a learner that died with
the old leader is declared dead. A learner registered after the last entry is unknown there and registers again.
A restart from a checkpoint (`restore` without `learners_at`) drops the table: the checkpoint may be older than
what learners hold, and every learner registers again.

Robust merge (`diloco.core.guard`): a pseudo-gradient with a non-finite norm, a norm above what AdamW can
produce (the ceiling) or an outlier norm against the recent median is refused and its learner is
**quarantined**. A refused submission never reaches the ledger, so its token range stays uncommitted and is
trained again. A quarantined learner stays live (it heartbeats and may be reached), is not waited for by
rounds and gets no new shards, but keeps the ones it holds: its next submission is checked like any other, and
a clean one is merged and releases it (so does `release`, the operator's ReleaseWorker). After
`quarantine_strikes` refusals in a row its shards move to healthy learners (new epoch, resuming at the accepted
cursor), so the data is trained again by someone else; it then stays quarantined, with no work, until an
operator releases it.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from diloco.core.energy import placed_speeds
from diloco.core.guard import CEILING, NON_FINITE, GuardConfig, NormGuard, Verdict
from diloco.core.ledger import AcceptReceipt, ShardLedger, ShardRange
from diloco.core.merge import MERGE_NAMES, EncodedDelta, MergeAccumulator, Segment
from diloco.core.outer import OuterConfig, OuterOptimizer, build_outer
from diloco.core.placement import (
    MEASURE_WINDOW,
    effective_speeds,
    is_known_speed,
    local_steps,
    measured_speed,
    place_shards,
    planning_speeds,
    shares_moved,
    work_seconds,
)
from diloco.core.rounds import CloseReason, Pending, RoundClose, RoundConfig, RoundPolicy
from diloco.core.states import (
    ACTIVE,
    DEAD,
    DRAINING,
    GONE_STATES,
    LIVE_STATES,
    QUARANTINED,
    WorkerState,
)
from diloco.errors import (
    AlreadyExists,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

_PUBLISHED_VERSIONS = 64  # versions whose close time is remembered (the measured rule's `sync` term)
APPLIED_KEPT = 4096  # outcomes of applied submissions remembered (checkpointed and replicated with them)


class SubmissionRejected(FailedPrecondition):
    """The guard refused a pseudo-gradient (an outlier norm) and quarantined its learner. The learner must adopt
    the newest parameters and train the range again (its plan's cursors did not move)."""

    def __init__(self, message: str, worker_id: str, verdict: Verdict, quarantined: bool, moved: list[int]) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.verdict = verdict
        self.newly_quarantined = quarantined  # this refusal put the learner in quarantine
        self.moved_shards = moved  # shards moved off the learner (its strikes ran out)


class NonFiniteRejected(SubmissionRejected, InvalidArgument):
    """As `SubmissionRejected`, for a pseudo-gradient with NaN or Inf: malformed input (INVALID_ARGUMENT)."""

    code = InvalidArgument.code


@dataclass(frozen=True)
class CoordinatorConfig:
    rounds: RoundConfig = field(default_factory=RoundConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    merge: str = "mean"
    local_steps: int = 50  # H
    min_local_steps: int = 5  # H_min
    dynamic_local_steps: bool = True  # H_m from measured speed
    expected_workers: int = 0  # M at start: keeps the first learner from taking every shard
    target_outer_steps: int = 0  # 0: train until stopped
    # > 0: a learner not confirmed alive (healthd forwarded its throughput, or it submitted) this long after it
    # registered is declared dead: it died before its first heartbeat, so healthd can never report it
    confirm_timeout_s: float = 0.0
    # > 0 (and below confirm_timeout_s): such a learner is declared dead sooner, once healthd has reported other
    # learners for this long since it registered without reporting it (it reports each learner it hears about
    # once a second), so one that died just after registering is reassigned within the window; while healthd is
    # silent only confirm_timeout_s applies
    unheard_after_s: float = 0.0
    guard: GuardConfig = field(default_factory=GuardConfig)  # outlier check off unless outlier_factor > 0
    # decoupled: a round closed on quorum + grace without every expected learner takes a step in proportion to the
    # inner steps it holds (see `_round_fraction`); False: every round takes a full step, as ALGORITHM.md section 4
    scale_partial_rounds: bool = True
    # > 0: every inner step trains one batch of this many tokens, so a submission's tokens must be steps x this.
    # The guard judges norms per step; a learner claiming more steps than it trained would shrink its own norm
    # and, once accepted, drag the median down until honest learners look like outliers.
    tokens_per_step: int = 0
    max_workers: int = 4096  # live learners at most; one more is refused (RESOURCE_EXHAUSTED)
    max_departed: int = 1024  # records of departed learners kept for operators (the most recent departures)

    def __post_init__(self) -> None:
        if self.merge not in MERGE_NAMES:
            raise ConfigError(f"merge: unknown method {self.merge!r}; allowed: {', '.join(MERGE_NAMES)}")
        if self.local_steps < 1:
            raise ConfigError(f"local_steps (H) must be >= 1, got {self.local_steps}")
        if not 1 <= self.min_local_steps <= self.local_steps:
            raise ConfigError(f"min_local_steps must be in [1, H={self.local_steps}], got {self.min_local_steps}")
        if self.expected_workers < 0:
            raise ConfigError(f"expected_workers must be >= 0, got {self.expected_workers}")
        if self.tokens_per_step < 0:
            raise ConfigError(f"tokens_per_step must be >= 0 (0: unchecked), got {self.tokens_per_step}")
        if self.max_workers < max(1, self.expected_workers):
            raise ConfigError(
                f"max_workers must be >= 1 and >= expected_workers ({self.expected_workers}), got {self.max_workers}"
            )
        if self.max_departed < 0:
            raise ConfigError(f"max_departed must be >= 0, got {self.max_departed}")
        if self.target_outer_steps < 0:
            raise ConfigError(f"target_outer_steps must be >= 0, got {self.target_outer_steps}")
        if not self.confirm_timeout_s >= 0:
            raise ConfigError(f"confirm_timeout_s must be >= 0 (0: off), got {self.confirm_timeout_s}")
        if not 0 <= self.unheard_after_s <= self.confirm_timeout_s:
            raise ConfigError(
                f"unheard_after_s must be in [0, confirm_timeout_s={self.confirm_timeout_s:g}] (0: off), "
                f"got {self.unheard_after_s}"
            )
        if self.expected_workers:
            self.rounds.check_learners(self.expected_workers)
        if self.rounds.mode == "async" and self.outer.name == "nesterov":
            object.__setattr__(self, "outer", OuterConfig("delayed_nesterov", self.outer.lr, self.outer.momentum))


@dataclass(frozen=True)
class Lease:
    shard_id: int
    epoch: int
    cursor: int


@dataclass(frozen=True)
class WorkPlan:
    shards: tuple[Lease, ...]
    local_steps: int
    plan_seq: int
    version: int


@dataclass
class WorkerRecord:
    worker_id: str
    name: str
    state: WorkerState = WorkerState.ACTIVE
    speed: float = 0.0  # tokens/s the learner claims (Register, ReportThroughput, heartbeats); 0 = no claim
    device_kind: str = ""
    registered_at: float = 0.0
    last_submit_at: float = 0.0
    submissions: int = 0
    tokens: int = 0
    last_base_version: int = 0
    state_reason: str = ""
    confirmed: bool = False  # healthd has forwarded its throughput, or it has submitted
    seen_at: float = 0.0  # last sign of life: registration, throughput forwarded by healthd, or a submission
    strikes: int = 0  # refused in a row (reset by an accepted submission or a release)
    measured_speed: float = 0.0  # tokens/s the coordinator measured from accepted submissions; 0 = not yet
    working_since: float | None = None  # when its plan first listed a shard (None: not yet)
    speed_samples: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) of the last accepted submissions


@dataclass(frozen=True)
class Submission:
    worker_id: str
    submission_id: str
    base_version: int
    tokens: int
    steps: int
    ranges: tuple[ShardRange, ...]
    plan_seq: int = 0


@dataclass(frozen=True)
class Accepted:
    """What became of an accepted submission: whose it is, its round (the version that round produces, or
    produced), its staleness at admission (the version then, which is `round - 1`, minus its base version) and
    whether the round was applied. A duplicate of it is answered with this (`diloco.core.uploads`)."""

    worker_id: str
    round: int
    staleness: int
    applied: bool

    @classmethod
    def of(cls, p: Pending, round_: int, applied: bool) -> Accepted:
        return cls(p.worker_id, round_, round_ - 1 - p.base_version, applied)


def applied_to_json(applied: Mapping[str, Accepted]) -> list[list[Any]]:
    """Applied outcomes as JSON, oldest first: `[submission_id, worker_id, round, staleness]` each."""
    return [[sid, a.worker_id, a.round, a.staleness] for sid, a in applied.items()]


def applied_from_json(value: object) -> dict[str, Accepted]:
    """The inverse of `applied_to_json`; InvalidArgument naming what is wrong."""
    if not isinstance(value, list):
        raise InvalidArgument(f"applied outcomes must be a list, got {type(value).__name__}")
    out: dict[str, Accepted] = {}
    for item in value:
        match item:
            case [str(sid), str(worker_id), int(round_), int(staleness)] if (
                sid and worker_id and round_ >= 1 and staleness >= 0 and bool not in (type(round_), type(staleness))
            ):
                out[sid] = Accepted(worker_id, round_, staleness, applied=True)
            case _:
                raise InvalidArgument(
                    f"an applied outcome must be [submission_id, worker_id, round >= 1, staleness >= 0], got {item!r}"
                )
    return out


_LEARNER_FIELDS = (
    "worker_id",
    "name",
    "state",
    "state_reason",
    "speed",
    "device_kind",
    "submissions",
    "tokens",
    "last_base_version",
    "strikes",
    "measured_speed",
)


def learners_to_json(workers: Mapping[str, WorkerRecord]) -> list[dict[str, Any]]:
    """The live learners' records as JSON (the learner table of a snapshot), by id; times are left out (they are
    of the process that wrote them)."""
    out = []
    for w in sorted(workers):
        rec = workers[w]
        if rec.state in LIVE_STATES:
            row = {k: getattr(rec, k) for k in _LEARNER_FIELDS}
            row["state"] = rec.state.value  # plain JSON: checkpoints load with `weights_only`
            row["speed_samples"] = [list(s) for s in rec.speed_samples]
            out.append(row)
    return out


def learners_from_json(value: object, now: float) -> dict[str, WorkerRecord]:
    """The inverse of `learners_to_json`, every learner's clock starting at `now` and unconfirmed; InvalidArgument
    naming what is wrong."""
    if not isinstance(value, list):
        raise InvalidArgument(f"the learner table must be a list, got {type(value).__name__}")
    out: dict[str, WorkerRecord] = {}
    for row in value:
        try:
            rec = _learner_from_json(row, now)
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"a learner record is malformed ({e}): {str(row)[:200]}") from None
        if rec.worker_id in out:
            raise InvalidArgument(f"learner {rec.worker_id!r} is listed twice")
        out[rec.worker_id] = rec
    return out


def _learner_from_json(row: Any, now: float) -> WorkerRecord:
    if not isinstance(row, dict) or set(row) != {*_LEARNER_FIELDS, "speed_samples"}:
        raise ValueError("expected an object with the fields " + ", ".join((*_LEARNER_FIELDS, "speed_samples")))
    state = WorkerState(row["state"])
    if state not in LIVE_STATES:
        raise ValueError(f"state {state.value!r} is not a live one")
    texts = [row[k] for k in ("worker_id", "name", "state_reason", "device_kind")]
    counts = [row[k] for k in ("submissions", "tokens", "last_base_version", "strikes")]
    speeds = [row[k] for k in ("speed", "measured_speed")]
    samples = tuple(_sample(x) for x in row["speed_samples"])
    if not all(isinstance(t, str) for t in texts) or not texts[0] or not texts[1]:
        raise ValueError("worker_id and name must be non-empty strings")
    if not all(type(c) is int and c >= 0 for c in counts):
        raise ValueError("submissions, tokens, last_base_version and strikes must be integers >= 0")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in speeds):
        raise ValueError("speed and measured_speed must be finite numbers >= 0")
    if len(samples) > MEASURE_WINDOW:
        raise ValueError(f"speed_samples must hold at most {MEASURE_WINDOW} pairs [tokens >= 0, seconds >= 0]")
    return WorkerRecord(
        texts[0],
        texts[1],
        state=state,
        speed=float(speeds[0]),
        device_kind=texts[3],
        registered_at=now,
        last_submit_at=now,
        submissions=counts[0],
        tokens=counts[1],
        last_base_version=counts[2],
        state_reason=texts[2],
        seen_at=now,
        strikes=counts[3],
        measured_speed=float(speeds[1]),
        speed_samples=samples,
    )


def _sample(value: Any) -> tuple[int, float]:
    match value:
        case [int(tokens), int() | float() as seconds] if (
            tokens >= 0 and math.isfinite(seconds) and seconds >= 0 and bool not in (type(tokens), type(seconds))
        ):
            return tokens, float(seconds)
    raise ValueError(f"a speed sample must be [tokens >= 0, seconds >= 0], got {value!r}")


def keep_applied(kept: OrderedDict[str, Accepted], new: Mapping[str, Accepted]) -> None:
    """Add `new` (in its order) to `kept` as its newest, then drop the oldest beyond `APPLIED_KEPT`."""
    kept.update(new)
    while len(kept) > APPLIED_KEPT:
        kept.popitem(last=False)


@dataclass(frozen=True)
class RoundApplied:
    version: int
    submissions: tuple[Pending, ...]
    tokens: int
    max_staleness: int
    delta_norm: float
    reason: CloseReason
    closed_at: float


@dataclass(frozen=True)
class ClosedRound:
    """A round whose bookkeeping is done (`CoordinatorCore.close`) and whose outer step is not (`step`)."""

    close: RoundClose
    scale: float  # the fraction of a full step it takes (`_round_fraction`)
    learners: int  # live learners at the close (N of Delayed Nesterov)


@dataclass(frozen=True)
class AcceptResult:
    staleness: int
    round: int  # the version the submission will produce (or produced)
    applied: RoundApplied | None  # the round this acceptance closed, if any
    released: bool = False  # the submission was clean and released its learner from quarantine
    norm_ratio: float = math.nan  # per-step norm / median of recent accepted ones (NaN: no reference yet)


class CoordinatorCore:
    """Global parameters, outer optimizer state, version, ledger and registry, with every transition."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        params: torch.Tensor,
        shard_lengths: Sequence[int],
        segments: Sequence[Segment] | None = None,
    ) -> None:
        if params.dim() != 1 or params.dtype != torch.float32:
            raise ConfigError("params must be a flat float32 vector")
        if cfg.expected_workers and len(shard_lengths) < cfg.expected_workers:
            raise ConfigError(
                f"num_shards ({len(shard_lengths)}) must be >= the number of learners ({cfg.expected_workers})"
            )
        self.cfg = cfg
        self.params = params
        self.segments = list(segments) if segments else None
        self.policy = RoundPolicy(cfg.rounds)
        self.ledger = ShardLedger(len(shard_lengths), list(shard_lengths))
        self.outer: OuterOptimizer = build_outer(cfg.outer)
        self.acc = MergeAccumulator(params.numel(), cfg.merge, self.segments)
        self.workers: dict[str, WorkerRecord] = {}
        self.receipts: dict[str, AcceptReceipt] = {}  # submission id -> receipt, open round
        self._healthd_seen_at: float | None = None  # when healthd last forwarded a throughput report
        self._healthd_since: float | None = None  # when it started reporting after its last silence
        self.applied: OrderedDict[str, Accepted] = OrderedDict()  # recent applied submissions, oldest first
        self.staged: dict[int, tuple[str, int]] = {}  # shard -> (target worker, plan_seq it was staged at)
        self.plan_seq = 0
        self.registered_ever = 0
        self.tokens_applied = 0
        self._stepped = 0  # the version the parameters are at (`close` advances the version, `step` them)
        self.guard = NormGuard(cfg.guard)
        self._param_norm: tuple[int, float] | None = None  # (version, ‖Θ‖) for the guard's ceiling
        self.paused = False
        self._incarnation = 0
        self._departed: deque[str] = deque()  # departed learners' ids, oldest departure first
        self._published: dict[int, float] = {}  # version -> when it closed (recent versions)
        self._placed: dict[str, float] = {}  # the speeds shards were last placed with (`_rebalance`)
        self._now = -math.inf  # the latest time a call gave (for changes made by calls without a time)
        self._speeds_cache: tuple[dict[str, float], float] | None = None  # `_speeds`
        self._weights: dict[str, float] = {}  # placement weights other than 1 (`set_placement_weights`)
        # the learners taken over with a standby's table (`restore(..., learners_at=...)`): registered under the
        # previous coordinator epoch, which their calls may still name (ids issued here later never are)
        self.adopted: frozenset[str] = frozenset()
        # round-log replication (`diloco.core.replication`): called with (version, Δ, learners) just before each
        # round's outer step, Δ merged and scaled as the step takes it (the merge buffer: copy what you keep)
        self.on_step: Callable[[int, torch.Tensor, int], None] | None = None

    # ---------------------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def finished(self) -> bool:
        return bool(self.cfg.target_outer_steps) and self.version >= self.cfg.target_outer_steps

    def live_ids(self) -> list[str]:
        return sorted(w for w, r in self.workers.items() if r.state in LIVE_STATES)

    def held_floor(self) -> int | None:
        """The oldest version a live learner is known to hold: the least base version of the live learners' last
        accepted submissions (a learner holds the version it trained from, or a newer one; one that has not
        submitted counts as holding version 0). None without live learners: who comes next is not known."""
        bases = [r.last_base_version if r.submissions else 0 for r in self.workers.values() if r.state in LIVE_STATES]
        return min(bases) if bases else None

    def worker(self, worker_id: str) -> WorkerRecord:
        rec = self.workers.get(worker_id)
        if rec is None:
            raise NotFound(f"unknown worker {worker_id!r}; register first")
        return rec

    def _live_worker(self, worker_id: str) -> WorkerRecord:
        rec = self.worker(worker_id)
        if rec.state not in LIVE_STATES:
            raise FailedPrecondition(
                f"worker {worker_id} is {rec.state} ({rec.state_reason or 'no reason given'}); register again"
            )
        return rec

    # --- membership -------------------------------------------------------------------------------------------
    def register(self, name: str, now: float, speed: float = 0.0, device_kind: str = "") -> WorkerRecord:
        if not name or len(name) > 128 or not name.isprintable():
            raise InvalidArgument("worker_name must be 1-128 printable characters")
        if not math.isfinite(speed) or speed < 0:
            raise InvalidArgument(f"throughput.tokens_per_s must be a finite number >= 0, got {speed}")
        live = sum(r.state in LIVE_STATES for r in self.workers.values())
        if live >= self.cfg.max_workers:
            raise ResourceExhausted(
                f"the coordinator holds {live} live learners, its limit (max_workers, flag --max-workers); "
                "retry once a learner has left, or restart the coordinator with a larger --max-workers"
            )
        while len(self._departed) > self.cfg.max_departed:
            self.workers.pop(self._departed.popleft(), None)
        self._now = max(self._now, now)
        self._incarnation += 1
        worker_id = f"{name}-{self._incarnation}"
        self.workers[worker_id] = WorkerRecord(
            worker_id, name, speed=speed, device_kind=device_kind, registered_at=now, seen_at=now
        )
        self.registered_ever += 1
        self._speeds_changed()
        self.policy.worker_joined(worker_id)
        self._membership_changed()
        return self.workers[worker_id]

    def report_throughput(
        self, worker_id: str, tokens_per_s: float, device_kind: str = "", now: float | None = None
    ) -> None:
        """healthd forwards a learner's throughput (it heartbeats, so it is alive). `now`: when, for the leases.
        The figure is a claim: it is recorded, and counts only as a prior until the learner is measured; it
        moves no shard by itself (the next placement reads it)."""
        rec = self.worker(worker_id)
        if not math.isfinite(tokens_per_s) or tokens_per_s < 0:
            raise InvalidArgument(f"tokens_per_s must be a finite number >= 0, got {tokens_per_s}")
        if is_known_speed(tokens_per_s) and tokens_per_s != rec.speed:  # a report without a figure: no change
            rec.speed = tokens_per_s
            self._speeds_changed()
        rec.confirmed = True
        if now is not None:
            self._now = max(self._now, now)
            rec.seen_at = max(rec.seen_at, now)
            gap = self.cfg.confirm_timeout_s / 2
            if self._healthd_seen_at is None or now - self._healthd_seen_at > gap:
                self._healthd_since = now  # healthd (re)started reporting: silences count from here
            self._healthd_seen_at = max(self._healthd_seen_at or now, now)
        if device_kind:
            rec.device_kind = device_kind

    def remove(self, worker_id: str, state: WorkerState, reason: str) -> list[int]:
        """A learner died, left or was evicted: it leaves quorum expectations and its shards move.
        Returns the shards that moved. Removing a learner that is already gone changes nothing."""
        if state not in GONE_STATES:
            raise InvalidArgument(f"a removed learner is dead, left or evicted, not {state!r}")
        rec = self.worker(worker_id)
        if rec.state not in LIVE_STATES:
            return []
        rec.state, rec.state_reason = state, reason
        self._departed.append(worker_id)
        self._speeds_changed()
        self.policy.worker_left(worker_id)
        released = self._take_back((worker_id,))
        self._membership_changed()
        return released

    def drain(self, worker_id: str) -> WorkerRecord:
        """The operator takes a learner out of the work (DrainWorker): it stays registered and gets no shards. Those
        it holds go to the active learners at once, as a paused learner's do: they resume at their accepted cursors
        under a new epoch, so steps it trained but did not submit are trained again by the new owner and a late
        submission of them is refused (exactly-once). Its accepted submissions are applied as usual. Waiting for
        its next submission, the hand-off of a slower learner, would hold them for ever: a learner with no shards
        submits nothing more. Returns the record (draining an already draining learner changes nothing)."""
        rec = self._live_worker(worker_id)
        if rec.state == DRAINING:
            return rec
        rec.state, rec.state_reason = DRAINING, "drained by operator"
        self._take_back((worker_id,))
        self._speeds_changed()
        self._rebalance()
        return rec

    def set_placement_weights(self, weights: Mapping[str, float]) -> bool:
        """A placement policy's weights (`diloco.core.energy.decide`): a live learner's share of shards and its
        H_m scale by its weight in [0, 1] (missing: 1); 0 pauses it: still registered, no shards (they move by the
        ordinary hand-off), not waited for. Returns whether they changed (and shards were placed again).

        A learner paused now gives its shards back at once, as a quarantined one does after its last strike: they
        resume at their accepted cursors under a new epoch, so steps it trained but did not submit are trained again
        by the new owner, and a late submission of them is refused (exactly-once). A paused learner never submits
        again, so waiting for its next submission, the hand-off of a slower learner, would hold them forever."""
        new = {w: float(x) for w, x in weights.items() if x != 1.0}
        placed_speeds(dict.fromkeys(new, 1.0), new)  # validates the weights
        if new == self._weights:
            return False
        paused = [w for w, x in new.items() if x == 0 and self._weights.get(w, 1.0) != 0 and w in self.workers]
        self._weights = new
        self._speeds_changed()
        self._take_back([w for w in paused if self.workers[w].state in LIVE_STATES])
        self._rebalance()
        return True

    def _take_back(self, worker_ids: Sequence[str]) -> list[int]:
        """Release the shards `worker_ids` own (each under a new epoch, resumed at its accepted cursor) and drop every
        hand-off from or towards them. Returns the released shard ids."""
        released = [shard for w in worker_ids for shard in self.ledger.release(w)]
        for shard, (target, _) in list(self.staged.items()):
            if target in worker_ids or shard in released:
                del self.staged[shard]
        return released

    def release(self, worker_id: str, reason: str = "released by operator") -> WorkerRecord:
        """Lift a quarantine (a live learner that is not quarantined is returned as it is)."""
        rec = self._live_worker(worker_id)
        if rec.state == QUARANTINED:
            rec.state, rec.state_reason, rec.strikes = ACTIVE, reason, 0
            self._rebalance()
        return rec

    def _quarantine(self, rec: WorkerRecord, verdict: Verdict) -> tuple[bool, list[int]]:
        """Refusal bookkeeping. Returns (newly quarantined, shards moved away because the strikes ran out)."""
        rec.strikes += 1
        newly = rec.state != QUARANTINED
        rec.state, rec.state_reason = QUARANTINED, f"pseudo-gradient refused ({verdict.describe()})"
        moved: list[int] = []
        if rec.strikes >= self.cfg.guard.quarantine_strikes and self.ledger.owned_by(rec.worker_id):
            moved = self.ledger.release(rec.worker_id)
            for shard in moved:
                self.staged.pop(shard, None)
            rec.state_reason += f"; {rec.strikes} refusals in a row: shards moved away"
            self._rebalance()
        else:
            self._refresh_idle()
        return newly, moved

    def _membership_changed(self) -> None:
        self._rebalance()  # the outer optimizer learns the number of live learners at each round's close

    def _speeds(self) -> tuple[dict[str, float], float]:
        """The speed every live learner plans with (`placement.planning_speeds`: measured, else a bounded
        claim), an unknown one counting as the median (`placement.effective_speeds`), and the fastest of them.
        Cached: every plan asks for it; `_speeds_changed` drops it."""
        if self._speeds_cache is None:
            live = [self.workers[w] for w in self.live_ids()]
            claimed = {r.worker_id: r.speed for r in live}
            speeds = effective_speeds(planning_speeds(claimed, {r.worker_id: r.measured_speed for r in live}))
            placed = placed_speeds(speeds, self._weights)
            self._speeds_cache = (speeds, max(placed.values(), default=max(speeds.values(), default=1.0)))
        return self._speeds_cache

    def planning_speeds(self) -> dict[str, float]:
        """Every live learner's planning speed (`_speeds`), before placement weights: what a placement policy weighs
        (`diloco.core.energy.decide`)."""
        return dict(self._speeds()[0])

    def _speeds_changed(self) -> None:
        """A claim, a measurement or the set of live learners changed."""
        self._speeds_cache = None

    def _slots(self) -> dict[str, float]:
        """What shards are placed on: the active learners' planning speeds, and a placeholder per learner still
        expected (not a valid worker id: shards placed there stay unowned) counting as the median speed."""
        speeds, _ = self._speeds()
        placed = placed_speeds(speeds, self._weights)
        slots = {w: v for w, v in placed.items() if self.workers[w].state == ACTIVE}
        for i in range(max(0, self.cfg.expected_workers - self.registered_ever)):
            slots[f"\x00slot{i}"] = 0.0
        return effective_speeds(slots)

    def _rebalance(self) -> None:
        """Place shards on the live learners in proportion to speed; moves off a live learner are staged."""
        slots = self._slots()
        speeds = {w for w in slots if not w.startswith("\x00")}
        kept = {w for w in self.live_ids() if self.workers[w].state == QUARANTINED}  # keep shards, get no new ones
        owners = self.ledger.owner_of()
        current = {i: self._effective_owner(i, owner) for i, owner in enumerate(owners)}
        target = place_shards(self.ledger.num_shards, slots, current)
        self._placed = slots
        changed = False
        for shard_id, owner in target.items():
            if owner is not None and owner.startswith("\x00"):
                owner = None
            now_owner = owners[shard_id]  # assign below changes only this shard's owner
            if now_owner in kept:
                continue
            if owner == now_owner:
                if self.staged.pop(shard_id, None) is not None:
                    changed = True
                continue
            if now_owner is None or now_owner not in speeds:
                if owner is not None:
                    self.ledger.assign(shard_id, owner)
                    self.staged.pop(shard_id, None)
                    changed = True
            elif owner is not None and self.staged.get(shard_id, ("", 0))[0] != owner:
                self.staged[shard_id] = (owner, self.plan_seq + 1)
                changed = True
        if changed:
            self.plan_seq += 1
        self._refresh_idle()

    def _refresh_idle(self) -> None:
        """Tell the round policy which live learners have no shards to train (a round must not wait for them)."""
        has_work = {w for w, ids in self.ledger.owners().items() if any(i not in self.staged for i in ids)}
        quarantined = {w for w, r in self.workers.items() if r.state == QUARANTINED}
        self.policy.idle = {w for w in self.policy.live if w not in has_work or w in quarantined}
        for w in has_work:  # its work can start: the measured rule counts its first submission's time from here
            rec = self.workers[w]
            if rec.working_since is None:
                rec.working_since = self._now

    def _effective_owner(self, shard_id: int, owner: str | None) -> str | None:
        staged = self.staged.get(shard_id)
        return staged[0] if staged else owner

    def plan(self, worker_id: str) -> WorkPlan:
        """The learner's shards (those not being handed off), cursors and H_m."""
        rec = self._live_worker(worker_id)
        leases = tuple(
            Lease(s.shard_id, s.epoch, s.accepted)
            for s in self.ledger.owned_by(worker_id)
            if s.shard_id not in self.staged
        )
        if rec.state == DRAINING:
            leases = ()
        return WorkPlan(leases, self._local_steps(rec), self.plan_seq, self.version)

    def _local_steps(self, rec: WorkerRecord) -> int:
        """H_m: the inner steps the learner's plan asks for (ALGORITHM.md section 6), against the fastest live
        learner, with the planning speeds (`_speeds`)."""
        if not self.cfg.dynamic_local_steps or rec.state not in LIVE_STATES:
            return self.cfg.local_steps
        speeds, fastest = self._speeds()
        weight = self._weights.get(rec.worker_id, 1.0)
        if weight == 0:  # paused: no shards; the figure is not used
            return self.cfg.local_steps
        speed = speeds[rec.worker_id] if weight == 1.0 else speeds[rec.worker_id] * weight
        return local_steps(self.cfg.local_steps, speed, fastest, self.cfg.min_local_steps)

    # --- submissions ------------------------------------------------------------------------------------------
    def accepted(self, submission_id: str) -> Accepted | None:
        """What became of submission `submission_id`: applied (one of the last `APPLIED_KEPT`, wherever it was
        applied: here, or at the leader whose round log or checkpoint this state came from), pending in the open
        round, or None: not accepted (or forgotten)."""
        done = self.applied.get(submission_id)
        if done is not None or submission_id not in self.receipts:
            return done
        p = next(p for p in self.policy.pending if p.submission_id == submission_id)  # every receipt is pending
        return Accepted.of(p, self.version + 1, False)

    def admit(self, sub: Submission) -> int:
        """Everything checkable before the payload is read. Returns the staleness; raises on refusal."""
        if sub.submission_id in self.applied or sub.submission_id in self.receipts:
            raise AlreadyExists(f"submission {sub.submission_id} was already accepted")
        self._live_worker(sub.worker_id)
        if sub.tokens <= 0 or sub.steps <= 0:
            raise InvalidArgument(f"tokens and steps must be > 0 (got tokens={sub.tokens}, steps={sub.steps})")
        tps = self.cfg.tokens_per_step
        if tps and sub.tokens != sub.steps * tps:
            raise InvalidArgument(
                f"tokens ({sub.tokens}) must be steps ({sub.steps}) x {tps}, the tokens of one batch: every inner "
                "step trains one batch of the task"
            )
        if sum(r.end - r.start for r in sub.ranges) != sub.tokens:
            raise InvalidArgument(
                f"the shard ranges add up to {sum(r.end - r.start for r in sub.ranges)} tokens "
                f"but the submission reports {sub.tokens}"
            )
        staleness = self.policy.admit(sub.worker_id, sub.base_version)
        self.ledger.check(sub.worker_id, sub.ranges)
        return staleness

    def accept(self, sub: Submission, delta: torch.Tensor, now: float) -> AcceptResult:
        """Fold a decoded, validated pseudo-gradient in and close a round if the policy says so; all checks
        happen before any state changes. One call for the simulator; the service runs its steps itself
        (`measure`, `take`, `fold`, `close`, `step`) so that only the bookkeeping holds its control lock."""
        per_step = self.measure(sub, delta)
        taken = self.take(sub, per_step, now)
        self.fold(delta, sub.tokens)
        applied = self.poll(now)
        return replace(taken, round=applied.version if applied else taken.round, applied=applied)

    def measure(self, sub: Submission, delta: torch.Tensor | EncodedDelta) -> float:
        """Work on the submission's own payload, no state read or changed: its size, and its norm per inner step
        for the guard (a tensor: one pass; an `EncodedDelta`: measured on arrival; NaN, Inf or an overflow make
        it non-finite)."""
        if isinstance(delta, EncodedDelta):
            numel, shaped = delta.meta.numel, True
        else:
            numel, shaped = delta.numel(), delta.shape == self.params.shape
        if numel != self.params.numel() or not shaped:
            raise InvalidArgument(f"pseudo-gradient has {numel} elements; the model has {self.params.numel()}")
        norm = delta.norm() if isinstance(delta, EncodedDelta) else float(torch.linalg.vector_norm(delta))
        return norm / max(1, sub.steps)

    def take(self, sub: Submission, per_step: float, now: float, guard: NormGuard | None = None) -> AcceptResult:
        """The bookkeeping of an acceptance, given the pseudo-gradient's norm per step (`measure`): admission,
        the guard, the ledger's accepted cursors, the learner's record and the round's pending set. No tensor
        is touched; the caller `fold`s the pseudo-gradient next, before the round can `close`. `guard`: the norms
        to judge it against (streaming fragments: its fragment's; None: the core's own)."""
        staleness = self.admit(sub)
        rec = self.workers[sub.worker_id]
        guard = guard or self.guard
        verdict = guard.check(per_step, self._ceiling())
        if not verdict.ok:
            raise self._refusal(sub, rec, verdict)
        receipt = self.ledger.accept(sub.worker_id, sub.ranges)
        self.receipts[sub.submission_id] = receipt
        guard.record(per_step)
        released = rec.state == WorkerState.QUARANTINED
        rec.strikes = 0
        if released:
            rec.state, rec.state_reason = WorkerState.ACTIVE, "released after a clean submission"
            self._rebalance()
        self._now = max(self._now, now)
        self._measure(rec, sub, now)
        rec.submissions += 1
        rec.tokens += sub.tokens
        rec.last_base_version = sub.base_version
        rec.last_submit_at = now
        rec.confirmed = True
        rec.seen_at = max(rec.seen_at, now)
        self._complete_handoffs(sub.worker_id, sub.plan_seq)
        self.policy.submitted(Pending(sub.submission_id, sub.worker_id, sub.base_version, sub.tokens, now, sub.steps))
        return AcceptResult(staleness, self.version + 1, None, released, verdict.ratio)

    def _measure(self, rec: WorkerRecord, sub: Submission, now: float) -> None:
        """Fold an accepted submission into its learner's measured speed (the rule: `diloco.core.placement`)."""
        seconds = work_seconds(
            now,
            rec.registered_at if rec.working_since is None else max(rec.registered_at, rec.working_since),
            rec.last_submit_at if rec.submissions else None,
            self._published.get(sub.base_version),
            self.cfg.rounds.mode == "sync",
        )
        rec.speed_samples = (*rec.speed_samples, (sub.tokens, seconds))[-MEASURE_WINDOW:]
        rec.measured_speed = measured_speed(rec.speed_samples) or rec.measured_speed
        self._speeds_changed()

    def fold(self, delta: torch.Tensor | EncodedDelta, tokens: int) -> None:
        """Tensor work: add a taken pseudo-gradient to the merge buffer (the caller may reuse `delta` after)."""
        self.acc.add(delta, tokens)

    def _refusal(self, sub: Submission, rec: WorkerRecord, verdict: Verdict) -> SubmissionRejected:
        newly, moved = self._quarantine(rec, verdict)
        if verdict.reason == NON_FINITE:
            return NonFiniteRejected(
                "pseudo-gradient contains NaN or Inf; check the learner's training. The learner is quarantined: "
                "adopt the newest parameters and train the range again",
                sub.worker_id,
                verdict,
                newly,
                moved,
            )
        if verdict.reason == CEILING:
            why = (
                f"its norm per inner step ({verdict.norm:.4g}) is above {verdict.ceiling:.4g}, more than the "
                "task's AdamW settings let any learner move the parameters (a wrong learning rate or a scaled "
                "update)"
            )
        else:
            why = (
                f"its norm per inner step ({verdict.norm:.4g}) is {verdict.ratio:.3g}x the median of recently "
                f"accepted ones ({verdict.median:.4g}; limit {self.cfg.guard.outlier_factor:g}x)"
            )
        return SubmissionRejected(
            f"pseudo-gradient refused: {why}. The learner is quarantined: adopt the newest parameters and train "
            "the range again; a clean submission (or ReleaseWorker) releases it",
            sub.worker_id,
            verdict,
            newly,
            moved,
        )

    def _ceiling(self) -> float:
        """The guard's ceiling for the current parameters (their norm is computed once per version)."""
        if not self.cfg.guard.has_ceiling:
            return math.inf  # and no pass over the parameters for their norm
        if self._param_norm is None or self._param_norm[0] != self._stepped:
            self._param_norm = (self._stepped, float(torch.linalg.vector_norm(self.params)))
        return self.cfg.guard.ceiling(self.params.numel(), self._param_norm[1])

    def _complete_handoffs(self, worker_id: str, plan_seq: int) -> None:
        for shard_id in sorted(self.ledger.shard_ids_of(worker_id) & self.staged.keys()):
            target, staged_at = self.staged[shard_id]
            if plan_seq >= staged_at:
                del self.staged[shard_id]
                if self.workers[target].state == ACTIVE:
                    self.ledger.assign(shard_id, target)
        self._refresh_idle()

    def poll(self, now: float) -> RoundApplied | None:
        """Close and apply a round if the policy says so (also call at `next_deadline()`)."""
        closed = self.close(now)
        return self.step(closed) if closed else None

    def close(self, now: float) -> ClosedRound | None:
        """The bookkeeping of a round close, if the policy says so: the version advances, the round's ledger
        receipts are committed and its submission ids recorded, atomically. The parameters are not touched: the
        caller must `step` the returned round before anything else reads or changes them (the next `fold`
        included), and must not show the new version's parameters before that."""
        if self.paused or self.finished:
            return None
        close = self.policy.poll(now)
        if close is None:
            return None
        self._now = max(self._now, now)
        scale = self._round_fraction(close)
        for p in close.submissions:
            self.ledger.commit(self.receipts.pop(p.submission_id))
        keep_applied(self.applied, {p.submission_id: Accepted.of(p, close.version, True) for p in close.submissions})
        self.tokens_applied += sum(p.tokens for p in close.submissions)
        self._published[close.version] = now
        self._published.pop(close.version - _PUBLISHED_VERSIONS, None)
        if shares_moved(self._placed, self._slots()):  # measurements moved a share: place shards again
            self._rebalance()
        return ClosedRound(close, scale, max(1, len(self.live_ids())))

    def step(self, closed: ClosedRound) -> RoundApplied:
        """Tensor work of a closed round: merge, scale, outer step; then the merge buffer is empty again."""
        close = closed.close
        delta = self.acc.result()  # lives in the merge buffer until acc.reset()
        tokens = self.acc.tokens
        if closed.scale < 1.0:
            delta.mul_(closed.scale)
        delta_norm = float(torch.linalg.vector_norm(delta))
        self.outer.set_num_learners(closed.learners)
        if self.on_step is not None:
            self.on_step(close.version, delta, closed.learners)
        self.outer.step(self.params, delta, scratch_delta=True)  # delta is the merge buffer, reset below
        self.acc.reset()
        self.mark_stepped(close.version)
        return RoundApplied(
            close.version,
            close.submissions,
            tokens,
            close.max_staleness,
            delta_norm,
            close.reason,
            close.closed_at,
        )

    def mark_stepped(self, version: int) -> None:
        """The parameters are at `version` now (`step`, or a caller taking the outer step itself: fragments)."""
        self._stepped = version
        if self.cfg.guard.has_ceiling:  # the guard's next check needs it: computed here, with the tensor work
            self._param_norm = (version, float(torch.linalg.vector_norm(self.params)))

    def next_deadline(self) -> float | None:
        """When to call `poll` (a grace window ends) or `expire_unconfirmed` (a registration lease runs out)."""
        deadlines = [
            d for d in (None if self.paused else self.policy.next_deadline(), self._confirm_deadline()) if d is not None
        ]
        return min(deadlines, default=None)

    def _unconfirmed(self) -> list[WorkerRecord]:
        if not self.cfg.confirm_timeout_s:
            return []
        return [r for r in self.workers.values() if r.state in LIVE_STATES and not r.confirmed]

    def _confirm_deadline(self) -> float | None:
        return min((r.registered_at + self.cfg.confirm_timeout_s for r in self._unconfirmed()), default=None)

    def _unreported(
        self, t: float, records: Iterable[WorkerRecord], since: Callable[[WorkerRecord], float]
    ) -> list[WorkerRecord]:
        """Of `records`, those healthd has not reported for `t` seconds after `since(record)` while it kept
        reporting others. Judged only on the times healthd reported, so no learner expires while healthd itself is
        silent (t = 0: none)."""
        seen, reporting_since = self._healthd_seen_at, self._healthd_since
        if not t or seen is None or reporting_since is None:
            return []
        return [r for r in records if seen >= max(since(r), reporting_since) + t]

    def _silent(self) -> list[WorkerRecord]:
        """Live, confirmed learners healthd has not reported for `confirm_timeout_s` while it kept reporting
        others: they died while healthd was down (a restarted healthd never hears of them)."""
        live = [r for r in self.workers.values() if r.state in LIVE_STATES and r.confirmed]
        return self._unreported(self.cfg.confirm_timeout_s, live, lambda r: r.seen_at)

    def _unheard(self) -> list[WorkerRecord]:
        """Unconfirmed learners healthd has not reported for `unheard_after_s` since they registered while it kept
        reporting others: they died before their first heartbeat reached it."""
        return self._unreported(self.cfg.unheard_after_s, self._unconfirmed(), lambda r: r.registered_at)

    def expire_unconfirmed(self, now: float) -> list[tuple[str, list[int]]]:
        """Declare dead the learners healthd cannot report: registered but never confirmed alive within
        `confirm_timeout_s`, or within `unheard_after_s` of healthd reporting others (`_unheard`: they died before
        healthd heard of them), or silent while healthd reports the others (`_silent`). Returns (worker, moved
        shards)."""
        t = self.cfg.confirm_timeout_s
        self._now = max(self._now, now)
        never = [r for r in self._unconfirmed() if now >= r.registered_at + t]
        reason = f"no heartbeat within {t:g} s of registering"
        out = [(r.worker_id, self.remove(r.worker_id, DEAD, reason)) for r in never]
        reason = f"healthd reported other learners for {self.cfg.unheard_after_s:g} s after it registered, never it"
        out += [(r.worker_id, self.remove(r.worker_id, DEAD, reason)) for r in self._unheard()]
        reason = f"healthd reported other learners for {t:g} s but not this one"
        return out + [(r.worker_id, self.remove(r.worker_id, DEAD, reason)) for r in self._silent()]

    def _round_fraction(self, close: RoundClose) -> float:
        """How much of a full wave a round holds: 1 for a round with every expected learner in (and in `sync`
        and `async`, whose rounds are whole by construction), else the inner steps it holds over those plus the
        planned steps (H_m) of the expected learners it closed without. Two waves that fall out of phase (fast
        learners in one round, slow ones in the next) then take one full step between them, not two."""
        if not self.cfg.scale_partial_rounds or close.reason != CloseReason.QUORUM_GRACE:
            return 1.0
        held = {p.worker_id for p in close.submissions}
        steps_in = sum(p.steps for p in close.submissions)
        missing = sum(self._local_steps(self.workers[w]) for w in self.policy.expected - held if w in self.workers)
        if steps_in <= 0 or missing <= 0:
            return 1.0
        return steps_in / (steps_in + missing)

    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    # --- checkpoints ------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a restart needs, consistent with the applied parameters (pending submissions excluded).
        Call it between rounds (not between a `close` and its `step`). The tensors in it are the core's own
        (parameters, outer state): copy them before the next round steps, e.g. under the caller's tensor lock,
        so that the bookkeeping need not wait for the copy."""
        return {
            "format": 1,
            "version": self.version,
            "params": self.params,
            "outer": dict(self.outer.state_dict()),
            "ledger": self.ledger.snapshot(),
            "tokens_applied": self.tokens_applied,
            "incarnation": self._incarnation,
            "guard_norms": self.guard.snapshot(),
            "applied": applied_to_json(self.applied),
            "learners": learners_to_json(self.workers),
            "plan_seq": self.plan_seq,
            "registered_ever": self.registered_ever,
        }

    def restore(self, snap: dict[str, Any], learners_at: float | None = None, *, adopt: bool = False) -> None:
        """Adopt a checkpoint. Pending submissions are gone: the ledger rolls accepted cursors back to
        committed. Without `learners_at` every learner must register again (its shards are released); with it (a
        standby's state, at a promotion) the learner table in `snap` is kept, clocks starting at `learners_at`
        (module docstring). The outcomes of applied submissions it holds are kept: a duplicate of one is answered
        as before. The parameters are copied into Θ; `adopt`: the caller hands `snap`'s tensors over (a checkpoint
        just read), so the outer state's are taken as they are, not copied (a model-sized copy each otherwise)."""
        try:
            params = snap["params"]
            if not isinstance(params, torch.Tensor) or params.shape != self.params.shape:
                raise InvalidArgument("checkpoint parameters do not match the model")
            ledger = ShardLedger.restore(snap["ledger"])
            if ledger.num_shards != self.ledger.num_shards:
                raise InvalidArgument(
                    f"checkpoint has {ledger.num_shards} shards; this run has {self.ledger.num_shards}"
                )
            applied = applied_from_json(snap.get("applied", []))  # none in checkpoints written before they were kept
            learners = {} if learners_at is None else learners_from_json(snap.get("learners", []), learners_at)
            if len(learners) > self.cfg.max_workers:
                raise InvalidArgument(
                    f"{len(learners)} learners; this coordinator holds at most {self.cfg.max_workers}"
                )
            plan_seq, registered_ever = int(snap.get("plan_seq", 0)), int(snap.get("registered_ever", 0))
            self.outer.load_state_dict(snap["outer"], clone=not adopt)
            version = int(snap["version"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"checkpoint is malformed: {e}") from e
        self.params.copy_(params)
        self._param_norm = None
        self.ledger = ledger
        self.ledger.rollback_uncommitted()
        for shard in self.ledger.states():
            if shard.owner is not None and shard.owner not in learners:
                self.ledger.release(shard.owner)
        self.policy = RoundPolicy(self.cfg.rounds, version=version)
        self._stepped = version
        self.tokens_applied = int(snap.get("tokens_applied", 0))
        self._incarnation = int(snap.get("incarnation", 0))
        self.guard.restore(snap.get("guard_norms", ()))
        self.applied = OrderedDict()
        keep_applied(self.applied, applied)
        self.registered_ever = 0
        self.workers = {}
        self._departed.clear()
        self._speeds_changed()
        self._published = {}
        self._placed = {}
        self.receipts = {}
        self.staged = {}
        self.acc.reset()
        self.adopted = frozenset(learners)
        if learners_at is not None and learners:
            self._restore_learners(learners, plan_seq, registered_ever, learners_at)

    def _restore_learners(
        self, learners: dict[str, WorkerRecord], plan_seq: int, registered_ever: int, now: float
    ) -> None:
        """Take over a standby's learner table: the learners keep their shards (placed again only where speeds or
        membership call for it, as hand-offs after `plan_seq`)."""
        self._now = max(self._now, now)
        self.workers = learners
        self.plan_seq = plan_seq
        self.registered_ever = max(registered_ever, len(learners))
        for worker_id in learners:
            self.policy.worker_joined(worker_id)
        self._membership_changed()
