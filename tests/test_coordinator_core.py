"""The coordinator state machine: registration, placement, admission, rounds, failures, checkpoints."""

from __future__ import annotations

import pytest
import torch

from diloco.core.coordinator import Accepted, CoordinatorConfig, CoordinatorCore, Submission
from diloco.core.ledger import ShardRange
from diloco.core.outer import Nesterov
from diloco.core.rounds import RoundConfig
from diloco.core.states import DEAD, EVICTED, LEFT, LIVE_STATES
from diloco.errors import (
    AlreadyExists,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from services.coordinator.config import parse

N = 8


def core(mode: str = "decoupled", workers: int = 2, k: int = 2, shards: int = 4) -> CoordinatorCore:
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode=mode, min_quorum=k, grace_max_s=1.0),
        local_steps=10,
        min_local_steps=2,
        expected_workers=workers,
    )
    return CoordinatorCore(cfg, torch.zeros(N), [1000] * shards)


def submission(c: CoordinatorCore, worker: str, sid: str, tokens: int = 10) -> Submission:
    plan = c.plan(worker)
    lease = plan.shards[0]
    rng = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + tokens)
    return Submission(worker, sid, c.version, tokens, 1, (rng,), plan.plan_seq)


def frozen(c: CoordinatorCore) -> tuple[list[float], dict[str, object], int]:
    return c.params.tolist(), c.ledger.snapshot(), c.version


def test_first_learner_does_not_take_every_shard() -> None:
    c = core(workers=2, shards=4)
    a = c.register("a", 0.0).worker_id
    assert len(c.plan(a).shards) == 2
    b = c.register("b", 0.0).worker_id
    assert len(c.plan(b).shards) == 2
    assert all(s.owner is not None for s in c.ledger.states())


def test_rounds_apply_the_merged_pseudo_gradient_and_commit_the_ledger() -> None:
    c = core()
    a, b = c.register("a", 0.0).worker_id, c.register("b", 0.0).worker_id
    r1 = c.accept(submission(c, a, "s1", tokens=30), torch.full((N,), 1.0), now=1.0)
    assert r1.applied is None and c.ledger.committed_tokens() == 0
    r2 = c.accept(submission(c, b, "s2", tokens=10), torch.full((N,), 2.0), now=1.1)
    assert r2.applied is not None and r2.applied.reason == "all_live"
    # merged = (30 * 1 + 10 * 2) / 40 = 1.25; first Nesterov step: -0.7 * (1.25 + 0.9 * 1.25)
    assert c.params[0].item() == pytest.approx(-0.7 * 1.25 * 1.9)
    assert c.version == 1 and c.ledger.committed_tokens() == 40 and c.tokens_applied == 40


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda s: s.__class__(**{**vars(s), "worker_id": "ghost"}), NotFound),
        (lambda s: s.__class__(**{**vars(s), "base_version": 7}), FailedPrecondition),
        (lambda s: s.__class__(**{**vars(s), "tokens": 11}), InvalidArgument),
        (lambda s: s.__class__(**{**vars(s), "ranges": (ShardRange(0, 99, 0, 10),)}), FailedPrecondition),
        (lambda s: s.__class__(**{**vars(s), "ranges": (ShardRange(0, 2, 5, 15),)}), FailedPrecondition),
    ],
    ids=["unknown-worker", "future-version", "token-mismatch", "stale-epoch", "wrong-cursor"],
)
def test_refused_submissions_change_nothing(mutate: object, error: type[Exception]) -> None:
    c = core()
    a = c.register("a", 0.0).worker_id
    c.register("b", 0.0)
    before = frozen(c)
    bad = mutate(submission(c, a, "s1"))  # type: ignore[operator]
    with pytest.raises(error):
        c.accept(bad, torch.ones(N), now=1.0)
    assert frozen(c) == before and c.acc.count == 0


def test_nan_and_wrong_size_pseudo_gradients_are_refused() -> None:
    c = core()
    a = c.register("a", 0.0).worker_id
    c.register("b", 0.0)
    before = frozen(c)
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        c.accept(submission(c, a, "s1"), torch.tensor([float("nan")] * N), now=1.0)
    with pytest.raises(InvalidArgument, match="elements"):
        c.accept(submission(c, a, "s1"), torch.ones(N + 1), now=1.0)
    assert frozen(c) == before


def test_duplicate_submission_id() -> None:
    c = core(k=1, workers=2)
    a = c.register("a", 0.0).worker_id
    c.register("b", 0.0)
    c.accept(submission(c, a, "s1"), torch.ones(N), now=1.0)
    with pytest.raises(AlreadyExists):
        c.accept(submission(c, a, "s1"), torch.ones(N), now=1.0)


