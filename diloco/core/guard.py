"""Robust merge: refuse pseudo-gradients whose norm is an outlier (a learner gone wrong, or a hostile one).

`NormGuard` keeps the norms of the last `window` *accepted* pseudo-gradients and judges a new one against their
median. Norms are compared **per inner step** (`‖Δ_m‖ / c_steps`): with dynamic local steps a slow learner runs
fewer steps (`H_m < H`) and its pseudo-gradient is shorter, roughly in proportion (AdamW moves each parameter by
about `lr` per step, whatever the batch), so the per-step norm is what is comparable across learners; per token
would be the same up to the (shared) batch size but would punish a learner with a smaller batch. Only the
upper side is judged: a short pseudo-gradient cannot do harm, a long one can.

A non-finite norm (NaN or Inf anywhere in the pseudo-gradient, or an overflow) is always refused, even before
warm-up. An outlier (`norm > factor * median`) is refused only once `min_samples` norms have been accepted;
before that every finite norm is accepted (no judgement without a reference). Refused norms never enter the
window, so a flood of bad submissions cannot drag the median up.

Pure: no clock, no I/O; the coordinator core owns one instance.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from diloco.errors import ConfigError

NON_FINITE, OUTLIER = "non_finite", "norm_outlier"


@dataclass(frozen=True)
class GuardConfig:
    outlier_factor: float = 0.0  # refuse a per-step norm above factor x the median; 0: outlier check off
    window: int = 32  # accepted norms the median is taken over
    min_samples: int = 3  # accepted norms needed before any outlier judgement
    quarantine_strikes: int = 3  # refusals in a row after which a quarantined learner's shards move away

    def __post_init__(self) -> None:
        if not (math.isfinite(self.outlier_factor) and (self.outlier_factor == 0 or self.outlier_factor > 1)):
            raise ConfigError(f"outlier_factor must be 0 (off) or a finite number > 1, got {self.outlier_factor}")
        if self.window < 1:
            raise ConfigError(f"guard window must be >= 1, got {self.window}")
        if not 1 <= self.min_samples <= self.window:
            raise ConfigError(f"guard min_samples must be in [1, window={self.window}], got {self.min_samples}")
        if self.quarantine_strikes < 1:
            raise ConfigError(f"quarantine_strikes must be >= 1, got {self.quarantine_strikes}")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # "" when ok, else NON_FINITE or OUTLIER
    norm: float  # the judged (per-step) norm
    median: float  # median of the window (NaN before any sample)
    ratio: float  # norm / median (NaN when there is no reference yet)


class NormGuard:
    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.norms: deque[float] = deque(maxlen=cfg.window)

    @property
    def warm(self) -> bool:
        return len(self.norms) >= self.cfg.min_samples

    def median(self) -> float:
        return statistics.median(self.norms) if self.norms else math.nan

    def check(self, norm: float) -> Verdict:
        """Judge one per-step norm; changes nothing (call `record` once the submission is accepted)."""
        median = self.median()
        if not math.isfinite(norm):
            return Verdict(False, NON_FINITE, norm, median, math.nan)
        if not self.norms:
            return Verdict(True, "", norm, median, math.nan)
        ratio = norm / median if median > 0 else (1.0 if norm <= 0 else math.inf)
        if self.cfg.outlier_factor and self.warm and ratio > self.cfg.outlier_factor:
            return Verdict(False, OUTLIER, norm, median, ratio)
        return Verdict(True, "", norm, median, ratio)

    def record(self, norm: float) -> None:
        """An accepted submission's per-step norm joins the window."""
        if math.isfinite(norm):
            self.norms.append(norm)

    def snapshot(self) -> list[float]:
        return list(self.norms)

    def restore(self, norms: Iterable[float]) -> None:
        self.norms.clear()
        for n in norms:
            self.record(float(n))
