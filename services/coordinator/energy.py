"""What the coordinator knows of its learners' power, zones and prices, and what they used (issue #15).

Pure: no gRPC, no clock (`now` is a parameter, the coordinator's unix seconds), no I/O. The coordinator's
`services.coordinator.placement.Placement` holds one `EnergyBook` (under the state's bookkeeping lock), feeds it
what learners report, asks it for the placement policy's inputs (`infos`, for `diloco.core.energy.decide`, where
the rules are) and turns the `Charge`s it returns into Prometheus counters.

Inputs, per learner: at registration its zone, price per hour and capacity (spot or on demand); with the
registration and every heartbeat (forwarded by healthd) its watts while training and their source
(`services.worker.power`). A report without watts (0) keeps the last figure.

The carbon signal (`CarbonSignal`): a zone's intensity (gCO2/kWh) at `now` is the carbon provider's last good
value for it (`services.coordinator.carbon`) when there is one, else the carbon trace's value at `now - origin`
(`diloco.core.energy.CarbonTrace`; `origin` is the unix time the trace's 0 stands for). With a trace, a learner
must name one of its zones. A zone with neither (a provider and no trace, and the provider has not answered for
it yet, or a learner without a zone) is *unknown*: placement and accounting take it as the dirtiest known zone
at `now` and at least `UNKNOWN_GCO2_PER_KWH`, so it is never counted clean by default. Only with neither a trace
nor a provider (carbon is not measured) is every zone 0. A provider call that gives no good value for a zone
(`fail`) leaves it on that fallback: its last good value, else the trace's, else unknown.

Accounting, per learner (and in total):
- energy: watts x work seconds. Work seconds are the coordinator's measure of how long each accepted submission's
  work took (`diloco.core.placement.work_seconds`, the time its measured speed is taken over), so a learner
  waiting, idle or paused draws nothing here: the figure is the energy its accepted work took, at the watts it
  reported last (a learner's watts are its draw while training).
- carbon: that energy (kWh) x its zone's intensity averaged over the work's interval (the trace's exact mean; a
  provider's value is taken as constant over it).
- cost: price per hour x the hours it was registered and not paused by the placement policy (a paused learner is
  assumed released, as the `cost` policy assumes).

Across a restart: the fleet's totals (`Totals`) are part of every checkpoint (`CoordinatorState.snapshot`, under
`SNAPSHOT_KEY`; the standbys get them with the round log's bookkeeping) and a coordinator resumed from one starts its
book, and so its counters, from them; what was used after that checkpoint is lost with the process. A learner's own
figures are not kept: they belong to its registration, and after a restart every learner registers again, as a new
incarnation whose figures start from zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from diloco.core.energy import MAX_GCO2_PER_KWH, CarbonTrace, LearnerInfo, PowerSource, valid_intensity
from diloco.errors import InvalidArgument

J_PER_KWH = 3.6e6
_ZONES_SHOWN = 12  # zones an error message lists
SNAPSHOT_KEY = "energy"  # the fleet's totals in a checkpoint
# A zone no carbon source has a value for (the provider has not answered for it yet, without a trace to fall back
# on) is weighed and charged as the dirtiest known zone, and at least as a coal-fired grid: never as clean.
UNKNOWN_GCO2_PER_KWH = 1000.0
LAST_GOOD, TRACE, UNKNOWN = "last_good", "trace", "unknown"  # what a zone falls back to (`CarbonSignal.fail`)


@dataclass(frozen=True)
class Totals:
    """What the whole fleet used since the run began: joules, grams of CO2 and cost (kept in checkpoints)."""

    joules: float = 0.0
    grams: float = 0.0
    cost: float = 0.0

    def to_snapshot(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_snapshot(cls, snap: Mapping[str, Any]) -> Totals:
        """The totals a checkpoint holds: zero for one written before they were kept; `InvalidArgument` when its
        section is malformed (keys other than these three are left for newer writers)."""
        section = snap.get(SNAPSHOT_KEY)
        if section is None:
            return cls()
        names = [f.name for f in fields(cls)]
        if not isinstance(section, Mapping) or any(n not in section for n in names):
            raise InvalidArgument(f"the checkpoint's {SNAPSHOT_KEY!r} section must map {', '.join(names)} to numbers")
        for n in names:
            x = section[n]
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x >= 0):
                raise InvalidArgument(f"the checkpoint's energy total {n} must be a finite number >= 0, got {x!r:.40}")
        return cls(**{n: float(section[n]) for n in names})


@dataclass
class LearnerEnergy:
    zone: str = ""
    price_per_hour: float = 0.0
    spot: bool = False
    watts: float = 0.0  # last reported draw while training (0: none reported)
    source: PowerSource | None = None
    weight: float = 1.0  # the placement policy's (0: paused)
    intensity: float = 0.0  # gCO2/kWh of its zone when last weighed (`infos`) or viewed (`view`)
    joules: float = 0.0
    grams: float = 0.0
    cost: float = 0.0
    paid_since: float | None = None  # registered and not paused since then: its price runs


@dataclass(frozen=True)
class Reweighed:
    """What `set_weights` did: the learners whose weight changed, and their charges up to then."""

    changed: list[str]
    charges: list[Charge]


@dataclass(frozen=True)
class Fallback:
    """What a zone's intensity is while the provider gives none for it: `to` its last good value (`LAST_GOOD`),
    the trace's (`TRACE`) or the unknown zone's (`UNKNOWN`), `value` that intensity now; `changed`: its first
    failure, or one whose fallback or reason differs from the zone's previous failure (the one to log)."""

    to: str
    value: float
    changed: bool


