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
the outcome does not depend on when within its cadence the caller ticks. DEAD and LEFT nodes are forgotten
(dropped without an event) `forget_after_s` after their last heartbeat, which bounds the table when nodes come
and go.

Stalls of the detector itself. Silence only counts while the detector was awake to hear heartbeats: if the
process (or its whole host) was paused, heartbeats sent meanwhile could not arrive, and judging that silence
would declare every node dead at once. So, while any node is ALIVE or SUSPECT, `next_deadline()` asks to be
called again within `tick_interval_s`, and a call (tick, heartbeat or leave) that comes more than
`stall_after_s` after the previous call is taken as a stall of the detector over that gap. On a stall every
node's silence window restarts at the resume: a node is suspect `suspect_after_s`, and dead `dead_after_s`,
after max(its last heartbeat, the end of the last stall). A node that really died before or during the stall is
therefore declared dead `dead_after_s` after the resume (at the latest), and a healthy node has a full window
to be heard again. Each stall is reported once by `take_stalls()`. With regular calls no gap exceeds
`stall_after_s` and the detector behaves exactly as without stall detection (`stall_after_s = inf`).

The detector is not thread-safe; the caller serializes calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from diloco.core.energy import PowerSource
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
    # While nodes are watched the caller calls at least this often (next_deadline() says when) ...
    tick_interval_s: float = 0.25
    # ... so a gap between two calls longer than this is a stall of the detector itself (inf: never a stall).
    stall_after_s: float = 1.0

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
        _positive_finite("tick_interval_s", self.tick_interval_s)
        stall = self.stall_after_s
        if not (isinstance(stall, (int, float)) and not isinstance(stall, bool) and stall > self.tick_interval_s):
            raise ConfigError(
                f"stall_after_s must be a number of seconds greater than tick_interval_s ({self.tick_interval_s}), "
                f"or inf to never detect a stall; got {stall!r}"
            )

    @property
    def detects_stalls(self) -> bool:
        return math.isfinite(self.stall_after_s)

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
    """Measured speed (and power) of a node, as reported with its heartbeats."""

    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    device_kind: str = ""
    watts: float = 0.0  # drawn while training (0: not reported)
    power_source: PowerSource | None = None  # where `watts` comes from (None with watts 0)

    def __post_init__(self) -> None:
        for name in ("tokens_per_s", "step_time_s", "watts"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"throughput.{name} must be a finite number >= 0, got {value!r}")
        if self.watts > 0 and self.power_source is None:
            raise InvalidArgument("throughput.power_source is required when throughput.watts is above 0")


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
class Stall:
    """A stall of the detector itself: no call between `started_at` (the last call before it) and `resumed_at`.
    `watched` nodes (ALIVE or SUSPECT) had their silence window restarted at `resumed_at`."""

    started_at: float
    resumed_at: float
    watched: int

    @property
    def length_s(self) -> float:
        return self.resumed_at - self.started_at


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


_WATCHED = (NodeState.ALIVE, NodeState.SUSPECT)


