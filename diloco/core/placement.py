"""Mixed hardware: per-learner local steps and speed-proportional shard placement (ALGORITHM.md section 6).

The speed rules, the one place they are written. A speed is in tokens/s.

*Unknown.* A speed that is not a positive finite number (0 = not measured yet, a report without a figure, NaN,
inf) is *unknown* (`is_known_speed`), and an unknown speed counts as the median of the known ones, or 1.0 when
none is known (`effective_speeds`). Local steps, shard quotas and the coordinator's placeholders for learners
still to come all follow it.

*Measured* (`v_m` of section 6; `work_seconds`, `measured_speed`). The coordinator measures each learner from the
submissions it *accepted*, with its own clock (`now`), never from what the learner says about itself. For an
accepted submission of `c_tok` tokens arriving at `t`, the work took `t - t0` seconds, where `t0` is the latest of
- the time the learner could start working: its registration, or later, the time its plan first listed a shard
  (a newcomer waiting for shards to be handed over to it is not slow, it is idle),
- the arrival of its previous accepted submission (the tokens of a submission are those trained since the
  previous one was cut: in `decoupled` and `async` the learner trains on while an upload and the next broadcast
  are in flight, and a rebase keeps those steps for the next pseudo-gradient),
- in `sync` only, the time the coordinator closed the submission's base version (the learner waited for that
  broadcast before training, and waiting is not work). In the other modes the base version's time is *not* used:
  a broadcast that lands mid-training does not restart the count, so it would overstate the speed.
Times are the coordinator's; a change made by a call that carries no time (a learner removed or released) counts
from the latest time any call gave. The measured speed is `sum(c_tok) / sum(t - t0)` over the learner's last
`MEASURE_WINDOW` accepted submissions: a ratio of sums, so one short interval cannot spike it and upload times
that vary from one submission to the next cancel out; unknown (0) until that sum of seconds is positive. It
counts what reached the coordinator: time lost to a refused or stale submission, to idling (no shards, a resync)
or to a slow uplink lowers it, as it should, since placement is about the tokens a learner delivers. The tokens
are not taken on trust either: they must match the learner's ledger ranges (and steps x batch tokens), so
`c_tok` is data it really consumed.

*Planning* (`planning_speeds`): what placement and H_m use. A learner with a measured speed plans with it; its
claimed figure (at registration, in ReportThroughput, in heartbeats forwarded by healthd) is then ignored. A
learner with no measurement yet plans with its claim as a *bounded prior*: at most the fastest measured speed in
the fleet (its live learners) when any learner is measured; when none is (a cold start), at most `CLAIM_SPREAD`
times `m`, the lower median of the fleet's known claims (the lower one, so that with two learners a single liar
does not set it). A learner with neither is unknown (the median rule above). The prior is bounded from above only:
a claim below the slowest measured speed is kept, since it can cost only its own learner shards and steps, and an
honest slow newcomer raised to the slowest measured speed would plan with the H_m of faster hardware until its
first submission (in the simulator that made plans swing in the first rounds of mixed-hardware runs; bounded from
above only, the simulator's runs without failures, whose claims are true, place exactly as before). So a learner
claiming 1e308 tokens/s gets at most the fastest measured learner's share when it joins a measured fleet, at most
`CLAIM_SPREAD` times the typical claim at a cold start, and from its first accepted submission on exactly what it
delivers. Shards are placed again at every membership change, and at a round's close when some learner's share of
the total planning speed moved by more than `REPLACE_TOLERANCE` (relative) since the last placement
(`shares_moved`): so the round that holds a liar's first submission (or any other learner's, which caps the liar's
prior at the fastest measured speed) takes its excess shards out of its plan, and the ledger moves them after its
next submission (the hand-off rule of `diloco.core.coordinator`). Smaller drifts wait for the next placement, so
that measurement noise does not move shards back and forth.

Pure functions. Quotas and local steps are computed exactly (`fractions.Fraction`), so they do not depend on
float rounding, and ties are broken only by sorted worker id.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from fractions import Fraction

from diloco.errors import InvalidArgument

MEASURE_WINDOW = 4  # accepted submissions a measured speed is taken over
CLAIM_SPREAD = 4.0  # cold start: a claim counts as at most 4 x the lower median of the claims
REPLACE_TOLERANCE = 0.25  # re-place shards when a learner's share of the planning speed moved by more than this


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


def work_seconds(
    arrived_at: float,
    work_since: float,
    previous_at: float | None,
    base_published_at: float | None,
    waits_for_round: bool,
) -> float:
    """Seconds the work of an accepted submission took (the measured rule above): from the latest of the time
    the learner could start working, its previous accepted submission (`None`: none) and, when the learner waits
    for each round (`sync`), its base version's close (`None`: not known), to its arrival. Never negative."""
    start = work_since
    if previous_at is not None:
        start = max(start, previous_at)
    if waits_for_round and base_published_at is not None:
        start = max(start, base_published_at)
    return max(0.0, arrived_at - start)


