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
import sys
import time
import uuid
from typing import cast

import torch

from diloco import log as logging
from diloco.core import learner as core
from diloco.core.broadcast import DEFAULT_BROADCAST_CODEC
from diloco.core.codecs import warm_up
from diloco.core.leadership import hintable
from diloco.errors import ConfigError, not_leader
from diloco.rpc.coordinators import Coordinators
from diloco.rpc.limits import MAX_REASON_CHARS
from diloco.rpc.metrics import serve_metrics
from diloco.task.model import pick_device
from diloco.v1 import coordinator_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.control import Control
from services.worker.heartbeats import Beat, Heartbeats
from services.worker.island import Island, device_kind
from services.worker.metrics import Metrics
from services.worker.power import PowerMeter, open_meter
from services.worker.replica import ParamsLost, Replica
from services.worker.session import Registration, SessionLost
from services.worker.uploader import Uploader, UploadJob, UploadResult
from services.worker.watcher import Delivered, Watcher, WatchFailed

IDLE_WAIT_S = 0.1  # the longest the loop sleeps without looking at `stop()`
# Where a round's time goes, by the action that spent it (the `worker.round` log line, `diloco_worker_seconds`):
# inner steps, the pseudo-gradient and its encoding (handed to the uploader, which uploads meanwhile), adopting new
# parameters, waiting (for a broadcast, a plan, a backoff), and the control calls.
PHASES: dict[type, str] = {
    core.Train: "inner",
    core.Submit: "encode",
    core.Load: "rebase",
    core.Rebase: "rebase",
    core.Wait: "wait",
}


def learner_device(cfg: WorkerConfig) -> torch.device:
    """A one-process learner's device: --device, or CUDA when present, else the CPU."""
    return torch.device(cfg.device) if cfg.device not in ("", "auto") else pick_device()


def open_power_meter(cfg: WorkerConfig, device: torch.device, world: int = 1) -> PowerMeter:
    """The learner's power meter (`power.py`): on CUDA its GPU, or in an island of `world` ranks every rank's GPU on
    this host (rank i sits on LOCAL_RANK i's GPU). Raises `ConfigError` naming --power-meter when the meter asked
    for cannot be read."""
    cuda: list[int] = []
    if device.type == "cuda":
        cuda = list(range(world)) if world > 1 else [device.index or 0]
    return open_meter(cfg.power_meter, cfg.power_w, cuda)


