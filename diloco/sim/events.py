"""The discrete-event loop both simulators run on: events at virtual times, dispatched to `on_<kind>` methods.
Events at equal times run in the order they were scheduled, so runs are deterministic."""

from __future__ import annotations

import heapq
import itertools
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.done = False

    def at(self, t: float, kind: str, *args: Any) -> None:
        """Schedule `self.on_<kind>(*args)` at virtual time `t`."""
        heapq.heappush(self.events, (t, next(self.seq), kind, args))

    def run_events(self, max_time_s: float = 0.0) -> None:
        """Dispatch events in time order until none are left, `done` is set, or `max_time_s` (0: no limit)."""
        while self.events and not self.done:
            t, _, kind, args = heapq.heappop(self.events)
            if max_time_s and t > max_time_s:
                self.now = max_time_s
                return
            self.now = t
            getattr(self, f"on_{kind}")(*args)
