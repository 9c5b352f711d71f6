"""Round-log replication, pure (`diloco.core.replication`): a standby replaying a leader core's rounds holds the
same bits at every version; every refusal (gap, repeat, older epoch, corrupt payload, wrong digest) leaves it
exactly as it was; a snapshot then the tail catches a new standby up; the log's window and the publish gate."""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from typing import Any

import pytest
import torch

from diloco.core.codecs import get_codec
from diloco.core.coordinator import Accepted, CoordinatorConfig, CoordinatorCore, Submission, applied_from_json
from diloco.core.fragments import FragmentedCoordinator, FragmentLayout, FragmentSubmission
from diloco.core.ledger import ShardRange
from diloco.core.outer import OuterConfig
from diloco.core.replication import (
    WHEN_NO_STANDBY,
    Digest,
    EntryMeta,
    Gate,
    LogEntry,
    Receiver,
    ResyncReason,
    ResyncRequired,
    RoundLog,
    Snapshot,
    Standby,
    SyncGate,
    WhenNoStandby,
    digest,
    snapshot_tensor_bytes,
    state_digest,
)
from diloco.core.rounds import RoundConfig
from diloco.core.uploads import Outcome, UploadHeader, UploadLimits, Uploads
from diloco.errors import AlreadyExists, ConfigError, FailedPrecondition, InvalidArgument
from diloco.rpc.payload import PayloadReceiver

pytestmark = pytest.mark.timeout(60)
N = 4099  # not a multiple of any vector width: the scalar tail of the elementwise kernels is exercised too
EPOCH = 7


class Leader:
    """A coordinator core driven through rounds, with the replication log the service would keep."""

    def __init__(self, mode: str = "decoupled", outer: str = "nesterov", workers: int = 3, k: int = 2) -> None:
        cfg = CoordinatorConfig(
            rounds=RoundConfig(mode=mode, min_quorum=k if mode == "decoupled" else 1, grace_max_s=0.5),
            outer=OuterConfig(outer, 0.7 if outer != "fedavg" else 1.0, 0.9 if outer != "fedavg" else 0.0),
            local_steps=10,
            min_local_steps=2,
            expected_workers=workers,
        )
        params = torch.randn(N, generator=torch.Generator().manual_seed(1))
        self.core = CoordinatorCore(cfg, params, [100_000] * 6)
        self.workers = [self.core.register(f"w{i}", 0.0).worker_id for i in range(workers)]
        self.gen = torch.Generator().manual_seed(2)
        self.now = 1.0
        self.entries: list[LogEntry] = []
        self.states: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}  # version -> (Θ, outer state) copies
        self.first = self.snapshot()
        self.log = RoundLog(self.core.version, digest(self.core.params, self.core.outer), max_entries=3)
        self._step: tuple[int, torch.Tensor, int] | None = None
        self.core.on_step = lambda v, d, n: setattr(self, "_step", (v, d.clone(), n))
        self._keep()

    def snapshot(self) -> Snapshot:
        return Snapshot.of_core(self.core.snapshot(), EPOCH)

    def _keep(self) -> None:
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.core.outer.state_dict().items()}
        self.states[self.core.version] = (self.core.params.clone(), state)

    def submit(self, worker: int, sid: str, steps: int = 1) -> Submission:
        c, w = self.core, self.workers[worker]
        lease = c.plan(w).shards[0]
        tokens = 16 * steps
        rng = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + tokens)
        sub = Submission(w, sid, c.version, tokens, steps, (rng,), c.plan(w).plan_seq)
        delta = torch.randn(N, generator=self.gen) * 1e-2 * steps  # different sizes and token weights
        self.now += 0.1
        applied = c.accept(sub, delta, self.now).applied
        if applied is not None:
            self._entry(applied.version, [p.submission_id for p in applied.submissions])
        return sub

    def poll(self) -> None:
        self.now += 1.0  # past every grace window
        applied = self.core.poll(self.now)
        if applied is not None:
            self._entry(applied.version, [p.submission_id for p in applied.submissions])

    def _entry(self, version: int, ids: list[str]) -> None:
        assert self._step is not None and self._step[0] == version
        _, delta, learners = self._step
        c = self.core
        outcomes = {sid: c.applied[sid] for sid in ids}
        e = LogEntry.make(version, EPOCH, learners, delta, c.snapshot(), outcomes, digest(c.params, c.outer))
        self.entries.append(e)
        self.log.append(e)
        self._keep()

    def rounds(self, n: int) -> None:
        """`n` rounds: full ones, partial ones (closed on quorum and grace, scaled), with varied steps."""
        start = self.core.version
        i = 0
        while self.core.version < start + n:
            i += 1
            if self.core.cfg.rounds.mode == "async":
                self.submit(i % len(self.workers), f"s{start}-{i}", steps=1 + i % 3)
            elif i % 2:
                for w in range(len(self.workers)):
                    self.submit(w, f"s{start}-{i}-{w}", steps=1 + (i + w) % 3)
            else:
                self.submit(0, f"s{start}-{i}-a", steps=2)
                self.submit(1, f"s{start}-{i}-b", steps=1)
                self.poll()  # closes without w2: a partial, scaled step


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_holds(standby: Standby, leader: Leader, version: int) -> None:
    params, outer = leader.states[version]
    assert standby.version == version
    assert same_bits(standby.params, params)
    got = standby.outer.state_dict()
    assert set(got) == set(outer)
    for key, value in outer.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(got[key], value), key
        else:
            assert got[key] == value, key


def frozen(s: Standby) -> tuple[Any, ...]:
    outer = {k: bits(v) if isinstance(v, torch.Tensor) else v for k, v in s.outer.state_dict().items()}
    return s.version, s.epoch, s.digest, bits(s.params), outer, dict(s.applied), repr(s.core_snapshot()["ledger"])


