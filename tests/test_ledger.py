"""Shard ledger (diloco.core.ledger): exactly-once data under ownership changes, failures and restarts."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from diloco.core.coordinator import CoordinatorConfig, CoordinatorCore, RoundApplied, Submission
from diloco.core.ledger import AcceptReceipt, ShardLedger, ShardRange
from diloco.core.rounds import RoundConfig
from diloco.core.states import DEAD, LEFT
from diloco.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

# ---------------------------------------------------------------- helpers


def make(num_shards: int = 4, length: int = 1000) -> ShardLedger:
    return ShardLedger(num_shards, [length] * num_shards)


def rng(ledger: ShardLedger, shard_id: int, tokens: int) -> ShardRange:
    """The next valid range for the shard's current owner."""
    s = ledger.state(shard_id)
    return ShardRange(shard_id, s.epoch, s.accepted, s.accepted + tokens)


def unowned(ledger: ShardLedger) -> list[int]:
    return [s.shard_id for s in ledger.states() if s.owner is None]


def pending_ids(ledger: ShardLedger) -> list[int]:
    """Ids of the accepted, not yet committed receipts (what a checkpoint keeps), in acceptance order."""
    return [p["receipt_id"] for p in ledger.snapshot()["pending"]]


def raises_unchanged(ledger: ShardLedger, exc: type[Exception], pattern: str, fn: Any, *args: Any) -> None:
    """`fn(*args)` raises `exc` matching `pattern` and leaves the ledger exactly as before."""
    before = ledger.snapshot()
    with pytest.raises(exc, match=pattern):
        fn(*args)
    assert ledger.snapshot() == before


# ---------------------------------------------------------------- construction and ownership


def test_new_ledger_is_unowned_at_epoch_one() -> None:
    ledger = make(3)
    assert unowned(ledger) == [0, 1, 2]
    s = ledger.state(1)
    assert (s.owner, s.epoch, s.accepted, s.committed, s.length) == (None, 1, 0, 0, 1000)
    assert s.committed_ranges == ()
    assert ledger.committed_tokens() == 0


