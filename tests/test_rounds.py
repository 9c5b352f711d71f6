"""Round policies on a fake clock (ALGORITHM.md section 5)."""

from __future__ import annotations

import pytest

from diloco.core.rounds import Pending, RoundConfig, RoundPolicy
from diloco.errors import ConfigError, FailedPrecondition, NotFound


def policy(mode: str, live: int = 4, **kw: float) -> RoundPolicy:
    p = RoundPolicy(RoundConfig(mode=mode, **kw))  # type: ignore[arg-type]
    for i in range(live):
        p.worker_joined(f"w{i}")
    return p


def sub(p: RoundPolicy, worker: str, now: float, base: int | None = None) -> None:
    base = p.version if base is None else base
    p.admit(worker, base)
    p.submitted(Pending(f"{worker}@{now}", worker, base, 100, now))


def test_sync_waits_for_every_live_learner() -> None:
    p = policy("sync")
    for i, t in enumerate([1.0, 2.0, 3.0]):
        sub(p, f"w{i}", t)
        assert p.poll(t) is None
    assert p.next_deadline() is None
    sub(p, "w3", 9.0)
    close = p.poll(9.0)
    assert close is not None and close.version == 1 and len(close.submissions) == 4
    assert close.reason == "all_live"


def test_sync_dead_learner_leaves_the_round() -> None:
    p = policy("sync")
    for i in range(3):
        sub(p, f"w{i}", 1.0)
    assert p.poll(5.0) is None
    p.worker_left("w3")
    close = p.poll(5.5)
    assert close is not None and {s.worker_id for s in close.submissions} == {"w0", "w1", "w2"}


def test_sync_refuses_any_staleness() -> None:
    p = policy("sync", live=1)
    sub(p, "w0", 1.0)
    assert p.poll(1.0) is not None
    with pytest.raises(FailedPrecondition, match="1 versions stale"):
        p.admit("w0", 0)


def test_decoupled_quorum_then_grace() -> None:
    p = policy("decoupled", min_quorum=2, grace_max_s=1.0, grace_gamma=0.5)
    sub(p, "w0", 10.0)
    assert p.poll(10.0) is None and p.next_deadline() is None  # below quorum: only an arrival can close
    sub(p, "w1", 10.4)  # quorum reached; no round period known yet -> grace = grace_max_s
    assert p.grace_s == pytest.approx(1.0)
    assert p.next_deadline() == pytest.approx(11.4)
    assert p.poll(11.3) is None
    close = p.poll(11.4)
    assert close is not None and close.reason == "quorum_grace" and len(close.submissions) == 2
    # a second close 1.8 s after the first: slack (EMA of round periods) = 1.8 s -> grace = 0.5 * 1.8
    sub(p, "w0", 12.0)
    sub(p, "w1", 12.2)
    assert p.poll(12.2 + 1.0) is not None  # closed 1.8 s after the previous close
    assert p.slack_s == pytest.approx(1.8)
    assert p.grace_s == pytest.approx(0.9)


def test_decoupled_grace_is_capped() -> None:
    p = policy("decoupled", live=2, min_quorum=1, grace_max_s=0.3, grace_gamma=0.9)
    for t in (0.0, 10.0):
        sub(p, "w0", t)
        assert p.poll(t + 0.3) is not None
    # round period 10 s -> gamma * slack = 9 s, capped at 0.3 s
    assert p.grace_s == pytest.approx(0.3)


def test_decoupled_closes_at_once_when_everyone_is_in() -> None:
    p = policy("decoupled", live=2, min_quorum=1, grace_max_s=5.0)
    sub(p, "w0", 1.0)
    sub(p, "w1", 1.1)
    close = p.poll(1.1)
    assert close is not None and close.reason == "all_live"


def test_decoupled_late_arrival_joins_the_next_round() -> None:
    p = policy("decoupled", min_quorum=2, grace_max_s=0.0)
    sub(p, "w0", 1.0)
    sub(p, "w1", 1.0)
    first = p.poll(1.0)
    assert first is not None and first.version == 1
    sub(p, "w2", 1.5, base=0)  # computed against version 0, arrives after the close
    sub(p, "w3", 1.6)
    second = p.poll(1.6)
    assert second is not None and second.version == 2
    assert [s.worker_id for s in second.submissions] == ["w2", "w3"]
    assert second.max_staleness == 1


def test_decoupled_staleness_bound() -> None:
    p = policy("decoupled", live=1, min_quorum=1, grace_max_s=0.0, max_staleness=2)
    for t in range(3):
        sub(p, "w0", float(t))
        assert p.poll(float(t)) is not None
    assert p.admit("w0", 1) == 2
    with pytest.raises(FailedPrecondition, match="3 versions stale \\(limit 2\\)"):
        p.admit("w0", 0)


def test_decoupled_quorum_shrinks_when_learners_die() -> None:
    p = policy("decoupled", live=3, min_quorum=3, grace_max_s=0.5)
    sub(p, "w0", 1.0)
    sub(p, "w1", 1.0)
    assert p.poll(2.0) is None
    p.worker_left("w2")
    close = p.poll(2.0)  # everyone live is in now
    assert close is not None and close.reason == "all_live"


def test_async_applies_every_arrival() -> None:
    p = policy("async")
    sub(p, "w0", 1.0)
    c = p.poll(1.0)
    assert c is not None and c.reason == "async" and len(c.submissions) == 1


def test_unknown_learner_and_future_base() -> None:
    p = policy("decoupled")
    with pytest.raises(NotFound, match="register again"):
        p.admit("ghost", 0)
    with pytest.raises(FailedPrecondition, match="newer than the global version"):
        p.admit("w0", 3)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="allowed: sync, decoupled, async"):
        RoundConfig(mode="eager")
    with pytest.raises(ConfigError, match="min_quorum"):
        RoundConfig(min_quorum=0)
    with pytest.raises(ConfigError, match=r"K=5.*M=4"):
        RoundConfig(min_quorum=5).check_learners(4)


def test_idle_learners_are_not_waited_for() -> None:
    p = policy("sync", live=3)
    p.idle = {"w2"}  # live, but no shards to train yet
    sub(p, "w0", 1.0)
    assert p.poll(1.0) is None
    sub(p, "w1", 1.5)
    close = p.poll(1.5)
    assert close is not None and close.reason == "all_live" and p.quorum == 2