def assert_frozen(s: Standby, before: tuple[Any, ...]) -> None:
    after = frozen(s)
    assert after[:3] == before[:3] and torch.equal(after[3], before[3]) and after[5:] == before[5:]
    assert after[4].keys() == before[4].keys()
    for k, v in before[4].items():
        assert torch.equal(after[4][k], v) if isinstance(v, torch.Tensor) else after[4][k] == v


# --- bit-exact replay -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "outer"),
    [("decoupled", "nesterov"), ("decoupled", "fedavg"), ("sync", "nesterov"), ("async", "delayed_nesterov")],
)
def test_a_standby_replaying_the_log_holds_the_leaders_bits_at_every_version(mode: str, outer: str) -> None:
    leader = Leader(mode, outer)
    standby = Standby(N)
    standby.load(leader.first)
    assert_holds(standby, leader, 0)
    leader.rounds(8)
    assert any(e.learners for e in leader.entries)
    for e in leader.entries:
        standby.apply(e)
        assert_holds(standby, leader, e.version)
        assert standby.digest == e.digest
    # the bookkeeping followed too: a core restored from the standby is the leader's, ledger and all
    restored = CoordinatorCore(leader.core.cfg, torch.zeros(N), [100_000] * 6)
    restored.restore(standby.core_snapshot())
    assert same_bits(restored.params, leader.core.params) and restored.version == leader.core.version
    assert restored.ledger.committed_tokens() == leader.core.ledger.committed_tokens() > 0
    assert restored.tokens_applied == leader.core.tokens_applied
    assert digest(restored.params, restored.outer) == digest(leader.core.params, leader.core.outer)
    assert list(standby.applied.items()) == list(leader.core.applied.items())
    assert list(restored.applied.items()) == list(leader.core.applied.items())


def test_partial_rounds_were_scaled_so_the_replay_covers_the_scaled_step() -> None:
    leader = Leader()
    scales: list[float] = []
    closed = leader.core.close

    def close(now: float) -> Any:
        r = closed(now)
        if r is not None:
            scales.append(r.scale)
        return r

    leader.core.close = close  # type: ignore[method-assign]
    leader.rounds(4)
    assert any(s < 1 for s in scales) and any(s == 1 for s in scales)


def test_snapshot_then_tail_catches_a_new_standby_up() -> None:
    leader = Leader()
    leader.rounds(3)
    late = Standby(N)
    with pytest.raises(ResyncRequired) as e:
        late.apply(leader.entries[-1])
    assert e.value.reason is ResyncReason.NO_STATE and "resync from a snapshot" in str(e.value)
    late.load(leader.snapshot())
    assert_holds(late, leader, 3)
    assert list(late.applied.items()) == list(leader.core.applied.items())
    leader.rounds(3)
    for entry in leader.log.since(late.version, late.digest) or []:
        late.apply(entry)
    assert_holds(late, leader, 6)


def test_a_snapshot_crosses_the_wire_and_an_entry_too() -> None:
    leader = Leader()
    leader.rounds(2)
    snap = leader.snapshot()
    rx = Receiver(N)
    got: Any = rx.start(snap.meta)
    for part in snap.payload():
        for i in range(0, len(part), 1000):
            assert got is None
            got = rx.feed(part[i : i + 1000])
    assert isinstance(got, Snapshot) and got.meta == snap.meta and not rx.busy
    s = Standby(N)
    s.load(got)
    assert_holds(s, leader, 2)
    leader.rounds(1)
    entry = leader.entries[-1]
    rx.start(entry.meta)
    received: Any = None
    for part in entry.payload():
        received = rx.feed(bytes(part))
    assert isinstance(received, LogEntry) and received.meta == entry.meta
    s.apply(received)
    assert_holds(s, leader, 3)


# --- outcomes survive a takeover ---------------------------------------------------------------------------------


def test_a_core_restored_from_a_standby_answers_a_resubmission_as_the_leader_did() -> None:
    """ALGORITHM.md section 11, "Submission ids are in the log, so a resubmission to the new leader is answered as
    before and never applied twice": the leader applies w0's submission `a` in round 1 and dies before its answer
    arrives; a core restored from the standby (what a promoted replica resumes from) answers the resubmission, under
    the old coordinator epoch, with the same outcome, and refuses to apply it again. A submission the leader held
    pending (`p`, its round not closed) is unknown there: its range is not committed, so it is trained again."""
    leader = Leader(workers=2, k=2)  # a round waits for both learners
    standby = Standby(N)
    standby.load(leader.first)
    a = leader.submit(0, "a")
    leader.submit(1, "b")  # both in: round 1 closes
    first = leader.core.accepted("a")
    assert first == Accepted(a.worker_id, round=1, staleness=0, applied=True)
    p = leader.submit(0, "p")  # pending in round 2 when the leader dies
    assert leader.core.version == 1 and leader.core.accepted("p") == Accepted(p.worker_id, 2, 0, applied=False)
    for entry in leader.entries:
        standby.apply(entry)
    assert standby.applied == {"a": first, "b": leader.core.accepted("b")}

    new = CoordinatorCore(leader.core.cfg, torch.zeros(N), [100_000] * 6)
    new.restore(standby.core_snapshot())  # what a promoted replica resumes from (it writes it as a checkpoint)
    assert new.version == 1 and new.accepted("a") == first and not new.workers  # learners register again
    table = Uploads(UploadLimits(N, 4 * N + 64, 10.0, 4), lambda h: PayloadReceiver(h.meta, N))
    _, meta = get_codec("fp32").encode(torch.zeros(N))
    resent = UploadHeader(a, EPOCH, meta, resume_offset=0)  # the old coordinator epoch: the lookup comes first
    assert table.open(resent, 5.0, new.accepted("a"), new.version) == Outcome(True, 1, 0, 1)
    with pytest.raises(AlreadyExists):  # never applied twice
        new.admit(a)
    committed = new.ledger.committed_tokens()
    assert committed == leader.core.ledger.committed_tokens() == a.tokens + 16  # a and b, once each

    assert new.accepted("p") is None  # lost with the leader: not applied, not pending
    (rng,) = p.ranges
    shard = new.ledger.state(rng.shard_id)
    assert shard.committed == shard.accepted == rng.start and shard.epoch > rng.epoch  # its range, fenced off
    learners = [new.register(f"w{i}", 6.0).worker_id for i in range(2)]  # new incarnations
    leases = {lease.shard_id: lease for w in learners for lease in new.plan(w).shards}
    assert leases[rng.shard_id].cursor == rng.start  # trained again, from its start


