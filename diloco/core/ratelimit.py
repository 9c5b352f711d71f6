"""A token bucket (pure: time is the `now` argument). healthd gives every heartbeat stream one, so a node that
sends far faster than configured is cut off with RESOURCE_EXHAUSTED instead of costing CPU without bound."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.errors import ConfigError


@dataclass
class TokenBucket:
    rate_per_s: float  # sustained rate allowed
    burst: float  # bucket size: how many may arrive at once
    tokens: float = math.nan  # NaN: full at the first call
    updated_at: float = math.nan

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise ConfigError(f"rate_per_s must be a finite number > 0, got {self.rate_per_s}")
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise ConfigError(f"burst must be a finite number >= 1, got {self.burst}")

    def allow(self, now: float) -> bool:
        """Take one token if there is one (refilled at `rate_per_s` since the last call)."""
        if math.isnan(self.updated_at):
            self.tokens, self.updated_at = self.burst, now
        elapsed = max(0.0, now - self.updated_at)
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate_per_s)
        self.updated_at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
