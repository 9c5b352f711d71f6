"""Merging pseudo-gradients (ALGORITHM.md section 4), one submission at a time so the coordinator holds a
single accumulation buffer however many learners submit.

- `mean`: token-weighted mean `Δ = Σ w_m·Δ_m / Σ w_m` with `w_m` = tokens trained.
- `rda`: radial-directional averaging per tensor (embeddings use the mean): the norm is the weighted mean of the
  norms, the direction the unit vector of the weighted sum of unit vectors, so near-orthogonal pseudo-gradients
  do not shrink like 1/√M.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.errors import ConfigError, InvalidArgument

MERGE_NAMES = ("mean", "rda")
_EPS = 1e-12


@dataclass(frozen=True)
class Segment:
    """One tensor's slice of the flat vector. RDA treats each segment separately; `embedding` ones use the mean."""

    offset: int
    numel: int
    embedding: bool = False


class MergeAccumulator:
    """Accumulates the submissions of one round; `result()` gives the merged pseudo-gradient."""

    def __init__(self, numel: int, method: str = "mean", segments: Sequence[Segment] | None = None) -> None:
        if method not in MERGE_NAMES:
            raise ConfigError(f"merge: unknown method {method!r}; allowed: {', '.join(MERGE_NAMES)}")
        self.numel = numel
        self.method = method
        self.segments = list(segments) if segments else [Segment(0, numel)]
        if sum(s.numel for s in self.segments) != numel:
            raise ConfigError(f"merge: segments cover {sum(s.numel for s in self.segments)} elements, not {numel}")
        self._sum: torch.Tensor | None = None
        self._norm_sum = torch.zeros(len(self.segments), dtype=torch.float64)
        self.weight = 0.0
        self.count = 0
        self.tokens = 0

    def add(self, delta: torch.Tensor, tokens: int) -> None:
        """Fold in one pseudo-gradient trained on `tokens` tokens (its weight)."""
        if delta.dim() != 1 or delta.numel() != self.numel:
            raise InvalidArgument(f"pseudo-gradient has {delta.numel()} elements; expected {self.numel}")
        if tokens <= 0:
            raise InvalidArgument(f"a pseudo-gradient must report tokens > 0, got {tokens}")
        if self._sum is None:
            self._sum = torch.zeros(self.numel, dtype=torch.float32, device=delta.device)
        w = float(tokens)
        if self.method == "mean":
            self._sum.add_(delta, alpha=w)
        else:
            for i, seg in enumerate(self.segments):
                part = delta.narrow(0, seg.offset, seg.numel)
                acc = self._sum.narrow(0, seg.offset, seg.numel)
                if seg.embedding:
                    acc.add_(part, alpha=w)
                    continue
                norm = float(torch.linalg.vector_norm(part))
                self._norm_sum[i] += w * norm
                if norm > _EPS:
                    acc.add_(part, alpha=w / norm)
        self.weight += w
        self.count += 1
        self.tokens += tokens

    def result(self) -> torch.Tensor:
        """The merged pseudo-gradient, computed in place in the accumulation buffer (no new allocation): the
        buffer holds it until `reset()`, which zeroes it for the next round."""
        if self._sum is None or self.count == 0:
            raise InvalidArgument("no pseudo-gradient to merge")
        out = self._sum.div_(self.weight)
        if self.method == "rda":
            for i, seg in enumerate(self.segments):
                if seg.embedding:
                    continue
                part = out.narrow(0, seg.offset, seg.numel)
                direction_norm = float(torch.linalg.vector_norm(part))
                target = float(self._norm_sum[i]) / self.weight
                if direction_norm > _EPS:
                    part.mul_(target / direction_norm)
                else:
                    part.zero_()
        return out

    def reset(self) -> None:
        if self._sum is not None:
            self._sum.zero_()  # keep the buffer: a fresh one per round costs page faults on large models
        self._norm_sum.zero_()
        self.weight = 0.0
        self.count = 0
        self.tokens = 0


def merge(
    deltas: Sequence[torch.Tensor],
    tokens: Sequence[int],
    method: str = "mean",
    segments: Sequence[Segment] | None = None,
) -> torch.Tensor:
    """Merge a list of pseudo-gradients in one call."""
    if not deltas:
        raise InvalidArgument("no pseudo-gradient to merge")
    acc = MergeAccumulator(deltas[0].numel(), method, segments)
    for d, t in zip(deltas, tokens, strict=True):
        acc.add(d, t)
    return acc.result()
