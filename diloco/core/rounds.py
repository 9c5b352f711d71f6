"""Round policies (ALGORITHM.md section 5) as a state machine driven by the caller's clock.

The policy decides *when* a round closes; it never reads a clock (`now` is a parameter) and holds no tensors.
The caller folds each accepted submission into its merge buffer, calls `submitted(...)`, then `poll(now)`;
when `poll` returns a `RoundClose`, every pending submission goes into that round and the version advances.
`next_deadline()` says when to poll again if nothing else happens (the end of a grace window).

- `sync`: close when every live learner has a pending submission. A learner that leaves or dies drops out of
  the expected set, so the round closes without it; so does a live learner with no shards to train (`idle`),
  e.g. one that rejoined while the shards it will get are still being handed off.
- `decoupled`: close when at least K submissions are pending (K capped at the live learners) and the grace
  window after the K-th arrival has passed, or at once when every live learner is in. The window is
  `min(grace_max_s, γ·slack)`, `slack` an EMA of the time between round closes (how long learners take to
  produce the next wave of submissions). Learners never wait on a round, so waiting a fraction γ < 1 of that
  period lets stragglers of the same wave in without idling anyone; only the update is a little later.
  Submissions arriving after a close join the next round; staleness above `max_staleness` is refused.
- `async`: every submission is a round of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from diloco.errors import ConfigError, FailedPrecondition, NotFound

MODES = ("sync", "decoupled", "async")


class CloseReason(StrEnum):
    """Why a round closed."""

    ALL_LIVE = "all_live"  # every expected learner is in
    QUORUM_GRACE = "quorum_grace"  # decoupled: K are in and the grace window passed
    ASYNC = "async"  # async: every submission is a round


@dataclass(frozen=True)
class RoundConfig:
    mode: str = "decoupled"
    min_quorum: int = 2  # K, for decoupled
    grace_max_s: float = 2.0
    grace_gamma: float = 0.5  # γ < 1
    max_staleness: int = 4
    slack_ema_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: unknown round mode {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.min_quorum < 1:
            raise ConfigError(f"min_quorum (K) must be >= 1, got {self.min_quorum}")
        if self.grace_max_s < 0:
            raise ConfigError(f"grace_max_s must be >= 0, got {self.grace_max_s}")
        if not 0 <= self.grace_gamma < 1:
            raise ConfigError(f"grace_gamma must be in [0, 1), got {self.grace_gamma}")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not 0 < self.slack_ema_alpha <= 1:
            raise ConfigError(f"slack_ema_alpha must be in (0, 1], got {self.slack_ema_alpha}")

    def check_learners(self, num_learners: int) -> None:
        """Raise when K cannot be met by the planned number of learners M."""
        if self.mode == "decoupled" and self.min_quorum > num_learners:
            raise ConfigError(f"min_quorum (K={self.min_quorum}) must be <= the number of learners (M={num_learners})")


@dataclass(frozen=True)
class Pending:
    submission_id: str
    worker_id: str
    base_version: int
    tokens: int
    arrived_at: float
    steps: int = 0  # inner steps it holds


@dataclass(frozen=True)
class RoundClose:
    version: int  # the new version this round produces
    submissions: tuple[Pending, ...]
    closed_at: float
    reason: CloseReason

    @property
    def max_staleness(self) -> int:
        return max(self.version - 1 - p.base_version for p in self.submissions)


@dataclass
class RoundPolicy:
    cfg: RoundConfig
    version: int = 0
    live: set[str] = field(default_factory=set)
    idle: set[str] = field(default_factory=set)  # live learners with no shards to train: not waited for
    pending: list[Pending] = field(default_factory=list)
    slack_s: float | None = None  # EMA of the time between round closes
    last_close: float | None = None
    quorum_at: float | None = None  # when the pending set reached the quorum

    # --- membership -------------------------------------------------------------------------------------------
    def worker_joined(self, worker_id: str) -> None:
        self.live.add(worker_id)

    def worker_left(self, worker_id: str) -> None:
        """A learner died, left or was evicted. Its pending submissions stay (their data is accepted)."""
        self.live.discard(worker_id)
        self.idle.discard(worker_id)

    @property
    def expected(self) -> set[str]:
        """The learners a round waits for: live ones that have work."""
        return self.live - self.idle

    @property
    def quorum(self) -> int:
        if self.cfg.mode == "async":
            return 1
        if self.cfg.mode == "sync":
            return max(1, len(self.expected))
        return max(1, min(self.cfg.min_quorum, len(self.expected)))

    # --- submissions ------------------------------------------------------------------------------------------
    def admit(self, worker_id: str, base_version: int) -> int:
        """Check a submission before its payload is read; returns its staleness or raises."""
        if worker_id not in self.live:
            raise NotFound(f"worker {worker_id} is not a live learner; register again")
        if base_version > self.version:
            raise FailedPrecondition(
                f"base version {base_version} is newer than the global version {self.version}; resync parameters"
            )
        staleness = self.version - base_version
        limit = 0 if self.cfg.mode == "sync" else self.cfg.max_staleness
        if staleness > limit:
            raise FailedPrecondition(
                f"pseudo-gradient is {staleness} versions stale (limit {limit}); "
                f"adopt version {self.version} and train again"
            )
        return staleness

    def submitted(self, p: Pending) -> None:
        """Record an accepted submission (already folded into the caller's merge buffer)."""
        self.pending.append(p)
        if self.quorum_at is None and len(self.pending) >= self.quorum:
            self.quorum_at = p.arrived_at

    @property
    def grace_s(self) -> float:
        if self.slack_s is None:
            return self.cfg.grace_max_s
        return min(self.cfg.grace_max_s, self.cfg.grace_gamma * self.slack_s)

    def _all_live_in(self) -> bool:
        return self.expected <= {p.worker_id for p in self.pending}

    # --- closing ----------------------------------------------------------------------------------------------
    def poll(self, now: float) -> RoundClose | None:
        """Close the round if the policy says so; returns what went into it."""
        if not self.pending:
            return None
        reason: CloseReason | None = None
        if self.cfg.mode == "async":
            reason = CloseReason.ASYNC
        elif self._all_live_in():
            reason = CloseReason.ALL_LIVE
        elif self.cfg.mode == "decoupled" and len(self.pending) >= self.quorum:
            if self.quorum_at is None:  # the quorum shrank below the pending count (learners died)
                self.quorum_at = now
            if now >= self.quorum_at + self.grace_s:
                reason = CloseReason.QUORUM_GRACE
        if reason is None:
            return None
        if self.last_close is not None:
            period = max(0.0, now - self.last_close)
            a = self.cfg.slack_ema_alpha
            self.slack_s = period if self.slack_s is None else a * period + (1 - a) * self.slack_s
        self.last_close = now
        self.version += 1
        close = RoundClose(self.version, tuple(self.pending), now, reason)
        self.pending = []
        self.quorum_at = None
        return close

    def next_deadline(self) -> float | None:
        """When `poll` may next close a round if no other event happens (None: only an event can close it)."""
        if self.cfg.mode != "decoupled" or not self.pending or len(self.pending) < self.quorum:
            return None
        start = self.quorum_at if self.quorum_at is not None else self.pending[-1].arrived_at
        return start + self.grace_s