def test_a_core_restored_from_a_standby_with_learners_at_keeps_the_learner_table() -> None:
    """ALGORITHM.md section 11, each entry carries "the ledger and learner table changes": a promoted standby
    (`restore(..., learners_at=...)`) knows the leader's learners by the ids they hold, with their shards, epochs and
    cursors, so they go on without registering again. A submission the leader held pending when it died was never
    in the log: its shard's cursor is where the standby's ledger has it, so the learner's resend of it is taken once.
    A learner that does not show up (healthd never reports it, it never submits) is declared dead after
    `confirm_timeout_s`, as a fresh registration would be."""
    leader = Leader(workers=2, k=2)
    standby = Standby(N)
    standby.load(leader.first)
    leader.submit(0, "a")
    leader.submit(1, "b")  # round 1
    leader.core.report_throughput(leader.workers[0], 123.0, "cpu")
    leader.submit(1, "c")
    leader.submit(0, "d")  # round 2; w0's claim is in the table from here on
    w0, w1 = leader.workers
    before = {w: leader.core.plan(w) for w in (w0, w1)}
    p = leader.submit(0, "p")  # pending in round 3 when the leader dies
    for entry in leader.entries:
        standby.apply(entry)

    cfg = dataclasses.replace(leader.core.cfg, confirm_timeout_s=10.0)
    new = CoordinatorCore(cfg, torch.zeros(N), [100_000] * 6)
    new.restore(standby.core_snapshot(), learners_at=500.0)
    assert sorted(new.workers) == [w0, w1] and new.adopted == {w0, w1} and new.live_ids() == [w0, w1]
    r0 = new.workers[w0]
    assert (r0.name, r0.speed, r0.device_kind, r0.submissions, r0.tokens) == ("w0", 123.0, "cpu", 2, 32)
    assert (r0.registered_at, r0.seen_at, r0.confirmed) == (500.0, 500.0, False)  # clocks of the new leader
    assert new.plan_seq == leader.core.plan_seq
    for w in (w0, w1):
        assert new.plan(w).shards == before[w].shards  # the same leases: epochs and cursors
    assert new.accepted("p") is None and new.take(p, 0.0, 501.0).round == 3  # the resend, taken once
    with pytest.raises(AlreadyExists):
        new.admit(p)
    # w1 goes on under the leases it held
    lease = before[w1].shards[0]
    rng = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + 16)
    assert new.take(Submission(w1, "e", new.version, 16, 1, (rng,)), 0.0, 501.0).round == 3
    # a registration at the new leader never reuses an adopted id, and is not adopted
    assert new.register("w0", 502.0).worker_id not in {w0, w1} | new.adopted

    # w0 died with the leader: healthd reports only w1, and w0 is declared dead once the confirmation window passed
    again = CoordinatorCore(cfg, torch.zeros(N), [100_000] * 6)
    again.restore(standby.core_snapshot(), learners_at=500.0)
    again.report_throughput(w1, 100.0, now=502.0)
    assert again.expire_unconfirmed(509.0) == []
    assert [w for w, _ in again.expire_unconfirmed(510.0)] == [w0] and again.live_ids() == [w1]

    fresh = CoordinatorCore(cfg, torch.zeros(N), [100_000] * 6)
    fresh.restore(standby.core_snapshot())  # a restart from a checkpoint: every learner registers again
    assert not fresh.workers and not fresh.adopted
    book = standby.core_snapshot()
    for bad in (
        {"learners": [{"worker_id": w0}]},
        {"learners": [{**book["learners"][0], "state": "dead"}]},
        {"learners": [book["learners"][0]] * 2},
        {"learners": {"w": 1}},
        {"learners": [{**book["learners"][0], "tokens": -1}]},
        {"learners": [{**book["learners"][0], "speed": float("nan")}]},
        {"learners": [{**book["learners"][0], "speed_samples": [["16", 1.0]]}]},
        {"learners": [{**book["learners"][0], "speed_samples": [[16, -1.0]]}]},
    ):
        with pytest.raises(InvalidArgument, match="learner"):
            fresh.restore({**book, **bad}, learners_at=1.0)
    small = CoordinatorCore(dataclasses.replace(cfg, max_workers=2), torch.zeros(N), [100_000] * 6)
    with pytest.raises(InvalidArgument, match="at most 2"):
        small.restore({**book, "learners": book["learners"] + [{**book["learners"][0], "worker_id": "w9-9"}]}, 1.0)
    assert not fresh.workers and fresh.version == 2  # a refused restore changed nothing


# --- refusals change nothing ------------------------------------------------------------------------------------


def corrupt(e: LogEntry) -> LogEntry:
    delta = e.delta.clone()
    delta[17] += 1.0
    return dataclasses.replace(e, delta=delta)


def wrong_digest(e: LogEntry) -> LogEntry:
    return dataclasses.replace(e, digest=Digest(e.digest.params_crc32 ^ 1, e.digest.outer_crc32))


def wrong_delta_right_crc(e: LogEntry) -> LogEntry:
    """A Δ that checks out as sent (its payload checksum recomputed) but is not the leader's: the replay differs."""
    delta = e.delta.clone()
    delta[3] *= 2
    return with_outcomes(dataclasses.replace(e, delta=delta), lambda applied: applied)


