"""The HA benchmark's settings: the soak's and a cost run's, the points a leader is killed at, the targets."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from diloco.cluster import TINY_TASK_ARGS
from diloco.errors import ConfigError

MEDIAN_TARGET_S = 5.0  # kill -> first round committed by the new leader (issue #14)
MAX_TARGET_S = 10.0
REPLICAS = ("coord-a", "coord-b")
NO_ETCD = "no etcd binary: install Debian's etcd-server (make etcd, or scripts/install_etcd.sh as root)"


class KillPoint(enum.Enum):
    ROUND_CLOSED = "after round.closed"
    SUBMITTED = "after worker.submitted"
    DELAY = "random delay"


@dataclass(frozen=True)
class SoakSettings:
    kills: int = 50
    workers: int = 3
    local_steps: int = 10
    min_local_steps: int = 2
    min_quorum: int = 2
    slowdown: float = 2.0  # every learner's (sleeps after each step): less CPU contention on 2 cores
    checkpoint_every: int = 5
    replication_log: int = 16
    steady_s: float = 15.0  # the steady phase before the first kill (throughput and lag)
    lag_poll_s: float = 0.1
    max_delay_s: float = 1.5  # a DELAY kill waits uniformly in [0, this] once the standby is in step
    restart_delay_s: float = 0.0  # the supervisor's wait before starting an ended replica again
    finish_rounds: int = 10  # the job's target, set at the end: this many rounds past where the final kill should be
    seed: int = 14
    poll_s: float = 0.01
    step_timeout_s: float = 60.0  # the longest wait for one event
    task_args: tuple[str, ...] = TINY_TASK_ARGS

    def __post_init__(self) -> None:
        if self.kills < 1 or self.workers < self.min_quorum or self.finish_rounds < 2:
            raise ConfigError("ha soak: kills >= 1, workers >= min_quorum and finish_rounds >= 2")


@dataclass(frozen=True)
class CostSettings:
    label: str
    task_args: tuple[str, ...] = ()  # () : the coordinator's default model
    workers: int = 3
    local_steps: int = 10
    rounds: int = 20
    warmup_rounds: int = 3
    repeats: int = 2  # pairs of runs (one coordinator, then two replicas), alternating; figures pooled per kind
    replication_log: int = 4  # entries of Δ the leader keeps (model-sized each)
    target: float = 0.10  # the replication's latency on a round (close, replicated - plain) / the plain round
    timeout_s: float = 300.0


@dataclass(frozen=True)
class HaSettings:
    soak: SoakSettings = field(default_factory=SoakSettings)
    cost: tuple[CostSettings, ...] = ()
