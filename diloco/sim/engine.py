"""The simulation loop: learners, links and failures on a virtual clock, driving the real cores.

The coordinator is the real `CoordinatorCore` and every learner the real `LearnerCore`, the object the worker
service drives: the learner's rules (when to submit, at most one submission outstanding, rebase, resync, the LR
catch-up, polling for a plan without shards, waiting for the round in `sync`) are written there, once. This module
is an adapter: it feeds each learner's core what happened and carries out the actions it returns on a virtual
clock, and keeps only time, links, failures and measurements:

- an inner step (`Train`) of a learner with relative speed `v` takes `step_time_s / v`; a `Submit` of `n` bytes
  reaches the coordinator after `latency_s + n / bandwidth`; so do the parameters, towards each learner: once
  after it registers (the watch's first message) and after every round (the broadcast, with the applied
  submission ids). The learner's plan rides along, read when the parameters arrive. Learners get the real
  broadcast shadow `Θ̂` (`BroadcastShadow`, ALGORITHM.md section 10): on registering, what a fresh learner holding
  the version 0 it built from the seed needs (`updates_since` with its checksum: nothing while version 0 is
  current, else the chain of deltas from it while the window holds it, else a full fp32 snapshot), then each
  version's delta in `broadcast_codec` (the encoded sizes are what `bytes_down` counts).
- control calls (`Register`, `FetchPlan`, `Deregister`) take no time; `Load` and `Rebase` run on the learner's
  `InnerTrainer`; `Wait(until)` wakes the learner at `until`.
- training is lazy: when an event touches a learner, the whole steps that end by the event's time run first, then
  the event is fed to the core, then the actions it asks for at that time; a step in progress at an event is
  computed after it, from its start, so no step is lost to an event. A learner also wakes itself when its next
  submission falls due and at the core's `next_deadline()`.
- a kill ends the session (`session_ended`); a revived learner starts a new model replica and registers again;
  the coordinator hears of the death `dead_after_s` later (healthd).
- with a fleet (`diloco.sim.fleet`), the placement policy (`diloco.core.energy.decide`) is asked at the start
  and at every round's close, with the learners' profile speeds, power, zone intensity now and prices; its weights
  go to the coordinator (`set_placement_weights`). A learner's energy is its power x the time of its inner steps,
  its carbon that energy x its zone's average intensity over those steps, its cost its price x the wall time it
  is alive and not paused.
- with streaming fragments (`fragments` P > 1, `diloco.core.fragments`) the coordinator is a
  `FragmentedCoordinator` around the same core: a learner submits one fragment at a time (its trainer's
  `submit_range`, one error-feedback residual per fragment), a round broadcasts only the fragments it stepped
  (`FragmentShadows`, their deltas are what `bytes_down` counts) and learners rebase only those (`rebase_ranges`).
  Every transfer on a learner link is logged for the peak link bandwidth (`diloco.sim.links`).

Events at equal times run in the order they were scheduled, so runs are deterministic for a seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from diloco.core import learner as lc
from diloco.core.broadcast import BroadcastShadow, params_checksum
from diloco.core.codecs import ErrorFeedback, get_codec
from diloco.core.coordinator import (
    AcceptResult,
    CoordinatorConfig,
    CoordinatorCore,
    RoundApplied,
    Submission,
    WorkPlan,
)
from diloco.core.energy import LearnerInfo, PauseDelay, decide
from diloco.core.fragments import (
    FragmentedCoordinator,
    FragmentLayout,
    FragmentShadows,
    FragmentSubmission,
    check_fragments,
)
from diloco.core.merge import Segment
from diloco.core.states import DEAD, LEFT
from diloco.errors import ConfigError, DilocoError
from diloco.sim.config import DILOCO_MODES, SimConfig
from diloco.sim.dp import DataParallelSimulator
from diloco.sim.events import EventLoop
from diloco.sim.links import Transfer, link_peaks
from diloco.sim.result import SimResult, encoded_size, time_to_target
from diloco.task.data import Corpus, EvalResult, evaluate
from diloco.task.factory import Task, build_task
from diloco.task.inner import InnerTrainer
from diloco.task.params import flatten_params, load_flat_, merge_segments

__all__ = ["Learner", "SimResult", "Simulator", "encoded_size", "simulate"]

_EPS = 1e-9  # in inner steps: a step that ends within this of an event's time ends by it


@dataclass
class Learner:
    """One simulated learner: its core, and what carrying out the core's actions needs."""

    idx: int
    speed: float
    step_time: float
    core: lc.LearnerCore
    alive: bool = False
    incarnation: int = 0
    trainer: InnerTrainer | None = None
    efs: list[ErrorFeedback] = field(default_factory=list)  # error feedback: the whole model's, or one per fragment
    params: tuple[int, torch.Tensor] | None = None  # the newest version the core took, and its tensor
    version0: torch.Tensor | None = None  # the version 0 this process built, until it adopts parameters
    training: bool = False  # False: idle until an event or a deadline
    t: float = 0.0  # while training: when the next (or the in-progress) inner step started
    clock: float = 0.0  # the last time given to the core (never goes back)
    wake_at: float | None = None  # the learner's own wake-up event, if one is pending
    wake_gen: int = 0
    alive_since: float = 0.0
    killed_at: float = 0.0
    shardless_since: float | None = None  # registered, but its plan holds no shard

    @property
    def tol(self) -> float:
        return _EPS * self.step_time


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
        self.codec = get_codec(cfg.codec, topk_fraction=cfg.topk_fraction)
        self.task: Task | None = None
        self.corpus: Corpus | None = None
        segments: list[Segment] | None = None
        if cfg.train:
            self.task = build_task(cfg.task_config())
            self.corpus = self.task.corpus
            model = self.task.model_fn(cfg.seed)
            params = flatten_params(model).cpu()  # version 0; every learner builds it too (`join`)
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
            target_outer_steps=cfg.outer_steps * cfg.fragments,  # fragments: P rounds per whole-model step
        )
        # streaming fragments (diloco.core.fragments): the same core, with the tensor work and broadcasts per fragment
        self.frag: FragmentedCoordinator | None = None
        self.shadows: FragmentShadows | None = None
        if cfg.fragments > 1:
            assert segments is not None  # SimConfig refuses fragments without a model
            p = check_fragments(cfg.fragments, cfg.local_steps, len(segments))
            layout = FragmentLayout.of_segments(segments, p)
            self.frag = FragmentedCoordinator(core_cfg, params, shard_lengths, layout, segments)
            self.core = self.frag.core
            self.shadows = FragmentShadows(self.core.params, layout, cfg.broadcast_codec)
        else:
            self.core = CoordinatorCore(core_cfg, params, shard_lengths, segments)
        self.broadcast = BroadcastShadow(self.core.params, self.core.version, cfg.broadcast_codec)
        self.transfers: list[Transfer] = []  # every learner-link transfer, for the peak bandwidth
        self.delta_bytes = encoded_size(get_codec(cfg.broadcast_codec), self.model_numel)  # for --no-train
        self.learners = [
            Learner(i, v, cfg.step_time_s / v, lc.LearnerCore(lc.LearnerConfig(id_prefix=f"l{i}-")))
            for i, v in enumerate(cfg.speeds)
        ]
        for learner in self.learners:
            learner.core.use_fragments(cfg.fragments)
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
        # energy, carbon, cost (with a fleet): per learner, and the policy's decisions
        self.policy = cfg.policy_config()
        self.pause_delay = PauseDelay(0.0)  # the time pauses cost the job so far (the energy policy's budget)
        self.energy_j = [0.0] * cfg.num_learners
        self.carbon_g = [0.0] * cfg.num_learners
        self.paid_s = [0.0] * cfg.num_learners  # alive and not paused
        self.paid_since: list[float | None] = [None] * cfg.num_learners
        self.paused: set[int] = set()
        self.placements: list[dict[str, object]] = []  # placement.changed: time, reason, paused learners

    # --- event queue ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        cfg = self.cfg
        initial = self.evaluate()
        self.history.append(
            {
                "time_s": 0.0,
                "tokens": 0,
                "version": 0,
                "bytes": 0,
                "val_loss": initial.loss,
                "eval_tokens": initial.tokens,
            }
        )
        for learner in self.learners:
            self.join(learner)
        self.apply_policy()
        for e in cfg.failures:
            self.at(e.at_s, e.action, e.learner)
        self.run_events(cfg.max_time_s)
        for learner in self.learners:
            if learner.alive:
                self.available_s[learner.idx] += self.now - learner.alive_since
                self.end_shardless(learner)
            self.set_paid(learner.idx, False)
        if self.history[-1]["version"] != self.core.version:
            self.record(force_eval=True)
        return self.result(initial.loss)

    def transfer_s(self, nbytes: int) -> float:
        """Time for `nbytes` over one learner's link."""
        return self.cfg.latency_s + nbytes / self.cfg.bandwidth_bytes_per_s

    # --- driving a learner's core -----------------------------------------------------------------------------
    def touch(self, learner: Learner, event: Callable[[lc.LearnerCore], None] | None = None) -> None:
        """Bring `learner` to the current time: run the steps that end by now, feed its core `event`, carry out
        what the core asks for now, and schedule the learner's next wake-up."""
        self.act(learner, before_event=True)
        if not learner.alive:
            return
        learner.clock = max(learner.clock, self.now)
        if event is not None:
            event(learner.core)
        self.act(learner, before_event=False)

    def act(self, learner: Learner, before_event: bool) -> None:
        """Carry out the core's actions up to now; `before_event`: stop when the learner reaches now."""
        now, step = self.now, learner.step_time
        done = 0  # steps run since learner.t
        while learner.alive:
            if learner.training:
                fits = math.floor((now - learner.t) / step + _EPS)  # whole steps from learner.t that end by now
                if before_event and done >= fits:
                    break
                learner.clock = max(learner.clock, learner.t + done * step)
            elif before_event:
                break
            action = learner.core.next_action(learner.clock)
            if isinstance(action, lc.Train):
                if not learner.training:
                    learner.training, learner.t, done, fits = True, now, 0, 0
                if done >= fits:
                    break  # the step in progress ends after now
                self.train(learner, action)
                done += 1
                continue
            self.count_steps(learner, done)
            done = 0
            when = now if learner.clock >= now - learner.tol else learner.clock
            if learner.training and learner.t >= now - learner.tol:
                learner.t = now  # at a step boundary
            if isinstance(action, lc.Wait):
                learner.training = False
                if action.until is not None and action.until <= now:
                    continue  # idle until `until`, which has passed: ask again now
                break
            if isinstance(action, lc.Exit):
                learner.training = False
                break
            self.carry_out(learner, action, when)
        self.count_steps(learner, done)
        self.schedule_wake(learner)
        self.track_shardless(learner)

    def train(self, learner: Learner, a: lc.Train) -> None:
        bs, seq = self.cfg.task.inner.batch_size, self.cfg.task.model.seq_len
        if learner.trainer is not None:
            assert self.corpus is not None
            x, y, nxt = self.corpus.batch(a.shard_id, a.cursor, bs, seq)
            learner.trainer.step(x, y)
        else:
            nxt = a.cursor + bs * seq
        learner.core.stepped(a.shard_id, a.epoch, a.cursor, nxt)

    def count_steps(self, learner: Learner, n: int) -> None:
        if n:
            self.account_energy(learner.idx, learner.t, learner.t + n * learner.step_time)
            learner.t += n * learner.step_time
            self.busy_s[learner.idx] += n * learner.step_time

    # --- energy, carbon and cost ------------------------------------------------------------------------------
    def account_energy(self, idx: int, t0: float, t1: float) -> None:
        """A learner trained from `t0` to `t1`: its power for that time, at its zone's intensity then."""
        if not self.cfg.fleet:
            return
        spec = self.cfg.fleet[idx]
        joules = spec.hw.watts * (t1 - t0)
        self.energy_j[idx] += joules
        trace = self.cfg.carbon_trace
        if trace is not None:
            self.carbon_g[idx] += joules / 3.6e6 * trace.mean(spec.zone, t0, t1)

    def set_paid(self, idx: int, paid: bool) -> None:
        """Start or stop counting a learner's wall time for its price (alive and not paused)."""
        since = self.paid_since[idx]
        if since is not None and not paid:
            self.paid_s[idx] += self.now - since
            self.paid_since[idx] = None
        elif since is None and paid:
            self.paid_since[idx] = self.now

    def apply_policy(self) -> None:
        """Ask the placement policy (`diloco.core.energy.decide`) for weights now; hand them to the coordinator."""
        if not self.cfg.fleet:
            for learner in self.learners:
                self.set_paid(learner.idx, learner.alive)
            return
        live = {lr.core.worker_id: lr for lr in self.learners if lr.alive and lr.core.worker_id}
        trace = self.cfg.carbon_trace
        infos = {}
        for w, lr in live.items():
            spec = self.cfg.fleet[lr.idx]
            infos[w] = LearnerInfo(
                speed=lr.speed * self.tokens_per_step / self.cfg.step_time_s,
                watts=spec.hw.watts,
                intensity=trace.intensity(spec.zone, self.now) if trace is not None else 0.0,
                price_per_hour=spec.price_per_hour,
                spot=spec.spot,
                zone=spec.zone,
                paused=lr.idx in self.paused,
            )
        left = max(0, self.cfg.token_budget - self.core.tokens_applied) if self.cfg.token_budget else 0
        delay = self.pause_delay.advance(self.now)
        decision = decide(self.now, infos, self.policy, tokens_left=left, delay_s=delay)
        self.pause_delay.follow(decision)
        paused = {live[w].idx for w in decision.paused}
        for learner in self.learners:
            self.set_paid(learner.idx, learner.alive and learner.idx not in paused)
        if self.core.set_placement_weights(decision.weights) or not self.placements:
            self.placements.append({"time_s": self.now, "reason": decision.reason, "paused": sorted(paused)})
        self.paused = paused

    def carry_out(self, learner: Learner, a: lc.Action, t: float) -> None:
        """One action other than Train, Wait and Exit, at time `t`."""
        trainer = learner.trainer
        if isinstance(a, lc.Register):
            self.register(learner, t)
        elif isinstance(a, lc.Load):
            assert learner.params is not None and learner.params[0] == a.version
            learner.version0 = None
            if trainer is not None:
                trainer.load_global(learner.params[1])
                trainer.catch_up(a.catch_up_steps)
            if a.reset_codec:
                for ef in learner.efs:
                    ef.reset()
        elif isinstance(a, lc.Rebase):
            assert learner.params is not None and learner.params[0] == a.version
            if trainer is not None and a.fragments is None:
                trainer.rebase(learner.params[1])  # keeps the steps not yet submitted
            elif trainer is not None and self.frag is not None and a.fragments is not None:  # the changed fragments
                trainer.rebase_ranges(learner.params[1], [self.frag.layout.range(p) for p in a.fragments])
        elif isinstance(a, lc.Submit):
            self.submit(learner, a.draft, t)
        elif isinstance(a, lc.FetchPlan):
            plan = self.plan_of(learner, lc.Rpc.GET_WORK_PLAN, t)
            if plan is not None:
                learner.core.plan_received(t, plan)
        elif isinstance(a, lc.Deregister):
            try:
                self.core.remove(a.worker_id, LEFT, "deregistered")
            except DilocoError as e:
                learner.core.rpc_failed(t, lc.Rpc.DEREGISTER, e.code, str(e))

    def plan_of(self, learner: Learner, rpc: lc.Rpc, t: float) -> WorkPlan | None:
        """The learner's plan as the coordinator has it now (None: the call failed, and the core was told)."""
        try:
            return self.core.plan(learner.core.worker_id)
        except DilocoError as e:
            learner.core.rpc_failed(t, rpc, e.code, str(e))
            return None

    def schedule_wake(self, learner: Learner) -> None:
        """Wake the learner when its submission falls due or its core's deadline comes, whichever is first."""
        times: list[float] = []
        if learner.alive and learner.training and learner.core.steps_to_submit > 0:
            times.append(learner.t + learner.core.steps_to_submit * learner.step_time)
        deadline = learner.core.next_deadline() if learner.alive else None
        if deadline is not None:
            times.append(max(deadline, self.now))
        wake = min(times, default=None)
        if wake is not None and learner.wake_at is not None and abs(wake - learner.wake_at) <= learner.tol:
            return  # already due then (up to rounding)
        learner.wake_gen += 1
        learner.wake_at = wake
        if wake is not None:
            self.at(wake, "wake", learner.idx, learner.incarnation, learner.wake_gen)

    def on_wake(self, idx: int, inc: int, gen: int) -> None:
        learner = self.learners[idx]
        if learner.incarnation != inc or not learner.alive or learner.wake_gen != gen:
            return
        learner.wake_at = None
        self.touch(learner)

    def track_shardless(self, learner: Learner) -> None:
        if learner.alive and learner.core.state is lc.LearnerState.SHARDLESS:
            if learner.shardless_since is None:
                learner.shardless_since = self.now
        else:
            self.end_shardless(learner)

    def end_shardless(self, learner: Learner) -> None:
        if learner.shardless_since is not None:
            self.shardless_s += self.now - learner.shardless_since
            learner.shardless_since = None

    # --- carrying out the learner's calls ---------------------------------------------------------------------
    def join(self, learner: Learner) -> None:
        """A learner process starts (again): a new model replica; its core registers."""
        learner.alive = True
        learner.alive_since = self.now
        learner.incarnation += 1
        learner.training, learner.params, learner.clock = False, None, self.now
        learner.version0 = torch.zeros(1)  # --no-train: the coordinator's stand-in parameters
        if self.task is not None:
            model = self.task.model_fn(self.cfg.seed)
            learner.version0 = flatten_params(model).cpu()
            assert self.corpus is not None
            learner.trainer = InnerTrainer(
                model, self.corpus, self.cfg.task.inner, seq_len=self.cfg.task.model.seq_len, device=torch.device("cpu")
            )
        sizes = (
            [self.core.params.numel()]
            if self.frag is None
            else [*map(self.frag.layout.size, range(self.frag.fragments))]
        )
        learner.efs = [
            ErrorFeedback(self.codec, n, enabled=self.cfg.error_feedback, decay=self.cfg.ef_decay) for n in sizes
        ]
        self.touch(learner)
        if self.cfg.mtbf_s > 0:
            self.at(self.now + self.rng.expovariate(1 / self.cfg.mtbf_s), "kill", learner.idx, learner.incarnation)

    def register(self, learner: Learner, t: float) -> None:
        """Register, then the watch brings the learner to the current version: from the version 0 it built when it
        started (named by its checksum, until the process adopted parameters), else from a full snapshot."""
        rec = self.core.register(f"learner{learner.idx}", t, speed=learner.speed * self.tokens_per_step)
        learner.core.registered(t, rec.worker_id, 0, self.cfg.mode, self.core.plan(rec.worker_id))
        if self.shadows is not None:  # fragments: a full snapshot (version 0 is not named per fragment yet)
            self.send_params(learner, t, self.core.version, self.shadow(), (), self.param_bytes, snapshot=True)
            return
        own, chain = learner.version0, None
        if own is not None:
            chain = self.broadcast.updates_since(0, self.core.version, params_checksum(own))
        if chain is None:
            nbytes = self.param_bytes
        else:
            nbytes = sum(self.delta_bytes if self.task is None else d.meta.encoded_bytes for d in chain)
        self.send_params(learner, t, self.core.version, self.shadow(), (), nbytes, snapshot=chain is None)

    def shadow(self) -> torch.Tensor:
        """A copy of what learners hold of the newest version (`Θ̂`; with fragments, every fragment's)."""
        return self.shadows.shadow if self.shadows is not None else self.broadcast.shadow.clone()

    def send_params(
        self,
        learner: Learner,
        t: float,
        version: int,
        params: torch.Tensor,
        applied: Iterable[str],
        nbytes: int,
        snapshot: bool = False,
    ) -> None:
        """Stream `version` (`nbytes` on the wire) to the learner's current registration (a watch ends with its
        registration)."""
        self.bytes_down += nbytes
        self.transfers.append(Transfer(learner.idx, False, t, nbytes, snapshot))
        arrive = t + self.transfer_s(nbytes)
        versions = tuple(self.frag.fragment_versions) if self.frag is not None else ()
        self.at(arrive, "params", learner.idx, learner.core.worker_id, version, params, frozenset(applied), versions)

    def on_params(
        self,
        idx: int,
        worker_id: str,
        version: int,
        params: torch.Tensor,
        applied: frozenset[str],
        fragment_versions: tuple[int, ...],
    ) -> None:
        """Parameters arrive with the learner's plan, the submissions they hold and whether the job finished (and,
        with fragments, the version that last changed each fragment)."""
        learner = self.learners[idx]
        if not learner.alive or learner.core.worker_id != worker_id:
            return

        def arrived(core: lc.LearnerCore) -> None:
            plan = self.plan_of(learner, lc.Rpc.WATCH_PARAMETERS, self.now)
            finished = self.core.finished
            if plan is not None and core.params_arrived(
                self.now, version, 0, plan, applied, finished, fragment_versions=fragment_versions
            ):
                learner.params = (version, params)

        self.touch(learner, arrived)

    def submit(self, learner: Learner, d: lc.SubmissionDraft, t: float) -> None:
        trainer = learner.trainer
        sub = Submission(d.worker_id, d.submission_id, d.base_version, d.tokens, d.steps, d.ranges, d.plan_seq)
        if self.frag is not None:  # one fragment: its slice, its own error feedback
            assert trainer is not None
            delta = trainer.submit_range(*self.frag.layout.range(d.fragment))
            payload, meta = learner.efs[d.fragment].compress(delta)
            sent: Submission | FragmentSubmission = FragmentSubmission(sub, d.fragment, self.frag.layout.fingerprint)
        else:
            delta = trainer.pseudo_gradient() if trainer is not None else torch.full((1,), 1e-3)
            payload, meta = learner.efs[0].compress(delta)
            if trainer is not None:
                trainer.mark_submitted()
            sent = sub
        decoded = self.codec.decode(payload, meta)
        nbytes = self.payload_bytes if trainer is None else meta.encoded_bytes
        self.sub_cost[d.submission_id] = (learner.idx, d.steps * learner.step_time)
        self.bytes_up += nbytes
        self.transfers.append(Transfer(learner.idx, True, t, nbytes))
        self.at(t + self.transfer_s(nbytes), "arrival", learner.idx, learner.incarnation, sent, decoded)

    def accept(self, sent: Submission | FragmentSubmission, delta: torch.Tensor) -> AcceptResult:
        if isinstance(sent, FragmentSubmission):
            assert self.frag is not None
            return self.frag.accept(sent, delta, self.now)
        return self.core.accept(sent, delta, self.now)

    def poll(self) -> RoundApplied | None:
        return self.frag.poll(self.now) if self.frag is not None else self.core.poll(self.now)

    def on_arrival(self, idx: int, inc: int, sent: Submission | FragmentSubmission, delta: torch.Tensor) -> None:
        learner = self.learners[idx]
        if learner.incarnation != inc or not learner.alive:
            self.lost_uploads += 1  # the learner died mid-upload
            return
        sub = sent.sub if isinstance(sent, FragmentSubmission) else sent
        try:
            res = self.accept(sent, delta)
        except DilocoError as e:
            self.rejected += 1
            reaction, detail = lc.react(lc.Rpc.SUBMIT, e.code), str(e)
            self.touch(learner, lambda core: core.upload_failed(self.now, sub.submission_id, reaction, detail))
            return
        self.staleness.append(res.staleness)
        if res.applied:
            self.on_round(res.applied)
        self.schedule_deadline()
        if not self.done:
            self.touch(learner, lambda core: core.upload_accepted(self.now, sub.submission_id, res.round))

    def on_round(self, applied: RoundApplied) -> None:
        for p in applied.submissions:
            self.useful_s += self.sub_cost.pop(p.submission_id)[1]
        self.record()
        if self.stop_reached():
            self.done = True
            return
        self.apply_policy()
        if self.frag is not None:
            nbytes = self.broadcast_fragments(applied.version)
            params = self.shadow()
        else:
            self.broadcast.forget_through(self.core.held_floor())  # as the coordinator: deltas no live learner needs
            delta = self.broadcast.advance(self.core.params, applied.version)
            self.broadcast.record(delta)
            params = self.broadcast.shadow.clone()
            nbytes = (
                self.param_bytes
                if delta is None
                else self.delta_bytes
                if self.task is None
                else delta.meta.encoded_bytes
            )
        ids = [p.submission_id for p in applied.submissions]
        for learner in self.learners:
            if learner.alive:
                self.send_params(learner, self.now, applied.version, params, ids, nbytes)

    def broadcast_fragments(self, version: int) -> int:
        """Move the shadow of every fragment round `version` stepped; returns the bytes of their deltas (of a
        fragment's fp32 snapshot where the codec is fp32 or the delta could not be encoded)."""
        assert self.frag is not None and self.shadows is not None
        nbytes = 0
        for p in self.frag.stepped_in(version):
            delta = self.shadows.advance(self.core.params, p, self.frag.fragment_steps[p])
            nbytes += 4 * self.frag.layout.size(p) if delta is None else delta.meta.encoded_bytes
        return nbytes

    # --- failures ---------------------------------------------------------------------------------------------
    def on_kill(self, idx: int, inc: int | None = None) -> None:
        learner = self.learners[idx]
        if not learner.alive or (inc is not None and learner.incarnation != inc):
            return
        self.act(learner, before_event=True)
        self.end_shardless(learner)
        worker_id = learner.core.worker_id
        learner.core.session_ended(self.now, "killed")
        learner.alive = False
        learner.training = False
        learner.trainer = None
        learner.params = None
        learner.wake_gen += 1
        learner.wake_at = None
        learner.killed_at = self.now
        self.set_paid(idx, False)
        self.available_s[idx] += self.now - learner.alive_since
        self.at(self.now + self.cfg.dead_after_s, "detect", idx, worker_id)
        if inc is not None and self.cfg.mtbf_s > 0:
            self.at(self.now + self.cfg.repair_s, "revive", idx)

    def on_detect(self, idx: int, worker_id: str) -> None:
        moved = self.core.remove(worker_id, DEAD, "missed heartbeats")
        if moved:
            self.reassign_latency.append(self.now - self.learners[idx].killed_at)
        applied = self.poll()
        if applied:
            self.on_round(applied)
        self.schedule_deadline()

    def on_revive(self, idx: int) -> None:
        learner = self.learners[idx]
        if not learner.alive:
            self.join(learner)

    def schedule_deadline(self) -> None:
        deadline = self.core.next_deadline()
        if deadline is not None and deadline != self.deadline_scheduled:
            self.deadline_scheduled = deadline
            self.at(max(deadline, self.now), "deadline")

    def on_deadline(self) -> None:
        self.deadline_scheduled = None
        applied = self.poll()
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
        if not force_eval and v % (self.cfg.eval_every * self.cfg.fragments) and not self.stop_reached():
            return
        point = {
            "time_s": self.now,
            "tokens": float(self.core.tokens_applied),
            "version": float(v),
            "bytes": float(self.bytes_up + self.bytes_down),
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
            placement=self.cfg.placement,
            energy_j=sum(self.energy_j),
            carbon_g=sum(self.carbon_g),
            cost=sum(s / 3600 * f.price_per_hour for s, f in zip(self.paid_s, self.cfg.fleet, strict=False)),
            per_learner=[
                {"energy_j": e, "carbon_g": c, "paid_s": s, "busy_s": b}
                for e, c, s, b in zip(self.energy_j, self.carbon_g, self.paid_s, self.busy_s, strict=True)
            ],
            placements=self.placements,
            fragments=self.cfg.fragments,
            peak_window_s=self.cfg.peak_window_s,
            peak_bytes_per_s=link_peaks(self.transfers, self.cfg.bandwidth_bytes_per_s, self.cfg.peak_window_s),
        )


def simulate(cfg: SimConfig, progress: Callable[[dict[str, float]], None] | None = None) -> SimResult:
    """Run one simulated job: the DiLoCo event engine, or the data-parallel baseline for `mode="dp"`."""
    if cfg.mode == "dp":
        return DataParallelSimulator(cfg, progress).run()
    return Simulator(cfg, progress).run()
