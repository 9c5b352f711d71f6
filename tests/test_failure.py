"""The pure failure detector, driven by a fake clock (times are plain numbers)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.failure import (
    DetectorConfig,
    FailureDetector,
    NodeEvent,
    NodeRole,
    NodeState,
    Stall,
    Throughput,
)
from diloco.errors import ConfigError, InvalidArgument

W = NodeRole.WORKER
CFG = DetectorConfig(heartbeat_interval_s=0.5, suspect_after_missed=2, dead_after_s=2.0, forget_after_s=10.0)
# The tests of the transitions call the detector only at chosen instants; with stall detection off such gaps are not
# stalls of the detector (the stall tests below use CFG, which detects stalls as the default does).
NO_STALL = replace(CFG, stall_after_s=math.inf)


def transitions(events: list[NodeEvent]) -> list[tuple[str, NodeState | None, NodeState, str]]:
    return [(e.node_id, e.previous_state, e.state, e.reason) for e in events]


def test_defaults_follow_the_algorithm() -> None:
    cfg = DetectorConfig()
    assert (cfg.heartbeat_interval_s, cfg.suspect_after_missed, cfg.dead_after_s) == (0.5, 2, 2.0)
    assert cfg.suspect_after_s == 1.0
    assert cfg.detects_stalls and cfg.tick_interval_s < cfg.stall_after_s < cfg.dead_after_s


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
    d = FailureDetector(NO_STALL)
    d.heartbeat("w1", W, now=0.0)
    events = d.tick(7.0)
    assert [e.state for e in events] == [NodeState.SUSPECT, NodeState.DEAD]
    assert d.tick(7.0) == []


def test_suspect_node_recovers() -> None:
    d = FailureDetector(NO_STALL)
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
    d = FailureDetector(NO_STALL)
    d.heartbeat("w1", W, now=0.0)
    d.tick(2.0)
    events = d.heartbeat("w1", W, now=3.0)
    assert transitions(events) == [("w1", NodeState.DEAD, NodeState.ALIVE, "rejoined")]
    assert d.get("w1").state is NodeState.ALIVE  # type: ignore[union-attr]
    d.tick(10.0)
    assert d.get("w1").deaths == 2  # type: ignore[union-attr]


def test_silence_is_judged_at_the_call_not_at_the_last_tick() -> None:
    """A heartbeat after a long silence with no tick in between reports what the silence earned first."""
    d = FailureDetector(NO_STALL)
    d.heartbeat("w1", W, now=0.0)
    events = d.heartbeat("w1", W, now=3.0)
    assert [(e.previous_state, e.state) for e in events] == [
        (NodeState.ALIVE, NodeState.SUSPECT),
        (NodeState.SUSPECT, NodeState.DEAD),
        (NodeState.DEAD, NodeState.ALIVE),
    ]
    d2 = FailureDetector(NO_STALL)
    d2.heartbeat("w1", W, now=0.0)
    assert [e.state for e in d2.heartbeat("w1", W, now=1.2)] == [NodeState.SUSPECT, NodeState.ALIVE]


def test_next_deadline() -> None:
    d = FailureDetector(NO_STALL)
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
    d = FailureDetector(NO_STALL)
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
        ({"tick_interval_s": 0.0}, "tick_interval_s"),
        ({"tick_interval_s": float("nan")}, "tick_interval_s"),
        ({"stall_after_s": 0.25}, "stall_after_s"),  # not above tick_interval_s
        ({"stall_after_s": float("nan")}, "stall_after_s"),
        ({"stall_after_s": True}, "stall_after_s"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DetectorConfig(**kwargs)  # type: ignore[arg-type]


# --- stalls of the detector itself ------------------------------------------------------------------------------
# A fake host: nodes "a".."d" heartbeat every 0.5 s, the caller ticks at every next_deadline() (as healthd's ticker
# does), and the whole process stops for a while: no call reaches the detector from `stall_from` to `stall_to`.

NODES = "abcd"


class Host:
    def __init__(self, cfg: DetectorConfig = CFG) -> None:
        self.d = FailureDetector(cfg)
        self.now = 0.0
        self.events: list[NodeEvent] = []

    def run(self, until: float, beating: str = NODES, phase: float = 0.0) -> None:
        """Heartbeats of `beating` every 0.5 s (offset by `phase`) and ticks at every deadline, up to `until`."""
        next_beat = self.now + phase
        while True:
            deadline = self.d.next_deadline()
            at = min(next_beat, until if deadline is None else min(deadline, until))
            self.now = max(self.now, at)
            if at == next_beat and at <= until:
                for node in beating:
                    self.events += self.d.heartbeat(node, W, now=at)
                next_beat += 0.5
            elif at == until:
                self.events += self.d.tick(until)
                return
            else:
                self.events += self.d.tick(at)

    def dead(self) -> list[tuple[str, float]]:
        return [(e.node_id, e.at) for e in self.events if e.state is NodeState.DEAD]


@pytest.mark.parametrize("first_call", ["tick", "heartbeat"])
def test_a_stall_longer_than_dead_after_declares_nobody_dead(first_call: str) -> None:
    """The incident: nothing ran for 9 s; the first call after it (the ticker's or a heartbeat's) sees the gap."""
    h = Host()
    h.run(until=10.0)
    assert h.d.take_stalls() == [] and h.dead() == []
    resume = 19.0
    if first_call == "tick":
        assert h.d.tick(resume) == []
    else:
        assert h.d.heartbeat("c", W, now=resume) == []
    (stall,) = h.d.take_stalls()
    assert stall == Stall(started_at=10.0, resumed_at=resume, watched=4) and stall.length_s == 9.0
    assert h.d.take_stalls() == []  # reported once
    assert {v.state for v in h.d.nodes()} == {NodeState.ALIVE}
    assert h.d.next_deadline() is not None and h.d.next_deadline() > resume  # type: ignore[operator]
    h.now = resume
    h.run(until=40.0, phase=0.3)  # the learners' heartbeats come back within the fresh window
    assert h.dead() == [] and h.d.take_stalls() == []
    assert not [e for e in h.events if e.state is NodeState.SUSPECT]


@pytest.mark.parametrize("died_at", [5.0, 9.9])  # long before the stall, or just before it began
def test_a_node_that_died_before_or_during_the_stall_is_dead_within_dead_after_of_the_resume(died_at: float) -> None:
    h = Host()
    h.run(until=died_at)
    h.run(until=10.0, beating="abc")  # d is gone (killed before or during healthd's pause)
    resume = 19.0
    h.d.tick(resume)
    h.now = resume
    h.run(until=30.0, beating="abc", phase=0.2)
    ((who, at),) = h.dead()
    assert who == "d"
    if died_at + CFG.dead_after_s <= 10.0:
        assert at == died_at + CFG.dead_after_s  # it died long before: declared before the stall, as ever
    else:
        assert at == resume + CFG.dead_after_s  # a fresh window after the resume, not more
        (ev,) = [e for e in h.events if e.state is NodeState.DEAD]
        assert "since the failure detector resumed from a stall" in ev.reason
        assert ev.last_seen < 10.0 and ev.silence_s == pytest.approx(resume + CFG.dead_after_s - ev.last_seen)


def test_normal_ticks_keep_detection_within_dead_after() -> None:
    h = Host()
    h.run(until=7.3)
    h.run(until=20.0, beating="abc")  # d's last heartbeat was at 7.0
    assert h.dead() == [("d", 7.0 + CFG.dead_after_s)]
    assert h.d.take_stalls() == []


def test_the_ticker_is_asked_to_call_within_tick_interval_while_nodes_are_watched() -> None:
    d = FailureDetector(CFG)
    assert d.next_deadline() is None  # nothing watched: the ticker may sleep
    d.heartbeat("a", W, now=0.0)
    assert d.next_deadline() == CFG.tick_interval_s
    d.tick(0.2)
    assert d.next_deadline() == pytest.approx(0.2 + CFG.tick_interval_s)
    d.tick(1.0)
    d.tick(1.25)
    d.tick(1.5)
    d.tick(1.75)
    assert [e.state for e in d.tick(2.0)] == [NodeState.DEAD]
    assert d.next_deadline() == CFG.forget_after_s  # only a dead node: no need to tick


def test_a_long_gap_with_nothing_watched_is_not_a_stall() -> None:
    d = FailureDetector(CFG)
    d.tick(0.0)
    d.heartbeat("a", W, now=100.0)  # nobody was watched since 0.0: the ticker rightly slept
    assert d.take_stalls() == []
    d.leave("a", now=100.1)
    d.heartbeat("b", W, now=200.0)
    assert d.take_stalls() == []
    d.heartbeat("b", W, now=200.5)
    d.leave("b", now=205.0)  # b was watched: this gap is a stall, then b leaves (not a failure either)
    assert [s.length_s for s in d.take_stalls()] == [4.5]


def test_a_late_tick_below_the_stall_threshold_is_judged_as_before() -> None:
    d = FailureDetector(CFG)
    d.heartbeat("a", W, now=0.0)
    d.tick(0.9)  # late by 0.65 s: within stall_after_s
    d.tick(1.8)
    events = d.tick(2.7)
    assert [e.state for e in events] == [NodeState.DEAD] and events[0].at == 2.7
    assert d.take_stalls() == []


@settings(max_examples=80, deadline=None)
@given(
    calls=st.lists(
        # gaps below stall_after_s (1 s) with room for float rounding: `now` is a running sum of them
        st.tuples(st.sampled_from(["tick", "beat", "leave"]), st.sampled_from("abc"), st.floats(0.0, 0.999)),
        min_size=1,
        max_size=60,
    )
)
def test_with_calls_never_further_apart_than_stall_after_stall_detection_changes_nothing(
    calls: list[tuple[str, str, float]],
) -> None:
    """On a healthy host (no gap over stall_after_s between calls) the detector behaves exactly as one without
    stall detection: the same events at the same times, so a real death is still declared dead_after after it."""
    on, off = FailureDetector(CFG), FailureDetector(NO_STALL)
    now = 0.0
    for op, node, gap in calls:
        now += gap
        results = []
        for d in (on, off):
            if op == "tick":
                results.append(d.tick(now))
            elif op == "beat":
                results.append(d.heartbeat(node, W, now=now))
            else:
                results.append(d.leave(node, now=now))
        assert results[0] == results[1]
        assert on.nodes() == off.nodes()
        recount = {state: sum(v.state is state for v in on.nodes()) for state in NodeState}
        assert on.counts() == off.counts() == recount  # kept up to date on every transition
    assert on.take_stalls() == []


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["tick", "beat", "stall"]), st.sampled_from("abc"), st.floats(0.0, 0.3)),
        min_size=1,
        max_size=80,
    ),
    stall_s=st.floats(1.01, 30.0),
)
def test_nobody_is_declared_dead_for_silence_overlapping_a_stall(
    steps: list[tuple[str, str, float]], stall_s: float
) -> None:
    """Whatever the schedule of stalls: a node declared dead was silent for dead_after_s *after* the end of the
    last stall (awake time); and a caller that ticks at every deadline declares it exactly then."""
    d = FailureDetector(CFG)
    now = 0.0
    resumed = -math.inf
    for op, node, gap in steps:
        now += stall_s if op == "stall" else gap
        events = d.heartbeat(node, W, now=now) if op == "beat" else d.tick(now)
        stalls = d.take_stalls()
        if stalls:
            resumed = stalls[-1].resumed_at
            assert stalls[-1].length_s > CFG.stall_after_s
        for e in events:
            if e.state is NodeState.DEAD:
                assert e.at - max(e.last_seen, resumed) >= CFG.dead_after_s
    # after the schedule, tick at every deadline: every silent node is declared dead exactly dead_after_s after
    # max(its last heartbeat, the last resume), and no further stall is seen
    for _ in range(200):
        deadline = d.next_deadline()
        if deadline is None or not d.counts()[NodeState.ALIVE] + d.counts()[NodeState.SUSPECT]:
            break
        for e in d.tick(deadline):
            if e.state is NodeState.DEAD:
                assert e.at == pytest.approx(max(e.last_seen, resumed) + CFG.dead_after_s)
    assert d.counts()[NodeState.ALIVE] == d.counts()[NodeState.SUSPECT] == 0
    assert d.take_stalls() == []
