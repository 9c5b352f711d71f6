"""The learner's rules (ALGORITHM.md sections 1, 5, 7, 8) as a state machine driven by the caller's clock.

`LearnerCore` decides what a learner does next; it never does it. It holds no tensors, opens no connection,
starts no thread and reads no clock: `now` is a parameter of every call. The worker service
(`services/worker/`) and the simulator drive the same object: they feed it what happened (an event method) and
ask it what to do (`next_action(now)`), then do that with their own model, network or virtual clock.

States (`LearnerState`) and what moves between them (`[Action]`: what `next_action` returns on the way):

    UNREGISTERED   --[Register] registered(...)--------------------------------> WAITING_PARAMS
    WAITING_PARAMS --params known: [Load(catch_up_steps=v*H_m)]------------------> TRAINING | SHARDLESS
    SHARDLESS      --a plan with shards (plan_received / params_arrived)---------> TRAINING
    SHARDLESS      --poll time reached: [FetchPlan], backoff doubles (capped)----> SHARDLESS
    TRAINING       --no shard left in the plan------------------------------------> SHARDLESS
    TRAINING       --[Train]... steps >= H_m, no submission outstanding: [Submit]-> TRAINING (decoupled, async)
                                                                                 | WAITING_ROUND (sync)
                     (sync: H_m steps done while the last upload's answer is still due: [Wait] for it)
                     (decoupled: max_unsent_rounds x H_m steps done and still no submission possible: [Wait])
    WAITING_ROUND  --a version newer than the base: [Load]------------------------> TRAINING | SHARDLESS
    any registered --a refused upload (RESYNC, DROP_UPLOAD)----------------------> RESYNCING
    RESYNCING      --params known: [Load(reset_codec=True)], cursors forgotten----> SHARDLESS (fetches the plan now)
    any registered --session_ended / REREGISTER / another epoch without a plan---> UNREGISTERED
    any registered --a higher epoch with this learner's plan (a standby took over, knowing it): the learner
                     adopts the epoch and stays registered; when the new leader is behind the versions it
                     received, or an older leader accepted the submission it waits for and its round is not
                     in the new leader's history (also when that acceptance arrives after the takeover) --> RESYNCING
    any            --stop() or a broadcast that says finished--------------------> DRAINING
    DRAINING       --[Wait] for the upload in flight (until the drain deadline), [Submit] the unsent steps (not
                     after finished), [Deregister]-------------------------------> DONE
    any            --unreachable longer than give_up_after_s (if set)------------> DONE
    DONE           --[Exit(reason, code)] on every call

In TRAINING and SHARDLESS, a version newer than the one trained on first yields `[Rebase(version)]` (in every
mode: keep the unsent steps; see `InnerTrainer.rebase`); the submission comes after it, so a submission is always
made against the newest version known. At most one submission is outstanding: a new one waits until the previous
upload is done AND its round was applied (its id is in a broadcast's applied ids, or a version at least its
round arrived); meanwhile the learner trains on.

Streaming fragments (`diloco.core.fragments`, docs/fragments.md; `use_fragments(P)` before registering): each
submission carries one fragment (`SubmissionDraft.fragment`), due after the schedule's gap (`due_steps`, about
H_m/P steps) rather than H_m; a `Rebase` names the fragments whose version changed (`Rebase.fragments`; None: the
whole vector, P = 1); a `sync` learner trains on after submitting and waits only when the next fragment is due
before the previous one's round was applied.

Driving it (what each call does and returns):
- `next_action(now) -> Action`: the one thing to do now; call it again after doing it. Some actions are
  commitments the core has already recorded (`Load`, `Rebase`, `Submit`, `Deregister`, `FetchPlan`); `Train` is
  not: report the step with `stepped`, or the same batch is proposed again.
  * `Register()`: call Register; then `registered(...)`, or `rpc_failed(now, Rpc.REGISTER, code)`.
  * `Wait(until)`: nothing to do before `until` (None: before the next event).
  * `FetchPlan()`: call GetWorkPlan; then `plan_received(now, plan)` or `rpc_failed(now, Rpc.GET_WORK_PLAN, ..)`.
  * `Load(version, catch_up_steps, reset_codec)`: adopt the parameters of `version` (`load_global`), start the
    LR schedule no earlier than `catch_up_steps` (`catch_up`), reset error feedback when `reset_codec`.
  * `Rebase(version)`: rebase onto `version`, keeping the steps not yet submitted.
  * `Train(shard_id, epoch, cursor)`: one inner step on that batch; then `stepped(shard_id, epoch, cursor, end)`.
  * `Submit(draft, drain)`: compute the pseudo-gradient, compress it, `mark_submitted`, upload `draft` (its id,
    base version, ranges, steps, tokens, plan_seq); then `upload_accepted(...)` or `upload_failed(...)`.
  * `Deregister(worker_id)`: call Deregister (best effort), send the leaving heartbeat, then ask again.
  * `Exit(reason, code)`: stop; `code` is the process exit status.
- Events: `registered`, `params_arrived` (returns whether the version is now the newest: keep its tensor),
  `plan_received`, `stepped`, `upload_accepted`, `upload_failed`, `rpc_failed` (returns the `Reaction` the table
  gives; RETRY leaves the state alone), `contact` (any successful coordinator reply), `session_ended`, `stop`.
  `give_up_due(now)` tells a caller's retry loop to stop retrying. No status code ends a learner: it exits only
  when stopped, when the job finished, or after `give_up_after_s`.
- `next_deadline()`: when `next_action` may change without an event (a plan poll, the drain deadline, giving up).
- `react(rpc, code)`: the one table (`REACTIONS`) from every status code of every RPC to what a learner does.
- `steps_to_submit`, `can_submit`, `progress` (the `ReadProgress`), `base_version`, `latest_version`, `state`:
  read-only views, e.g. for a simulator that evaluates training lazily: it may take `steps_to_submit` `Train`
  actions in one go (calling `stepped` for each) and schedule the next look at the time they take.

Time is the caller's: monotonic seconds in the worker, virtual seconds in the simulator. A simulator without an
RPC layer calls `registered` where the worker's Register returns, `params_arrived` when a broadcast's download
completes, `upload_accepted`/`upload_failed(..., Reaction.RESYNC)` when `CoordinatorCore.accept` takes or refuses
a submission, and `session_ended` when it kills the learner (a new incarnation registers again).

The core is not thread-safe; the caller serializes calls (the worker drives it from its training thread only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from diloco.core.coordinator import WorkPlan
from diloco.core.fragments import first_fragment, schedule_gap
from diloco.core.leadership import FAILOVER_CODES
from diloco.core.ledger import ShardRange
from diloco.core.progress import ReadProgress
from diloco.core.rounds import MODES
from diloco.errors import ConfigError, InvalidArgument


class LearnerState(str, Enum):
    UNREGISTERED = "unregistered"
    WAITING_PARAMS = "waiting_params"
    SHARDLESS = "shardless"
    TRAINING = "training"
    WAITING_ROUND = "waiting_round"
    RESYNCING = "resyncing"
    DRAINING = "draining"
    DONE = "done"


class ExitReason(str, Enum):
    FINISHED = "finished"  # the job reached its target (exit 0)
    STOPPED = "stopped"  # SIGTERM/SIGINT: drained and deregistered (exit 0)
    GAVE_UP = "gave_up"  # unreachable for longer than give_up_after_s (exit 1)


EXIT_CODES = {ExitReason.FINISHED: 0, ExitReason.STOPPED: 0, ExitReason.GAVE_UP: 1}


class Rpc(str, Enum):
    """Every call a learner makes."""

    REGISTER = "Register"
    WATCH_PARAMETERS = "WatchParameters"
    GET_WORK_PLAN = "GetWorkPlan"
    SUBMIT = "SubmitPseudoGradient"  # also the bulk upload path, which answers the same codes
    GET_UPLOAD_STATUS = "GetUploadStatus"
    DEREGISTER = "Deregister"
    HEARTBEAT = "Heartbeat"  # to healthd


class Reaction(str, Enum):
    RETRY = "retry"  # the same call again after a capped, jittered backoff
    REREGISTER = "reregister"  # the registration is gone: register again (unsent progress is void)
    RESYNC = "resync"  # the submission was refused: adopt the newest parameters and the ledger's cursors
    DROP_UPLOAD = "drop_upload"  # this upload can never be accepted: drop it, then resync like RESYNC
    SKIP = "skip"  # leaving only: the call is not needed to leave (Deregister of a registration that is gone)
    # the coordinator is down or does not lead (a standby, a fenced leader): retry like RETRY, at the leader its
    # refusal names ("not the leader; leader is at HOST:PORT") or else at the next of the learner's coordinator
    # addresses (`diloco.core.leadership.failover_target`); with one address that is the same address. The new
    # leader answers the old registration NOT_FOUND or FAILED_PRECONDITION (another epoch): the learner registers
    # again (REREGISTER).
    FAILOVER = "failover"

    @property
    def retries(self) -> bool:
        """The same call is made again (at the same or another coordinator address)."""
        return self in (Reaction.RETRY, Reaction.FAILOVER)


_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED", "UNKNOWN", "INTERNAL", "DATA_LOSS")
STATUS_CODES = (
    *_TRANSIENT,
    *("INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"),
    *("FAILED_PRECONDITION", "OUT_OF_RANGE", "UNIMPLEMENTED", "UNAUTHENTICATED"),
)


def _table(default: Reaction, **special: Reaction) -> dict[str, Reaction]:
    out = {code: default for code in STATUS_CODES}
    out.update({code: r for code, r in special.items()})
    return out


def _coordinator_table(default: Reaction, **special: Reaction) -> dict[str, Reaction]:
    """A coordinator call's table: the FAILOVER codes (UNAVAILABLE: down, draining, or not the leader) move to another
    address (`diloco.core.leadership.FAILOVER_CODES`, the rule every client of the coordinator follows)."""
    return _table(default, **{**{code: Reaction.FAILOVER for code in FAILOVER_CODES}, **special})


R = Reaction
# What a learner does on each status code of each RPC. Transient codes and overload are retried everywhere; a
# learner the coordinator no longer knows (NOT_FOUND; FAILED_PRECONDITION on a plan or a watch: dead, left or a
# new coordinator epoch; PERMISSION_DENIED: its id now names another learner) registers again; a refused
# submission resyncs. No status ends a learner (issue #16): what looks permanent (UNIMPLEMENTED: the address is not
# a coordinator of this protocol; INVALID_ARGUMENT on Register; authentication failures) is retried with capped
# backoff and logged at each attempt, so the learner comes back by itself once the operator fixes the other side;
# `give_up_after_s` is the operator's way to bound that.
_SESSION_CALL = _coordinator_table(  # a call that names this learner's registration (its worker id)
    R.RETRY,
    NOT_FOUND=R.REREGISTER,
    FAILED_PRECONDITION=R.REREGISTER,
    PERMISSION_DENIED=R.REREGISTER,
    INVALID_ARGUMENT=R.REREGISTER,
)
REACTIONS: dict[Rpc, dict[str, Reaction]] = {
    Rpc.REGISTER: _coordinator_table(R.RETRY),
    Rpc.WATCH_PARAMETERS: _SESSION_CALL,
    Rpc.GET_WORK_PLAN: _SESSION_CALL,
    # an upload is idempotent and resumable: transient codes resume it (from GetUploadStatus's offset)
    Rpc.SUBMIT: _coordinator_table(
        R.RETRY,
        NOT_FOUND=R.REREGISTER,
        PERMISSION_DENIED=R.REREGISTER,
        FAILED_PRECONDITION=R.RESYNC,  # stale base, moved shard, wrong cursor; a new epoch or "finished" follow
        INVALID_ARGUMENT=R.DROP_UPLOAD,  # the coordinator will never take these bytes
        ALREADY_EXISTS=R.DROP_UPLOAD,  # the id was used by another learner
        OUT_OF_RANGE=R.DROP_UPLOAD,
    ),
    # asked between upload attempts: whatever it answers, the upload is retried (from byte 0 unless it says more)
    Rpc.GET_UPLOAD_STATUS: _coordinator_table(R.RETRY),
    # best effort while leaving: retried until the drain deadline, otherwise skipped
    Rpc.DEREGISTER: _coordinator_table(R.SKIP, DEADLINE_EXCEEDED=R.RETRY, ABORTED=R.RETRY),
    # training never waits on healthd; a DEAD verdict in a reply (not a status) means REREGISTER
    Rpc.HEARTBEAT: _table(R.RETRY),
}
del R


def react(rpc: Rpc, code: str) -> Reaction:
    """The reaction to status `code` (a `grpc.StatusCode` name, e.g. "NOT_FOUND") from `rpc`."""
    try:
        return REACTIONS[rpc][code]
    except KeyError:
        known = ", ".join(STATUS_CODES)
        raise InvalidArgument(f"no reaction for status {code!r} of {rpc.value}; known: {known}") from None


# --- actions ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Register:
    pass


@dataclass(frozen=True)
class Wait:
    until: float | None  # None: until the next event


@dataclass(frozen=True)
class FetchPlan:
    pass


@dataclass(frozen=True)
class Load:
    version: int
    catch_up_steps: int  # 0: no catch-up
    reset_codec: bool  # a resync: error feedback starts from zero


@dataclass(frozen=True)
class Rebase:
    version: int
    fragments: tuple[int, ...] | None = None  # None: the whole vector; else only these fragments (streaming)


@dataclass(frozen=True)
class Train:
    shard_id: int
    epoch: int
    cursor: int


@dataclass(frozen=True)
class SubmissionDraft:
    worker_id: str
    coordinator_epoch: int
    submission_id: str
    base_version: int
    ranges: tuple[ShardRange, ...]
    steps: int
    tokens: int
    plan_seq: int
    fragment: int = 0  # streaming fragments: the fragment whose pseudo-gradient this is (0 when P = 1)


@dataclass(frozen=True)
class Submit:
    draft: SubmissionDraft
    drain: bool  # the hand-back of a draining learner


@dataclass(frozen=True)
class Deregister:
    worker_id: str


@dataclass(frozen=True)
class Exit:
    reason: ExitReason
    code: int
    detail: str


Action = Register | Wait | FetchPlan | Load | Rebase | Train | Submit | Deregister | Exit


@dataclass(frozen=True)
class LearnerConfig:
    id_prefix: str = ""  # submission ids are f"{id_prefix}{n}": make it unique per process (e.g. a uuid)
    drain_timeout_s: float = 30.0  # how long a draining learner waits for its uploads
    plan_poll_initial_s: float = 0.1  # a learner without shards asks for a plan again after this, doubling
    plan_poll_max_s: float = 2.0
    give_up_after_s: float | None = None  # exit when no coordinator call succeeded for this long (None: never)
    # while it cannot submit (an upload in flight or a round awaited), train at most this many submissions' worth of
    # steps, then wait: the ledger refuses a range longer than a shard (the whole submission would be lost), and
    # steps piled up against an old base are stale anyway
    max_unsent_rounds: int = 8

    def __post_init__(self) -> None:
        for name in ("drain_timeout_s", "plan_poll_initial_s", "plan_poll_max_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {v}")
        if self.plan_poll_max_s < self.plan_poll_initial_s:
            raise ConfigError("plan_poll_max_s must be >= plan_poll_initial_s")
        g = self.give_up_after_s
        if g is not None and not (math.isfinite(g) and g > 0):
            raise ConfigError(f"give_up_after_s must be a finite number > 0 or None (never), got {g}")
        if not 1 <= self.max_unsent_rounds <= 1000:
            raise ConfigError(f"max_unsent_rounds must be in [1, 1000], got {self.max_unsent_rounds}")


_SESSION_STATES = frozenset(
    {
        LearnerState.WAITING_PARAMS,
        LearnerState.SHARDLESS,
        LearnerState.TRAINING,
        LearnerState.WAITING_ROUND,
        LearnerState.RESYNCING,
    }
)


@dataclass
class LearnerCore:
    cfg: LearnerConfig = field(default_factory=LearnerConfig)
    state: LearnerState = LearnerState.UNREGISTERED
    worker_id: str = ""  # "" while unregistered
    coordinator_epoch: int = 0
    mode: str = ""
    local_steps: int = 1  # H_m of the current plan
    fragments: int = 1  # P (streaming fragments, `diloco.core.fragments`); 1: the whole model every H_m steps
    next_fragment: int = 0  # the fragment the next submission carries
    fragment_versions: tuple[int, ...] = ()  # per fragment, the version that last changed it (newest broadcast)
    plan_seq: int = 0
    base_version: int = -1  # the version trained on (-1: none loaded this session)
    latest_version: int = -1  # the newest version known this session (-1: none)
    progress: ReadProgress = field(default_factory=ReadProgress)
    uploading: str | None = None  # submission id of the upload in flight
    awaiting: str | None = None  # submission id accepted (or in flight) whose round has not been applied
    awaiting_round: int | None = None  # the version that will include it
    awaiting_epoch: int = 0  # the epoch of the coordinator that accepted `awaiting`
    finished: bool = False
    stopping: bool = False
    drain_deadline: float = math.inf
    exit: Exit | None = None
    failing_since: float | None = None  # first failed coordinator call since the last success
    detail: str = ""  # why the last resync or re-registration happened (for logs)
    _poll_at: float = 0.0
    _poll_backoff_s: float = 0.0
    _submissions: int = 0
    _handed_back: bool = False
    _deregistering: bool = False
    _proposed: Train | None = None  # the batch the last Train named, until it is stepped or no longer leased

    # --- events -----------------------------------------------------------------------------------------------
    def registered(self, now: float, worker_id: str, coordinator_epoch: int, mode: str, plan: WorkPlan) -> None:
        """Register succeeded: a new session. Everything of the previous one (progress, uploads) is void."""
        if mode not in MODES:
            raise InvalidArgument(f"round mode {mode!r} is unknown; known: {', '.join(MODES)}")
        if not worker_id:
            raise InvalidArgument("worker_id is required")
        self.contact(now)
        self.worker_id, self.coordinator_epoch, self.mode = worker_id, coordinator_epoch, mode
        self.base_version = self.latest_version = -1
        self._forget_work()
        self._adopt(plan)
        if self.state is not LearnerState.DRAINING:
            self.state = LearnerState.WAITING_PARAMS

    def params_arrived(
        self,
        now: float,
        version: int,
        coordinator_epoch: int,
        plan: WorkPlan | None = None,
        applied: Iterable[str] = (),
        finished: bool = False,
        fragment_versions: tuple[int, ...] = (),
    ) -> bool:
        """A broadcast of global `version` (with this learner's plan, the submissions it merged and whether the
        job is finished). Returns True when `version` is now the newest known: the caller keeps its tensor for
        the `Load`/`Rebase` that follows. An older or repeated version, or one outside a session, returns False
        (`finished` still stops the learner: a leader that resumes at the job's target publishes nothing newer).
        A version from a higher coordinator epoch that carries this learner's plan comes from a leader that took
        this learner over (`_taken_over`); from any other epoch it ends the session."""
        if not self.worker_id:
            return False
        if self.fragments > 1 and (len(fragment_versions) != self.fragments or max(fragment_versions) != version):
            raise InvalidArgument(
                f"a broadcast of version {version} must list the version of each of the {self.fragments} "
                f"fragments (the newest being {version}), got {fragment_versions!r}"
            )
        self.contact(now)
        if coordinator_epoch != self.coordinator_epoch:
            if coordinator_epoch < self.coordinator_epoch or plan is None:
                self.session_ended(now, f"coordinator epoch {coordinator_epoch} != {self.coordinator_epoch}")
                return False
            self._taken_over(now, version, coordinator_epoch)
        if finished and not self.finished:  # also for a version held: a job that ended there publishes none newer
            self.finished = True
            self.stop(now)
        if version <= self.latest_version:
            return False
        if self.fragments > 1:
            self.fragment_versions = tuple(fragment_versions)
        self.latest_version = version
        if self.awaiting is not None and (
            self.awaiting in applied or (self.awaiting_round is not None and version >= self.awaiting_round)
        ):
            self.awaiting = self.awaiting_round = None
        if plan is not None:
            self._adopt(plan)
        return True

    def _taken_over(self, now: float, version: int, coordinator_epoch: int) -> None:
        """A new leader (`coordinator_epoch`, higher) took this registration over with the learner table and is
        at `version`: stay registered under its epoch. If it is behind a version this learner received (its
        standby did not hold it), or this learner waits for the round of a submission an older leader accepted
        and the new one does not hold, what was trained since is void: resync onto `version`. A submission this
        leader accepted itself (before its first broadcast reached this learner), or one still uploading (the
        upload follows the leader and its outcome decides), is waited for as before."""
        self.coordinator_epoch = coordinator_epoch
        self.detail = f"coordinator epoch {coordinator_epoch} took this learner over at version {version}"
        if self.awaiting is not None and self.awaiting_round is not None and self.awaiting_round <= version:
            self.awaiting = self.awaiting_round = None  # its round is in the new leader's history: applied
        # an accepted submission whose round the new leader does not hold is void there (its ledger rolled the
        # cursors back to committed) and would never be applied: waiting for it would stop this learner for good
        if version < self.latest_version or self._void_acceptance():
            self.latest_version = version - 1  # `version` is the newest known again
            self.awaiting = self.awaiting_round = None
            self._apply(now, Reaction.RESYNC, self.detail)

    def plan_received(self, now: float, plan: WorkPlan) -> None:
        """A plan from GetWorkPlan (or any other source): adopt its leases, H_m and plan_seq."""
        self.contact(now)
        if self.worker_id:
            self._adopt(plan)

    def stepped(self, shard_id: int, epoch: int, start: int, end: int) -> None:
        """One inner step read `[start, end)` of `shard_id` under `epoch` (the batch a `Train` named)."""
        self._proposed = None
        self.progress.consumed(shard_id, epoch, start, end)

    def upload_accepted(
        self, now: float, submission_id: str, pending_round: int, applied: bool = False, epoch: int | None = None
    ) -> None:
        """The coordinator of `epoch` (None: not said, the one this learner follows) holds submission
        `submission_id` for round `pending_round` (`applied`: it was merged already, a duplicate of an earlier
        upload). An acceptance by an older leader than the one that took this learner over since is void (see
        `_taken_over`): resync."""
        self.contact(now)
        if submission_id != self.uploading:
            return
        self.uploading = None
        if self.awaiting == submission_id:
            self.awaiting_epoch = self.coordinator_epoch if epoch is None else epoch
            # sync with fragments trains on past a submission: "applied in round r" may come before version r does,
            # and the next fragment must wait for it (sync refuses any staleness: a resync would lose those steps)
            early = applied and self.fragments > 1 and self.mode == "sync" and self.latest_version < pending_round
            if (applied and not early) or (pending_round and self.latest_version >= pending_round):
                self.awaiting = self.awaiting_round = None
            else:
                self.awaiting_round = pending_round or None
            if self._void_acceptance():
                self.awaiting = self.awaiting_round = None
                detail = f"submission {submission_id} was accepted by epoch {epoch}, which no longer leads"
                self._apply(now, Reaction.RESYNC, detail)

    def _void_acceptance(self) -> bool:
        """The submission awaited was accepted by an older leader than the one followed now (which may not hold
        it: its ledger rolled back to what was committed). One still uploading is not: its outcome decides."""
        return self.awaiting is not None and self.uploading is None and self.awaiting_epoch < self.coordinator_epoch

    def upload_failed(self, now: float, submission_id: str, reaction: Reaction, detail: str = "") -> None:
        """The upload of `submission_id` ended without acceptance; `reaction` is `react(Rpc.SUBMIT, code)` of the
        last error, or DROP_UPLOAD when its retries ran out."""
        if submission_id != self.uploading:
            return
        self.uploading = None
        if self.awaiting == submission_id:
            self.awaiting = self.awaiting_round = None
        self._apply(now, reaction, detail or f"upload {submission_id}: {reaction.value}")

    def rpc_failed(self, now: float, rpc: Rpc, code: str, detail: str = "") -> Reaction:
        """A coordinator call failed with status `code`; returns the table's reaction after applying it (RETRY:
        nothing changes but the give-up clock). Uploads report their outcome with `upload_failed`."""
        reaction = react(rpc, code)
        if rpc is not Rpc.HEARTBEAT and self.failing_since is None:
            self.failing_since = now
        if rpc is Rpc.SUBMIT:
            return reaction
        if rpc is Rpc.DEREGISTER:
            return reaction  # leaving anyway: the caller retries until the drain deadline or skips the call
        if rpc is Rpc.REGISTER and reaction is Reaction.REREGISTER:
            return Reaction.RETRY
        self._apply(now, reaction, detail or f"{rpc.value}: {code}")
        return reaction

    def contact(self, now: float) -> None:
        """A coordinator call succeeded (or a broadcast arrived): the give-up clock stops."""
        self.failing_since = None

    def session_ended(self, now: float, reason: str) -> None:
        """The registration is gone (the coordinator forgot this learner, a new epoch, healthd declared it dead):
        register again. Unsent progress is void: the coordinator moved the shards or lost the ledger entries."""
        if not self.worker_id:
            return
        self.detail = reason
        self.worker_id = ""
        self._forget_work()
        if self.state is not LearnerState.DRAINING and self.state is not LearnerState.DONE:
            self.state = LearnerState.UNREGISTERED

    def stop(self, now: float) -> None:
        """Drain: hand the unsent steps back (unless the job finished), deregister, exit."""
        if self.stopping or self.state is LearnerState.DONE:
            return
        self.stopping = True
        self.drain_deadline = now + self.cfg.drain_timeout_s
        self.state = LearnerState.DRAINING

    # --- decisions --------------------------------------------------------------------------------------------
    def next_action(self, now: float) -> Action:
        """The one thing to do now (see the module docstring)."""
        if self.exit is not None:
            return self.exit
        if self.failing_since is not None and self.give_up_due(now):
            return self._done(ExitReason.GAVE_UP, f"no coordinator call succeeded for {now - self.failing_since:.1f} s")
        if self.state is LearnerState.DRAINING:
            return self._drain(now)
        if self.state is LearnerState.UNREGISTERED:
            return Register()
        if self.latest_version < 0:
            return Wait(None)
        if self.state is LearnerState.WAITING_PARAMS:  # the first version of a registration
            catch_up = self.latest_version * self.local_steps // self.fragments  # P rounds per H_m steps
            return self._load(now, Load(self.latest_version, catch_up, reset_codec=False))
        if self.state is LearnerState.RESYNCING:
            self.progress.reset()
            self._poll_at, self._poll_backoff_s = now, 0.0
            self.state = LearnerState.SHARDLESS
            self.base_version = self.latest_version
            self.next_fragment = first_fragment(self.fragment_versions)
            return Load(self.latest_version, 0, reset_codec=True)
        if self.state is LearnerState.WAITING_ROUND:
            if self.latest_version <= self.base_version:
                return Wait(None)
            self.awaiting = self.awaiting_round = None
            return self._load(now, Load(self.latest_version, 0, reset_codec=False))
        if self.latest_version > self.base_version:
            changed = self._changed_fragments()
            self.base_version = self.latest_version
            return Rebase(self.latest_version, changed)
        if self.state is LearnerState.SHARDLESS:
            if self.progress.cursors:
                self.state = LearnerState.TRAINING
            elif now >= self._poll_at:
                self._poll_backoff_s = min(
                    self.cfg.plan_poll_max_s, max(self.cfg.plan_poll_initial_s, 2 * self._poll_backoff_s)
                )
                self._poll_at = now + self._poll_backoff_s
                return FetchPlan()
            else:
                return Wait(self._poll_at)
        if self.progress.steps >= self.due_steps and self.can_submit:
            submit = self._submit(drain=False)
            if self.mode == "sync" and self.fragments == 1:  # fragments: train on while the fragment syncs
                self.state = LearnerState.WAITING_ROUND
            return submit
        if self.progress.steps >= self.due_steps and self.mode == "sync":
            # a sync round is exactly H_m steps: the next round's version can arrive before the answer to the upload
            # that closed the previous one (the coordinator broadcasts it first); wait for that answer, not train on
            return Wait(None)
        if self.progress.steps >= self.cfg.max_unsent_rounds * self.due_steps:
            return Wait(None)  # cannot submit (else it would have): the upload's outcome or a version wakes it
        if not self.progress.cursors:
            self.state = LearnerState.SHARDLESS
            self._poll_at, self._poll_backoff_s = now, 0.0
            return self.next_action(now)
        return self._train()

    def next_deadline(self) -> float | None:
        """When `next_action` may change without an event (None: only an event changes it)."""
        times: list[float] = []
        if self.state is LearnerState.SHARDLESS and self.latest_version >= 0:
            times.append(self._poll_at)
        if self.state is LearnerState.DRAINING and math.isfinite(self.drain_deadline):
            times.append(self.drain_deadline)
        if self.cfg.give_up_after_s is not None and self.failing_since is not None:
            times.append(self.failing_since + self.cfg.give_up_after_s)
        return min(times) if times else None

    def give_up_due(self, now: float) -> bool:
        """True when no coordinator call succeeded for `give_up_after_s` (never when that is None)."""
        g = self.cfg.give_up_after_s
        return g is not None and self.failing_since is not None and now - self.failing_since >= g

    @property
    def can_submit(self) -> bool:
        """No upload in flight and no accepted submission waiting for its round."""
        return self.uploading is None and self.awaiting is None

    @property
    def steps_to_submit(self) -> int:
        """Inner steps still to train before the next submission is due (0: due now or waiting to submit)."""
        return max(0, self.due_steps - self.progress.steps)

    @property
    def due_steps(self) -> int:
        """Inner steps from one submission to the next: H_m, or with fragments the schedule's gap before the next
        fragment (`diloco.core.fragments.schedule_gap`: fragment p at steps ≡ p·⌊H_m/P⌋ mod H_m)."""
        if self.fragments == 1:
            return self.local_steps
        return schedule_gap(self.next_fragment, self.fragments, self.local_steps)

    def use_fragments(self, fragments: int) -> None:
        """Streaming fragments (the coordinator's P, told at registration): submit one fragment at a time."""
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise InvalidArgument(f"fragments must be an integer >= 1, got {fragments!r}")
        self.fragments = fragments
        self.fragment_versions = (0,) * fragments
        self.next_fragment = first_fragment(self.fragment_versions)

    def _changed_fragments(self) -> tuple[int, ...] | None:
        """The fragments a rebase onto the newest version touches (None: all, P = 1): those changed after the base."""
        if self.fragments == 1:
            return None
        return tuple(p for p, v in enumerate(self.fragment_versions) if v > self.base_version)

    # --- internals --------------------------------------------------------------------------------------------
    def _train(self) -> Train:
        """The next batch, round-robin over the leased shards. Asked again before `stepped` (a caller that
        schedules the step for later, like the simulator), the same batch, while its shard is leased at that
        cursor: proposing does not move the round-robin on."""
        p = self._proposed
        if p is None or self.progress.cursors.get(p.shard_id) != (p.epoch, p.cursor):
            p = self._proposed = Train(*self.progress.next_shard())
        return p

    def _adopt(self, plan: WorkPlan) -> None:
        self.progress.adopt((lease.shard_id, lease.epoch, lease.cursor) for lease in plan.shards)
        self.local_steps = max(1, plan.local_steps)
        self.plan_seq = plan.plan_seq

    def _load(self, now: float, action: Load) -> Load:
        self.base_version = action.version
        self.next_fragment = first_fragment(self.fragment_versions)
        self.state = LearnerState.TRAINING if self.progress.cursors else LearnerState.SHARDLESS
        if self.state is LearnerState.SHARDLESS:  # the plan just came with Register or the broadcast: wait a bit
            self._poll_backoff_s = self.cfg.plan_poll_initial_s
            self._poll_at = now + self._poll_backoff_s
        return action

    def _forget_work(self) -> None:
        self.progress.reset()
        self.uploading = self.awaiting = self.awaiting_round = None

    def _submit(self, drain: bool) -> Submit:
        self._submissions += 1
        sid = f"{self.cfg.id_prefix}{self._submissions}"
        ranges, steps, tokens = self.progress.take()
        draft = SubmissionDraft(
            self.worker_id,
            self.coordinator_epoch,
            sid,
            self.base_version,
            ranges,
            steps,
            tokens,
            self.plan_seq,
            self.next_fragment,
        )
        self.next_fragment = (self.next_fragment + 1) % self.fragments
        self.uploading = self.awaiting = sid
        self.awaiting_round = None
        return Submit(draft, drain)

    def _apply(self, now: float, reaction: Reaction, detail: str) -> None:
        if reaction is Reaction.REREGISTER:
            self.session_ended(now, detail)
        elif reaction in (Reaction.RESYNC, Reaction.DROP_UPLOAD):
            self.detail = detail
            self.progress.reset()
            if self.state in _SESSION_STATES:
                self.state = LearnerState.RESYNCING

    def _drain(self, now: float) -> Action:
        if self.uploading is not None and now < self.drain_deadline:
            return Wait(self.drain_deadline)
        if (
            self.worker_id
            and not self.finished
            and not self._handed_back
            and self.uploading is None
            and self.progress.steps > 0
            and self.base_version >= 0
        ):
            self._handed_back = True
            return self._submit(drain=True)
        if self.worker_id and not self._deregistering:
            self._deregistering = True
            return Deregister(self.worker_id)
        return self._done(ExitReason.FINISHED if self.finished else ExitReason.STOPPED, "")

    def _done(self, reason: ExitReason, detail: str) -> Exit:
        self.state = LearnerState.DONE
        self.exit = Exit(reason, EXIT_CODES[reason], detail)
        return self.exit
