"""Energy-, carbon- and cost-aware placement policies and the carbon-intensity trace (ALGORITHM.md section 6).

A *policy* is a pure function of `(now, learners, constraints)` (`decide`): for every learner its measured speed
(tokens/s, the planning speed of `diloco.core.placement`), its power draw (W), the carbon intensity of its zone now
(gCO2/kWh), its price per hour and whether it runs on spot capacity; for the fleet a minimum number of active
learners, a deadline and the tokens left. It returns a `Decision`: a weight per learner in [0, 1] (0 = paused:
still registered, no shards, not waited for by the quorum; 1 = full share) and a short reason for the
`placement.changed` log line. `placed_speeds` turns weights into the speeds `place_shards`/`shard_quotas` and
`plan_local_steps` take: a paused learner is left out, the others' speeds are scaled by their weight. Moving
shards off a paused learner is the ledger's ordinary hand-off, so exactly-once data is not this module's job.

The rules. Every learner is assumed busy while it is active, so the fleet's energy per token is `sum(W) / sum(v)`,
its time is `tokens / sum(v)`, its emissions per token `sum(W * I) / sum(v)` and its cost per token
`sum(price) / sum(v)`. Pausing a learner lowers one of those ratios exactly when the learner's own ratio
(`W / v`, `W * I / v`, `price / v`) is above the ratio of the learners that stay. So each policy pauses greedily,
worst ratio first, and every pause must keep `constraints.min_active` learners, must not slow the fleet's total
speed by more than the policy's allowance (against every learner active), and must still let the job meet
`constraints.deadline_s` at the remaining speed.

- `speed`: every learner at weight 1, so placement is exactly `place_shards(n, speeds)` (today's rule).
- `energy`: a learner whose joules per token `W / v` is at least `energy_factor` times that of the learners that
  stay is paused, while the fleet loses at most `energy_max_slowdown` of its speed. With the job's start
  (`started_s`), its tokens left and the time its pauses have cost it so far (`delay_s`, kept by `PauseDelay`),
  the allowance holds over the whole job instead: a pause that would slow the fleet more is also taken when the
  job, paused so until its end, still spends at most `ENERGY_BUDGET_SHARE` of `energy_max_slowdown` of the time
  it takes with every learner active (`ENERGY_BUDGET_HYSTERESIS` less for a learner not paused yet, so that a
  learner at the edge does not flap as rounds bring tokens in lumps). Time the steady pauses left unspent is so
  spent on the next least efficient learner, from the moment it fits until the end: the job's mean slowdown stays
  within the allowance while a time-shared pause saves what no fixed set of pauses can.
- `carbon`: a learner is *dirty* when its zone's intensity is above `carbon_threshold` gCO2/kWh (or, with no
  threshold, when its zone is the dirtiest at this moment and some zone is greener). Dirty learners are paused,
  dirtiest (`W * I / v`) first, while some greener learner stays active and the fleet loses at most
  `carbon_max_slowdown` of its speed; their shards move to greener learners. Intensities change with `now`, so a
  learner paused at night comes back when its zone's intensity falls.
- `cost`: the cheapest plan that meets the deadline. Learners are taken in order of price per token
  (`price / v`; spot before on-demand at equal price, on-demand only when `allow_spot` is off) until their speed
  finishes `tokens_left` by `deadline_s` with `cost_margin` to spare and `min_active` are in; then every further
  learner whose price per token is below the chosen set's is added too (it lowers the cost per token and the
  time). Without a deadline only the second rule applies. The others are paused: a paused learner is assumed
  released, so it costs nothing.

Pure: no clock, no I/O, deterministic (ties go to the smaller learner id).

The carbon signal: `CarbonTrace.load(path)` reads a CSV of `zone,time_s,gco2_per_kwh` rows (`#` lines are
comments), validated row by row, and `intensity(zone, now)` looks a value up: `step` holds each value until the
zone's next time (hourly averages as grid operators publish them), `linear` interpolates between the two
surrounding times; before a zone's first time its first value holds, after its last time its last value.
`mean(zone, t0, t1)` is the exact average over an interval (for accounting).
"""

from __future__ import annotations

import bisect
import csv
import enum
import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diloco.core.placement import effective_speeds
from diloco.errors import ConfigError


class Policy(enum.Enum):
    SPEED = "speed"
    ENERGY = "energy"
    CARBON = "carbon"
    COST = "cost"


