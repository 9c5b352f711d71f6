"""What a simulation run measured (shared by the DiLoCo event engine and the data-parallel baseline)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.core.codecs import Codec


@dataclass
class SimResult:
    """`history` holds one point per evaluation: `time_s`, `tokens` (applied), `version`, `bytes` (on the learner
    links so far, both directions, as `bytes_up + bytes_down`), `val_loss` and `eval_tokens` (the validation tokens
    the loss was scored on)."""

    mode: str
    history: list[dict[str, float]]
    final_loss: float
    initial_loss: float
    time_s: float
    tokens: int
    rounds: int  # outer steps (data-parallel: optimizer steps)
    goodput: float  # useful compute / available compute
    bytes_up: int  # learner links, learner -> coordinator (data-parallel: what learners send)
    bytes_down: int  # learner links, towards the learners (data-parallel: what learners receive)
    mean_staleness: float
    max_staleness: int
    rejected: int
    lost_uploads: int
    reassign_latency_s: list[float]
    time_to_target_s: float | None
    busy_fraction: dict[int, float]
    lost_steps: int = 0  # data-parallel: steps lost to a failure in flight
    shardless_s: float = 0.0  # learner-seconds registered with no shard to read (waiting for a handoff)
    # with a fleet (diloco.sim.fleet): placement policy, power x busy time, that x the zone's intensity, and the
    # price x wall hours of every learner while alive and not paused (0 without a fleet)
    placement: str = "speed"
    energy_j: float = 0.0
    carbon_g: float = 0.0
    cost: float = 0.0
    per_learner: list[dict[str, float]] = field(default_factory=list)
    placements: list[dict[str, Any]] = field(default_factory=list)  # placement.changed: time_s, reason, paused
    fragments: int = 1  # streaming fragments P (diloco.core.fragments)
    # peak bytes/s of training traffic over any `peak_window_s` window (diloco.sim.links): `link_up`/`link_down` on
    # the busiest learner link, `coordinator_up`/`coordinator_down` summed over the links (snapshots aside)
    peak_window_s: float = 0.0
    peak_bytes_per_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def encoded_size(codec: Codec, numel: int) -> int:
    """Bytes a codec produces for `numel` values (without encoding them)."""
    _, meta = codec.encode(torch.zeros(min(numel, 4096), dtype=torch.float32))
    if numel <= 4096:
        return meta.encoded_bytes
    return round(meta.encoded_bytes * numel / 4096)


def time_to_target(history: list[dict[str, float]], target: float) -> float | None:
    """Virtual time of the first evaluation at or below `target` (None: never, or no target)."""
    return next((p["time_s"] for p in history if target and p["val_loss"] <= target), None)