def measured_speed(samples: Sequence[tuple[int, float]]) -> float:
    """Tokens per second over `(tokens, seconds)` samples, as a ratio of sums; 0.0 (unknown) while no time
    has been measured."""
    seconds = math.fsum(s for _, s in samples)
    if not seconds > 0:
        return 0.0
    speed = sum(t for t, _ in samples) / seconds
    return speed if is_known_speed(speed) else 0.0


def planning_speeds(claimed: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """The speed each learner (`claimed`'s keys) plans with: its measured speed when known, else its claim
    capped at the fastest measured speed among them (or, with nobody measured, at `CLAIM_SPREAD` x the lower
    median claim), else unknown (0.0, for `effective_speeds`)."""
    known = [v for w, v in measured.items() if w in claimed and is_known_speed(v)]
    if known:
        hi = max(known)
    else:
        claims = [c for c in claimed.values() if is_known_speed(c)]
        if not claims:
            return dict.fromkeys(claimed, 0.0)
        hi = statistics.median_low(claims) * CLAIM_SPREAD
    out: dict[str, float] = {}
    for w, claim in claimed.items():
        v = measured.get(w, 0.0)
        if is_known_speed(v):
            out[w] = v
        elif is_known_speed(claim):
            out[w] = min(claim, hi)
        else:
            out[w] = 0.0
    return out


def shares_moved(placed: Mapping[str, float], speeds: Mapping[str, float]) -> bool:
    """Whether some learner's share of the total speed moved by more than `REPLACE_TOLERANCE` (relative)
    between `placed` (the speeds shards were last placed with) and `speeds`. Shares are taken among the
    learners present in both, so only changes of speed count: a learner that joined, left or stopped taking
    shards (drained, quarantined) is a change of membership, placed by its own rule. Every speed must be known
    (`effective_speeds`)."""
    common = placed.keys() & speeds.keys()
    before = math.fsum(placed[w] for w in common)
    now = math.fsum(speeds[w] for w in common)
    if not (before > 0 and now > 0):
        return False
    return any(abs(speeds[w] / now - placed[w] / before) > REPLACE_TOLERANCE * placed[w] / before for w in common)


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
    # Exact arithmetic in integers: a float is m / 2^k, so one common power of two makes every speed an integer
    # weight (Fraction arithmetic on float-sized denominators is ~100x slower at a thousand learners).
    fractions = {w: Fraction(v) for w, v in effective_speeds(speeds).items()}
    scale = max((f.denominator for f in fractions.values()), default=1)
    eff = {w: f.numerator * (scale // f.denominator) for w, f in fractions.items()}
    quotas: dict[str, int] = {}
    rest = sorted(eff)
    left = num_shards
    if num_shards >= len(eff):
        while rest:
            total = sum(eff[w] for w in rest)
            small = [w for w in rest if left * eff[w] < total]  # a share below one shard
            if not small:
                break
            for w in small:
                quotas[w] = 1
            rest = [w for w in rest if w not in quotas]
            left -= len(small)
    if rest:
        total = sum(eff[w] for w in rest)
        share = {w: divmod(left * eff[w], total) for w in rest}  # (whole shards, remainder x total)
        extra = left - sum(whole for whole, _ in share.values())
        by_remainder = sorted(rest, key=lambda w: (-share[w][1], w))
        for i, w in enumerate(by_remainder):
            quotas[w] = share[w][0] + (1 if i < extra else 0)
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