def with_outcomes(e: LogEntry, change: Any) -> LogEntry:
    """`e` with its outcomes changed by `change(outcomes as JSON)`, consistent as sent (checksum recomputed)."""
    book = json.loads(e.bookkeeping)
    applied = applied_from_json(change(book["applied"]))
    return LogEntry.make(e.version, e.epoch, e.learners, e.delta, book["core"], applied, e.digest)


def bad_outcomes(e: LogEntry) -> LogEntry:
    """Outcomes that are not `[id, worker, round, staleness]` lists, with a payload checksum that checks out."""
    book = json.loads(e.bookkeeping)
    data = json.dumps({"core": book["core"], "applied": [["s", "w", "one", 0]]}).encode()
    crc = zlib.crc32(data, zlib.crc32(e.delta.numpy().tobytes()))
    return dataclasses.replace(e, bookkeeping=data, payload_crc32=crc)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda es: es[1], ResyncReason.GAP),  # skips version 1
        (lambda es: es[-1], ResyncReason.GAP),  # far ahead
        (lambda es: dataclasses.replace(es[0], epoch=EPOCH - 1), ResyncReason.STALE_EPOCH),
        (lambda es: corrupt(es[0]), ResyncReason.CORRUPT),
        (lambda es: wrong_digest(es[0]), ResyncReason.CHECKSUM),
        (lambda es: wrong_delta_right_crc(es[0]), ResyncReason.CHECKSUM),
        (lambda es: dataclasses.replace(es[0], bookkeeping=b"{not json"), ResyncReason.CORRUPT),
        (lambda es: dataclasses.replace(es[0], learners=0), ResyncReason.CORRUPT),
        (lambda es: with_outcomes(es[0], lambda a: [[*x[:2], x[2] + 1, x[3]] for x in a]), ResyncReason.CORRUPT),
        (lambda es: bad_outcomes(es[0]), ResyncReason.CORRUPT),
    ],
    ids=[
        "gap",
        "far-ahead",
        "older-epoch",
        "corrupt-payload",
        "wrong-digest",
        "other-delta",
        "bad-json",
        "no-learners",
        "outcomes-of-another-round",
        "malformed-outcomes",
    ],
)
def test_a_refused_entry_changes_nothing(make: Any, reason: ResyncReason) -> None:
    leader = Leader()
    leader.rounds(3)
    s = Standby(N)
    s.load(leader.first)
    before = frozen(s)
    with pytest.raises(ResyncRequired) as e:
        s.apply(make(leader.entries))
    assert e.value.reason is reason and "resync from a snapshot" in str(e.value)
    assert isinstance(e.value, FailedPrecondition)
    assert_frozen(s, before)
    s.apply(leader.entries[0])  # and it still takes the right entry
    assert_holds(s, leader, 1)


def test_a_repeated_entry_is_a_gap_and_changes_nothing() -> None:
    leader = Leader()
    leader.rounds(2)
    s = Standby(N)
    s.load(leader.first)
    s.apply(leader.entries[0])
    before = frozen(s)
    with pytest.raises(ResyncRequired) as e:
        s.apply(leader.entries[0])
    assert e.value.reason is ResyncReason.GAP
    assert_frozen(s, before)


def test_a_newer_epoch_is_adopted_and_an_older_one_is_then_refused() -> None:
    leader = Leader()
    leader.rounds(2)
    s = Standby(N)
    s.load(leader.first)
    s.apply(dataclasses.replace(leader.entries[0], epoch=EPOCH + 5))
    assert s.epoch == EPOCH + 5
    before = frozen(s)
    with pytest.raises(ResyncRequired) as e:
        s.apply(leader.entries[1])
    assert e.value.reason is ResyncReason.STALE_EPOCH
    assert_frozen(s, before)
    with pytest.raises(ResyncRequired):  # a snapshot of the old leadership too
        s.load(leader.snapshot())
    assert_frozen(s, before)


@pytest.mark.parametrize("what", ["params", "digest", "version", "outer-name", "older-epoch"])
def test_a_refused_snapshot_changes_nothing(what: str) -> None:
    leader = Leader()
    leader.rounds(2)
    s = Standby(N)
    s.load(dataclasses.replace(leader.first, epoch=EPOCH + 1))
    s.apply(dataclasses.replace(leader.entries[0], epoch=EPOCH + 1))
    before = frozen(s)
    snap = dataclasses.replace(leader.snapshot(), epoch=EPOCH + 1)
    if what == "params":
        p = snap.params.clone()
        p[0] = 5.0
        bad = dataclasses.replace(snap, params=p)
    elif what == "digest":
        bad = dataclasses.replace(snap, digest=Digest(snap.digest.params_crc32, snap.digest.outer_crc32 + 1))
    elif what == "version":
        bad = dataclasses.replace(snap, version=99)  # the header says 99, the bookkeeping 2
    elif what == "outer-name":
        bad = _outer_renamed(snap)
    else:
        bad = dataclasses.replace(snap, epoch=EPOCH)
    with pytest.raises(ResyncRequired):
        s.load(bad)
    assert_frozen(s, before)
    s.load(snap)
    assert_holds(s, leader, 2)


def _outer_renamed(snap: Snapshot) -> Snapshot:
    book = json.loads(snap.bookkeeping)
    book["outer"]["name"] = "adam"
    raw = json.dumps(book).encode()
    crc = 0
    for part in snap.payload()[:-1]:
        crc = zlib.crc32(part, crc)
    crc = zlib.crc32(raw, crc)
    return dataclasses.replace(snap, bookkeeping=raw, payload_crc32=crc)