class Worker:
    """A one-process learner, or rank 0 (the leader) of an island (`island.py`): then every torch action is sent
    to the other ranks first, and they carry it out together with this one."""

    def __init__(self, cfg: WorkerConfig, island: Island | None = None, power: PowerMeter | None = None) -> None:
        self.cfg = cfg
        self.island = island
        self.name = cfg.display_name
        self.log = logging.get("worker", worker=self.name)
        self.core = core.LearnerCore(
            core.LearnerConfig(id_prefix=uuid.uuid4().hex + "-", give_up_after_s=cfg.give_up_after_s or None)
        )
        self.device = learner_device(cfg) if island is None else island.device
        self.device_kind = device_kind(self.device, 1 if island is None else island.world)
        # first: a meter that cannot be read is a configuration error (`__main__` opens it before logging starts)
        self.power = power or open_power_meter(cfg, self.device, island.world if island is not None else 1)
        reading = self.power.reading()
        self.log.info(
            "worker.power_meter",
            source=self.power.counter.source.value if self.power.counter is not None else "declared",
            declared_w=cfg.power_w,
            watts=reading.watts if reading else None,
            not_used=self.power.note or None,
        )
        # the address in use; moves on FAILOVER
        self.coordinators = Coordinators(cfg.coordinators, cfg.security, who="worker", log=lambda: self.log)
        self.stub = cast(coordinator_pb2_grpc.CoordinatorStub, self.coordinators)
        self.metrics = Metrics()
        self.power.on_drop = self._power_window_dropped
        self.round_phases: dict[str, float] = {}  # seconds per phase since the last submission
        self.inbox: queue.Queue[object] = queue.Queue()
        self.replica = Replica(cfg, self.device, self.metrics, island)
        self.reg: Registration | None = None
        self.bulk_port = 0  # the bulk upload port of the coordinator followed (0: upload over gRPC)
        self.watcher: Watcher | None = None
        self.exit_reason = ""
        self._warmed = False  # the codecs' kernels were asked to compile (`warm_up`, at the first registration)
        self._joining = ""  # the worker id heartbeats name while `_register` builds the session (model, kernels)
        self._stop_requested = False
        failover = self.coordinators.failover
        self.uploader = Uploader(
            self.stub, cfg, self.metrics, self.inbox.put, lambda: self.log, failover, self._address
        )
        self.heartbeats = Heartbeats(cfg, self._beat, self.inbox.put, lambda: self.log, self._leader_announced)
        self.control = Control(
            self.stub, cfg, self.core, lambda: self._stop_requested, lambda: self.log, failover, self._address
        )

    def _address(self) -> str:
        """The coordinator address in use now (the leader-following client's)."""
        return self.coordinators.address

    def _leader_announced(self, epoch: int, address: str) -> None:
        """healthd passes on the newest leader announced (heartbeat thread): one of a newer epoch than the
        coordinator this learner follows, elsewhere, is moved to now, as a refusal naming it would (calls still
        running on the old channel end CANCELLED and are retried there)."""
        if epoch > self.core.coordinator_epoch and address != self.coordinators.address and hintable(address):
            self.log.info("worker.leader_announced", epoch=epoch, address=address)
            self.coordinators.failover(str(not_leader(address)))

    def stop(self) -> None:
        """Drain: hand the unsent steps back, deregister, say "leaving" to healthd, return from `run`. Safe from a
        signal handler (sets a flag; the loop looks at it at least every IDLE_WAIT_S)."""
        self._stop_requested = True

    def close(self) -> None:
        """End the threads and the channel, let go of the model (`run` does it on its way out; safe to call twice)."""
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        self.uploader.close()
        self.heartbeats.close()
        self.coordinators.close()
        self.replica.close()

    def run(self) -> int:
        """Train until the job finishes or `stop()`; returns the exit status (0 finished or stopped, 1 gave up or
        met something no retry fixes, 2 the coordinator's task does not build or fit here: `_refuse`)."""
        server, port = serve_metrics(self.metrics.registry, "0.0.0.0", self.cfg.metrics_port)
        if port > 0:
            self.log.info("worker.metrics", port=port)
        code: int | None = None  # the exit status, once the loop ended without an exception
        try:
            try:
                while not isinstance(action := self._next(), core.Exit):
                    self._do(action)
            except ConfigError as e:  # the coordinator's task does not build or fit here
                code = self._refuse(str(e))
                return code
            code = action.code
        finally:
            if self.island is not None and code is not None:  # else the other ranks see this one die
                self.island.stop(code)
            self.close()
            if server is not None:
                server.shutdown()
        self.exit_reason = action.reason.value
        if action.reason is core.ExitReason.GAVE_UP:
            self.log.error("worker.coordinator_unreachable", detail=action.detail)
        self.log.info("worker.exited", reason=self.exit_reason, detail=action.detail)
        return action.code

    def _refuse(self, detail: str) -> int:
        """The coordinator's task does not build or fit here (a file missing, the island's ranks, a fingerprint
        part that differs): exit status 2, the reason in the log and on stderr, and no registration left behind
        (Deregister with the reason, which ListWorkers shows)."""
        self.log.error("worker.task_refused", detail=detail)
        print(f"diloco worker: configuration error: {detail}", file=sys.stderr)  # as for a bad flag (__main__)
        self.exit_reason = "config"
        worker_id = self.reg.worker_id if self.reg is not None else self.core.worker_id
        if worker_id:
            reason = "".join(c if c.isprintable() else " " for c in f"task refused: {detail}")
            self._deregister(worker_id, reason[:MAX_REASON_CHARS])
        return 2

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
            versions = b.fragment_versions
            if b.worker_id == c.worker_id and c.params_arrived(
                now, b.version, b.epoch, b.plan, b.applied, b.finished, fragment_versions=versions
            ):
                self.replica.params = (b.version, event.held)
            if b.worker_id == c.worker_id and b.epoch == c.coordinator_epoch and b.bulk_port is not None:
                self.bulk_port = b.bulk_port  # a leader that took this learner over has its own bulk port
        elif isinstance(event, UploadResult):
            if event.worker_id != c.worker_id:
                return
            if event.reaction is None:
                c.upload_accepted(now, event.submission_id, event.pending_round, event.applied, event.epoch)
            else:
                c.upload_failed(now, event.submission_id, event.reaction, event.detail)
        elif isinstance(event, SessionLost):
            if event.worker_id == c.worker_id:
                self.log.warning("worker.reregister", reason=event.reason)
                c.session_ended(now, event.reason)
        elif isinstance(event, WatchFailed) and event.worker_id == c.worker_id:
            c.rpc_failed(now, core.Rpc.WATCH_PARAMETERS, event.code)

    def _set_watcher(self) -> None:
        """One watcher for the current registration, none without one (or once the loop ends)."""
        w, wid = self.watcher, self.core.worker_id
        if w is not None and (w.worker_id != wid or self.core.exit is not None):
            w.close()
            self.watcher = w = None
        if w is None and wid and self.core.exit is None:
            epoch, numel, v0 = self.core.coordinator_epoch, self.replica.numel, self.replica.version0
            failover, address = self.coordinators.failover, self._address
            self.watcher = Watcher(
                self.stub,
                wid,
                epoch,
                numel,
                self.inbox.put,
                self.log,
                failover,
                version0=v0,
                address=address,
                vector=self.replica.theta_hat_vector,
            )

    def _do(self, a: core.Action) -> None:
        """Carry out `a`, timing it into its phase of the round (`PHASES`); a submission logs the round's phases."""
        started = time.monotonic()
        try:
            self._carry_out(a)
        finally:
            phase = PHASES.get(type(a), "control")
            seconds = time.monotonic() - started
            self.round_phases[phase] = self.round_phases.get(phase, 0.0) + seconds
            self.metrics.seconds.labels(phase=phase).inc(seconds)
        if isinstance(a, core.Submit):
            self.log.info("worker.round", **{f"{k}_s": round(v, 4) for k, v in sorted(self.round_phases.items())})
            self.round_phases = {}

    def _carry_out(self, a: core.Action) -> None:
        if isinstance(a, core.Register):
            self._register()
        elif isinstance(a, core.Wait):
            timeout = IDLE_WAIT_S if a.until is None else max(0.0, min(IDLE_WAIT_S, a.until - time.monotonic()))
            with contextlib.suppress(queue.Empty):
                self._feed(self.inbox.get(timeout=timeout))
        elif isinstance(a, core.FetchPlan):
            self._fetch_plan()
        elif isinstance(a, core.Train):
            if self.island is not None:
                self.island.train(a.shard_id, a.cursor)
            self.power.begin(time.monotonic())
            cursor = self.replica.train(a)
            self.power.end(time.monotonic())
            self.core.stepped(a.shard_id, a.epoch, a.cursor, cursor)
        elif isinstance(a, (core.Load, core.Rebase)):
            try:
                self._adopt(a)
            except ParamsLost as e:  # Θ̂ is partly written: from a snapshot, in a new registration
                self.log.warning("worker.broadcast_refused", reason=str(e), version=a.version)
                self.core.session_ended(time.monotonic(), str(e))
        elif isinstance(a, core.Submit):
            self.uploader.put(self._upload_job(a))
        elif isinstance(a, core.Deregister):
            self._deregister(a.worker_id)

    # --- carrying the actions out -----------------------------------------------------------------------------
    def _adopt(self, a: core.Load | core.Rebase) -> None:
        if self.island is None:
            self.replica.adopt(a, self.log, self.core.detail)
            return
        t = self.replica.trainer
        assert t is not None
        before = self.island.digest(t.model)
        self.replica.adopt(a, self.log, self.core.detail)
        self.island.params(t.model, t.steps_done, before)

    def _register(self) -> None:
        reg = self.control.register(self.name, self.replica.throughput(), self.device_kind, self.power.reading())
        if reg is None:
            return  # the core knows why (re-register, give up), or the loop sees the stop request
        self.reg, self.bulk_port = reg, reg.bulk_port
        if not self.cfg.healthd and reg.healthd_address:
            self.heartbeats.address = reg.healthd_address
        # heartbeats name this registration from now on: building the model (and, the first time, the codecs'
        # kernels) can take longer than the coordinator waits to hear of a new learner (--confirm-timeout-s)
        self._joining = reg.worker_id
        try:
            if self.island is not None:
                self.island.session(reg.task_json, reg.task_fingerprint)
            self.replica.start_session(reg.task_json, reg.task_fingerprint, reg.init_seed)
            # streaming fragments: the coordinator's layout, checked against the model built here (ConfigError:
            # exit 2)
            self.replica.use_layout(reg.layout(self.replica.specs, self.replica.numel), reg.codec)
            self.core.use_fragments(reg.fragments)
            self.log = logging.get("worker", worker=self.name, worker_id=reg.worker_id)
            self.core.registered(time.monotonic(), reg.worker_id, reg.epoch, reg.mode, reg.plan)
            if not self._warmed:  # the codecs' kernels compile during the first inner steps, not at the first upload
                warm_up(reg.codec, DEFAULT_BROADCAST_CODEC)
                self._warmed = True
        finally:
            self._joining = ""
        self.log.info(
            "worker.registered",
            epoch=reg.epoch,
            version=reg.version,
            mode=reg.mode,
            codec=reg.codec,
            **({"fragments": reg.fragments} if reg.fragments > 1 else {}),
        )

    def _fetch_plan(self) -> None:
        """Only a learner without shards (or after a resync) asks; the others get their plan with each version."""
        plan = self.control.work_plan(self.core.worker_id)
        if plan is not None:
            self.core.plan_received(time.monotonic(), plan)

    def _upload_job(self, a: core.Submit) -> UploadJob:
        return self.replica.upload_job(a, self.bulk_port if self.cfg.upload_path == "auto" else 0)

    def _deregister(self, worker_id: str, reason: str = "drained") -> None:
        """Best effort; then the leaving heartbeat, so healthd reports this learner LEFT, not DEAD."""
        if self.control.deregister(worker_id, reason):
            self.log.info("worker.deregistered")
        else:
            self.log.warning("worker.deregister_failed")
        self.heartbeats.leave(worker_id)
        if not self.heartbeats.left.wait(timeout=max(1.0, 4 * self.cfg.heartbeat_interval_s)):
            self.log.warning("worker.leave_unconfirmed")

    def _beat(self) -> Beat | None:
        wid, t = self.core.worker_id or self._joining, self.replica.trainer
        if not wid:
            return None
        tp = t.throughput() if t else None
        return Beat(
            wid,
            self.core.base_version,
            t.steps_done if t else 0,
            tp.tokens_per_s if tp else 0.0,
            tp.step_time_s if tp else 0.0,
            self.device_kind,
            self.power.reading(),
        )

    def _power_window_dropped(self, reason: str, detail: str, in_a_row: int) -> None:
        """The power meter dropped a window (`power.py`): counted; the first of a run of drops is logged."""
        self.metrics.power_windows_dropped.labels(reason=reason).inc()
        if in_a_row == 1:
            kept = self.power.reading()
            self.log.warning(
                "power.window_dropped",
                reason=reason,
                detail=detail,
                kept_watts=kept.watts if kept else None,
                kept_source=kept.source.value if kept else None,
            )
