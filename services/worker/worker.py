"""The learner process (ALGORITHM.md sections 1, 2, 5): the learner core (`diloco.core.learner.LearnerCore`)
decides, this loop carries its actions out with the model and the network.

Threads: the training loop (the caller's: the only one that touches the core and the model), a parameter
watcher per registration (`watcher.py`), the uploader (`uploader.py`) and heartbeats (`heartbeats.py`). The
threads post what happened to one inbox; the loop feeds it to the core. Control calls (Register, GetWorkPlan,
Deregister) are retried with capped, jittered backoff for as long as the core's status table says
(`REACTIONS`): the learner outlives coordinator and healthd restarts and exits only when stopped, when the job
finished, or after `give_up_after_s` without reaching the coordinator.
"""

from __future__ import annotations

import contextlib
import queue
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import grpc
import torch

from diloco import log as logging
from diloco.core import learner as core
from diloco.core.codecs import ErrorFeedback, get_codec
from diloco.errors import InvalidArgument
from diloco.rpc.metrics import serve_metrics
from diloco.rpc.retry import retry_while
from diloco.task.factory import TaskConfig, build_task
from diloco.task.inner import InnerTrainer
from diloco.task.model import pick_device
from diloco.task.params import param_specs
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.heartbeats import Beat, Heartbeats
from services.worker.metrics import Metrics
from services.worker.session import Fatal, Registration, SessionLost, header_of, plan_from_proto
from services.worker.uploader import Uploader, UploadJob, UploadResult
from services.worker.watcher import Delivered, Watcher

T = TypeVar("T")
IDLE_WAIT_S = 0.1  # the longest the loop sleeps without looking at `stop()`


