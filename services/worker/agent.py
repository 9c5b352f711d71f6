"""The learner loop (ALGORITHM.md sections 1, 2, 5): register, adopt the global parameters, train H_m inner
steps on the shards the coordinator leased, upload the compressed pseudo-gradient in the background while
training on, and rebase when new parameters arrive. In `sync` mode it waits for the new parameters instead.

Threads: the training loop (caller's thread), a parameter watcher (server stream), an uploader (one upload at a
time, resumable), and heartbeats to healthd. Only the training loop touches the model.
"""

from __future__ import annotations

import queue
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from diloco import log as logging
from diloco.core.codecs import ErrorFeedback, get_codec
from diloco.errors import ConfigError
from diloco.rpc.bulk import bulk_upload, client_ssl_context_from_dir
from diloco.rpc.metrics import serve_metrics
from diloco.rpc.payload import PayloadReceiver, chunks, meta_from_proto, meta_to_proto
from diloco.rpc.retry import RETRYABLE, RetryConfig, call_with_retry
from diloco.rpc.security import host_of
from diloco.task.data import Corpus
from diloco.task.factory import TaskConfig, build_task
from diloco.task.inner import InnerTrainer
from diloco.task.model import pick_device
from diloco.task.params import param_specs
from diloco.task.progress import ReadProgress
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, healthd_pb2, healthd_pb2_grpc
from services.worker.config import WorkerConfig

T = TypeVar("T")
MODE_NAMES = {
    coordinator_pb2.ROUND_MODE_SYNC: "sync",
    coordinator_pb2.ROUND_MODE_DECOUPLED: "decoupled",
    coordinator_pb2.ROUND_MODE_ASYNC: "async",
}
CODEC_NAMES = {
    common_pb2.CODEC_FP32: "fp32",
    common_pb2.CODEC_BF16: "bf16",
    common_pb2.CODEC_INT8: "int8",
    common_pb2.CODEC_INT4: "int4",
    common_pb2.CODEC_TOPK: "topk",
}


class SessionEnded(Exception):
    """The registration is no longer valid (coordinator restarted, or this learner was declared dead)."""


@dataclass
class Params:
    version: int
    epoch: int
    flat: torch.Tensor
    applied: frozenset[str]


