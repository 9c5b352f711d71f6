"""What a learner has read since its last submission, and where it reads next (ALGORITHM.md section 7).

The coordinator leases shards as `(shard_id, epoch, cursor)`. The learner reads them round-robin, one batch a
step, and reports per shard the token range `[start, end)` it consumed under that epoch. The learner core
(`diloco.core.learner.LearnerCore`) keeps its reading state in a `ReadProgress`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from diloco.core.ledger import ShardRange


@dataclass
class ReadProgress:
    cursors: dict[int, tuple[int, int]] = field(default_factory=dict)  # shard -> (epoch, next cursor)
    ranges: dict[int, list[int]] = field(default_factory=dict)  # shard -> [epoch, start, end], not yet submitted
    steps: int = 0
    tokens: int = 0
    turn: int = 0

    def adopt(self, leases: Iterable[tuple[int, int, int]]) -> None:
        """Read the leased shards from now on. A shard still held under the same epoch keeps the local cursor
        (it is ahead of the coordinator's while submissions are in flight); a new or re-leased one starts at the
        lease's cursor. Ranges already read stay to be submitted."""
        self.cursors = {
            shard: (
                self.cursors[shard] if shard in self.cursors and self.cursors[shard][0] == epoch else (epoch, cursor)
            )
            for shard, epoch, cursor in leases
        }

    def next_shard(self) -> tuple[int, int, int]:
        """`(shard_id, epoch, cursor)` of the next batch to read, round-robin over the leased shards."""
        shards = sorted(self.cursors)
        shard = shards[self.turn % len(shards)]
        self.turn += 1
        epoch, cursor = self.cursors[shard]
        return shard, epoch, cursor

    def consumed(self, shard: int, epoch: int, start: int, end: int) -> None:
        """One step read tokens `[start, end)` of `shard`."""
        self.cursors[shard] = (epoch, end)
        r = self.ranges.get(shard)
        if r is None or r[0] != epoch:
            self.ranges[shard] = [epoch, start, end]
        else:
            r[2] = end
        self.steps += 1
        self.tokens += end - start

    def take(self) -> tuple[tuple[ShardRange, ...], int, int]:
        """The ranges, steps and tokens since the last submission; starts counting afresh."""
        ranges = tuple(ShardRange(s, e, a, b) for s, (e, a, b) in sorted(self.ranges.items()))
        out = ranges, self.steps, self.tokens
        self.ranges, self.steps, self.tokens = {}, 0, 0
        return out

    def reset(self) -> None:
        """Forget everything (after a refused submission the coordinator's cursors are the truth)."""
        self.cursors, self.ranges, self.steps, self.tokens = {}, {}, 0, 0