class Stopped(Exception):
    """A control call's retries ended because the worker is exiting or gave up."""


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.name = cfg.display_name
        self.log = logging.get("worker", worker=self.name)
        self.core = core.LearnerCore(
            core.LearnerConfig(id_prefix=uuid.uuid4().hex + "-", give_up_after_s=cfg.give_up_after_s or None)
        )
        self.channel = cfg.security.channel(cfg.coordinator)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.metrics = Metrics()
        self.inbox: queue.Queue[object] = queue.Queue()
        self.device = torch.device(cfg.device) if cfg.device else pick_device()
        self.trainer: InnerTrainer | None = None
        self.task_json = ""
        self.reg: Registration | None = None
        self.ef: ErrorFeedback | None = None
        self.params: tuple[int, torch.Tensor] | None = None  # the newest version the core adopted, and its tensor
        self.watcher: Watcher | None = None
        self.exit_reason = ""
        self._stop_requested = False
        self.uploader = Uploader(self.stub, cfg, self.metrics, self.inbox.put, lambda: self.log)
        self.heartbeats = Heartbeats(cfg, self._beat, self.inbox.put, lambda: self.log)

    def stop(self) -> None:
        """Drain: hand the unsent steps back, deregister, say "leaving" to healthd, return from `run`. Safe from a
        signal handler (sets a flag; the loop looks at it at least every IDLE_WAIT_S)."""
        self._stop_requested = True

    def run(self) -> int:
        """Train until the job finishes or `stop()`; returns the exit status (0 finished or stopped, 1 gave up or
        met something no retry fixes)."""
        server, port = serve_metrics(self.metrics.registry, "0.0.0.0", self.cfg.metrics_port)
        if port > 0:
            self.log.info("worker.metrics", port=port)
        try:
            while not isinstance(action := self._next(), core.Exit):
                self._do(action)
        finally:
            if self.watcher is not None:
                self.watcher.close()
            self.uploader.close()
            self.heartbeats.close()
            if server is not None:
                server.shutdown()
            self.channel.close()
        self.exit_reason = action.reason.value
        if action.reason is core.ExitReason.GAVE_UP:
            self.log.error("worker.coordinator_unreachable", detail=action.detail)
        self.log.info("worker.exited", reason=self.exit_reason, detail=action.detail)
        return action.code

    # --- the loop ---------------------------------------------------------------------------------------------
    def _next(self) -> core.Action:
        while True:
            try:
                self._feed(self.inbox.get_nowait())
            except queue.Empty:
                break
        if self._stop_requested:
            self.core.stop(time.monotonic())
        self._set_watcher()
        return self.core.next_action(time.monotonic())

    def _feed(self, event: object) -> None:
        now, c = time.monotonic(), self.core
        if isinstance(event, Delivered):
            b = event.broadcast
            if b.worker_id == c.worker_id and c.params_arrived(now, b.version, b.epoch, b.plan, b.applied, b.finished):
                self.params = (b.version, event.flat)
        elif isinstance(event, UploadResult):
            if event.worker_id != c.worker_id:
                return
            if event.reaction is None:
                c.upload_accepted(now, event.submission_id, event.pending_round, event.applied)
            else:
                c.upload_failed(now, event.submission_id, event.reaction, event.detail)
        elif isinstance(event, SessionLost):
            if event.worker_id == c.worker_id:
                self.log.warning("worker.reregister", reason=event.reason)
                c.session_ended(now, event.reason)
        elif isinstance(event, Fatal):
            self.log.error("worker.fatal", reason=event.reason)
            c.fatal(now, event.reason)

    def _set_watcher(self) -> None:
        """One watcher for the current registration, none without one (or once the loop ends)."""
        w, wid = self.watcher, self.core.worker_id
        if w is not None and (w.worker_id != wid or self.core.exit is not None):
            w.close()
            self.watcher = w = None
        if w is None and wid and self.core.exit is None and self.trainer is not None:
            self.watcher = Watcher(
                self.stub, wid, self.core.coordinator_epoch, self.trainer.numel, self.inbox.put, self.log
            )

    def _do(self, a: core.Action) -> None:
        trainer = self.trainer
        if isinstance(a, core.Register):
            self._register()
        elif isinstance(a, core.Wait):
            timeout = IDLE_WAIT_S if a.until is None else max(0.0, min(IDLE_WAIT_S, a.until - time.monotonic()))
            with contextlib.suppress(queue.Empty):
                self._feed(self.inbox.get(timeout=timeout))
        elif isinstance(a, core.FetchPlan):
            self._fetch_plan()
        elif isinstance(a, core.Train):
            assert trainer is not None
            x, y, nxt = trainer.corpus.batch(a.shard_id, a.cursor, trainer.cfg.batch_size, trainer.seq_len)
            trainer.step(x, y)
            self.core.stepped(a.shard_id, a.epoch, a.cursor, nxt)
            self.metrics.steps.inc()
            self.metrics.tokens.inc(nxt - a.cursor)
        elif isinstance(a, (core.Load, core.Rebase)):
            assert trainer is not None and self.params is not None and self.ef is not None
            version, flat = self.params
            assert version == a.version, (version, a)
            if isinstance(a, core.Rebase):
                trainer.rebase(flat)
                self.metrics.rebases.inc()
            else:
                trainer.load_global(flat)
                trainer.catch_up(a.catch_up_steps)  # joined late: resume the schedule, no re-warmup
                if a.reset_codec:
                    self.log.info("worker.resync", reason=self.core.detail, version=version)
                    self.metrics.resyncs.inc()
                    self.ef.reset()
            self.metrics.version.set(version)
        elif isinstance(a, core.Submit):
            self._submit(a)
        elif isinstance(a, core.Deregister):
            self._deregister(a.worker_id)

    # --- carrying the actions out -----------------------------------------------------------------------------
    def _control(self, rpc: core.Rpc, fn: Callable[[], T]) -> T:
        """A control call, retried while the core's table says RETRY and the learner neither stops nor gives up.
        Raises `Stopped`, or the call's error for any other reaction (after the core applied it)."""

        def retry(e: grpc.RpcError) -> bool:
            now = time.monotonic()
            reaction = self.core.rpc_failed(now, rpc, e.code().name, e.details() or "")
            if reaction is not core.Reaction.RETRY:
                self.log.warning("worker.rpc_refused", call=rpc.value, code=e.code().name, action=reaction.value)
            return reaction is core.Reaction.RETRY and not self.core.give_up_due(now)

        def wait(seconds: float) -> bool:
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                if self._stop_requested and rpc is not core.Rpc.DEREGISTER:
                    return True
                time.sleep(min(left, IDLE_WAIT_S))
            return rpc is core.Rpc.DEREGISTER and time.monotonic() >= self.core.drain_deadline

        try:
            result = retry_while(fn, rpc.value, retry=retry, wait=wait)
        except grpc.RpcError as e:
            if self._stop_requested or self.core.give_up_due(time.monotonic()):
                raise Stopped(str(e)) from e
            raise
        self.core.contact(time.monotonic())
        return result

    def _register(self) -> None:
        tp = self.trainer.throughput() if self.trainer else None
        req = coordinator_pb2.RegisterRequest(
            worker_name=self.name,
            throughput=common_pb2.Throughput(
                tokens_per_s=tp.tokens_per_s if tp else 0.0,
                step_time_s=tp.step_time_s if tp else 0.0,
                device_kind=self.device.type,
            ),
        )
        try:
            resp = self._control(core.Rpc.REGISTER, lambda: self.stub.Register(req, timeout=self.cfg.rpc_timeout_s))
            reg = Registration.from_proto(resp)
        except (Stopped, grpc.RpcError):
            return  # the core knows (STOP, give up) or the loop sees the stop request
        except InvalidArgument as e:  # a mode or codec this build does not know
            self.core.fatal(time.monotonic(), f"Register: {e}")
            return
        if reg.task_json != self.task_json:
            self._build_task(reg.task_json)
        assert self.trainer is not None
        self.reg = reg
        self.ef = ErrorFeedback(get_codec(reg.codec), self.trainer.numel)
        self.params = None
        if not self.cfg.healthd and reg.healthd_address:
            self.heartbeats.address = reg.healthd_address
        self.log = logging.get("worker", worker=self.name, worker_id=reg.worker_id)
        self.core.registered(time.monotonic(), reg.worker_id, reg.epoch, reg.mode, reg.plan)
        self.log.info("worker.registered", epoch=reg.epoch, version=reg.version, mode=reg.mode, codec=reg.codec)

    def _build_task(self, task_json: str) -> None:
        cfg = TaskConfig.from_json(task_json)
        task = build_task(cfg)
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

    def _fetch_plan(self) -> None:
        """Only a learner without shards (or after a resync) asks; the others get their plan with each version."""
        req = coordinator_pb2.GetWorkPlanRequest(worker_id=self.core.worker_id)
        try:
            resp = self._control(
                core.Rpc.GET_WORK_PLAN, lambda: self.stub.GetWorkPlan(req, timeout=self.cfg.rpc_timeout_s)
            )
        except (Stopped, grpc.RpcError):
            return
        self.core.plan_received(time.monotonic(), plan_from_proto(resp.plan, resp.version))

    def _submit(self, a: core.Submit) -> None:
        """Compress the pseudo-gradient of everything read since the last submission and queue its upload."""
        assert self.trainer is not None and self.ef is not None and self.reg is not None
        delta = self.trainer.pseudo_gradient()
        if self.cfg.fault_scale_updates != 1.0:  # fault injection (tests, chaos runs): a learner gone wrong
            delta = delta * self.cfg.fault_scale_updates
        payload, meta = self.ef.compress(delta)
        self.trainer.mark_submitted()
        bulk_port = self.reg.bulk_port if self.cfg.upload_path == "auto" else 0
        self.uploader.put(UploadJob(header_of(a.draft, meta, self.specs), payload, bulk_port))
        self.metrics.tokens_per_s.set(self.trainer.throughput().tokens_per_s)

    def _deregister(self, worker_id: str) -> None:
        """Best effort; then the leaving heartbeat, so healthd reports this learner LEFT, not DEAD."""
        req = coordinator_pb2.DeregisterRequest(worker_id=worker_id, reason="drained")
        try:
            self._control(core.Rpc.DEREGISTER, lambda: self.stub.Deregister(req, timeout=self.cfg.rpc_timeout_s))
            self.log.info("worker.deregistered")
        except (Stopped, grpc.RpcError) as e:
            self.log.warning("worker.deregister_failed", error=str(e))
        self.heartbeats.leave(worker_id)
        if not self.heartbeats.left.wait(timeout=max(1.0, 4 * self.cfg.heartbeat_interval_s)):
            self.log.warning("worker.leave_unconfirmed")

    def _beat(self) -> Beat | None:
        wid, t = self.core.worker_id, self.trainer
        if not wid:
            return None
        tp = t.throughput() if t else None
        return Beat(
            wid,
            self.core.base_version,
            t.steps_done if t else 0,
            tp.tokens_per_s if tp else 0.0,
            tp.step_time_s if tp else 0.0,
            self.device.type,
        )