def test_the_receiver_refuses_what_is_out_of_order_or_oversized() -> None:
    leader = Leader()
    leader.rounds(1)
    entry = leader.entries[0]
    rx = Receiver(N)
    with pytest.raises(ResyncRequired, match="without a header"):
        rx.feed(b"x")
    with pytest.raises(ResyncRequired, match="parameters"):
        rx.start(dataclasses.replace(entry.meta, numel=N + 1))
    with pytest.raises(ResyncRequired, match="bookkeeping"):
        rx.start(dataclasses.replace(entry.meta, bookkeeping_bytes=1 << 40))
    rx.start(entry.meta)
    with pytest.raises(ResyncRequired, match="before the previous payload"):
        rx.start(entry.meta)
    assert not rx.busy
    rx.start(entry.meta)
    with pytest.raises(ResyncRequired, match="more payload bytes"):
        rx.feed(b"\0" * (entry.meta.payload_bytes + 1))
    meta = dataclasses.replace(entry.meta, payload_crc32=entry.payload_crc32 ^ 1)
    rx.start(meta)
    with pytest.raises(ResyncRequired, match="checksum"):
        for part in entry.payload():
            rx.feed(part)
    assert isinstance(entry.meta, EntryMeta)


# --- the leader's window ----------------------------------------------------------------------------------------


def test_the_log_says_entries_or_snapshot() -> None:
    leader = Leader()
    log = leader.log  # keeps 3 entries
    first = leader.first.digest
    assert log.since(0, first) == [] and log.since(None, None) is None
    leader.rounds(2)
    assert [e.version for e in log.since(0, first) or []] == [1, 2]
    assert [e.version for e in log.since(1, leader.entries[0].digest) or []] == [2]
    assert log.since(2, leader.entries[1].digest) == []
    assert log.since(1, Digest(0, 0)) is None  # other bits at version 1
    assert log.since(3, leader.entries[1].digest) is None  # ahead of the leader
    leader.rounds(3)  # versions 3..5 kept; version 2 is the floor
    assert log.oldest == 2 and log.newest == 5
    assert log.since(0, first) is None and log.since(1, leader.entries[0].digest) is None
    assert [e.version for e in log.since(2, leader.entries[1].digest) or []] == [3, 4, 5]
    with pytest.raises(FailedPrecondition):
        log.append(leader.entries[-1])


def test_the_log_keeps_the_newest_entries_that_fit_its_byte_cap_and_always_the_newest() -> None:
    leader = Leader()
    leader.rounds(8)
    sizes = [e.payload_bytes for e in leader.entries]
    assert all(s == 4 * N + len(e.bookkeeping) for s, e in zip(sizes, leader.entries, strict=True))
    for cap in (1, min(sizes), 2 * max(sizes), 3 * max(sizes) + 7, sum(sizes)):
        log = RoundLog(0, leader.first.digest, max_entries=100, max_bytes=cap)
        for n, e in enumerate(leader.entries, start=1):
            log.append(e)
            kept = log.since(log.oldest, log.digest_of(log.oldest))
            assert (
                kept is not None and kept[-1] is e and [k.version for k in kept] == list(range(log.oldest + 1, n + 1))
            )
            assert log.bytes == sum(k.payload_bytes for k in kept) == log.usage().bytes
            assert log.bytes <= cap or len(kept) == 1  # only the newest may be larger than the cap
            if log.oldest > 0:  # the entry dropped last did not fit beside the kept ones
                assert log.bytes + sizes[log.oldest - 1] > cap
        assert log.usage().entries == len(kept) and log.newest == 8
    tiny = RoundLog(0, leader.first.digest, max_entries=100, max_bytes=1)
    for e in leader.entries:
        tiny.append(e)
    assert tiny.oldest == 7 and tiny.bytes == sizes[-1]
    # the version just before the newest is still acknowledgeable and caught up from the newest entry
    assert [e.version for e in tiny.since(7, leader.entries[6].digest) or []] == [8]
    assert tiny.digest_of(8) == leader.entries[-1].digest and tiny.since(6, leader.entries[5].digest) is None
    # the entry count still caps it too
    both = RoundLog(0, leader.first.digest, max_entries=2, max_bytes=sum(sizes))
    for e in leader.entries:
        both.append(e)
    assert both.usage().entries == 2
    with pytest.raises(ConfigError, match="bytes must be >= 1"):
        RoundLog(0, leader.first.digest, max_entries=2, max_bytes=0)


def test_a_standby_behind_the_byte_capped_window_gets_a_snapshot_then_tails_bit_for_bit() -> None:
    leader = Leader()
    leader.log = RoundLog(0, leader.first.digest, max_entries=16, max_bytes=1)  # the newest entry only
    s = Standby(N)
    s.load(leader.first)
    leader.rounds(3)
    assert leader.log.since(s.version, s.digest) is None  # versions 1 and 2 were dropped: a snapshot
    s.load(leader.snapshot())
    assert_holds(s, leader, 3)
    for _ in range(4):  # tailing one round behind, it always finds the entry it needs, and acknowledges the newest
        leader.rounds(1)
        entries = leader.log.since(s.version, s.digest)
        assert entries is not None and [e.version for e in entries] == [leader.core.version]
        s.apply(entries[0])
        assert_holds(s, leader, leader.core.version)
        assert leader.log.digest_of(s.version) == s.digest


@pytest.mark.parametrize(
    ("mode", "outer"), [("decoupled", "nesterov"), ("decoupled", "fedavg"), ("async", "delayed_nesterov")]
)
def test_the_default_byte_cap_is_a_snapshots_tensors_and_keeps_what_is_cheaper_than_one(mode: str, outer: str) -> None:
    leader = Leader(mode, outer)
    leader.rounds(6)
    snap = leader.snapshot()
    cap = snapshot_tensor_bytes(N, leader.core.outer)
    assert cap == snap.meta.payload_bytes - len(snap.bookkeeping)  # Θ and the outer optimizer's tensors
    assert tuple(n for n, _ in snap.outer_tensors) == tuple(sorted(leader.core.outer.state_tensors))
    log = RoundLog(0, leader.first.digest, max_entries=100, max_bytes=cap)
    for e in leader.entries:
        log.append(e)
    # a standby behind the window would need more entry bytes than the snapshot's tensors: it gets the snapshot
    behind = sum(e.payload_bytes for e in leader.entries[log.oldest - 1 :])
    assert log.oldest > 0 and behind > cap and (log.bytes <= cap or log.usage().entries == 1)  # FedAvg: Δ alone
    assert log.usage().entries == {"nesterov": 1, "fedavg": 1, "delayed_nesterov": 2}[outer]


