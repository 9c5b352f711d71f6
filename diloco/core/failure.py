"""Failure detector (ALGORITHM.md section 8) as a state machine driven by the caller's clock.

Every node sends heartbeats (default every 0.5 s). A node silent for `suspect_after_missed` intervals is
*suspect*; one silent for `dead_after_s` is *dead*. A node that says it is leaving is *left*, which is not a
failure. The detector never reads a clock: `now` is a parameter of every call, and `next_deadline()` tells the
caller when a `tick` could next change something, so the caller can sleep until then instead of polling.

States and the events reported on each transition (each transition is reported once):

    (unknown) --heartbeat--> ALIVE "joined"
    ALIVE   --silence >= suspect_after_s--> SUSPECT "missed N heartbeats"
    SUSPECT --silence >= dead_after_s-->    DEAD "no heartbeat for X s"
    SUSPECT --heartbeat--> ALIVE "recovered"
    DEAD    --heartbeat--> ALIVE "rejoined"   (the node must register again with the coordinator)
    LEFT    --heartbeat--> ALIVE "joined"
    ALIVE/SUSPECT/DEAD --leave--> LEFT "left"

Silence is judged at the time of the call, whoever makes it: a heartbeat or leave arriving after a silence
longer than a threshold first reports the transitions the silence earned (with `at` = that call's `now`), so
the outcome does not depend on how often the caller ticks. DEAD and LEFT nodes are forgotten (dropped without
an event) `forget_after_s` after their last heartbeat, which bounds the table when nodes come and go.

The detector is not thread-safe; the caller serializes calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from diloco.errors import ConfigError, InvalidArgument

MAX_NODE_ID_CHARS = 256


class NodeState(str, Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


class NodeRole(str, Enum):
    WORKER = "worker"
    COORDINATOR = "coordinator"


@dataclass(frozen=True)
class DetectorConfig:
    heartbeat_interval_s: float = 0.5
    suspect_after_missed: int = 2
    dead_after_s: float = 2.0
    forget_after_s: float = 3600.0  # DEAD/LEFT nodes are dropped this long after their last heartbeat

    def __post_init__(self) -> None:
        _positive_finite("heartbeat_interval_s", self.heartbeat_interval_s)
        n = self.suspect_after_missed
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"suspect_after_missed must be an integer >= 1, got {n!r}")
        _positive_finite("dead_after_s", self.dead_after_s)
        if not self.dead_after_s > self.suspect_after_s:
            raise ConfigError(
                f"dead_after_s ({self.dead_after_s}) must be greater than the suspect threshold "
                f"suspect_after_missed x heartbeat_interval_s = {self.suspect_after_s}"
            )
        _positive_finite("forget_after_s", self.forget_after_s)
        if not self.forget_after_s > self.dead_after_s:
            raise ConfigError(
                f"forget_after_s ({self.forget_after_s}) must be greater than dead_after_s ({self.dead_after_s})"
            )

    @property
    def suspect_after_s(self) -> float:
        """Silence after which a node is suspect."""
        return self.suspect_after_missed * self.heartbeat_interval_s


def _positive_finite(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(f"{name} must be a finite number > 0 (seconds), got {value!r}")


@dataclass(frozen=True)
class Throughput:
    """Measured speed of a node, as reported with its heartbeats."""

    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    device_kind: str = ""

    def __post_init__(self) -> None:
        for name in ("tokens_per_s", "step_time_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"throughput.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class NodeEvent:
    """One state transition. `previous_state` is None when the node was unknown; `at` is when it was declared;
    `last_seen` is the node's last heartbeat at that moment (so `at - last_seen` is the silence)."""

    node_id: str
    state: NodeState
    previous_state: NodeState | None
    at: float
    reason: str
    role: NodeRole
    last_seen: float

    @property
    def silence_s(self) -> float:
        return self.at - self.last_seen


@dataclass(frozen=True)
class NodeView:
    """A read-only view of one node. `deaths` counts how often this node id was declared dead."""

    node_id: str
    role: NodeRole
    state: NodeState
    last_seen: float
    joined_at: float
    heartbeats: int
    version: int
    throughput: Throughput | None
    deaths: int


@dataclass
class _Node:
    node_id: str
    role: NodeRole
    state: NodeState
    last_seen: float
    joined_at: float
    heartbeats: int = 0
    version: int = 0
    throughput: Throughput | None = None
    deaths: int = 0

    def view(self) -> NodeView:
        return NodeView(
            node_id=self.node_id,
            role=self.role,
            state=self.state,
            last_seen=self.last_seen,
            joined_at=self.joined_at,
            heartbeats=self.heartbeats,
            version=self.version,
            throughput=self.throughput,
            deaths=self.deaths,
        )