class FailureDetector:
    def __init__(self, cfg: DetectorConfig = DetectorConfig()) -> None:
        self.cfg = cfg
        self._nodes: dict[str, _Node] = {}
        self._counts: dict[NodeState, int] = dict.fromkeys(NodeState, 0)
        self._last_call: float | None = None  # the latest `now` of any call
        self._resumed_at = -math.inf  # the end of the last stall: no silence window starts before it
        self._stalls: list[Stall] = []  # detected, not yet taken

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
        self._observe(now)
        node = self._nodes.get(node_id)
        events: list[NodeEvent] = []
        if node is None:
            node = _Node(node_id, role, NodeState.ALIVE, last_seen=now, joined_at=now)
            self._nodes[node_id] = node
            self._counts[NodeState.ALIVE] += 1
            events.append(self._event(node, NodeState.ALIVE, None, now, "joined"))
        else:
            events.extend(self._advance(node, now))
            previous = node.state
            node.role = role
            node.last_seen = max(node.last_seen, now)  # callers' clocks may race by a hair
            if previous is not NodeState.ALIVE:
                self._set_state(node, NodeState.ALIVE)
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
        self._observe(now)
        node = self._nodes.get(node_id)
        if node is None or node.state is NodeState.LEFT:
            return []
        events = self._advance(node, now)
        previous = node.state
        self._set_state(node, NodeState.LEFT)
        node.last_seen = max(node.last_seen, now)
        events.append(self._event(node, NodeState.LEFT, previous, now, "left"))
        return events

    def tick(self, now: float) -> list[NodeEvent]:
        """Apply the transitions that silence up to `now` has earned, each reported once."""
        self._observe(now)
        events: list[NodeEvent] = []
        forget: list[_Node] = []
        for node in self._nodes.values():
            if node.state in (NodeState.DEAD, NodeState.LEFT):
                if now >= node.last_seen + self.cfg.forget_after_s:
                    forget.append(node)
            else:
                events.extend(self._advance(node, now))
        for node in forget:
            del self._nodes[node.node_id]
            self._counts[node.state] -= 1
        return events

    def take_stalls(self) -> list[Stall]:
        """The stalls of the detector itself detected since the last call of this method, oldest first."""
        stalls, self._stalls = self._stalls, []
        return stalls

    # --- queries --------------------------------------------------------------------------------------------
    def get(self, node_id: str) -> NodeView | None:
        node = self._nodes.get(node_id)
        return node.view() if node is not None else None

    def nodes(self) -> list[NodeView]:
        """Every known node, by node id."""
        return [self._nodes[k].view() for k in sorted(self._nodes)]

    def counts(self) -> dict[NodeState, int]:
        return dict(self._counts)

    def next_deadline(self) -> float | None:
        """The earliest time at which `tick` could change something (None: nothing to wait for). While a node is
        ALIVE or SUSPECT and stalls are detected, that is at most `tick_interval_s` after the last call: a
        caller that ticks at every deadline is then never silent long enough to look stalled."""
        deadlines = [self._deadline(node) for node in self._nodes.values()]
        if self._watched() and self.cfg.detects_stalls and self._last_call is not None:
            deadlines.append(self._last_call + self.cfg.tick_interval_s)
        return min(deadlines) if deadlines else None

    # --- internals ------------------------------------------------------------------------------------------
    def _watched(self) -> int:
        return sum(self._counts[s] for s in _WATCHED)

    def _observe(self, now: float) -> None:
        """Every call starts here: a gap since the previous call longer than `stall_after_s`, while nodes were
        watched (so the caller had been asked to call sooner), is a stall of the detector itself."""
        last = self._last_call
        if last is not None and now - last > self.cfg.stall_after_s and self._watched():
            self._resumed_at = now
            self._stalls.append(Stall(started_at=last, resumed_at=now, watched=self._watched()))
        if last is None or now > last:
            self._last_call = now

    def _set_state(self, node: _Node, state: NodeState) -> None:
        self._counts[node.state] -= 1
        self._counts[state] += 1
        node.state = state

    def _window_start(self, node: _Node) -> float:
        """Where the node's silence is measured from: its last heartbeat, or the end of a later stall."""
        return max(node.last_seen, self._resumed_at)

    def _deadline(self, node: _Node) -> float:
        # Must be the same expressions `_advance` and `tick` compare against, so a tick at the deadline acts.
        if node.state is NodeState.ALIVE:
            return self._window_start(node) + self.cfg.suspect_after_s
        if node.state is NodeState.SUSPECT:
            return self._window_start(node) + self.cfg.dead_after_s
        return node.last_seen + self.cfg.forget_after_s

    def _advance(self, node: _Node, now: float) -> list[NodeEvent]:
        events: list[NodeEvent] = []
        start = self._window_start(node)
        if node.state is NodeState.ALIVE and now >= start + self.cfg.suspect_after_s:
            self._set_state(node, NodeState.SUSPECT)
            missed = self.cfg.suspect_after_missed
            events.append(self._event(node, NodeState.SUSPECT, NodeState.ALIVE, now, f"missed {missed} heartbeats"))
        if node.state is NodeState.SUSPECT and now >= start + self.cfg.dead_after_s:
            self._set_state(node, NodeState.DEAD)
            node.deaths += 1
            reason = f"no heartbeat for {now - node.last_seen:.2f} s"
            if start > node.last_seen:
                reason += f" ({now - start:.2f} s of it since the failure detector resumed from a stall)"
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
