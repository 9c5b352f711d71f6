"""Peak link bandwidth of a simulated run: the most bytes a link carried in any window of `window_s` virtual
seconds, divided by the window (bytes per second).

A transfer of `n` bytes started at `t` on a link of bandwidth `b` occupies it at rate `b` during `[t, t + n/b]`
(the latency is propagation: it delays the arrival, not the link). The bytes in a window `[a, a + W]` are `b` times
its overlap with the transfers; the maximum over `a` of that piecewise-linear function is reached where a window
edge meets a transfer's start or end, so only those window positions are evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Transfer:
    link: int  # the learner whose link carries it
    up: bool  # learner -> coordinator
    start_s: float
    nbytes: int
    snapshot: bool = False  # a full snapshot to a learner that (re)registered: not training traffic


def peak_rate(intervals: Sequence[tuple[float, float]], rate: float, window_s: float) -> float:
    """Max over windows of `window_s` of the bytes moved by transfers `(start, end)` at `rate` bytes/s, per
    second of the window. Overlapping transfers add up (several links into one end)."""
    if not intervals:
        return 0.0
    iv = np.asarray(intervals, dtype=np.float64)
    s, e = iv[:, 0], iv[:, 1]
    starts = np.unique(np.concatenate([s, e, s - window_s, e - window_s]))
    best = 0.0
    for lo in range(0, starts.size, 512):  # bounded memory: 512 window positions at a time
        a = starts[lo : lo + 512, None]
        overlap = np.clip(np.minimum(e, a + window_s) - np.maximum(s, a), 0.0, None)
        best = max(best, float(overlap.sum(axis=1).max()))
    return best * rate / window_s


def link_peaks(transfers: Sequence[Transfer], bandwidth: float, window_s: float) -> dict[str, float]:
    """Peak bytes/s of training traffic (snapshots aside), up and down: on the busiest learner link (`link_*`)
    and summed over every link, the coordinator's side (`coordinator_*`)."""
    out: dict[str, float] = {}
    for up, name in ((True, "up"), (False, "down")):
        mine = [t for t in transfers if t.up == up and not t.snapshot]
        spans: dict[int, list[tuple[float, float]]] = {}
        for t in mine:
            spans.setdefault(t.link, []).append((t.start_s, t.start_s + t.nbytes / bandwidth))
        out[f"link_{name}"] = max((peak_rate(v, bandwidth, window_s) for v in spans.values()), default=0.0)
        out[f"coordinator_{name}"] = peak_rate([x for v in spans.values() for x in v], bandwidth, window_s)
    return out
