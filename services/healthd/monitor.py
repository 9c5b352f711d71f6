"""The failure detector put to work: one lock around the pure `FailureDetector`, a ticker thread that sleeps on a
condition until `next_deadline()` (woken early when a join makes an earlier deadline), and the consequences of
every event: fan-out to watchers, logs, metrics, and reports of dead workers to the coordinator.

The monitor only passes the time: every call hands the detector `clock()`, and the ticker ticks at every
deadline, which while nodes are watched comes at least every `tick_interval_s`. When this process (or its host)
was paused, the detector sees the gap and reports a stall (logged `healthd.stalled` with its length, counted in
`diloco_healthd_stall_seconds`); it declares nobody dead for the silence that overlaps it.

Events are published under the lock, so watchers see them in the order they happened."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from diloco.core.failure import (
    DetectorConfig,
    FailureDetector,
    NodeEvent,
    NodeRole,
    NodeState,
    NodeView,
    Stall,
    Throughput,
)
from services.healthd.hub import EventHub, Subscription
from services.healthd.metrics import HealthdMetrics
from services.healthd.reporter import CoordinatorReporter, FailureReport

_LOG_EVENT = {
    "joined": "node.joined",
    "recovered": "node.recovered",
    "rejoined": "node.rejoined",
}


class Monitor:
    def __init__(
        self,
        cfg: DetectorConfig,
        metrics: HealthdMetrics,
        log: Any,
        reporter: CoordinatorReporter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.log = log
        self.reporter = reporter
        self.clock = clock
        self.hub = EventHub()
        self._detector = FailureDetector(cfg)
        self._cond = threading.Condition()
        self._waiting_until = math.inf  # the deadline the ticker sleeps towards
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- inputs (servicer threads) ----------------------------------------------------------------------------
    def heartbeat(
        self, node_id: str, role: NodeRole, throughput: Throughput | None = None, version: int = 0
    ) -> NodeState:
        """Record a heartbeat; returns the state to answer with. The heartbeat that ends a DEAD period is
        answered DEAD: the node was dropped by the coordinator and must register again (a new incarnation)."""
        with self._cond:
            events = self._detector.heartbeat(node_id, role, self.clock(), throughput, version)
            view = self._detector.get(node_id)
            first_deaths = self._changed(events)
            stalls = self._detector.take_stalls()
        self.metrics.heartbeats.inc()
        self._stalled(stalls)
        self._consequences(events, first_deaths)
        if any(e.previous_state is NodeState.DEAD and e.state is NodeState.ALIVE for e in events):
            return NodeState.DEAD  # the coordinator no longer knows this id: no throughput to forward
        if throughput is not None and role is NodeRole.WORKER and self.reporter is not None:
            self.reporter.offer_throughput(node_id, throughput)
        return view.state if view is not None else NodeState.ALIVE

    def leave(self, node_id: str) -> NodeState:
        with self._cond:
            events = self._detector.leave(node_id, self.clock())
            first_deaths = self._changed(events)
            stalls = self._detector.take_stalls()
        self._stalled(stalls)
        self._consequences(events, first_deaths)
        return NodeState.LEFT

    # --- queries ----------------------------------------------------------------------------------------------
    def nodes(self) -> list[NodeView]:
        with self._cond:
            return self._detector.nodes()

    def subscribe(self) -> Subscription:
        return self.hub.subscribe()

    @property
    def dead_after_s(self) -> float:
        return self.cfg.dead_after_s

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._tick_loop, name="healthd-ticker", daemon=True)
            self._thread.start()

    def close_watchers(self) -> None:
        self.hub.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        self.hub.close()

    # --- internals --------------------------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    deadline = self._detector.next_deadline()
                    self._waiting_until = math.inf if deadline is None else deadline
                    now = self.clock()
                    if deadline is not None and now >= deadline:
                        break
                    self._cond.wait(None if deadline is None else deadline - now)
                if self._stopping:
                    return
                self._waiting_until = math.inf
                events = self._detector.tick(self.clock())
                first_deaths = self._changed(events)
                stalls = self._detector.take_stalls()
            self._stalled(stalls)
            self._consequences(events, first_deaths)

    def _changed(self, events: list[NodeEvent]) -> set[str]:
        """Under the lock: publish in order, refresh the gauges, wake the ticker if a deadline moved earlier.
        Returns the ids declared dead for the first time by these events."""
        if not events:
            return set()
        self.hub.publish(events)
        first_deaths: set[str] = set()
        for ev in events:
            view = self._detector.get(ev.node_id) if ev.state is NodeState.DEAD else None
            if view is not None and view.deaths == 1:
                first_deaths.add(ev.node_id)
        self.metrics.set_counts(self._detector.counts())
        deadline = self._detector.next_deadline()
        if deadline is not None and deadline < self._waiting_until:
            self._cond.notify_all()
        return first_deaths

    def _stalled(self, stalls: list[Stall]) -> None:
        """Outside the lock: this process did not run for a while (paused, or its host was)."""
        for stall in stalls:
            self.metrics.stall_seconds.observe(stall.length_s)
            self.log.warning(
                "healthd.stalled",
                stall_s=round(stall.length_s, 3),
                stalled_from_unix_s=stall.started_at,
                resumed_unix_s=stall.resumed_at,
                nodes_given_a_fresh_window=stall.watched,
                dead_after_s=self.cfg.dead_after_s,
            )

    def _consequences(self, events: list[NodeEvent], first_deaths: set[str]) -> None:
        """Outside the lock: logs, metrics and coordinator reports (queued, never blocking)."""
        for ev in events:
            fields = {"node_id": ev.node_id, "role": ev.role.value, "reason": ev.reason}
            if ev.state is NodeState.ALIVE:
                self.log.info(_LOG_EVENT.get(ev.reason, "node.joined"), **fields, silence_s=round(ev.silence_s, 3))
            elif ev.state is NodeState.SUSPECT:
                self.log.warning("node.suspect", **fields, silence_s=round(ev.silence_s, 3))
            elif ev.state is NodeState.LEFT:
                self.log.info("node.left", **fields)
                if self.reporter is not None:
                    self.reporter.forget(ev.node_id)
            elif ev.state is NodeState.DEAD:
                self._dead(ev, fields, first=ev.node_id in first_deaths)

    def _dead(self, ev: NodeEvent, fields: dict[str, Any], first: bool) -> None:
        self.metrics.deaths.inc()
        self.metrics.detection_seconds.observe(ev.silence_s)
        # The coordinator drops a worker id for good on the first report; a later death of the same id
        # (e.g. it kept heartbeating after being told to re-register) changes nothing there.
        report = ev.role is NodeRole.WORKER and self.reporter is not None and first
        self.log.warning(
            "node.dead",
            **fields,
            silence_s=round(ev.silence_s, 3),
            last_seen_unix_s=ev.last_seen,
            declared_dead_unix_s=ev.at,
            reporting=report,
        )
        if self.reporter is not None:
            self.reporter.forget(ev.node_id)
            if report:
                self.reporter.report_failure(FailureReport(ev.node_id, ev.reason, ev.last_seen, ev.at))
