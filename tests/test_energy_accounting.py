"""The coordinator's energy book (`services.coordinator.energy`) as a pure object with explicit times: the carbon
signal (provider over trace), the accounting of energy, carbon and cost, paused learners included, and the fleet's
totals as a checkpoint holds them."""

from __future__ import annotations

import math

import pytest

from diloco.core.energy import CarbonTrace, PowerSource
from diloco.errors import InvalidArgument
from services.coordinator.energy import (
    LAST_GOOD,
    SNAPSHOT_KEY,
    UNKNOWN,
    UNKNOWN_GCO2_PER_KWH,
    CarbonSignal,
    Charge,
    EnergyBook,
    Fallback,
    Reweighed,
    Totals,
)
from services.coordinator.energy import TRACE as TO_TRACE

pytestmark = pytest.mark.timeout(30)
TRACE = CarbonTrace({"DE": ((0.0, 3600.0), (400.0, 100.0)), "FR": ((0.0,), (50.0,))})


def test_the_signal_is_the_providers_last_value_over_the_trace() -> None:
    signal = CarbonSignal(TRACE, origin=1000.0)
    assert signal.at("DE", 1000.0) == 400.0 and signal.at("DE", 1000.0 + 3600.0) == 100.0
    assert signal.mean("DE", 1000.0 + 1800.0, 1000.0 + 5400.0) == pytest.approx(250.0)  # half an hour of each
    signal.set_live("DE", 220.0)
    assert signal.at("DE", 1000.0) == 220.0 and signal.mean("DE", 0.0, 9999.0) == 220.0
    for bad in (math.nan, -1.0, math.inf, 2000.5):
        with pytest.raises(InvalidArgument):
            signal.set_live("DE", bad)
    assert signal.live == {"DE": 220.0}
    signal.check_zone("FR")
    for zone in ("", "MARS"):
        with pytest.raises(InvalidArgument, match="--zone set to one of DE, FR"):
            signal.check_zone(zone)
    CarbonSignal().check_zone("anything")  # without a trace every zone goes


def test_a_zone_without_a_value_falls_back_and_is_never_counted_clean() -> None:
    # a provider alone: a zone it has not answered for is unknown, the dirtiest known zone and at least 1000
    signal = CarbonSignal(provider=True)
    assert signal.at("PL", 0.0) == signal.mean("PL", 0.0, 10.0) == UNKNOWN_GCO2_PER_KWH
    assert signal.fail("PL", "missing", 0.0) == Fallback(UNKNOWN, UNKNOWN_GCO2_PER_KWH, changed=True)
    assert signal.fail("PL", "missing", 5.0).changed is False  # the same fallback for the same reason: logged once
    assert signal.fail("PL", "timeout", 6.0) == Fallback(UNKNOWN, UNKNOWN_GCO2_PER_KWH, changed=True)
    signal.set_live("MN", 1500.0)  # a known zone dirtier than the floor sets the unknown's value
    assert signal.at("PL", 0.0) == 1500.0 and signal.fail("PL", "timeout", 7.0).value == 1500.0
    assert signal.set_live("PL", 700.0) is True and signal.set_live("PL", 650.0) is False  # recovered, then fresh
    assert signal.fail("PL", "missing", 8.0) == Fallback(LAST_GOOD, 650.0, changed=True)  # keeps its last value
    assert signal.at("PL", 9.0) == 650.0
    # a provider over a trace: a zone never answered takes the trace's value; the unknown one the dirtiest of all
    over = CarbonSignal(TRACE, origin=0.0, provider=True)
    assert over.fail("DE", "error", 0.0) == Fallback(TO_TRACE, 400.0, changed=True)
    assert over.at("", 0.0) == UNKNOWN_GCO2_PER_KWH  # no zone, with a trace and a provider
    # neither a trace nor a provider: carbon is not measured, every zone counts 0
    assert CarbonSignal().at("PL", 0.0) == 0.0 and CarbonSignal().mean("PL", 0.0, 10.0) == 0.0
    # the carbon counter charges an unknown zone's work at that value, never at 0
    book = EnergyBook(CarbonSignal(provider=True))
    book.join("a", 0.0, zone="PL", watts=360.0, source=PowerSource.DECLARED)
    assert book.work("a", 10.0, 10.0).grams == pytest.approx(360.0 * 10.0 / 3.6e6 * UNKNOWN_GCO2_PER_KWH)
    assert book.infos({"a": 1.0}, 10.0)["a"].intensity == UNKNOWN_GCO2_PER_KWH


