"""Shard ledger: exactly-once data accounting with ownership epochs (ALGORITHM.md section 7).

Two phases, because a pseudo-gradient is accepted before the round containing it is applied, and a checkpoint
must match the applied parameters:

* `accept` checks a submission's ranges against the owner, epoch and *accepted* cursor of every shard
  and moves the accepted cursors; it returns an `AcceptReceipt`.
* `commit` is called when the round containing that submission is applied; it moves the *committed*
  cursors and records the committed ranges. Receipts touching a shard are committed in acceptance order.

`rollback_uncommitted` (after a restart from a checkpoint, where pending submissions are lost) undoes
acceptance. Every mutating call validates everything first, so a failure leaves the ledger exactly as it was.

Epochs are fencing tokens within one coordinator incarnation; across a restart from an older checkpoint the
coordinator epoch (checked by the RPC layer) fences submissions made against the lost state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco.errors import FailedPrecondition, InvalidArgument, NotFound

SNAPSHOT_FORMAT = 1


@dataclass(frozen=True)
class ShardRange:
    """Tokens `[start, end)` of shard `shard_id`, read by the owner at ownership `epoch`.

    Cursors are absolute token offsets that only grow; wrap-around is the reader's business.
    """

    shard_id: int
    epoch: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardState:
    """A read-only view of one shard.

    `accepted` is where the owner resumes reading (the end of the last accepted range); `committed` is the
    end of the last range applied to the global parameters; `committed_ranges` tile `[0, committed)`, with
    adjacent ranges of the same epoch merged.
    """

    shard_id: int
    owner: str | None
    epoch: int
    accepted: int
    committed: int
    length: int
    committed_ranges: tuple[ShardRange, ...]

    @property
    def cursor(self) -> int:
        """Where the owner resumes reading: the accepted cursor."""
        return self.accepted

    @property
    def pending_tokens(self) -> int:
        return self.accepted - self.committed


@dataclass(frozen=True)
class AcceptReceipt:
    """Proof that a submission's ranges were accepted; pass it to `commit`."""

    receipt_id: int
    worker_id: str
    ranges: tuple[ShardRange, ...]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.ranges)

    @property
    def shard_ids(self) -> tuple[int, ...]:
        return tuple(r.shard_id for r in self.ranges)


@dataclass
class _Shard:
    length: int
    owner: str | None = None
    epoch: int = 1
    accepted: int = 0
    committed: int = 0
    committed_ranges: list[ShardRange] = field(default_factory=list)
    queue: deque[int] = field(default_factory=deque)  # pending receipt ids, in acceptance order


