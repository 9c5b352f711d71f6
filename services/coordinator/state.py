"""The coordinator service's state around the pure `CoordinatorCore` and the pure upload table
(`diloco.core.uploads.Uploads`): the locks, the coordinator epoch, the broadcast shadow and the encoded broadcasts
shared by every watcher (`diloco.core.broadcast`, ALGORITHM.md section 10).

No gRPC here: the servicer turns protos into the domain types below and calls these methods; errors are
`diloco.errors` types, mapped to status codes in one place (`diloco.rpc.status`).

Control calls never wait on bulk work (ALGORITHM.md section 9). Locks, always taken in this order:
- `work` (re-entrant): the tensors (merge buffer, parameters, outer state, broadcast shadow). Held to fold a
  pseudo-gradient in, to step and encode a closed round, to hold a full snapshot of the shadow, and to copy the
  parameters for a checkpoint or an evaluation.
- `lock`: the core's bookkeeping (registry, ledger, round policy) and everything else here; held only briefly,
  never for tensor work. Status, plans, registration and throughput reports take only this lock.
- one stripe of `_stripes` per submission id: one upload's decoder (decoding a chunk holds only this).
- `_table_lock`: the upload table and the byte counters (a leaf).
A round's bookkeeping (version, ledger commits, applied ids) changes atomically under `lock` (`core.close`); its
outer step and the encoding of the new parameters follow under `work`, and watchers see the new version only once
its bytes are ready (`_publish`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from diloco import log as logging
from diloco.core.broadcast import DEFAULT_BROADCAST_CODEC, DEFAULT_HISTORY, BroadcastShadow, Delta, Snapshot
from diloco.core.codecs import EncodedMeta, Payload
from diloco.core.coordinator import (
    Accepted,
    CoordinatorCore,
    RoundApplied,
    Submission,
    SubmissionRejected,
    WorkerRecord,
    WorkPlan,
)
from diloco.core.energy import PolicyConfig, PowerSource
from diloco.core.fragments import FragmentedCoordinator, FragmentSubmission
from diloco.core.holds import Holds
from diloco.core.ledger import ShardState
from diloco.core.states import LIVE_STATES, WorkerState
from diloco.core.uploads import (
    Dropped,
    Outcome,
    Stream,
    UploadHeader,
    UploadLimits,
    UploadRefused,
    Uploads,
)
from diloco.errors import (
    AlreadyExists,
    DilocoError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NotLeader,
    ResourceExhausted,
    Unavailable,
)
from diloco.rpc.payload import IN_MEMORY, BufferPool, Spill, SpillFile, UploadReceiver
from diloco.task.factory import fingerprint_mismatch
from services.coordinator.energy import SNAPSHOT_KEY, EnergyBook, LearnerEnergy
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.placement import Joining, Placement

__all__ = [
    "Broadcast",
    "CoordinatorState",
    "Joining",
    "Published",
    "Report",
    "StatusView",
    "UploadHeader",
    "UploadStream",
    "WorkerView",
]

_APPLIED_VERSIONS = 256  # versions whose applied submission ids are remembered
_STRIPES = 64  # locks for the uploads' decoders, by submission id
_POOLED_PAYLOADS = 2  # idle upload buffers kept for reuse: at most this many of the largest payloads' bytes
_REMOVED_EVENTS = {
    WorkerState.LEFT: "worker.left",
    WorkerState.DEAD: "worker.dead",
    WorkerState.EVICTED: "worker.evicted",
}


@dataclass(frozen=True)
class Published:
    """The newest version watchers may receive."""

    version: int
    coordinator_epoch: int
    applied_ids: tuple[str, ...]
    finished: bool  # the run reached its target: this is the last version
    fragment_versions: tuple[int, ...] = ()  # streaming fragments: the version that last stepped each (() none)


@dataclass(frozen=True)
class Broadcast:
    """One broadcast message of `version`: a full snapshot of the shadow (`delta_from` None) or the delta from
    `delta_from`, encoded once and shared by every watcher. `checksum`: the shadow's at `version`."""

    version: int
    coordinator_epoch: int
    delta_from: int | None
    checksum: int
    data: Payload  # never written: every watcher sends from these bytes (or this spill file), not a copy
    meta: EncodedMeta
    applied_ids: tuple[str, ...]
    finished: bool
    fragment_versions: tuple[int, ...] = ()  # streaming fragments: each fragment's version at `version` (() none)
    delta_start: int = 0  # a delta covers meta.numel values of the flat shadow from here (fragments: their range)


@dataclass(frozen=True)
class StatusView:
    mode: str
    version: int
    coordinator_epoch: int
    paused: bool
    live_workers: int
    pending_submissions: int
    tokens_applied: int
    last_round_unix_s: float
    validation_loss: float
    validation_tokens: int  # scored by the evaluation behind `validation_loss` (0: none yet)
    bytes_received: int
    bytes_sent: int
    target_outer_steps: int
    finished: bool
    codec: str
    min_quorum: int
    rejected_submissions: int
    started_unix_s: float
    placement: str = "speed"
    placement_reason: str = ""
    paused_workers: int = 0
    watts: float = 0.0
    energy_kwh: float = 0.0
    carbon_g: float = 0.0
    cost: float = 0.0


@dataclass(frozen=True)
class Report:
    """One learner's throughput report (healthd forwards its heartbeats' figures)."""

    worker_id: str
    tokens_per_s: float
    device_kind: str = ""
    watts: float = 0.0  # 0 (with `source` None): no power figure, the last one stays
    source: PowerSource | None = None


