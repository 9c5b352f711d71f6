"""Simulator configuration: hardware profile, links, failures, algorithm settings. Validated at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from diloco.core.broadcast import BROADCAST_CODECS, DEFAULT_BROADCAST_CODEC
from diloco.core.codecs import CODEC_NAMES, CodecError, check_ef_decay, get_codec
from diloco.core.energy import CarbonTrace, PolicyConfig, parse_policy
from diloco.core.fragments import check_fragments
from diloco.core.outer import OuterConfig
from diloco.core.rounds import RoundConfig
from diloco.errors import ConfigError
from diloco.sim.fleet import FleetLearner
from diloco.task.data import check_eval_tokens
from diloco.task.factory import TaskConfig

SIM_MODES = ("sync", "decoupled", "async", "dp")
DILOCO_MODES = ("sync", "decoupled", "async")  # `dp`: the data-parallel baseline (every step all-reduced)


@dataclass(frozen=True)
class FailureEvent:
    at_s: float
    learner: int
    action: str  # "kill" | "revive"


def parse_speeds(text: str) -> tuple[float, ...]:
    """`"1,1,0.5,0.25"` -> relative speeds (1 = one step per `step_time_s`)."""
    try:
        speeds = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise ConfigError(f"speeds: expected comma-separated numbers like 1,1,0.5,0.25, got {text!r}") from e
    if not speeds:
        raise ConfigError("speeds: give at least one learner, e.g. 1,1,0.5,0.25")
    return speeds


def parse_failures(text: str) -> tuple[FailureEvent, ...]:
    """`"kill:1@30,revive:1@90"` -> learner 1 dies at t=30 s and comes back at t=90 s."""
    events = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            action, rest = item.split(":", 1)
            learner, at = rest.split("@", 1)
            events.append(FailureEvent(float(at), int(learner), action))
        except ValueError as e:
            raise ConfigError(f"failures: expected items like kill:1@30 or revive:1@90, got {item!r}") from e
    return tuple(sorted(events, key=lambda e: e.at_s))


@dataclass(frozen=True)
class SimConfig:
    """One simulated job. `mode` is a DiLoCo round policy (`sync`, `decoupled`, `async`) or `dp`, the data-parallel
    baseline (`diloco/sim/dp.py`): every inner step ends in a ring all-reduce of the fp32 gradient, so `codec`,
    `min_quorum`, `grace_*`, `max_staleness`, `outer` and `merge` do not apply to it."""

    mode: str = "decoupled"
    speeds: tuple[float, ...] = (1.0, 1.0, 0.5, 0.25)
    step_time_s: float = 1.0  # virtual seconds per inner step at speed 1
    bandwidth_bytes_per_s: float = 100e6  # per learner link, both directions
    latency_s: float = 0.5
    failures: tuple[FailureEvent, ...] = ()
    mtbf_s: float = 0.0  # 0: no random failures; else exponential per learner
    repair_s: float = 60.0  # downtime after a random failure
    dead_after_s: float = 2.0  # detection delay (healthd)
    local_steps: int = 20  # H
    min_local_steps: int = 2
    dynamic_local_steps: bool = True  # H_m from speed (decoupled/async only; sync uses H for all)
    scale_partial_rounds: bool = True  # see CoordinatorConfig.scale_partial_rounds
    min_quorum: int = 2  # K
    grace_max_s: float = 5.0
    grace_gamma: float = 0.5
    max_staleness: int = 4
    codec: str = "int8"
    broadcast_codec: str = DEFAULT_BROADCAST_CODEC  # parameters to learners (ALGORITHM.md section 10)
    error_feedback: bool = True
    ef_decay: float | None = None  # error feedback's β (0 < β <= 1); None: the codec's default (`ErrorFeedback`)
    topk_fraction: float | None = None  # topk/sparse: fraction of entries sent; None: the codec's default
    outer: OuterConfig = field(default_factory=OuterConfig)
    merge: str = "mean"
    num_shards: int = 16
    token_budget: int = 0  # stop after this many applied tokens (0: no limit)
    max_time_s: float = 0.0  # stop at this virtual time (0: no limit)
    outer_steps: int = 0  # stop after this many rounds (0: no limit; dp: a round is H optimizer steps)
    eval_every: int = 1  # evaluate global params every N rounds (dp: every N·H optimizer steps)
    eval_tokens: int = 32_768  # validation tokens scored per evaluation (0: the whole split; see task.data)
    target_loss: float = 0.0  # report time to reach this validation loss (0: skip)
    train: bool = True  # False: timing only (no model), for large sweeps
    model_numel: int = 0  # timing-only payload size (0: the task model's size)
    seed: int = 0  # the run's seed: initial parameters, failure times and the training data order
    task: TaskConfig = field(default_factory=TaskConfig)
    # energy, carbon and cost (diloco.sim.fleet, diloco.core.energy): one hardware profile and zone per learner
    # (its speed must be the profile's); without a fleet energy_j, carbon_g and cost are reported as 0
    fleet: tuple[FleetLearner, ...] = ()
    placement: str = "speed"  # speed | energy | carbon | cost (diloco.core.energy.Policy)
    carbon_trace: CarbonTrace | None = None  # zones' intensity over virtual time; None: every zone at 0
    deadline_s: float = 0.0  # the job must end by this virtual time (0: none); for `cost` and the pauses' checks
    carbon_threshold: float = 0.0  # gCO2/kWh above which a zone is dirty (0: the dirtiest zone at each moment)
    # streaming fragments (diloco.core.fragments): P fragments synchronised on a staggered schedule; 1: none.
    # With P > 1, `outer_steps` and `eval_every` count whole-model outer steps (P rounds each)
    fragments: int = 1
    peak_window_s: float = 1.0  # the sliding window of the peak link bandwidth (diloco.sim.links)

    def __post_init__(self) -> None:
        if self.mode not in SIM_MODES:
            raise ConfigError(f"mode: unknown {self.mode!r}; allowed: {', '.join(SIM_MODES)}")
        if not self.speeds or any(not (math.isfinite(v) and v > 0) for v in self.speeds):
            raise ConfigError(f"speeds: every learner needs a finite speed > 0, got {self.speeds}")
        if self.codec not in CODEC_NAMES:
            raise ConfigError(f"codec: unknown {self.codec!r}; allowed: {', '.join(CODEC_NAMES)}")
        try:
            if self.ef_decay is not None:
                check_ef_decay(self.ef_decay)
        except CodecError as err:
            raise ConfigError(f"ef_decay: {err}") from None
        try:
            get_codec(self.codec, topk_fraction=self.topk_fraction)
        except CodecError as err:
            raise ConfigError(f"topk_fraction: {err}") from None
        if self.broadcast_codec not in BROADCAST_CODECS:
            raise ConfigError(
                f"broadcast_codec: unknown {self.broadcast_codec!r}; allowed: {', '.join(BROADCAST_CODECS)}"
            )
        for name in ("step_time_s", "bandwidth_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("latency_s", "mtbf_s", "repair_s", "dead_after_s", "grace_max_s", "max_time_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_steps < 1:
            raise ConfigError(f"local_steps (H) must be >= 1, got {self.local_steps}")
        if not 1 <= self.min_local_steps <= self.local_steps:
            raise ConfigError(f"min_local_steps must be in [1, H={self.local_steps}], got {self.min_local_steps}")
        if self.mode == "decoupled" and not 1 <= self.min_quorum <= self.num_learners:
            raise ConfigError(
                f"min_quorum (K={self.min_quorum}) must be between 1 and the number of learners (M={self.num_learners})"
            )
        if self.num_shards < self.num_learners:
            raise ConfigError(f"num_shards ({self.num_shards}) must be >= the number of learners ({self.num_learners})")
        if not (self.token_budget or self.max_time_s or self.outer_steps):
            raise ConfigError("set a stopping rule: token_budget, max_time_s or outer_steps")
        for e in self.failures:
            if not 0 <= e.learner < self.num_learners or e.action not in ("kill", "revive") or e.at_s < 0:
                raise ConfigError(
                    f"failures: {e.action}:{e.learner}@{e.at_s} needs action kill|revive, "
                    f"learner in 0..{self.num_learners - 1}, time >= 0"
                )
        if self.eval_every < 1:
            raise ConfigError(f"eval_every must be >= 1, got {self.eval_every}")
        self.check_fragments()
        check_eval_tokens(self.eval_tokens, self.task.model.seq_len)
        self.round_config()
        if self.fleet:
            if len(self.fleet) != self.num_learners:
                raise ConfigError(f"fleet: {len(self.fleet)} learners but {self.num_learners} speeds; give one each")
            for i, (f, v) in enumerate(zip(self.fleet, self.speeds, strict=True)):
                if v != f.hw.speed:
                    raise ConfigError(f"speeds: learner {i} ({f.profile}) must have its profile's speed {f.hw.speed}")
            if self.carbon_trace is not None:
                self.carbon_trace.check_zones([f.zone for f in self.fleet])
        if self.deadline_s < 0:
            raise ConfigError(f"deadline_s must be >= 0 (0: none), got {self.deadline_s}")
        policy = self.policy_config()
        if policy.policy.value != "speed" and (not self.fleet or self.mode not in DILOCO_MODES):
            raise ConfigError(f"placement {self.placement!r} needs a fleet (--fleet) and a DiLoCo mode, not dp")

    def check_fragments(self) -> None:
        """What can be checked of `fragments` without the model (its tensor count is checked when it is built)."""
        p = check_fragments(self.fragments, self.local_steps)
        if not (math.isfinite(self.peak_window_s) and self.peak_window_s > 0):
            raise ConfigError(f"peak_window_s must be a finite number > 0, got {self.peak_window_s}")
        if p == 1:
            return
        if self.mode == "dp":
            raise ConfigError("fragments: the data-parallel baseline (mode dp) has no outer step to fragment; use 1")
        if not self.train:
            raise ConfigError("fragments need the model's tensors to cut at (not --no-train); use 1 with --no-train")
        check_fragments(p, self.local_steps)

    @property
    def num_learners(self) -> int:
        return len(self.speeds)

    def task_config(self) -> TaskConfig:
        """The task the simulator trains: `task` cut into `num_shards` shards, its data ordered by `seed`."""
        data = dataclasses.replace(self.task.data, num_shards=self.num_shards, seed=self.seed)
        return dataclasses.replace(self.task, data=data)

    def policy_config(self) -> PolicyConfig:
        """The placement policy's settings: at least the quorum stays active."""
        return PolicyConfig(
            policy=parse_policy(self.placement),
            min_active=self.min_quorum if self.mode == "decoupled" else 1,
            deadline_s=self.deadline_s or math.inf,
            carbon_threshold=self.carbon_threshold,
            started_s=0.0,
        )

    def round_config(self) -> RoundConfig:
        """The coordinator's round policy (the data-parallel baseline has none; it gets the `sync` one)."""
        return RoundConfig(
            mode=self.mode if self.mode in DILOCO_MODES else "sync",
            min_quorum=self.min_quorum,
            grace_max_s=self.grace_max_s,
            grace_gamma=self.grace_gamma,
            max_staleness=self.max_staleness,
        )
