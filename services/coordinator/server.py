"""Server wiring: build the task and the core, resume from a checkpoint, serve gRPC (with health and
reflection) and Prometheus, and run the background work (round deadlines, evaluation, checkpoints)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco import log as logging
from diloco.core.codecs import warm_up
from diloco.core.coordinator import CoordinatorCore, RoundApplied, Submission
from diloco.core.energy import CarbonTrace
from diloco.core.fragments import FragmentedCoordinator, layout_for
from diloco.core.leadership import Handover, LeadershipView
from diloco.core.replication import WhenNoStandby
from diloco.core.uploads import Outcome
from diloco.errors import ConfigError, InvalidArgument
from diloco.rpc.auth import Tokens
from diloco.rpc.bulk import BulkServer, server_ssl_context_from_dir
from diloco.rpc.metrics import ServedMetrics, serve_metrics
from diloco.rpc.payload import Spill
from diloco.rpc.server import GrpcService
from diloco.task.data import evaluate
from diloco.task.factory import Task, build_task
from diloco.task.params import flatten_params, load_flat_, merge_segments, param_specs, view_flat_
from diloco.v1 import coordinator_pb2_grpc
from services.coordinator import checkpoint
from services.coordinator.bulk import BulkUploads
from services.coordinator.carbon import CarbonFeed, Provider, load_provider
from services.coordinator.config import CoordinatorServiceConfig, CrashFault
from services.coordinator.energy import J_PER_KWH, CarbonSignal, EnergyBook, Totals
from services.coordinator.metrics import CoordinatorMetrics, HaCollector
from services.coordinator.replication import SERVICE_NAME as REPLICATION_SERVICE_NAME
from services.coordinator.replication import HaView, ReplicationLog, ReplicationServicer, ha_view
from services.coordinator.replication import add_to_server as add_replication_to_server
from services.coordinator.servicer import CoordinatorServicer
from services.coordinator.state import CoordinatorState

SERVICE_NAME = "diloco.v1.Coordinator"


def default_max_upload_bytes(numel: int) -> int:
    """The fp32 size of the model plus 1%."""
    return 4 * numel + math.ceil(4 * numel / 100)


def load_carbon(cfg: CoordinatorServiceConfig) -> tuple[CarbonTrace | None, Provider | None]:
    """The carbon trace and provider the flags name (None: not given). `ConfigError` naming the flag, the file
    and line, or the import that failed."""
    trace = CarbonTrace.load(cfg.carbon_trace) if cfg.carbon_trace else None
    provider = load_provider(cfg.carbon_provider, cfg.carbon_provider_timeout_s) if cfg.carbon_provider else None
    return trace, provider


class CoordinatorServer:
    """The coordinator service in-process: `start()` builds everything and returns the bound port,
    `stop(grace_s)` drains and writes a final checkpoint. Both are safe to call twice."""

    def __init__(
        self,
        cfg: CoordinatorServiceConfig,
        clock: Callable[[], float] = time.time,
        *,
        epoch: int | None = None,
        fence: Callable[[], None] | None = None,
        leadership: Callable[[], LeadershipView] | None = None,
        step_down: Callable[[str], Handover] | None = None,
        adopt_learners: bool = False,
        served_metrics: ServedMetrics | None = None,
    ) -> None:
        """`epoch`: the coordinator epoch to serve under (with --etcd: the leadership epoch; None: a new one from
        the clock); `fence`: raises NotLeader while this replica may not accept work or publish; `leadership`: the
        replica's leadership view (GetStatus, metrics); `step_down`: hands leadership to a standby (the StepDown
        RPC; None: refused, there is no leadership to hand over); `adopt_learners`: the checkpoint is a standby's
        state written at its promotion: keep its learner table (`CoordinatorCore.restore`), so learners go on
        without registering again; `served_metrics`: a metrics port the caller already serves (a replica's, from before
        its promotion): the metrics go in its registry and no port is bound here."""
        self.cfg = cfg
        self._served_metrics = served_metrics
        self._adopt_learners = adopt_learners
        self._epoch = epoch
        self._fence = fence
        self._leadership = leadership
        self._step_down = step_down
        self.clock = clock
        self.metrics = CoordinatorMetrics(served_metrics.registry if served_metrics is not None else None)
        self.log = logging.get("coordinator")
        self.metrics_port = -1
        self.resumed_from: Path | None = None
        self._lifecycle = threading.Lock()
        self._started = False
        self._stopped = threading.Event()
        self._state: CoordinatorState | None = None
        self._replication: ReplicationLog | None = None  # with --replication-log: the round log for standbys
        self._grpc: GrpcService | None = None
        self._bulk: BulkServer | None = None
        self._metrics_server: Any = None
        self._threads: list[threading.Thread] = []
        self._carbon: CarbonFeed | None = None  # asks --carbon-provider for live intensities
        self._work: ThreadPoolExecutor | None = None
        self._snapshots: ThreadPoolExecutor | None = None  # with a round log: takes standbys' snapshots
        self._task: Task | None = None
        self._eval_model: nn.Module | None = None
        self._jobs = threading.Condition()
        self._jobs_stop = False
        # evaluation runs on `_eval_model`, whose parameters are views of Θ taken under the state's `work` lock and
        # held until the evaluation is done (`CoordinatorState.hold_params`: a round closing meanwhile steps a copy of
        # Θ), or, for a model whose parameters cannot view Θ (not fp32), a copy of it; while an evaluation runs the
        # model is not touched, and the newest version wanted meanwhile is evaluated after it (`_eval_deferred`)
        self._eval_request: int | None = None  # the version the model holds, to evaluate
        self._eval_release: Callable[[], None] | None = None  # lets go of the Θ the model views
        self._evaluating = False
        self._eval_deferred = False
        self._ckpt_request = False  # a checkpoint is due: the jobs thread writes the newest version
        self._ckpt_lock = threading.Lock()
        self._last_ckpt_version = -1

    # --- accessors ------------------------------------------------------------------------------------------------
    @property
    def state(self) -> CoordinatorState:
        if self._state is None:
            raise RuntimeError("the coordinator is not started; call start() first")
        return self._state

    @property
    def core(self) -> CoordinatorCore:
        return self.state.core

    @property
    def carbon(self) -> CarbonFeed | None:
        """The carbon provider's feed (None without --carbon-provider)."""
        return self._carbon

    @property
    def replication(self) -> ReplicationLog | None:
        """The round log for standbys (None without --replication-log)."""
        return self._replication

    def ha_status(self) -> HaView | None:
        """Leadership and the standbys' lag (None: neither --etcd nor a round log)."""
        leadership = self._leadership() if self._leadership is not None else None
        return ha_view(leadership, self._replication, self._grpc.address if self._grpc else "")

    @property
    def task(self) -> Task:
        if self._task is None:
            raise RuntimeError("the coordinator is not started; call start() first")
        return self._task

    @property
    def port(self) -> int:
        return self._grpc.port if self._grpc else 0

    @property
    def address(self) -> str:
        if self._grpc is None:
            raise RuntimeError("the coordinator is not started; call start() first")
        return self._grpc.address

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> int:
        with self._lifecycle:
            if self._started:
                if self._stopped.is_set():
                    raise RuntimeError("a stopped CoordinatorServer cannot be started again; make a new one")
                return self.port
            self._build()
            self._started = True
            warm_up(
                self.cfg.codec, self.cfg.broadcast_codec
            )  # before the first upload (an HA replica warmed up at start)
            return self.port

    def _build(self) -> None:
        cfg = self.cfg
        trace, provider = load_carbon(cfg)
        task = build_task(cfg.task)
        model = task.model_fn(cfg.seed)
        params = flatten_params(model).to("cpu")  # Θ: a new vector
        view_flat_(model, params)  # the model's own parameters go: it views Θ (when it can: fp32 on the CPU)
        specs = param_specs(model)
        shard_lengths = [task.corpus.shard_length(i) for i in range(task.corpus.num_shards)]
        segments = merge_segments(model)
        frag: FragmentedCoordinator | None = None
        layout = layout_for(cfg.fragments, cfg.local_steps, segments)  # P <= the model's tensors
        if layout is not None:  # streaming fragments: the same core, the tensor work per fragment
            frag = FragmentedCoordinator(cfg.core_config(), params, shard_lengths, layout, segments)
            core = frag.core
        else:
            core = CoordinatorCore(cfg.core_config(), params, shard_lengths, segments)
        totals = Totals()
        if cfg.checkpoint_dir:
            found = checkpoint.load_latest(cfg.checkpoint_dir)
            if found is not None:
                snap, path = found
                try:
                    if frag is not None:
                        frag.restore(snap, learners_at=self.clock() if self._adopt_learners else None, adopt=True)
                    elif "fragments" in snap:
                        raise InvalidArgument(
                            f"it was written with --fragments {len(snap['fragments'].get('versions', ()))}, this run "
                            "has none; restart with the --fragments it was written with"
                        )
                    else:
                        learners_at = self.clock() if self._adopt_learners else None
                        core.restore(snap, learners_at=learners_at, adopt=True)  # read for it: its tensors are ours
                except InvalidArgument as e:
                    raise ConfigError(
                        f"checkpoint {path} does not fit this run ({e}); point --checkpoint-dir elsewhere "
                        "or start the run with its original task"
                    ) from e
                self.resumed_from = path
                self._last_ckpt_version = core.version
                totals = self._restored_totals(snap, path)
                del found, snap  # the parameters read were copied into Θ: they go before Θ's broadcast shadow is made
        started = self.clock()
        signal = CarbonSignal(trace, cfg.carbon_trace_origin_unix_s or started, provider=provider is not None)
        epoch = time.time_ns() if self._epoch is None else self._epoch
        state = CoordinatorState(
            core,
            coordinator_epoch=epoch,
            fingerprint=task.fingerprint,
            codec=cfg.codec,
            broadcast_codec=cfg.broadcast_codec,
            broadcast_history=cfg.broadcast_history,
            max_upload_bytes=cfg.max_upload_bytes or default_max_upload_bytes(params.numel()),
            upload_ttl_s=cfg.upload_ttl_s,
            max_partial_uploads=cfg.max_partial_uploads,
            max_uploads_per_worker=cfg.max_uploads_per_worker,
            metrics=self.metrics,
            clock=self.clock,
            on_round=self._on_round,
            energy=EnergyBook(signal, totals),
            placement=cfg.policy_config(started),
            fragments=frag,
            spill=Spill.checked(cfg.spill_dir, cfg.spill_above),
        )
        state.fence = self._fence
        crash = cfg.crash_fault()
        if crash is not None:
            state.before_answer = lambda sub, outcome: self._crash_if(crash, sub, outcome)
        if provider is not None:
            self._carbon = CarbonFeed(
                provider,
                state.zones,
                state.set_intensity,
                state.intensity_failed,
                self.clock,
                refresh_s=cfg.carbon_refresh_s,
                timeout_s=cfg.carbon_provider_timeout_s,
            )
            state.on_new_zone = self._carbon.wake
        self.log = logging.get("coordinator", epoch=epoch)
        if self.resumed_from is not None:
            self.log.info(
                "checkpoint.restored",
                path=str(self.resumed_from),
                version=core.version,
                learners=len(core.adopted),
                energy_kwh=totals.joules / J_PER_KWH,
                carbon_g=totals.grams,
                cost=totals.cost,
            )
        # the built model is the evaluation model; a coordinator that never evaluates keeps only Θ
        self._task, self._eval_model, self._state = task, model if cfg.eval_every else None, state
        del model
        self._work = ThreadPoolExecutor(max_workers=cfg.work_threads, thread_name_prefix="coordinator-work")
        if cfg.replication_log:
            self._replication = ReplicationLog(
                state,
                entries=cfg.replication_log,
                max_bytes=cfg.replication_log_bytes,
                sync_replicas=cfg.sync_replicas,
                ack_timeout_s=cfg.replica_ack_timeout_s,
                when_no_standby=WhenNoStandby(cfg.when_no_standby),
            )
        servicer = CoordinatorServicer(
            state,
            task=task.config,
            specs=specs,
            mode=cfg.mode,
            healthd_address=cfg.healthd_address,
            checkpoint=self.checkpoint_now,
            work=self._work,
            ha=self.ha_status,
            step_down=self._step_down,
            init_seed=cfg.seed,
        )
        replication = self._replication
        service = GrpcService(
            cfg.host,
            cfg.port,
            [SERVICE_NAME] + ([REPLICATION_SERVICE_NAME] if replication else []),
            credentials=cfg.security.server_credentials(),
            interceptors=cfg.security.server_interceptors(),
            admission=cfg.admission(),
        )
        service.add(lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server))
        if replication is not None:
            # snapshots on a thread of their own: uploads waiting for a round held for a standby may occupy every
            # work thread, and that standby's snapshot must still be taken
            self._snapshots = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replication-snapshot")
            follow = ReplicationServicer(replication, fingerprint=task.fingerprint, work=self._snapshots)
            service.add(lambda server: add_replication_to_server(follow, server))
        self._threads = [
            threading.Thread(target=state.run_poller, name="coordinator-rounds", daemon=True),
            threading.Thread(target=self._jobs_loop, name="coordinator-jobs", daemon=True),
        ]
        for t in self._threads:
            t.start()
        if self._carbon is not None:
            self._carbon.start()
        if cfg.eval_every:
            with state.work:  # the model still holds the initial parameters unless a checkpoint was restored
                self._request_eval(core.version)
        if self._leadership is not None or self._replication is not None:
            self.metrics.registry.register(HaCollector(self.ha_status))
        self._grpc = service
        service.start()
        if cfg.bulk_port >= 0:
            sec = cfg.security
            tokens = Tokens(sec.join_token, sec.admin_token) if sec.join_token else None
            self._bulk = BulkServer(
                cfg.host,
                cfg.bulk_port,
                BulkUploads(state, specs, tokens),
                ssl_context=server_ssl_context_from_dir(sec.tls_dir, sec.tls_name) if sec.tls else None,
                executor=self._work,  # one bound on upload decoding over both paths
            )
            servicer.bulk_port = self._bulk.start()
        if self._served_metrics is None:
            self._metrics_server, self.metrics_port = serve_metrics(self.metrics.registry, cfg.host, cfg.metrics_port)
        else:
            self.metrics_port = self._served_metrics.port
        self.log.info(
            "coordinator.serving",
            address=service.address,
            bulk_port=servicer.bulk_port,
            tls=cfg.security.tls,
            auth=bool(cfg.security.join_token),
            metrics_port=self.metrics_port,
            version=core.version,
            mode=cfg.mode,
            codec=cfg.codec,
            broadcast_codec=cfg.broadcast_codec,
            placement=cfg.placement,
            carbon_zones=sorted(trace.zones) if trace is not None else None,
            carbon_provider=cfg.carbon_provider or None,
            numel=params.numel(),
            fragments=list(frag.layout.bounds) if frag is not None else None,
            shards=len(shard_lengths),
            fingerprint=task.fingerprint,
        )

    def _restored_totals(self, snap: dict[str, Any], path: Path) -> Totals:
        """The fleet's energy, carbon and cost totals in checkpoint `snap` (zero in one written before they were
        kept). Malformed ones are logged and the totals start from zero: the run resumes all the same."""
        try:
            return Totals.from_snapshot(snap)
        except InvalidArgument as e:
            self.log.warning("checkpoint.energy_totals_dropped", path=str(path), error=str(e))
            return Totals()

    def stop(self, grace_s: float | None = None) -> None:
        """Drain: health NOT_SERVING, end parameter streams, let in-flight calls finish for `grace_s`, stop the
        background threads and write a final checkpoint. Safe to call twice."""
        with self._lifecycle:
            if not self._started or self._stopped.is_set():
                self._stopped.set()
                return
            grace = self.cfg.shutdown_grace_s if grace_s is None else grace_s
            self.log.info("coordinator.stopping", grace_s=grace)
            state = self.state
            state.stop()
            if self._carbon is not None:
                self._carbon.stop()
            if self._replication is not None:
                self._replication.stop()
            if self._bulk is not None:
                self._bulk.stop(grace)
            if self._grpc is not None:
                self._grpc.stop(grace)
            with self._jobs:
                self._jobs_stop = True
                self._jobs.notify_all()
            for t in self._threads:
                t.join()
            for pool in (self._work, self._snapshots):
                if pool is not None:
                    pool.shutdown(wait=True)
            if self.cfg.checkpoint_dir and self._last_ckpt_version != self.core.version:
                self.checkpoint_now()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
            self._stopped.set()
            self.log.info("coordinator.stopped", version=self.core.version)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until `stop` has finished (or the timeout passes)."""
        return self._stopped.wait(timeout_s)

    def _crash_if(self, fault: CrashFault, sub: Submission, outcome: Outcome) -> None:
        """--fault-crash-before-answer: die as a crash does (SIGKILL: no drain, no final checkpoint, the call never
        answered) once an upload's outcome matches."""
        if not fault.matches(outcome.applied, outcome.round):
            return
        self.log.warning(
            "fault.crash",
            worker_id=sub.worker_id,
            submission_id=sub.submission_id,
            applied=outcome.applied,
            round=outcome.round,
            version=outcome.version,
            ranges=[[r.shard_id, r.epoch, r.start, r.end] for r in sub.ranges],
        )
        os.kill(os.getpid(), signal.SIGKILL)

    # --- after every round ----------------------------------------------------------------------------------------
    def _on_round(self, applied: RoundApplied) -> bool:
        """Called after a round's outer step, holding the state's tensor lock (`work`) but not its control lock, before
        the version is published: log it for the standbys (and wait for them), copy Θ for an evaluation, and ask the
        jobs thread for it and for a checkpoint (newest wins). False: withhold the version (the round log stopped
        while it was held for a standby)."""
        # first: the entry, and with --sync-replicas the wait for standbys
        if self._replication is not None and not self._replication.round_applied(applied):
            return False
        cfg = self.cfg
        v = applied.version
        last = bool(self.core.cfg.target_outer_steps) and v >= self.core.cfg.target_outer_steps
        want_eval = bool(cfg.eval_every) and (v % cfg.eval_every == 0 or last)
        want_ckpt = bool(cfg.checkpoint_dir) and (v % cfg.checkpoint_every == 0 or last)
        if not (want_eval or want_ckpt):
            return True
        if want_eval:
            self._request_eval(v)
        with self._jobs:
            self._ckpt_request = self._ckpt_request or want_ckpt
            self._jobs.notify_all()
        return True

    def _request_eval(self, version: int) -> None:
        """Holding the state's `work` lock (Θ is `version`'s): point the evaluation model at Θ, held (or copy Θ
        into it), and hand it to the jobs thread, or, while an evaluation runs, ask for the newest version after
        it."""
        with self._jobs:
            if self._evaluating:
                self._eval_deferred = True
                return
            assert self._eval_model is not None
            self._let_go_eval()  # a request not started yet: this one replaces it
            params, release = self.state.hold_params()
            if view_flat_(self._eval_model, params):
                self._eval_release = release
            else:
                release()
                load_flat_(self._eval_model, params)
            self._eval_request = version
            self._jobs.notify_all()

    def _let_go_eval(self) -> None:
        """Under `work` and `_jobs`: the evaluation model is done with the Θ it views (rounds write it in place
        again); it views Θ as it is now, not an older one a round replaced meanwhile (that one goes)."""
        if self._eval_release is not None:
            self._eval_release()
            self._eval_release = None
            assert self._eval_model is not None
            view_flat_(self._eval_model, self.core.params)

    def _jobs_loop(self) -> None:
        while True:
            with self._jobs:
                while not (self._jobs_stop or self._eval_request is not None or self._ckpt_request):
                    self._jobs.wait()
                ckpt, ev = self._ckpt_request, self._eval_request
                self._ckpt_request, self._eval_request = False, None
                self._evaluating = ev is not None
                stopping = self._jobs_stop
            if ckpt:
                try:
                    self.checkpoint_now()
                except Exception:
                    self.log.exception("checkpoint.failed")
            if ev is not None and not stopping:
                try:
                    self._evaluate(ev)
                except Exception:
                    self.log.exception("eval.failed", version=ev)
            if ev is not None:
                with self.state.work, self._jobs:  # lock order: `work`, then `_jobs`
                    self._let_go_eval()
                    self._evaluating, deferred = False, self._eval_deferred
                    self._eval_deferred = False
                    if deferred and not stopping:
                        self._request_eval(self.core.version)
            if stopping:
                return

    def _evaluate(self, version: int) -> None:
        model, task = self._eval_model, self.task
        assert model is not None
        result = evaluate(model, task.corpus, task.config.model.seq_len, self.cfg.eval_tokens, torch.device("cpu"))
        self.state.set_validation(version, result.loss, result.tokens)

    def checkpoint_now(self) -> tuple[Path, int] | None:
        """Write a checkpoint of the current applied state; None when checkpoints are off. Its tensors are
        serialised under the state's `work` lock, uncopied (rounds and folds wait meanwhile: `locked_s` in the
        log line); hashing the rest, the fsync and the rename do not hold it."""
        if not self.cfg.checkpoint_dir:
            return None
        started = time.monotonic()
        locked_s: list[float] = []

        @contextlib.contextmanager
        def work() -> Iterator[None]:
            with self.state.work:
                entered = time.monotonic()
                try:
                    yield
                finally:
                    locked_s.append(time.monotonic() - entered)

        with self._ckpt_lock:
            path, version = checkpoint.save(
                self.cfg.checkpoint_dir, self.state.snapshot, keep=self.cfg.keep_checkpoints, hold=work()
            )
            self._last_ckpt_version = max(self._last_ckpt_version, version)
        self.metrics.checkpoints.inc()
        self.log.info(
            "checkpoint.saved",
            path=str(path),
            version=version,
            seconds=round(time.monotonic() - started, 3),
            locked_s=round(sum(locked_s), 3),
        )
        return path, version
