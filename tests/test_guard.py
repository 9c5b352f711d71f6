"""Robust merge: the norm guard (golden cases, properties) and the core's quarantine, release and ledger."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.coordinator import (
    CoordinatorConfig,
    CoordinatorCore,
    NonFiniteRejected,
    Submission,
    SubmissionRejected,
)
from diloco.core.guard import CEILING, NON_FINITE, OUTLIER, GuardConfig, NormGuard, adamw_move_bound
from diloco.core.ledger import ShardRange
from diloco.core.rounds import RoundConfig
from diloco.core.states import ACTIVE, QUARANTINED
from diloco.errors import ConfigError, FailedPrecondition, InvalidArgument
from diloco.task.factory import build_task
from diloco.task.inner import InnerConfig, InnerTrainer
from diloco.task.params import flatten_params
from tests.conftest import tiny_task

N = 8

# --- NormGuard ------------------------------------------------------------------------------------------------


def guard(factor: float = 10.0, window: int = 8, min_samples: int = 3) -> NormGuard:
    return NormGuard(GuardConfig(outlier_factor=factor, window=window, min_samples=min_samples))


def test_golden_cases() -> None:
    g = guard()
    assert g.check(5.0).ok and math.isnan(g.check(5.0).ratio)  # no reference yet
    for n in (1.0, 2.0):
        g.record(n)
    v = g.check(100.0)
    assert v.ok and v.ratio == pytest.approx(100 / 1.5)  # 2 samples < min_samples: no judgement yet
    g.record(3.0)
    assert g.median() == 2.0
    assert g.check(20.0).ok  # exactly the limit
    v = g.check(20.1)
    assert not v.ok and v.reason == OUTLIER and v.ratio == pytest.approx(10.05) and v.median == 2.0
    assert g.check(0.0).ok  # short pseudo-gradients are harmless


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_is_refused_even_before_warm_up(bad: float) -> None:
    v = guard().check(bad)
    assert not v.ok and v.reason == NON_FINITE


def test_refused_norms_never_enter_the_window_and_the_window_slides() -> None:
    g = guard(window=3, min_samples=3)
    for n in (1.0, 1.0, 1.0):
        g.record(n)
    g.record(math.nan)
    assert g.snapshot() == [1.0, 1.0, 1.0]
    for n in (50.0, 50.0):
        g.record(n)
    assert g.median() == 50.0  # the oldest ones slid out
    assert g.check(400.0).ok and not g.check(501.0).ok


def test_factor_zero_turns_the_outlier_check_off() -> None:
    g = guard(factor=0.0)
    for _ in range(5):
        g.record(1.0)
    assert g.check(1e9).ok and not g.check(math.nan).ok


@pytest.mark.parametrize(
    "kw",
    [
        {"outlier_factor": 1.0},
        {"outlier_factor": -2.0},
        {"window": 0},
        {"min_samples": 9},
        {"quarantine_strikes": 0},
        {"step_move": -1.0},
        {"step_decay": math.nan},
        {"ceiling_slack": 0.5},
    ],
)
def test_bad_guard_config(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        GuardConfig(**{"window": 8, **kw})  # type: ignore[arg-type]


norms = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(norms, min_size=3, max_size=40), st.sampled_from([math.nan, math.inf, 100.0]))
def test_after_warm_up_a_non_finite_or_x100_norm_is_always_refused(history: list[float], bad: float) -> None:
    g = guard(factor=10.0, window=16, min_samples=3)
    for n in history:
        g.record(n)
    judged = bad if not math.isfinite(bad) else max(g.snapshot()) * bad  # x100 the largest: above 10x the median
    assert not g.check(judged).ok


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e30, allow_nan=False), st.integers(1, 40), st.floats(1.0001, 100.0))
def test_never_refuses_when_all_norms_are_equal(norm: float, count: int, factor: float) -> None:
    g = guard(factor=factor, window=8, min_samples=1)
    for _ in range(count):
        assert g.check(norm).ok
        g.record(norm)


# --- CoordinatorCore: quarantine, release and the ledger ------------------------------------------------------


def make_core(strikes: int = 3, k: int = 2, workers: int = 3) -> CoordinatorCore:
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode="decoupled", min_quorum=k, grace_max_s=0.0),
        local_steps=10,
        min_local_steps=2,
        expected_workers=workers,
        guard=GuardConfig(outlier_factor=10.0, window=16, min_samples=2, quarantine_strikes=strikes),
    )
    return CoordinatorCore(cfg, torch.zeros(N), [1000] * 6)


def sub(c: CoordinatorCore, worker: str, sid: str, tokens: int = 10, steps: int = 2) -> Submission:
    plan = c.plan(worker)
    lease = plan.shards[0]
    rng = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + tokens)
    return Submission(worker, sid, c.version, tokens, steps, (rng,), plan.plan_seq)


def warm(c: CoordinatorCore, workers: list[str], now: float = 1.0) -> None:
    for i, w in enumerate(workers):
        c.accept(sub(c, w, f"warm-{w}"), torch.full((N,), 0.01), now=now + i * 0.01)


def committed_ranges(c: CoordinatorCore) -> list[tuple[int, int, int]]:
    return sorted((r.shard_id, r.start, r.end) for s in c.ledger.states() for r in s.committed_ranges)


def test_outlier_is_refused_quarantined_and_its_range_stays_uncommitted() -> None:
    c = make_core()
    a, b, m = (c.register(n, 0.0).worker_id for n in "abm")
    warm(c, [a, b])
    params, tokens_applied = c.params.clone(), c.tokens_applied
    bad = sub(c, m, "m1")
    with pytest.raises(SubmissionRejected, match="quarantined") as info:
        c.accept(bad, torch.full((N,), 0.01) * 100, now=2.0)
    assert isinstance(info.value, FailedPrecondition) and info.value.newly_quarantined
    assert info.value.verdict.ratio == pytest.approx(100.0)
    rec = c.workers[m]
    assert rec.state == QUARANTINED and "refused" in rec.state_reason and rec.strikes == 1
    shard = bad.ranges[0].shard_id
    assert c.ledger.state(shard).accepted == bad.ranges[0].start  # not accepted, so not committed either
    assert c.ledger.state(shard).owner == m  # it keeps its shards (strikes left)
    assert torch.equal(c.params, params) and c.tokens_applied == tokens_applied
    assert m in c.policy.idle  # rounds do not wait for it
    assert c.plan(m).shards  # it may train the range again


def test_a_clean_submission_releases_and_the_range_is_trained_exactly_once() -> None:
    c = make_core()
    a, b, m = (c.register(n, 0.0).worker_id for n in "abm")
    warm(c, [a, b])
    bad = sub(c, m, "m1")
    with pytest.raises(SubmissionRejected):
        c.accept(bad, torch.full((N,), 1.0), now=2.0)
    again = sub(c, m, "m2")  # the plan's cursor did not move: the same range again
    assert again.ranges == bad.ranges
    r = c.accept(again, torch.full((N,), 0.01), now=3.0)
    assert r.released and c.workers[m].state == ACTIVE and c.workers[m].strikes == 0
    c.accept(sub(c, a, "a2"), torch.full((N,), 0.01), now=3.1)
    c.poll(10.0)
    rng = bad.ranges[0]
    assert committed_ranges(c).count((rng.shard_id, rng.start, rng.end)) == 1
    assert c.ledger.committed_tokens() == c.tokens_applied == 40


def test_operator_release_and_non_finite_rejection() -> None:
    c = make_core()
    a, _b, m = (c.register(n, 0.0).worker_id for n in "abm")
    with pytest.raises(NonFiniteRejected) as info:  # before warm-up too
        c.accept(sub(c, m, "m1"), torch.tensor([math.nan] * N), now=1.0)
    assert isinstance(info.value, InvalidArgument) and info.value.code == "INVALID_ARGUMENT"
    assert c.workers[m].state == QUARANTINED
    assert c.release(m).state == ACTIVE and m not in c.policy.idle
    assert c.release(a).state == ACTIVE  # not quarantined: unchanged


def test_strikes_move_the_shards_and_the_data_is_trained_once_by_a_healthy_learner() -> None:
    c = make_core(strikes=2)
    a, b, m = (c.register(n, 0.0).worker_id for n in "abm")
    warm(c, [a, b])
    first = sub(c, m, "m1")
    shards = {lease.shard_id for lease in c.plan(m).shards}
    for i in range(2):
        with pytest.raises(SubmissionRejected) as info:
            c.accept(sub(c, m, f"m{i}"), torch.full((N,), 5.0), now=2.0 + i)
    assert sorted(info.value.moved_shards) == sorted(shards)
    assert c.workers[m].state == QUARANTINED and not c.plan(m).shards
    owners = {c.ledger.state(s).owner for s in shards}
    assert owners <= {a, b}
    # the healthy owner resumes at the accepted cursor: the refused range is trained again, once
    rng = first.ranges[0]
    owner = c.ledger.state(rng.shard_id).owner
    assert owner is not None
    lease = next(s for s in c.plan(owner).shards if s.shard_id == rng.shard_id)
    assert lease.cursor == rng.start
    redo = Submission(owner, "redo", c.version, 10, 2, (ShardRange(rng.shard_id, lease.epoch, rng.start, rng.end),), 0)
    c.accept(redo, torch.full((N,), 0.01), now=5.0)
    other = b if owner == a else a
    c.accept(sub(c, other, "o"), torch.full((N,), 0.01), now=5.1)
    c.poll(10.0)
    assert committed_ranges(c).count((rng.shard_id, rng.start, rng.end)) == 1
    # the operator releases it: shards are handed back to it (staged, as for a learner that joins)
    assert c.release(m).state == ACTIVE and any(target == m for target, _ in c.staged.values())


def test_per_step_norms_make_learners_with_different_h_comparable() -> None:
    c = make_core()
    a, b, m = (c.register(n, 0.0).worker_id for n in "abm")
    warm(c, [a, b])  # 2 steps, norm of 0.01 * sqrt(8)
    # a learner that ran 20 steps and moved 10x as far is as healthy as the others
    c.accept(sub(c, m, "m1", steps=20), torch.full((N,), 0.1), now=2.0)
    assert c.workers[m].state == ACTIVE


def test_guard_window_survives_a_checkpoint() -> None:
    c = make_core()
    a, b, _ = (c.register(n, 0.0).worker_id for n in "abm")
    warm(c, [a, b])
    c.poll(10.0)
    fresh = make_core()
    fresh.restore(c.snapshot())
    assert fresh.guard.snapshot() == c.guard.snapshot() and fresh.guard.warm


# --- the ceiling: what no honest AdamW learner can exceed ---------------------------------------------------------


def test_adamw_move_bound_golden_values() -> None:
    assert adamw_move_bound((0.9, 0.95)) == pytest.approx(1.16496, abs=1e-4)  # the task's default betas
    assert adamw_move_bound((0.9, 0.999)) == pytest.approx(7.2703, abs=1e-3)
    assert adamw_move_bound((0.0, 0.99)) == 1.0  # m̂ = g: every step moves by exactly lr
    assert adamw_move_bound((0.99, 0.9)) == math.inf  # β1² ≥ β2: no bound, so no ceiling


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False), min_size=1, max_size=60),
    st.sampled_from([(0.9, 0.95), (0.9, 0.999), (0.8, 0.99), (0.5, 0.5)]),
)
def test_torch_adamw_never_moves_a_parameter_further_than_the_bound(
    grads: list[float], betas: tuple[float, float]
) -> None:
    """Adversarial gradient sequences through torch's own AdamW (no weight decay, lr 1): no step exceeds B."""
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1.0, betas=betas, weight_decay=0.0)
    bound = adamw_move_bound(betas)
    for g in grads:
        before = float(p.detach())
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        assert abs(float(p.detach()) - before) <= bound * (1 + 1e-9)


