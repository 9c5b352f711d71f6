"""The coordinator service's state around the pure `CoordinatorCore`: one lock, the coordinator epoch, the
encoded parameters shared by every watcher, partial (resumable) uploads and the idempotency records.

No gRPC here: the servicer turns protos into the domain types below and calls these methods; errors are
`diloco.errors` types, mapped to status codes in one place (`diloco.rpc.status`).

Locks, always taken in this order: `lock` (the core and everything else here) -> `Upload.lock` (one upload's
decoder) -> `_uploads_lock` (the upload table, a leaf). Decoding a chunk holds only its upload's lock, so
uploads proceed in parallel and never block control calls.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco import log as logging
from diloco.core.codecs import CodecError, EncodedMeta
from diloco.core.coordinator import (
    DEAD,
    EVICTED,
    LEFT,
    LIVE_STATES,
    QUARANTINED,
    CoordinatorCore,
    RoundApplied,
    Submission,
    SubmissionRejected,
    WorkerRecord,
    WorkPlan,
)
from diloco.core.ledger import ShardState
from diloco.errors import (
    AlreadyExists,
    DilocoError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from diloco.rpc.payload import BufferPool, PayloadReceiver, encode_params
from services.coordinator.metrics import CoordinatorMetrics

_DONE_RECORDS = 8192  # idempotency records of accepted submissions
_APPLIED_VERSIONS = 256  # versions whose applied submission ids are remembered


@dataclass(frozen=True)
class UploadHeader:
    """A decoded `SubmissionHeader`."""

    sub: Submission
    coordinator_epoch: int
    meta: EncodedMeta
    resume_offset: int


@dataclass(frozen=True)
class SubmitResult:
    applied: bool  # merged into the global parameters (else pending)
    version: int  # newest global version at the time of the reply
    staleness: int
    round: int  # the version the submission produces (or produced)


@dataclass
class Upload:
    """An upload in progress: its header and the decoder holding the bytes received so far."""

    sub: Submission
    meta: EncodedMeta
    receiver: PayloadReceiver
    started_at: float
    touched_at: float
    gen: int = 0  # bumped by every stream that takes the upload over; older streams stop
    streams: int = 0  # streams feeding it now (under `_uploads_lock`); 0: held only for a resume
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def received(self) -> int:
        return self.receiver.received


@dataclass
class _Done:
    worker_id: str
    staleness: int
    round: int
    encoded_bytes: int


@dataclass(frozen=True)
class ParamsSnapshot:
    """One version of the global parameters, encoded once (fp32) and shared by every watcher."""

    version: int
    coordinator_epoch: int
    data: bytes
    meta: EncodedMeta
    applied_ids: tuple[str, ...]
    finished: bool  # the run reached its target: this is the last version


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
    bytes_received: int
    bytes_sent: int
    target_outer_steps: int
    finished: bool
    codec: str
    min_quorum: int
    rejected_submissions: int
    started_unix_s: float


@dataclass(frozen=True)
class WorkerView:
    record: WorkerRecord
    plan: WorkPlan | None  # None when the learner is not live


class CoordinatorState:
    """Everything the servicer needs, thread-safe. `on_round` is called (under the lock) after every round."""

    def __init__(
        self,
        core: CoordinatorCore,
        *,
        coordinator_epoch: int,
        fingerprint: str,
        codec: str,
        max_upload_bytes: int,
        upload_ttl_s: float,
        max_partial_uploads: int,
        metrics: CoordinatorMetrics,
        max_uploads_per_worker: int = 2,
        clock: Callable[[], float] = time.time,
        on_round: Callable[[RoundApplied], None] | None = None,
    ) -> None:
        self.core = core
        self.epoch = coordinator_epoch
        self.fingerprint = fingerprint
        self.codec = codec
        self.numel = core.params.numel()
        self.max_upload_bytes = max_upload_bytes
        self.upload_ttl_s = upload_ttl_s
        self.max_partial_uploads = max_partial_uploads
        self.max_uploads_per_worker = max_uploads_per_worker
        self._buffers = BufferPool(self.numel, size=2)  # decode buffers, reused across uploads
        self.metrics = metrics
        self.clock = clock
        self.on_round = on_round
        self.log = logging.get("coordinator", epoch=coordinator_epoch)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a new version, or stopping: wakes watchers
        self.wake = threading.Condition(self.lock)  # the round deadline may have moved: wakes the poller
        self.stopping = False
        self.started_at = clock()
        self.last_round_at = 0.0
        self.validation_loss = math.nan
        self.validation_version = -1
        self.rejected = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self._uploads: OrderedDict[str, Upload] = OrderedDict()
        self._uploads_lock = threading.Lock()
        self._done: OrderedDict[str, _Done] = OrderedDict()
        self._applied_by_version: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._params: ParamsSnapshot | None = None
        self._refresh_gauges()

    # --- membership ---------------------------------------------------------------------------------------------
    def register(self, name: str, fingerprint: str, speed: float, device_kind: str) -> tuple[WorkerRecord, WorkPlan]:
        """A learner joins. An empty fingerprint means the learner adopts the task this coordinator sends."""
        if fingerprint and fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"model fingerprint {fingerprint!r} differs from the coordinator's {self.fingerprint!r}: the learner "
                "trains another model; start it with the coordinator's task (task_json) or leave the fingerprint empty"
            )
        with self.lock:
            rec = self.core.register(name, self.clock(), speed=speed, device_kind=device_kind)
            plan = self.core.plan(rec.worker_id)
            self._refresh_gauges()
            self.wake.notify_all()
        self.log.info(
            "worker.registered",
            worker_id=rec.worker_id,
            name=name,
            tokens_per_s=speed,
            device_kind=device_kind,
            shards=[lease.shard_id for lease in plan.shards],
            local_steps=plan.local_steps,
        )
        return rec, plan

    def worker_name(self, worker_id: str) -> str:
        """The name learner `worker_id` registered under (NOT_FOUND when unknown)."""
        with self.lock:
            return self.core.worker(worker_id).name

    def plan(self, worker_id: str) -> tuple[WorkPlan, int]:
        with self.lock:
            return self.core.plan(worker_id), self.core.version

    def report_throughput(self, worker_id: str, tokens_per_s: float, device_kind: str) -> None:
        with self.lock:
            self.core.report_throughput(worker_id, tokens_per_s, device_kind, now=self.clock())
            self._expire_locked()  # healthd reports again: learners it no longer hears of are gone

    def remove(self, worker_id: str, state: str, reason: str) -> tuple[bool, list[int]]:
        """A learner left (LEFT), died (DEAD) or was evicted (EVICTED). Returns (was live, shards released).
        A round that was only waiting for that learner closes at once."""
        with self.lock:
            rec = self.core.worker(worker_id)
            was_live = rec.state in LIVE_STATES
            released = self.core.remove(worker_id, state, reason)
            if released:
                self.metrics.reassignments.inc(len(released))
            self._poll_locked()
            self._refresh_gauges()
            self.wake.notify_all()
        self._drop_uploads_of(worker_id)
        if was_live:
            event = {LEFT: "worker.left", DEAD: "worker.dead", EVICTED: "worker.evicted"}.get(state, "worker.removed")
            self.log.info(event, worker_id=worker_id, reason=reason, released_shards=released)
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
        _, released = self.remove(worker_id, DEAD, reason or "reported dead")
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
        with self.lock:
            rec = self.core.drain(worker_id)
        self.log.info("worker.draining", worker_id=worker_id)
        return rec

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
            self.wake.notify_all()
            view = WorkerRecord(**vars(rec))
        if was != view.state:
            self.log.info("worker.released", worker_id=worker_id, by="operator")
        return view

    def set_paused(self, paused: bool) -> bool:
        with self.lock:
            self.core.set_paused(paused)
            if not paused:
                self._poll_locked()
            self.wake.notify_all()
        self.log.info("coordinator.paused" if paused else "coordinator.resumed", version=self.core.version)
        return paused

    # --- rounds ---------------------------------------------------------------------------------------------------
    def poll(self) -> RoundApplied | None:
        """Close a round if the policy says so now."""
        with self.lock:
            return self._poll_locked()

    def _expire_locked(self) -> None:
        for worker_id, released in self.core.expire_unconfirmed(self.clock()):
            self.metrics.reassignments.inc(len(released))
            reason = self.core.workers[worker_id].state_reason
            self.log.warning("worker.dead", worker_id=worker_id, reason=reason, released_shards=released)
            self.wake.notify_all()

    def _poll_locked(self) -> RoundApplied | None:
        self._expire_locked()
        applied = self.core.poll(self.clock())
        if applied is not None:
            self._round_applied(applied)
        return applied

    def _round_applied(self, applied: RoundApplied) -> None:
        """Under the lock, after every applied round."""
        self.last_round_at = self.clock()
        ids = tuple(p.submission_id for p in applied.submissions)
        self._applied_by_version[applied.version] = ids
        while len(self._applied_by_version) > _APPLIED_VERSIONS:
            self._applied_by_version.popitem(last=False)
        m = self.metrics
        m.rounds.inc()
        m.pseudo_gradient_norm.set(applied.delta_norm)
        for p in applied.submissions:
            done = self._done.get(p.submission_id)
            if done is not None:
                done.round = applied.version
            m.round_staleness.observe(applied.version - 1 - p.base_version)
        self._refresh_gauges()
        self.log.info(
            "round.closed",
            version=applied.version,
            submissions=len(applied.submissions),
            workers=sorted({p.worker_id for p in applied.submissions}),
            tokens=applied.tokens,
            staleness=applied.max_staleness,
            reason=applied.reason,
            delta_norm=round(applied.delta_norm, 6),
        )
        self.changed.notify_all()
        if self.on_round is not None:
            self.on_round(applied)

    def next_deadline(self) -> float | None:
        """Under the lock: when the poller should poll next (None: only an event can close a round)."""
        if self.core.finished:
            return None
        return self.core.next_deadline()

    def run_poller(self, idle_s: float = 0.05) -> None:
        """Close rounds at their deadlines until `stop()`: sleeps on a condition until the next deadline or
        until an event (a submission, a membership change, resume) moves it. Run it in a thread."""
        with self.lock:
            while not self.stopping:
                deadline = self.next_deadline()
                if deadline is None:
                    self.wake.wait()
                    continue
                delay = deadline - self.clock()
                if delay > 0:
                    self.wake.wait(delay)
                    continue
                try:
                    applied = self._poll_locked()
                except Exception:
                    self.log.exception("round.poll_failed")
                    applied = None
                if applied is None:  # the policy did not close after all: do not spin
                    self.wake.wait(idle_s)

    def _refresh_gauges(self) -> None:
        self.metrics.version.set(self.core.version)
        self.metrics.live_workers.set(len(self.core.live_ids()))
        self.metrics.quarantined_workers.set(sum(r.state == QUARANTINED for r in self.core.workers.values()))
        self.metrics.pending_submissions.set(len(self.core.policy.pending))

    def set_validation(self, version: int, loss: float, tokens: int) -> None:
        """The validation loss of `version`'s parameters, scored on `tokens` validation tokens."""
        with self.lock:
            if version >= self.validation_version:
                self.validation_version, self.validation_loss = version, loss
                self.metrics.validation_loss.set(loss)
        self.log.info("eval.done", version=version, val_loss=round(loss, 6), eval_tokens=tokens)

    # --- parameters -----------------------------------------------------------------------------------------------
    def _snapshot_locked(self) -> ParamsSnapshot:
        v = self.core.version
        if self._params is None or self._params.version != v:
            data, meta = encode_params(self.core.params)
            self._params = ParamsSnapshot(
                v, self.epoch, data, meta, self._applied_by_version.get(v, ()), self.core.finished
            )
        return self._params

    def params_snapshot(self) -> ParamsSnapshot:
        with self.lock:
            return self._snapshot_locked()

    def wait_params(self, after: int | None, timeout_s: float) -> ParamsSnapshot | None:
        """The current parameters if their version is newer than `after` (None: any version), waiting up to
        `timeout_s` for one; None on timeout or when stopping."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while not self.stopping:
                if after is None or self.core.version > after:
                    return self._snapshot_locked()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)
            return None

    def wake_watchers(self) -> None:
        with self.lock:
            self.changed.notify_all()

    def count_sent(self, nbytes: int) -> None:
        with self._uploads_lock:
            self.bytes_sent += nbytes
        self.metrics.download_bytes.inc(nbytes)

    # --- submissions ----------------------------------------------------------------------------------------------
    def open_upload(self, h: UploadHeader) -> SubmitResult | tuple[Upload, int]:
        """Check a submission's header before any payload byte is read. Returns the outcome of an earlier
        identical submission (idempotent), or the upload to feed and this stream's generation."""
        now = self.clock()
        sub = h.sub
        with self.lock:
            self._expire_uploads(now)
            if h.coordinator_epoch != self.epoch:
                raise self.reject(
                    FailedPrecondition(
                        f"coordinator restarted (epoch {self.epoch}, the submission names {h.coordinator_epoch}); "
                        "register again"
                    ),
                    "stale_coordinator_epoch",
                )
            done = self._duplicate_locked(sub)
            if done is not None:
                return done
            if self.core.finished:
                raise self.reject(
                    FailedPrecondition(
                        f"training finished at version {self.core.version} (target_outer_steps); stop training"
                    ),
                    "finished",
                )
            try:
                self.core.admit(sub)
            except DilocoError as e:
                raise self.reject(e, e.code.lower()) from None
            try:
                h.meta.validate(expected_numel=self.numel)
            except CodecError as e:
                raise self.reject(e, "bad_payload_spec") from None
            if h.meta.encoded_bytes > self.max_upload_bytes:
                raise self.reject(
                    ResourceExhausted(
                        f"payload of {h.meta.encoded_bytes} bytes exceeds the limit of {self.max_upload_bytes} "
                        "bytes; send it with a more compact codec (e.g. int8)"
                    ),
                    "too_large",
                )
            with self._uploads_lock:
                up = self._uploads.get(sub.submission_id)
            if up is not None and (up.sub != sub or up.meta != h.meta) and h.resume_offset != 0:
                raise self.reject(
                    FailedPrecondition(
                        f"submission {sub.submission_id} was started with another header; "
                        "resume with the same header or restart it from offset 0"
                    ),
                    "resume_mismatch",
                )
            if h.resume_offset == 0:
                old = up
                if old is None:
                    self._make_room(sub.worker_id)  # before the decoder takes a buffer
                up = Upload(sub, h.meta, PayloadReceiver(h.meta, self.numel, out=self._buffers.take()), now, now)
                if old is not None:
                    with old.lock:
                        old.gen += 1  # a stream still feeding it stops
            else:
                held = up.received if up is not None else 0
                if up is None or held != h.resume_offset:
                    raise self.reject(
                        FailedPrecondition(
                            f"upload {sub.submission_id}: the coordinator holds {held} bytes, not "
                            f"{h.resume_offset}; resume from offset {held}"
                        ),
                        "resume_offset",
                    )
            with up.lock:
                up.gen += 1
                gen = up.gen
                up.touched_at = now
            with self._uploads_lock:
                up.streams += 1
                self._uploads[sub.submission_id] = up
                self._uploads.move_to_end(sub.submission_id)
            return up, gen

    def _make_room(self, worker_id: str) -> None:
        """Under `lock`, before a new upload's buffer is allocated. Bounds the buffers held: at most
        `max_uploads_per_worker` per learner and `max_partial_uploads` in all, counting interrupted uploads kept
        for a resume. Those idle ones are evicted oldest first to make room; when the uploads in the way are all
        streaming, the new one is refused (RESOURCE_EXHAUSTED)."""
        refused: tuple[ResourceExhausted, str] | None = None
        with self._uploads_lock:
            mine = [s for s, u in self._uploads.items() if u.sub.worker_id == worker_id]
            limits = (
                (mine, self.max_uploads_per_worker, f"concurrent uploads per worker ({worker_id})", "per_worker"),
                (list(self._uploads), self.max_partial_uploads, "concurrent uploads in all", "total"),
            )
            for held, limit, what, scope in limits:
                idle = [s for s in held if s in self._uploads and self._uploads[s].streams == 0]  # oldest first
                while len(held) >= limit and idle:
                    sid = idle.pop(0)
                    held.remove(sid)
                    self._evict(sid, scope)
                held[:] = [s for s in held if s in self._uploads]
                if len(held) >= limit:
                    message = (
                        f"too many uploads in flight: the limit is {limit} {what}; "
                        "finish or resume the uploads in flight first, then retry"
                    )
                    refused = (ResourceExhausted(message), f"too_many_uploads_{scope}")
                    break
        if refused is not None:  # counted and logged outside `_uploads_lock`, which `reject` takes
            raise self.reject(*refused)

    def _evict(self, sid: str, scope: str) -> None:
        """Under `_uploads_lock`: drop an idle partial upload (its learner restarts it from offset 0)."""
        up = self._uploads.pop(sid)
        self.metrics.uploads_evicted.inc()
        self.log.info(
            "upload.evicted", worker_id=up.sub.worker_id, submission_id=sid, scope=scope, received_bytes=up.received
        )

    def end_stream(self, up: Upload) -> None:
        """A stream of `up` ended (finished, failed or broke): it no longer counts as streaming."""
        with self._uploads_lock:
            up.streams = max(0, up.streams - 1)

    def feed(self, up: Upload, gen: int, data: bytes | memoryview) -> None:
        """Decode one chunk into the upload's buffer (without the core lock)."""
        with up.lock:
            self._check_gen(up, gen)
            try:
                up.receiver.feed(data)
            except CodecError as e:
                up.gen += 1
                self._forget_upload(up)
                raise self.reject(e, "bad_payload") from None
            up.touched_at = self.clock()
        with self._uploads_lock:
            self.bytes_received += len(data)
        self.metrics.upload_bytes.inc(len(data))

    def finish_upload(self, up: Upload, gen: int) -> SubmitResult:
        """The stream ended: verify the payload and fold it into the round."""
        with up.lock:
            self._check_gen(up, gen)
            held, total = up.received, up.meta.encoded_bytes
            if held < total:
                raise self.reject(
                    InvalidArgument(
                        f"payload truncated: got {held} of {total} bytes; resume from offset {held} "
                        "(GetUploadStatus tells the bytes held)"
                    ),
                    "truncated",
                )
            try:
                delta = up.receiver.finish()
            except CodecError as e:
                up.gen += 1
                self._forget_upload(up)
                raise self.reject(e, "bad_payload") from None
            up.gen += 1  # complete: no other stream may feed it
        self._forget_upload(up)
        now = self.clock()
        with self.lock:
            try:
                result = self.core.accept(up.sub, delta, now)  # folds delta into the merge sum; keeps no reference
            except AlreadyExists:  # a concurrent stream of the same submission won
                done = self._duplicate_locked(up.sub)
                if done is None:
                    raise
                return done
            except SubmissionRejected as e:
                self._guard_rejected(e, up.sub)
                raise
            except DilocoError as e:
                raise self.reject(e, e.code.lower()) from None
            finally:
                self._buffers.give(delta)
            self._done[up.sub.submission_id] = _Done(
                up.sub.worker_id, result.staleness, result.round, up.meta.encoded_bytes
            )
            while len(self._done) > _DONE_RECORDS:
                self._done.popitem(last=False)
            self.metrics.submission_tokens.observe(up.sub.tokens)
            self.metrics.upload_seconds.observe(max(0.0, now - up.started_at))
            self.log.info(
                "submission.accepted",
                worker_id=up.sub.worker_id,
                submission_id=up.sub.submission_id,
                base_version=up.sub.base_version,
                staleness=result.staleness,
                tokens=up.sub.tokens,
                codec=up.meta.codec,
                bytes=up.meta.encoded_bytes,
            )
            if result.released:
                self.log.info("worker.released", worker_id=up.sub.worker_id, by="clean_submission")
            if result.applied is not None:
                self._round_applied(result.applied)
            else:
                self._refresh_gauges()
            self.wake.notify_all()
            return SubmitResult(result.applied is not None, self.core.version, result.staleness, result.round)

    def interrupted(self, up: Upload) -> None:
        """The stream broke mid-upload: the bytes held stay for a resume (until `upload_ttl_s` passes)."""
        self.log.info(
            "upload.interrupted",
            worker_id=up.sub.worker_id,
            submission_id=up.sub.submission_id,
            received_bytes=up.received,
            total_bytes=up.meta.encoded_bytes,
        )

    def upload_status(self, worker_id: str, submission_id: str) -> tuple[int, bool]:
        """(bytes held, complete) of an upload; (0, False) for one the coordinator does not hold."""
        with self.lock:
            self.core.worker(worker_id)
            sid = submission_id
            if sid in self.core.receipts or sid in self.core.applied_ids:
                done = self._done.get(sid)
                return (done.encoded_bytes if done else 0), True
            self._expire_uploads(self.clock())
            with self._uploads_lock:
                up = self._uploads.get(sid)
            if up is None or up.sub.worker_id != worker_id:
                return 0, False
            return up.received, False

    def _duplicate_locked(self, sub: Submission) -> SubmitResult | None:
        sid = sub.submission_id
        pending = sid in self.core.receipts
        if not pending and sid not in self.core.applied_ids:
            return None
        done = self._done.get(sid)
        if done is not None and done.worker_id != sub.worker_id:
            raise AlreadyExists(f"submission id {sid!r} was used by another learner; make submission ids unique")
        version = self.core.version
        staleness = done.staleness if done else max(0, version - sub.base_version)
        round_ = done.round if done else (version + 1 if pending else version)
        return SubmitResult(not pending, version, staleness, round_)

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
        self.wake.notify_all()

    def _check_gen(self, up: Upload, gen: int) -> None:
        if up.gen != gen:
            raise FailedPrecondition(
                f"upload {up.sub.submission_id} was taken over by a newer stream; "
                "only the newest stream of a submission may send data"
            )

    def reject(self, err: DilocoError, reason: str) -> DilocoError:
        """Count and log a refused submission. After the run's last round every submission is refused
        ("finished"): those are counted by the metric's reason label only, not in the status figure."""
        self._count_rejected(reason)
        self.log.info("submission.rejected", reason=reason, error=str(err))
        return err

    def _count_rejected(self, reason: str) -> None:
        if reason != "finished":
            with self._uploads_lock:
                self.rejected += 1
        self.metrics.rejected.labels(reason=reason).inc()

    def _forget_upload(self, up: Upload) -> None:
        with self._uploads_lock:
            if self._uploads.get(up.sub.submission_id) is up:
                del self._uploads[up.sub.submission_id]

    def _drop_uploads_of(self, worker_id: str) -> None:
        with self._uploads_lock:
            for sid in [s for s, u in self._uploads.items() if u.sub.worker_id == worker_id]:
                del self._uploads[sid]

    def _expire_uploads(self, now: float) -> None:
        with self._uploads_lock:
            for sid in [s for s, u in self._uploads.items() if now - u.touched_at > self.upload_ttl_s]:
                del self._uploads[sid]

    def partial_uploads(self) -> int:
        with self._uploads_lock:
            return len(self._uploads)

    # --- operator views -------------------------------------------------------------------------------------------
    def status(self, mode: str) -> StatusView:
        c = self.core
        with self.lock:
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
                bytes_received=self.bytes_received,
                bytes_sent=self.bytes_sent,
                target_outer_steps=c.cfg.target_outer_steps,
                finished=c.finished,
                codec=self.codec,
                min_quorum=c.cfg.rounds.min_quorum,
                rejected_submissions=self.rejected,
                started_unix_s=self.started_at,
            )

    def workers(self) -> list[WorkerView]:
        with self.lock:
            return [
                WorkerView(
                    WorkerRecord(**vars(rec)),
                    self.core.plan(rec.worker_id) if rec.state in LIVE_STATES else None,
                )
                for rec in sorted(self.core.workers.values(), key=lambda r: r.registered_at)
            ]

    def ledger(self) -> tuple[list[ShardState], int]:
        with self.lock:
            return self.core.ledger.states(), self.core.version

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint of the applied state (taken under the lock; write it without)."""
        with self.lock:
            return self.core.snapshot()

    def eval_params(self) -> tuple[int, torch.Tensor]:
        with self.lock:
            return self.core.version, self.core.params.detach().clone()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.changed.notify_all()
            self.wake.notify_all()
