"""Energy-, carbon- and cost-aware placement (diloco.core.energy), the carbon trace, and the simulator's report."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.energy import CarbonTrace, LearnerInfo, PauseDelay, Policy, PolicyConfig, decide, placed_speeds
from diloco.core.placement import place_shards, plan_local_steps
from diloco.errors import ConfigError
from diloco.sim.config import SimConfig
from diloco.sim.engine import simulate
from diloco.sim.fleet import parse_fleet

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "carbon" / "diurnal.csv"

# an H100-, A100- and V100-class fleet and one far worse part (speed in tokens/s, watts)
FLEET = {
    "h1": LearnerInfo(100.0, 700.0, intensity=40.0, price_per_hour=4.0, zone="hydro"),
    "h2": LearnerInfo(100.0, 700.0, intensity=40.0, price_per_hour=2.0, spot=True, zone="hydro"),
    "a1": LearnerInfo(40.0, 400.0, intensity=450.0, price_per_hour=2.0, zone="solar"),
    "v1": LearnerInfo(16.0, 300.0, intensity=450.0, price_per_hour=1.5, zone="solar"),
    "p1": LearnerInfo(5.5, 300.0, intensity=700.0, price_per_hour=1.0, zone="coal"),
}


def speeds_of(fleet: dict[str, LearnerInfo]) -> dict[str, float]:
    return {w: i.speed for w, i in fleet.items()}


@given(
    speeds=st.dictionaries(
        st.sampled_from("abcdefgh"),
        st.one_of(st.floats(0.01, 1e4), st.just(0.0), st.just(math.nan)),
        min_size=1,
        max_size=8,
    ),
    shards=st.integers(0, 40),
)
@settings(max_examples=200, deadline=None)
def test_speed_policy_places_exactly_as_today(speeds: dict[str, float], shards: int) -> None:
    infos = {w: LearnerInfo(v, 100.0) for w, v in speeds.items()}
    d = decide(0.0, infos, PolicyConfig(Policy.SPEED))
    assert d.paused == () and set(d.weights.values()) == {1.0}
    placed = placed_speeds(speeds, d.weights)
    assert place_shards(shards, placed, {}) == place_shards(shards, speeds, {})
    assert plan_local_steps(placed, 20, 2) == plan_local_steps(speeds, 20, 2)


@given(
    fleet=st.dictionaries(
        st.sampled_from("abcdefgh"),
        st.tuples(st.floats(0.1, 100.0), st.floats(1.0, 1000.0), st.floats(0.0, 900.0), st.floats(0.0, 10.0)),
        min_size=1,
        max_size=8,
    ),
    policy=st.sampled_from(list(Policy)),
    min_active=st.integers(1, 8),
)
@settings(max_examples=300, deadline=None)
def test_every_policy_keeps_the_quorum_and_pauses_only_with_weight_zero(
    fleet: dict[str, tuple[float, float, float, float]], policy: Policy, min_active: int
) -> None:
    infos = {w: LearnerInfo(v, watts, intensity=g, price_per_hour=p) for w, (v, watts, g, p) in fleet.items()}
    d = decide(3600.0, infos, PolicyConfig(policy, min_active=min_active, carbon_threshold=300.0))
    assert set(d.weights) == set(fleet)
    assert len(d.active()) >= min(min_active, len(fleet))
    assert set(d.paused) == {w for w, x in d.weights.items() if x == 0.0}
    assert d.reason.startswith(policy.value)
    assert decide(3600.0, infos, PolicyConfig(policy, min_active=min_active, carbon_threshold=300.0)) == d


def test_energy_pauses_the_far_worse_learner_when_it_costs_little_time() -> None:
    d = decide(0.0, FLEET, PolicyConfig(Policy.ENERGY, min_active=2))
    assert d.paused == ("p1", "v1")  # 55 and 19 J/token against 7.5 for the rest, 9% of the speed
    assert "p1" in d.reason and "v1" in d.reason
    # not when pausing it costs more time than allowed
    d = decide(0.0, FLEET, PolicyConfig(Policy.ENERGY, min_active=2, energy_max_slowdown=0.05))
    assert d.paused == ("p1",)
    d = decide(0.0, FLEET, PolicyConfig(Policy.ENERGY, min_active=2, energy_max_slowdown=0.01))
    assert d.paused == ()
    # nor below the quorum
    assert decide(0.0, FLEET, PolicyConfig(Policy.ENERGY, min_active=4)).paused == ("p1",)
    assert decide(0.0, FLEET, PolicyConfig(Policy.ENERGY, min_active=5)).paused == ()
    # nor when the deadline needs its speed
    tight = PolicyConfig(Policy.ENERGY, min_active=2, deadline_s=100.0)
    assert decide(0.0, FLEET, tight, tokens_left=261.5 * 99.0).paused == ()


# the benchmark's fleet: two each of H100-, A100- and V100-class parts and three P100-class (tokens/s, watts)
GENERATIONS = {
    **{f"h{i}": LearnerInfo(1.0, 700.0) for i in (1, 2)},
    **{f"a{i}": LearnerInfo(0.4, 400.0) for i in (1, 2)},
    **{f"v{i}": LearnerInfo(0.16, 300.0) for i in (1, 2)},
    **{f"p{i}": LearnerInfo(0.055, 300.0) for i in (1, 2, 3)},
}


def test_energy_spends_the_time_its_steady_pauses_leave_on_the_next_learner() -> None:
    # 3,285 tokens at every learner's 3.285 tokens/s: 1,000 s. Pausing the P100s costs 5% of the speed, a V100
    # besides 11%: over the 10% allowance at any one moment, so without the job's figures only the P100s pause.
    cfg = PolicyConfig(Policy.ENERGY, min_active=2, started_s=0.0)
    assert decide(0.0, GENERATIONS, PolicyConfig(Policy.ENERGY, min_active=2)).paused == ("p1", "p2", "p3")
    assert decide(0.0, GENERATIONS, cfg, tokens_left=3285.0).paused == ("p1", "p2", "p3")

    def at(now: float, paused_v1: bool) -> tuple[str, ...]:
        """The decision at `now`, the P100s paused since 0 (and v1 as `paused_v1` says)."""
        delay = now * 0.165 / 3.285  # what the P100s' pause cost so far
        left = 3285.0 - now * 3.12
        fleet = {
            w: dataclasses.replace(i, paused=w.startswith("p") or (w == "v1" and paused_v1))
            for w, i in GENERATIONS.items()
        }
        return decide(now, fleet, cfg, tokens_left=left, delay_s=delay).paused

    # at 600 s, pausing v1 to the end would spend 77.4 s of the 100 s the job may lose: over the 75 s (75%) a new
    # pause may plan, within the 80 s a pause already taken may keep (no flapping at the edge)
    assert at(600.0, paused_v1=False) == ("p1", "p2", "p3")
    assert at(600.0, paused_v1=True) == ("p1", "p2", "p3", "v1")
    # at 700 s it spends 72.0 s: v1 pauses; v2 as well would spend 93.2 s
    assert at(700.0, paused_v1=False) == ("p1", "p2", "p3", "v1")


def test_energy_over_the_job_saves_more_within_the_same_time() -> None:
    """A fluid job decided every second: the whole job's allowance ends it within 10% of the time with every
    learner active (as pausing only at each moment's 10% does) and spends less energy."""

    def run(cfg: PolicyConfig) -> tuple[float, float]:
        delay, left, now, joules, paused = PauseDelay(0.0), 3285.0, 0.0, 0.0, set[str]()
        while left > 0:
            fleet = {w: dataclasses.replace(i, paused=w in paused) for w, i in GENERATIONS.items()}
            d = decide(now, fleet, cfg, tokens_left=left, delay_s=delay.advance(now))
            delay.follow(d)
            paused = set(d.paused)
            active = d.active()
            left -= sum(GENERATIONS[w].speed for w in active)
            joules += sum(GENERATIONS[w].watts for w in active)
            now += 1.0
        return now, joules

    steady = run(PolicyConfig(Policy.ENERGY, min_active=2))
    job = run(PolicyConfig(Policy.ENERGY, min_active=2, started_s=0.0))
    every = 1000.0, 1000.0 * 3700.0
    assert steady[0] <= 1.1 * every[0] and job[0] <= 1.08 * every[0]  # it plans 80% of the allowance
    assert 1 - steady[1] / every[1] == pytest.approx(0.203, abs=0.002)  # the P100s' pause alone
    assert 1 - job[1] / every[1] > 0.215  # and a V100's for most of the job


def test_pause_delay_integrates_what_each_decision_left_paused() -> None:
    delay = PauseDelay(100.0)
    assert delay.advance(50.0) == 0.0 and delay.advance(200.0) == 0.0  # all active so far
    delay.follow(decide(200.0, GENERATIONS, PolicyConfig(Policy.ENERGY, min_active=2)))  # the P100s: 5% paused
    assert delay.advance(300.0) == pytest.approx(100.0 * 0.165 / 3.285)
    delay.follow(decide(300.0, GENERATIONS, PolicyConfig(Policy.SPEED)))
    assert delay.advance(400.0) == pytest.approx(100.0 * 0.165 / 3.285)


def test_energy_keeps_a_fleet_of_equals() -> None:
    equal = {w: LearnerInfo(10.0, 300.0) for w in "abc"}
    assert decide(0.0, equal, PolicyConfig(Policy.ENERGY)).paused == ()


def test_carbon_pauses_dirty_zones_when_greener_capacity_exists() -> None:
    cfg = PolicyConfig(Policy.CARBON, min_active=2, carbon_threshold=300.0)
    d = decide(0.0, FLEET, cfg)
    assert d.paused == ("p1", "v1")  # a1 too would slow the fleet by 31% (> 25%)
    # a smaller allowance binds sooner: the dirtiest per token first
    d = decide(0.0, FLEET, PolicyConfig(Policy.CARBON, min_active=2, carbon_threshold=300.0, carbon_max_slowdown=0.05))
    assert d.paused == ("p1",)
    d = decide(0.0, FLEET, PolicyConfig(Policy.CARBON, min_active=2, carbon_threshold=300.0, carbon_max_slowdown=0.5))
    assert d.paused == ("a1", "p1", "v1")
    # not when it would break the quorum
    assert decide(0.0, FLEET, PolicyConfig(Policy.CARBON, min_active=4, carbon_threshold=300.0)).paused == ("p1",)
    # not when no greener learner would stay
    dirty = {w: LearnerInfo(10.0, 300.0, intensity=700.0) for w in "ab"}
    assert decide(0.0, dirty, cfg).paused == ()
    # no threshold: the dirtiest zone at this moment
    assert decide(0.0, FLEET, PolicyConfig(Policy.CARBON, min_active=2)).paused == ("p1",)


def test_cost_meets_the_deadline_at_the_lowest_price() -> None:
    # no deadline: only learners cheaper per token than the chosen set (spot h2 at 0.02/token, h1 at 0.04)
    d = decide(0.0, FLEET, PolicyConfig(Policy.COST, min_active=1))
    assert d.paused == ("a1", "h1", "p1", "v1")
    # a deadline that needs ~150 tokens/s: h2 (100) is not enough, h1 joins
    d = decide(0.0, FLEET, PolicyConfig(Policy.COST, min_active=1, deadline_s=1000.0), tokens_left=150_000)
    assert d.active() == ["h1", "h2"]
    # spot not allowed: on-demand first, spot only when nothing else will do
    d = decide(0.0, FLEET, PolicyConfig(Policy.COST, min_active=1, allow_spot=False))
    assert d.active() == ["h1"]
    # an impossible deadline: everyone, and the reason says so
    d = decide(0.0, FLEET, PolicyConfig(Policy.COST, deadline_s=10.0), tokens_left=1e9)
    assert d.paused == () and "cannot be met" in d.reason


def test_placed_speeds_leave_paused_learners_out() -> None:
    placed = placed_speeds({"a": 2.0, "b": 1.0, "c": 0.0}, {"b": 0.0, "c": 0.5})
    assert placed == {"a": 2.0, "c": 0.75}  # c unknown: the median of the known (1.5), halved
    with pytest.raises(ConfigError, match="weight"):
        placed_speeds({"a": 1.0}, {"a": 1.5})
    assert set(place_shards(8, placed, {}).values()) == {"a", "c"}


# --------------------------------------------------------------------------------------------- carbon trace
def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "trace.csv"
    p.write_text(text)
    return p


def test_example_trace_loads_and_has_three_diurnal_zones() -> None:
    trace = CarbonTrace.load(EXAMPLE)
    assert sorted(trace.zones) == ["coal", "hydro", "solar"]
    assert trace.intensity("solar", 13 * 3600) < 150 < 400 < trace.intensity("solar", 2 * 3600)
    assert trace.intensity("coal", 0) > trace.intensity("solar", 0) > trace.intensity("hydro", 0)


def test_trace_lookup_step_linear_and_mean(tmp_path: Path) -> None:
    p = write(tmp_path, "# c\nzone,time_s,gco2_per_kwh\nz,0,100\nz,10,200\nz,20,100\n")
    step, linear = CarbonTrace.load(p), CarbonTrace.load(p, "linear")
    assert [step.intensity("z", t) for t in (-5, 0, 5, 10, 25)] == [100, 100, 100, 200, 100]
    assert [linear.intensity("z", t) for t in (-5, 5, 15, 25)] == [100, 150, 150, 100]
    assert step.mean("z", 5, 15) == pytest.approx(150.0)
    assert linear.mean("z", 0, 20) == pytest.approx(150.0)
    with pytest.raises(ConfigError, match="zone 'mars' is not in the carbon trace"):
        step.intensity("mars", 0)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("zone,time_s,gco2_per_kwh,price\nz,0,1,2\n", r"line 1: .*unknown columns \['price'\]"),
        ("zone,time_s\nz,0\n", r"misses \['gco2_per_kwh'\]"),
        ("zone,time_s,gco2_per_kwh\nz,0,100\nz,10,-1\n", "line 3: .*gco2_per_kwh from 0 to 2000"),
        ("zone,time_s,gco2_per_kwh\nz,0,100\nz,10,2001\n", "line 3: .*gco2_per_kwh from 0 to 2000, got 10.0, 2001"),
        ("zone,time_s,gco2_per_kwh\nz,-5,100\n", "line 2: time_s must be finite and >= 0"),
        ("zone,time_s,gco2_per_kwh\nz,0,100\nz,0,100\n", "line 3: time 0.0 of zone 'z' is not after"),
        ("zone,time_s,gco2_per_kwh\nz,10,100\nz,5,100\n", "line 3: .*not after"),
        ("zone,time_s,gco2_per_kwh\nz,0,1\nz,10,1\nz,20,1\nz,60,1\nz,70,1\n", "line 5: a gap in zone 'z'"),
        ("zone,time_s,gco2_per_kwh\nz,0,abc\n", "line 2: .*must be numbers"),
        ("zone,time_s,gco2_per_kwh\nz,0\n", "line 2: 2 fields"),
        ("zone,time_s,gco2_per_kwh\n", "no rows"),
        ("", "empty"),
    ],
)
def test_trace_validation_names_the_row(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CarbonTrace.load(write(tmp_path, text))


# ------------------------------------------------------------------------------------------------ simulator
def fleet_cfg(placement: str, **kw: object) -> SimConfig:
    fleet = parse_fleet("h100@hydro,a100@solar,p100@coal,p100@coal")
    base: dict[str, object] = dict(
        mode="decoupled",
        speeds=tuple(f.hw.speed for f in fleet),
        fleet=fleet,
        placement=placement,
        carbon_trace=CarbonTrace.load(EXAMPLE),
        min_quorum=1,
        num_shards=8,
        token_budget=200_000,
        step_time_s=60.0,
        train=False,
        model_numel=10_000,
    )
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_simulated_energy_policy_spends_less_energy_than_speed() -> None:
    speed, energy = simulate(fleet_cfg("speed")), simulate(fleet_cfg("energy"))
    assert speed.tokens >= 200_000 and energy.tokens >= 200_000
    assert energy.energy_j < 0.8 * speed.energy_j
    assert energy.time_s < 1.10 * speed.time_s
    assert [p["paused"] for p in energy.placements] == [[2, 3]]
    assert speed.carbon_g > 0 and speed.cost > 0 and energy.cost < speed.cost
    assert energy.per_learner[2]["energy_j"] == 0.0


def test_cli_reports_energy_carbon_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from diloco.cli.main import main

    args = ["simulate", "--no-train", "--model-numel", "10000", "--fleet", "h100@hydro,a100@solar,v100@coal"]
    args += ["--carbon-trace", str(EXAMPLE), "--placement", "carbon", "--outer-steps", "3", "-K", "1", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["energy_j"] > 0 and out["carbon_g"] > 0 and out["cost"] > 0 and out["time_s"] > 0
    assert "final_loss" in out and out["placements"][0]["paused"] == [2]  # coal, the dirtiest zone
    bad = [*args, "--fleet", "h100@mars,a100@solar,v100@coal"]
    assert main(bad) == 2
    assert "'mars' is not in the carbon trace" in capsys.readouterr().err


def test_simulator_refuses_a_policy_without_a_fleet_and_an_unknown_zone() -> None:
    with pytest.raises(ConfigError, match="needs a fleet"):
        SimConfig(speeds=(1.0, 1.0), placement="energy", outer_steps=1, train=False)
    with pytest.raises(ConfigError, match="unknown policy"):
        fleet_cfg("greenest")
    with pytest.raises(ConfigError, match="'mars' is not in the carbon trace"):
        fleet_cfg("carbon", fleet=parse_fleet("h100@mars,a100@solar,p100@coal,p100@coal"))


# ------------------------------------------------------------------------------------------- coordinator core
def test_coordinator_pauses_a_learner_by_weight_and_brings_it_back() -> None:
    import torch

    from diloco.core.coordinator import CoordinatorConfig, CoordinatorCore
    from diloco.core.rounds import RoundConfig

    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode="decoupled", min_quorum=1), local_steps=20, min_local_steps=2, expected_workers=3
    )
    core = CoordinatorCore(cfg, torch.zeros(4), [1000] * 6)
    ids = [core.register(name, 0.0, speed=s).worker_id for name, s in (("fast", 4.0), ("mid", 2.0), ("slow", 1.0))]
    fast, mid, slow = ids
    assert all(core.plan(w).shards for w in ids)
    assert not core.set_placement_weights(dict.fromkeys(ids, 1.0))  # all 1: no change
    assert core.set_placement_weights({fast: 0.0})
    # paused: still registered and live, no shards once the hand-off completes, not waited for
    assert core.worker(fast).state.value == "active"
    assert core.plan(fast).shards == ()
    assert not core.ledger.owned_by(fast)  # given back at once (new epochs), not staged behind a submission
    assert sum(len(core.plan(w).shards) for w in (mid, slow)) == 6
    assert fast in core.policy.idle
    assert core.plan(mid).local_steps == 20  # H_m against the fastest learner still placed
    assert core.plan(slow).local_steps == 10
    with pytest.raises(ConfigError, match="weight"):
        core.set_placement_weights({mid: 2.0})
    assert core.set_placement_weights({})  # back to speed placement
    assert core.plan(mid).local_steps == 10