def test_ceiling_is_judged_before_warm_up() -> None:
    g = guard()
    v = g.check(3.0, ceiling=2.0)
    assert not v.ok and v.reason == CEILING and v.ceiling == 2.0 and "above" in v.describe()
    assert g.check(2.0, ceiling=2.0).ok
    assert not g.check(math.nan, ceiling=2.0).ok  # non-finite first
    cfg = GuardConfig(step_move=0.01, step_decay=0.001, ceiling_slack=2.0)
    assert cfg.ceiling(100, 5.0) == pytest.approx(2 * (0.01 * 10 + 0.001 * 5))
    assert GuardConfig().ceiling(100, 5.0) == math.inf  # off by default
    assert GuardConfig(step_move=math.inf).ceiling(100, 5.0) == math.inf


def test_honest_learners_stay_under_the_ceiling() -> None:
    """Real inner training on the tiny task, round lengths 1 to 20 steps, from a fresh optimizer (its first steps
    move every parameter by the full lr): the per-step norm stays below the ceiling even without its slack."""
    inner = InnerConfig(lr=3e-2, batch_size=4, warmup_steps=2, total_steps=200)
    task = build_task(tiny_task())
    tr = InnerTrainer(task.build_model(0), task.corpus, inner, seq_len=task.config.model.seq_len)
    cfg = GuardConfig(step_move=inner.lr * adamw_move_bound(inner.betas), step_decay=inner.lr * inner.weight_decay)
    cursor = 0
    for steps in (1, 2, 5, 20, 1, 3):
        theta = flatten_params(tr.model)
        result = tr.train([(0, 0, cursor)], steps)
        cursor = result.ranges[0].end
        per_step = float(torch.linalg.vector_norm(tr.pseudo_gradient())) / steps
        limit = cfg.ceiling(theta.numel(), float(torch.linalg.vector_norm(theta))) / cfg.ceiling_slack
        assert per_step <= limit, f"{steps} steps: {per_step:.4g} > {limit:.4g}"
        tr.load_global(flatten_params(tr.model))