class FailureDetector:
    def __init__(self, cfg: DetectorConfig = DetectorConfig()) -> None:
        self.cfg = cfg
        self._nodes: dict[str, _Node] = {}

    # --- inputs ---------------------------------------------------------------------------------------------
    def heartbeat(
        self,
        node_id: str,
        role: NodeRole,
        now: float,
        throughput: Throughput | None = None,
        version: int = 0,
    ) -> list[NodeEvent]:
        """Record a heartbeat from `node_id` at `now`; returns the transitions it caused (often none)."""
        _check_node_id(node_id)
        if not isinstance(role, NodeRole):
            raise InvalidArgument(f"role must be one of {', '.join(r.value for r in NodeRole)}, got {role!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidArgument(f"version must be an integer >= 0, got {version!r}")
        node = self._nodes.get(node_id)
        events: list[NodeEvent] = []
        if node is None:
            node = _Node(node_id, role, NodeState.ALIVE, last_seen=now, joined_at=now)
            self._nodes[node_id] = node
            events.append(self._event(node, NodeState.ALIVE, None, now, "joined"))
        else:
            events.extend(self._advance(node, now))
            previous = node.state
            node.role = role
            node.last_seen = max(node.last_seen, now)  # callers' clocks may race by a hair
            if previous is not NodeState.ALIVE:
                node.state = NodeState.ALIVE
                if previous is NodeState.SUSPECT:
                    reason = "recovered"
                elif previous is NodeState.DEAD:
                    reason = "rejoined"
                else:
                    node.joined_at = now
                    reason = "joined"
                events.append(self._event(node, NodeState.ALIVE, previous, now, reason))
        node.heartbeats += 1
        node.version = version
        if throughput is not None:
            node.throughput = throughput
        return events

    def leave(self, node_id: str, now: float) -> list[NodeEvent]:
        """The node shuts down cleanly: LEFT (not a failure). Unknown or already-left nodes: no event."""
        _check_node_id(node_id)
        node = self._nodes.get(node_id)
        if node is None or node.state is NodeState.LEFT:
            return []
        events = self._advance(node, now)
        previous = node.state
        node.state = NodeState.LEFT
        node.last_seen = max(node.last_seen, now)
        events.append(self._event(node, NodeState.LEFT, previous, now, "left"))
        return events

    def tick(self, now: float) -> list[NodeEvent]:
        """Apply the transitions that silence up to `now` has earned, each reported once."""
        events: list[NodeEvent] = []
        forget: list[str] = []
        for node in self._nodes.values():
            if node.state in (NodeState.DEAD, NodeState.LEFT):
                if now >= node.last_seen + self.cfg.forget_after_s:
                    forget.append(node.node_id)
            else:
                events.extend(self._advance(node, now))
        for node_id in forget:
            del self._nodes[node_id]
        return events

    # --- queries --------------------------------------------------------------------------------------------
    def get(self, node_id: str) -> NodeView | None:
        node = self._nodes.get(node_id)
        return node.view() if node is not None else None

    def nodes(self) -> list[NodeView]:
        """Every known node, by node id."""
        return [self._nodes[k].view() for k in sorted(self._nodes)]

    def counts(self) -> dict[NodeState, int]:
        counts = dict.fromkeys(NodeState, 0)
        for node in self._nodes.values():
            counts[node.state] += 1
        return counts

    def next_deadline(self) -> float | None:
        """The earliest time at which `tick` could change something (None: nothing to wait for)."""
        deadlines = [self._deadline(node) for node in self._nodes.values()]
        return min(deadlines) if deadlines else None

    # --- internals ------------------------------------------------------------------------------------------
    def _deadline(self, node: _Node) -> float:
        # Must be the same expressions `_advance` and `tick` compare against, so a tick at the deadline acts.
        if node.state is NodeState.ALIVE:
            return node.last_seen + self.cfg.suspect_after_s
        if node.state is NodeState.SUSPECT:
            return node.last_seen + self.cfg.dead_after_s
        return node.last_seen + self.cfg.forget_after_s

    def _advance(self, node: _Node, now: float) -> list[NodeEvent]:
        events: list[NodeEvent] = []
        if node.state is NodeState.ALIVE and now >= node.last_seen + self.cfg.suspect_after_s:
            node.state = NodeState.SUSPECT
            missed = self.cfg.suspect_after_missed
            events.append(self._event(node, NodeState.SUSPECT, NodeState.ALIVE, now, f"missed {missed} heartbeats"))
        if node.state is NodeState.SUSPECT and now >= node.last_seen + self.cfg.dead_after_s:
            node.state = NodeState.DEAD
            node.deaths += 1
            reason = f"no heartbeat for {now - node.last_seen:.2f} s"
            events.append(self._event(node, NodeState.DEAD, NodeState.SUSPECT, now, reason))
        return events

    @staticmethod
    def _event(node: _Node, state: NodeState, previous: NodeState | None, now: float, reason: str) -> NodeEvent:
        return NodeEvent(node.node_id, state, previous, now, reason, node.role, node.last_seen)


def _check_node_id(node_id: str) -> None:
    if not isinstance(node_id, str) or not node_id.strip():
        raise InvalidArgument("node_id must be a non-empty string (the worker id the coordinator assigned)")
    if len(node_id) > MAX_NODE_ID_CHARS:
        raise InvalidArgument(f"node_id is {len(node_id)} characters; at most {MAX_NODE_ID_CHARS} are allowed")
    if not node_id.isprintable():  # as the coordinator requires of worker ids, so a death report is never refused
        raise InvalidArgument("node_id must be printable (no control characters); send the coordinator's worker id")