def test_dead_learner_shards_move_and_sync_round_closes() -> None:
    c = core(mode="sync")
    a, b = c.register("a", 0.0).worker_id, c.register("b", 0.0).worker_id
    c.accept(submission(c, a, "s1"), torch.ones(N), now=1.0)
    assert c.poll(5.0) is None
    moved = c.remove(b, DEAD, "missed heartbeats")
    assert len(moved) == 2
    assert {s.owner for s in c.ledger.states()} == {a}
    assert c.poll(5.1) is not None
    with pytest.raises(FailedPrecondition, match="register again"):
        c.plan(b)


def test_rebalance_hands_shards_off_after_the_owner_submits() -> None:
    c = core(workers=1, k=1, shards=4)
    a = c.register("a", 0.0).worker_id
    assert len(c.plan(a).shards) == 4
    b = c.register("b", 0.0).worker_id
    # two of a's shards are staged for b: a stops seeing them, b gets them once a has submitted under that plan
    assert len(c.plan(a).shards) == 2 and len(c.plan(b).shards) == 0
    c.accept(submission(c, a, "s1"), torch.ones(N), now=1.0)
    assert len(c.plan(b).shards) == 2


def test_snapshot_restore_rolls_back_pending_and_forgets_learners() -> None:
    c = core(k=2)
    a, b = c.register("a", 0.0).worker_id, c.register("b", 0.0).worker_id
    c.accept(submission(c, a, "s1"), torch.ones(N), now=1.0)
    c.accept(submission(c, b, "s2"), torch.ones(N), now=1.0)
    snap = c.snapshot()
    c.accept(submission(c, a, "s3"), torch.ones(N), now=2.0)  # pending, not in the checkpoint
    fresh = core(k=2)
    fresh.restore(snap)
    assert fresh.version == 1 and torch.equal(fresh.params, c.params)
    assert [s.accepted for s in fresh.ledger.states()] == [s.committed for s in fresh.ledger.states()]
    assert fresh.ledger.committed_tokens() == 20
    assert not fresh.workers and all(s.owner is None for s in fresh.ledger.states())
    # the outcomes of applied submissions are in the checkpoint (a duplicate is answered as before); the pending
    # one is not: it was lost with the restart, and its learner trains the range again
    assert fresh.accepted("s1") == c.accepted("s1") == Accepted(a, 1, 0, applied=True)
    assert fresh.accepted("s2") == Accepted(b, 1, 0, applied=True)
    assert c.accepted("s3") == Accepted(a, 2, 0, applied=False) and fresh.accepted("s3") is None
    with pytest.raises(InvalidArgument, match="malformed"):
        fresh.restore({"params": c.params})
    for bad in ([["s9", a, 0, 0]], [["s9", a, 1, -1]], [["", a, 1, 0]], [["s9", a, True, 0]], {"s9": a}):
        with pytest.raises(InvalidArgument, match=r"malformed.*applied"):
            fresh.restore({**snap, "applied": bad})
    assert fresh.accepted("s1") is not None and fresh.accepted("s9") is None  # a refused restore changed nothing


def test_restore_adopting_a_checkpoint_takes_its_outer_state_without_copying_it() -> None:
    c = core(k=2)
    a, b = c.register("a", 0.0).worker_id, c.register("b", 0.0).worker_id
    c.accept(submission(c, a, "s1"), torch.ones(N), now=1.0)
    c.accept(submission(c, b, "s2"), torch.ones(N), now=1.0)
    snap = {**c.snapshot(), "params": c.params.clone(), "outer": {**c.outer.state_dict(), "buf": c.outer.buf.clone()}}
    copied, adopted = core(k=2), core(k=2)
    copied.restore(snap)
    adopted.restore(snap, adopt=True)
    assert isinstance(copied.outer, Nesterov) and isinstance(adopted.outer, Nesterov)
    assert copied.outer.buf is not None and adopted.outer.buf is snap["outer"]["buf"]  # taken, not copied
    assert copied.outer.buf.data_ptr() != snap["outer"]["buf"].data_ptr()
    assert torch.equal(adopted.outer.buf, copied.outer.buf) and torch.equal(adopted.params, copied.params)
    assert adopted.params.data_ptr() != snap["params"].data_ptr()  # Θ is the core's own: the parameters are copied


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="K=3"):
        CoordinatorConfig(rounds=RoundConfig(min_quorum=3), expected_workers=2)
    with pytest.raises(ConfigError, match="num_shards"):
        CoordinatorCore(CoordinatorConfig(expected_workers=4), torch.zeros(2), [10, 10])
    with pytest.raises(ConfigError, match="allowed: mean, rda"):
        CoordinatorConfig(merge="sum")