def _check_worker_id(worker_id: object) -> str:
    if not isinstance(worker_id, str) or not worker_id:
        raise InvalidArgument(f"worker id must be a non-empty string, got {worker_id!r}")
    return worker_id


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ShardLedger:
    """Owner, epoch, accepted and committed cursor of every shard, plus the pending (accepted) receipts.

    `max_range_tokens` caps the tokens one submission may claim from one shard; by default a shard's length
    (one full pass over it).
    """

    def __init__(self, num_shards: int, shard_lengths: Sequence[int], *, max_range_tokens: int | None = None) -> None:
        if not _is_int(num_shards) or num_shards < 1:
            raise InvalidArgument(f"num_shards must be a positive integer, got {num_shards!r}")
        lengths = list(shard_lengths)
        if len(lengths) != num_shards:
            raise InvalidArgument(
                f"shard_lengths has {len(lengths)} entries but num_shards is {num_shards}; give one per shard"
            )
        for i, n in enumerate(lengths):
            if not _is_int(n) or n < 1:
                raise InvalidArgument(f"shard {i} length must be a positive integer, got {n!r}")
        if max_range_tokens is not None and (not _is_int(max_range_tokens) or max_range_tokens < 1):
            raise InvalidArgument(f"max_range_tokens must be a positive integer or None, got {max_range_tokens!r}")
        self._shards = [_Shard(length=n) for n in lengths]
        self._owned: dict[str, set[int]] = {}  # owner -> its shard ids: the index behind `owned_by` and `owners`
        self._max_range_tokens = max_range_tokens
        self._pending: dict[int, AcceptReceipt] = {}
        self._next_receipt_id = 1

    # ------------------------------------------------------------------ queries

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def state(self, shard_id: int) -> ShardState:
        """The state of one shard; NotFound for an unknown shard."""
        return self._view(shard_id, self._get(shard_id))

    def states(self) -> list[ShardState]:
        """Every shard, by id."""
        return [self._view(i, s) for i, s in enumerate(self._shards)]

    def owned_by(self, worker_id: str) -> list[ShardState]:
        """The shards `worker_id` owns now, by id (empty for a worker that owns none). O(its shards)."""
        return [self._view(i, self._shards[i]) for i in sorted(self._owned.get(worker_id, ()))]

    def shard_ids_of(self, worker_id: str) -> frozenset[int]:
        """The ids of the shards `worker_id` owns now (empty when none)."""
        return frozenset(self._owned.get(worker_id, ()))

    def owners(self) -> dict[str, frozenset[int]]:
        """Every owner and the ids of the shards it owns (no unowned shard, no owner without a shard)."""
        return {w: frozenset(ids) for w, ids in self._owned.items()}

    def owner_of(self) -> list[str | None]:
        """Every shard's owner (None: unowned), by id; cheaper than `states()` when only owners matter."""
        return [s.owner for s in self._shards]

    def _set_owner(self, shard_id: int, owner: str | None) -> None:
        """The one place a shard's owner changes (keeps `_owned` in step)."""
        shard = self._shards[shard_id]
        if shard.owner is not None:
            ids = self._owned[shard.owner]
            ids.discard(shard_id)
            if not ids:
                del self._owned[shard.owner]
        shard.owner = owner
        if owner is not None:
            self._owned.setdefault(owner, set()).add(shard_id)

    def committed_tokens(self) -> int:
        """Tokens applied to the global parameters, over all shards."""
        return sum(s.committed for s in self._shards)

    # ------------------------------------------------------------------ ownership

    def assign(self, shard_id: int, worker_id: str) -> ShardState:
        """Give `shard_id` to `worker_id` under a new epoch; the new owner resumes at the accepted cursor.

        Assigning a shard to its current owner changes nothing.
        """
        shard = self._get(shard_id)
        worker_id = _check_worker_id(worker_id)
        if shard.owner != worker_id:
            self._set_owner(shard_id, worker_id)
            shard.epoch += 1
        return self._view(shard_id, shard)

    def release(self, worker_id: str) -> list[int]:
        """Remove `worker_id` as owner (dead, left or evicted): its shards become unowned under a new epoch.

        Its accepted-but-uncommitted submissions stay accepted (they are pending and will be applied).
        Returns the released shard ids.
        """
        released = sorted(self._owned.get(worker_id, ()))
        for i in released:
            self._set_owner(i, None)
            self._shards[i].epoch += 1
        return released

    # ------------------------------------------------------------------ phase 1: accept

    def check(self, worker_id: str, ranges: Iterable[ShardRange]) -> tuple[ShardRange, ...]:
        """Validate a submission's ranges exactly as `accept` would, without changing anything.

        Raises InvalidArgument for malformed ranges, NotFound for an unknown shard and FailedPrecondition for a
        stale owner, epoch or cursor. Returns the ranges as a tuple.
        """
        worker_id = _check_worker_id(worker_id)
        checked = tuple(ranges)
        seen: set[int] = set()
        for r in checked:  # shape first, so a malformed request is reported as such
            if not isinstance(r, ShardRange):
                raise InvalidArgument(f"expected ShardRange, got {type(r).__name__}")
            shard = self._get(r.shard_id)
            if r.shard_id in seen:
                raise InvalidArgument(
                    f"shard {r.shard_id} appears twice in one submission; send one range [start, end) per shard"
                )
            seen.add(r.shard_id)
            self._check_range_shape(r, shard)
        for r in checked:
            shard = self._shards[r.shard_id]
            self._check_fresh(worker_id, r, shard)
        return checked

    def accept(self, worker_id: str, ranges: Iterable[ShardRange]) -> AcceptReceipt:
        """Accept a submission's ranges, all or nothing (see `check` for what is refused).

        Every range must name a shard owned by `worker_id` at its current epoch and start at the shard's
        accepted cursor; then the accepted cursor moves to the range's end.
        """
        worker_id = _check_worker_id(worker_id)
        checked = self.check(worker_id, ranges)
        receipt = AcceptReceipt(receipt_id=self._next_receipt_id, worker_id=worker_id, ranges=checked)
        self._next_receipt_id += 1
        for r in checked:
            shard = self._shards[r.shard_id]
            shard.accepted = r.end
            shard.queue.append(receipt.receipt_id)
        self._pending[receipt.receipt_id] = receipt
        return receipt

    def _check_range_shape(self, r: ShardRange, shard: _Shard) -> None:
        sid = r.shard_id
        if not (_is_int(r.epoch) and _is_int(r.start) and _is_int(r.end)):
            raise InvalidArgument(f"shard {sid} range needs integer epoch, start and end, got {r!r}")
        if r.epoch < 1:
            raise InvalidArgument(f"shard {sid} range has epoch {r.epoch}; epochs start at 1")
        if r.start < 0:
            raise InvalidArgument(f"shard {sid} range starts at {r.start}; cursors are non-negative")
        if r.end <= r.start:
            raise InvalidArgument(
                f"shard {sid} range [{r.start}, {r.end}) is empty or reversed; send end > start, "
                "or leave out shards you did not read"
            )
        limit = self._max_range_tokens if self._max_range_tokens is not None else shard.length
        if r.end - r.start > limit:
            raise InvalidArgument(
                f"shard {sid} range [{r.start}, {r.end}) covers {r.end - r.start} tokens, more than the "
                f"{limit} allowed per submission; submit more often (fewer local steps)"
            )

    @staticmethod
    def _check_fresh(worker_id: str, r: ShardRange, shard: _Shard) -> None:
        sid = r.shard_id
        if shard.owner is None:
            raise FailedPrecondition(
                f"shard {sid} has no owner at epoch {shard.epoch}, so {worker_id!r} no longer owns it; "
                "fetch your work plan and stop reading this shard"
            )
        if shard.owner != worker_id:
            raise FailedPrecondition(
                f"shard {sid} is owned by {shard.owner!r} at epoch {shard.epoch}, not by {worker_id!r}; "
                "fetch your work plan and stop reading this shard"
            )
        if r.epoch != shard.epoch:
            raise FailedPrecondition(
                f"shard {sid} moved to epoch {shard.epoch} (you sent epoch {r.epoch}); "
                f"fetch your work plan and resume from cursor {shard.accepted}"
            )
        if r.start != shard.accepted:
            raise FailedPrecondition(
                f"shard {sid} range starts at {r.start} but the accepted cursor is {shard.accepted}; "
                f"fetch your work plan and resume from cursor {shard.accepted}"
            )

    # ------------------------------------------------------------------ phase 2: commit / undo

    def commit(self, receipt: AcceptReceipt) -> None:
        """Record `receipt`'s ranges as applied to the global parameters (its round was applied).

        Receipts touching a shard must be committed in acceptance order; FailedPrecondition otherwise, or when
        the receipt is not pending (already committed or rolled back).
        """
        self._check_pending(receipt)
        for r in receipt.ranges:
            head = self._shards[r.shard_id].queue[0]
            if head != receipt.receipt_id:
                raise FailedPrecondition(
                    f"receipt {receipt.receipt_id} cannot be committed before receipt {head} on shard "
                    f"{r.shard_id}; commit receipts in acceptance order"
                )
        for r in receipt.ranges:
            shard = self._shards[r.shard_id]
            shard.queue.popleft()
            shard.committed = r.end
            last = shard.committed_ranges[-1] if shard.committed_ranges else None
            if last is not None and last.epoch == r.epoch and last.end == r.start:
                shard.committed_ranges[-1] = ShardRange(r.shard_id, r.epoch, last.start, r.end)
            else:
                shard.committed_ranges.append(r)
        del self._pending[receipt.receipt_id]

    def rollback_uncommitted(self) -> None:
        """After a restart from a checkpoint: pending submissions are lost, so every accepted cursor falls
        back to the committed one, and the epoch of every shard that had any bumps (owners are kept; they must
        fetch a new work plan). A shard with nothing pending keeps its epoch: its owner's lease (epoch, cursor) is
        exactly as valid as before, so a learner a promoted standby still knows goes on training it."""
        for shard in self._shards:
            if shard.accepted != shard.committed or shard.queue:
                shard.epoch += 1
            shard.accepted = shard.committed
            shard.queue.clear()
        self._pending.clear()

    def _check_pending(self, receipt: AcceptReceipt) -> None:
        if not isinstance(receipt, AcceptReceipt):
            raise InvalidArgument(f"expected AcceptReceipt, got {type(receipt).__name__}")
        if self._pending.get(receipt.receipt_id) != receipt:
            raise FailedPrecondition(
                f"receipt {receipt.receipt_id} is not pending (already committed or rolled back by a restart); "
                "commit only receipts returned by accept since the last restart"
            )

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self) -> dict[str, Any]:
        """A JSON-safe copy of the whole ledger (pending receipts included) for checkpoints."""
        return {
            "format": SNAPSHOT_FORMAT,
            "max_range_tokens": self._max_range_tokens,
            "next_receipt_id": self._next_receipt_id,
            "shards": [
                {
                    "shard_id": i,
                    "length": s.length,
                    "owner": s.owner,
                    "epoch": s.epoch,
                    "accepted": s.accepted,
                    "committed": s.committed,
                    "committed_ranges": [[r.epoch, r.start, r.end] for r in s.committed_ranges],
                }
                for i, s in enumerate(self._shards)
            ],
            "pending": [
                {
                    "receipt_id": p.receipt_id,
                    "worker_id": p.worker_id,
                    "ranges": [[r.shard_id, r.epoch, r.start, r.end] for r in p.ranges],
                }
                for p in self._pending.values()
            ],
        }

    @classmethod
    def restore(cls, snapshot: Mapping[str, Any]) -> ShardLedger:
        """Rebuild a ledger from `snapshot()`; InvalidArgument when it is corrupt or inconsistent."""
        try:
            return cls._restore(snapshot)
        except _Corrupt as e:
            raise InvalidArgument(f"corrupt ledger snapshot: {e}; restore from the previous checkpoint") from None

    @classmethod
    def _restore(cls, snap: Mapping[str, Any]) -> ShardLedger:
        if not isinstance(snap, Mapping):
            raise _Corrupt(f"expected a mapping, got {type(snap).__name__}")
        if snap.get("format") != SNAPSHOT_FORMAT:
            raise _Corrupt(f"format is {snap.get('format')!r}, expected {SNAPSHOT_FORMAT}")
        max_range = snap.get("max_range_tokens")
        if max_range is not None:
            _want_int(max_range, "max_range_tokens", 1)
        next_id = _want_int(snap.get("next_receipt_id"), "next_receipt_id", 1)
        shards_raw = snap.get("shards")
        if not isinstance(shards_raw, list) or not shards_raw:
            raise _Corrupt("shards must be a non-empty list")
        ledger = cls(len(shards_raw), [1] * len(shards_raw), max_range_tokens=max_range)
        ledger._next_receipt_id = next_id
        for i, raw in enumerate(shards_raw):
            shard = _restore_shard(i, raw)
            owner, shard.owner = shard.owner, None
            ledger._shards[i] = shard
            ledger._set_owner(i, owner)
        pending_raw = snap.get("pending")
        if not isinstance(pending_raw, list):
            raise _Corrupt("pending must be a list")
        cursor = {i: s.committed for i, s in enumerate(ledger._shards)}  # where the next pending range starts
        last_id = 0
        for raw in pending_raw:
            receipt = _restore_receipt(raw, ledger._shards)
            if not last_id < receipt.receipt_id < next_id:
                raise _Corrupt(f"pending receipt id {receipt.receipt_id} is out of order or not below next_receipt_id")
            last_id = receipt.receipt_id
            for r in receipt.ranges:
                if r.start != cursor[r.shard_id]:
                    raise _Corrupt(
                        f"pending receipt {receipt.receipt_id} starts shard {r.shard_id} at {r.start}, "
                        f"expected {cursor[r.shard_id]}"
                    )
                cursor[r.shard_id] = r.end
                ledger._shards[r.shard_id].queue.append(receipt.receipt_id)
            ledger._pending[receipt.receipt_id] = receipt
        for i, s in enumerate(ledger._shards):
            if cursor[i] != s.accepted:
                raise _Corrupt(f"shard {i} pending ranges end at {cursor[i]} but accepted is {s.accepted}")
        return ledger

    # ------------------------------------------------------------------ helpers

    def _get(self, shard_id: int) -> _Shard:
        if not _is_int(shard_id) or not 0 <= shard_id < len(self._shards):
            raise NotFound(
                f"shard {shard_id!r} does not exist (shards are 0..{len(self._shards) - 1}); fetch your work plan"
            )
        return self._shards[shard_id]

    @staticmethod
    def _view(shard_id: int, s: _Shard) -> ShardState:
        return ShardState(
            shard_id=shard_id,
            owner=s.owner,
            epoch=s.epoch,
            accepted=s.accepted,
            committed=s.committed,
            length=s.length,
            committed_ranges=tuple(s.committed_ranges),
        )


