"""The uploader: one thread, one upload at a time (the learner core never has two in flight). An upload goes over
the coordinator's bulk port when it offers one, else (and after the bulk path fails once) over
SubmitPseudoGradient, whose address stays right when the coordinator restarts. Uploads are idempotent (the
submission id) and resumable: after a transient error the uploader asks GetUploadStatus how much the coordinator
holds and resumes from there. It retries with capped, jittered backoff for `retry_total_s`, then drops the upload
(the core resyncs). Each outcome is posted to the worker's inbox as an `UploadResult`."""

from __future__ import annotations

import queue
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import structlog

from diloco.core.learner import Reaction, Rpc, react
from diloco.rpc.bulk import bulk_upload, client_ssl_context_from_dir
from diloco.rpc.payload import chunks
from diloco.rpc.retry import Backoff
from diloco.rpc.security import host_of
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.metrics import Metrics

Response = coordinator_pb2.SubmitPseudoGradientResponse


@dataclass(frozen=True)
class UploadJob:
    header: coordinator_pb2.SubmissionHeader
    payload: bytes | bytearray | memoryview
    bulk_port: int  # 0: over gRPC


@dataclass(frozen=True)
class UploadResult:
    worker_id: str
    submission_id: str
    reaction: Reaction | None  # None: accepted
    pending_round: int = 0
    applied: bool = False
    detail: str = ""
    epoch: int | None = None  # the accepting coordinator's epoch (None: it did not say)