# --- the publish gate -------------------------------------------------------------------------------------------


def test_the_gate_publishes_after_enough_acks() -> None:
    g = SyncGate(required=1, timeout_s=2.0)
    g.follow("a")
    g.appended(1)
    d = g.decide(1, since=10.0, now=10.0)
    assert d.gate is Gate.WAIT and d.deadline == 12.0 and d.missing == ("a",)
    g.ack("a", 1)
    assert g.decide(1, since=10.0, now=10.5).gate is Gate.PUBLISH
    assert SyncGate(0, 1.0).decide(5, 0.0, 0.0).gate is Gate.PUBLISH


def test_the_gate_degrades_at_once_without_enough_followers() -> None:
    g = SyncGate(required=2, timeout_s=2.0)
    g.follow("a")
    g.appended(1)
    d = g.decide(1, since=0.0, now=0.0)
    assert d.gate is Gate.DEGRADED and d.missing == ("a",)
    g.ack("x", 1)  # not following: ignored
    assert g.acked("x") == -1


def test_a_standby_that_misses_the_deadline_is_not_waited_for_until_it_catches_up() -> None:
    g = SyncGate(required=1, timeout_s=2.0)
    g.follow("a")
    g.appended(1)
    assert g.decide(1, since=0.0, now=1.9).gate is Gate.WAIT
    d = g.decide(1, since=0.0, now=2.0)
    assert d.gate is Gate.DEGRADED and d.missing == ("a",)
    g.appended(2)
    assert g.decide(2, since=3.0, now=3.0).gate is Gate.DEGRADED  # lagging: no wait at all
    g.ack("a", 1)
    assert g.decide(2, since=3.0, now=3.0).gate is Gate.DEGRADED  # still behind what it must reach
    g.ack("a", 2)
    g.appended(3)
    assert g.decide(3, since=4.0, now=4.0).gate is Gate.WAIT  # caught up: waited for again
    g.unfollow("a")
    assert g.decide(3, since=4.0, now=4.0).gate is Gate.DEGRADED


def test_waiting_for_a_standby_the_gate_holds_where_it_would_degrade_until_one_acknowledges() -> None:
    """--when-no-standby wait: no follower, or the timeout passed, is HOLD with no deadline (never DEGRADED), and
    the version goes out once enough standbys hold it, one that joined meanwhile included."""
    g = SyncGate(required=1, timeout_s=2.0, when_no_standby=WhenNoStandby.WAIT)
    g.appended(1)
    d = g.decide(1, since=0.0, now=0.0)
    assert d.gate is Gate.HOLD and d.deadline == math.inf and d.missing == ()
    g.follow("a")
    assert g.decide(1, since=0.0, now=1.0).gate is Gate.WAIT  # within the timeout: the usual bounded wait
    d = g.decide(1, since=0.0, now=100.0)
    assert d.gate is Gate.HOLD and d.missing == ("a",) and g.replicas()[0].lagging
    g.ack("a", 1)
    assert g.decide(1, since=0.0, now=100.0).gate is Gate.PUBLISH
    g.unfollow("a")
    g.appended(2)
    assert g.decide(2, since=200.0, now=10_000.0).gate is Gate.HOLD
    assert WHEN_NO_STANDBY == ("publish", "wait") and SyncGate(1, 1.0).when_no_standby is WhenNoStandby.PUBLISH


# --- the spare a standby steps on ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "outer"), [("decoupled", "nesterov"), ("sync", "fedavg"), ("async", "delayed_nesterov")]
)
def test_a_standby_stepping_its_prepared_spare_holds_the_leaders_bits_and_a_refusal_still_changes_nothing(
    mode: str, outer: str
) -> None:
    """As the follower runs it: Δ off the wire used as scratch, the spare prepared after every version. A refused
    entry whose step already ran on the spare leaves the held state as it was, and the right entry is then taken
    (the spare is copied again, not reused dirty)."""
    leader = Leader(mode, outer)
    s = Standby(N)
    s.load(leader.first)
    s.prepare()
    leader.rounds(6)
    for e in leader.entries:
        before = frozen(s)
        with pytest.raises(ResyncRequired) as refused:
            s.apply(wrong_delta_right_crc(e), scratch_delta=True)
        assert refused.value.reason is ResyncReason.CHECKSUM
        assert_frozen(s, before)
        wire = dataclasses.replace(e, delta=e.delta.clone())
        s.apply(wire, scratch_delta=True)
        assert_holds(s, leader, e.version)
        held = frozen(s)
        s.prepare()  # writes the spare only
        assert_frozen(s, held)


def test_prepare_is_a_no_op_while_nothing_is_held() -> None:
    s = Standby(N)
    s.prepare()
    assert s.version is None


def test_a_reusing_receiver_takes_each_payload_into_the_last_ones_memory_and_gets_every_byte_right() -> None:
    leader = Leader()
    leader.rounds(4)
    rx = Receiver(N, reuse=True)
    s = Standby(N)

    def receive(item: LogEntry | Snapshot) -> Any:
        got: Any = rx.start(item.meta)
        for part in item.payload():
            for i in range(0, len(part), 1000):
                got = rx.feed(part[i : i + 1000])
        return got

    s.load(receive(leader.snapshot()))  # a snapshot's memory is too large to keep for entries
    leader.rounds(3)
    pointers = []
    for e in leader.entries[-3:]:
        got = receive(e)
        assert isinstance(got, LogEntry) and same_bits(got.delta, e.delta) and got.bookkeeping == e.bookkeeping
        pointers.append(got.delta.data_ptr())
        s.apply(got, scratch_delta=True)
        assert_holds(s, leader, e.version)
    assert pointers[1] == pointers[2]  # the memory of the one before
    rx.start(leader.entries[-1].meta)
    rx.reset()  # a stream cut mid-payload: the next message starts afresh
    assert not rx.busy


