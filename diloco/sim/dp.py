"""The data-parallel baseline (`SimConfig.mode="dp"`) on the same virtual clock: every inner step is synchronized.

It models an elastic, torchft-like data-parallel job, which is generous to data-parallel:

- Every step each live learner computes one batch. The step takes the slowest live learner's step time, then a
  ring all-reduce of the full fp32 gradient: `2·(M−1)/M·4·numel / bandwidth + 2·(M−1)·latency` for M live
  learners. Each learner sends `2·(M−1)/M·4·numel` bytes per step and receives as many; they count as `bytes_up`
  and `bytes_down`, the traffic on the learner links, as in the DiLoCo modes.
- Training is one model whose step uses the concatenation of the live learners' batches (the same as averaging
  their gradients), with AdamW and the task's inner config; evaluation is of that model.
- Data: each learner of a step reads the next shard, round-robin over all shards, at that shard's cursor. Cursors
  move only when a step completes, so the data of a lost step is read again (no data lost or counted twice).
- A failure of a learner in the step loses that step for everyone, and the job stalls `dead_after_s` (detection)
  before it goes on with the survivors. A revived learner first downloads the parameters and the AdamW moments
  from a peer (`latency + 12·numel / bandwidth`), then joins the next step.
- Random failures follow the same process and random stream as in the event engine (exponential time to failure
  per incarnation, revival after `repair_s`), so for a seed the failure times are the same in every mode.

A "round" for the stopping rule `outer_steps` and for `eval_every` is `local_steps` (H) optimizer steps, so the
loss curve has the density of a `sync` run's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.errors import ConfigError
from diloco.sim.config import SimConfig
from diloco.sim.events import EventLoop
from diloco.sim.result import SimResult, time_to_target
from diloco.task.data import Corpus, EvalResult, evaluate
from diloco.task.factory import build_task
from diloco.task.inner import InnerTrainer
from diloco.task.params import num_params

REJOIN_STATE_COPIES = 3  # parameters + AdamW's two moments


def allreduce_seconds(numel: int, learners: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce of `numel` fp32 values over `learners` peers: reduce-scatter then all-gather."""
    if learners <= 1:
        return 0.0
    m = learners
    return 2 * (m - 1) / m * 4 * numel / bandwidth_bytes_per_s + 2 * (m - 1) * latency_s


def allreduce_bytes_per_learner(numel: int, learners: int) -> int:
    """Bytes each learner sends (and receives) in one ring all-reduce of `numel` fp32 values."""
    if learners <= 1:
        return 0
    return round(2 * (learners - 1) / learners * 4 * numel)


@dataclass
class _Peer:
    idx: int
    step_time: float
    alive: bool = False
    ready: bool = False  # holds the current parameters and optimizer state
    incarnation: int = 0
    alive_since: float = 0.0