class Uploader:
    def __init__(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        cfg: WorkerConfig,
        metrics: Metrics,
        post: Callable[[object], None],
        log: Callable[[], structlog.stdlib.BoundLogger],
        failover: Callable[[str, str], bool] = lambda _details, _tried: False,
        address: Callable[[], str] | None = None,
    ) -> None:
        self.stub, self.cfg, self.metrics, self.post, self.log = stub, cfg, metrics, post, log
        self.failover = failover  # FAILOVER: move to another coordinator address (`rpc.coordinators`)
        self.address = address or (lambda: cfg.coordinators[0])  # the coordinator in use (the bulk path's host)
        self._jobs: queue.Queue[UploadJob | None] = queue.Queue()
        self._closed = threading.Event()
        self._bulk_ssl: ssl.SSLContext | None = None  # built on the first bulk upload over TLS
        self._thread = threading.Thread(target=self._run, name="upload", daemon=True)
        self._thread.start()

    def put(self, job: UploadJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Abandon retries and end the thread (safe to call twice)."""
        self._closed.set()
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result = self.upload(job)
            except Exception as e:  # a fault no status covers: the learner hears of it rather than wait for good
                wid, sid = job.header.worker_id, job.header.submission_id
                self.log().exception("worker.upload_crashed", submission_id=sid)
                result = UploadResult(wid, sid, Reaction.DROP_UPLOAD, detail=f"the upload failed: {e!r}")
            del job  # the payload is not kept while the next one is awaited (a learner's peak memory)
            if not self._closed.is_set():
                self.post(result)

    def upload(self, job: UploadJob) -> UploadResult:
        """Upload `job` until it is accepted, refused, or its retries run out."""
        header, payload = job.header, job.payload
        wid, sid = header.worker_id, header.submission_id
        offset, bulk_port = 0, job.bulk_port
        started = time.monotonic()
        backoff = Backoff()
        while True:
            header.resume_offset = offset
            tried = self.address()
            try:
                resp = self._bulk(bulk_port, header, payload, offset) if bulk_port else self._grpc(header, payload)
            except grpc.RpcError as e:  # a BulkError is one too, with the same codes
                code = e.code().name
                reaction = react(Rpc.SUBMIT, code)
                if reaction is Reaction.FAILOVER and bulk_port:
                    # the bulk port is not there (a coordinator that moved or restarted): say so over gRPC at
                    # once, whose answer moves this learner if the coordinator did (the port is not the leader's)
                    self.log().warning(
                        "worker.bulk_unavailable", submission_id=sid, port=bulk_port, code=code, details=e.details()
                    )
                    bulk_port, offset = 0, self._resume_offset(wid, sid, len(payload))
                    continue
                if reaction is Reaction.FAILOVER and self.failover(e.details() or "", tried):
                    backoff.reset()  # another replica: the first try there is prompt, not this outage's n-th
                if reaction.retries and not self._closed.is_set():
                    if time.monotonic() - started < self.cfg.retry_total_s:
                        sleep_s = backoff.next_s(e)
                        self.log().warning("worker.upload_retry", submission_id=sid, code=code, sleep_s=sleep_s)
                        if self._closed.wait(sleep_s):
                            return UploadResult(wid, sid, Reaction.DROP_UPLOAD, detail="the worker is exiting")
                        bulk_port = 0  # the bulk port changes with every coordinator start; the RPC's does not
                        offset = self._resume_offset(wid, sid, len(payload))
                        continue
                    reaction = Reaction.DROP_UPLOAD
                self.metrics.uploads.labels(outcome=code).inc()
                self.log().warning(
                    "worker.submission_refused", submission_id=sid, code=code, details=e.details(), action=reaction
                )
                return UploadResult(wid, sid, reaction, detail=f"{code}: {e.details()}")
            self.metrics.uploads.labels(outcome="accepted").inc()
            self.metrics.upload_bytes.inc(len(payload) - offset)
            applied = resp.outcome == coordinator_pb2.SUBMISSION_OUTCOME_APPLIED
            self.log().info(
                "worker.submitted",
                submission_id=sid,
                path="bulk" if bulk_port else "grpc",
                applied=applied,
                version=resp.version,
                round=resp.round,
                staleness=resp.staleness,
                bytes=len(payload),
                tokens=header.tokens,
                steps=header.steps,
                seconds=round(time.monotonic() - started, 3),
            )
            epoch = resp.coordinator_epoch or None
            return UploadResult(wid, sid, None, pending_round=resp.round, applied=applied, epoch=epoch)

    def _resume_offset(self, worker_id: str, submission_id: str, size: int) -> int:
        """Where to resume: what the coordinator holds (all of it when the submission is complete: sending the
        header again then returns its outcome), else 0. Every GetUploadStatus error means "from byte 0"
        (REACTIONS[GET_UPLOAD_STATUS] retries everything)."""
        try:
            st = self.stub.GetUploadStatus(
                coordinator_pb2.GetUploadStatusRequest(worker_id=worker_id, submission_id=submission_id),
                timeout=self.cfg.rpc_timeout_s,
            )
        except grpc.RpcError:
            return 0
        return size if st.complete else min(size, max(0, st.received_bytes))

    def _grpc(self, header: coordinator_pb2.SubmissionHeader, payload: bytes | bytearray | memoryview) -> Response:
        offset = header.resume_offset

        def requests() -> Iterator[coordinator_pb2.SubmitPseudoGradientRequest]:
            yield coordinator_pb2.SubmitPseudoGradientRequest(header=header)
            for c in chunks(payload, offset):
                yield coordinator_pb2.SubmitPseudoGradientRequest(data=bytes(c))

        resp: Response = self.stub.SubmitPseudoGradient(requests(), timeout=self.cfg.upload_timeout_s)
        return resp

    def _bulk(
        self, port: int, header: coordinator_pb2.SubmissionHeader, payload: bytes | bytearray | memoryview, offset: int
    ) -> Response:
        """The payload over the coordinator's bulk upload port (same host, same TLS identity and token), abandoned
        as soon as the learner moves to another coordinator."""
        host = host_of(self.address())
        sec = self.cfg.security
        if sec.tls and self._bulk_ssl is None:
            self._bulk_ssl = client_ssl_context_from_dir(sec.tls_dir, sec.tls_name)
        return bulk_upload(
            f"{host}:{port}",
            sec.join_token.encode(),
            coordinator_pb2.SubmitPseudoGradientRequest(header=header),
            memoryview(payload)[offset:],
            timeout_s=self.cfg.upload_timeout_s,
            ssl_context=self._bulk_ssl,
            server_hostname=host if sec.tls else None,
            # moved to another coordinator (a new leader, say): stop waiting on this one, which may be cut off
            abandon=lambda: host_of(self.address()) != host,
        )