def ceiling_core() -> CoordinatorCore:
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode="decoupled", min_quorum=2, grace_max_s=0.0),
        local_steps=10,
        min_local_steps=2,
        expected_workers=3,
        guard=GuardConfig(outlier_factor=10.0, window=16, min_samples=3, step_move=0.003, step_decay=0.0003),
    )
    return CoordinatorCore(cfg, torch.full((N,), 0.5), [1000] * 6)


def test_a_x100_learner_is_refused_from_its_first_submission() -> None:
    """The warm-up gap closed: with no accepted norm yet, the ceiling alone refuses a scaled-up update."""
    c = ceiling_core()
    a, m = (c.register(n, 0.0).worker_id for n in "am")
    honest = torch.full((N,), 0.002)  # 2 steps of 0.001 per parameter
    with pytest.raises(SubmissionRejected, match="AdamW settings") as info:
        c.accept(sub(c, m, "m1"), honest * 100, now=1.0)
    assert info.value.verdict.reason == CEILING and math.isnan(info.value.verdict.median)
    assert c.workers[m].state == QUARANTINED and "no AdamW learner" in c.workers[m].state_reason
    assert torch.equal(c.params, torch.full((N,), 0.5)) and not c.guard.snapshot()
    c.accept(sub(c, a, "a1"), honest, now=1.1)  # an honest one gets in
    assert c.guard.snapshot() == [pytest.approx(float(torch.linalg.vector_norm(honest)) / 2)]


def test_claiming_more_steps_than_tokens_is_refused_so_the_median_cannot_be_dragged_down() -> None:
    """Norms are judged per step: a learner claiming 10,000 steps for 10 tokens would enter a tiny norm, and a
    few such would make every honest learner an outlier. With `tokens_per_step` the claim must match its tokens."""
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode="decoupled", min_quorum=1, grace_max_s=0.0),
        local_steps=10,
        min_local_steps=2,
        guard=GuardConfig(outlier_factor=10.0, window=16, min_samples=1),
        tokens_per_step=5,
    )
    c = CoordinatorCore(cfg, torch.zeros(N), [1000] * 6)
    a = c.register("a", 0.0).worker_id
    with pytest.raises(InvalidArgument, match="steps"):
        c.accept(sub(c, a, "inflated", tokens=10, steps=10_000), torch.full((N,), 0.01), now=1.0)
    assert not c.guard.snapshot() and c.workers[a].state == ACTIVE
    c.accept(sub(c, a, "honest", tokens=10, steps=2), torch.full((N,), 0.01), now=1.1)
    assert c.guard.snapshot() == [pytest.approx(0.01 * N**0.5 / 2)]