POLICY_NAMES = tuple(p.value for p in Policy)
# energy, over the whole job: the share of `energy_max_slowdown` its pauses plan to spend (the rest is for what the
# plan does not see: the rounds' own overhead and the last round's granularity), and the share a new pause must
# leave besides (hysteresis: a learner paused stays paused until the plan is over `ENERGY_BUDGET_SHARE`)
ENERGY_BUDGET_SHARE = 0.8
ENERGY_BUDGET_HYSTERESIS = 0.05

# A carbon intensity above this is no grid's: the dirtiest grids average under 1,000 gCO2/kWh and a lignite plant on
# its own emits about 1,200. A trace row or a provider's value above it is refused as a mistake (wrong unit, say).
MAX_GCO2_PER_KWH = 2000.0


def valid_intensity(value: object) -> bool:
    """`value` is a carbon intensity: a number (not a bool), finite, from 0 to `MAX_GCO2_PER_KWH` gCO2/kWh."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_GCO2_PER_KWH
    )


class PowerSource(enum.Enum):
    """Where a learner's watts come from (`services.worker.power`): NVIDIA's management library, Linux RAPL
    energy counters, or the figure its operator declared (--power-w)."""

    NVML = "nvml"
    RAPL = "rapl"
    DECLARED = "declared"


def parse_policy(name: str) -> Policy:
    try:
        return Policy(name)
    except ValueError:
        raise ConfigError(f"placement: unknown policy {name!r}; allowed: {', '.join(POLICY_NAMES)}") from None


def _finite_nonneg(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class LearnerInfo:
    """What a policy knows about one learner at `now`."""

    speed: float  # measured tokens/s (unknown, i.e. not positive and finite: the median of the known ones)
    watts: float  # power draw while training
    intensity: float = 0.0  # gCO2/kWh of its zone now
    price_per_hour: float = 0.0
    spot: bool = False
    zone: str = ""
    paused: bool = False  # the policy's last decision paused it (weight 0)

    def __post_init__(self) -> None:
        if isinstance(self.speed, bool) or not isinstance(self.speed, (int, float)):
            raise ConfigError(f"speed must be a number, got {self.speed!r}")
        _finite_nonneg(self.watts, "watts")
        _finite_nonneg(self.intensity, "intensity")
        _finite_nonneg(self.price_per_hour, "price_per_hour")


@dataclass(frozen=True)
class PolicyConfig:
    policy: Policy = Policy.SPEED
    min_active: int = 1  # never fewer active learners than this (the quorum K at least)
    deadline_s: float = math.inf  # the job must end by this time (same clock as `now`)
    energy_factor: float = 1.25  # energy: "far worse" = J/token at least this x the rest's
    energy_max_slowdown: float = 0.10  # energy: fleet speed lost to pauses, at most (fraction)
    carbon_threshold: float = 0.0  # gCO2/kWh; 0: the dirtiest zone at each moment is dirty
    carbon_max_slowdown: float = 0.25
    allow_spot: bool = True
    cost_margin: float = 0.05  # cost: plan for this much more speed than the deadline needs
    started_s: float | None = None  # when the job (its `tokens_done`) began, same clock as `now`; None: unknown

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"policy must be a Policy, got {self.policy!r}")
        if isinstance(self.min_active, bool) or not isinstance(self.min_active, int) or self.min_active < 1:
            raise ConfigError(f"min_active must be an integer >= 1, got {self.min_active!r}")
        if math.isnan(self.deadline_s) or self.deadline_s <= 0:
            raise ConfigError(f"deadline_s must be > 0 (inf: none), got {self.deadline_s!r}")
        if not (math.isfinite(self.energy_factor) and self.energy_factor >= 1):
            raise ConfigError(f"energy_factor must be >= 1, got {self.energy_factor!r}")
        for name in ("energy_max_slowdown", "carbon_max_slowdown", "cost_margin", "carbon_threshold"):
            _finite_nonneg(getattr(self, name), name)
        if self.started_s is not None and not math.isfinite(self.started_s):
            raise ConfigError(f"started_s must be a finite time or None, got {self.started_s!r}")


@dataclass(frozen=True)
class Decision:
    weights: dict[str, float]  # learner id -> weight in [0, 1]; 0 = paused
    reason: str
    paused: tuple[str, ...] = field(default=())
    share: float = 1.0  # the active learners' share of every learner's speed

    def active(self) -> list[str]:
        return [w for w, x in self.weights.items() if x > 0]


def placed_speeds(speeds: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """The speeds shard placement and local steps use under `weights`: unknown speeds resolved
    (`effective_speeds`), paused learners (weight 0) left out, the others scaled by their weight (missing: 1)."""
    out: dict[str, float] = {}
    for w, v in effective_speeds(speeds).items():
        x = weights.get(w, 1.0)
        if not (math.isfinite(x) and 0 <= x <= 1):
            raise ConfigError(f"weight of {w!r} must be in [0, 1], got {x!r}")
        if x > 0:
            out[w] = v if x == 1.0 else v * x
    return out


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.inf


def decide(
    now: float,
    learners: Mapping[str, LearnerInfo],
    cfg: PolicyConfig,
    tokens_left: float = 0.0,
    delay_s: float = 0.0,
) -> Decision:
    """The policy's weights for `learners` at `now` (see the module docstring); `tokens_left` the job still needs
    (0: unknown), `delay_s` the time pauses cost it since `cfg.started_s` (`PauseDelay`)."""
    _finite_nonneg(tokens_left, "tokens_left")
    _finite_nonneg(delay_s, "delay_s")
    ids = sorted(learners)
    speeds = effective_speeds({w: learners[w].speed for w in ids})
    if cfg.policy is Policy.SPEED or not ids:
        return Decision(dict.fromkeys(ids, 1.0), "speed: every learner, shards in proportion to speed")
    total = math.fsum(speeds.values())
    time_left = cfg.deadline_s - now

    def feasible(active: Sequence[str], max_slowdown: float) -> bool:
        v = math.fsum(speeds[w] for w in active)
        if len(active) < cfg.min_active or v <= 0 or total / v - 1 > max_slowdown + 1e-12:
            return False
        return not (math.isfinite(time_left) and tokens_left > 0 and tokens_left / v > time_left)

    if cfg.policy is Policy.COST:
        return _cost(ids, learners, speeds, cfg, tokens_left, time_left)
    if cfg.policy is Policy.ENERGY:
        return _energy(now, ids, learners, speeds, cfg, tokens_left, delay_s, feasible)
    # carbon
    intensity = {w: learners[w].intensity for w in ids}
    if cfg.carbon_threshold > 0:
        dirty = [w for w in ids if intensity[w] > cfg.carbon_threshold]
    else:
        worst, best = max(intensity.values()), min(intensity.values())
        dirty = [w for w in ids if intensity[w] == worst] if worst > best else []
    grams = {w: learners[w].watts * intensity[w] / speeds[w] for w in ids}
    active = list(ids)
    paused: list[str] = []
    for w in sorted(dirty, key=lambda x: (-grams[x], x)):
        rest = [x for x in active if x != w]
        greener = any(intensity[x] < intensity[w] for x in rest)
        if greener and feasible(rest, cfg.carbon_max_slowdown):
            active, paused = rest, [*paused, w]
    why = ", ".join(f"{w} ({intensity[w]:.0f} g/kWh)" for w in paused)
    reason = f"carbon: paused {why}" if paused else "carbon: no dirty learner can pause"
    return _decision(ids, paused, reason, speeds)


def _energy(
    now: float,
    ids: Sequence[str],
    learners: Mapping[str, LearnerInfo],
    speeds: Mapping[str, float],
    cfg: PolicyConfig,
    tokens_left: float,
    delay_s: float,
    feasible: Callable[[Sequence[str], float], bool],
) -> Decision:
    per_token = {w: learners[w].watts / speeds[w] for w in ids}
    order = sorted(ids, key=lambda w: (-per_token[w], w))
    total = math.fsum(speeds.values())
    budget = cfg.started_s is not None and tokens_left > 0 and now >= cfg.started_s
    active = list(ids)
    paused: list[str] = []
    for w in order:
        rest = [x for x in active if x != w]
        rest_ratio = _ratio(math.fsum(learners[x].watts for x in rest), math.fsum(speeds[x] for x in rest))
        if per_token[w] < cfg.energy_factor * rest_ratio:
            continue
        ok = feasible(rest, cfg.energy_max_slowdown)
        if not ok and budget and feasible(rest, math.inf):
            assert cfg.started_s is not None
            share = ENERGY_BUDGET_SHARE - (0.0 if learners[w].paused else ENERGY_BUDGET_HYSTERESIS)
            v = math.fsum(speeds[x] for x in rest)
            ref_s = now - cfg.started_s - delay_s + tokens_left / total  # the job's time with no pause
            ok = delay_s + tokens_left / v - tokens_left / total <= cfg.energy_max_slowdown * share * ref_s
        if ok:
            active, paused = rest, [*paused, w]
    why = ", ".join(f"{w} ({per_token[w]:.3g} J/token)" for w in paused)
    reason = f"energy: paused {why}" if paused else "energy: no learner far less efficient than the rest"
    return _decision(ids, paused, reason, speeds)


class PauseDelay:
    """The time pauses have cost a job since `started_s`: while a decision's learners are active, the job runs at
    `share` = their speed / every learner's, so each second costs `1 - share` of a second against every learner
    active. Fed every decision in time order (`advance` before `decide`, `follow` after); pure."""

    def __init__(self, started_s: float) -> None:
        self.at = started_s
        self.delay_s = 0.0
        self.share = 1.0

    def advance(self, now: float) -> float:
        """The delay up to `now` (at the last decision's share)."""
        if now > self.at:
            self.delay_s += (now - self.at) * (1.0 - self.share)
            self.at = now
        return self.delay_s

    def follow(self, decision: Decision) -> None:
        self.share = decision.share


def _decision(ids: Sequence[str], paused: Sequence[str], reason: str, speeds: Mapping[str, float]) -> Decision:
    out = set(paused)
    total = math.fsum(speeds.values())
    share = math.fsum(v for w, v in speeds.items() if w not in out) / total if total > 0 else 1.0
    return Decision({w: 0.0 if w in out else 1.0 for w in ids}, reason, tuple(sorted(out)), share)


def _cost(
    ids: Sequence[str],
    learners: Mapping[str, LearnerInfo],
    speeds: Mapping[str, float],
    cfg: PolicyConfig,
    tokens_left: float,
    time_left: float,
) -> Decision:
    per_token = {w: learners[w].price_per_hour / speeds[w] for w in ids}
    banned = {w for w in ids if learners[w].spot and not cfg.allow_spot}  # only when nothing else will do
    order = sorted(ids, key=lambda w: (w in banned, per_token[w], not learners[w].spot, w))
    need = 0.0
    if math.isfinite(time_left) and tokens_left > 0:
        need = math.inf if time_left <= 0 else tokens_left / time_left * (1 + cfg.cost_margin)
    chosen: list[str] = []
    v = price = 0.0
    for w in order:
        if len(chosen) >= cfg.min_active and v >= need and (w in banned or per_token[w] >= _ratio(price, v)):
            continue
        chosen.append(w)
        v += speeds[w]
        price += learners[w].price_per_hour
    paused = [w for w in ids if w not in chosen]
    late = " (the deadline cannot be met even with every learner)" if v < need else ""
    reason = (
        f"cost: {len(chosen)} learner(s), {price:.3g}/h for {v:.3g} tokens/s; paused: {', '.join(paused) or 'none'}"
    )
    reason += late
    return _decision(ids, paused, reason, speeds)


# --- carbon intensity trace -----------------------------------------------------------------------------------
TRACE_COLUMNS = ("zone", "time_s", "gco2_per_kwh")
INTERPOLATIONS = ("step", "linear")
GAP_FACTOR = 2.0  # a step between two times of a zone longer than this x its median step is a gap


@dataclass(frozen=True)
class CarbonTrace:
    """Per zone, increasing times (s) and intensities (gCO2/kWh). Validated at construction."""

    zones: Mapping[str, tuple[tuple[float, ...], tuple[float, ...]]]
    interpolation: str = "step"

    def __post_init__(self) -> None:
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(f"interpolation: unknown {self.interpolation!r}; allowed: {', '.join(INTERPOLATIONS)}")
        if not self.zones:
            raise ConfigError("carbon trace: no zone")
        for zone, (times, values) in self.zones.items():
            if not times or len(times) != len(values):
                raise ConfigError(f"carbon trace: zone {zone!r} needs as many times as values, at least one")

    @staticmethod
    def load(path: Path | str, interpolation: str = "step") -> CarbonTrace:
        """Read and validate a CSV trace: a header naming exactly `zone,time_s,gco2_per_kwh` (any order), then
        one row per (zone, time). Errors name the line: unknown or missing columns, a short or long row, a value
        that is not a finite number, a negative time, an intensity outside 0 to `MAX_GCO2_PER_KWH`, a time not
        after the zone's previous one, and a gap (a step more than `GAP_FACTOR` x the zone's median step)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"carbon trace {p}: cannot read it ({e.strerror}); pass a readable CSV file") from None
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")]
        if not lines:
            raise ConfigError(f"carbon trace {p}: empty; expected a header {','.join(TRACE_COLUMNS)} and rows")
        rows = list(csv.reader([line for _, line in lines]))
        header = [c.strip() for c in rows[0]]
        unknown = [c for c in header if c not in TRACE_COLUMNS]
        missing = [c for c in TRACE_COLUMNS if c not in header]
        if unknown or missing or len(set(header)) != len(header):
            raise ConfigError(
                f"carbon trace {p} line {lines[0][0]}: header {','.join(header)!r} has unknown columns {unknown} "
                f"or misses {missing}; expected exactly {','.join(TRACE_COLUMNS)}"
            )
        col = {c: header.index(c) for c in TRACE_COLUMNS}
        series: dict[str, tuple[list[float], list[float], list[int]]] = {}
        for (lineno, _), row in zip(lines[1:], rows[1:], strict=True):
            where = f"carbon trace {p} line {lineno}"
            if len(row) != len(header):
                raise ConfigError(f"{where}: {len(row)} fields, expected {len(header)} ({','.join(header)})")
            zone = row[col["zone"]].strip()
            if not zone:
                raise ConfigError(f"{where}: empty zone")
            try:
                t = float(row[col["time_s"]])
                g = float(row[col["gco2_per_kwh"]])
            except ValueError:
                raise ConfigError(f"{where}: time_s and gco2_per_kwh must be numbers, got {row}") from None
            if not math.isfinite(t) or t < 0 or not valid_intensity(g):
                raise ConfigError(
                    f"{where}: time_s must be finite and >= 0 and gco2_per_kwh from 0 to {MAX_GCO2_PER_KWH:g}, "
                    f"got {t}, {g}"
                )
            times, values, linenos = series.setdefault(zone, ([], [], []))
            if times and t <= times[-1]:
                raise ConfigError(
                    f"{where}: time {t} of zone {zone!r} is not after its previous time {times[-1]} "
                    f"(line {linenos[-1]}); sort each zone's rows by time, without duplicates"
                )
            times.append(t)
            values.append(g)
            linenos.append(lineno)
        if not series:
            raise ConfigError(f"carbon trace {p}: a header but no rows")
        for zone, (times, _, linenos) in series.items():
            steps = [b - a for a, b in itertools.pairwise(times)]
            if len(steps) >= 2:
                typical = statistics.median(steps)
                for i, s in enumerate(steps):
                    if s > GAP_FACTOR * typical:
                        raise ConfigError(
                            f"carbon trace {p} line {linenos[i + 1]}: a gap in zone {zone!r} from time {times[i]} "
                            f"to {times[i + 1]} ({s:g} s; its rows are {typical:g} s apart); fill the missing rows"
                        )
        zones = {z: (tuple(t), tuple(v)) for z, (t, v, _) in series.items()}
        return CarbonTrace(zones, interpolation)

    def _series(self, zone: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        try:
            return self.zones[zone]
        except KeyError:
            raise ConfigError(
                f"zone {zone!r} is not in the carbon trace; its zones: {', '.join(sorted(self.zones))}"
            ) from None

    def check_zones(self, zones: Sequence[str]) -> None:
        """Fail at start-up on a zone the trace does not cover."""
        for z in zones:
            self._series(z)

    def intensity(self, zone: str, now: float) -> float:
        """gCO2/kWh of `zone` at `now` (the module docstring says how)."""
        times, values = self._series(zone)
        i = bisect.bisect_right(times, now) - 1
        if i < 0:
            return values[0]
        if i >= len(times) - 1 or self.interpolation == "step":
            return values[i]
        w = (now - times[i]) / (times[i + 1] - times[i])
        return values[i] + w * (values[i + 1] - values[i])

    def mean(self, zone: str, t0: float, t1: float) -> float:
        """The exact average intensity of `zone` over `[t0, t1]` (its value at `t0` when `t1 <= t0`)."""
        if t1 <= t0:
            return self.intensity(zone, t0)
        times, _ = self._series(zone)
        cuts = [t0, *(t for t in times if t0 < t < t1), t1]
        area = 0.0
        for a, b in itertools.pairwise(cuts):
            if self.interpolation == "step":
                area += self.intensity(zone, a) * (b - a)
            else:  # linear between knots: the trapezoid is exact
                area += (self.intensity(zone, a) + self.intensity(zone, b)) / 2 * (b - a)
        return area / (t1 - t0)
