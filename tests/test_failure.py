"""The pure failure detector, driven by a fake clock (times are plain numbers)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.failure import (
    DetectorConfig,
    FailureDetector,
    NodeEvent,
    NodeRole,
    NodeState,
    Throughput,
)
from diloco.errors import ConfigError, InvalidArgument

W = NodeRole.WORKER
CFG = DetectorConfig(heartbeat_interval_s=0.5, suspect_after_missed=2, dead_after_s=2.0, forget_after_s=10.0)


def transitions(events: list[NodeEvent]) -> list[tuple[str, NodeState | None, NodeState, str]]:
    return [(e.node_id, e.previous_state, e.state, e.reason) for e in events]


def test_defaults_follow_the_algorithm() -> None:
    cfg = DetectorConfig()
    assert (cfg.heartbeat_interval_s, cfg.suspect_after_missed, cfg.dead_after_s) == (0.5, 2, 2.0)
    assert cfg.suspect_after_s == 1.0


def test_first_heartbeat_joins() -> None:
    d = FailureDetector(CFG)
    events = d.heartbeat("w1", W, now=100.0, throughput=Throughput(1000.0, 0.1, "cpu"), version=3)
    assert transitions(events) == [("w1", None, NodeState.ALIVE, "joined")]
    assert events[0].at == 100.0 and events[0].role is W and events[0].silence_s == 0.0
    (view,) = d.nodes()
    assert view.state is NodeState.ALIVE and view.heartbeats == 1 and view.version == 3
    assert view.throughput == Throughput(1000.0, 0.1, "cpu")
    # Regular heartbeats change nothing.
    for t in (100.5, 101.0, 101.5):
        assert d.heartbeat("w1", W, now=t) == []
        assert d.tick(t + 0.4) == []
    assert d.get("w1") is not None and d.get("w1").heartbeats == 4  # type: ignore[union-attr]
    assert d.get("w1").throughput == Throughput(1000.0, 0.1, "cpu")  # type: ignore[union-attr]  # kept


def test_suspect_after_two_missed_intervals_then_dead_each_reported_once() -> None:
    d = FailureDetector(CFG)
    d.heartbeat("w1", W, now=0.0)
    assert d.tick(0.99) == []
    suspect = d.tick(1.0)  # 2 x 0.5 s of silence
    assert transitions(suspect) == [("w1", NodeState.ALIVE, NodeState.SUSPECT, "missed 2 heartbeats")]
    assert d.tick(1.5) == [] and d.tick(1.99) == []  # reported once
    dead = d.tick(2.0)
    assert [(e.previous_state, e.state) for e in dead] == [(NodeState.SUSPECT, NodeState.DEAD)]
    assert dead[0].last_seen == 0.0 and dead[0].silence_s == 2.0 and dead[0].at == 2.0
    assert d.tick(2.5) == [] and d.tick(5.0) == []  # reported once
    assert d.get("w1").state is NodeState.DEAD and d.get("w1").deaths == 1  # type: ignore[union-attr]
    assert d.counts() == {NodeState.ALIVE: 0, NodeState.SUSPECT: 0, NodeState.DEAD: 1, NodeState.LEFT: 0}


def test_a_late_tick_reports_both_transitions_in_order() -> None:
    d = FailureDetector(CFG)
    d.heartbeat("w1", W, now=0.0)
    events = d.tick(7.0)
    assert [e.state for e in events] == [NodeState.SUSPECT, NodeState.DEAD]
    assert d.tick(7.0) == []


def test_suspect_node_recovers() -> None:
    d = FailureDetector(CFG)
    d.heartbeat("w1", W, now=0.0)
    d.tick(1.2)
    events = d.heartbeat("w1", W, now=1.5)
    assert transitions(events) == [("w1", NodeState.SUSPECT, NodeState.ALIVE, "recovered")]
    assert d.tick(2.4) == []  # silence restarts at 1.5
    assert [e.state for e in d.tick(2.5)] == [NodeState.SUSPECT]


def test_leave_is_not_a_failure() -> None:
    d = FailureDetector(CFG)
    d.heartbeat("w1", W, now=0.0)
    events = d.leave("w1", now=0.3)
    assert transitions(events) == [("w1", NodeState.ALIVE, NodeState.LEFT, "left")]
    assert d.tick(5.0) == []  # never suspect, never dead
    assert d.get("w1").state is NodeState.LEFT and d.get("w1").deaths == 0  # type: ignore[union-attr]
    assert d.leave("w1", now=5.0) == []  # once
    assert d.leave("never-seen", now=5.0) == []
    # Coming back after leaving is a join.
    assert transitions(d.heartbeat("w1", W, now=6.0)) == [("w1", NodeState.LEFT, NodeState.ALIVE, "joined")]


def test_heartbeat_from_a_dead_node_is_a_rejoin() -> None:
    d = FailureDetector(CFG)
    d.heartbeat("w1", W, now=0.0)
    d.tick(2.0)
    events = d.heartbeat("w1", W, now=3.0)
    assert transitions(events) == [("w1", NodeState.DEAD, NodeState.ALIVE, "rejoined")]
    assert d.get("w1").state is NodeState.ALIVE  # type: ignore[union-attr]
    d.tick(10.0)
    assert d.get("w1").deaths == 2  # type: ignore[union-attr]


def test_silence_is_judged_at_the_call_not_at_the_last_tick() -> None:
    """A heartbeat after a long silence with no tick in between reports what the silence earned first."""
    d = FailureDetector(CFG)
    d.heartbeat("w1", W, now=0.0)
    events = d.heartbeat("w1", W, now=3.0)
    assert [(e.previous_state, e.state) for e in events] == [
        (NodeState.ALIVE, NodeState.SUSPECT),
        (NodeState.SUSPECT, NodeState.DEAD),
        (NodeState.DEAD, NodeState.ALIVE),
    ]
    d2 = FailureDetector(CFG)
    d2.heartbeat("w1", W, now=0.0)
    assert [e.state for e in d2.heartbeat("w1", W, now=1.2)] == [NodeState.SUSPECT, NodeState.ALIVE]


def test_next_deadline() -> None:
    d = FailureDetector(CFG)
    assert d.next_deadline() is None
    d.heartbeat("a", W, now=0.0)
    d.heartbeat("b", W, now=0.3)
    assert d.next_deadline() == 1.0  # a turns suspect
    assert d.tick(0.999) == []
    d.tick(1.0)
    assert d.next_deadline() == pytest.approx(1.3)  # b turns suspect before a dies (at 2.0)
    d.tick(1.3)
    assert d.next_deadline() == 2.0
    d.tick(2.0)
    assert d.next_deadline() == pytest.approx(2.3)
    d.tick(2.3)
    assert d.next_deadline() == 10.0  # a is forgotten
    d.heartbeat("c", W, now=9.0)
    assert d.next_deadline() == 10.0
    d.heartbeat("c", W, now=9.5)
    assert d.tick(10.0) == []
    assert [v.node_id for v in d.nodes()] == ["b", "c"]  # a forgotten without an event
    assert d.next_deadline() == pytest.approx(10.3)


@settings(max_examples=60, deadline=None)
@given(
    beats=st.lists(st.tuples(st.sampled_from("abc"), st.floats(0.0, 0.9)), min_size=1, max_size=30),
    ticks=st.lists(st.floats(0.0, 3.0), max_size=30),
)
def test_ticking_at_next_deadline_always_changes_something(beats: list[tuple[str, float]], ticks: list[float]) -> None:
    """The ticker sleeps until next_deadline(); a tick there must act (no busy loop) and a tick before it must
    not (no missed transition)."""
    d = FailureDetector(CFG)
    now = 0.0
    for (node, gap), tick_gap in zip(beats, [*ticks, *[0.0] * len(beats)], strict=False):
        now += gap
        d.heartbeat(node, W, now=now)
        now += tick_gap
        deadline = d.next_deadline()
        assert deadline is not None
        if now < deadline:
            assert d.tick(now) == [] and d.next_deadline() == deadline
    for _ in range(20):
        deadline = d.next_deadline()
        if deadline is None:
            break
        before = [(v.node_id, v.state) for v in d.nodes()]
        d.tick(deadline)
        assert [(v.node_id, v.state) for v in d.nodes()] != before
    assert d.next_deadline() is None


def test_node_ids_and_inputs_are_validated() -> None:
    d = FailureDetector(CFG)
    with pytest.raises(InvalidArgument, match="node_id"):
        d.heartbeat("", W, now=0.0)
    with pytest.raises(InvalidArgument, match="node_id"):
        d.heartbeat("x" * 300, W, now=0.0)
    with pytest.raises(InvalidArgument, match="role"):
        d.heartbeat("w1", "worker", now=0.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="version"):
        d.heartbeat("w1", W, now=0.0, version=-1)
    with pytest.raises(InvalidArgument, match="tokens_per_s"):
        Throughput(tokens_per_s=float("nan"))
    with pytest.raises(InvalidArgument, match="step_time_s"):
        Throughput(step_time_s=-1.0)
    assert d.nodes() == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"heartbeat_interval_s": 0.0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": float("inf")}, "heartbeat_interval_s"),
        ({"suspect_after_missed": 0}, "suspect_after_missed"),
        ({"suspect_after_missed": 1.5}, "suspect_after_missed"),
        ({"dead_after_s": -1.0}, "dead_after_s"),
        ({"dead_after_s": 1.0}, "dead_after_s"),  # equal to the suspect threshold 2 x 0.5 s
        ({"heartbeat_interval_s": 1.0, "dead_after_s": 1.5}, "dead_after_s"),
        ({"forget_after_s": 2.0}, "forget_after_s"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DetectorConfig(**kwargs)  # type: ignore[arg-type]
