"""The `diloco.v1.Coordinator` servicer (`grpc.aio`): decode the request, call `CoordinatorState`, encode the reply.

Control calls run on the event loop (they take only the state's short bookkeeping lock); upload work (opening,
decoding chunks, finishing) and checkpoints run on a bounded executor, so control calls keep answering while
pseudo-gradients arrive. A parameter watch is a coroutine waiting on `LoopSignal`; it sends a watcher what it needs
from the version it holds (`CoordinatorState.broadcasts_since`: the deltas since, or a full snapshot). Every watcher
sends from the same encoded bytes, held once: a delta's are the broadcast history's, a lossy snapshot's are `Θ̂`'s own
(held while sent, `CoordinatorState.snapshot_broadcast`), an fp32 one's are made once per version; each data message
is made as it is sent.

Domain errors (`diloco.errors`) become status codes in `diloco.rpc.status`; nothing here decides policy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

import grpc

from diloco.core.coordinator import Submission, WorkerRecord, WorkPlan
from diloco.core.leadership import Handover
from diloco.core.ledger import ShardRange
from diloco.core.states import WorkerState
from diloco.core.uploads import Outcome, UploadHeader
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument, PermissionDenied
from diloco.rpc import auth, status
from diloco.rpc.limits import MAX_ID_CHARS, check_request
from diloco.rpc.payload import (
    CHUNK_BYTES,
    check_layout,
    chunks,
    meta_from_proto,
    meta_to_proto,
)
from diloco.rpc.server import LoopSignal, SendSlots
from diloco.rpc.vocab import CODECS, MODES, WORKER_STATES, power_from_proto, power_to_proto
from diloco.task.factory import TaskConfig
from diloco.task.params import ParamSpec
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.energy import J_PER_KWH, LearnerEnergy
from services.coordinator.replication import HaView
from services.coordinator.state import Broadcast, CoordinatorState, Joining, Published, Report, UploadStream

T = TypeVar("T")
# Parameter-watch writes in progress at once (`SendSlots`): enough to keep a fast network busy, few enough that a
# control call waits behind at most this many writes; a write the network holds up longer than the lease (a slow
# peer) frees its slot.
SEND_SLOTS = 32
SEND_SLOT_LEASE_S = 0.05
Context = grpc.aio.ServicerContext[Any, Any]


def plan_to_proto(plan: WorkPlan) -> common_pb2.WorkPlan:
    return common_pb2.WorkPlan(
        shards=[common_pb2.ShardAssignment(shard_id=s.shard_id, epoch=s.epoch, cursor=s.cursor) for s in plan.shards],
        local_steps=plan.local_steps,
        assigned_at_version=plan.version,
        plan_seq=plan.plan_seq,
    )


def _require_id(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(f"{field} is required")
    if len(value) > MAX_ID_CHARS or not value.isprintable():
        raise InvalidArgument(f"{field} must be at most {MAX_ID_CHARS} printable characters")
    return value


def ha_to_proto(v: HaView) -> coordinator_pb2.HaStatus:
    return coordinator_pb2.HaStatus(
        replica_id=v.replica_id,
        leader_id=v.leader_id,
        leader_address=v.leader_address,
        leader_epoch=v.epoch,
        is_leader=v.is_leader,
        sync_replicas=v.sync_replicas,
        log_version=v.log_version,
        log_oldest_version=v.log.oldest if v.log is not None else 0,
        log_entries=v.log.entries if v.log is not None else 0,
        log_bytes=v.log.bytes if v.log is not None else 0,
        log_max_bytes=(v.log.max_bytes or 0) if v.log is not None else 0,
        holding_version=v.held[0] if v.held is not None else 0,
        held_s=v.held[1] if v.held is not None else 0.0,
        replicas=[
            coordinator_pb2.ReplicaStatus(
                replica_id=r.replica_id, acked_version=r.acked, lag_versions=r.lag, lagging=r.lagging
            )
            for r in v.replicas
        ],
    )


def header_from_proto(h: coordinator_pb2.SubmissionHeader, specs: list[ParamSpec]) -> UploadHeader:
    """Validate and decode a `SubmissionHeader` (shape only; the state checks it against the run)."""
    worker_id = _require_id(h.worker_id, "header.worker_id")
    submission_id = _require_id(h.submission_id, "header.submission_id")
    if h.resume_offset < 0:
        raise InvalidArgument(f"header.resume_offset must be >= 0, got {h.resume_offset}")
    if not h.HasField("payload"):
        raise InvalidArgument("header.payload (PayloadSpec) is required")
    meta = meta_from_proto(h.payload)
    check_layout(h.payload, specs)
    ranges = tuple(ShardRange(r.shard_id, r.epoch, r.start, r.end) for r in h.ranges)
    sub = Submission(worker_id, submission_id, h.base_version, h.tokens, h.steps, ranges, h.plan_seq)
    return UploadHeader(sub, h.coordinator_epoch, meta, h.resume_offset, h.fragment, h.fragment_layout)


def _report(worker_id: str, tp: common_pb2.Throughput) -> Report:
    watts, source = power_from_proto(tp)
    return Report(worker_id, tp.tokens_per_s, tp.device_kind, watts, source)


def worker_to_proto(
    rec: WorkerRecord, plan: WorkPlan | None, energy: LearnerEnergy | None = None
) -> coordinator_pb2.WorkerInfo:
    e = energy or LearnerEnergy()
    return coordinator_pb2.WorkerInfo(
        worker_id=rec.worker_id,
        worker_name=rec.name,
        state=WORKER_STATES.to_proto(rec.state),
        throughput=common_pb2.Throughput(
            tokens_per_s=rec.speed,
            device_kind=rec.device_kind,
            watts=e.watts,
            power_source=power_to_proto(e.source),
        ),
        local_steps=plan.local_steps if plan else 0,
        shards=plan_to_proto(plan).shards if plan else [],
        submissions=rec.submissions,
        tokens=rec.tokens,
        last_base_version=rec.last_base_version,
        last_submit_unix_s=rec.last_submit_at,
        registered_unix_s=rec.registered_at,
        state_reason=rec.state_reason,
        measured_tokens_per_s=rec.measured_speed,
        zone=e.zone,
        price_per_hour=e.price_per_hour,
        spot=e.spot,
        placement_weight=e.weight,
        carbon_intensity=e.intensity,
        energy_kwh=e.joules / J_PER_KWH,
        carbon_g=e.grams,
        cost=e.cost,
    )


def open_submission(
    state: CoordinatorState,
    first: coordinator_pb2.SubmitPseudoGradientRequest | None,
    specs: list[ParamSpec],
    identity: str | None,
) -> coordinator_pb2.SubmitPseudoGradientResponse | UploadStream:
    """The start of an upload on either path (this RPC or the bulk port): check its header message and the
    client's certificate `identity` (`auth.act_as`), then open (or resume) the upload. Returns the earlier outcome
    of a duplicate, else the stream to feed (`UploadStream`: feed, then finish or interrupted, then close)."""
    try:
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("an upload starts with a message holding its header (SubmissionHeader)")
        check_request(first)  # the gRPC path checked it already; the bulk path did not
        header = header_from_proto(first.header, specs)
    except DilocoError as e:
        raise state.reject(e, "bad_header") from None
    if identity is not None:
        try:
            auth.act_as(identity, learner_name(state, header.sub.worker_id, header.sub.submission_id))
        except PermissionDenied as e:
            raise state.reject(e, "identity") from None
    opened = state.open_upload(header)
    if isinstance(opened, Outcome):
        return submit_response(opened, state.epoch)
    return opened


def learner_name(state: CoordinatorState, worker_id: str, submission_id: str = "") -> str:
    """The learner name a call about `worker_id` acts as (`auth.act_as`): its registered name (NOT_FOUND when this
    coordinator does not know it), or, for a call about one of its accepted submissions, the name in its id (the
    learner may have registered with the leader this coordinator took over from)."""
    if submission_id and state.submitted_by(worker_id, submission_id):
        return auth.worker_name_of(worker_id)
    return state.worker_name(worker_id)


def submit_response(r: Outcome, epoch: int) -> coordinator_pb2.SubmitPseudoGradientResponse:
    """The reply to an upload (or a duplicate of one) taken by the coordinator of `epoch`."""
    return coordinator_pb2.SubmitPseudoGradientResponse(
        outcome=coordinator_pb2.SUBMISSION_OUTCOME_APPLIED
        if r.applied
        else coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED,
        version=r.version,
        staleness=r.staleness,
        round=r.round,
        coordinator_epoch=epoch,
    )


def _release_unsent(job: asyncio.Future[tuple[Broadcast, Callable[[], None]]]) -> None:
    """Lets go of a snapshot taken for a watch that ended meanwhile."""
    if not job.cancelled() and job.exception() is None:
        job.result()[1]()


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin gRPC layer over `CoordinatorState`. `checkpoint` writes a checkpoint now and returns its path
    and version (None when checkpoints are off); `work`: the executor for upload decoding and checkpoints; `ha`:
    leadership and the standbys' lag for GetStatus (None: nothing to show); `step_down`: hands leadership to a
    standby, blocking (None: not under etcd leadership)."""

    def __init__(
        self,
        state: CoordinatorState,
        *,
        task: TaskConfig,
        specs: list[ParamSpec],
        mode: str,
        healthd_address: str,
        checkpoint: Callable[[], tuple[Path, int] | None],
        work: Executor,
        chunk_bytes: int = CHUNK_BYTES,
        ha: Callable[[], HaView | None] = lambda: None,
        step_down: Callable[[str], Handover] | None = None,
        init_seed: int = 0,
    ) -> None:
        self.state = state
        self.init_seed = init_seed  # version 0 is the task's model built with it (when not resumed)
        self.ha = ha
        self.step_down = step_down
        self.specs = specs
        self.mode = mode
        self.healthd_address = healthd_address
        self.task_json = task.to_json()
        self.checkpoint = checkpoint
        self.work = work
        self.chunk_bytes = chunk_bytes
        self.bulk_port = 0  # set once the bulk upload server listens; 0: learners upload over gRPC
        self.params_changed = LoopSignal()
        state.add_listener(self.params_changed.notify)
        self._send = SendSlots(SEND_SLOTS, SEND_SLOT_LEASE_S)

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.work, fn, *args)

    # --- learners -------------------------------------------------------------------------------------------------
    @status.unary
    async def Register(
        self, request: coordinator_pb2.RegisterRequest, context: Context
    ) -> coordinator_pb2.RegisterResponse:
        auth.act_as(auth.peer_identity(context), request.worker_name)
        tp = request.throughput
        watts, source = power_from_proto(tp)
        energy = Joining(watts, source, request.zone, request.price_per_hour, request.spot)
        rec, plan = self.state.register(
            request.worker_name, request.model_fingerprint, tp.tokens_per_s, tp.device_kind, energy
        )
        return coordinator_pb2.RegisterResponse(
            worker_id=rec.worker_id,
            coordinator_epoch=self.state.epoch,
            version=plan.version,
            plan=plan_to_proto(plan),
            mode=MODES.to_proto(self.mode),
            codec=CODECS.to_proto(self.state.codec),
            healthd_address=self.healthd_address,
            task_json=self.task_json,
            bulk_port=self.bulk_port,
            task_fingerprint=self.state.fingerprint,
            init_seed=self.init_seed,
            **self._fragment_layout(),
        )

    def _fragment_layout(self) -> dict[str, Any]:
        """RegisterResponse's streaming-fragment fields (none without fragments)."""
        frag = self.state.frag
        if frag is None:
            return {}
        layout = frag.layout
        return {"fragments": layout.fragments, "fragment_bounds": layout.bounds, "fragment_layout": layout.fingerprint}

    @status.streaming
    async def WatchParameters(
        self, request: coordinator_pb2.WatchParametersRequest, context: Context
    ) -> AsyncIterator[coordinator_pb2.ParametersChunk]:
        worker_id = request.worker_id
        if worker_id:
            self._act_as(context, worker_id)
            self.state.plan(worker_id)  # NOT_FOUND / FAILED_PRECONDITION before anything is sent
        # 0 (unless named with its checksum), or a version newer than ours (we restarted from an older checkpoint): a
        # full snapshot of the current one
        current = self.state.published().version
        named: int | None = request.held_checksum if request.HasField("held_checksum") else None
        after = request.after_version
        held: int | None = after if (after > 0 or named is not None) and after <= current else None
        while not self.state.stopping:
            changed = self.params_changed.waiter()  # before reading: a version published after this wakes it
            newest, chain = self.state.broadcasts_since(held, named)
            if chain == [] and named is not None:  # it holds the current version, checksum and all: say so
                async with self._send.slot():
                    yield coordinator_pb2.ParametersChunk(header=self._held_header(newest, named, worker_id))
            named = None  # checked once: what follows is sent from the version it now holds
            if chain == []:
                if not request.follow:
                    return
                await changed.wait()
                await self._send.turn()  # a new version wakes every watcher at once: they go on a few at a time
                continue
            if chain is None:  # a full snapshot: a view of Θ̂, held (kept as it is) while it is sent
                snap, release = await self._held_snapshot()
                try:
                    async for msg in self._messages(snap, worker_id):
                        yield msg
                finally:
                    release()
                held = snap.version
                del snap  # not kept while waiting: a round closing during the send left these bytes to the holders
            else:
                for d in chain:
                    async for msg in self._messages(d, worker_id):
                        yield msg
                    held = d.version
            if not request.follow:
                return

    async def _held_snapshot(self) -> tuple[Broadcast, Callable[[], None]]:
        """`CoordinatorState.snapshot_broadcast` off the event loop; a watch cancelled while it is taken lets go of
        the hold once it is (else the next round would copy Θ̂ for nobody)."""
        job = asyncio.ensure_future(self._blocking(self.state.snapshot_broadcast))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(_release_unsent)
            raise

    async def _messages(self, b: Broadcast, worker_id: str) -> AsyncIterator[coordinator_pb2.ParametersChunk]:
        """One broadcast's messages: its header (with `worker_id`'s plan), then its bytes in chunks."""
        async with self._send.slot():  # the header is built in the slot too: it is the loop's work
            first = coordinator_pb2.ParametersChunk(header=self._header(b))
            self._to_learner(first.header, worker_id)
            yield first
        for part in chunks(b.data, chunk_bytes=self.chunk_bytes):
            async with self._send.slot():
                yield coordinator_pb2.ParametersChunk(data=bytes(part))  # a copy of one chunk, while sent
            self.state.count_sent(len(part))

    def _held_header(self, pub: Published, checksum: int, worker_id: str) -> coordinator_pb2.ParametersHeader:
        """The header that tells a watcher it holds the current version `pub` (checksum `checksum`): no payload."""
        header = coordinator_pb2.ParametersHeader(
            version=pub.version,
            coordinator_epoch=pub.coordinator_epoch,
            applied_submission_ids=list(pub.applied_ids),
            finished=pub.finished,
            params_checksum=checksum,
            held=True,
            fragment_versions=pub.fragment_versions,
        )
        self._to_learner(header, worker_id)
        return header

    def _to_learner(self, header: coordinator_pb2.ParametersHeader, worker_id: str) -> None:
        """What a header says to the learner `worker_id` watching ("": an observer, nothing): its plan, and this
        coordinator's bulk port (a learner taken over uploads there from then on)."""
        if worker_id:
            header.plan.CopyFrom(plan_to_proto(self.state.plan(worker_id)[0]))
            header.bulk_port = self.bulk_port

    def _header(self, b: Broadcast) -> coordinator_pb2.ParametersHeader:
        """The header of a delta or snapshot, without a plan."""
        header = coordinator_pb2.ParametersHeader(
            version=b.version,
            coordinator_epoch=b.coordinator_epoch,
            payload=meta_to_proto(b.meta, self.specs),
            applied_submission_ids=list(b.applied_ids),
            finished=b.finished,
            params_checksum=b.checksum,
            fragment_versions=b.fragment_versions,
        )
        if b.delta_from is not None:
            header.delta_from = b.delta_from
            header.delta_start = b.delta_start
        return header

    def _act_as(self, context: Context, worker_id: str, submission_id: str = "") -> str:
        """Check that the caller's certificate may act as learner `worker_id` (see `auth.act_as`; `learner_name`
        for a call about its submission `submission_id`); returns it."""
        identity = auth.peer_identity(context)
        if identity is not None:
            auth.act_as(identity, learner_name(self.state, worker_id, submission_id))
        return worker_id

    @status.unary
    async def SubmitPseudoGradient(
        self, request_iterator: AsyncIterator[coordinator_pb2.SubmitPseudoGradientRequest], context: Context
    ) -> coordinator_pb2.SubmitPseudoGradientResponse:
        first = await anext(aiter(request_iterator), None)
        opened = await self._blocking(open_submission, self.state, first, self.specs, auth.peer_identity(context))
        if isinstance(opened, coordinator_pb2.SubmitPseudoGradientResponse):
            return opened  # a duplicate: the earlier outcome, nothing changes
        feeding: asyncio.Future[None] | None = None
        try:
            try:
                async for msg in request_iterator:  # the next chunk arrives while this one decodes
                    if msg.WhichOneof("kind") != "data":
                        raise InvalidArgument("an upload has one header; every following message must be data")
                    if feeding is not None:
                        await feeding
                    feeding = asyncio.ensure_future(self._blocking(opened.feed, msg.data))
                if feeding is not None:
                    await feeding
            except (grpc.RpcError, asyncio.CancelledError):  # the client went away: keep what we hold for a resume
                await _settle(feeding)
                opened.interrupted()
                raise
            return submit_response(await self._blocking(opened.finish), self.state.epoch)
        except BaseException:
            await _settle(feeding)
            raise
        finally:
            opened.close()

    @status.unary
    async def GetUploadStatus(
        self, request: coordinator_pb2.GetUploadStatusRequest, context: Context
    ) -> coordinator_pb2.GetUploadStatusResponse:
        sid = _require_id(request.submission_id, "submission_id")
        worker_id = self._act_as(context, _require_id(request.worker_id, "worker_id"), sid)
        held, complete = self.state.upload_status(worker_id, sid)
        return coordinator_pb2.GetUploadStatusResponse(received_bytes=held, complete=complete)

    @status.unary
    async def GetWorkPlan(
        self, request: coordinator_pb2.GetWorkPlanRequest, context: Context
    ) -> coordinator_pb2.GetWorkPlanResponse:
        plan, version = self.state.plan(self._act_as(context, _require_id(request.worker_id, "worker_id")))
        return coordinator_pb2.GetWorkPlanResponse(plan=plan_to_proto(plan), version=version)

    @status.unary
    async def Deregister(
        self, request: coordinator_pb2.DeregisterRequest, context: Context
    ) -> coordinator_pb2.DeregisterResponse:
        worker_id = self._act_as(context, _require_id(request.worker_id, "worker_id"))
        self.state.remove(worker_id, WorkerState.LEFT, request.reason or "left")
        return coordinator_pb2.DeregisterResponse()

    @status.unary
    async def ReportNodeFailure(
        self, request: coordinator_pb2.ReportNodeFailureRequest, context: Context
    ) -> coordinator_pb2.ReportNodeFailureResponse:
        known, released = self.state.report_failure(
            _require_id(request.worker_id, "worker_id"),
            request.reason,
            request.last_seen_unix_s,
            request.declared_dead_unix_s,
        )
        return coordinator_pb2.ReportNodeFailureResponse(reassigned_shards=released, known=known)

    @status.unary
    async def ReportThroughput(
        self, request: coordinator_pb2.ReportThroughputRequest, context: Context
    ) -> coordinator_pb2.ReportThroughputResponse:
        single = None
        if request.worker_id or not request.reports:  # one learner's report: an unknown learner is NOT_FOUND
            single = _report(_require_id(request.worker_id, "worker_id"), request.throughput)
        # healthd's batch: learners that are gone meanwhile are skipped; every report is decoded before any applies
        batch = [_report(_require_id(r.worker_id, "reports.worker_id"), r.throughput) for r in request.reports]
        if single is not None:
            self.state.report_throughputs([single], strict=True)
        if batch:
            self.state.report_throughputs(batch)
        return coordinator_pb2.ReportThroughputResponse()

    # --- operators ------------------------------------------------------------------------------------------------
    @status.unary
    async def GetStatus(
        self, request: coordinator_pb2.GetStatusRequest, context: Context
    ) -> coordinator_pb2.GetStatusResponse:
        s = self.state.status(self.mode)
        ha = self.ha()
        return coordinator_pb2.GetStatusResponse(
            ha=ha_to_proto(ha) if ha is not None else None,
            mode=MODES.to_proto(s.mode),
            version=s.version,
            coordinator_epoch=s.coordinator_epoch,
            paused=s.paused,
            live_workers=s.live_workers,
            pending_submissions=s.pending_submissions,
            tokens_applied=s.tokens_applied,
            last_round_unix_s=s.last_round_unix_s,
            validation_loss=s.validation_loss,
            validation_tokens=s.validation_tokens,
            bytes_received=s.bytes_received,
            bytes_sent=s.bytes_sent,
            target_outer_steps=s.target_outer_steps,
            finished=s.finished,
            codec=s.codec,
            min_quorum=s.min_quorum,
            rejected_submissions=s.rejected_submissions,
            started_unix_s=s.started_unix_s,
            placement=s.placement,
            placement_reason=s.placement_reason,
            paused_workers=s.paused_workers,
            watts=s.watts,
            energy_kwh=s.energy_kwh,
            carbon_g=s.carbon_g,
            cost=s.cost,
        )

    @status.unary
    async def ListWorkers(
        self, request: coordinator_pb2.ListWorkersRequest, context: Context
    ) -> coordinator_pb2.ListWorkersResponse:
        return coordinator_pb2.ListWorkersResponse(
            workers=[worker_to_proto(w.record, w.plan, w.energy) for w in self.state.workers()]
        )

    @status.unary
    async def GetLedger(
        self, request: coordinator_pb2.GetLedgerRequest, context: Context
    ) -> coordinator_pb2.GetLedgerResponse:
        shards, version, tokens_applied = self.state.ledger()
        return coordinator_pb2.GetLedgerResponse(
            shards=[
                coordinator_pb2.ShardLedgerEntry(
                    shard_id=s.shard_id,
                    owner=s.owner or "",
                    epoch=s.epoch,
                    committed=s.committed,
                    accepted=s.accepted,
                    length=s.length,
                    committed_ranges=[
                        common_pb2.ShardRange(shard_id=r.shard_id, epoch=r.epoch, start=r.start, end=r.end)
                        for r in s.committed_ranges
                    ],
                )
                for s in shards
            ],
            version=version,
            tokens_applied=tokens_applied,
        )

    @status.unary
    async def Checkpoint(
        self, request: coordinator_pb2.CheckpointRequest, context: Context
    ) -> coordinator_pb2.CheckpointResponse:
        written = await self._blocking(self.checkpoint)
        if written is None:
            raise FailedPrecondition("checkpoints are off; start the coordinator with --checkpoint-dir")
        path, version = written
        return coordinator_pb2.CheckpointResponse(path=str(path), version=version)

    @status.unary
    async def DrainWorker(
        self, request: coordinator_pb2.DrainWorkerRequest, context: Context
    ) -> coordinator_pb2.DrainWorkerResponse:
        rec = self.state.drain(_require_id(request.worker_id, "worker_id"))
        return coordinator_pb2.DrainWorkerResponse(state=WORKER_STATES.to_proto(rec.state))

    @status.unary
    async def EvictWorker(
        self, request: coordinator_pb2.EvictWorkerRequest, context: Context
    ) -> coordinator_pb2.EvictWorkerResponse:
        worker_id = _require_id(request.worker_id, "worker_id")
        _, released = self.state.remove(worker_id, WorkerState.EVICTED, request.reason or "evicted by operator")
        return coordinator_pb2.EvictWorkerResponse(reassigned_shards=released)

    @status.unary
    async def ReleaseWorker(
        self, request: coordinator_pb2.ReleaseWorkerRequest, context: Context
    ) -> coordinator_pb2.ReleaseWorkerResponse:
        rec = self.state.release(_require_id(request.worker_id, "worker_id"))
        return coordinator_pb2.ReleaseWorkerResponse(state=WORKER_STATES.to_proto(rec.state))

    @status.unary
    async def StepDown(
        self, request: coordinator_pb2.StepDownRequest, context: Context
    ) -> coordinator_pb2.StepDownResponse:
        self.state.check_leading()  # a replica that may not lead now: UNAVAILABLE naming the leader
        if self.step_down is None:
            raise FailedPrecondition(
                "this coordinator does not run under etcd leadership (--etcd): there is no leadership to hand over; "
                "stop it with SIGTERM (it writes a final checkpoint) and start the next one on its --checkpoint-dir"
            )
        done = await asyncio.to_thread(self.step_down, request.reason or "asked by an operator")
        new = done.successor
        return coordinator_pb2.StepDownResponse(
            version=done.version,
            held_by=list(done.held_by),
            leader_id=new.replica_id if new else "",
            leader_address=new.address if new else "",
            leader_epoch=new.epoch if new else 0,
        )

    @status.unary
    async def Pause(self, request: coordinator_pb2.PauseRequest, context: Context) -> coordinator_pb2.PauseResponse:
        return coordinator_pb2.PauseResponse(paused=self.state.set_paused(True))

    @status.unary
    async def Resume(self, request: coordinator_pb2.ResumeRequest, context: Context) -> coordinator_pb2.ResumeResponse:
        return coordinator_pb2.ResumeResponse(paused=self.state.set_paused(False))


async def _settle(pending: asyncio.Future[None] | None) -> None:
    """Wait for a chunk still decoding (the decoder must be idle before the upload is interrupted or closed);
    its own error, if any, is not the one to report."""
    if pending is not None:
        with contextlib.suppress(BaseException):
            await asyncio.shield(pending)
