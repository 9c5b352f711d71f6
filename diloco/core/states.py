"""A learner's state in the coordinator's registry. Its own module, free of torch, so that the enum tables
(`diloco.rpc.vocab`) and the tools that print states (`diloco ctl`) load in a fraction of a second."""

from __future__ import annotations

from enum import StrEnum


class WorkerState(StrEnum):
    """A learner's state in the coordinator's registry.

    ACTIVE      --drain-->                DRAINING  (gets no shards: they move to the active learners at once)
    ACTIVE      --guard refuses-->        QUARANTINED (keeps its shards, gets no new ones)
    QUARANTINED --clean submission / release--> ACTIVE
    ACTIVE, DRAINING, QUARANTINED --remove--> DEAD | LEFT | EVICTED (final: the learner registers again)
    """

    ACTIVE = "active"
    DRAINING = "draining"
    QUARANTINED = "quarantined"
    DEAD = "dead"
    LEFT = "left"
    EVICTED = "evicted"

    @property
    def live(self) -> bool:
        return self in LIVE_STATES


ACTIVE, DRAINING, QUARANTINED = WorkerState.ACTIVE, WorkerState.DRAINING, WorkerState.QUARANTINED
DEAD, LEFT, EVICTED = WorkerState.DEAD, WorkerState.LEFT, WorkerState.EVICTED
LIVE_STATES = frozenset({ACTIVE, DRAINING, QUARANTINED})
GONE_STATES = frozenset({DEAD, LEFT, EVICTED})  # what `remove` may set