class _Corrupt(Exception):
    """Internal: a snapshot failed validation."""


def _want_int(value: object, name: str, minimum: int) -> int:
    if not _is_int(value):
        raise _Corrupt(f"{name} must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < minimum:
        raise _Corrupt(f"{name} must be >= {minimum}, got {value}")
    return value


def _want_triple(raw: object, name: str, size: int) -> list[int]:
    if not isinstance(raw, list) or len(raw) != size:
        raise _Corrupt(f"{name} must be a list of {size} integers, got {raw!r}")
    return [_want_int(v, name, 0) for v in raw]


def _restore_shard(i: int, raw: object) -> _Shard:
    if not isinstance(raw, Mapping):
        raise _Corrupt(f"shard entry {i} must be a mapping")
    if raw.get("shard_id") != i or not _is_int(raw.get("shard_id")):
        raise _Corrupt(f"shard entry {i} has shard_id {raw.get('shard_id')!r}")
    owner = raw.get("owner")
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise _Corrupt(f"shard {i} owner must be a non-empty string or null, got {owner!r}")
    shard = _Shard(
        length=_want_int(raw.get("length"), f"shard {i} length", 1),
        owner=owner,
        epoch=_want_int(raw.get("epoch"), f"shard {i} epoch", 1),
        accepted=_want_int(raw.get("accepted"), f"shard {i} accepted", 0),
        committed=_want_int(raw.get("committed"), f"shard {i} committed", 0),
    )
    if shard.committed > shard.accepted:
        raise _Corrupt(f"shard {i} committed {shard.committed} is beyond accepted {shard.accepted}")
    ranges_raw = raw.get("committed_ranges")
    if not isinstance(ranges_raw, list):
        raise _Corrupt(f"shard {i} committed_ranges must be a list")
    end = 0
    for item in ranges_raw:
        epoch, start, stop = _want_triple(item, f"shard {i} committed range", 3)
        if start != end or stop <= start or not 1 <= epoch <= shard.epoch:
            raise _Corrupt(f"shard {i} committed range {item!r} does not continue contiguously from {end}")
        shard.committed_ranges.append(ShardRange(i, epoch, start, stop))
        end = stop
    if end != shard.committed:
        raise _Corrupt(f"shard {i} committed ranges end at {end} but committed is {shard.committed}")
    return shard


def _restore_receipt(raw: object, shards: Sequence[_Shard]) -> AcceptReceipt:
    if not isinstance(raw, Mapping):
        raise _Corrupt("pending entry must be a mapping")
    receipt_id = _want_int(raw.get("receipt_id"), "pending receipt_id", 1)
    worker_id = raw.get("worker_id")
    if not isinstance(worker_id, str) or not worker_id:
        raise _Corrupt(f"pending receipt {receipt_id} worker_id must be a non-empty string")
    ranges_raw = raw.get("ranges")
    if not isinstance(ranges_raw, list):
        raise _Corrupt(f"pending receipt {receipt_id} ranges must be a list")
    ranges: list[ShardRange] = []
    for item in ranges_raw:
        sid, epoch, start, end = _want_triple(item, f"pending receipt {receipt_id} range", 4)
        if sid >= len(shards) or sid in {r.shard_id for r in ranges}:
            raise _Corrupt(f"pending receipt {receipt_id} names unknown or repeated shard {sid}")
        if end <= start or not 1 <= epoch <= shards[sid].epoch:
            raise _Corrupt(f"pending receipt {receipt_id} has a malformed range {item!r}")
        ranges.append(ShardRange(sid, epoch, start, end))
    return AcceptReceipt(receipt_id=receipt_id, worker_id=worker_id, ranges=tuple(ranges))
