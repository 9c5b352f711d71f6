"""Settings of every benchmark section, for the full suite and for `--quick` (CI). Frozen and stated in the report.

The simulated comparison represents islands far apart: 400 Mbit/s per learner link, 0.5 s one-way latency, and a
virtual step time of 1 s at speed 1. The model is a small byte-level GPT, so each simulated run takes seconds of
real compute (simulated time is virtual; the training is real). Nothing here is tuned to make a target pass.

Every loss comparison runs each configuration with every seed in `seeds` (data order, initial parameters and
failure times change with the seed) and reports the mean and the min–max spread (`diloco.bench.seeds`). To run
3 seeds in about the time one took, the full profile's simulated token budget went from 1.5M to 1.0M tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from diloco.errors import ConfigError

PROFILES: dict[str, tuple[float, ...]] = {
    "uniform": (1.0, 1.0, 1.0, 1.0),
    "mixed": (1.0, 1.0, 0.5, 0.25),
    "mixed+failures": (1.0, 1.0, 0.5, 0.25),
}


@dataclass(frozen=True)
class SimSettings:
    """Simulated sections (time to target, compression, batch layout; the outer-optimizer section with a larger
    model, `Profile.outer`): real training on a virtual clock, M = 4 learners."""

    # task: a byte-level GPT on the standard library's sources
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8
    inner_lr: float = 3e-3
    warmup_steps: int = 20
    max_bytes: int = 4_000_000
    num_shards: int = 16
    # budget and algorithm
    token_budget: int = 1_000_000  # applied tokens, the same for every mode (1.5M before runs took 3 seeds)
    local_steps: int = 100  # H
    min_local_steps: int = 10
    min_quorum: int = 2  # K (decoupled)
    grace_max_s: float = 5.0
    max_staleness: int = 4
    codec: str = "int8"
    # links and hardware
    step_time_s: float = 1.0  # virtual seconds per inner step at speed 1
    bandwidth_mbps: float = 400.0
    latency_s: float = 0.5
    dead_after_s: float = 2.0
    # mixed+failures: per-learner MTBF and repair time, in rounds of H·step_time_s (the uniform round length)
    mtbf_rounds: float = 12.0  # 4 learners: one failure in the cluster every ~3 rounds
    repair_rounds: float = 2.0
    # measurement
    eval_tokens: int = 65_536  # validation tokens per evaluation, an evenly spread sample (0: the whole split)
    eval_every: int = 1  # rounds between evaluations (async: multiplied by M, a round there is one submission)
    # target losses: what sync reaches on uniform at these fractions of the budget (0.5 was added after the first
    # full run showed the reference curve flat over its last quarter, see the report)
    target_fractions: tuple[float, ...] = (0.5, 0.75)
    seeds: tuple[int, ...] = (0, 1, 2)  # every loss comparison runs each of these; the report gives mean and spread

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"seeds: give distinct seeds >= 0, got {self.seeds}")
        if self.eval_every < 1:
            raise ConfigError(f"eval_every must be >= 1, got {self.eval_every}")

    @property
    def round_s(self) -> float:
        return self.local_steps * self.step_time_s

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8


@dataclass(frozen=True)
class Network:
    name: str
    bandwidth_mbps: float
    latency_s: float


@dataclass(frozen=True)
class ScaleSettings:
    """Section 2: timing only (no model), a fixed payload, uniform learners, a per-learner failure rate."""

    learners: tuple[int, ...] = (2, 4, 8, 16, 64)
    model_numel: int = 100_000_000
    local_steps: int = 100
    step_time_s: float = 1.0
    horizon_rounds: float = 50.0  # virtual time of each run, in rounds of H·step_time_s
    mtbf_rounds: float = 20.0  # per learner
    repair_rounds: float = 3.0
    dead_after_s: float = 2.0
    codec: str = "int8"
    quorum_fraction: float = 0.5  # K = max(1, floor(M·fraction))
    networks: tuple[Network, ...] = (
        Network("far-apart islands", 400.0, 0.5),
        Network("one datacenter", 100_000.0, 10e-6),
    )
    seed: int = 0


@dataclass(frozen=True)
class ClusterSettings:
    """Section 4: `LocalCluster`, real processes on loopback, one worker slowed down."""

    workers: int = 4
    slowdowns: tuple[float, ...] = (1.0, 1.0, 1.0, 4.0)
    modes: tuple[str, ...] = ("sync", "decoupled")
    kill_runs: tuple[bool, ...] = (False, True)
    token_budget: int = 2_000_000
    local_steps: int = 30
    min_local_steps: int = 5
    min_quorum: int = 2
    codec: str = "int8"
    heartbeat_interval_s: float = 0.5
    dead_after_s: float = 2.0
    kill_fraction: float = 0.4  # SIGKILL when this fraction of the budget is applied
    victim: int = 0  # a full-speed worker
    window_s: float = 4.0  # sliding window of the applied-token rate
    recovered_fraction: float = 0.9
    poll_s: float = 0.25
    stall_s: float = 30.0  # no tokens applied for this long: the run is reported as stalled and stopped
    timeout_s: float = 240.0
    task_args: tuple[str, ...] = (
        "--d-model",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--max-bytes",
        "4000000",
        "--shards",
        "16",
        "--eval-tokens",
        "8192",
    )


# The outer-optimizer comparison (issue #17): a 1.03M-parameter GPT (5 layers, 128 wide), short sequences and
# small batches so that 50 outer steps of M = 4 learners (H = 10) fit the 2-core machine: the budget is
# 50 · 4 · 10 · 4 · 32 = 256,000 tokens; evaluated every 5 outer steps on 16,384 validation tokens.
OUTER = SimSettings(
    d_model=128,
    n_layers=5,
    n_heads=4,
    seq_len=32,
    batch_size=4,
    local_steps=10,
    min_local_steps=2,
    token_budget=256_000,
    eval_tokens=16_384,
    eval_every=5,
)


@dataclass(frozen=True)
class Profile:
    name: str
    sim: SimSettings = field(default_factory=SimSettings)
    outer: SimSettings = OUTER
    scale: ScaleSettings = field(default_factory=ScaleSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FULL = Profile("full")
QUICK = Profile(
    "quick",
    sim=SimSettings(token_budget=120_000, local_steps=20, min_local_steps=4, eval_tokens=16_384, seeds=(0, 1)),
    outer=SimSettings(token_budget=40_960, local_steps=5, min_local_steps=1, eval_tokens=4_096, seeds=(0, 1)),
    scale=ScaleSettings(learners=(2, 4, 8), horizon_rounds=10.0, mtbf_rounds=5.0, repair_rounds=1.0),
    cluster=ClusterSettings(
        modes=("decoupled",), kill_runs=(True,), token_budget=700_000, window_s=2.0, stall_s=15.0, timeout_s=120.0
    ),
)
