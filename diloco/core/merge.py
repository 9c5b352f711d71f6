"""Merging pseudo-gradients (ALGORITHM.md section 4), one submission at a time so the coordinator holds a
single accumulation buffer however many learners submit.

- `mean`: token-weighted mean `Δ = Σ w_m·Δ_m / Σ w_m` with `w_m` = tokens trained.
- `rda`: radial-directional averaging per tensor (embeddings use the mean): the norm is the weighted mean of the
  norms, the direction the unit vector of the weighted sum of unit vectors, so near-orthogonal pseudo-gradients
  do not shrink like 1/√M.

A pseudo-gradient is folded in either as a tensor or as an `EncodedDelta`: its payload bytes, held encoded, with
the sums of squares of its segments measured while it arrived (`SegmentSquares`, a window sink of the decoder).
Folding an `EncodedDelta` decodes it a second time, window by window, straight into the accumulator: the
coordinator needs no model-sized decode buffer per upload, only the encoded bytes. Both ways run the same fp32
`add` per element (`mean` gives the same bits); norms are float64 sums of the squared norms of fp32 windows, so
they agree up to rounding when the windows differ.

The accumulator's buffer is idle between a round's step and the next fold: `lend()` hands it out as scratch (the
broadcast encode uses it), and the next `add` zeroes it first.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.core.codecs import EncodedMeta, Payload, WindowSink, payload_chunks, payload_decoder
from diloco.errors import ConfigError, InvalidArgument

MERGE_NAMES = ("mean", "rda")
_EPS = 1e-12


@dataclass(frozen=True)
class Segment:
    """One tensor's slice of the flat vector. RDA treats each segment separately; `embedding` ones use the mean."""

    offset: int
    numel: int
    embedding: bool = False


_SLAB = 1 << 20  # elements per norm step of a tensor folded whole


class _Segmented:
    """Splits windows of the flat vector along segment boundaries."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = list(segments)
        self._starts = [s.offset for s in self.segments]
        self._bounds = torch.tensor([s.offset + s.numel for s in self.segments], dtype=torch.int64)

    def parts(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """(segment index, offset in the window, length) of each segment piece of elements [start, start + n)."""
        out = []
        i = bisect.bisect_right(self._starts, start) - 1
        pos = start
        while pos < start + n:
            seg = self.segments[i]
            end = min(start + n, seg.offset + seg.numel)
            out.append((i, pos - start, end - pos))
            pos, i = end, i + 1
        return out

    def segment_of(self, index: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self._bounds, index, right=True)


class SegmentSquares(_Segmented):
    """A window sink (`diloco.core.codecs.WindowSink`): the sum of squares of each segment, in float64, of the
    fp32 values it is given (NaN or inf when any value is non-finite)."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        super().__init__(segments)
        self.sums = torch.zeros(len(self.segments), dtype=torch.float64)

    def dense(self, start: int, values: torch.Tensor) -> None:
        for i, at, n in self.parts(start, values.numel()):
            norm = float(torch.linalg.vector_norm(values.narrow(0, at, n)))
            self.sums[i] += norm * norm

    def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
        self.sums.index_add_(0, self.segment_of(index), values.double().square())

    def norm(self) -> float:
        return math.sqrt(float(self.sums.sum()))


def segment_squares(delta: torch.Tensor, segments: Sequence[Segment]) -> SegmentSquares:
    """`SegmentSquares` of a whole tensor, a slab at a time (as a decoder would hand it over)."""
    sq = SegmentSquares(segments)
    for start in range(0, delta.numel(), _SLAB):
        sq.dense(start, delta[start : start + _SLAB])
    return sq


@dataclass(frozen=True)
class EncodedDelta:
    """A pseudo-gradient held as its verified payload bytes (in memory, or a `ChunkSource`: a spill file), with the
    `SegmentSquares` measured on arrival."""

    meta: EncodedMeta
    data: Payload
    squares: SegmentSquares

    def norm(self) -> float:
        return self.squares.norm()

    def replay(self, sink: WindowSink) -> None:
        """Decode the payload again, window by window, into `sink`."""
        decoder = payload_decoder(self.meta, sink=sink)
        for chunk in payload_chunks(self.data):
            decoder.feed(chunk)
        decoder.verify()


class _Fold(_Segmented):
    """A window sink adding `alpha[segment] * values` into the accumulation buffer."""

    def __init__(self, segments: Sequence[Segment], acc: torch.Tensor, alpha: Sequence[float]) -> None:
        super().__init__(segments)
        self.acc, self.alpha = acc, list(alpha)
        self._alpha = torch.tensor(self.alpha, dtype=torch.float32)  # per segment, for sparse windows

    def dense(self, start: int, values: torch.Tensor) -> None:
        for i, at, n in self.parts(start, values.numel()):
            if self.alpha[i] != 0.0:
                self.acc.narrow(0, start + at, n).add_(values.narrow(0, at, n), alpha=self.alpha[i])

    def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
        self.acc.index_add_(0, index, values.mul(self._alpha[self.segment_of(index)]))


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
        self._stale = False  # the buffer was reset or lent: zero it before the next add
        self._norm_sum = torch.zeros(len(self.segments), dtype=torch.float64)
        self.weight = 0.0
        self.count = 0
        self.tokens = 0

    def add(self, delta: torch.Tensor | EncodedDelta, tokens: int) -> None:
        """Fold in one pseudo-gradient trained on `tokens` tokens (its weight): a tensor, or an `EncodedDelta`
        measured against this accumulator's segments."""
        numel = delta.meta.numel if isinstance(delta, EncodedDelta) else delta.numel()
        if numel != self.numel or (isinstance(delta, torch.Tensor) and delta.dim() != 1):
            raise InvalidArgument(f"pseudo-gradient has {numel} elements; expected {self.numel}")
        if tokens <= 0:
            raise InvalidArgument(f"a pseudo-gradient must report tokens > 0, got {tokens}")
        if self._sum is None:
            device = delta.device if isinstance(delta, torch.Tensor) else torch.device("cpu")
            self._sum = torch.zeros(self.numel, dtype=torch.float32, device=device)
        elif self._stale:
            self._sum.zero_()
        self._stale = False
        w = float(tokens)
        alpha = [w] * len(self.segments)
        if self.method == "rda":
            sums = delta.squares.sums if isinstance(delta, EncodedDelta) else segment_squares(delta, self.segments).sums
            if sums.numel() != len(self.segments):
                raise InvalidArgument(f"pseudo-gradient measured in {sums.numel()} segments, not {len(self.segments)}")
            for i, seg in enumerate(self.segments):
                if seg.embedding:
                    continue
                norm = math.sqrt(float(sums[i]))
                self._norm_sum[i] += w * norm
                alpha[i] = w / norm if norm > _EPS else 0.0
        sink = _Fold(self.segments, self._sum, alpha)
        if isinstance(delta, EncodedDelta):
            delta.replay(sink)
        else:
            sink.dense(0, delta)
        self.weight += w
        self.count += 1
        self.tokens += tokens

    def lend(self) -> torch.Tensor | None:
        """The buffer as scratch while it holds nothing (after `reset()`, before the next `add`; the caller
        serialises the two), or None before the first `add`. The next `add` zeroes it first."""
        if self.count:
            raise InvalidArgument("the merge buffer holds pseudo-gradients of an open round")
        self._stale = True
        return self._sum

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
        self._stale = True  # keep the buffer (a fresh one per round costs page faults), zeroed by the next add
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