@dataclass(frozen=True)
class Charge:
    """What one learner used since the last charge (for the counters)."""

    worker_id: str
    joules: float = 0.0
    grams: float = 0.0
    cost: float = 0.0


class CarbonSignal:
    """Zones' carbon intensity: a provider's last good values over the trace, and what a zone falls back to while
    the provider gives none for it (see the module docstring)."""

    def __init__(self, trace: CarbonTrace | None = None, origin: float = 0.0, *, provider: bool = False) -> None:
        """`provider`: a carbon provider feeds `set_live` and `fail` (so a zone can be unknown)."""
        self.trace = trace
        self.origin = origin
        self.provider = provider
        self.live: dict[str, float] = {}  # zone -> the provider's last good value
        self.failing: dict[str, tuple[str, str]] = {}  # zone -> (fallback, reason) of its last failed call

    def check_zone(self, zone: str) -> None:
        """With a trace, `zone` must be one of its zones (InvalidArgument naming them)."""
        if self.trace is None or zone in self.trace.zones:
            return
        known = sorted(self.trace.zones)
        shown = ", ".join(known[:_ZONES_SHOWN]) + (f" and {len(known) - _ZONES_SHOWN} more" if len(known) > 12 else "")
        what = "no zone" if not zone else f"zone {zone!r}, which its carbon trace does not name"
        raise InvalidArgument(
            f"this coordinator weighs carbon by zone and the learner sent {what}: register with --zone set to one "
            f"of {shown}"
        )

    def set_live(self, zone: str, value: float) -> bool:
        """The provider's value for `zone`; True when the zone was falling back until now (it recovered)."""
        if not valid_intensity(value):
            raise InvalidArgument(
                f"carbon intensity of {zone!r} must be a finite number from 0 to {MAX_GCO2_PER_KWH:g}, got {value!r}"
            )
        self.live[zone] = float(value)
        return self.failing.pop(zone, None) is not None

    def fail(self, zone: str, reason: str, now: float) -> Fallback:
        """The provider gave no good value for `zone` (`reason`, one of `services.coordinator.carbon`'s): what the
        zone's intensity falls back to, and whether that differs from its last failure's (the change to log)."""
        to = LAST_GOOD if zone in self.live else TRACE if self._traced(zone) else UNKNOWN
        changed = self.failing.get(zone) != (to, reason)
        self.failing[zone] = (to, reason)
        return Fallback(to, self.at(zone, now), changed)

    def _traced(self, zone: str) -> bool:
        return self.trace is not None and zone in self.trace.zones

    def unknown(self, now: float) -> float:
        """The intensity of a zone no source has a value for: 0 with neither a trace nor a provider (carbon is not
        measured), else the dirtiest known zone's value at `now`, and at least `UNKNOWN_GCO2_PER_KWH`."""
        if self.trace is None and not self.provider:
            return 0.0
        known = list(self.live.values())
        if self.trace is not None:
            known += [self.trace.intensity(z, now - self.origin) for z in self.trace.zones]
        return max([UNKNOWN_GCO2_PER_KWH, *known])

    def at(self, zone: str, now: float) -> float:
        if zone in self.live:
            return self.live[zone]
        if self.trace is not None and zone in self.trace.zones:
            return self.trace.intensity(zone, now - self.origin)
        return self.unknown(now)

    def mean(self, zone: str, t0: float, t1: float) -> float:
        """The average intensity of `zone` over `[t0, t1]` (its value at `t1` from a provider, or unknown)."""
        if zone in self.live:
            return self.live[zone]
        if self.trace is not None and zone in self.trace.zones:
            return self.trace.mean(zone, t0 - self.origin, t1 - self.origin)
        return self.unknown(t1)