@dataclass(frozen=True)
class WorkerView:
    record: WorkerRecord
    plan: WorkPlan | None  # None when the learner is not live
    energy: LearnerEnergy | None = None  # a copy of its power, zone, price, weight and what it used


class UploadStream:
    """One transport stream (a gRPC call or a bulk connection) feeding one upload: the transport calls `feed`
    per chunk, then exactly one of `finish` (the payload ended) or `interrupted` (the stream broke), or neither
    (a refusal ended it), and always `close` last."""

    def __init__(self, state: CoordinatorState, stream: Stream) -> None:
        self._state = state
        self._stream = stream
        self.expected_bytes = stream.expected_bytes

    def feed(self, data: bytes | memoryview) -> None:
        self._state._chunk(self._stream, data)

    def storage(self) -> memoryview | None:
        """Where this stream's bytes will be kept, from its first one (`Decoder.storage`); asked before the first
        `feed`."""
        with self._state._stripe(self._stream.upload.sub.submission_id):
            return self._state.uploads.storage(self._stream)

    def finish(self) -> Outcome:
        return self._state._finish(self._stream)

    def interrupted(self) -> None:
        self._state._broken(self._stream)

    def close(self) -> None:
        self._state._closed(self._stream)


class CoordinatorState:
    """Everything the servicer needs, thread-safe. `on_round` is called after every round's outer step, holding
    `work` but not `lock` (so it may copy the parameters; `snapshot()` is safe there), and says whether the version
    may be published (False: withhold it, the coordinator is stopping before a standby held it); `on_stepped` too,
    earlier: right after the step, before the broadcast is encoded (the round log sends the entry to standbys
    meanwhile)."""

    def __init__(
        self,
        core: CoordinatorCore,
        *,
        coordinator_epoch: int,
        fingerprint: str,
        codec: str,
        max_upload_bytes: int,
        broadcast_codec: str = DEFAULT_BROADCAST_CODEC,
        broadcast_history: int = DEFAULT_HISTORY,
        upload_ttl_s: float,
        max_partial_uploads: int,
        metrics: CoordinatorMetrics,
        max_uploads_per_worker: int = 2,
        clock: Callable[[], float] = time.time,
        on_round: Callable[[RoundApplied], bool] | None = None,
        energy: EnergyBook | None = None,
        placement: PolicyConfig | None = None,
        fragments: FragmentedCoordinator | None = None,
        spill: Spill = IN_MEMORY,
    ) -> None:
        if fragments is not None and fragments.core is not core:
            raise ValueError("fragments must wrap the state's core")
        self.core = core
        # streaming fragments (docs/fragments.md): the tensor work of accept and close goes through it; None: P = 1
        self.frag = fragments
        self.on_new_zone: Callable[[], None] | None = None  # a learner brought a zone the carbon provider never gave
        self.epoch = coordinator_epoch
        self.fingerprint = fingerprint
        self.codec = codec
        self.numel = core.params.numel()
        # uploads are held encoded (in buffers reused within a round), measured on arrival, decoded again by the merge
        self.buffers = BufferPool(max_partial_uploads, _POOLED_PAYLOADS * max_upload_bytes)
        # or, above the spill rule's size, in unlinked files (`diloco.rpc.payload.SpillFile`), as are the broadcast
        # deltas kept for late learners
        self.spill = spill
        sizes = tuple(fragments.layout.size(p) for p in range(fragments.fragments)) if fragments else ()
        self.uploads = Uploads(
            UploadLimits(
                self.numel, max_upload_bytes, upload_ttl_s, max_partial_uploads, max_uploads_per_worker, sizes
            ),
            self._receiver,
        )
        self.metrics = metrics
        metrics.idle_upload_buffer_bytes.set_function(lambda: self.buffers.idle[1])
        self.clock = clock
        self.on_round = on_round
        self.on_stepped: Callable[[RoundApplied], None] | None = None
        # with leadership (--etcd): raises NotLeader while this replica may not accept work or publish a version
        self.fence: Callable[[], None] | None = None
        # called with each accepted upload's outcome just before it is answered (fault tests: the server's
        # --fault-crash-before-answer)
        self.before_answer: Callable[[Submission, Outcome], None] | None = None
        self.log = logging.get("coordinator", epoch=coordinator_epoch)
        # learners' power, zones, prices and what they used, and the placement policy (issue #15; under `lock`)
        self.placement = Placement(energy or EnergyBook(), placement or PolicyConfig(), metrics, self.log)
        self.work = threading.RLock()
        self.lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []  # called after a new version, and on stop: wake watchers
        self.wake = threading.Condition(self.lock)  # the round deadline may have moved: wakes the poller
        self._poke = False  # an event happened since the poller last polled
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._table_lock = threading.Lock()
        self.stopping = False
        self.started_at = clock()
        self.last_round_at = 0.0
        self.validation_loss = math.nan
        self.validation_version = -1
        self.validation_tokens = 0
        self.rejected = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self._applied_by_version: dict[int, tuple[str, ...]] = {}
        self._fragments_by_version: dict[int, tuple[int, ...]] = {}  # fragments: each one's version, per version
        self._merge_s = 0.0  # under `work`: time spent checking and folding uploads since the last round closed
        self._round_seconds: dict[str, float] = {}  # under `work`: where the last round's close spent its time
        self.broadcast_codec = broadcast_codec
        self.shadow = BroadcastShadow(
            core.params, core.version, broadcast_codec, history=broadcast_history, ranged=fragments is not None
        )
        self._params_holds = Holds()  # readers of Θ outside `work` (`hold_params`: the evaluation)
        self._published = Published(core.version, self.epoch, (), core.finished, self._fragment_versions())
        self._refresh_gauges()

    # --- membership ---------------------------------------------------------------------------------------------
    def register(
        self, name: str, fingerprint: str, speed: float, device_kind: str, energy: Joining | None = None
    ) -> tuple[WorkerRecord, WorkPlan]:
        """A learner joins. An empty fingerprint means the learner adopts the task this coordinator sends (and
        compares the fingerprint of the task it builds itself); another is refused naming the parts that differ.
        `energy`: its power, zone, price and capacity (a zone the carbon trace does not name is refused before
        anything changes)."""
        mismatch = fingerprint_mismatch(fingerprint, self.fingerprint) if fingerprint else ""
        if mismatch:
            raise FailedPrecondition(mismatch)
        e = energy or Joining()
        self.check_leading()
        with self.lock:
            self.placement.book.check(e.zone)
            now = self.clock()
            rec = self.core.register(name, now, speed=speed, device_kind=device_kind)
            new_zone = self.placement.join(rec.worker_id, now, e, self.core.workers.keys())
            plan = self.core.plan(rec.worker_id)
            self._refresh_gauges()
            self._nudge_locked()
        self.log.info(
            "worker.registered",
            worker_id=rec.worker_id,
            name=name,
            tokens_per_s=speed,
            device_kind=device_kind,
            shards=[lease.shard_id for lease in plan.shards],
            local_steps=plan.local_steps,
            watts=e.watts,
            power_source=e.source.value if e.source else None,
            zone=e.zone,
            price_per_hour=e.price_per_hour,
            spot=e.spot,
        )
        if new_zone and self.on_new_zone is not None:
            self.on_new_zone()
        return rec, plan

    def worker_name(self, worker_id: str) -> str:
        """The name learner `worker_id` registered under (NOT_FOUND when unknown)."""
        with self.lock:
            return self.core.worker(worker_id).name

    def submitted_by(self, worker_id: str, submission_id: str) -> bool:
        """Whether `submission_id` is an accepted submission of learner `worker_id`: pending here, or applied here
        or at the leader this coordinator took over from (which may have registered a learner unknown here)."""
        with self.lock:
            known = self.core.accepted(submission_id)
        return known is not None and known.worker_id == worker_id

    def plan(self, worker_id: str) -> tuple[WorkPlan, int]:
        with self.lock:
            return self.core.plan(worker_id), self.core.version

    def report_throughputs(self, reports: list[Report], *, strict: bool = False) -> None:
        """Throughput (and power) reports under one lock. healthd's batch skips learners gone meanwhile
        (NOT_FOUND, FAILED_PRECONDITION); `strict` (one learner reporting for itself) raises them instead."""
        with self.lock:
            now = self.clock()
            for r in reports:
                try:
                    self.core.report_throughput(r.worker_id, r.tokens_per_s, r.device_kind, now=now)
                except (NotFound, FailedPrecondition):
                    if strict:
                        raise
                    continue
                self.placement.book.report(r.worker_id, r.watts, r.source)
            self._expire_locked()  # healthd reports again: learners it no longer hears of are gone
            self.placement.gauges([r.worker_id for r in reports if r.source is not None])

    def remove(self, worker_id: str, state: WorkerState, reason: str) -> tuple[bool, list[int]]:
        """A learner left (LEFT), died (DEAD) or was evicted (EVICTED). Returns (was live, shards released).
        A round that was only waiting for that learner closes at once (the poller closes it)."""
        with self.lock:
            rec = self.core.worker(worker_id)
            was_live = rec.state in LIVE_STATES
            released = self.core.remove(worker_id, state, reason)
            if released:
                self.metrics.reassignments.inc(len(released))
            if was_live:
                now = self.clock()
                self.placement.leave(worker_id, now)
                self._place_locked(now)
            self._refresh_gauges()
            self._nudge_locked(poll=True)
        with self._table_lock:
            self.uploads.drop_worker(worker_id)
            self._upload_gauges()
        if was_live:
            self.log.info(_REMOVED_EVENTS[state], worker_id=worker_id, reason=reason, released_shards=released)
        return was_live, released

    def report_failure(
        self, worker_id: str, reason: str, last_seen_unix_s: float, declared_dead_unix_s: float
    ) -> tuple[bool, list[int]]:
        """healthd says a learner is dead. Returns (known and live, shards released); unknown or already gone
        learners change nothing."""
        with self.lock:
            rec = self.core.workers.get(worker_id)
            if rec is None or rec.state not in LIVE_STATES:
                return False, []
        now = self.clock()
        _, released = self.remove(worker_id, WorkerState.DEAD, reason or "reported dead")
        fields: dict[str, float] = {}
        if declared_dead_unix_s > 0:
            fields["latency_s"] = round(now - declared_dead_unix_s, 4)
        if last_seen_unix_s > 0:
            fields["since_last_seen_s"] = round(now - last_seen_unix_s, 4)
        with self.lock:
            owners = {s: self.core.ledger.state(s).owner for s in released}
        self.log.info("shard.reassigned", worker_id=worker_id, shards=released, owners=owners, **fields)
        return True, released

    def drain(self, worker_id: str) -> WorkerRecord:
        """The operator's DrainWorker: the learner stays registered and its shards move at once (`core.drain`). A
        round that was only waiting for it closes at once (the poller closes it)."""
        with self.lock:
            owned = sorted(s.shard_id for s in self.core.ledger.owned_by(worker_id))
            rec = self.core.drain(worker_id)
            view = WorkerRecord(**vars(rec))
            owners = {i: self.core.ledger.state(i).owner for i in owned}
            if owned:
                self.metrics.reassignments.inc(len(owned))
            self._refresh_gauges()
            self._nudge_locked(poll=True)
        self.log.info("worker.draining", worker_id=worker_id, released_shards=owned, owners=owners)
        return view

    def release(self, worker_id: str) -> WorkerRecord:
        """Lift a quarantine (the operator's ReleaseWorker); a live learner not in quarantine is returned as it is."""
        with self.lock:
            rec = self.core.worker(worker_id)
            if rec.state not in LIVE_STATES:
                raise FailedPrecondition(
                    f"worker {worker_id} is {rec.state} ({rec.state_reason or 'no reason given'}); "
                    "it cannot be released: the learner must register again"
                )
            was = rec.state
            rec = self.core.release(worker_id)
            self._refresh_gauges()
            self._nudge_locked()
            view = WorkerRecord(**vars(rec))
        if was != view.state:
            self.log.info("worker.released", worker_id=worker_id, by="operator")
        return view

    def set_paused(self, paused: bool) -> bool:
        with self.lock:
            self.core.set_paused(paused)
            self._nudge_locked(poll=not paused)
            version = self.core.version
        self.log.info("coordinator.paused" if paused else "coordinator.resumed", version=version)
        return paused

    # --- rounds ---------------------------------------------------------------------------------------------------
    def poll(self) -> RoundApplied | None:
        """Close a round if the policy says so now."""
        with self.work:
            return self._close_round(self.clock())

    def _nudge_locked(self, poll: bool = False) -> None:
        """Under `lock`: a round's deadline may have moved: wake the poller. `poll`: the event may close a round
        at once (a learner left, training resumed): the poller polls now, whatever the deadline."""
        self._poke = self._poke or poll
        self.wake.notify_all()

    def _expire_locked(self) -> None:
        now = self.clock()
        expired = self.core.expire_unconfirmed(now)
        for worker_id, released in expired:
            self.metrics.reassignments.inc(len(released))
            self.placement.leave(worker_id, now)
            reason = self.core.workers[worker_id].state_reason
            self.log.warning("worker.dead", worker_id=worker_id, reason=reason, released_shards=released)
            self._nudge_locked(poll=True)  # a round may have waited only for it
        if expired:
            self._place_locked(now)

    # --- placement and accounting (issue #15) -----------------------------------------------------------------------
    def _place_locked(self, now: float) -> None:
        """Under `lock`: the placement policy weighs the learners again (`Placement.place`); a round may have waited
        only for a learner it paused."""
        if self.placement.place(self.core, now):
            self._nudge_locked(poll=True)

    def zones(self) -> set[str]:
        """The live learners' zones (the carbon provider asks for these)."""
        with self.lock:
            return self.placement.book.zones(self.core.live_ids())

    def set_intensity(self, zone: str, value: float) -> None:
        """The carbon provider's value for `zone` (gCO2/kWh); the next placement uses it."""
        with self.lock:
            self.placement.set_intensity(zone, value)

    def intensity_failed(self, zone: str, reason: str, detail: str) -> None:
        """A carbon provider call gave no good value for `zone` (`Placement.intensity_failed`)."""
        with self.lock:
            self.placement.intensity_failed(zone, reason, detail, self.clock())

    def _close_round(self, now: float) -> RoundApplied | None:
        """Under `work`: close a round if the policy says so (bookkeeping under `lock`), then step it and encode
        the new parameters under `work` alone, then publish them. A replica that may not lead (`fence`) closes no
        round, and one fenced between the step and the publication does not publish it (it is about to exit)."""
        if not self.leading():
            return None
        with self.lock:
            self._expire_locked()
            closed = self.core.close(now)
            if closed is not None:
                self._place_locked(now)  # measured speeds moved, and time did: the policy weighs the learners again
        if closed is None:
            return None
        started = time.perf_counter()
        # idle upload buffers go back to the system: the close is the coordinator's peak (the momentum, the merge
        # buffer and the shadow's update beside Θ), and idle buffers would sit beside it; within a round they are
        # reused as uploads come and go
        self.buffers.drop_idle()
        if self._params_holds.let_go():  # Θ is being read (evaluated): this round steps a copy, the reader keeps Θ
            self.core.params = self.core.params.clone()
        applied = self.frag.step(closed) if self.frag is not None else self.core.step(closed)
        stepped = time.perf_counter()
        if self.on_stepped is not None:
            self.on_stepped(applied)
        logged = time.perf_counter()
        span = self._stepped_span(applied.version)
        with self.lock:  # the deltas kept and the one about to be encoded fit the history's budget together
            self.shadow.forget_through(self.core.held_floor())  # no live learner needs these
            self.shadow.make_room(span)
        delta = self.shadow.advance(self.core.params, applied.version, scratch=self.core.acc.lend(), span=span)
        if delta is not None:
            delta = self._spilled(delta)
        encoded = time.perf_counter()
        self._round_seconds = {
            "merge_s": self._merge_s,  # checking and folding this round's uploads (decoding streams as they arrive)
            "step_s": stepped - started,  # the outer step
            "entry_s": logged - stepped,  # the round-log entry for standbys (its digest and checksum)
            "encode_s": encoded - logged,  # the broadcast: Θ̂ update, encoded once for every learner
        }
        self._merge_s = 0.0
        if self.on_round is not None:
            publish = self.on_round(applied)
            # the round hook: with --sync-replicas, the wait for the standbys' acks left after the encode
            self._round_seconds["hook_s"] = time.perf_counter() - encoded
            if not publish:
                self.log.warning("round.unpublished", version=applied.version, reason="withheld: no standby holds it")
                return applied
        if not self.leading():
            self.log.warning("round.unpublished", version=applied.version, reason="not the leader any more")
            return applied
        self._publish(applied, delta)
        return applied

    def _spilled(self, delta: Delta) -> Delta:
        """The version's delta with its bytes in a spill file when the spill rule says so (`--spill-above`), or as
        it is, in memory (also when the file cannot be written: a full disk must not stop a round that has already
        stepped)."""
        directory = self.spill.directory_for(delta.meta.encoded_bytes)
        if directory is None or not isinstance(delta.data, (bytes, bytearray, memoryview)):
            return delta
        try:
            return replace(delta, data=SpillFile.holding(directory, delta.data))
        except (OSError, ResourceExhausted) as e:
            self.log.warning("broadcast.spill_failed", version=delta.version, spill_dir=directory, error=str(e))
            return delta

    def _stepped_span(self, version: int) -> tuple[int, int] | None:
        """The range of the flat parameters that `version`'s broadcast delta covers: with streaming fragments, from
        the first to the last fragment the round stepped (usually one); else None (the whole model)."""
        if self.frag is None:
            return None
        stepped = self.frag.stepped_in(version)
        if not stepped:
            return None
        layout = self.frag.layout
        return layout.range(min(stepped))[0], layout.range(max(stepped))[1]

    def check_leading(self) -> None:
        """Raise NotLeader (UNAVAILABLE, naming the leader) unless this replica may accept work now."""
        if self.fence is not None:
            self.fence()

    def leading(self) -> bool:
        try:
            self.check_leading()
        except NotLeader:
            return False
        return True

    def _publish(self, applied: RoundApplied, delta: Delta | None) -> None:
        """After a round's step: its parameters go to the watchers, its outcome to the records and metrics."""
        ids = tuple(p.submission_id for p in applied.submissions)
        with self.lock:
            self.last_round_at = self.clock()
            self._applied_by_version[applied.version] = ids
            versions = self._fragment_versions()
            if versions:
                self._fragments_by_version[applied.version] = versions
            for v in [v for v in self._applied_by_version if v <= applied.version - _APPLIED_VERSIONS]:
                del self._applied_by_version[v]
                self._fragments_by_version.pop(v, None)
            self.shadow.record(delta)
            self._published = Published(applied.version, self.epoch, ids, self.core.finished, versions)
            m = self.metrics
            m.rounds.inc()
            m.pseudo_gradient_norm.set(applied.delta_norm)
            for p in applied.submissions:
                m.round_staleness.observe(applied.version - 1 - p.base_version)
            self._refresh_gauges()
            self._nudge_locked()
        self._notify_listeners()
        self.log.info(
            "round.closed",
            version=applied.version,
            submissions=len(applied.submissions),
            workers=sorted({p.worker_id for p in applied.submissions}),
            tokens=applied.tokens,
            staleness=applied.max_staleness,
            reason=applied.reason,
            **({"fragments": self.frag.stepped_in(applied.version)} if self.frag else {}),
            delta_norm=round(applied.delta_norm, 6),
            **{k: round(v, 4) for k, v in self._round_seconds.items()},
        )

    def next_deadline(self) -> float | None:
        """Under the lock: when the poller should poll next (None: only an event can close a round)."""
        if self.core.finished:
            return None
        return self.core.next_deadline()

    def run_poller(self, idle_s: float = 0.05) -> None:
        """Close rounds at their deadlines, and after events that may close one (a submission, a membership
        change, resume), until `stop()`. Sleeps on a condition in between. Run it in a thread."""
        due_unclosed = False  # the last poll was due by its deadline and closed nothing: do not spin on it
        while True:
            with self.lock:
                while not self.stopping and not self._poke:
                    deadline = self.next_deadline()
                    now = self.clock()
                    if deadline is not None and deadline <= now and not due_unclosed:
                        break
                    if deadline is None:
                        self.wake.wait()
                    else:
                        self.wake.wait(max(deadline - now, idle_s if due_unclosed else 0.0))
                        due_unclosed = False
                if self.stopping:
                    return
                self._poke = False
            try:
                applied = self.poll()
            except Exception:
                self.log.exception("round.poll_failed")
                applied = None
            due_unclosed = applied is None

    def _refresh_gauges(self) -> None:
        self.metrics.version.set(self.core.version)
        self.metrics.live_workers.set(len(self.core.live_ids()))
        self.metrics.quarantined_workers.set(
            sum(r.state == WorkerState.QUARANTINED for r in self.core.workers.values())
        )
        self.metrics.pending_submissions.set(len(self.core.policy.pending))

    def set_validation(self, version: int, loss: float, tokens: int) -> None:
        """The validation loss of `version`'s parameters, scored on `tokens` validation tokens."""
        with self.lock:
            if version >= self.validation_version:
                self.validation_version, self.validation_loss = version, loss
                self.validation_tokens = tokens
                self.metrics.validation_loss.set(loss)
        self.log.info("eval.done", version=version, val_loss=round(loss, 6), eval_tokens=tokens)

    # --- parameters -----------------------------------------------------------------------------------------------
    def hold_params(self) -> tuple[torch.Tensor, Callable[[], None]]:
        """Θ (`core.params`) as it is now, for the caller holding `work`, and the function to call (once, from any
        thread) when done reading it: until then no round writes that tensor (one closing meanwhile steps a copy,
        which becomes `core.params`), so it is read without `work` and without a copy of its own."""
        with self.work:
            return self.core.params, self._params_holds.hold()

    def published(self) -> Published:
        return self._published  # one reference, replaced whole under the lock: reading it needs no lock

    def broadcasts_since(
        self, held: int | None, held_checksum: int | None = None
    ) -> tuple[Published, list[Broadcast] | None]:
        """The newest version, and what a watcher holding version `held` (None: none; `held_checksum`: the checksum it
        named for it, if any) needs to reach it: [] nothing, the deltas held+1..newest, or None: a full snapshot
        (`snapshot_broadcast`; also when the named checksum is not the shadow's). Bookkeeping only (cheap)."""
        with self.lock:
            pub = self._published
            chain = self.shadow.updates_since(held, pub.version, held_checksum)
            if chain is None:
                return pub, None
            return pub, [self._delta_broadcast(d, pub) for d in chain]

    def _delta_broadcast(self, d: Delta, pub: Published) -> Broadcast:
        ids = self._applied_by_version.get(d.version, ())
        finished = pub.finished and d.version == pub.version
        versions = self._fragments_at(d.version)
        return Broadcast(d.version, self.epoch, d.base, d.checksum, d.data, d.meta, ids, finished, versions, d.start)

    def _fragment_versions(self) -> tuple[int, ...]:
        """Each fragment's version now (() without fragments)."""
        return tuple(self.frag.fragment_versions) if self.frag is not None else ()

    def _fragments_at(self, version: int) -> tuple[int, ...]:
        """Under `lock`: each fragment's version as of `version` (published, or a delta still kept)."""
        if self.frag is None:
            return ()
        return self._fragments_by_version.get(version) or self._published.fragment_versions

    def snapshot_broadcast(self) -> tuple[Broadcast, Callable[[], None]]:
        """The shadow of the newest version in full, and the function to call once it is sent. With a shadow: a
        view of `Θ̂` itself (no copy), held until released (a round closing meanwhile writes the next `Θ̂` into a new
        tensor: `BroadcastShadow.hold`), taken under `work` (it waits behind a round or an upload being folded in);
        fp32 snapshots: the bytes made with the version."""
        if self.shadow.shadowed:
            with self.work:
                snap, release = self.shadow.hold()  # Θ̂ moves only under `work`, and `record` follows `advance` in it
                with self.lock:
                    return self._snapshot_locked(snap), release
        with self.lock:
            snap, release = self.shadow.hold()
            return self._snapshot_locked(snap), release

    def _snapshot_locked(self, snap: Snapshot) -> Broadcast:
        ids = self._applied_by_version.get(snap.version, ())
        finished = self._published.finished and self._published.version == snap.version
        versions = self._fragments_at(snap.version)
        return Broadcast(snap.version, self.epoch, None, snap.checksum, snap.data, snap.meta, ids, finished, versions)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` is called (from the thread that published) after every new version and when stopping; it
        must not block (the servicer's wakes its watchers on the event loop)."""
        with self.lock:
            self._listeners.append(listener)

    def _notify_listeners(self) -> None:
        with self.lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def count_sent(self, nbytes: int) -> None:
        with self._table_lock:
            self.bytes_sent += nbytes
        self.metrics.download_bytes.inc(nbytes)

    # --- submissions ----------------------------------------------------------------------------------------------
    def open_upload(self, h: UploadHeader) -> Outcome | UploadStream:
        """A stream starts with header `h`, checked before any payload byte is read. Returns the outcome of an
        earlier identical submission (idempotent), or the stream to feed.

        A submission this coordinator holds is answered with its outcome whatever coordinator epoch it names: one
        applied at the leader this coordinator took over from (a learner resending after a failover, the first
        answer lost) gets "applied in round v", as it would have there, and is never applied again. A submission
        not held that names another epoch is refused (its learner registers again) unless this coordinator took
        its learner over from the previous leader (`CoordinatorCore.adopted`: a promoted standby holds the learner
        table); the ledger then checks its shards, epochs and cursors as for any submission."""
        sub = h.sub
        self.check_leading()
        try:
            self._check_fragment(h)
        except InvalidArgument as e:
            raise self.reject(e, "bad_fragment") from None
        with self.lock:
            known = self.core.accepted(sub.submission_id)
            version = self.core.version
            if known is None:
                if h.coordinator_epoch != self.epoch and sub.worker_id not in self.core.adopted:
                    raise self.reject(
                        FailedPrecondition(
                            f"coordinator restarted (epoch {self.epoch}, the submission names "
                            f"{h.coordinator_epoch}); register again"
                        ),
                        "stale_coordinator_epoch",
                    )
                if self.core.finished:
                    raise self.reject(
                        FailedPrecondition(
                            f"training finished at version {version} (target_outer_steps); stop training"
                        ),
                        "finished",
                    )
                try:
                    self.core.admit(sub)
                except DilocoError as e:
                    raise self.reject(e, e.code.lower()) from None
        refused: UploadRefused | None = None
        with self._stripe(sub.submission_id), self._table_lock:
            try:
                opened = self.uploads.open(h, self.clock(), known, version)
            except UploadRefused as e:
                refused = e
            self._upload_gauges()
        if refused is not None:  # counted and logged outside the table lock, which `reject` takes
            self._log_dropped(refused.dropped)
            raise self.reject(refused.error, refused.reason) from None
        if isinstance(opened, Outcome):
            self._log_duplicate(h, opened)
            return opened
        self._log_dropped(opened.dropped)
        return UploadStream(self, opened.stream)

    def _check_fragment(self, h: UploadHeader) -> None:
        """The header's fragment and layout against this run's (`FragmentLayout.check_index`/`check_fingerprint`,
        the one place); without fragments both must be unset."""
        if self.frag is None:
            if h.fragment or h.layout:
                raise InvalidArgument(
                    f"this coordinator runs without fragments (--fragments 1), the submission names fragment "
                    f"{h.fragment} of layout {h.layout!r}: register again and submit the whole model"
                )
            return
        self.frag.layout.check_index(h.fragment)
        self.frag.layout.check_fingerprint(h.layout)

    def _receiver(self, h: UploadHeader) -> UploadReceiver:
        """The decoder of a new upload: measured on arrival against the merge segments of what it is of."""
        spill_dir = self.spill.directory_for(h.meta.encoded_bytes)
        if self.frag is None:
            return UploadReceiver(h.meta, self.numel, self.core.acc.segments, self.buffers, spill_dir)
        p = h.fragment
        return UploadReceiver(h.meta, self.frag.layout.size(p), self.frag.segments_of(p), self.buffers, spill_dir)

    def _log_duplicate(self, h: UploadHeader, outcome: Outcome) -> None:
        self.log.info(
            "submission.duplicate",
            worker_id=h.sub.worker_id,
            submission_id=h.sub.submission_id,
            applied=outcome.applied,
            round=outcome.round,
            staleness=outcome.staleness,
            version=outcome.version,
            named_epoch=h.coordinator_epoch,  # another than this coordinator's: it was accepted before a takeover
        )

    def _stripe(self, submission_id: str) -> threading.Lock:
        return self._stripes[hash(submission_id) % _STRIPES]

    def _chunk(self, stream: Stream, data: bytes | memoryview) -> None:
        """Decode one chunk into the upload's buffer (holding only that upload's stripe)."""
        with self._stripe(stream.upload.sub.submission_id):
            try:
                self.uploads.chunk(stream, data, self.clock())
            except UploadRefused as e:
                raise self.reject(e.error, e.reason) from None
        with self._table_lock:
            self.bytes_received += len(data)
        self.metrics.upload_bytes.inc(len(data))

    def _broken(self, stream: Stream) -> None:
        up = self.uploads.broken(stream)
        self.log.info(
            "upload.interrupted",
            worker_id=up.sub.worker_id,
            submission_id=up.sub.submission_id,
            received_bytes=up.received,
            total_bytes=up.meta.encoded_bytes,
        )

    def _closed(self, stream: Stream) -> None:
        with self._table_lock:
            self.uploads.closed(stream)
            self._upload_gauges()

    def _finish(self, stream: Stream) -> Outcome:
        """The stream ended: verify the payload and fold it into the round (tensor work under `work` only)."""
        with self._stripe(stream.upload.sub.submission_id):
            try:
                done = self.uploads.end(stream)
            except UploadRefused as e:
                raise self.reject(e.error, e.reason) from None
        sub, payload = done.sub, done.payload
        frag = self.frag
        fs = FragmentSubmission(sub, done.fragment, frag.layout.fingerprint) if frag is not None else None
        merge_started = time.perf_counter()
        try:  # reads only the payload
            per_step = frag.check(fs, payload) if frag is not None and fs else self.core.measure(sub, payload)
        except DilocoError as e:
            raise self.reject(e, e.code.lower()) from None
        with self.work:
            now = self.clock()
            self.check_leading()  # last thing before the submission changes the round
            with self.lock:
                try:
                    if frag is not None and fs is not None:
                        taken = frag.take(fs, per_step, now)
                    else:
                        taken = self.core.take(sub, per_step, now)
                except AlreadyExists:  # a concurrent stream of the same submission won
                    known = self.core.accepted(sub.submission_id)
                    if known is None:
                        raise
                    with self._table_lock:
                        return self.uploads.earlier(sub, known, self.core.version)
                except SubmissionRejected as e:
                    self._guard_rejected(e, sub)
                    raise
                except DilocoError as e:
                    raise self.reject(e, e.code.lower()) from None
                seconds = self.core.workers[sub.worker_id].speed_samples[-1][1]  # this submission's work
                self.placement.work(sub.worker_id, seconds, now)
                with self._table_lock:
                    self.uploads.accepted(sub, done.meta.encoded_bytes)
                self.metrics.submission_tokens.observe(sub.tokens)
                self.metrics.upload_seconds.observe(max(0.0, now - done.started_at))
                self._refresh_gauges()
                self._nudge_locked()
            if frag is not None:
                frag.fold(done.fragment, payload, sub.tokens)
            else:
                self.core.fold(payload, sub.tokens)
            self._merge_s += time.perf_counter() - merge_started
            self.log.info(
                "submission.accepted",
                worker_id=sub.worker_id,
                submission_id=sub.submission_id,
                base_version=sub.base_version,
                staleness=taken.staleness,
                tokens=sub.tokens,
                **({"fragment": done.fragment} if self.frag else {}),
                codec=done.meta.codec,
                bytes=done.meta.encoded_bytes,
            )
            if taken.released:
                self.log.info("worker.released", worker_id=sub.worker_id, by="clean_submission")
            del payload, done  # the encoded bytes go (back to the pool) before a round closes
            applied = self._close_round(now)
        if applied is not None and self._published.version < applied.version:
            # stepped, never published (fenced, or withheld while stopping): a standby may not hold it, so the
            # learner must not count on it; it resends to the leader, which answers it or takes it as new
            raise Unavailable(
                f"round {applied.version} was not published (this coordinator stopped leading); resend the submission"
            )
        with self.lock:
            version = self.core.version
        outcome = Outcome(applied is not None, version, taken.staleness, applied.version if applied else taken.round)
        if self.before_answer is not None:
            self.before_answer(sub, outcome)
        return outcome

    def upload_status(self, worker_id: str, submission_id: str) -> tuple[int, bool]:
        """(bytes held, complete) of an upload; (0, False) for one the coordinator does not hold. An accepted
        submission of `worker_id` is complete even when this coordinator does not know the learner (it registered
        with the leader this one took over from); otherwise an unknown learner is NOT_FOUND."""
        with self.lock:
            known: Accepted | None = self.core.accepted(submission_id)
            if known is None or known.worker_id != worker_id:
                self.core.worker(worker_id)
        with self._table_lock:
            expired = self.uploads.tick(self.clock())
            held = self.uploads.status(worker_id, submission_id, known, self.clock())
            self._upload_gauges()
        self._log_dropped(expired)
        return held

    def _upload_gauges(self) -> None:
        """Under `_table_lock`, after the table changed."""
        held, streaming = self.uploads.counts()
        self.metrics.partial_uploads.set(held)
        self.metrics.streaming_uploads.set(streaming)

    def _log_dropped(self, dropped: tuple[Dropped, ...] | list[Dropped]) -> None:
        for d in dropped:
            if d.why != "expired":
                self.metrics.uploads_evicted.inc()
            self.log.info(
                "upload.expired" if d.why == "expired" else "upload.evicted",
                worker_id=d.worker_id,
                submission_id=d.submission_id,
                scope=d.why,
                received_bytes=d.received,
            )

    def _guard_rejected(self, e: SubmissionRejected, sub: Submission) -> None:
        """Under `lock`: count and log a submission the guard refused (its learner is now quarantined)."""
        v = e.verdict
        ratio = round(v.ratio, 3) if math.isfinite(v.ratio) else None  # no reference yet, or non-finite
        self._count_rejected(v.reason)
        fields: dict[str, Any] = {"worker_id": sub.worker_id, "norm_ratio": ratio, "norm_per_step": v.norm}
        fields["median"] = v.median if math.isfinite(v.median) else None  # JSON has no NaN
        fields["ceiling"] = v.ceiling if math.isfinite(v.ceiling) else None
        self.log.warning(
            "submission.rejected", reason=v.reason, submission_id=sub.submission_id, tokens=sub.tokens, **fields
        )
        if e.newly_quarantined:
            self.metrics.quarantines.inc()
            self.log.warning("worker.quarantined", reason=v.reason, **fields)
        if e.moved_shards:
            self.metrics.reassignments.inc(len(e.moved_shards))
            owners = {s: self.core.ledger.state(s).owner for s in e.moved_shards}
            self.log.warning("shard.reassigned", worker_id=sub.worker_id, shards=e.moved_shards, owners=owners)
        self._refresh_gauges()
        self._nudge_locked()

    def reject(self, err: DilocoError, reason: str) -> DilocoError:
        """Count and log a refused submission. After the run's last round every submission is refused
        ("finished"): those are counted by the metric's reason label only, not in the status figure."""
        self._count_rejected(reason)
        self.log.info("submission.rejected", reason=reason, error=str(err))
        return err

    def _count_rejected(self, reason: str) -> None:
        if reason != "finished":
            with self._table_lock:
                self.rejected += 1
        self.metrics.rejected.labels(reason=reason).inc()

    # --- operator views -------------------------------------------------------------------------------------------
    def status(self, mode: str) -> StatusView:
        c = self.core
        with self.lock:
            use = self.placement.usage(c.live_ids(), self.clock())  # costs up to now
            return StatusView(
                mode=mode,
                version=c.version,
                coordinator_epoch=self.epoch,
                paused=c.paused,
                live_workers=len(c.live_ids()),
                pending_submissions=len(c.policy.pending),
                tokens_applied=c.tokens_applied,
                last_round_unix_s=self.last_round_at,
                validation_loss=self.validation_loss,
                validation_tokens=self.validation_tokens,
                bytes_received=self.bytes_received,
                bytes_sent=self.bytes_sent,
                target_outer_steps=c.cfg.target_outer_steps,
                finished=c.finished,
                codec=self.codec,
                min_quorum=c.cfg.rounds.min_quorum,
                rejected_submissions=self.rejected,
                started_unix_s=self.started_at,
                placement=self.placement.policy.policy.value,
                placement_reason=self.placement.reason,
                paused_workers=use.paused_workers,
                watts=use.watts,
                energy_kwh=use.energy_kwh,
                carbon_g=use.carbon_g,
                cost=use.cost,
            )

    def workers(self) -> list[WorkerView]:
        with self.lock:
            now = self.clock()
            self.placement.accrue(now)  # costs up to now
            return [
                WorkerView(
                    WorkerRecord(**vars(rec)),
                    self.core.plan(rec.worker_id) if rec.state in LIVE_STATES else None,
                    self.placement.book.view(rec.worker_id, now),
                )
                for rec in sorted(self.core.workers.values(), key=lambda r: r.registered_at)
            ]

    def ledger(self) -> tuple[list[ShardState], int, int]:
        """The shards' ledger, the version and the tokens applied, read together (a round closing between two
        reads would make the committed cursors and the applied tokens disagree)."""
        with self.lock:
            return self.core.ledger.states(), self.core.version, self.core.tokens_applied

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of the applied state, for the caller holding `work` (no round steps meanwhile, so the
        tensors match the version): the bookkeeping taken under `lock`, the tensors the core's own, not copied
        (a model-sized copy of Θ and of the outer state each, at the peak, otherwise). Serialise it before
        releasing `work` (`checkpoint.save(..., hold=state.work)`). It carries the fleet's energy, carbon and cost
        totals, costs charged up to now (`services.coordinator.energy.Totals`)."""
        with self.work, self.lock:
            totals = self.placement.totals(self.clock())  # costs charged up to now
            snap = self.frag.snapshot() if self.frag is not None else self.core.snapshot()
            return {**snap, SNAPSHOT_KEY: totals.to_snapshot()}

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.wake.notify_all()
        self._notify_listeners()