def test_learner_never_confirmed_alive_is_declared_dead() -> None:
    cfg = CoordinatorConfig(rounds=RoundConfig(min_quorum=1), expected_workers=2, confirm_timeout_s=10.0)
    c = CoordinatorCore(cfg, torch.zeros(N), [1000] * 4)
    a = c.register("a", now=0.0).worker_id
    b = c.register("b", now=1.0).worker_id
    c.report_throughput(a, 100.0)  # healthd heard of a; b died before its first heartbeat
    assert c.next_deadline() == 11.0
    assert c.expire_unconfirmed(10.9) == []
    [(dead, moved)] = c.expire_unconfirmed(11.0)
    assert dead == b and moved and c.workers[b].state == DEAD
    assert {s.owner for s in c.ledger.states()} == {a}
    assert c.next_deadline() is None


def test_a_learner_unheard_while_healthd_reports_others_is_dead_within_the_window() -> None:
    """Found by the kill storm (`diloco bench --only kill-storm`): a learner killed just after it registered with a
    restarted coordinator never reached healthd under its new id, and was declared dead only at the 10 s
    registration lease, past the 5 s reassignment window. With healthd reporting others it now goes after
    `unheard_after_s`; one that healthd hears of in time stays; while healthd is silent only the lease applies."""
    cfg = CoordinatorConfig(
        rounds=RoundConfig(min_quorum=1), expected_workers=3, confirm_timeout_s=10.0, unheard_after_s=3.0
    )
    c = CoordinatorCore(cfg, torch.zeros(N), [1000] * 6)
    a = c.register("a", now=0.0).worker_id
    b = c.register("b", now=1.0).worker_id  # dies before its first heartbeat
    late = c.register("late", now=1.0).worker_id  # its first heartbeat reaches healthd 2.5 s after registering
    for t in (0.5, 1.5, 2.5, 3.5):
        c.report_throughput(a, 100.0, now=t)
        if t == 3.5:
            c.report_throughput(late, 100.0, now=t)
        assert c.expire_unconfirmed(t) == []
    c.report_throughput(a, 100.0, now=4.0)
    [(dead, moved)] = c.expire_unconfirmed(4.0)  # healthd reported a for 3 s after b registered: b is gone
    assert dead == b and moved and c.workers[b].state == DEAD
    assert "healthd reported other learners for 3 s" in c.workers[b].state_reason
    assert c.workers[late].state != DEAD and c.workers[a].state != DEAD

    quiet = CoordinatorCore(cfg, torch.zeros(N), [1000] * 6)
    both = {quiet.register("a", now=0.0).worker_id, quiet.register("b", now=0.0).worker_id}
    assert quiet.expire_unconfirmed(9.9) == []  # healthd reported nobody: they are judged by the lease alone
    assert {dead for dead, _ in quiet.expire_unconfirmed(10.0)} == both


def test_unheard_after_s_is_bounded_by_the_registration_lease() -> None:
    with pytest.raises(ConfigError, match=r"unheard_after_s must be in \[0, confirm_timeout_s=10\]"):
        CoordinatorConfig(confirm_timeout_s=10.0, unheard_after_s=11.0)
    with pytest.raises(ConfigError, match="unheard_after_s"):
        CoordinatorConfig(confirm_timeout_s=10.0, unheard_after_s=-1.0)


@pytest.mark.parametrize("scale", [True, False])
def test_a_round_closed_without_every_learner_takes_a_partial_step(scale: bool) -> None:
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode="decoupled", min_quorum=2, grace_max_s=1.0),
        local_steps=10,
        min_local_steps=2,
        expected_workers=3,
        scale_partial_rounds=scale,
    )
    c = CoordinatorCore(cfg, torch.zeros(N), [1000] * 6)
    a, b, _ = (c.register(n, 0.0).worker_id for n in "abc")

    def sub(worker: str, sid: str, steps: int) -> Submission:
        s = submission(c, worker, sid, tokens=10)
        return Submission(s.worker_id, s.submission_id, s.base_version, s.tokens, steps, s.ranges, s.plan_seq)

    c.accept(sub(a, "s1", 10), torch.full((N,), 1.0), now=1.0)
    assert c.accept(sub(b, "s2", 10), torch.full((N,), 1.0), now=1.0).applied is None  # grace window open
    applied = c.poll(now=2.5)
    assert applied is not None and applied.reason == "quorum_grace"
    # 20 inner steps in, learner c's planned 10 missing: 2/3 of a step (Nesterov's first step: -lr * (1 + mu) * d)
    fraction = 20 / 30 if scale else 1.0
    assert c.params[0].item() == pytest.approx(-0.7 * 1.9 * fraction)


