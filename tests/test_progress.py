"""ReadProgress: leases, round-robin reading, ranges per shard and epoch."""

from __future__ import annotations

from diloco.core.ledger import ShardRange
from diloco.core.progress import ReadProgress


def test_round_robin_ranges_and_take() -> None:
    p = ReadProgress()
    p.adopt([(0, 1, 100), (3, 2, 0)])
    for _ in range(3):
        shard, epoch, cursor = p.next_shard()
        p.consumed(shard, epoch, cursor, cursor + 10)
    ranges, steps, tokens = p.take()
    assert ranges == (ShardRange(0, 1, 100, 120), ShardRange(3, 2, 0, 10))
    assert (steps, tokens) == (3, 30)
    assert p.take() == ((), 0, 0)
    assert p.cursors == {0: (1, 120), 3: (2, 10)}


def test_adopt_keeps_local_cursor_for_the_same_epoch_only() -> None:
    p = ReadProgress()
    p.adopt([(0, 1, 0), (1, 1, 0)])
    p.consumed(0, 1, 0, 50)
    p.consumed(1, 1, 0, 50)
    p.adopt([(0, 1, 0), (1, 2, 40), (2, 1, 7)])  # shard 1 was re-leased at epoch 2, shard 2 is new
    assert p.cursors == {0: (1, 50), 1: (2, 40), 2: (1, 7)}
    ranges, _, _ = p.take()  # what was read under the old lease is still submitted under its epoch
    assert ShardRange(1, 1, 0, 50) in ranges


def test_reset_forgets_everything() -> None:
    p = ReadProgress()
    p.adopt([(0, 1, 0)])
    p.consumed(0, 1, 0, 5)
    p.reset()
    assert (p.cursors, p.take()) == ({}, ((), 0, 0))