def test_energy_carbon_and_cost_per_learner_and_in_total() -> None:
    book = EnergyBook(CarbonSignal(TRACE, origin=0.0))
    book.join("a", 0.0, zone="DE", price_per_hour=3.6, watts=500.0, source=PowerSource.NVML)
    book.join("b", 0.0, zone="FR", price_per_hour=7.2, spot=True)  # no power reported yet
    assert book.work("b", 10.0, 10.0) == Charge("b")  # no watts: nothing drawn
    book.report("b", 200.0, PowerSource.RAPL)
    book.report("b", 0.0, None)  # a report without power keeps the last figure
    charge = book.work("a", 7200.0, 7200.0)  # 1 kWh over two hours: one at 400, one at 100 gCO2/kWh
    assert charge.joules == 500.0 * 7200.0 == 3.6e6 and charge.grams == pytest.approx(250.0)
    assert book.work("b", 36.0, 7200.0).grams == pytest.approx(200.0 * 36.0 / 3.6e6 * 50.0)
    # cost: b paused from 1 h to 3 h, so it pays for 1 h (before) + 1 h (after, to 4 h); a pays for 4 h
    assert book.set_weights({"a": 1.0, "b": 0.0}, 3600.0) == Reweighed(["b"], [Charge("b", cost=7.2)])
    assert book.paused == 1 and book.learners["b"].weight == 0.0
    assert book.accrue(3 * 3600.0) == [Charge("a", cost=pytest.approx(3 * 3.6))]
    assert book.set_weights({"a": 1.0, "b": 1.0}, 3 * 3600.0).changed == ["b"] and book.paused == 0
    book.accrue(4 * 3600.0)
    assert book.learners["a"].cost == pytest.approx(4 * 3.6) and book.learners["b"].cost == pytest.approx(2 * 7.2)
    assert book.leave("b", 5 * 3600.0) == [Charge("b", cost=pytest.approx(7.2))]
    assert book.accrue(6 * 3600.0) == [Charge("a", cost=pytest.approx(7.2))]  # b's price stopped when it left
    a, b = book.learners["a"], book.learners["b"]
    assert book.joules == a.joules + b.joules and book.grams == pytest.approx(a.grams + b.grams)
    assert book.cost == pytest.approx(a.cost + b.cost) == pytest.approx(6 * 3.6 + 3 * 7.2)
    assert book.forget(["a"]) == ["b"] and set(book.learners) == {"a"}


def test_policy_inputs() -> None:
    book = EnergyBook(CarbonSignal(TRACE, origin=0.0))
    book.join("a", 0.0, zone="DE", price_per_hour=2.0, spot=True, watts=300.0, source=PowerSource.DECLARED)
    infos = book.infos({"a": 1000.0, "new": 500.0}, 4000.0)
    assert (infos["a"].speed, infos["a"].watts, infos["a"].intensity, infos["a"].price_per_hour) == (
        1000.0,
        300.0,
        100.0,
        2.0,
    )
    assert infos["a"].spot and infos["a"].zone == "DE" and book.learners["a"].intensity == 100.0
    assert infos["new"].watts == 0.0 and infos["new"].speed == 500.0
    assert book.zones() == {"DE"} and book.zones(["new"]) == set()


def test_a_book_goes_on_from_the_totals_it_is_given() -> None:
    book = EnergyBook(totals=Totals(joules=7.2e6, grams=900.0, cost=12.5))  # a checkpoint's
    book.join("a", 0.0, price_per_hour=3.6, watts=1000.0, source=PowerSource.DECLARED)
    book.work("a", 3600.0, 3600.0)
    book.accrue(3600.0)
    assert book.totals() == Totals(joules=7.2e6 + 3.6e6, grams=900.0, cost=pytest.approx(12.5 + 3.6))
    a = book.learners["a"]
    assert (a.joules, a.cost) == (3.6e6, pytest.approx(3.6))  # a learner's own figures start from zero


def test_totals_in_a_checkpoint() -> None:
    totals = Totals(joules=3.6e6, grams=250.0, cost=4)
    assert Totals.from_snapshot({"version": 3, SNAPSHOT_KEY: totals.to_snapshot()}) == totals
    assert Totals.from_snapshot({"version": 3}) == Totals()  # written before the totals were kept
    newer = {SNAPSHOT_KEY: {**totals.to_snapshot(), "per_zone": {"DE": 1.0}}}  # a newer writer's extra keys
    assert Totals.from_snapshot(newer) == totals
    for bad in (
        [1.0, 2.0, 3.0],
        {"joules": 1.0, "grams": 2.0},
        {"joules": -1.0, "grams": 0.0, "cost": 0.0},
        {"joules": math.nan, "grams": 0.0, "cost": 0.0},
        {"joules": 0.0, "grams": math.inf, "cost": 0.0},
        {"joules": 0.0, "grams": 0.0, "cost": "12"},
        {"joules": True, "grams": 0.0, "cost": 0.0},
    ):
        with pytest.raises(InvalidArgument, match="checkpoint"):
            Totals.from_snapshot({SNAPSHOT_KEY: bad})