def test_learner_that_died_while_healthd_was_down_is_declared_dead_once_healthd_reports_again() -> None:
    cfg = CoordinatorConfig(rounds=RoundConfig(min_quorum=1), expected_workers=2, confirm_timeout_s=10.0)
    c = CoordinatorCore(cfg, torch.zeros(N), [1000] * 4)
    a, b = c.register("a", now=0.0).worker_id, c.register("b", now=0.0).worker_id
    for t in range(0, 20):  # healthd reports both every second
        c.report_throughput(a, 100.0, now=float(t))
        c.report_throughput(b, 100.0, now=float(t))
    assert c.expire_unconfirmed(20.0) == []
    # healthd goes down at 20 s and b dies meanwhile; nobody is reported for a minute: nobody expires
    assert c.expire_unconfirmed(80.0) == []
    # healthd is back at 80 s and reports only a: b is not judged until healthd has reported for 10 s
    for t in range(80, 90):
        c.report_throughput(a, 100.0, now=float(t))
        assert c.expire_unconfirmed(float(t)) == []
    c.report_throughput(a, 100.0, now=90.0)
    [(dead, moved)] = c.expire_unconfirmed(90.0)
    assert dead == b and moved and c.workers[b].state == DEAD
    assert c.workers[a].state != DEAD


def test_a_learner_that_keeps_submitting_is_not_silent() -> None:
    cfg = CoordinatorConfig(rounds=RoundConfig(min_quorum=1), expected_workers=2, confirm_timeout_s=10.0)
    c = CoordinatorCore(cfg, torch.zeros(N), [1000] * 4)
    a, b = c.register("a", now=0.0).worker_id, c.register("b", now=0.0).worker_id
    c.report_throughput(b, 100.0, now=0.0)
    for i, t in enumerate(range(1, 30, 3)):
        c.report_throughput(a, 100.0, now=float(t))
        c.accept(submission(c, b, f"s{i}"), torch.zeros(N), now=float(t))  # b's heartbeats are not forwarded
        assert c.expire_unconfirmed(float(t)) == []


def test_the_service_s_steps_match_accept_and_split_bookkeeping_from_tensor_work() -> None:
    """The service runs `accept` as measure, take, fold, close, step (control lock for take and close only):
    the same parameters and ledger as one `accept`; take and close touch no tensor; close alone moves the version,
    the committed cursors and the applied ids together; step alone moves the parameters."""
    one, split = core(mode="sync"), core(mode="sync")
    for c in (one, split):
        c.register("a", 0.0)
        c.register("b", 0.0)
    deltas = {"a-1": torch.full((N,), 0.5), "b-2": torch.arange(N, dtype=torch.float32)}
    for w, d in deltas.items():
        one.accept(submission(one, w, f"s-{w}"), d, now=1.0)
    params_before = split.params.clone()
    for w, d in deltas.items():
        sub = submission(split, w, f"s-{w}")
        taken = split.take(sub, split.measure(sub, d), now=1.0)
        assert taken.applied is None and taken.round == 1 and torch.equal(split.params, params_before)
        split.fold(d, sub.tokens)
    assert split.version == 0
    closed = split.close(1.0)
    assert closed is not None and closed.close.version == split.version == 1
    assert split.ledger.committed_tokens() == 20 and split.accepted("s-a-1") == Accepted("a-1", 1, 0, applied=True)
    assert torch.equal(split.params, params_before)  # not stepped yet
    applied = split.step(closed)
    assert applied.version == 1 and applied.tokens == 20
    assert torch.equal(split.params, one.params) and split.ledger.snapshot() == one.ledger.snapshot()
    assert split.close(2.0) is None  # nothing pending


def test_measure_refuses_a_wrong_size_without_touching_state() -> None:
    c = core()
    a = c.register("a", 0.0).worker_id
    before = frozen(c)
    with pytest.raises(InvalidArgument, match="elements"):
        c.measure(submission(c, a, "s1"), torch.zeros(N + 1))
    assert frozen(c) == before


# ---------------------------------------------------------------- a bounded registry


def bounded(max_workers: int = 4096, max_departed: int = 1024, expected: int = 0) -> CoordinatorCore:
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode="decoupled", min_quorum=min(2, max(1, expected)), grace_max_s=1.0),
        local_steps=10,
        min_local_steps=2,
        expected_workers=expected,  # placeholders: each of the first learners gets its shards at once
        max_workers=max_workers,
        max_departed=max_departed,
    )
    return CoordinatorCore(cfg, torch.zeros(N), [1000] * 10)


