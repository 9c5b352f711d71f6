"""The simulation loop: learners, links and failures on a virtual clock, driving the real `CoordinatorCore`.

Every learner trains a real model replica (unless `train=False`), but time is virtual: an inner step of a learner
with relative speed `v` takes `step_time_s / v`, an upload of `n` bytes takes `latency_s + n / bandwidth`.
Learner training is evaluated lazily: when an event touches a learner, it first runs the whole steps that fit
before the event's time. Events at equal times run in the order they were scheduled, so runs are deterministic
for a seed.

Learner behaviour follows ALGORITHM.md section 5:
- `sync`: train H steps, upload, wait for the new parameters (idle), repeat.
- `decoupled` / `async`: train H_m steps, upload and keep training; rebase onto new parameters when they arrive.
  A learner has at most one submission waiting for a round; if its next H_m steps are done before that one is
  applied, it keeps training and submits as soon as it is.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.core.codecs import ErrorFeedback, get_codec
from diloco.core.coordinator import CoordinatorConfig, CoordinatorCore, RoundApplied, Submission
from diloco.core.merge import Segment
from diloco.core.states import DEAD
from diloco.errors import ConfigError, DilocoError
from diloco.sim.config import DILOCO_MODES, SimConfig
from diloco.sim.dp import DataParallelSimulator
from diloco.sim.events import EventLoop
from diloco.sim.result import SimResult, encoded_size, time_to_target
from diloco.task.data import Corpus, EvalResult, evaluate
from diloco.task.factory import Task, build_task
from diloco.task.inner import InnerTrainer
from diloco.task.params import flatten_params, load_flat_, merge_segments
from diloco.task.progress import ReadProgress

__all__ = ["Learner", "SimResult", "Simulator", "encoded_size", "simulate"]

_EPS = 1e-9


@dataclass
class Learner:
    idx: int
    speed: float
    step_time: float
    alive: bool = True
    incarnation: int = 0
    worker_id: str = ""
    trainer: InnerTrainer | None = None
    ef: ErrorFeedback | None = None
    training: bool = False
    t_cursor: float = 0.0
    segment_steps: int = 0
    seg_gen: int = 0
    progress: ReadProgress = field(default_factory=ReadProgress)
    plan_seq: int = 0
    base_version: int = 0
    uploading: bool = False
    awaiting: str | None = None  # submission id waiting for its round
    ready: bool = False  # H_m steps done, submission deferred
    alive_since: float = 0.0
    killed_at: float = 0.0
    shardless_since: float | None = None  # registered, but its plan holds no shard


class Simulator(EventLoop):
    def __init__(self, cfg: SimConfig, progress: Callable[[dict[str, float]], None] | None = None) -> None:
        super().__init__()
        if cfg.mode not in DILOCO_MODES:
            raise ConfigError(
                f"Simulator runs the DiLoCo modes ({', '.join(DILOCO_MODES)}); use simulate() for mode {cfg.mode!r}"
            )
        self.cfg = cfg
        self.progress = progress
        self.rng = random.Random(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.codec = get_codec(cfg.codec)
        self.task: Task | None = None
        self.corpus: Corpus | None = None
        segments: list[Segment] | None = None
        if cfg.train:
            self.task = build_task(cfg.task_config())
            self.corpus = self.task.corpus
            model = self.task.model_fn(cfg.seed)
            params = flatten_params(model).cpu()
            shard_lengths = [self.corpus.shard_length(i) for i in range(cfg.num_shards)]
            segments = merge_segments(model)
            self.eval_model = model
            self.model_numel = params.numel()
            self.tokens_per_step = cfg.task.inner.batch_size * cfg.task.model.seq_len
        else:
            params = torch.zeros(1)
            shard_lengths = [1 << 40] * cfg.num_shards
            self.model_numel = cfg.model_numel or 1_000_000
            self.tokens_per_step = cfg.task.inner.batch_size * cfg.task.model.seq_len
        self.payload_bytes = encoded_size(self.codec, self.model_numel)
        self.param_bytes = 4 * self.model_numel
        core_cfg = CoordinatorConfig(
            rounds=cfg.round_config(),
            outer=cfg.outer,
            merge=cfg.merge,
            local_steps=cfg.local_steps,
            min_local_steps=cfg.min_local_steps,
            dynamic_local_steps=cfg.dynamic_local_steps and cfg.mode != "sync",
            scale_partial_rounds=cfg.scale_partial_rounds,
            expected_workers=cfg.num_learners,
            target_outer_steps=cfg.outer_steps,
        )
        self.core = CoordinatorCore(core_cfg, params, shard_lengths, segments)
        self.learners = [Learner(i, v, cfg.step_time_s / v) for i, v in enumerate(cfg.speeds)]
        self.history: list[dict[str, float]] = []
        self.bytes_up = 0
        self.bytes_down = 0
        self.useful_s = 0.0
        self.busy_s = [0.0] * cfg.num_learners
        self.available_s = [0.0] * cfg.num_learners
        self.sub_cost: dict[str, tuple[int, float]] = {}
        self.staleness: list[int] = []
        self.rejected = 0
        self.lost_uploads = 0
        self.reassign_latency: list[float] = []
        self.shardless_s = 0.0
        self.deadline_scheduled: float | None = None
        self.sub_ids = itertools.count()

    # --- event queue ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        cfg = self.cfg
        initial = self.evaluate()
        self.history.append(
            {"time_s": 0.0, "tokens": 0, "version": 0, "val_loss": initial.loss, "eval_tokens": initial.tokens}
        )
        for learner in self.learners:
            self.join(learner, 0.0)
        for e in cfg.failures:
            self.at(e.at_s, e.action, e.learner)
        self.run_events(cfg.max_time_s)
        for learner in self.learners:
            if learner.alive:
                self.available_s[learner.idx] += self.now - learner.alive_since
                self.end_shardless(learner, self.now)
        if self.history[-1]["version"] != self.core.version:
            self.record(force_eval=True)
        return self.result(initial.loss)

    # --- learners ---------------------------------------------------------------------------------------------
    def join(self, learner: Learner, t: float) -> None:
        """Register (a new incarnation) and schedule the start once the parameters are downloaded."""
        learner.alive = True
        learner.alive_since = t
        learner.incarnation += 1
        rec = self.core.register(f"learner{learner.idx}", t, speed=learner.speed * self.tokens_per_step)
        learner.worker_id = rec.worker_id
        if self.task is not None:
            model = self.task.model_fn(self.cfg.seed)
            assert self.corpus is not None
            learner.trainer = InnerTrainer(
                model, self.corpus, self.cfg.task.inner, seq_len=self.cfg.task.model.seq_len, device=torch.device("cpu")
            )
        learner.ef = ErrorFeedback(self.codec, self.core.params.numel(), enabled=self.cfg.error_feedback)
        self.bytes_down += self.param_bytes
        self.at(
            t + self.cfg.latency_s + self.param_bytes / self.cfg.bandwidth_bytes_per_s,
            "start",
            learner.idx,
            learner.incarnation,
            self.core.version,
            self.core.params.clone(),
        )
        if self.cfg.mtbf_s > 0:
            self.at(t + self.rng.expovariate(1 / self.cfg.mtbf_s), "kill", learner.idx, learner.incarnation)

    def on_start(self, idx: int, inc: int, version: int, params: torch.Tensor) -> None:
        learner = self.learners[idx]
        if learner.incarnation != inc or not learner.alive:
            return
        if learner.trainer is not None:
            learner.trainer.load_global(params)
            learner.trainer.catch_up(version * self.core.plan(learner.worker_id).local_steps)
        learner.base_version = version
        learner.progress.reset()
        learner.awaiting, learner.ready, learner.uploading = None, False, False
        self.begin_segment(learner, self.now)

    def refresh_plan(self, learner: Learner) -> int:
        plan = self.core.plan(learner.worker_id)
        learner.progress.adopt((lease.shard_id, lease.epoch, lease.cursor) for lease in plan.shards)
        learner.plan_seq = plan.plan_seq
        return plan.local_steps

    def begin_segment(self, learner: Learner, t: float) -> None:
        steps = self.refresh_plan(learner)
        learner.seg_gen += 1
        learner.t_cursor = t
        if not learner.progress.cursors:  # no shards yet: ask again a little later
            learner.training = False
            if learner.shardless_since is None:
                learner.shardless_since = t
            self.at(t + learner.step_time * self.cfg.min_local_steps, "retry_plan", learner.idx, learner.incarnation)
            return
        self.end_shardless(learner, t)
        learner.training = True
        learner.segment_steps = steps
        self.at(t + steps * learner.step_time, "segment_end", learner.idx, learner.incarnation, learner.seg_gen)

    def end_shardless(self, learner: Learner, t: float) -> None:
        if learner.shardless_since is not None:
            self.shardless_s += t - learner.shardless_since
            learner.shardless_since = None

    def on_retry_plan(self, idx: int, inc: int) -> None:
        learner = self.learners[idx]
        if learner.incarnation == inc and learner.alive and not learner.training:
            self.begin_segment(learner, self.now)

    def advance(self, learner: Learner, t: float) -> None:
        """Run the whole inner steps that fit between the learner's cursor and `t`."""
        if not learner.training or not learner.alive:
            return
        n = math.floor((t - learner.t_cursor) / learner.step_time + _EPS)
        if n <= 0:
            return
        bs, seq = self.cfg.task.inner.batch_size, self.cfg.task.model.seq_len
        for _ in range(n):
            shard, epoch, cursor = learner.progress.next_shard()
            if learner.trainer is not None:
                assert self.corpus is not None
                x, y, nxt = self.corpus.batch(shard, cursor, bs, seq)
                learner.trainer.step(x, y)
            else:
                nxt = cursor + bs * seq
            learner.progress.consumed(shard, epoch, cursor, nxt)
        learner.t_cursor += n * learner.step_time
        self.busy_s[learner.idx] += n * learner.step_time

    def on_segment_end(self, idx: int, inc: int, gen: int) -> None:
        learner = self.learners[idx]
        if learner.incarnation != inc or not learner.alive or learner.seg_gen != gen:
            return
        self.advance(learner, self.now)
        if learner.uploading or learner.awaiting is not None:
            learner.ready = True  # keep training; submit once the previous submission is in
            return
        self.submit(learner)

    def submit(self, learner: Learner) -> None:
        t = self.now
        self.advance(learner, t)
        assert learner.ef is not None
        trainer = learner.trainer
        delta = trainer.pseudo_gradient() if trainer is not None else torch.full((1,), 1e-3)
        payload, meta = learner.ef.compress(delta)
        decoded = self.codec.decode(payload, meta)
        if learner.trainer is not None:
            learner.trainer.mark_submitted()
        nbytes = self.payload_bytes if learner.trainer is None else meta.encoded_bytes
        sid = f"s{next(self.sub_ids)}"
        ranges, steps, tokens = learner.progress.take()
        sub = Submission(learner.worker_id, sid, learner.base_version, tokens, steps, ranges, learner.plan_seq)
        self.sub_cost[sid] = (learner.idx, steps * learner.step_time)
        self.bytes_up += nbytes
        learner.uploading, learner.awaiting, learner.ready = True, sid, False
        self.at(
            t + self.cfg.latency_s + nbytes / self.cfg.bandwidth_bytes_per_s,
            "arrival",
            learner.idx,
            learner.incarnation,
            sub,
            decoded,
        )
        if self.cfg.mode == "sync":
            learner.training = False  # classic DiLoCo: wait for the new parameters
            return
        self.begin_segment(learner, t)

    def on_arrival(self, idx: int, inc: int, sub: Submission, delta: torch.Tensor) -> None:
        learner = self.learners[idx]
        if learner.incarnation != inc or not learner.alive:
            self.lost_uploads += 1  # the learner died mid-upload
            return
        learner.uploading = False
        try:
            res = self.core.accept(sub, delta, self.now)
        except DilocoError:
            self.rejected += 1
            self.resync(learner)
            return
        self.staleness.append(res.staleness)
        if res.applied:
            self.on_round(res.applied)
        self.schedule_deadline()

    def resync(self, learner: Learner) -> None:
        """A refused submission: adopt the newest parameters and the ledger's cursors, start over."""
        learner.training = False
        learner.seg_gen += 1
        if learner.ef is not None:
            learner.ef.reset()
        self.bytes_down += self.param_bytes
        self.at(
            self.now + self.cfg.latency_s + self.param_bytes / self.cfg.bandwidth_bytes_per_s,
            "start",
            learner.idx,
            learner.incarnation,
            self.core.version,
            self.core.params.clone(),
        )

    def on_round(self, applied: RoundApplied) -> None:
        for p in applied.submissions:
            self.useful_s += self.sub_cost.pop(p.submission_id)[1]
        self.record()
        if self.stop_reached():
            self.done = True
            return
        params = self.core.params.clone()
        applied_ids = {p.submission_id for p in applied.submissions}
        for learner in self.learners:
            if learner.alive:
                self.bytes_down += self.param_bytes
                self.at(
                    self.now + self.cfg.latency_s + self.param_bytes / self.cfg.bandwidth_bytes_per_s,
                    "broadcast",
                    learner.idx,
                    learner.incarnation,
                    applied.version,
                    params,
                    applied_ids,
                )

    def on_broadcast(self, idx: int, inc: int, version: int, params: torch.Tensor, applied: set[str]) -> None:
        learner = self.learners[idx]
        if learner.incarnation != inc or not learner.alive or version <= learner.base_version:
            return
        if learner.awaiting in applied:
            learner.awaiting = None
        if self.cfg.mode == "sync":
            if learner.training or learner.uploading:
                return  # still in its round (it joined late); it picks the version up after submitting
            if learner.trainer is not None:
                learner.trainer.load_global(params)
            learner.base_version = version
            learner.awaiting = None
            self.begin_segment(learner, self.now)
            return
        self.advance(learner, self.now)
        if learner.trainer is not None:
            learner.trainer.rebase(params)  # keeps the steps not yet submitted
        learner.base_version = version
        if learner.ready and not learner.uploading and learner.awaiting is None:
            self.submit(learner)

    def on_kill(self, idx: int, inc: int | None = None) -> None:
        learner = self.learners[idx]
        if not learner.alive or (inc is not None and learner.incarnation != inc):
            return
        self.advance(learner, self.now)
        self.end_shardless(learner, self.now)
        learner.alive = False
        learner.training = False
        learner.trainer = None
        learner.killed_at = self.now
        self.available_s[idx] += self.now - learner.alive_since
        self.at(self.now + self.cfg.dead_after_s, "detect", idx, learner.worker_id)
        if inc is not None and self.cfg.mtbf_s > 0:
            self.at(self.now + self.cfg.repair_s, "revive", idx)

    def on_detect(self, idx: int, worker_id: str) -> None:
        moved = self.core.remove(worker_id, DEAD, "missed heartbeats")
        if moved:
            self.reassign_latency.append(self.now - self.learners[idx].killed_at)
        applied = self.core.poll(self.now)
        if applied:
            self.on_round(applied)
        self.schedule_deadline()

    def on_revive(self, idx: int) -> None:
        learner = self.learners[idx]
        if not learner.alive:
            self.join(learner, self.now)

    def schedule_deadline(self) -> None:
        deadline = self.core.next_deadline()
        if deadline is not None and deadline != self.deadline_scheduled:
            self.deadline_scheduled = deadline
            self.at(max(deadline, self.now), "deadline")

    def on_deadline(self) -> None:
        self.deadline_scheduled = None
        applied = self.core.poll(self.now)
        if applied:
            self.on_round(applied)
        self.schedule_deadline()

    # --- measurements -----------------------------------------------------------------------------------------
    def evaluate(self) -> EvalResult:
        if self.task is None or self.corpus is None:
            return EvalResult(math.nan, 0)
        load_flat_(self.eval_model, self.core.params)
        return evaluate(
            self.eval_model, self.corpus, self.cfg.task.model.seq_len, self.cfg.eval_tokens, torch.device("cpu")
        )

    def record(self, force_eval: bool = False) -> None:
        v = self.core.version
        if not force_eval and v % self.cfg.eval_every and not self.stop_reached():
            return
        point = {
            "time_s": self.now,
            "tokens": float(self.core.tokens_applied),
            "version": float(v),
        }
        ev = self.evaluate()
        point.update(val_loss=ev.loss, eval_tokens=ev.tokens)
        self.history.append(point)
        if self.progress:
            self.progress(point)

    def stop_reached(self) -> bool:
        cfg = self.cfg
        return self.core.finished or (cfg.token_budget > 0 and self.core.tokens_applied >= cfg.token_budget)

    def result(self, initial: float) -> SimResult:
        available = sum(self.available_s)
        return SimResult(
            mode=self.cfg.mode,
            history=self.history,
            final_loss=self.history[-1]["val_loss"],
            initial_loss=initial,
            time_s=self.now,
            tokens=self.core.tokens_applied,
            rounds=self.core.version,
            goodput=self.useful_s / available if available > 0 else 0.0,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            mean_staleness=sum(self.staleness) / len(self.staleness) if self.staleness else 0.0,
            max_staleness=max(self.staleness, default=0),
            rejected=self.rejected,
            lost_uploads=self.lost_uploads,
            reassign_latency_s=self.reassign_latency,
            time_to_target_s=time_to_target(self.history, self.cfg.target_loss),
            shardless_s=self.shardless_s,
            busy_fraction={
                i: (self.busy_s[i] / self.available_s[i] if self.available_s[i] else 0.0)
                for i in range(self.cfg.num_learners)
            },
        )


def simulate(cfg: SimConfig, progress: Callable[[dict[str, float]], None] | None = None) -> SimResult:
    """Run one simulated job: the DiLoCo event engine, or the data-parallel baseline for `mode="dp"`."""
    if cfg.mode == "dp":
        return DataParallelSimulator(cfg, progress).run()
    return Simulator(cfg, progress).run()
