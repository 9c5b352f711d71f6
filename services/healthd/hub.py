"""Fan-out of node events to watchers (WatchNodeEvents). Publishing never blocks (it may come from any thread): each
subscriber has a bounded buffer, and one that falls too far behind is cut off (it should reconnect and resync with
ListNodes). A watcher is a coroutine on the server's event loop (`async for ev in subscription`)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import AsyncIterator, Iterable

from diloco.core.failure import NodeEvent
from diloco.errors import ResourceExhausted
from diloco.rpc.server import LoopSignal

MAX_BUFFERED_EVENTS = 10_000


class Subscription:
    """Events published after `EventHub.subscribe`, in order. Iterating (async) waits for the next event and ends
    when the subscription is closed (by the watcher, or by the hub when the server stops)."""

    def __init__(self, hub: EventHub, max_buffered: int) -> None:
        self._hub = hub
        self._max = max_buffered
        self._lock = threading.Lock()
        self._signal = LoopSignal()
        self._events: deque[NodeEvent] = deque()
        self._closed = False
        self._overflowed = False

    def push(self, events: Iterable[NodeEvent]) -> None:
        with self._lock:
            if self._closed:
                return
            self._events.extend(events)
            if len(self._events) > self._max:
                self._overflowed = True
                self._closed = True
                self._events.clear()
        self._signal.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._signal.notify()
        self._hub.unsubscribe(self)

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    async def __aiter__(self) -> AsyncIterator[NodeEvent]:
        while True:
            changed = self._signal.waiter()  # before looking: an event pushed after this wakes it
            with self._lock:
                if self._overflowed:
                    raise ResourceExhausted(
                        f"the watcher fell more than {self._max} events behind; reconnect and call ListNodes to resync"
                    )
                batch = list(self._events)
                self._events.clear()
                closed = self._closed
            for ev in batch:
                yield ev
            if not batch:
                if closed:
                    return
                await changed.wait()


class EventHub:
    def __init__(self, max_buffered: int = MAX_BUFFERED_EVENTS) -> None:
        self._lock = threading.Lock()
        self._subs: set[Subscription] = set()
        self._max = max_buffered
        self._closed = False

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self._max)
        with self._lock:
            closed = self._closed
            if not closed:
                self._subs.add(sub)
        if closed:
            sub.close()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def publish(self, events: list[NodeEvent]) -> None:
        if not events:
            return
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.push(events)

    def subscriber_count(self) -> int:
        with self._lock:
            return len(self._subs)

    def close(self) -> None:
        """End every subscription (they deliver what they hold, then stop) and refuse new ones."""
        with self._lock:
            self._closed = True
            subs = list(self._subs)
        for sub in subs:
            sub.close()
