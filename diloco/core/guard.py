"""Robust merge: refuse pseudo-gradients whose norm is an outlier (a learner gone wrong, or a hostile one).

`NormGuard` keeps the norms of the last `window` *accepted* pseudo-gradients and judges a new one against their
median. Norms are compared **per inner step** (`‖Δ_m‖ / c_steps`): with dynamic local steps a slow learner runs
fewer steps (`H_m < H`) and its pseudo-gradient is shorter, roughly in proportion (AdamW moves each parameter by
about `lr` per step, whatever the batch), so the per-step norm is what is comparable across learners; per token
would be the same up to the (shared) batch size but would punish a learner with a smaller batch. Only the
upper side is judged: a short pseudo-gradient cannot do harm, a long one can.

Three checks, in order:
- **non-finite** (NaN or Inf anywhere in the pseudo-gradient, or an overflow): always refused.
- **ceiling**: a norm no honest AdamW learner can produce, always refused, from the first submission on. One
  AdamW step moves a parameter by `lr_t·m̂/(√v̂+ε)` plus weight decay `lr_t·wd·θ`, and `|m̂/√v̂|` is bounded by
  a constant of the betas alone (`adamw_move_bound`), whatever the gradients. So one step's update has a norm of
  at most `lr·(B·√N + wd·‖θ‖)`, and a pseudo-gradient's norm per inner step too (triangle inequality). The
  coordinator passes that bound times `ceiling_slack` (room for the error-feedback residual of a lossy codec and
  for `θ` drifting from `Θ` within a round).
- **outlier** (`norm > factor * median`): judged only once `min_samples` norms have been accepted (no judgement
  without a reference). Before that the ceiling is the only bound, so a broken learner cannot get more than twice
  the largest update AdamW could make into the first rounds.

Refused norms never enter the window, so a flood of bad submissions cannot drag the median up.

Pure: no clock, no I/O; the coordinator core owns one instance.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from diloco.errors import ConfigError

NON_FINITE, CEILING, OUTLIER = "non_finite", "norm_ceiling", "norm_outlier"


@functools.lru_cache(maxsize=16)
def adamw_move_bound(betas: tuple[float, float], horizon: int = 10_000) -> float:
    """The most one AdamW step can move one parameter, in units of the learning rate, before weight decay:
    `sup_t |m̂_t / √v̂_t|` over any gradients. By Cauchy-Schwarz, with `γ = β1²/β2`,
    `|m̂_t/√v̂_t| ≤ (1-β1)/(1-β1^t) · √((1-β2^t)/(1-β2)) · √((1-γ^t)/(1-γ))`; the sup is taken over the first
    `horizon` steps and the limit `t → ∞`. `inf` when `β1² ≥ β2` (no bound holds for every step count)."""
    b1, b2 = betas
    if b1 == 0:
        return 1.0  # m̂ = g and v̂ = g²
    g = b1 * b1 / b2
    if g >= 1:
        return math.inf
    limit = (1 - b1) / math.sqrt((1 - b2) * (1 - g))
    finite = max(
        (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2)) * math.sqrt((1 - g**t) / (1 - g))
        for t in range(1, horizon + 1)
    )
    return max(limit, finite)


@dataclass(frozen=True)
class GuardConfig:
    outlier_factor: float = 0.0  # refuse a per-step norm above factor x the median; 0: outlier check off
    window: int = 32  # accepted norms the median is taken over
    min_samples: int = 3  # accepted norms needed before any outlier judgement
    quarantine_strikes: int = 3  # refusals in a row after which a quarantined learner's shards move away
    # the ceiling: per-step norm <= ceiling_slack * (step_move * sqrt(N) + step_decay * ||Θ||); step_move 0: off
    step_move: float = 0.0  # the most one honest inner step moves one parameter: lr x adamw_move_bound(betas)
    step_decay: float = 0.0  # lr x weight decay
    ceiling_slack: float = 2.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.outlier_factor) and (self.outlier_factor == 0 or self.outlier_factor > 1)):
            raise ConfigError(f"outlier_factor must be 0 (off) or a finite number > 1, got {self.outlier_factor}")
        if self.window < 1:
            raise ConfigError(f"guard window must be >= 1, got {self.window}")
        if not 1 <= self.min_samples <= self.window:
            raise ConfigError(f"guard min_samples must be in [1, window={self.window}], got {self.min_samples}")
        if self.quarantine_strikes < 1:
            raise ConfigError(f"quarantine_strikes must be >= 1, got {self.quarantine_strikes}")
        for name in ("step_move", "step_decay"):
            value = getattr(self, name)
            if not (value >= 0):  # also NaN; inf means no ceiling
                raise ConfigError(f"guard {name} must be >= 0 (0 or inf: no ceiling), got {value}")
        if not (math.isfinite(self.ceiling_slack) and self.ceiling_slack >= 1):
            raise ConfigError(f"guard ceiling_slack must be a finite number >= 1, got {self.ceiling_slack}")

    @property
    def has_ceiling(self) -> bool:
        return 0 < self.step_move < math.inf

    def ceiling(self, numel: int, param_norm: float) -> float:
        """The largest per-step norm an honest learner can submit for a model of `numel` parameters with norm
        `param_norm`; inf when the ceiling is off."""
        if not self.has_ceiling:
            return math.inf
        return self.ceiling_slack * (self.step_move * math.sqrt(numel) + self.step_decay * param_norm)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # "" when ok, else NON_FINITE or OUTLIER
    norm: float  # the judged (per-step) norm
    median: float  # median of the window (NaN before any sample)
    ratio: float  # norm / median (NaN when there is no reference yet)
    ceiling: float = math.inf  # the ceiling it was judged against

    def describe(self) -> str:
        """Why it was refused, in a few words (for the learner's state and logs)."""
        if self.reason == NON_FINITE:
            return "non-finite values"
        if self.reason == CEILING:
            return f"norm per step {self.norm:.4g} above the {self.ceiling:.4g} no AdamW learner can exceed"
        return f"norm {self.ratio:.3g}x the median"


class NormGuard:
    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.norms: deque[float] = deque(maxlen=cfg.window)

    @property
    def warm(self) -> bool:
        return len(self.norms) >= self.cfg.min_samples

    def median(self) -> float:
        return statistics.median(self.norms) if self.norms else math.nan

    def check(self, norm: float, ceiling: float = math.inf) -> Verdict:
        """Judge one per-step norm against `ceiling` (see `GuardConfig.ceiling`) and the median; changes nothing
        (call `record` once the submission is accepted)."""
        median = self.median()
        if not math.isfinite(norm):
            return Verdict(False, NON_FINITE, norm, median, math.nan, ceiling)
        ratio = math.nan
        if self.norms:
            ratio = norm / median if median > 0 else (1.0 if norm <= 0 else math.inf)
        if norm > ceiling:
            return Verdict(False, CEILING, norm, median, ratio, ceiling)
        if self.cfg.outlier_factor and self.warm and ratio > self.cfg.outlier_factor:
            return Verdict(False, OUTLIER, norm, median, ratio, ceiling)
        return Verdict(True, "", norm, median, ratio, ceiling)

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