def registry(c: CoordinatorCore) -> tuple[object, ...]:
    return (
        {w: vars(r).copy() for w, r in c.workers.items()},
        c.ledger.snapshot(),
        dict(c.staged),
        c.plan_seq,
        c.registered_ever,
        sorted(c.policy.live),
        c.next_deadline(),
    )


def test_registration_beyond_max_workers_is_refused_and_changes_nothing() -> None:
    c = bounded(max_workers=2)
    a = c.register("a", 0.0).worker_id
    c.register("b", 0.0)
    before = registry(c)
    with pytest.raises(ResourceExhausted, match=r"2 live learners.*--max-workers"):
        c.register("c", 1.0, speed=1e308)
    assert registry(c) == before
    c.remove(a, LEFT, "deregistered")  # departed learners do not count
    assert c.register("c", 2.0).worker_id == "c-3"  # the refused attempt used no incarnation
    with pytest.raises(ResourceExhausted):
        c.register("d", 3.0)


def test_departed_records_are_bounded_oldest_first_without_touching_ledger_or_duplicates() -> None:
    c = bounded(max_departed=2, expected=5)  # K = 2
    keeper = c.register("keeper", 0.0).worker_id
    gone: list[str] = []
    for i in range(4):
        w = c.register(f"w{i}", float(i)).worker_id
        if i == 0:  # applied: its outcome is in `applied`
            c.accept(submission(c, w, "applied"), torch.ones(N), now=0.5)
            c.accept(submission(c, keeper, "k1"), torch.ones(N), now=0.5)
            assert c.version == 1
        if i == 1:  # pending in the open round when it leaves
            c.accept(submission(c, w, "pending"), torch.ones(N), now=1.5)
            assert c.version == 1
        c.remove(w, (LEFT, DEAD, EVICTED, LEFT)[i], "test")
        gone.append(w)
    # w3's registration dropped w0 (three departed, two kept); w3's own departure makes three again, until ...
    assert set(c.workers) == {keeper, *gone[1:]}
    newcomer = c.register("new", 10.0).worker_id
    assert set(c.workers) == {keeper, newcomer, *gone[-2:]}  # ... the next registration: the two most recent
    assert all(r.state in LIVE_STATES for w, r in c.workers.items() if w not in gone)
    assert {s.owner for s in c.ledger.states()} <= {keeper, newcomer}  # nothing points at a forgotten learner
    assert all(t in (keeper, newcomer) for t, _ in c.staged.values())
    # a duplicate of a forgotten learner's submission is still a duplicate, applied or pending
    for sid, w in (("applied", gone[0]), ("pending", gone[1])):
        dup = Submission(w, sid, c.version, 10, 1, (), 0)
        with pytest.raises(AlreadyExists):
            c.admit(dup)
    with pytest.raises(NotFound, match="register"):
        c.plan(gone[0])
    # the forgotten learner's pending submission still closes its round and commits its range
    applied = c.accept(submission(c, keeper, "k2"), torch.ones(N), now=11.0).applied or c.poll(20.0)
    assert applied is not None and {p.submission_id for p in applied.submissions} == {"pending", "k2"}
    assert c.ledger.committed_tokens() == 40


def test_max_departed_zero_forgets_at_the_next_registration() -> None:
    c = bounded(max_departed=0)
    a = c.register("a", 0.0).worker_id
    c.remove(a, LEFT, "test")
    assert a in c.workers  # a removal does not forget: the caller may still read the record
    c.register("b", 1.0)
    assert a not in c.workers


def test_registry_limits_config_and_flags() -> None:
    with pytest.raises(ConfigError, match="max_workers"):
        CoordinatorConfig(max_workers=0)
    with pytest.raises(ConfigError, match=r"max_workers .*expected_workers \(3\)"):
        CoordinatorConfig(rounds=RoundConfig(min_quorum=1), expected_workers=3, max_workers=2)
    with pytest.raises(ConfigError, match="max_departed"):
        CoordinatorConfig(max_departed=-1)
    assert (CoordinatorConfig().max_workers, CoordinatorConfig().max_departed) == (4096, 1024)
    cfg = parse(["--insecure", "--max-workers", "7", "--max-departed", "3"], env={}).core_config()
    assert (cfg.max_workers, cfg.max_departed) == (7, 3)
    assert parse(["--insecure"], env={"DILOCO_MAX_WORKERS": "9"}).max_workers == 9
    with pytest.raises(ConfigError, match="max_workers"):
        parse(["--insecure", "--max-workers", "0"], env={})