class EnergyBook:
    """Per learner: its energy inputs and what it used. Not thread-safe (the caller holds its lock)."""

    def __init__(self, signal: CarbonSignal | None = None, totals: Totals | None = None) -> None:
        """`totals`: the fleet's totals so far (a checkpoint's, when the coordinator resumes from one)."""
        self.signal = signal or CarbonSignal()
        self.learners: dict[str, LearnerEnergy] = {}
        t = totals or Totals()
        self.joules, self.grams, self.cost = t.joules, t.grams, t.cost
        self.paused = 0  # live learners at weight 0

    def totals(self) -> Totals:
        return Totals(self.joules, self.grams, self.cost)

    def check(self, zone: str) -> None:
        """Everything about a registration that can be refused, before anything changes."""
        self.signal.check_zone(zone)

    def join(
        self,
        worker_id: str,
        now: float,
        *,
        zone: str = "",
        price_per_hour: float = 0.0,
        spot: bool = False,
        watts: float = 0.0,
        source: PowerSource | None = None,
    ) -> None:
        """A learner registered (`check` passed): its price runs from `now`."""
        if not (math.isfinite(price_per_hour) and price_per_hour >= 0):
            raise InvalidArgument(f"price_per_hour must be a finite number >= 0, got {price_per_hour!r}")
        rec = LearnerEnergy(zone, float(price_per_hour), spot, paid_since=now)
        rec.intensity = self.signal.at(zone, now)
        self.learners[worker_id] = rec
        self.report(worker_id, watts, source)

    def report(self, worker_id: str, watts: float, source: PowerSource | None) -> None:
        """A learner's power (`source` None: no figure, the last one stays)."""
        rec = self.learners.get(worker_id)
        if rec is None or source is None:
            return
        if not (math.isfinite(watts) and watts >= 0):
            raise InvalidArgument(f"watts must be a finite number >= 0, got {watts!r}")
        rec.watts, rec.source = float(watts), source

    def work(self, worker_id: str, seconds: float, now: float) -> Charge:
        """An accepted submission of `worker_id` took `seconds` of work, ending at `now`."""
        rec = self.learners.get(worker_id)
        if rec is None or not seconds > 0 or not math.isfinite(seconds):
            return Charge(worker_id)
        joules = rec.watts * seconds
        grams = joules / J_PER_KWH * self.signal.mean(rec.zone, now - seconds, now)
        rec.joules += joules
        rec.grams += grams
        self.joules += joules
        self.grams += grams
        return Charge(worker_id, joules=joules, grams=grams)

    def accrue(self, now: float, worker_ids: Iterable[str] | None = None) -> list[Charge]:
        """Charge every learner whose price runs (or those of `worker_ids`) up to `now`."""
        out = []
        for w in self.learners if worker_ids is None else worker_ids:
            rec = self.learners.get(w)
            if rec is None or rec.paid_since is None:
                continue
            cost = rec.price_per_hour * max(0.0, now - rec.paid_since) / 3600.0
            rec.paid_since = max(rec.paid_since, now)
            if cost > 0:
                rec.cost += cost
                self.cost += cost
                out.append(Charge(w, cost=cost))
        return out

    def leave(self, worker_id: str, now: float) -> list[Charge]:
        """A learner is gone (dead, left, evicted): its price stops, and it no longer counts as paused."""
        out = self.accrue(now, [worker_id])
        rec = self.learners.get(worker_id)
        if rec is not None:
            rec.paid_since = None
            if rec.weight == 0:
                self.paused -= 1
                rec.weight = 1.0
        return out

    def set_weights(self, weights: Mapping[str, float], now: float) -> Reweighed:
        """The placement policy's weights: a paused learner's (0) price stops, a resumed one's runs again (only
        the learners whose weight changed are touched)."""
        changed = [w for w, x in weights.items() if (rec := self.learners.get(w)) is not None and rec.weight != x]
        charges = self.accrue(now, changed)
        for w in changed:
            rec, x = self.learners[w], weights[w]
            self.paused += (x == 0) - (rec.weight == 0)
            rec.weight = x
            if x == 0:
                rec.paid_since = None
            elif rec.paid_since is None:
                rec.paid_since = now
        return Reweighed(changed, charges)

    def view(self, worker_id: str, now: float) -> LearnerEnergy | None:
        """A copy of a learner's entry, with its zone's intensity at `now`."""
        rec = self.learners.get(worker_id)
        if rec is None:
            return None
        out = LearnerEnergy(**vars(rec))
        out.intensity = self.signal.at(rec.zone, now)
        return out

    def infos(self, speeds: Mapping[str, float], now: float) -> dict[str, LearnerInfo]:
        """The policy's view of the learners in `speeds` (their planning speeds) at `now`; a learner the book does
        not know (none yet) counts with no power, zone or price."""
        out = {}
        for w, v in speeds.items():
            rec = self.learners.get(w)
            if rec is None:
                out[w] = LearnerInfo(speed=v, watts=0.0)
                continue
            rec.intensity = self.signal.at(rec.zone, now)
            out[w] = LearnerInfo(
                speed=v,
                watts=rec.watts,
                intensity=rec.intensity,
                price_per_hour=rec.price_per_hour,
                spot=rec.spot,
                zone=rec.zone,
                paused=rec.weight == 0,
            )
        return out

    def zones(self, worker_ids: Iterable[str] | None = None) -> set[str]:
        """The zones of `worker_ids` (default: every learner in the book)."""
        ids = self.learners if worker_ids is None else worker_ids
        return {rec.zone for w in ids if (rec := self.learners.get(w)) is not None and rec.zone}

    def forget(self, keep: Iterable[str]) -> list[str]:
        """Drop the learners not in `keep` (the coordinator no longer holds their records); returns their ids."""
        kept = set(keep)
        gone = [w for w in self.learners if w not in kept]
        for w in gone:
            self.paused -= self.learners.pop(w).weight == 0
        return gone
