"""Placement and H_m from the throughput the coordinator measures, a claim being only a bounded prior
(ALGORITHM.md section 6; the rule is written in `diloco.core.placement`). Pure core, driven by a `now` we choose."""

from __future__ import annotations

import random

import pytest
import torch

from diloco.core.coordinator import CoordinatorConfig, CoordinatorCore, Submission
from diloco.core.ledger import ShardRange
from diloco.core.placement import CLAIM_SPREAD
from diloco.core.rounds import RoundConfig
from diloco.core.states import DEAD, WorkerState
from diloco.errors import DilocoError

N = 4
SHARD = 10**9  # tokens per shard: never exhausted here
H = 40


def core(mode: str, learners: int, shards: int = 16, k: int | None = None) -> CoordinatorCore:
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode=mode, min_quorum=k or learners, grace_max_s=1.0),
        local_steps=H,
        min_local_steps=2,
        expected_workers=learners,
    )
    return CoordinatorCore(cfg, torch.zeros(N), [SHARD] * shards)


def deliver(c: CoordinatorCore, worker: str, sid: str, tokens: int, now: float, base: int | None = None) -> None:
    """`worker` submits `tokens` read from the first shard of its plan, arriving at `now`."""
    plan = c.plan(worker)
    lease = plan.shards[0]
    rng = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + tokens)
    version = c.version if base is None else base
    c.accept(Submission(worker, sid, version, tokens, 10, (rng,), plan.plan_seq), torch.zeros(N), now)


def shards_in_plan(c: CoordinatorCore) -> dict[str, int]:
    return {w: len(c.plan(w).shards) for w in c.live_ids()}


def placed(c: CoordinatorCore) -> dict[str, int]:
    """Shards each learner trains now or will once a hand-off to it completes."""
    return {w: n + sum(t == w for t, _ in c.staged.values()) for w, n in shards_in_plan(c).items()}


def shards_in_ledger(c: CoordinatorCore) -> dict[str, int]:
    return {w: len(c.ledger.owned_by(w)) for w in c.live_ids()}


def steps(c: CoordinatorCore) -> dict[str, int]:
    return {w: c.plan(w).local_steps for w in c.live_ids()}


# ---------------------------------------------------------------- the measured rule


def test_sync_measures_from_the_broadcast_not_from_the_previous_submission() -> None:
    """A sync learner waits for the round between submissions: the wait is not counted."""
    c = core("sync", 2, shards=4)
    a, b = c.register("a", 0.0, speed=5.0).worker_id, c.register("b", 0.0, speed=5.0).worker_id
    deliver(c, a, "a1", 1000, now=10.0)  # 10 s of work since registering
    deliver(c, b, "b1", 1000, now=20.0)  # 20 s: the round closes, version 1 at t = 20
    assert (c.workers[a].measured_speed, c.workers[b].measured_speed) == (100.0, 50.0)
    deliver(c, a, "a2", 1000, now=30.0)  # a waited 10..20 for version 1, then worked 20..30
    deliver(c, b, "b2", 1000, now=40.0)
    assert (c.workers[a].measured_speed, c.workers[b].measured_speed) == (100.0, 50.0)
    assert c.workers[a].speed_samples == ((1000, 10.0), (1000, 10.0))


def test_decoupled_measures_from_the_previous_submission_not_from_the_broadcast() -> None:
    """A decoupled learner trains on while the round closes; the steps made meanwhile are in its next
    submission, so the broadcast's time must not restart the count."""
    c = core("decoupled", 2, shards=4, k=1)
    a, b = c.register("a", 0.0).worker_id, c.register("b", 0.0).worker_id
    deliver(c, a, "a1", 1000, now=10.0)
    assert c.poll(11.0) is not None  # version 1 closes at 11 s (K = 1 plus the grace window)
    deliver(c, a, "a2", 1000, now=20.0, base=1)  # trained 10..20, rebased onto version 1 at about 11
    assert c.workers[a].speed_samples == ((1000, 10.0), (1000, 10.0))
    assert c.workers[a].measured_speed == 100.0
    assert c.workers[b].measured_speed == 0.0  # not measured yet: unknown


def test_measured_speed_is_a_ratio_of_sums_over_the_last_four_submissions() -> None:
    c = core("async", 1, shards=2)
    a = c.register("a", 0.0).worker_id
    t = 0.0
    for i, (tokens, seconds) in enumerate([(100, 1.0), (100, 1.0), (100, 1.0), (100, 1.0), (900, 3.0)]):
        t += seconds
        deliver(c, a, f"a{i}", tokens, now=t)
    # the first sample (100 tokens in 1 s) fell out of the window: (100 + 100 + 100 + 900) / (1 + 1 + 1 + 3)
    assert c.workers[a].measured_speed == pytest.approx(1200 / 6)
    deliver(c, a, "burst", 100, now=t)  # a second submission at the same instant: 0 s of work, tokens count
    assert c.workers[a].measured_speed == pytest.approx(1200 / 5)


