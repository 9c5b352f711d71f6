"""Local steps and speed-proportional shard placement (diloco.core.placement)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.placement import (
    CLAIM_SPREAD,
    REPLACE_TOLERANCE,
    effective_speeds,
    local_steps,
    measured_speed,
    place_shards,
    plan_local_steps,
    planning_speeds,
    shard_quotas,
    shares_moved,
    work_seconds,
)
from diloco.errors import InvalidArgument

SPEEDS = {"a": 1.0, "b": 1.0, "c": 0.5, "d": 0.25}


# ---------------------------------------------------------------- local steps


def moved_between(before: Mapping[int, str | None], after: Mapping[int, str | None]) -> list[int]:
    """Ids of shards whose owner differs between two placements."""
    return sorted(s for s in set(before) | set(after) if before.get(s) != after.get(s))


def test_plan_local_steps_golden() -> None:
    assert plan_local_steps(SPEEDS, h=100, h_min=10) == {"a": 100, "b": 100, "c": 50, "d": 25}


def test_local_steps_floors_and_clamps_to_h_min() -> None:
    assert local_steps(100, 0.25, 1.0, 10) == 25
    assert local_steps(100, 0.05, 1.0, 10) == 10  # 5 -> clamped up to h_min
    assert local_steps(10, 1.0, 3.0, 1) == 3  # floor(3.33)
    assert local_steps(7, 0.3, 0.3, 1) == 7  # the fastest learner runs exactly h, no float drift
    assert local_steps(3, 0.1, 0.1, 1) == 3


@pytest.mark.parametrize(
    ("h", "speed", "max_speed", "h_min", "needle"),
    [
        (0, 1.0, 1.0, 1, "h must be a positive integer"),
        (10, 1.0, 1.0, 0, "h_min must be a positive integer"),
        (10, 1.0, 1.0, 11, "h_min (11) must not exceed h (10)"),
        (10, 0.0, 1.0, 1, "speed must be a positive finite number"),
        (10, 1.0, math.nan, 1, "max_speed must be a positive finite number"),
        (10, 2.0, 1.0, 1, "exceeds max_speed"),
        (True, 1.0, 1.0, 1, "h must be a positive integer"),
    ],
)
def test_local_steps_validation(h: int, speed: float, max_speed: float, h_min: int, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        local_steps(h, speed, max_speed, h_min)


def test_plan_local_steps_unknown_speed_is_median_of_known() -> None:
    # known speeds 1, 0.5, 0.25 -> median 0.5; 0 and NaN count as unknown
    plan = plan_local_steps({"a": 1.0, "b": 0.5, "c": 0.25, "new": 0.0, "nan": math.nan}, h=100, h_min=10)
    assert plan == {"a": 100, "b": 50, "c": 25, "nan": 50, "new": 50}


def test_plan_local_steps_all_unknown_and_empty() -> None:
    assert plan_local_steps({"a": 0.0, "b": -1.0}, h=40, h_min=5) == {"a": 40, "b": 40}
    assert plan_local_steps({}, h=40, h_min=5) == {}
    with pytest.raises(InvalidArgument):
        plan_local_steps({}, h=0, h_min=5)


def test_effective_speeds_rejects_bad_input() -> None:
    assert effective_speeds({"a": 2.0, "b": math.inf}) == {"a": 2.0, "b": 2.0}
    with pytest.raises(InvalidArgument, match="worker id"):
        effective_speeds({"": 1.0})
    with pytest.raises(InvalidArgument, match="must be a number"):
        effective_speeds({"a": "fast"})  # type: ignore[dict-item]


# ---------------------------------------------------------------- measured and planning speeds


@pytest.mark.parametrize(
    ("work_since", "previous", "published", "waits", "seconds"),
    [
        (0.0, None, None, False, 10.0),  # the first submission: from when it could start
        (4.0, None, 2.0, True, 6.0),  # sync: a version closed before it could start changes nothing
        (0.0, 3.0, 6.0, True, 4.0),  # sync: it waited 3..6 for the broadcast; work is 6..10
        (0.0, 3.0, 6.0, False, 7.0),  # decoupled/async: the broadcast landed mid-training; work is 3..10
        (0.0, 3.0, None, True, 7.0),  # sync, base version's close forgotten: from the previous submission
        (12.0, None, None, False, 0.0),  # never negative
    ],
)
def test_work_seconds(
    work_since: float, previous: float | None, published: float | None, waits: bool, seconds: float
) -> None:
    assert work_seconds(10.0, work_since, previous, published, waits) == seconds


def test_measured_speed_is_a_ratio_of_sums() -> None:
    assert measured_speed([(100, 1.0), (300, 1.0)]) == 200.0
    assert measured_speed([(1000, 0.0), (100, 1.0)]) == 1100.0  # a zero interval adds tokens, not a spike
    assert measured_speed([(1000, 0.0)]) == 0.0  # no time measured yet: unknown
    assert measured_speed([]) == 0.0


def test_planning_speeds_prefer_the_measurement_and_cap_claims_at_the_fastest_measured() -> None:
    claimed = {"a": 1e308, "b": 5.0, "new": 1e308, "slow_claim": 1.0, "no_claim": 0.0}
    measured = {"a": 100.0, "b": 50.0}
    assert planning_speeds(claimed, measured) == {
        "a": 100.0,  # measured: the claim is ignored
        "b": 50.0,
        "new": 100.0,  # a prior no higher than the fastest measured learner
        "slow_claim": 1.0,  # a low claim is kept: it can only cost its own learner
        "no_claim": 0.0,  # unknown: the median rule (`effective_speeds`)
    }
    # measurements of learners that are not in the fleet (departed) do not set the range
    cold = {"b": 100.0, "new": 100.0 * CLAIM_SPREAD}
    assert planning_speeds({"b": 100.0, "new": 1e308}, {"gone": 7.0}) == cold


def test_planning_speeds_cold_start_caps_claims_at_a_multiple_of_the_lower_median() -> None:
    claimed = {"a": 100.0, "b": 100.0, "c": 100.0, "liar": 1e308, "tiny": 1e-9, "none": 0.0}
    assert planning_speeds(claimed, {}) == {
        "a": 100.0,
        "b": 100.0,
        "c": 100.0,
        "liar": 100.0 * CLAIM_SPREAD,
        "tiny": 1e-9,
        "none": 0.0,
    }
    # two learners: the lower median, so the liar does not set the reference
    assert planning_speeds({"a": 100.0, "liar": 1e308}, {}) == {"a": 100.0, "liar": 100.0 * CLAIM_SPREAD}
    assert planning_speeds({"a": 0.0, "b": math.nan}, {}) == {"a": 0.0, "b": 0.0}


def test_shares_moved_compares_shares_not_speeds() -> None:
    placed = {"a": 100.0, "b": 100.0}
    assert not shares_moved(placed, {"a": 200.0, "b": 200.0})  # everyone twice as fast: same shares
    assert not shares_moved(placed, {"a": 110.0, "b": 100.0})  # a's share 0.5 -> 0.524
    lim = (1 + REPLACE_TOLERANCE) / (1 - REPLACE_TOLERANCE)  # a's share 0.5 -> just above 0.5 x (1 + tolerance)
    assert shares_moved(placed, {"a": 100.0 * lim * 1.01, "b": 100.0})
    # shares among the learners in both: a join or a departure is not a drift (membership is placed anyway)
    assert not shares_moved(placed, {"a": 100.0})
    assert not shares_moved(placed, {"a": 100.0, "b": 100.0, "c": 1e9})
    assert shares_moved(placed, {"a": 100.0, "b": 300.0, "c": 1e9})
    assert not shares_moved({}, {"a": 1.0}) and not shares_moved(placed, {})


# ---------------------------------------------------------------- quotas and placement


def test_quotas_largest_remainder_golden() -> None:
    # exact shares 5.82, 5.82, 2.91, 1.45: floors 5,5,2,1 and the 3 largest remainders (c, a, b) get one more
    assert shard_quotas(16, SPEEDS) == {"a": 6, "b": 6, "c": 3, "d": 1}


def test_quotas_tie_goes_to_smaller_worker_id() -> None:
    assert shard_quotas(4, {"w2": 1.0, "w1": 1.0, "w3": 1.0}) == {"w1": 2, "w2": 1, "w3": 1}


def test_quotas_at_least_one_each_when_enough_shards() -> None:
    # share of the slow ones is 0.03 each: they get one, the fast one the rest
    assert shard_quotas(4, {"fast": 100.0, "s1": 1.0, "s2": 1.0}) == {"fast": 2, "s1": 1, "s2": 1}
    assert shard_quotas(3, {"fast": 100.0, "s1": 1.0, "s2": 1.0}) == {"fast": 1, "s1": 1, "s2": 1}


def test_quotas_fewer_shards_than_workers() -> None:
    q = shard_quotas(2, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert q == {"a": 1, "b": 1, "c": 0}
    assert shard_quotas(1, {"slow": 1.0, "fast": 3.0}) == {"fast": 1, "slow": 0}


def test_place_shards_proportional_from_scratch() -> None:
    placement = place_shards(16, SPEEDS, {})
    counts = {w: sum(1 for o in placement.values() if o == w) for w in SPEEDS}
    assert counts == {"a": 6, "b": 6, "c": 3, "d": 1}
    assert sorted(placement) == list(range(16))


def test_place_shards_zero_workers_leaves_all_unowned() -> None:
    assert place_shards(3, {}, {0: "gone", 1: None}) == {0: None, 1: None, 2: None}


def test_place_shards_keeps_owners_when_balanced() -> None:
    current: dict[int, str | None] = {i: ("a" if i % 2 else "b") for i in range(8)}
    assert place_shards(8, {"a": 1.0, "b": 1.0}, current) == current


def test_place_shards_worker_death_moves_only_its_shards() -> None:
    before = place_shards(12, {"a": 1.0, "b": 1.0, "c": 1.0}, {})
    after = place_shards(12, {"a": 1.0, "b": 1.0}, before)
    moved = moved_between(before, after)
    assert moved == sorted(s for s, o in before.items() if o == "c")
    assert all(after[s] in ("a", "b") for s in range(12))
    assert sum(1 for o in after.values() if o == "a") == 6


def test_place_shards_join_moves_minimum_from_over_quota() -> None:
    before = place_shards(12, {"a": 1.0, "b": 1.0}, {})
    after = place_shards(12, {"a": 1.0, "b": 1.0, "c": 1.0}, before)
    moved = moved_between(before, after)
    assert len(moved) == 4  # c's quota; nothing else moves
    assert all(after[s] == "c" for s in moved)
    # the over-quota workers keep their lowest shard ids
    assert [s for s in range(12) if after[s] == "a"] == [s for s in range(12) if before[s] == "a"][:4]


def test_place_shards_reassigns_unowned_and_unknown_owners() -> None:
    current: dict[int, str | None] = {0: "a", 1: None, 2: "ghost", 3: "a"}
    assert place_shards(4, {"a": 1.0, "b": 1.0}, current) == {0: "a", 1: "b", 2: "b", 3: "a"}


def test_place_shards_rejects_out_of_range_current() -> None:
    with pytest.raises(InvalidArgument, match="shard 5"):
        place_shards(4, {"a": 1.0}, {5: "a"})
    with pytest.raises(InvalidArgument, match="num_shards"):
        place_shards(-1, {"a": 1.0}, {})


worker_ids = st.sampled_from([f"w{i}" for i in range(8)])
speed_maps = st.dictionaries(worker_ids, st.one_of(st.floats(0.01, 100.0), st.just(0.0), st.just(math.nan)), max_size=8)


@settings(max_examples=200, deadline=None)
@given(
    num_shards=st.integers(0, 40),
    speeds=speed_maps,
    current_owners=st.lists(st.one_of(st.none(), worker_ids), max_size=40),
)
def test_place_shards_properties(num_shards: int, speeds: dict[str, float], current_owners: list[str | None]) -> None:
    current = {i: o for i, o in enumerate(current_owners[:num_shards])}
    placement = place_shards(num_shards, speeds, current)
    # deterministic: insertion order of the speeds does not matter
    assert placement == place_shards(num_shards, dict(reversed(list(speeds.items()))), current)
    assert sorted(placement) == list(range(num_shards))
    if not speeds:
        assert all(o is None for o in placement.values())
        return
    assert all(o in speeds for o in placement.values())
    quotas = shard_quotas(num_shards, speeds)
    counts = {w: sum(1 for o in placement.values() if o == w) for w in speeds}
    assert counts == quotas
    assert sum(quotas.values()) == num_shards
    if num_shards >= len(speeds):
        assert min(counts.values()) >= 1
    # proportionality: a faster learner never gets fewer shards; without the at-least-one floor in play every
    # count is its exact share rounded down or up
    eff = effective_speeds(speeds)
    total = sum(eff.values())
    shares = {w: num_shards * eff[w] / total for w in eff}
    for a in eff:
        for b in eff:
            if eff[a] > eff[b]:
                assert counts[a] >= counts[b]
    if num_shards < len(speeds) or min(shares.values()) >= 1:
        for w, n in counts.items():
            assert math.floor(shares[w] + 1e-9) <= n <= math.ceil(shares[w] - 1e-9)
    # minimal moves: a shard moves only away from a dead or over-quota owner, or from unowned
    moved = moved_between(current, placement)
    lower_bound = sum(max(0, quotas[w] - sum(1 for o in current.values() if o == w)) for w in quotas)
    assert len(moved) == lower_bound
    # stable: placing again with the result as current moves nothing
    assert place_shards(num_shards, speeds, placement) == placement
