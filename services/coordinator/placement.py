"""Energy-, carbon- and cost-aware placement in the coordinator service (issue #15): the learners' energy book
(`services.coordinator.energy.EnergyBook`), the placement policy (`diloco.core.energy.decide`, where the rules
are), and what they show: the Prometheus counters and gauges and the `placement.changed` and `carbon.*` lines.

`CoordinatorState` holds one `Placement` and calls every method under its bookkeeping `lock`; none reads the
clock (`now` is the coordinator's unix seconds) and none touches the core's bookkeeping: `place` reads the core
and sets its placement weights, and the state wakes its round poller when they changed.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import structlog

from diloco.core.coordinator import CoordinatorCore
from diloco.core.energy import PauseDelay, Policy, PolicyConfig, PowerSource, decide
from diloco.core.states import WorkerState
from services.coordinator.energy import J_PER_KWH, Charge, EnergyBook, Totals
from services.coordinator.metrics import CoordinatorMetrics


@dataclass(frozen=True)
class Joining:
    """What a registering learner says about its power, zone, price and capacity."""

    watts: float = 0.0
    source: PowerSource | None = None
    zone: str = ""
    price_per_hour: float = 0.0
    spot: bool = False


@dataclass(frozen=True)
class Usage:
    """The fleet's figures for `diloco ctl status`: the live learners' watts and what the fleet used."""

    paused_workers: int
    watts: float
    energy_kwh: float
    carbon_g: float
    cost: float


class Placement:
    """The energy book and the placement policy of one coordinator, with their metrics and log lines."""

    def __init__(
        self,
        book: EnergyBook,
        policy: PolicyConfig,
        metrics: CoordinatorMetrics,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.book = book  # learners' power, zones, prices and what they used
        self.policy = policy
        self.pause_delay = PauseDelay(policy.started_s or 0.0)  # what the policy's pauses cost the job so far
        self.reason = ""  # the last decision's reason
        self.metrics, self.log = metrics, log
        # the fleet's counters go on from the book's totals (a checkpoint's, when resumed from one)
        metrics.fleet_energy_joules.inc(book.joules)
        metrics.fleet_carbon_grams.inc(book.grams)
        metrics.fleet_cost.inc(book.cost)

    # --- learners ---------------------------------------------------------------------------------------------------
    def join(self, worker_id: str, now: float, e: Joining, known: Collection[str]) -> bool:
        """A learner registered (`known`: every learner the core still has a record of). True when it brings a zone
        no carbon source has given a value for yet (the carbon provider is asked for it at once)."""
        if len(self.book.learners) >= len(known):  # the core dropped departed records
            for gone in self.book.forget(known):
                self.metrics.forget_worker(gone)
        new_zone = bool(e.zone) and e.zone not in self.book.signal.live and e.zone not in self.book.zones()
        self.book.join(
            worker_id, now, zone=e.zone, price_per_hour=e.price_per_hour, spot=e.spot, watts=e.watts, source=e.source
        )
        self.gauges([worker_id])  # weighed at the next round close, with the rest
        return new_zone

    def leave(self, worker_id: str, now: float) -> None:
        """A live learner left, died or was evicted: what it used until `now` is charged."""
        self.charge(self.book.leave(worker_id, now))
        self.gauges([worker_id])

    def work(self, worker_id: str, seconds: float, now: float) -> None:
        """A submission of `worker_id`'s was accepted: its `seconds` of work are charged."""
        self.charge([self.book.work(worker_id, seconds, now)])

    def accrue(self, now: float) -> None:
        """Costs up to `now` into the counters (before a view or a checkpoint)."""
        self.charge(self.book.accrue(now))

    def totals(self, now: float) -> Totals:
        """The fleet's totals with costs up to `now` (for a checkpoint)."""
        self.accrue(now)
        return self.book.totals()

    def usage(self, live: Collection[str], now: float) -> Usage:
        """The fleet's figures at `now`, with costs up to it."""
        self.accrue(now)
        book = self.book
        return Usage(
            paused_workers=book.paused,
            watts=math.fsum(rec.watts for w in live if (rec := book.learners.get(w)) is not None),
            energy_kwh=book.joules / J_PER_KWH,
            carbon_g=book.grams,
            cost=book.cost,
        )

    # --- the policy ---------------------------------------------------------------------------------------------------
    def place(self, core: CoordinatorCore, now: float) -> bool:
        """The policy's weights for the active learners now, from their planning speeds (measured, else a bounded
        claim) and what the book knows (watts, zone intensity at `now`, price, capacity), set on the core (a paused
        learner keeps its registration, gets no shards and is not waited for; the ledger moves its shards like any
        hand-off). True when the weights changed: a round may have waited only for a learner now paused. Called at
        every round close and departure (a newcomer counts with weight 1 until the next round close, so a burst of
        registrations costs no decision each); `speed` has nothing to decide (every weight is 1)."""
        if self.policy.policy is Policy.SPEED:
            return False
        live = core.live_ids()
        speeds = core.planning_speeds()
        active = {w: speeds[w] for w in live if core.workers[w].state == WorkerState.ACTIVE}
        delay = self.pause_delay.advance(now)
        infos = self.book.infos(active, now)
        decision = decide(now, infos, self.policy, tokens_left=_tokens_left(core), delay_s=delay)
        self.pause_delay.follow(decision)
        weights = {w: decision.weights.get(w, 1.0) for w in live}
        changed = core.set_placement_weights(weights)
        moved = self.book.set_weights(weights, now)
        self.charge(moved.charges)
        if active:  # with nobody active (the run over, everyone gone) the last reason stays
            self.reason = decision.reason
        if changed:
            self.metrics.placement_changes.inc()
            self.log.info(
                "placement.changed",
                policy=self.policy.policy.value,
                reason=decision.reason,
                paused=list(decision.paused),
                weights={w: x for w, x in weights.items() if x != 1.0},
                plan_seq=core.plan_seq,
            )
        self.gauges(moved.changed)
        return changed

    # --- the carbon signal ------------------------------------------------------------------------------------------
    def set_intensity(self, zone: str, value: float) -> None:
        """The carbon provider's value for `zone` (gCO2/kWh); the next placement uses it."""
        recovered = self.book.signal.set_live(zone, value)
        self.metrics.carbon_intensity.labels(zone=zone).set(value)
        if recovered:
            self.log.info("carbon.provider_recovered", zone=zone, gco2_per_kwh=value)

    def intensity_failed(self, zone: str, reason: str, detail: str, now: float) -> None:
        """A carbon provider call gave no good value for `zone`: counted by reason and by zone, and logged when the
        zone's fallback or the reason changes (`CarbonSignal.fail` says what the zone falls back to)."""
        fallback = self.book.signal.fail(zone, reason, now)
        self.metrics.carbon_provider_failures.labels(reason=reason).inc()
        self.metrics.carbon_fallbacks.labels(zone=zone, to=fallback.to).inc()
        if fallback.changed:
            self.log.warning(
                "carbon.provider_failed",
                zone=zone,
                reason=reason,
                detail=detail,
                fallback=fallback.to,
                gco2_per_kwh=fallback.value,
            )

    # --- metrics ------------------------------------------------------------------------------------------------------
    def charge(self, charges: list[Charge]) -> None:
        """What learners used, into the counters."""
        m = self.metrics
        for ch in charges:
            if ch.joules:
                m.energy_joules.labels(worker=ch.worker_id).inc(ch.joules)
                m.fleet_energy_joules.inc(ch.joules)
            if ch.grams:
                m.carbon_grams.labels(worker=ch.worker_id).inc(ch.grams)
                m.fleet_carbon_grams.inc(ch.grams)
            if ch.cost:
                m.cost.labels(worker=ch.worker_id).inc(ch.cost)
                m.fleet_cost.inc(ch.cost)

    def gauges(self, worker_ids: list[str]) -> None:
        """The watts and weights of `worker_ids` (those that changed), and how many are paused."""
        for w in worker_ids:
            rec = self.book.learners.get(w)
            if rec is not None:
                self.metrics.worker_watts.labels(worker=w).set(rec.watts)
                self.metrics.placement_weight.labels(worker=w).set(rec.weight)
        self.metrics.paused_workers.set(self.book.paused)


def _tokens_left(core: CoordinatorCore) -> float:
    """Tokens the run still needs (for the `cost` policy's deadline): the rounds left to the target times the tokens
    an applied round held so far on average; 0 (unknown) without a target or before the first round."""
    target = core.cfg.target_outer_steps
    if not target or not core.version:
        return 0.0
    return max(0, target - core.version) * core.tokens_applied / core.version