# --- streaming fragments ------------------------------------------------------------------------------------------

LAYOUT = FragmentLayout.balanced([1500, 1300, 1299], 2)  # N values in 3 tensors: fragments [0, 1500), [1500, N)


class FragmentLeader:
    """A `FragmentedCoordinator` driven through rounds, with the entries the service's replication log makes: the
    Δ[p] of each fragment stepped, in order, and the digest over the fragments' outer optimizers."""

    def __init__(self, mode: str = "decoupled", outer: str = "nesterov", workers: int = 2) -> None:
        cfg = CoordinatorConfig(
            rounds=RoundConfig(mode=mode, min_quorum=1, grace_max_s=0.5),
            outer=OuterConfig(outer, 0.7, 0.9),
            local_steps=10,
            min_local_steps=2,
            expected_workers=workers,
        )
        params = torch.randn(N, generator=torch.Generator().manual_seed(1))
        self.frag = FragmentedCoordinator(cfg, params, [100_000] * 4, LAYOUT)
        self.workers = [self.frag.core.register(f"w{i}", 0.0).worker_id for i in range(workers)]
        self.gen = torch.Generator().manual_seed(2)
        self.now = 1.0
        self.entries: list[LogEntry] = []
        self.parts: list[tuple[int, torch.Tensor]] = []
        self.frag.on_step = lambda v, p, d, n: self.parts.append((p, d.clone()))
        self.first = self.snapshot()

    def snapshot(self) -> Snapshot:
        return Snapshot.of_core(self.frag.snapshot(), EPOCH)

    def digest(self) -> Digest:
        return state_digest(self.frag.core.params, self.frag.core.outer, self.frag.outers)

    def submit(self, worker: int, sid: str, p: int) -> None:
        c, w = self.frag.core, self.workers[worker]
        lease = c.plan(w).shards[0]
        rng = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + 16)
        sub = Submission(w, sid, c.version, 16, 1, (rng,), c.plan(w).plan_seq)
        delta = torch.randn(LAYOUT.size(p), generator=self.gen) * 1e-2
        self.now += 0.1
        self.parts.clear()
        applied = self.frag.accept(FragmentSubmission(sub, p, LAYOUT.fingerprint), delta, self.now).applied
        if applied is not None:
            self._entry(applied.version, [s.submission_id for s in applied.submissions])

    def poll(self) -> None:
        self.now += 1.0
        self.parts.clear()
        applied = self.frag.poll(self.now)
        if applied is not None:
            self._entry(applied.version, [s.submission_id for s in applied.submissions])

    def _entry(self, version: int, ids: list[str]) -> None:
        c = self.frag.core
        fragments = [p for p, _ in self.parts]
        delta = torch.cat([d for _, d in self.parts])
        outcomes = {sid: c.applied[sid] for sid in ids}
        learners = len(c.live_ids())
        e = LogEntry.make(version, EPOCH, learners, delta, self.frag.snapshot(), outcomes, self.digest(), fragments)
        self.entries.append(e)

    def rounds(self) -> None:
        """Rounds stepping fragment 1 alone, then both fragments in one round (two learners on different ones), then
        fragment 0 alone (closed on quorum and grace: a partial, scaled step), then fragment 1 again."""
        v = self.frag.core.version
        self.submit(0, f"a{v}", 1)
        self.submit(1, f"b{v}", 1)  # sync/decoupled: both submitted fragment 1: the round closes
        self.submit(0, f"c{v}", 0)
        self.submit(1, f"d{v}", 1)  # fragments 0 and 1 in one round
        self.submit(0, f"e{v}", 0)
        self.poll()  # fragment 0 alone, without w1
        self.submit(0, f"f{v}", 1)
        self.submit(1, f"g{v}", 0)


def fragment_state(frag_snapshot: dict[str, Any]) -> tuple[Any, ...]:
    """What a standby must hold of a `FragmentedCoordinator.snapshot()`: Θ's bits, each fragment's outer state
    (tensors as bits), versions, step counts and guard norms, the ledger and tokens applied."""
    f = frag_snapshot["fragments"]
    outers = [{k: bits(v).tolist() if isinstance(v, torch.Tensor) else v for k, v in o.items()} for o in f["outer"]]
    return (
        bits(frag_snapshot["params"]).tolist(),
        outers,
        list(f["versions"]),
        list(f["steps"]),
        [list(g) for g in f["guard_norms"]],
        list(f["bounds"]),
        f["fingerprint"],
        json.dumps(frag_snapshot["ledger"], sort_keys=True),  # as JSON: the standby's came through JSON
        frag_snapshot["tokens_applied"],
    )


