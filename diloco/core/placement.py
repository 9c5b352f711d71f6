"""Mixed hardware: per-learner local steps and speed-proportional shard placement (ALGORITHM.md section 6).

The unknown-speed rule, the one place it is written: a speed (tokens/s) that is not a positive finite number
(0 = not measured yet, a report without a figure, NaN, inf) is *unknown* (`is_known_speed`), and an unknown speed
counts as the median of the known ones, or 1.0 when none is known (`effective_speeds`). Local steps, shard
quotas and the coordinator's placeholders for learners still to come all follow it.

Pure functions. Arithmetic on speeds is exact (`fractions.Fraction`), so results do not depend on float
rounding and ties are broken only by sorted worker id.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from fractions import Fraction

from diloco.errors import InvalidArgument


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_speed(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def local_steps(h: int, speed: float, max_speed: float, h_min: int) -> int:
    """`H_m = max(h_min, floor(h * speed / max_speed))`: learners finish a round in about the same time."""
    h = _positive_int(h, "h")
    h_min = _positive_int(h_min, "h_min")
    if h_min > h:
        raise InvalidArgument(f"h_min ({h_min}) must not exceed h ({h}); lower h_min or raise h")
    speed = _positive_speed(speed, "speed")
    max_speed = _positive_speed(max_speed, "max_speed")
    if speed > max_speed:
        raise InvalidArgument(f"speed {speed} exceeds max_speed {max_speed}; pass the maximum over all learners")
    return max(h_min, math.floor(h * Fraction(speed) / Fraction(max_speed)))


def is_known_speed(speed: float) -> bool:
    """A measured speed: a positive finite number. Anything else (0 = not measured yet, NaN, inf) is unknown."""
    return math.isfinite(speed) and speed > 0


def effective_speeds(speeds: Mapping[str, float]) -> dict[str, float]:
    """Speeds with every unknown one (`is_known_speed`) replaced by the median of the known ones, or 1.0 when
    none is known."""
    known: list[float] = []
    for worker_id, v in speeds.items():
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidArgument(f"worker id must be a non-empty string, got {worker_id!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidArgument(f"speed of {worker_id!r} must be a number, got {v!r}")
        if is_known_speed(v):
            known.append(float(v))
    fill = statistics.median(known) if known else 1.0
    return {w: (float(v) if is_known_speed(v) else fill) for w, v in speeds.items()}


def plan_local_steps(speeds: Mapping[str, float], h: int, h_min: int) -> dict[str, int]:
    """`local_steps` for every learner, against the fastest one (unknown speeds count as the median)."""
    eff = effective_speeds(speeds)
    if not eff:
        _positive_int(h, "h")
        _positive_int(h_min, "h_min")
        return {}
    fastest = max(eff.values())
    return {w: local_steps(h, v, fastest, h_min) for w, v in sorted(eff.items())}


def shard_quotas(num_shards: int, speeds: Mapping[str, float]) -> dict[str, int]:
    """How many shards each learner should own: proportional to speed, largest-remainder rounding, at least
    one each when `num_shards >= len(speeds)` (learners whose share is below one get exactly one, and the
    rest is shared among the others). Ties go to the smaller worker id."""
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 0:
        raise InvalidArgument(f"num_shards must be a non-negative integer, got {num_shards!r}")
    eff = {w: Fraction(v) for w, v in effective_speeds(speeds).items()}
    quotas: dict[str, int] = {}
    rest = sorted(eff)
    left = num_shards
    if num_shards >= len(eff):
        while rest:
            total = sum(eff[w] for w in rest)
            small = [w for w in rest if left * eff[w] / total < 1]
            if not small:
                break
            for w in small:
                quotas[w] = 1
            rest = [w for w in rest if w not in quotas]
            left -= len(small)
    if rest:
        total = sum(eff[w] for w in rest)
        exact = {w: left * eff[w] / total for w in rest}
        floors = {w: math.floor(exact[w]) for w in rest}
        extra = left - sum(floors.values())
        by_remainder = sorted(rest, key=lambda w: (-(exact[w] - floors[w]), w))
        for i, w in enumerate(by_remainder):
            quotas[w] = floors[w] + (1 if i < extra else 0)
    return dict(sorted(quotas.items()))


def place_shards(
    num_shards: int, speeds: Mapping[str, float], current: Mapping[int, str | None]
) -> dict[int, str | None]:
    """Place shards `0..num_shards-1` on the live learners (`speeds`' keys) in proportion to speed, moving
    as few as possible.

    A shard keeps its current owner while that owner is live and within its quota (the lowest shard ids
    are kept); shards of over-quota or dead owners and unowned shards go, by id, to under-quota learners in
    worker-id order. With no learners every shard is unowned (None). Deterministic.
    """
    quotas = shard_quotas(num_shards, speeds)
    for shard_id in current:
        if not isinstance(shard_id, int) or isinstance(shard_id, bool) or not 0 <= shard_id < num_shards:
            raise InvalidArgument(f"current names shard {shard_id!r}, outside 0..{num_shards - 1}")
    if not quotas:
        return dict.fromkeys(range(num_shards))
    placement: dict[int, str | None] = {}
    kept = dict.fromkeys(quotas, 0)
    free: list[int] = []
    for shard_id in range(num_shards):
        owner = current.get(shard_id)
        if owner is not None and owner in quotas and kept[owner] < quotas[owner]:
            placement[shard_id] = owner
            kept[owner] += 1
        else:
            free.append(shard_id)
    free_iter = iter(free)
    for worker_id, quota in quotas.items():
        for _ in range(quota - kept[worker_id]):
            placement[next(free_iter)] = worker_id
    return dict(sorted(placement.items()))