@pytest.mark.parametrize(
    ("num_shards", "lengths", "needle"),
    [(0, [], "num_shards"), (2, [10], "one per shard"), (2, [10, 0], "shard 1 length")],
)
def test_constructor_validation(num_shards: int, lengths: list[int], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        ShardLedger(num_shards, lengths)


def test_assign_bumps_epoch_only_on_owner_change() -> None:
    ledger = make()
    assert ledger.assign(0, "a").epoch == 2
    assert ledger.assign(0, "a").epoch == 2  # idempotent
    assert ledger.assign(0, "b").epoch == 3
    assert [s.shard_id for s in ledger.owned_by("b")] == [0]
    assert ledger.owned_by("a") == []


def test_assign_unknown_shard_and_bad_worker() -> None:
    ledger = make()
    raises_unchanged(ledger, NotFound, r"shard 9 does not exist \(shards are 0..3\)", ledger.assign, 9, "a")
    raises_unchanged(ledger, InvalidArgument, "worker id must be a non-empty string", ledger.assign, 0, "")


def test_release_unowns_with_new_epoch_and_keeps_pending() -> None:
    ledger = make()
    ledger.assign(0, "a")
    ledger.assign(1, "a")
    ledger.assign(2, "b")
    receipt = ledger.accept("a", [rng(ledger, 0, 100)])
    assert ledger.release("a") == [0, 1]
    assert ledger.release("a") == []
    s0 = ledger.state(0)
    assert (s0.owner, s0.epoch, s0.accepted, s0.committed) == (None, 3, 100, 0)
    assert unowned(ledger) == [0, 1, 3]
    ledger.commit(receipt)  # the pending submission is still applied
    assert ledger.state(0).committed == 100
    # the new owner resumes at the accepted cursor
    assert ledger.assign(0, "b").cursor == 100


# ---------------------------------------------------------------- accept


def test_accept_moves_accepted_not_committed() -> None:
    ledger = make()
    ledger.assign(0, "a")
    ledger.assign(1, "a")
    receipt = ledger.accept("a", [rng(ledger, 0, 100), rng(ledger, 1, 50)])
    assert receipt.worker_id == "a"
    assert receipt.tokens == 150
    assert receipt.shard_ids == (0, 1)
    assert (ledger.state(0).accepted, ledger.state(0).committed) == (100, 0)
    assert ledger.state(0).pending_tokens == 100
    assert pending_ids(ledger) == [receipt.receipt_id]
    follow = ledger.accept("a", [rng(ledger, 0, 10)])
    assert follow.receipt_id > receipt.receipt_id
    assert follow.ranges[0].start == 100


def test_accept_rejects_stale_epoch_with_resume_hint() -> None:
    ledger = make(length=5000)
    ledger.assign(3, "a")
    ledger.accept("a", [rng(ledger, 3, 1200)])
    old = rng(ledger, 3, 100)
    ledger.assign(3, "b")
    ledger.assign(3, "a")  # a owns it again, but under a new epoch
    msg = re.escape("shard 3 moved to epoch 4 (you sent epoch 2); fetch your work plan and resume from cursor 1200")
    raises_unchanged(ledger, FailedPrecondition, msg, ledger.accept, "a", [old])


def test_accept_rejects_wrong_start() -> None:
    ledger = make()
    ledger.assign(0, "a")
    ledger.accept("a", [rng(ledger, 0, 100)])
    epoch = ledger.state(0).epoch
    for start in (0, 99, 101):
        raises_unchanged(
            ledger,
            FailedPrecondition,
            f"shard 0 range starts at {start} but the accepted cursor is 100; .*resume from cursor 100",
            ledger.accept,
            "a",
            [ShardRange(0, epoch, start, start + 10)],
        )


def test_accept_rejects_non_owner_and_unowned() -> None:
    ledger = make()
    ledger.assign(0, "a")
    r = rng(ledger, 0, 10)
    raises_unchanged(
        ledger,
        FailedPrecondition,
        "shard 0 is owned by 'a' at epoch 2, not by 'b'; fetch your work plan",
        ledger.accept,
        "b",
        [r],
    )
    ledger.release("a")
    raises_unchanged(ledger, FailedPrecondition, "shard 0 has no owner at epoch 3", ledger.accept, "a", [r])


def test_accept_is_all_or_nothing_across_shards() -> None:
    ledger = make()
    ledger.assign(0, "a")
    ledger.assign(1, "b")
    good = rng(ledger, 0, 10)
    not_mine = rng(ledger, 1, 10)
    raises_unchanged(ledger, FailedPrecondition, "shard 1 is owned by 'b'", ledger.accept, "a", [good, not_mine])
    assert ledger.state(0).accepted == 0
    assert pending_ids(ledger) == []


@pytest.mark.parametrize(
    ("ranges", "exc", "needle"),
    [
        ([ShardRange(9, 2, 0, 10)], NotFound, "shard 9 does not exist"),
        ([ShardRange(-1, 2, 0, 10)], NotFound, "shard -1 does not exist"),
        ([ShardRange(0, 2, 0, 10), ShardRange(0, 2, 10, 20)], InvalidArgument, "shard 0 appears twice"),
        ([ShardRange(0, 2, 10, 10)], InvalidArgument, r"shard 0 range \[10, 10\) is empty or reversed"),
        ([ShardRange(0, 2, 10, 5)], InvalidArgument, "empty or reversed; send end > start"),
        ([ShardRange(0, 2, 0, 1001)], InvalidArgument, "covers 1001 tokens, more than the 1000 allowed"),
        ([ShardRange(0, 2, -5, 5)], InvalidArgument, "starts at -5; cursors are non-negative"),
        ([ShardRange(0, 0, 0, 5)], InvalidArgument, "epoch 0; epochs start at 1"),
        ([ShardRange(0, 2, 0.5, 5)], InvalidArgument, "integer epoch, start and end"),  # type: ignore[arg-type]
        (["0:0-5"], InvalidArgument, "expected ShardRange"),
    ],
)
def test_accept_rejects_malformed(ranges: list[ShardRange], exc: type[Exception], needle: str) -> None:
    ledger = make()
    ledger.assign(0, "a")
    raises_unchanged(ledger, exc, needle, ledger.accept, "a", ranges)


def test_malformed_reported_before_stale() -> None:
    ledger = make()
    ledger.assign(0, "a")
    ledger.assign(1, "a")
    stale = ShardRange(0, 1, 0, 10)
    bad = ShardRange(1, 2, 10, 10)
    raises_unchanged(ledger, InvalidArgument, "shard 1 range", ledger.accept, "a", [stale, bad])


def test_max_range_tokens_caps_ranges() -> None:
    ledger = ShardLedger(2, [1000, 1000], max_range_tokens=64)
    ledger.assign(0, "a")
    ledger.accept("a", [rng(ledger, 0, 64)])
    raises_unchanged(ledger, InvalidArgument, "more than the 64 allowed", ledger.accept, "a", [rng(ledger, 0, 65)])
    with pytest.raises(InvalidArgument, match="max_range_tokens"):
        ShardLedger(1, [10], max_range_tokens=0)


def test_cursors_grow_past_shard_length() -> None:
    """The ledger only counts; wrap-around is the reader's business."""
    ledger = make(1, length=100)
    ledger.assign(0, "a")
    for _ in range(3):
        ledger.commit(ledger.accept("a", [rng(ledger, 0, 100)]))
    assert ledger.state(0).committed == 300
    assert ledger.committed_tokens() == 300


def test_empty_submission_gives_empty_receipt() -> None:
    ledger = make()
    receipt = ledger.accept("a", [])
    assert receipt.ranges == ()
    ledger.commit(receipt)
    assert pending_ids(ledger) == []


# ---------------------------------------------------------------- commit, rollback


def test_commit_in_order_merges_ranges_of_one_epoch() -> None:
    ledger = make()
    ledger.assign(0, "a")
    r1 = ledger.accept("a", [rng(ledger, 0, 100)])
    r2 = ledger.accept("a", [rng(ledger, 0, 50)])
    ledger.commit(r1)
    assert ledger.state(0).committed == 100
    ledger.commit(r2)
    s = ledger.state(0)
    assert s.committed == 150
    assert s.committed_ranges == (ShardRange(0, 2, 0, 150),)
    ledger.assign(0, "b")
    ledger.commit(ledger.accept("b", [rng(ledger, 0, 10)]))
    assert ledger.state(0).committed_ranges == (ShardRange(0, 2, 0, 150), ShardRange(0, 3, 150, 160))
    assert ledger.committed_tokens() == 160


def test_commit_out_of_order_is_rejected() -> None:
    ledger = make()
    ledger.assign(0, "a")
    ledger.assign(1, "b")
    r1 = ledger.accept("a", [rng(ledger, 0, 100)])
    r2 = ledger.accept("a", [rng(ledger, 0, 100)])
    r3 = ledger.accept("b", [rng(ledger, 1, 100)])
    raises_unchanged(
        ledger,
        FailedPrecondition,
        f"receipt {r2.receipt_id} cannot be committed before receipt {r1.receipt_id} on shard 0; "
        "commit receipts in acceptance order",
        ledger.commit,
        r2,
    )
    ledger.commit(r3)  # other shards are independent
    ledger.commit(r1)
    ledger.commit(r2)
    assert ledger.state(0).committed == 200


def test_commit_twice_or_forged_is_rejected() -> None:
    ledger = make()
    ledger.assign(0, "a")
    receipt = ledger.accept("a", [rng(ledger, 0, 100)])
    forged = AcceptReceipt(receipt.receipt_id, "a", (ShardRange(0, 2, 0, 999),))
    raises_unchanged(ledger, FailedPrecondition, f"receipt {receipt.receipt_id} is not pending", ledger.commit, forged)
    ledger.commit(receipt)
    raises_unchanged(ledger, FailedPrecondition, "already committed or rolled back", ledger.commit, receipt)
    raises_unchanged(ledger, InvalidArgument, "expected AcceptReceipt", ledger.commit, "r1")


def test_rollback_uncommitted_drops_pending_and_bumps_epochs() -> None:
    ledger = make(2)
    ledger.assign(0, "a")
    r1 = ledger.accept("a", [rng(ledger, 0, 100)])
    r2 = ledger.accept("a", [rng(ledger, 0, 100)])
    ledger.commit(r1)
    epochs = [s.epoch for s in ledger.states()]
    ledger.rollback_uncommitted()
    assert [s.epoch for s in ledger.states()] == [epochs[0] + 1, epochs[1]]  # shard 1 had nothing pending
    s0 = ledger.state(0)
    assert (s0.owner, s0.accepted, s0.committed) == ("a", 100, 100)
    assert pending_ids(ledger) == []
    raises_unchanged(ledger, FailedPrecondition, "rolled back by a restart", ledger.commit, r2)
    # a's in-flight range from before the restart is fenced by the new epoch
    raises_unchanged(
        ledger,
        FailedPrecondition,
        "shard 0 moved to epoch 3 .*resume from cursor 100",
        ledger.accept,
        "a",
        [ShardRange(0, 2, 200, 300)],
    )


# ---------------------------------------------------------------- snapshot / restore


def busy_ledger() -> tuple[ShardLedger, list[AcceptReceipt]]:
    ledger = make(3)
    ledger.assign(0, "a")
    ledger.assign(1, "b")
    ledger.commit(ledger.accept("a", [rng(ledger, 0, 100)]))
    ledger.assign(0, "b")
    ledger.commit(ledger.accept("b", [rng(ledger, 0, 10), rng(ledger, 1, 20)]))
    p1 = ledger.accept("b", [rng(ledger, 0, 5)])
    p2 = ledger.accept("b", [rng(ledger, 0, 7), rng(ledger, 1, 9)])
    return ledger, [p1, p2]


def test_snapshot_round_trip_through_json() -> None:
    ledger, pending = busy_ledger()
    snap = ledger.snapshot()
    restored = ShardLedger.restore(json.loads(json.dumps(snap)))
    assert restored.snapshot() == snap
    assert restored.states() == ledger.states()
    assert pending_ids(restored) == [p.receipt_id for p in pending]
    # the restored ledger behaves the same: pending receipts commit, new receipt ids do not collide
    restored.commit(pending[0])
    restored.commit(pending[1])
    assert restored.state(0).committed == 122
    new = restored.accept("b", [rng(restored, 1, 1)])
    assert new.receipt_id > pending[1].receipt_id


def test_restore_then_rollback_is_the_restart_path() -> None:
    ledger, _ = busy_ledger()
    restored = ShardLedger.restore(ledger.snapshot())
    restored.rollback_uncommitted()
    assert [(s.accepted, s.committed) for s in restored.states()] == [(110, 110), (20, 20), (0, 0)]


def corruptions() -> list[tuple[str, Any]]:
    def edit(fn: Any) -> Any:
        snap = busy_ledger()[0].snapshot()
        fn(snap)
        return snap

    def pop_shards(s: dict[str, Any]) -> None:
        s.pop("shards")

    return [
        ("expected a mapping, got list", [1, 2]),
        ("format", edit(lambda s: s.update(format=99))),
        ("shards must be a non-empty list", edit(pop_shards)),
        ("shards must be a non-empty list", edit(lambda s: s.update(shards=[]))),
        ("next_receipt_id", edit(lambda s: s.update(next_receipt_id="7"))),
        ("max_range_tokens", edit(lambda s: s.update(max_range_tokens=0))),
        ("shard entry 1 has shard_id", edit(lambda s: s["shards"][1].update(shard_id=5))),
        ("shard 0 epoch", edit(lambda s: s["shards"][0].update(epoch=0))),
        ("shard 0 length", edit(lambda s: s["shards"][0].update(length=True))),
        ("shard 0 owner", edit(lambda s: s["shards"][0].update(owner=3))),
        ("committed 999 is beyond accepted", edit(lambda s: s["shards"][0].update(committed=999))),
        ("does not continue contiguously", edit(lambda s: s["shards"][0]["committed_ranges"].reverse())),
        ("committed ranges end at", edit(lambda s: s["shards"][1]["committed_ranges"].clear())),
        ("shard 0 committed range", edit(lambda s: s["shards"][0]["committed_ranges"].append([1, 2]))),
        ("pending ranges end at", edit(lambda s: s["pending"].pop())),
        ("out of order", edit(lambda s: s["pending"][1].update(receipt_id=s["pending"][0]["receipt_id"]))),
        ("starts shard 0 at 115, expected 110", edit(lambda s: s["pending"].reverse())),
        ("not below next_receipt_id", edit(lambda s: s.update(next_receipt_id=2))),
        ("unknown or repeated shard 7", edit(lambda s: s["pending"][0]["ranges"].append([7, 1, 0, 1]))),
        ("malformed range", edit(lambda s: s["pending"][0]["ranges"][0].__setitem__(1, 99))),
        ("worker_id", edit(lambda s: s["pending"][0].update(worker_id=""))),
        ("pending must be a list", edit(lambda s: s.update(pending=None))),
    ]


@pytest.mark.parametrize(("needle", "snap"), corruptions())
def test_restore_rejects_corrupt_snapshot(needle: str, snap: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"corrupt ledger snapshot: .*" + re.escape(needle)) as info:
        ShardLedger.restore(snap)
    assert "restore from the previous checkpoint" in str(info.value)


def test_snapshot_is_a_copy() -> None:
    ledger, _ = busy_ledger()
    snap = ledger.snapshot()
    kept = copy.deepcopy(snap)
    snap["shards"][0]["committed_ranges"].clear()
    assert ledger.snapshot() == kept


# ---------------------------------------------------------------- stateful property test


N_PARAMS = 4


def fingerprint(core: CoordinatorCore) -> Any:
    """Everything a submission could change: a refused one must leave all of it as it was."""
    return (
        core.params.tolist(),
        core.ledger.snapshot(),
        core.version,
        {w: vars(r).copy() for w, r in core.workers.items()},
        list(core.receipts),
        dict(core.staged),
        core.plan_seq,
        list(core.policy.pending),
        core.policy.quorum_at,
        core.acc.tokens,
        core.tokens_applied,
        list(core.applied.items()),
    )


class LedgerMachine(RuleBasedStateMachine):
    """The ledger driven the way production drives it: through `CoordinatorCore`. Learners register (shards are
    placed by speed, moves off a live learner handed off after its next submission), fetch plans, submit ranges
    from them, die or leave; rounds close on the policy's clock and commit; the coordinator restarts from its
    checkpoint and the learners register again. Stale owners, impostors, malformed and replayed submissions are
    refused and change nothing.

    The model keeps what an observer of the coordinator can know: the live learners, every (shard, epoch) -> owner
    pairing ever observed, the submissions accepted and not yet applied, and the ranges applied per shard.
    """

    NUM_SHARDS = 5
    LENGTH = 200

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.live: dict[str, str] = {}  # worker id -> name
        self.next_name = 0
        self.sent: dict[str, Submission] = {}  # every submission this core accepted, by id
        self.open: list[str] = []  # accepted, not yet applied, in acceptance order
        self.epoch_owner: dict[tuple[int, int], str | None] = {}  # fencing: one owner per (shard, epoch)
        self.stale: list[tuple[str, ShardRange]] = []  # ranges a former owner may still try to send
        # per shard, the (start, end, epoch, worker) of every applied range, in order
        self.applied: dict[int, list[tuple[int, int, int, str]]] = {i: [] for i in range(self.NUM_SHARDS)}
        self.last_epoch = [1] * self.NUM_SHARDS
        self.last_committed = [0] * self.NUM_SHARDS
        self.next_sid = 0

    # -------------------------------------------------------------- model helpers

    def new_core(self) -> CoordinatorCore:
        return CoordinatorCore(self.cfg, torch.zeros(N_PARAMS), [self.LENGTH] * self.NUM_SHARDS)

    def record_owners(self) -> None:
        for s in self.core.ledger.states():
            key = (s.shard_id, s.epoch)
            assert self.epoch_owner.setdefault(key, s.owner) == s.owner, "an epoch changed owner"

    def act(self, fn: Any, *args: Any) -> Any:
        """Run a production call; a shard whose epoch moved under its owner makes that owner's lease stale."""
        before = {s.shard_id: (s.owner, s.epoch, s.accepted) for s in self.core.ledger.states()}
        result = fn(*args)
        for s in self.core.ledger.states():
            owner, epoch, accepted = before[s.shard_id]
            if owner is not None and s.epoch != epoch:
                self.stale.append((owner, ShardRange(s.shard_id, epoch, accepted, accepted + 1)))
        self.record_owners()
        return result

    def applied_round(self, applied: RoundApplied | None) -> None:
        if applied is None:
            return
        for p in applied.submissions:
            assert p.submission_id == self.open.pop(0), "a round applies submissions in acceptance order"
            for r in self.sent[p.submission_id].ranges:
                self.applied[r.shard_id].append((r.start, r.end, r.epoch, p.worker_id))

    def sid(self) -> str:
        self.next_sid += 1
        return f"s{self.next_sid}"

    def refused(self, exc: type[Exception] | tuple[type[Exception], ...], fn: Any, *args: Any) -> None:
        before = fingerprint(self.core)
        with pytest.raises(exc):
            fn(*args)
        assert fingerprint(self.core) == before, "a refused call changed the coordinator"

    def submit_ranges(self, worker_id: str, ranges: list[ShardRange], base: int, plan_seq: int) -> Submission:
        tokens = sum(r.end - r.start for r in ranges)
        return Submission(worker_id, self.sid(), base, tokens, 1, tuple(ranges), plan_seq)

    # -------------------------------------------------------------- rules

    @initialize(
        mode=st.sampled_from(["sync", "decoupled", "async"]),
        quorum=st.integers(1, 2),
        expected=st.sampled_from([0, 2]),
        n=st.integers(1, 3),
    )
    def start(self, mode: str, quorum: int, expected: int, n: int) -> None:
        self.cfg = CoordinatorConfig(
            rounds=RoundConfig(mode=mode, min_quorum=quorum, grace_max_s=1.0, max_staleness=2),
            local_steps=10,
            min_local_steps=2,
            expected_workers=expected,  # phantom slots keep shards for learners still to come
        )
        self.core = self.new_core()
        self.checkpoint = self.core.snapshot()
        self.checkpoint_applied = copy.deepcopy(self.applied)
        self.record_owners()
        for _ in range(n):
            self.join(1.0)

    @rule(speed=st.sampled_from([0.25, 0.5, 1.0, 2.0, 0.0]))
    def join(self, speed: float) -> None:
        name = f"w{self.next_name}"
        self.next_name += 1
        rec = self.act(self.core.register, name, self.now, speed)
        self.live[rec.worker_id] = name

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), speed=st.sampled_from([0.5, 1.0, 4.0]))
    def throughput(self, data: st.DataObject, speed: float) -> None:
        """healthd forwards a measured speed: H_m changes, placement does not until membership does."""
        worker_id = data.draw(st.sampled_from(sorted(self.live)))
        self.act(self.core.report_throughput, worker_id, speed, "cpu", self.now)

    def working(self) -> list[str]:
        """The live learners whose plan lists shards."""
        return [w for w in sorted(self.live) if self.core.plan(w).shards]

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        working = self.working()
        if not working:
            return
        worker_id = data.draw(st.sampled_from(working))
        plan = self.core.plan(worker_id)
        chosen = data.draw(st.lists(st.sampled_from(plan.shards), min_size=1, unique_by=lambda lease: lease.shard_id))
        ranges = []
        for lease in chosen:
            assert self.epoch_owner[(lease.shard_id, lease.epoch)] == worker_id
            n = data.draw(st.integers(1, self.LENGTH))
            ranges.append(ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + n))
        limit = 0 if self.cfg.rounds.mode == "sync" else self.cfg.rounds.max_staleness
        base = data.draw(st.integers(max(0, self.core.version - limit), self.core.version))
        sub = self.submit_ranges(worker_id, ranges, base, plan.plan_seq)
        self.now += data.draw(st.sampled_from([0.0, 0.1, 0.7]))
        result = self.act(self.core.accept, sub, torch.zeros(N_PARAMS), self.now)
        assert result.staleness == self.core.version - base - (1 if result.applied else 0)
        for r in ranges:  # the ledger took the range (it may already be committed by the round it closed)
            assert self.core.ledger.state(r.shard_id).accepted >= r.end
        self.sent[sub.submission_id] = sub
        self.open.append(sub.submission_id)
        self.applied_round(result.applied)

    @precondition(lambda self: bool(self.live))
    @rule(
        data=st.data(),
        fault=st.sampled_from(
            ["epoch-1", "epoch+1", "start-1", "start+1", "not-owner", "impostor", "long", "too-stale", "future"]
        ),
    )
    def submit_bad(self, data: st.DataObject, fault: str) -> None:
        working = self.working()
        if not working:
            return
        worker_id = data.draw(st.sampled_from(working))
        plan = self.core.plan(worker_id)
        good = [ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + 1) for lease in plan.shards]
        victim = data.draw(st.sampled_from(good))
        e, a = victim.epoch, victim.start
        bad = {
            "epoch-1": ShardRange(victim.shard_id, e - 1, a, a + 1),
            "epoch+1": ShardRange(victim.shard_id, e + 1, a, a + 1),
            "start-1": ShardRange(victim.shard_id, e, a - 1, a + 1),
            "start+1": ShardRange(victim.shard_id, e, a + 1, a + 2),
            "long": ShardRange(victim.shard_id, e, a, a + self.LENGTH + 1),
        }.get(fault, victim)
        # the good ranges must not land either
        ranges = [bad if r.shard_id == victim.shard_id else r for r in good]
        base = self.core.version
        sender = worker_id
        expected: type[Exception] = FailedPrecondition
        if fault == "not-owner":  # another live learner sends this learner's ranges
            others = sorted(set(self.live) - {worker_id})
            if not others:
                return
            sender = data.draw(st.sampled_from(others))
        elif fault == "impostor":  # an id the coordinator never issued
            sender, expected = worker_id + "-impostor", NotFound
        elif fault == "too-stale":
            limit = 0 if self.cfg.rounds.mode == "sync" else self.cfg.rounds.max_staleness
            if self.core.version <= limit:
                return
            base = self.core.version - limit - 1
        elif fault == "future":
            base = self.core.version + 1
        elif fault == "long" or bad.start < 0 or bad.epoch < 1:
            expected = InvalidArgument
        sub = self.submit_ranges(sender, ranges, base, plan.plan_seq)
        self.refused(expected, self.core.accept, sub, torch.zeros(N_PARAMS), self.now)

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def stale_owner_submits(self, data: st.DataObject) -> None:
        worker_id, r = data.draw(st.sampled_from(self.stale))
        # even when it got the shard back (under a newer epoch) the old epoch stays fenced
        assert self.core.ledger.state(r.shard_id).epoch > r.epoch
        sub = self.submit_ranges(worker_id, [r], self.core.version, self.core.plan_seq)
        expected = FailedPrecondition if worker_id in self.core.workers else NotFound
        self.refused(expected, self.core.accept, sub, torch.zeros(N_PARAMS), self.now)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """A learner retries a submission that was already accepted (pending or applied): refused, nothing moves."""
        sub = self.sent[data.draw(st.sampled_from(sorted(self.sent)))]
        self.refused(AlreadyExists, self.core.accept, sub, torch.zeros(N_PARAMS), self.now)

    @rule(dt=st.sampled_from([0.0, 0.3, 1.0, 2.5]))
    def poll(self, dt: float) -> None:
        """Time passes; the service polls at the policy's deadlines."""
        self.now += dt
        self.applied_round(self.act(self.core.poll, self.now))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), state=st.sampled_from([DEAD, LEFT]))
    def remove(self, data: st.DataObject, state: str) -> None:
        """healthd reports a death, or the learner deregisters: its shards move at once, its pending data stays."""
        worker_id = data.draw(st.sampled_from(sorted(self.live)))
        owned = {s.shard_id: s for s in self.core.ledger.owned_by(worker_id)}
        moved = self.act(self.core.remove, worker_id, state, "test")
        assert moved == sorted(owned)
        for sid, s in owned.items():
            after = self.core.ledger.state(sid)
            assert after.owner != worker_id and after.epoch > s.epoch
            assert after.accepted == s.accepted  # pending data stays accepted
        del self.live[worker_id]
        self.refused(FailedPrecondition, self.core.plan, worker_id)  # it must register again
        assert self.core.remove(worker_id, DEAD, "again") == []

    @precondition(lambda self: self.applied != self.checkpoint_applied)
    @rule()
    def take_checkpoint(self) -> None:
        self.checkpoint = self.core.snapshot()
        self.checkpoint_applied = copy.deepcopy(self.applied)

    @precondition(lambda self: bool(self.open) or self.applied != self.checkpoint_applied)
    @rule()
    def coordinator_restart(self) -> None:
        """A new process restores the last checkpoint: submissions accepted after it are lost (their learners
        train those ranges again), and every live learner registers again under a new id."""
        core = self.new_core()
        core.restore(self.checkpoint)
        self.core = core
        self.open = []
        self.sent = {}
        self.applied = copy.deepcopy(self.checkpoint_applied)
        # epochs issued after the checkpoint are issued again by the restored ledger; in the real system the
        # coordinator epoch fences submissions made against the lost state, so the model forgets them
        self.epoch_owner = {k: v for k, v in self.epoch_owner.items() if k[1] < core.ledger.state(k[0]).epoch}
        self.stale = []
        self.last_epoch = [s.epoch for s in core.ledger.states()]
        self.last_committed = [s.committed for s in core.ledger.states()]
        assert all(s.owner is None and s.accepted == s.committed for s in core.ledger.states())
        self.record_owners()
        names = sorted(self.live.values())
        self.live = {}
        for name in names:
            rec = self.act(core.register, name, self.now, 1.0)
            self.live[rec.worker_id] = name

    # -------------------------------------------------------------- invariants

    @invariant()
    def committed_ranges_tile_from_zero_exactly_once(self) -> None:
        for s in self.core.ledger.states():
            end = 0
            for r in s.committed_ranges:
                assert r.shard_id == s.shard_id
                assert r.start == end and r.end > r.start  # contiguous, no overlap, no gap
                end = r.end
            assert end == s.committed
            # exactly the tokens the model applied, each once and in order, each by the owner at its epoch
            merged: list[tuple[int, int, int]] = []
            model_end = 0
            for start, stop, epoch, worker_id in self.applied[s.shard_id]:
                assert start == model_end
                assert self.epoch_owner[(s.shard_id, epoch)] == worker_id
                model_end = stop
                if merged and merged[-1][2] == epoch and merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], stop, epoch)
                else:
                    merged.append((start, stop, epoch))
            assert merged == [(r.start, r.end, r.epoch) for r in s.committed_ranges]
        assert self.core.tokens_applied == sum(s.committed for s in self.core.ledger.states())

    @invariant()
    def cursors_epochs_and_owners_are_consistent(self) -> None:
        for s in self.core.ledger.states():
            assert 0 <= s.committed <= s.accepted
            assert s.epoch >= self.last_epoch[s.shard_id]
            assert s.committed >= self.last_committed[s.shard_id]
            self.last_epoch[s.shard_id] = s.epoch
            self.last_committed[s.shard_id] = s.committed
            assert s.owner is None or s.owner in self.live
            if self.live and self.core.registered_ever >= self.cfg.expected_workers:
                assert s.owner is not None  # placement keeps every shard owned while anyone is alive
        assert set(self.core.live_ids()) == set(self.live)
        by_scan: dict[str, set[int]] = {}
        for s in self.core.ledger.states():
            if s.owner is not None:
                by_scan.setdefault(s.owner, set()).add(s.shard_id)
        assert self.core.ledger.owners() == by_scan  # the owner index agrees with the shards, also after restore
        for owner, ids in by_scan.items():
            assert [s.shard_id for s in self.core.ledger.owned_by(owner)] == sorted(ids)

    @invariant()
    def plans_match_the_ledger(self) -> None:
        """What a learner is told to train is where the ledger will accept it: nothing skipped, nothing twice."""
        for worker_id in self.live:
            for lease in self.core.plan(worker_id).shards:
                s = self.core.ledger.state(lease.shard_id)
                assert (s.owner, s.epoch, s.accepted) == (worker_id, lease.epoch, lease.cursor)
                assert lease.shard_id not in self.core.staged  # a shard being handed off is in no plan

    @invariant()
    def pending_matches_model_and_was_fenced(self) -> None:
        assert [p.submission_id for p in self.core.policy.pending] == self.open
        assert sorted(self.core.receipts) == sorted(self.open)
        cursor = {s.shard_id: s.committed for s in self.core.ledger.states()}
        for sid in self.open:
            receipt = self.core.receipts[sid]
            assert receipt.ranges == self.sent[sid].ranges and receipt.worker_id == self.sent[sid].worker_id
            for r in receipt.ranges:
                assert self.epoch_owner[(r.shard_id, r.epoch)] == receipt.worker_id  # owner at that epoch
                assert r.start == cursor[r.shard_id]
                cursor[r.shard_id] = r.end
        assert cursor == {s.shard_id: s.accepted for s in self.core.ledger.states()}


LedgerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLedgerMachine = LedgerMachine.TestCase
