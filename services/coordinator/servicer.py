"""The `diloco.v1.Coordinator` servicer: decode the request, call `CoordinatorState`, encode the reply.

Domain errors (`diloco.errors`) become status codes in `diloco.rpc.status`; nothing here decides policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from diloco.core.coordinator import Submission, WorkerRecord, WorkPlan
from diloco.core.ledger import ShardRange
from diloco.core.states import WorkerState
from diloco.core.uploads import Outcome, UploadHeader
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument, PermissionDenied
from diloco.rpc import auth, status
from diloco.rpc.payload import (
    CHUNK_BYTES,
    check_layout,
    chunks,
    meta_from_proto,
    meta_to_proto,
    prefetch,
)
from diloco.rpc.vocab import CODECS, MODES, WORKER_STATES
from diloco.task.factory import TaskConfig
from diloco.task.params import ParamSpec
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.state import CoordinatorState, ParamsSnapshot, UploadStream

WATCH_RECHECK_S = 1.0  # a follow watcher rechecks that its client is still there at least this often
_MAX_ID = 256


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
    if len(value) > _MAX_ID or not value.isprintable():
        raise InvalidArgument(f"{field} must be at most {_MAX_ID} printable characters")
    return value


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
    return UploadHeader(sub, h.coordinator_epoch, meta, h.resume_offset)


def worker_to_proto(rec: WorkerRecord, plan: WorkPlan | None) -> coordinator_pb2.WorkerInfo:
    return coordinator_pb2.WorkerInfo(
        worker_id=rec.worker_id,
        worker_name=rec.name,
        state=WORKER_STATES.to_proto(rec.state),
        throughput=common_pb2.Throughput(tokens_per_s=rec.speed, device_kind=rec.device_kind),
        local_steps=plan.local_steps if plan else 0,
        shards=plan_to_proto(plan).shards if plan else [],
        submissions=rec.submissions,
        tokens=rec.tokens,
        last_base_version=rec.last_base_version,
        last_submit_unix_s=rec.last_submit_at,
        registered_unix_s=rec.registered_at,
        state_reason=rec.state_reason,
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
        header = header_from_proto(first.header, specs)
    except DilocoError as e:
        raise state.reject(e, "bad_header") from None
    if identity is not None:
        try:
            auth.act_as(identity, state.worker_name(header.sub.worker_id))
        except PermissionDenied as e:
            raise state.reject(e, "identity") from None
    opened = state.open_upload(header)
    if isinstance(opened, Outcome):
        return submit_response(opened)
    return opened


def submit_response(r: Outcome) -> coordinator_pb2.SubmitPseudoGradientResponse:
    return coordinator_pb2.SubmitPseudoGradientResponse(
        outcome=coordinator_pb2.SUBMISSION_OUTCOME_APPLIED
        if r.applied
        else coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED,
        version=r.version,
        staleness=r.staleness,
        round=r.round,
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin gRPC layer over `CoordinatorState`. `checkpoint` writes a checkpoint now and returns its path
    and version (None when checkpoints are off)."""

    def __init__(
        self,
        state: CoordinatorState,
        *,
        task: TaskConfig,
        specs: list[ParamSpec],
        mode: str,
        healthd_address: str,
        checkpoint: Callable[[], tuple[Path, int] | None],
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.state = state
        self.specs = specs
        self.mode = mode
        self.healthd_address = healthd_address
        self.task_json = task.to_json()
        self.checkpoint = checkpoint
        self.chunk_bytes = chunk_bytes
        self.bulk_port = 0  # set once the bulk upload server listens; 0: learners upload over gRPC

    # --- learners -------------------------------------------------------------------------------------------------
    @status.unary
    def Register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        auth.act_as(auth.peer_identity(context), request.worker_name)
        tp = request.throughput
        rec, plan = self.state.register(request.worker_name, request.model_fingerprint, tp.tokens_per_s, tp.device_kind)
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
        )

    @status.streaming
    def WatchParameters(
        self, request: coordinator_pb2.WatchParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.ParametersChunk]:
        worker_id = request.worker_id
        if worker_id:
            self._act_as(context, worker_id)
            self.state.plan(worker_id)  # NOT_FOUND / FAILED_PRECONDITION before anything is sent
        context.add_callback(self.state.wake_watchers)
        # 0, or a version newer than ours (we restarted from an older checkpoint): send the current one
        current = self.state.params_snapshot().version
        after: int | None = request.after_version if 0 < request.after_version <= current else None
        while context.is_active() and not self.state.stopping:
            snap = self.state.wait_params(after, WATCH_RECHECK_S if request.follow else 0.0)
            if snap is None:
                if not request.follow:
                    return
                continue
            yield coordinator_pb2.ParametersChunk(header=self._params_header(snap, worker_id))
            for chunk in chunks(snap.data, chunk_bytes=self.chunk_bytes):
                if not context.is_active():
                    return
                yield coordinator_pb2.ParametersChunk(data=bytes(chunk))
                self.state.count_sent(len(chunk))
            after = snap.version
            if not request.follow:
                return

    def _act_as(self, context: grpc.ServicerContext, worker_id: str) -> str:
        """Check that the caller's certificate may act as learner `worker_id` (see `auth.act_as`); returns it."""
        identity = auth.peer_identity(context)
        if identity is not None:
            auth.act_as(identity, self.state.worker_name(worker_id))
        return worker_id

    def _params_header(self, snap: ParamsSnapshot, worker_id: str) -> coordinator_pb2.ParametersHeader:
        header = coordinator_pb2.ParametersHeader(
            version=snap.version,
            coordinator_epoch=snap.coordinator_epoch,
            payload=meta_to_proto(snap.meta, self.specs),
            applied_submission_ids=list(snap.applied_ids),
            finished=snap.finished,
        )
        if worker_id:
            plan, _ = self.state.plan(worker_id)
            header.plan.CopyFrom(plan_to_proto(plan))
        return header

    @status.unary
    def SubmitPseudoGradient(
        self, request_iterator: Iterator[coordinator_pb2.SubmitPseudoGradientRequest], context: grpc.ServicerContext
    ) -> coordinator_pb2.SubmitPseudoGradientResponse:
        opened = open_submission(self.state, next(request_iterator, None), self.specs, auth.peer_identity(context))
        if isinstance(opened, coordinator_pb2.SubmitPseudoGradientResponse):
            return opened  # a duplicate: the earlier outcome, nothing changes
        try:
            try:
                for msg in prefetch(request_iterator):  # receive the next chunk while this one decodes
                    if msg.WhichOneof("kind") != "data":
                        raise InvalidArgument("an upload has one header; every following message must be data")
                    opened.feed(msg.data)
            except grpc.RpcError:  # the client went away: keep what we hold for a resume
                opened.interrupted()
                return coordinator_pb2.SubmitPseudoGradientResponse()
            return submit_response(opened.finish())
        finally:
            opened.close()

    @status.unary
    def GetUploadStatus(
        self, request: coordinator_pb2.GetUploadStatusRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.GetUploadStatusResponse:
        worker_id = self._act_as(context, _require_id(request.worker_id, "worker_id"))
        held, complete = self.state.upload_status(worker_id, _require_id(request.submission_id, "submission_id"))
        return coordinator_pb2.GetUploadStatusResponse(received_bytes=held, complete=complete)

    @status.unary
    def GetWorkPlan(
        self, request: coordinator_pb2.GetWorkPlanRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.GetWorkPlanResponse:
        plan, version = self.state.plan(self._act_as(context, _require_id(request.worker_id, "worker_id")))
        return coordinator_pb2.GetWorkPlanResponse(plan=plan_to_proto(plan), version=version)

    @status.unary
    def Deregister(
        self, request: coordinator_pb2.DeregisterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.DeregisterResponse:
        worker_id = self._act_as(context, _require_id(request.worker_id, "worker_id"))
        self.state.remove(worker_id, WorkerState.LEFT, request.reason or "left")
        return coordinator_pb2.DeregisterResponse()

    @status.unary
    def ReportNodeFailure(
        self, request: coordinator_pb2.ReportNodeFailureRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ReportNodeFailureResponse:
        known, released = self.state.report_failure(
            _require_id(request.worker_id, "worker_id"),
            request.reason,
            request.last_seen_unix_s,
            request.declared_dead_unix_s,
        )
        return coordinator_pb2.ReportNodeFailureResponse(reassigned_shards=released, known=known)

    @status.unary
    def ReportThroughput(
        self, request: coordinator_pb2.ReportThroughputRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ReportThroughputResponse:
        tp = request.throughput
        self.state.report_throughput(_require_id(request.worker_id, "worker_id"), tp.tokens_per_s, tp.device_kind)
        return coordinator_pb2.ReportThroughputResponse()

    # --- operators ------------------------------------------------------------------------------------------------
    @status.unary
    def GetStatus(
        self, request: coordinator_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.GetStatusResponse:
        s = self.state.status(self.mode)
        return coordinator_pb2.GetStatusResponse(
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
        )

    @status.unary
    def ListWorkers(
        self, request: coordinator_pb2.ListWorkersRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ListWorkersResponse:
        return coordinator_pb2.ListWorkersResponse(
            workers=[worker_to_proto(w.record, w.plan) for w in self.state.workers()]
        )

    @status.unary
    def GetLedger(
        self, request: coordinator_pb2.GetLedgerRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.GetLedgerResponse:
        shards, version = self.state.ledger()
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
        )

    @status.unary
    def Checkpoint(
        self, request: coordinator_pb2.CheckpointRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.CheckpointResponse:
        written = self.checkpoint()
        if written is None:
            raise FailedPrecondition("checkpoints are off; start the coordinator with --checkpoint-dir")
        path, version = written
        return coordinator_pb2.CheckpointResponse(path=str(path), version=version)

    @status.unary
    def DrainWorker(
        self, request: coordinator_pb2.DrainWorkerRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.DrainWorkerResponse:
        rec = self.state.drain(_require_id(request.worker_id, "worker_id"))
        return coordinator_pb2.DrainWorkerResponse(state=WORKER_STATES.to_proto(rec.state))

    @status.unary
    def EvictWorker(
        self, request: coordinator_pb2.EvictWorkerRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.EvictWorkerResponse:
        worker_id = _require_id(request.worker_id, "worker_id")
        _, released = self.state.remove(worker_id, WorkerState.EVICTED, request.reason or "evicted by operator")
        return coordinator_pb2.EvictWorkerResponse(reassigned_shards=released)

    @status.unary
    def ReleaseWorker(
        self, request: coordinator_pb2.ReleaseWorkerRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ReleaseWorkerResponse:
        rec = self.state.release(_require_id(request.worker_id, "worker_id"))
        return coordinator_pb2.ReleaseWorkerResponse(state=WORKER_STATES.to_proto(rec.state))

    @status.unary
    def Pause(
        self, request: coordinator_pb2.PauseRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.PauseResponse:
        return coordinator_pb2.PauseResponse(paused=self.state.set_paused(True))

    @status.unary
    def Resume(
        self, request: coordinator_pb2.ResumeRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ResumeResponse:
        return coordinator_pb2.ResumeResponse(paused=self.state.set_paused(False))