def test_a_newcomer_waiting_for_a_hand_off_is_measured_from_when_it_got_shards() -> None:
    c = core("decoupled", 1, shards=4, k=1)
    a = c.register("a", 0.0).worker_id
    b = c.register("b", 5.0).worker_id  # two of a's shards are staged for b: b has nothing to train yet
    assert shards_in_plan(c)[b] == 0
    deliver(c, a, "a1", 1000, now=10.0)  # the hand-off completes: b's work can start at 10 s
    assert shards_in_plan(c)[b] == 2
    deliver(c, b, "b1", 500, now=15.0)
    assert c.workers[b].speed_samples == ((500, 5.0),)  # not 10 s since it registered


# ---------------------------------------------------------------- claims are bounded priors


def test_a_liar_at_a_cold_start_loses_its_excess_shards_within_two_rounds() -> None:
    """Nobody is measured yet: the liar's claim counts, capped at CLAIM_SPREAD x the lower median claim. It
    delivers like the others (100 tokens/s); the round holding the first measurements takes its excess shards
    out of its plan, and its next submission hands them over in the ledger."""
    c = core("decoupled", 4)
    honest = [c.register(n, 0.0, speed=100.0).worker_id for n in "abc"]
    liar = c.register("liar", 0.0, speed=1e308).worker_id
    # quotas from the capped claim: 16 x 400 / 700 = 9.1 for the liar, 2.3 for each honest learner
    quota = int(16 * 100 * CLAIM_SPREAD / (300 + 100 * CLAIM_SPREAD))
    assert sum(placed(c).values()) == 16 and placed(c)[liar] == quota
    assert steps(c) == {**dict.fromkeys(honest, H // 4), liar: H}
    everyone = [*honest, liar]
    for w in everyone:  # round 1: everyone delivers 100 tokens/s for 10 s
        deliver(c, w, f"{w}-r1", 1000, now=10.0)
    assert c.version == 1
    assert all(c.workers[w].measured_speed == 100.0 for w in everyone)
    assert shards_in_plan(c)[liar] == 4  # the liar's excess left its plan in round 1
    assert placed(c) == dict.fromkeys(everyone, 4)
    assert steps(c) == dict.fromkeys(everyone, H)
    for w in everyone:  # round 2: its submission under the new plan hands the excess over
        deliver(c, w, f"{w}-r2", 1000, now=20.0)
    assert c.version == 2 and not c.staged
    assert shards_in_ledger(c) == dict.fromkeys(everyone, 4)


def test_a_liar_joining_a_measured_fleet_gets_at_most_the_fastest_share() -> None:
    c = core("decoupled", 3, shards=12)
    a, b, slow = (c.register(n, 0.0).worker_id for n in ("a", "b", "slow"))
    for w, tokens in ((a, 1000), (b, 1000), (slow, 500)):
        deliver(c, w, f"{w}-1", tokens, now=10.0)
    assert c.version == 1 and placed(c) == {a: 5, b: 5, slow: 2}  # 100 : 100 : 50
    liar = c.register("liar", 11.0, speed=1e308).worker_id
    assert placed(c)[liar] == 3  # 12 x 100 / 350: as fast as the fastest measured learner, no more
    assert steps(c)[liar] == H
    c.report_throughput(liar, 1e308, now=12.0)  # heartbeats claim it again: still a bounded prior
    assert steps(c)[liar] == H and steps(c)[slow] == H // 2


def test_after_its_first_accepted_submission_a_claim_no_longer_matters() -> None:
    c = core("decoupled", 2, shards=6)
    a, b = c.register("a", 0.0, speed=100.0).worker_id, c.register("b", 0.0, speed=100.0).worker_id
    deliver(c, a, "a1", 1000, now=10.0)
    deliver(c, b, "b1", 500, now=10.0)
    before = (placed(c), steps(c))
    assert before == ({a: 4, b: 2}, {a: H, b: H // 2})
    for claim in (1e308, 1.0, 0.0):
        c.report_throughput(b, claim, now=11.0)
        assert (placed(c), steps(c)) == before
    deliver(c, a, "a2", 1000, now=20.0)
    deliver(c, b, "b2", 500, now=20.0)
    assert (placed(c), steps(c)) == before


def test_a_learner_that_delivers_less_than_it_claims_loses_shards_after_its_first_round() -> None:
    c = core("sync", 3, shards=12)
    a, b, slow = (c.register(n, 0.0, speed=100.0).worker_id for n in ("a", "b", "slow"))
    assert shards_in_plan(c) == dict.fromkeys([a, b, slow], 4)
    deliver(c, a, "a1", 1000, now=10.0)
    deliver(c, b, "b1", 1000, now=10.0)
    deliver(c, slow, "s1", 1000, now=40.0)  # a quarter of the claimed speed
    assert c.version == 1
    assert shards_in_plan(c)[slow] == 1
    assert placed(c) == {a: 6, b: 5, slow: 1}  # 12 x (100, 100, 25) / 225 = 5.3, 5.3, 1.3; a wins the tie
    deliver(c, a, "a2", 1000, now=50.0)
    deliver(c, b, "b2", 1000, now=50.0)
    deliver(c, slow, "s2", 1000, now=80.0)
    assert not c.staged and shards_in_ledger(c) == {a: 6, b: 5, slow: 1}


def test_small_drifts_do_not_move_shards() -> None:
    c = core("decoupled", 2, shards=8)
    a, b = c.register("a", 0.0).worker_id, c.register("b", 0.0).worker_id
    deliver(c, a, "a1", 1000, now=10.0)
    deliver(c, b, "b1", 1000, now=10.0)
    seq = c.plan_seq
    deliver(c, a, "a2", 1100, now=20.0)  # a is 10% faster this round: its share moves by 2.4%
    deliver(c, b, "b2", 1000, now=20.0)
    assert c.version == 2 and c.plan_seq == seq and not c.staged


@pytest.mark.parametrize("mode", ["sync", "decoupled", "async"])
def test_cached_planning_speeds_match_a_fresh_computation(mode: str) -> None:
    """The core caches the planning speeds (every plan reads them); whatever happens, they are what a fresh
    computation gives."""
    rng = random.Random(mode)
    c = core(mode, 2, shards=12, k=1)
    now, n = 0.0, 0
    for i in range(300):
        now += rng.choice([0.0, 0.5, 3.0])
        live = c.live_ids()
        op = rng.choice(["register", "claim", "deliver", "deliver", "remove", "poll"])
        if op == "register" and len(live) < 6:
            n += 1
            c.register(f"w{n}", now, speed=rng.choice([0.0, 50.0, 1e308]))
        elif op == "claim" and live:
            c.report_throughput(rng.choice(live), rng.choice([0.0, 10.0, 1e308]), now=now)
        elif op == "deliver" and live:
            w = rng.choice(live)
            if c.plan(w).shards:
                deliver(c, w, f"s{i}", rng.randint(1, 500), now)
        elif op == "remove" and len(live) > 1:
            c.remove(rng.choice(live), DEAD, "test")
        else:
            c.poll(now)
        cached = c._speeds()
        c._speeds_changed()
        assert c._speeds() == cached


def test_a_drain_or_a_quarantine_is_not_a_drift() -> None:
    """Only speed changes re-place shards at a close: a drain moved the drained learner's shards already."""
    c = core("decoupled", 2, shards=4, k=1)
    a, b = c.register("a", 0.0).worker_id, c.register("b", 0.0).worker_id
    c.drain(b)
    seq, owners = c.plan_seq, [s.owner for s in c.ledger.states()]
    assert owners == [a] * 4
    deliver(c, a, "a1", 1000, now=10.0)  # closes the round at once: the drained learner has nothing to send
    assert c.version == 1
    assert c.plan_seq == seq and [s.owner for s in c.ledger.states()] == owners


def test_a_drained_learner_hands_its_shards_over_at_once_and_nothing_is_counted_twice() -> None:
    """A drained learner gets no shards: they move to the active learners at once, at their accepted cursors under
    a new epoch, also those staged towards it; its late submission of steps made before is refused, while the one
    accepted before the drain is applied."""
    c = core("decoupled", 3, shards=6, k=1)
    a, b, x = (c.register(n, 0.0).worker_id for n in ("a", "b", "x"))
    deliver(c, x, "x1", 1000, now=1.0)  # accepted before the drain: applied as usual
    lease = c.plan(x).shards[0]
    late = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + 500)  # trained, not yet sent
    c.staged[c.plan(a).shards[0].shard_id] = (x, c.plan_seq + 1)  # a hand-off towards x still pending
    drained = c.drain(x)
    assert drained.state == WorkerState.DRAINING and c.plan(x).shards == ()
    assert not c.ledger.shard_ids_of(x) and all(target != x for target, _ in c.staged.values())
    assert set(s.owner for s in c.ledger.states()) == {a, b}
    moved = c.ledger.state(lease.shard_id)
    assert moved.epoch > lease.epoch and moved.accepted == lease.cursor  # resumes where x's acceptance left it
    assert c.drain(x) is drained and c.ledger.state(lease.shard_id).epoch == moved.epoch  # again: nothing changes
    with pytest.raises(DilocoError):
        c.accept(Submission(x, "x2", c.version, 500, 10, (late,), c.plan_seq), torch.zeros(N), 2.0)
    applied = c.poll(3.0)
    assert applied is not None and applied.tokens == 1000  # x1 only
    assert c.ledger.state(lease.shard_id).committed == lease.cursor