@dataclass
class Session:
    worker_id: str
    epoch: int
    mode: str
    codec: str
    local_steps: int  # H_m at registration
    bulk_port: int = 0  # the coordinator's bulk upload port (0: upload over gRPC)
    ended: threading.Event = field(default_factory=threading.Event)
    resync: str = ""  # why the learner must adopt the newest parameters and its leases again
    watch_call: grpc.Future | None = None  # type: ignore[type-arg]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("diloco_worker_steps", "Inner steps trained", registry=r)
        self.tokens = Counter("diloco_worker_tokens", "Tokens trained", registry=r)
        self.uploads = Counter("diloco_worker_uploads", "Pseudo-gradients uploaded", ["outcome"], registry=r)
        self.upload_bytes = Counter("diloco_worker_upload_bytes", "Bytes uploaded", registry=r)
        self.rebases = Counter("diloco_worker_rebases", "Rebases onto new global parameters", registry=r)
        self.resyncs = Counter("diloco_worker_resyncs", "Resyncs after a refused submission", registry=r)
        self.version = Gauge("diloco_worker_version", "Global version trained on", registry=r)
        self.tokens_per_s = Gauge("diloco_worker_tokens_per_second", "Measured throughput", registry=r)


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.name = cfg.display_name
        self.log = logging.get("worker", worker=self.name)
        self.stop_event = threading.Event()
        self.channel = cfg.security.channel(cfg.coordinator)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self._bulk_ssl: ssl.SSLContext | None = None  # built on the first bulk upload over TLS
        self.retry = RetryConfig(max_total_s=cfg.retry_total_s, max_attempts=1_000)
        self.metrics = Metrics()
        self.cv = threading.Condition()
        self.latest: Params | None = None
        self.applied_ids: deque[str] = deque(maxlen=1024)
        self.session: Session | None = None
        self.uploads: queue.Queue[tuple[Session, coordinator_pb2.SubmissionHeader, bytes] | None] = queue.Queue(1)
        self.upload_idle = threading.Event()  # set while no upload is queued or in flight
        self.upload_idle.set()
        self.awaiting: str | None = None  # submission waiting for its round
        self.trainer: InnerTrainer | None = None
        self.corpus: Corpus | None = None
        self.task_json = ""
        self.device = torch.device(cfg.device) if cfg.device else pick_device()
        self.exit_reason = ""
        self.leaving = threading.Event()  # deregistered: the last heartbeat says so, so healthd sees no failure
        self._threads: list[threading.Thread] = []

    # --- lifecycle --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the learner to drain: it hands its current work back, deregisters and returns from `run`."""
        self.stop_event.set()
        with self.cv:
            self.cv.notify_all()

    def run(self) -> int:
        """Train until the coordinator says training is finished or `stop()` is called. Returns an exit code."""
        server, port = serve_metrics(self.metrics.registry, "0.0.0.0", self.cfg.metrics_port)
        if port > 0:
            self.log.info("worker.metrics", port=port)
        for target in (self._upload_loop, self._heartbeat_loop):
            t = threading.Thread(target=target, name=target.__name__, daemon=True)
            t.start()
            self._threads.append(t)
        code = 0
        try:
            while not self.stop_event.is_set():
                try:
                    if self._session():
                        self.exit_reason = "finished"
                        break
                except SessionEnded as e:
                    self.log.warning("worker.reregister", reason=str(e))
                except grpc.RpcError as e:
                    if e.code() not in RETRYABLE:
                        raise
                    self.log.error("worker.coordinator_unreachable", code=e.code().name, details=e.details())
                    code = 1
                    break
            if self.stop_event.is_set():
                self.exit_reason = self.exit_reason or "stopped"
        finally:
            self.uploads.put(None)
            self.stop_event.set()
            if self.session is not None:
                self.session.ended.set()
                if self.session.watch_call is not None:
                    self.session.watch_call.cancel()
            for t in self._threads:
                t.join(timeout=5)
            if server is not None:
                server.shutdown()
            self.channel.close()
        self.log.info("worker.exited", reason=self.exit_reason)
        return code

    # --- one registration -------------------------------------------------------------------------------------
    def _register(self) -> Session:
        tp = self.trainer.throughput() if self.trainer else None
        req = coordinator_pb2.RegisterRequest(
            worker_name=self.name,
            throughput=common_pb2.Throughput(
                tokens_per_s=tp.tokens_per_s if tp else 0.0,
                step_time_s=tp.step_time_s if tp else 0.0,
                device_kind=self.device.type,
            ),
        )
        resp = call_with_retry(lambda: self.stub.Register(req, timeout=self.cfg.rpc_timeout_s), "Register", self.retry)
        if resp.task_json != self.task_json:
            self._build_task(resp.task_json)
        session = Session(
            resp.worker_id,
            resp.coordinator_epoch,
            MODE_NAMES.get(resp.mode, "decoupled"),
            CODEC_NAMES.get(resp.codec, "int8"),
            max(1, resp.plan.local_steps),
            bulk_port=resp.bulk_port if self.cfg.upload_path == "auto" else 0,
        )
        if not self.cfg.healthd and resp.healthd_address:
            self.healthd_address = resp.healthd_address
        self.log = logging.get("worker", worker=self.name, worker_id=session.worker_id)
        self.log.info(
            "worker.registered", epoch=session.epoch, version=resp.version, mode=session.mode, codec=session.codec
        )
        return session

    def _build_task(self, task_json: str) -> None:
        cfg = TaskConfig.from_json(task_json)
        task = build_task(cfg)
        self.corpus = task.corpus
        self.trainer = InnerTrainer(
            task.model_fn(self.cfg.seed),
            task.corpus,
            cfg.inner,
            seq_len=cfg.model.seq_len,
            device=self.device,
            slowdown=self.cfg.slowdown,
        )
        self.task_json = task_json
        self.specs = param_specs(self.trainer.model)

    def _session(self) -> bool:
        """Register, train until finished (True) or until the registration ends (SessionEnded)."""
        session = self._register()
        self.session = session
        with self.cv:
            self.latest = None
        watcher = threading.Thread(target=self._watch_loop, args=(session,), name="watch", daemon=True)
        watcher.start()
        try:
            return self._train(session)
        finally:
            session.ended.set()
            if session.watch_call is not None:
                session.watch_call.cancel()
            watcher.join(timeout=5)

    # --- parameters -------------------------------------------------------------------------------------------
    def _watch_loop(self, session: Session) -> None:
        """Stream every new version of the global parameters; reconnect with backoff."""
        backoff = 0.1
        while not session.ended.is_set():
            after = self.latest.version if self.latest else 0
            req = coordinator_pb2.WatchParametersRequest(worker_id=session.worker_id, after_version=after, follow=True)
            try:
                call = self.stub.WatchParameters(req)
                session.watch_call = call
                receiver: PayloadReceiver | None = None
                header: coordinator_pb2.ParametersHeader | None = None
                for msg in call:
                    if msg.HasField("header"):
                        header = msg.header
                        if header.coordinator_epoch != session.epoch:
                            self._end(session, "coordinator restarted")
                            return
                        assert self.trainer is not None
                        receiver = PayloadReceiver(meta_from_proto(header.payload), self.trainer.numel)
                        continue
                    if receiver is None or header is None:
                        continue
                    receiver.feed(msg.data)
                    if receiver.received == receiver.meta.encoded_bytes:
                        self._publish(header, receiver.finish())
                        receiver = None
                    backoff = 0.1
            except grpc.RpcError as e:
                if session.ended.is_set() or e.code() == grpc.StatusCode.CANCELLED:
                    return
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    self._end(session, e.details() or e.code().name)
                    return
                self.log.warning("worker.watch_retry", code=e.code().name, sleep_s=backoff)
            if session.ended.wait(backoff):
                return
            backoff = min(2.0, backoff * 2)

    def _publish(self, header: coordinator_pb2.ParametersHeader, flat: torch.Tensor) -> None:
        with self.cv:
            self.applied_ids.extend(header.applied_submission_ids)
            applied = frozenset(self.applied_ids)
            self.latest = Params(header.version, header.coordinator_epoch, flat, applied)
            if self.awaiting is not None and self.awaiting in applied:
                self.awaiting = None
            self.cv.notify_all()

    def _end(self, session: Session, reason: str) -> None:
        if not session.ended.is_set():
            session.resync = reason
            session.ended.set()
            with self.cv:
                self.cv.notify_all()

    def _wait_params(self, session: Session, newer_than: int) -> Params:
        with self.cv:
            while not (self.latest and self.latest.version > newer_than) or self.latest is None:
                if session.ended.is_set():
                    raise SessionEnded(session.resync or "session ended")
                if self.stop_event.is_set() and newer_than >= 0:
                    raise SessionEnded("stopping")
                self.cv.wait(0.5)
            return self.latest

    # --- training ---------------------------------------------------------------------------------------------
    def _train(self, session: Session) -> bool:
        assert self.trainer is not None and self.corpus is not None
        trainer = self.trainer
        first = self._wait_params(session, -1)
        trainer.load_global(first.flat)
        trainer.catch_up(first.version * session.local_steps)  # joined late: resume the schedule, no re-warmup
        base = first.version
        self.metrics.version.set(base)
        ef = ErrorFeedback(get_codec(session.codec), trainer.numel)
        progress = ReadProgress()
        plan_seq = 0
        self.awaiting = None
        bs, seq = trainer.cfg.batch_size, trainer.seq_len
        while True:
            if session.ended.is_set():
                raise SessionEnded(session.resync or "session ended")
            if session.resync:
                # a refused submission: adopt the newest parameters and the ledger's cursors, start over
                self.log.info("worker.resync", reason=session.resync)
                self.metrics.resyncs.inc()
                session.resync = ""
                latest = self._wait_params(session, -1)
                trainer.load_global(latest.flat)
                base = latest.version
                ef.reset()
                progress.reset()
                self.awaiting = None
            if self.stop_event.is_set():
                self._drain(session, progress, base, plan_seq, ef)
                return False
            status = self._call(
                "GetStatus",
                lambda: self.stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=self.cfg.rpc_timeout_s),
            )
            if status.finished:
                self._drain(session, progress, base, plan_seq, ef)
                return True
            plan = self._plan(session)
            plan_seq = plan.plan_seq
            progress.adopt((s.shard_id, s.epoch, s.cursor) for s in plan.shards)
            if not progress.cursors:
                with self.cv:
                    self.cv.wait(0.5)
                continue
            target = max(1, plan.local_steps)
            while not self.stop_event.is_set() and not session.ended.is_set() and not session.resync:
                ready = progress.steps >= target and self._can_submit()
                base = self._maybe_rebase(session, base)  # after the check: submit against the newest version
                if ready:
                    break
                shard, epoch, cursor = progress.next_shard()
                x, y, nxt = self.corpus.batch(shard, cursor, bs, seq)
                trainer.step(x, y)
                progress.consumed(shard, epoch, cursor, nxt)
                self.metrics.steps.inc()
                self.metrics.tokens.inc(nxt - cursor)
            if self.stop_event.is_set() or session.ended.is_set() or session.resync:
                continue
            self._submit(session, progress, base, plan_seq, ef)
            self.metrics.tokens_per_s.set(trainer.throughput().tokens_per_s)
            if session.mode == "sync":
                latest = self._wait_params(session, base)
                trainer.load_global(latest.flat)
                base = latest.version
                self.metrics.version.set(base)
            else:
                base = self._maybe_rebase(session, base)

    def _maybe_rebase(self, session: Session, base: int) -> int:
        """Adopt newer global parameters, keeping the steps not yet submitted (see `InnerTrainer.rebase`)."""
        assert self.trainer is not None
        with self.cv:
            latest = self.latest
        if latest is None or latest.version <= base:
            return base
        self.trainer.rebase(latest.flat)
        self.metrics.rebases.inc()
        self.metrics.version.set(latest.version)
        return latest.version

    def _can_submit(self) -> bool:
        with self.cv:
            return self.upload_idle.is_set() and self.awaiting is None

    def _plan(self, session: Session) -> common_pb2.WorkPlan:
        try:
            resp = self.stub.GetWorkPlan(
                coordinator_pb2.GetWorkPlanRequest(worker_id=session.worker_id), timeout=self.cfg.rpc_timeout_s
            )
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                self._end(session, e.details() or e.code().name)
                raise SessionEnded(e.details() or "plan refused") from e
            if e.code() in RETRYABLE:
                return self._call(
                    "GetWorkPlan",
                    lambda: self.stub.GetWorkPlan(
                        coordinator_pb2.GetWorkPlanRequest(worker_id=session.worker_id), timeout=self.cfg.rpc_timeout_s
                    ),
                ).plan
            raise
        return resp.plan

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return call_with_retry(fn, what, self.retry)

    def _submit(self, session: Session, progress: ReadProgress, base: int, plan_seq: int, ef: ErrorFeedback) -> str:
        """Compress the pseudo-gradient of everything read since the last submission and queue its upload."""
        assert self.trainer is not None
        delta = self.trainer.pseudo_gradient()
        if self.cfg.fault_scale_updates != 1.0:  # fault injection (tests, chaos runs): a learner gone wrong
            delta = delta * self.cfg.fault_scale_updates
        payload, meta = ef.compress(delta)
        self.trainer.mark_submitted()
        sid = uuid.uuid4().hex
        ranges, steps, tokens = progress.take()
        header = coordinator_pb2.SubmissionHeader(
            worker_id=session.worker_id,
            coordinator_epoch=session.epoch,
            submission_id=sid,
            base_version=base,
            tokens=tokens,
            steps=steps,
            ranges=[
                common_pb2.ShardRange(shard_id=r.shard_id, epoch=r.epoch, start=r.start, end=r.end) for r in ranges
            ],
            payload=meta_to_proto(meta, self.specs),
            plan_seq=plan_seq,
        )
        with self.cv:
            self.awaiting = sid
            self.upload_idle.clear()
        self.uploads.put((session, header, payload))
        return sid

    def _drain(self, session: Session, progress: ReadProgress, base: int, plan_seq: int, ef: ErrorFeedback) -> None:
        """Hand the work done so far back (submit it if allowed), wait for the upload, then deregister."""
        deadline = time.monotonic() + 30
        self.upload_idle.wait(30)
        if progress.steps > 0 and not session.ended.is_set() and not session.resync:
            with self.cv:
                self.awaiting = None  # the drain submission may join any round
            self._submit(session, progress, base, plan_seq, ef)
            self.upload_idle.wait(max(0.0, deadline - time.monotonic()))
        try:
            self.stub.Deregister(
                coordinator_pb2.DeregisterRequest(worker_id=session.worker_id, reason="drained"),
                timeout=self.cfg.rpc_timeout_s,
            )
            self.log.info("worker.deregistered")
        except grpc.RpcError as e:
            self.log.warning("worker.deregister_failed", code=e.code().name)

    # --- uploads ----------------------------------------------------------------------------------------------
    def _upload_loop(self) -> None:
        while True:
            job = self.uploads.get()
            if job is None:
                self.upload_idle.set()
                return
            session, header, payload = job
            try:
                self._upload(session, header, payload)
            finally:
                self.upload_idle.set()

    def _upload(self, session: Session, header: coordinator_pb2.SubmissionHeader, payload: bytes) -> None:
        offset = 0
        started = time.monotonic()
        # the bulk port, while it answers; after it fails once, this upload goes on over the RPC, whose address
        # stays right when the coordinator restarts (the port does not: it changes with every start)
        bulk_port = session.bulk_port

        def attempt() -> coordinator_pb2.SubmitPseudoGradientResponse:
            nonlocal offset, bulk_port
            header.resume_offset = offset

            def requests() -> Iterator[coordinator_pb2.SubmitPseudoGradientRequest]:
                yield coordinator_pb2.SubmitPseudoGradientRequest(header=header)
                for c in chunks(payload, offset):
                    yield coordinator_pb2.SubmitPseudoGradientRequest(data=bytes(c))

            try:
                if bulk_port:
                    return self._bulk_upload(bulk_port, header, memoryview(payload)[offset:])
                return self.stub.SubmitPseudoGradient(requests(), timeout=self.cfg.upload_timeout_s)
            except grpc.RpcError as e:  # a BulkError is one too, with the same codes
                if e.code() in RETRYABLE:
                    bulk_port = 0
                    try:
                        st = self.stub.GetUploadStatus(
                            coordinator_pb2.GetUploadStatusRequest(
                                worker_id=header.worker_id, submission_id=header.submission_id
                            ),
                            timeout=self.cfg.rpc_timeout_s,
                        )
                        if st.complete:
                            return coordinator_pb2.SubmitPseudoGradientResponse(
                                outcome=coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED
                            )
                        offset = st.received_bytes
                    except grpc.RpcError:
                        offset = 0
                raise

        try:
            resp = call_with_retry(attempt, "SubmitPseudoGradient", self.retry)
        except grpc.RpcError as e:
            outcome = e.code().name
            self.metrics.uploads.labels(outcome=outcome).inc()
            self.log.warning(
                "worker.submission_refused", submission_id=header.submission_id, code=outcome, details=e.details()
            )
            with self.cv:
                self.awaiting = None
            if e.code() in RETRYABLE or e.code() == grpc.StatusCode.NOT_FOUND:
                self._end(session, f"coordinator unreachable or forgot us ({outcome})")
            else:
                session.resync = e.details() or outcome
            return
        self.metrics.uploads.labels(outcome="accepted").inc()
        self.metrics.upload_bytes.inc(len(payload))
        self.log.info(
            "worker.submitted",
            submission_id=header.submission_id,
            path="bulk" if bulk_port else "grpc",
            version=resp.version,
            staleness=resp.staleness,
            bytes=len(payload),
            tokens=header.tokens,
            steps=header.steps,
            seconds=round(time.monotonic() - started, 3),
        )

    def _bulk_upload(
        self, port: int, header: coordinator_pb2.SubmissionHeader, payload: memoryview
    ) -> coordinator_pb2.SubmitPseudoGradientResponse:
        """The payload over the coordinator's bulk upload port (same host, same TLS identity and token)."""
        host = host_of(self.cfg.coordinator)
        sec = self.cfg.security
        if sec.tls and self._bulk_ssl is None:
            self._bulk_ssl = client_ssl_context_from_dir(sec.tls_dir, sec.tls_name)
        return bulk_upload(
            f"{host}:{port}",
            sec.join_token.encode(),
            coordinator_pb2.SubmitPseudoGradientRequest(header=header),
            payload,
            timeout_s=self.cfg.upload_timeout_s,
            ssl_context=self._bulk_ssl,
            server_hostname=host if sec.tls else None,
        )

    # --- heartbeats -------------------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        """Heartbeats to healthd with measured throughput. Never blocks training; reconnects with backoff."""
        address = self.cfg.healthd
        backoff = 0.2
        chan: grpc.Channel | None = None
        while not self.stop_event.is_set():
            address = self.cfg.healthd or getattr(self, "healthd_address", "")
            session = self.session
            if not address or session is None or session.ended.is_set():
                self.stop_event.wait(0.2)
                continue
            if chan is None:
                try:
                    chan = self.cfg.security.channel(address)
                except ConfigError as e:  # e.g. plaintext to a healthd that is not on loopback
                    self.log.error("worker.heartbeat_config", error=str(e))
                    self.stop_event.wait(5.0)
                    continue
            stub = healthd_pb2_grpc.HealthDaemonStub(chan)
            try:
                for resp in stub.Heartbeat(self._beats(session)):
                    backoff = 0.2
                    if resp.state == healthd_pb2.NODE_STATE_DEAD:
                        self.log.warning("worker.declared_dead")
                        self._end(session, "declared dead by healthd")
                        break
            except grpc.RpcError as e:
                if not self.stop_event.is_set():
                    self.log.debug("worker.heartbeat_retry", code=e.code().name)
                self.stop_event.wait(backoff)
                backoff = min(2.0, backoff * 2)
        if chan is not None:
            chan.close()

    def _beats(self, session: Session) -> Iterator[healthd_pb2.HeartbeatRequest]:
        """One heartbeat per interval; after a clean deregistration a last one says the node is leaving."""
        seq = 0
        while True:
            seq += 1
            tp = self.trainer.throughput() if self.trainer else None
            leaving = self.leaving.is_set()
            yield healthd_pb2.HeartbeatRequest(
                node_id=session.worker_id,
                role=healthd_pb2.NODE_ROLE_WORKER,
                sequence=seq,
                throughput=common_pb2.Throughput(
                    tokens_per_s=tp.tokens_per_s if tp else 0.0,
                    step_time_s=tp.step_time_s if tp else 0.0,
                    device_kind=self.device.type,
                ),
                version=self.latest.version if self.latest else 0,
                steps_done=self.trainer.steps_done if self.trainer else 0,
                leaving=leaving,
            )
            if leaving:
                return
            self.leaving.wait(self.cfg.heartbeat_interval_s)  # wakes at once when the worker leaves
            if session.ended.is_set() and not self.leaving.is_set():
                return