@pytest.mark.parametrize(
    ("mode", "outer"), [("decoupled", "nesterov"), ("sync", "nesterov"), ("async", "delayed_nesterov")]
)
def test_a_standby_replaying_fragment_rounds_holds_the_leaders_fragmented_state(mode: str, outer: str) -> None:
    leader = FragmentLeader(mode, outer)
    s = Standby(N, LAYOUT)
    s.load(leader.first)
    leader.rounds()
    stepped = [e.fragments for e in leader.entries]
    assert len(stepped) >= 3 and all(stepped) and {0, 1} <= {p for f in stepped for p in f}
    if mode != "async":
        assert (0, 1) in stepped  # a round stepping both, Δ[0] then Δ[1]
    rx = Receiver(N, layout=LAYOUT)
    for e in leader.entries:
        assert e.delta.numel() == sum(LAYOUT.size(p) for p in e.fragments) < N or e.fragments == (0, 1)
        got: Any = rx.start(e.meta)  # over the wire's reassembly too
        for part in e.payload():
            got = rx.feed(bytes(part))
        assert isinstance(got, LogEntry) and got.fragments == e.fragments
        s.apply(got, scratch_delta=True)
        assert s.digest == e.digest
        s.prepare()
    assert s.version == leader.frag.core.version and s.digest == leader.digest()
    assert fragment_state(s.core_snapshot()) == fragment_state(leader.frag.snapshot())
    # a coordinator resumed from the standby (a promotion) is the leader, fragments and all
    again = FragmentedCoordinator(leader.frag.core.cfg, torch.zeros(N), [100_000] * 4, LAYOUT)
    again.restore(s.core_snapshot(), learners_at=leader.now)  # keeps the learner table, so their shards
    assert fragment_state(again.snapshot()) == fragment_state(leader.frag.snapshot())
    # a standby new now gets a snapshot of the fragmented state (one fragment's momentum laid beside the other's)
    late = Standby(N, LAYOUT)
    late.load(leader.snapshot())
    assert late.digest == leader.digest()
    assert fragment_state(late.core_snapshot()) == fragment_state(leader.frag.snapshot())


def test_a_snapshot_where_one_fragment_was_never_stepped_holds_no_momentum_for_it() -> None:
    leader = FragmentLeader()
    leader.submit(0, "a", 1)
    leader.submit(1, "b", 1)
    assert [e.fragments for e in leader.entries] == [(1,)]
    snap = leader.snapshot()
    assert [name for name, _ in snap.outer_tensors] == ["fragments.buf"]
    s = Standby(N, LAYOUT)
    s.load(snap)
    assert [o.state_dict()["buf"] is None for o in s.fragment_outers] == [True, False]
    assert s.digest == leader.digest()


def _refragment(e: LogEntry, fragments: tuple[int, ...], delta: torch.Tensor | None = None) -> LogEntry:
    """`e` naming other fragments (and Δ), consistent as sent (its payload checksum recomputed)."""
    d = e.delta if delta is None else delta
    crc = zlib.crc32(e.bookkeeping, zlib.crc32(d.numpy().tobytes()))
    return dataclasses.replace(e, fragments=fragments, delta=d, payload_crc32=crc)


def _rebook(e: LogEntry, change: Any) -> LogEntry:
    book = json.loads(e.bookkeeping)
    change(book["core"])
    applied = applied_from_json(book["applied"])
    return LogEntry.make(e.version, e.epoch, e.learners, e.delta, book["core"], applied, e.digest, e.fragments)


@pytest.mark.parametrize(
    "make",
    [
        lambda e: _refragment(e, (2,)),  # out of range
        lambda e: _refragment(e, ()),  # names none
        lambda e: _refragment(e, (1, 1), torch.cat([e.delta, e.delta])),  # twice
        lambda e: _refragment(e, (0,), torch.zeros(LAYOUT.size(0))),  # not the fragment the bookkeeping says
        lambda e: _refragment(e, (1,), e.delta[:-1].clone()),  # Δ shorter than the fragment
        lambda e: _rebook(e, lambda c: c["fragments"].update(steps=[0, 2])),  # fragment 1 stepped twice
        lambda e: _rebook(e, lambda c: c["fragments"].update(bounds=[0, 1300, N])),  # another layout
        lambda e: _rebook(e, lambda c: c.pop("fragments")),  # bookkeeping without fragments
    ],
    ids=["index-out-of-range", "none", "repeated", "other-fragment", "short-delta", "steps", "layout", "no-book"],
)
def test_a_refused_fragment_entry_changes_nothing(make: Any) -> None:
    leader = FragmentLeader()
    leader.rounds()
    s = Standby(N, LAYOUT)
    s.load(leader.first)
    before = frozen(s)
    frag_before = fragment_state(s.core_snapshot())
    entry = leader.entries[0]
    assert entry.fragments == (1,)
    with pytest.raises(ResyncRequired) as e:
        s.apply(make(entry))
    assert e.value.reason is ResyncReason.CORRUPT
    assert_frozen(s, before)
    assert fragment_state(s.core_snapshot()) == frag_before
    s.apply(entry)  # and it still takes the right entry
    assert s.digest == entry.digest


def test_fragments_and_no_fragments_do_not_mix() -> None:
    leader, plain = FragmentLeader(), Leader()
    leader.rounds()
    plain.rounds(1)
    with pytest.raises(ResyncRequired, match="without"):
        Standby(N).load(leader.first)  # a standby without fragments, a leader with
    with pytest.raises(ResyncRequired, match="holds no fragments"):
        Standby(N, LAYOUT).load(plain.first)
    with pytest.raises(ResyncRequired, match="without fragments"):
        Receiver(N).start(leader.entries[0].meta)
    with pytest.raises(ResyncRequired, match="names no fragment"):
        Receiver(N, layout=LAYOUT).start(plain.entries[0].meta)
    with pytest.raises(ResyncRequired, match="out of range"):
        Receiver(N, layout=LAYOUT).start(dataclasses.replace(leader.entries[0].meta, fragments=(5,)))
    with pytest.raises(ResyncRequired, match="parameters"):  # Δ of fragment 0's size, naming fragment 1
        Receiver(N, layout=LAYOUT).start(dataclasses.replace(leader.entries[0].meta, numel=LAYOUT.size(0)))


def test_the_default_byte_cap_with_fragments_counts_the_fragments_laid_tensors() -> None:
    leader = FragmentLeader("async", "delayed_nesterov")
    leader.rounds()
    snap = leader.snapshot()
    assert len(snap.outer_tensors) == 2  # fragments.buf, fragments.m: the core's own optimizer never stepped
    assert snapshot_tensor_bytes(N, leader.frag.core.outer) == snap.meta.payload_bytes - len(snap.bookkeeping)