class DataParallelSimulator(EventLoop):
    def __init__(self, cfg: SimConfig, progress: Callable[[dict[str, float]], None] | None = None) -> None:
        super().__init__()
        if cfg.mode != "dp":
            raise ConfigError(f"DataParallelSimulator runs mode 'dp', got {cfg.mode!r}; use Simulator for DiLoCo")
        self.cfg = cfg
        self.progress = progress
        self.rng = random.Random(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.tokens_per_step = cfg.task.inner.batch_size * cfg.task.model.seq_len
        self.trainer: InnerTrainer | None = None
        self.corpus: Corpus | None = None
        if cfg.train:
            task = build_task(cfg.task_config())
            self.corpus = task.corpus
            model = task.model_fn(cfg.seed)
            self.numel = num_params(model)
            self.trainer = InnerTrainer(
                model, self.corpus, cfg.task.inner, seq_len=cfg.task.model.seq_len, device=torch.device("cpu")
            )
        else:
            self.numel = cfg.model_numel or 1_000_000
        self.param_bytes = 4 * self.numel
        self.peers = [_Peer(i, cfg.step_time_s / v) for i, v in enumerate(cfg.speeds)]
        self.cursors = [0] * cfg.num_shards
        self.turn = 0
        self.history: list[dict[str, float]] = []
        self.steps = 0
        self.tokens = 0
        self.lost_steps = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.useful_s = 0.0
        self.busy_s = [0.0] * cfg.num_learners
        self.available_s = [0.0] * cfg.num_learners
        self.stall_latency: list[float] = []
        self.gen = 0  # invalidates a lost step's end and superseded resumes
        self.in_flight: list[int] | None = None
        self.step_started = 0.0
        self.stalled_until: float | None = None

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
        for peer in self.peers:
            self.join(peer, rejoin=False)
        for e in cfg.failures:
            self.at(e.at_s, e.action, e.learner)
        self.run_events(cfg.max_time_s)
        for peer in self.peers:
            if peer.alive:
                self.available_s[peer.idx] += self.now - peer.alive_since
        if self.history[-1]["version"] != self.steps:
            self.record(force=True)
        return self.result(initial.loss)

    # --- membership -------------------------------------------------------------------------------------------
    def join(self, peer: _Peer, *, rejoin: bool) -> None:
        """A (new incarnation of a) learner fetches the state, then joins the next step."""
        cfg = self.cfg
        peer.alive, peer.ready = True, False
        peer.alive_since = self.now
        peer.incarnation += 1
        state_bytes = self.param_bytes * (REJOIN_STATE_COPIES if rejoin else 1)
        self.bytes_down += state_bytes
        if rejoin:
            self.bytes_up += state_bytes  # sent by a surviving peer over its link
        self.at(self.now + cfg.latency_s + state_bytes / cfg.bandwidth_bytes_per_s, "ready", peer.idx, peer.incarnation)
        if cfg.mtbf_s > 0:
            self.at(self.now + self.rng.expovariate(1 / cfg.mtbf_s), "kill", peer.idx, peer.incarnation)

    def on_ready(self, idx: int, inc: int) -> None:
        peer = self.peers[idx]
        if peer.alive and peer.incarnation == inc:
            peer.ready = True
            self.at(self.now, "start")  # after the other events of this instant (more learners may get ready)

    def on_kill(self, idx: int, inc: int | None = None) -> None:
        peer = self.peers[idx]
        if not peer.alive or (inc is not None and peer.incarnation != inc):
            return
        was_member = peer.ready
        peer.alive, peer.ready = False, False
        self.available_s[idx] += self.now - peer.alive_since
        if inc is not None and self.cfg.mtbf_s > 0:
            self.at(self.now + self.cfg.repair_s, "revive", idx)
        if self.in_flight is not None and idx in self.in_flight:
            for i in self.in_flight:  # the compute done so far is lost
                self.busy_s[i] += min(self.peers[i].step_time, self.now - self.step_started)
            self.in_flight = None
            self.lost_steps += 1
        elif not (was_member and self.stalled_until is not None):
            return  # not part of a step: the others do not notice
        self.gen += 1
        self.stalled_until = self.now + self.cfg.dead_after_s
        self.stall_latency.append(self.cfg.dead_after_s)
        self.at(self.stalled_until, "resume", self.gen)

    def on_revive(self, idx: int) -> None:
        peer = self.peers[idx]
        if not peer.alive:
            self.join(peer, rejoin=True)

    def on_resume(self, gen: int) -> None:
        if gen == self.gen:
            self.stalled_until = None
            self.at(self.now, "start")

    # --- steps ------------------------------------------------------------------------------------------------
    def on_start(self) -> None:
        """Start the next step with every learner that is ready, unless one is running or the job stalls."""
        if self.done or self.in_flight is not None or self.stalled_until is not None:
            return
        members = [p.idx for p in self.peers if p.alive and p.ready]
        if not members:
            return  # idle until a learner is ready
        cfg = self.cfg
        compute = max(self.peers[i].step_time for i in members)
        comm = allreduce_seconds(self.numel, len(members), cfg.bandwidth_bytes_per_s, cfg.latency_s)
        self.in_flight = members
        self.step_started = self.now
        self.gen += 1
        self.at(self.now + compute + comm, "step_end", self.gen)

    def on_step_end(self, gen: int) -> None:
        if gen != self.gen or self.in_flight is None:
            return
        members, self.in_flight = self.in_flight, None
        self.train_step(members)
        per_learner = allreduce_bytes_per_learner(self.numel, len(members))
        self.bytes_up += per_learner * len(members)
        self.bytes_down += per_learner * len(members)
        for i in members:
            self.busy_s[i] += self.peers[i].step_time
            self.useful_s += self.peers[i].step_time
        self.steps += 1
        self.tokens += self.tokens_per_step * len(members)
        if self.stop_reached():
            self.done = True
            self.record(force=True)
            return
        if self.steps % (self.cfg.eval_every * self.cfg.local_steps) == 0:
            self.record()
        self.at(self.now, "start")

    def train_step(self, members: list[int]) -> None:
        """One optimizer step on the concatenated batches of `members` (one batch each, in learner order)."""
        bs, seq = self.cfg.task.inner.batch_size, self.cfg.task.model.seq_len
        xs, ys = [], []
        for _ in members:
            shard = self.turn % self.cfg.num_shards
            self.turn += 1
            if self.corpus is not None:
                x, y, self.cursors[shard] = self.corpus.batch(shard, self.cursors[shard], bs, seq)
                xs.append(x)
                ys.append(y)
            else:
                self.cursors[shard] += bs * seq
        if self.trainer is not None:
            self.trainer.step(torch.cat(xs), torch.cat(ys))

    def stop_reached(self) -> bool:
        cfg = self.cfg
        return (cfg.token_budget > 0 and self.tokens >= cfg.token_budget) or (
            cfg.outer_steps > 0 and self.steps >= cfg.outer_steps * cfg.local_steps
        )

    # --- measurements -----------------------------------------------------------------------------------------
    def evaluate(self) -> EvalResult:
        if self.trainer is None or self.corpus is None:
            return EvalResult(math.nan, 0)
        model = self.trainer.model
        return evaluate(model, self.corpus, self.cfg.task.model.seq_len, self.cfg.eval_tokens, torch.device("cpu"))

    def record(self, force: bool = False) -> None:
        if not force and self.history[-1]["version"] == self.steps:
            return
        point = {
            "time_s": self.now,
            "tokens": float(self.tokens),
            "version": float(self.steps),
            "bytes": float(self.bytes_up + self.bytes_down),
        }
        ev = self.evaluate()
        point.update(val_loss=ev.loss, eval_tokens=ev.tokens)
        self.history.append(point)
        if self.progress:
            self.progress(point)

    def result(self, initial: float) -> SimResult:
        available = sum(self.available_s)
        return SimResult(
            mode="dp",
            history=self.history,
            final_loss=self.history[-1]["val_loss"],
            initial_loss=initial,
            time_s=self.now,
            tokens=self.tokens,
            rounds=self.steps,
            goodput=self.useful_s / available if available > 0 else 0.0,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            mean_staleness=0.0,
            max_staleness=0,
            rejected=0,
            lost_uploads=0,
            reassign_latency_s=self.stall_latency,
            time_to_target_s=time_to_target(self.history, self.cfg.target_loss),
            busy_fraction={
                i: (self.busy_s[i] / self.available_s[i] if self.available_s[i] else 0.0)
                for i in range(self.cfg.num_learners)
            },
            lost_steps=self.lost_steps,
        )
