"""The pure leadership machine (diloco/core/leadership.py): transitions, fencing by time alone, epochs that never
go backwards, and property tests over random sequences of etcd outcomes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.leadership import (
    ANNOUNCE_EVERY_S,
    ANNOUNCED_FOR_S,
    Action,
    AnnouncedLeader,
    Duty,
    EpochCheck,
    LeaderInfo,
    Leadership,
    LeadershipConfig,
    Role,
    compare_epoch,
    coordinator_addresses,
    duty,
    failover_target,
    leader_hint,
)
from diloco.errors import ConfigError, FailedPrecondition, InvalidArgument

CFG = LeadershipConfig()  # ttl 2, renew 0.5, margin 0.5: fenced 1.5 s after the last confirmed renewal
OTHER = LeaderInfo("b", "b:1", 7)


def leader(epoch: int = 5, granted_at: float = 0.0, now: float = 0.01) -> Leadership:
    m = Leadership("a", "a:1", CFG)
    m.campaign_started(granted_at)
    m.won(epoch, granted_at, now)
    assert m.role is Role.LEADER
    return m


# --- config ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"lease_ttl_s": 0},
        {"lease_ttl_s": math.nan},
        {"lease_ttl_s": True},
        {"renew_interval_s": -1},
        {"safety_margin_s": 2.0},  # not below the TTL
        {"renew_interval_s": 1.5},  # not below ttl - margin: fenced between two renewals
        {"retry_interval_s": 0.6},  # above the renew interval
        {"observe_interval_s": math.inf},
        {"rejoin_after_s": -0.1},
        {"rejoin_after_s": "1"},
        {"orphan_after_s": 0},
    ],
)
def test_config_refuses(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LeadershipConfig(**kw)  # type: ignore[arg-type]


def test_config_names_the_fence_time() -> None:
    assert CFG.fence_after_s == pytest.approx(1.5)
    with pytest.raises(ConfigError, match=r"renew_interval_s \(1.5\) must be less than lease_ttl_s - safety_margin_s"):
        replace(CFG, renew_interval_s=1.5)


@pytest.mark.parametrize("replica_id,address", [("", "a:1"), ("a\n", "a:1"), ("a", "x" * 300), ("a" * 200, "a:1")])
def test_identity_is_checked(replica_id: str, address: str) -> None:
    with pytest.raises(InvalidArgument):
        Leadership(replica_id, address, CFG)


# --- a term, step by step ---------------------------------------------------------------------------------------


def test_a_fresh_replica_reads_first_then_campaigns_at_once() -> None:
    m = Leadership("a", "a:1", CFG)
    assert (m.role, m.epoch, m.due(0.0), m.next_deadline()) == (Role.FOLLOWER, 0, Action.OBSERVE, -math.inf)
    m.observe_failed(0.0)  # etcd away: read again, never campaign blind
    assert m.due(0.05) is Action.NONE and m.due(CFG.retry_interval_s) is Action.OBSERVE
    m.peers({}, 0.2)
    m.observed(None, 0.2)  # nobody leads, no standby published a version: a new job
    assert not m.behind and m.due(0.2) is Action.CAMPAIGN
    [t] = m.campaign_started(0.2)
    assert (t.previous, t.role) == (Role.FOLLOWER, Role.CANDIDATE)
    assert m.due(10.0) is Action.NONE and m.next_deadline() is None  # the campaign is in flight


def test_a_replica_that_joins_a_running_job_lets_an_up_to_date_standby_take_over_first() -> None:
    # b was restarted while its dead incarnation's key still stood; a is the standby in step with the dead leader
    b = Leadership("b", "b:1", CFG)
    a = Leadership("a", "a:1", CFG)
    dead = LeaderInfo("b", "b:1", 5)
    b.campaign_started(0.0)
    b.lost(dead, 0.1)
    assert b.behind and b.role is Role.FOLLOWER
    a.observed(dead, 0.0)
    a.caught_up(0.05)  # the dead leader had acknowledged a's versions
    assert not a.behind
    for m in (a, b):
        m.observed(None, 2.0)  # the dead leader's lease expired
    assert a.due(2.0) is Action.CAMPAIGN
    assert b.due(2.0) is not Action.CAMPAIGN and b.due(2.0 + CFG.orphan_after_s - 0.01) is not Action.CAMPAIGN
    assert b.next_deadline() is not None and b.next_deadline() <= 2.0 + CFG.orphan_after_s
    assert b.due(2.0 + CFG.orphan_after_s) is Action.CAMPAIGN  # nobody took over: it leads with what it has


def test_a_restart_that_finds_the_key_expired_defers_to_the_standby_that_published_a_version() -> None:
    """The soak's finding on a quiet machine: the killed leader came back just after its lease expired. It must not
    campaign before it has read the standbys' entries; then the vouched standby's entry makes it defer."""
    a = standby("a", 41)  # in step with the dead leader, holding version 41
    b = Leadership("b", "b:1", CFG)  # the dead leader's restart: its checkpoint may be older than 41
    assert b.due(2.0) is Action.OBSERVE
    b.peers({"a": 41}, 2.0)
    b.observed(None, 2.0)
    assert b.ahead == ("a",) and b.due(2.0) is not Action.CAMPAIGN
    a.observed(None, 2.05)
    assert a.due(2.05) is Action.CAMPAIGN
    assert b.due(2.0 + 2 * CFG.orphan_after_s - 0.01) is not Action.CAMPAIGN
    assert b.due(2.0 + 2 * CFG.orphan_after_s) is Action.CAMPAIGN  # a never took over: b leads with what it has


def test_a_replica_that_loses_its_first_campaign_is_behind_until_vouched_for() -> None:
    m = Leadership("c", "c:1", CFG)
    m.observed(None, 0.0)
    m.campaign_started(0.0)
    m.lost(OTHER, 0.1)  # a standby took the key between the read and the campaign
    assert m.behind
    m.caught_up(1.0)
    m.observed(None, 3.0)
    assert not m.behind and m.due(3.0) is Action.CAMPAIGN


def test_a_replica_that_led_is_not_behind_when_it_sees_another_leader() -> None:
    m = leader()
    m.observed(OTHER, 1.0)  # deposed
    assert m.role is Role.FOLLOWER and not m.behind


def test_a_replica_behind_campaigns_at_once_after_a_leader_vouched_for_it() -> None:
    m = Leadership("b", "b:1", CFG)
    m.observed(OTHER, 0.0)
    assert m.behind
    m.caught_up(1.0)
    m.observed(None, 3.0)
    assert not m.behind and m.due(3.0) is Action.CAMPAIGN


def standby(replica_id: str, held: int | None) -> Leadership:
    """A standby in step with the leader OTHER (a leader vouched for it), holding `held`."""
    m = Leadership(replica_id, f"{replica_id}:1", CFG)
    m.observed(OTHER, 0.0)
    m.caught_up(0.05)
    if held is not None:
        m.hold(held, 0.05)
    return m


def test_with_two_standbys_the_one_holding_the_newest_version_campaigns_first() -> None:
    """Issue #14 point 4: b holds version 7, c version 5; both in step with the dead leader. b campaigns as soon as
    the key is gone; c defers to it, but only for `orphan_after_s`: if b never takes over, c still leads."""
    b, c = standby("b", 7), standby("c", 5)
    peers = {"b": 7, "c": 5}
    for m in (b, c):
        m.peers(peers, 1.0)  # its own entry is left out
        m.observed(None, 2.0)  # the leader's lease expired
    assert (b.ahead, c.ahead) == ((), ("b",))
    assert b.due(2.0) is Action.CAMPAIGN
    wait = 2 * CFG.orphan_after_s
    assert c.due(2.0) is not Action.CAMPAIGN and c.due(2.0 + wait - 0.01) is not Action.CAMPAIGN
    assert c.next_deadline() is not None and c.next_deadline() <= 2.0 + wait
    assert c.due(2.0 + wait) is Action.CAMPAIGN  # b never took over: an election still happens


def behind(replica_id: str, held: int | None) -> Leadership:
    """A replica that joined while the leader OTHER led and was never vouched for, its state at `held` (applied
    from the leader, or resumed from its checkpoint)."""
    m = Leadership(replica_id, f"{replica_id}:1", CFG)
    m.observed(OTHER, 0.0)
    if held is not None:
        m.hold(held, 0.05)
    assert m.behind
    return m


def test_among_replicas_no_leader_vouched_for_the_one_holding_the_newest_version_campaigns_first() -> None:
    """The soak's finding at 852ca20: the restarted standby s applied version 239 10 ms before the leader (which had
    published it with no standby in step) took its acknowledgement; the leader was killed, and its restart r
    resumed from its checkpoint at 238. Both were behind and waited the same time: r won, and the learners' version
    went back. Now s goes first, after `orphan_after_s`; r waits twice that."""
    s, r = behind("s", 239), behind("r", 238)
    for m in (s, r):
        m.peers({"s": 239, "r": 238}, 1.0)
        m.observed(None, 2.0)
    assert (s.ahead, r.ahead) == ((), ("s",))
    assert s.due(2.0 + CFG.orphan_after_s - 0.01) is not Action.CAMPAIGN
    assert s.due(2.0 + CFG.orphan_after_s) is Action.CAMPAIGN
    assert r.due(2.0 + CFG.orphan_after_s) is not Action.CAMPAIGN
    assert r.due(2.0 + 2 * CFG.orphan_after_s) is Action.CAMPAIGN  # s never took over: r leads with what it has


def test_a_replica_holding_a_newer_version_goes_first_even_when_no_leader_vouched_for_it() -> None:
    """A leader published version 101 with no standby in step and died; its restart resumed from a checkpoint at
    101, while the standby a leader vouched for holds 100. The restart goes first (behind: after orphan_after_s);
    the standby, knowing a newer holder, waits twice that."""
    vouched, restart = standby("t", 100), behind("r", 101)
    for m in (vouched, restart):
        m.peers({"t": 100, "r": 101}, 1.0)
        m.observed(None, 2.0)
    assert restart.due(2.0 + CFG.orphan_after_s) is Action.CAMPAIGN
    assert vouched.due(2.0 + CFG.orphan_after_s) is not Action.CAMPAIGN
    assert vouched.due(2.0 + 2 * CFG.orphan_after_s) is Action.CAMPAIGN


def test_a_standby_campaigns_at_once_once_nobody_alive_is_ahead() -> None:
    c = standby("c", 5)
    c.peers({"b": 7}, 1.0)
    c.observed(None, 2.0)
    assert c.due(2.5) is not Action.CAMPAIGN
    c.peers({}, 2.6)  # b's entry went with its lease: b is dead
    assert c.ahead == () and c.due(2.6) is Action.CAMPAIGN
    c2 = standby("c", 5)
    c2.peers({"b": 7}, 1.0)
    c2.hold(8, 1.5)  # c caught up past b
    c2.observed(None, 2.0)
    assert c2.due(2.0) is Action.CAMPAIGN


def test_equal_versions_do_not_defer_and_a_standby_holding_nothing_defers_to_any() -> None:
    b, c = standby("b", 6), standby("c", 6)
    b.peers({"c": 6}, 1.0)
    c.peers({"b": 6}, 1.0)
    for m in (b, c):
        m.observed(None, 2.0)
        assert m.ahead == () and m.due(2.0) is Action.CAMPAIGN  # etcd picks one
    fresh = standby("d", None)
    fresh.peers({"b": 0}, 1.0)
    assert fresh.ahead == ("b",)


def test_peer_versions_are_validated() -> None:
    m = standby("c", 5)
    for bad in (-1, True, 1.5, "7"):
        with pytest.raises(InvalidArgument, match="version"):
            m.peers({"b": bad}, 1.0)  # type: ignore[dict-item]
        with pytest.raises(InvalidArgument, match="version"):
            m.hold(bad, 1.0)  # type: ignore[arg-type]
    assert m.held == 5 and m.ahead == ()


def test_a_cold_start_is_not_behind() -> None:
    m = Leadership("a", "a:1", CFG)
    m.observed(None, 0.0)
    assert not m.behind and m.due(0.0) is Action.CAMPAIGN
    w = leader()
    assert not w.behind


def test_winner_leads_until_its_fence_time_and_renewals_move_it() -> None:
    m = Leadership("a", "a:1", CFG)
    m.campaign_started(0.0)
    [t] = m.won(5, lease_granted_at=0.0, now=0.02)
    assert (t.role, t.epoch, t.reason) == (Role.LEADER, 5, "won epoch 5")
    assert m.leader == LeaderInfo("a", "a:1", 5)
    assert m.fence_at == pytest.approx(1.5)  # from the grant's send time, not from the win
    assert m.may_accept(0.02) and m.may_accept(1.4999)
    assert not m.may_accept(1.5)  # by time alone: nobody ticked
    assert m.due(0.3) is Action.NONE and m.next_deadline() == pytest.approx(0.5)
    assert m.due(0.5) is Action.RENEW
    assert m.renewed(sent_at=0.5, now=0.53) == []
    assert m.fence_at == pytest.approx(2.0) and m.may_accept(1.9999) and not m.may_accept(2.0)
    assert m.due(0.53) is Action.OBSERVE  # the leader reads its key at the renew cadence too
    assert m.observed(m.leader, 0.54) == []
    assert m.due(0.6) is Action.NONE and m.next_deadline() == pytest.approx(1.0)


def test_an_unrenewed_leader_is_fenced_before_its_lease_can_expire() -> None:
    m = leader(granted_at=0.0)
    m.renewed(0.5, 0.51)
    m.observed(m.leader, 1.1)
    m.renew_failed(1.1, lease_lost=False, reason="timeout")  # unknown outcome: retried, still leading
    assert m.role is Role.LEADER and m.due(1.15) is Action.NONE and m.due(1.21) is Action.RENEW
    assert m.next_deadline() == pytest.approx(1.2)
    assert m.tick(1.99) == []
    [t] = m.tick(2.0)
    assert (t.previous, t.role, t.epoch) == (Role.LEADER, Role.FENCED, 5)
    assert t.reason == "lease not renewed for 1.500 s"
    assert not m.may_accept(2.0) and m.fence_at is None
    assert m.due(2.0) is Action.RESIGN


def test_a_renewal_confirmed_after_the_fence_time_does_not_unfence() -> None:
    m = leader(granted_at=0.0)
    out = m.renewed(sent_at=1.4, now=1.6)  # it was sent in time, answered too late
    assert [t.role for t in out] == [Role.FENCED]
    assert m.role is Role.FENCED and not m.may_accept(1.6)


def test_a_slow_campaign_wins_nothing_to_lead_with() -> None:
    m = Leadership("a", "a:1", CFG)
    m.campaign_started(0.0)
    out = m.won(5, lease_granted_at=0.0, now=1.7)
    assert [t.role for t in out] == [Role.LEADER, Role.FENCED]
    assert not m.may_accept(1.7) and m.due(1.7) is Action.RESIGN


def test_lease_gone_at_etcd_ends_leadership_at_once() -> None:
    m = leader()
    [t] = m.renew_failed(0.6, lease_lost=True, reason="keepalive: no such lease")
    assert (t.role, m.leader) == (Role.FOLLOWER, None)
    assert not m.may_accept(0.6)
    assert m.due(0.6) is Action.OBSERVE  # learns who leads, but does not campaign before the hold-off
    assert m.due(0.6 + CFG.rejoin_after_s) is Action.CAMPAIGN


@pytest.mark.parametrize("holder", [OTHER, None], ids=["another-holder", "no-key"])
def test_a_leader_that_sees_the_key_gone_or_taken_is_deposed(holder: LeaderInfo | None) -> None:
    m = leader(epoch=5)
    [t] = m.observed(holder, 0.3)
    assert t.role is Role.FOLLOWER and t.reason.startswith("deposed")
    assert not m.may_accept(0.3)
    assert m.epoch == (7 if holder else 5) and m.leader == holder


def test_loser_follows_the_holder_and_campaigns_when_the_key_is_gone() -> None:
    m = Leadership("a", "a:1", CFG)
    m.campaign_started(0.0)
    [t] = m.lost(OTHER, 0.01)
    assert (t.role, m.leader, m.epoch) == (Role.FOLLOWER, OTHER, 7)
    assert m.due(0.05) is Action.NONE and m.due(0.11) is Action.OBSERVE
    m.observed(OTHER, 0.11)
    assert m.due(0.15) is Action.NONE
    m.caught_up(0.15)  # it followed the holder as a standby, in step (else it would wait orphan_after_s)
    m.observed(None, 0.21)
    assert m.leader is None and m.epoch == 7 and m.due(0.21) is Action.CAMPAIGN
    m.campaign_started(0.21)
    m.won(9, 0.21, 0.22)
    assert m.epoch == 9 and m.may_accept(0.22)


def test_a_failed_campaign_is_retried() -> None:
    m = Leadership("a", "a:1", CFG)
    m.observed(None, 0.0)
    m.campaign_started(0.0)
    [t] = m.campaign_failed(0.5, "connection refused")
    assert t.role is Role.FOLLOWER and t.reason == "campaign failed: connection refused"
    assert m.due(0.5) is Action.OBSERVE  # the key's next read was due meanwhile
    m.observe_failed(0.5)
    assert m.due(0.55) is Action.NONE and m.next_deadline() == pytest.approx(0.6)
    assert m.due(0.6) is Action.CAMPAIGN


def test_step_down_stops_accepting_at_once_and_resigns_until_it_works() -> None:
    m = leader()
    [t] = m.step_down(0.2)
    assert (t.role, m.may_accept(0.2)) == (Role.STEPPING_DOWN, False)
    assert m.due(0.2) is Action.RESIGN
    assert m.resign_failed(0.25) == []
    assert m.due(0.3) is Action.NONE and m.due(0.35) is Action.RESIGN
    [t] = m.resigned(0.4)
    assert (t.role, m.leader) == (Role.FOLLOWER, None)
    assert m.due(0.4) is Action.OBSERVE and m.due(0.4 + CFG.rejoin_after_s) is Action.CAMPAIGN
    assert m.step_down(0.5) == []  # not leading: nothing to do


def test_epochs_never_go_backwards() -> None:
    m = leader(epoch=5)
    m.step_down(0.1)
    m.resigned(0.2)
    m.observed(LeaderInfo("c", "c:1", 3), 0.3)  # an older read
    assert (m.epoch, m.leader) == (5, None)
    m.observed(LeaderInfo("c", "c:1", 8), 0.4)
    assert m.epoch == 8
    m.observed(None, 0.5)
    assert m.epoch == 8
    m.campaign_started(3.0)
    [t] = m.won(6, 3.0, 3.01)  # etcd's revisions went backwards (its data was lost)
    assert (t.role, m.epoch, m.may_accept(3.01)) == (Role.FENCED, 8, False)
    assert t.reason == "won epoch 6, not above the known epoch 8"
    assert m.due(3.01) is Action.RESIGN


def test_time_never_runs_backwards() -> None:
    m = leader()
    m.tick(1.6)
    assert m.role is Role.FENCED
    assert m.resigned(0.1)[0].at == 1.6  # an older `now` is taken as the latest


def test_an_input_for_another_state_is_refused_and_changes_nothing() -> None:
    m = leader()
    before = m.view()
    with pytest.raises(FailedPrecondition, match="won is an input for a candidate; this replica is leader"):
        m.won(9, 0.1, 0.1)
    with pytest.raises(FailedPrecondition):
        m.campaign_started(0.1)
    assert m.view() == before
    with pytest.raises(InvalidArgument):
        m.tick(math.nan)


def test_close_is_terminal() -> None:
    m = leader()
    [t] = m.close(0.1)
    assert (t.role, m.due(0.1), m.next_deadline(), m.may_accept(0.1)) == (Role.STOPPED, Action.NONE, None, False)
    assert m.close(0.2) == []


# --- epochs on messages -------------------------------------------------------------------------------------------


def test_a_stale_epoch_is_refused_with_the_current_one() -> None:
    m = Leadership("a", "a:1", CFG)
    m.campaign_started(0.0)
    m.lost(OTHER, 0.0)
    assert m.check_epoch(7) is EpochCheck.CURRENT
    with pytest.raises(FailedPrecondition) as e:
        m.require_epoch(6)
    assert e.value.code == "FAILED_PRECONDITION"
    assert str(e.value) == (
        "leadership epoch 6 is older than the current epoch 7 (leader b at b:1); "
        "find the current leader and resend with epoch 7"
    )
    assert m.require_epoch(9) is EpochCheck.AHEAD and m.epoch == 7  # a message never raises the epoch


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3"])
def test_compare_epoch_refuses_non_epochs(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        compare_epoch(bad, 3)  # type: ignore[arg-type]


# --- properties -----------------------------------------------------------------------------------------------------

_holders = st.one_of(
    st.none(),
    st.just("self"),
    st.builds(LeaderInfo, st.sampled_from(["b", "c"]), st.just("x:1"), st.integers(1, 60)),
)
_OPS = [
    "tick",
    "campaign",
    "won",
    "lost",
    "campaign_failed",
    "renewed",
    "renew_failed",
    "lease_lost",
    "observed",
    "observe_failed",
    "step_down",
    "resigned",
    "resign_failed",
]
_ops = st.lists(
    st.tuples(
        st.sampled_from(_OPS),
        st.floats(0.0, 1.2),  # time advance before the op
        st.floats(0.0, 1.0),  # how long before `now` a renewal or grant was sent
        st.integers(1, 60),  # an epoch
        _holders,
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(_ops)
def test_properties_over_random_histories(ops: list[tuple[str, float, float, int, object]]) -> None:
    """Whatever etcd answers and whenever: (1) the epoch never decreases; (2) the machine accepts only as leader,
    only before `fence_after_s` past the latest confirmed renewal (or grant) it was told of in its current term,
    and (3) never again in a term once fenced; (4) after a tick, something is due exactly when the deadline has
    come."""
    m = Leadership("a", "a:1", CFG)
    now, last_ok, fenced_epoch, epoch = 0.0, -math.inf, -1, 0
    for op, dt, ago, new_epoch, holder in ops:
        now += dt
        sent = now - ago
        role = m.role
        if op == "campaign" and role is Role.FOLLOWER:
            m.campaign_started(now)
        elif op == "won" and role is Role.CANDIDATE:
            m.won(new_epoch, sent, now)
            last_ok = sent
        elif op == "lost" and role is Role.CANDIDATE:
            m.lost(LeaderInfo("b", "b:1", new_epoch), now)
        elif op == "campaign_failed" and role is Role.CANDIDATE:
            m.campaign_failed(now, "x")
        elif op == "renewed":
            m.renewed(sent, now)
            last_ok = max(last_ok, sent)
        elif op == "renew_failed":
            m.renew_failed(now, False, "x")
        elif op == "lease_lost":
            m.renew_failed(now, True, "x")
        elif op == "observed":
            seen = LeaderInfo("a", "a:1", max(m.epoch, 1)) if holder == "self" else holder
            assert seen is None or isinstance(seen, LeaderInfo)
            m.observed(seen, now)
        elif op == "observe_failed":
            m.observe_failed(now)
        elif op == "step_down":
            m.step_down(now)
        elif op == "resigned":
            m.resigned(now)
        elif op == "resign_failed":
            m.resign_failed(now)
        else:
            m.tick(now)
        assert m.epoch >= epoch, "the epoch went backwards"
        epoch = m.epoch
        if m.role is Role.FENCED:
            fenced_epoch = m.epoch
        for q in (now, now + 0.25, now + 1.0, now + 2.0):
            if m.may_accept(q):
                assert m.role is Role.LEADER
                assert q < last_ok + CFG.fence_after_s, "accepting past the fence time"
                assert m.epoch > fenced_epoch, "accepting again in a fenced term"
        m.tick(now)
        deadline = m.next_deadline()
        assert (m.due(now) is Action.NONE) == (deadline is None or deadline > now)


# --- what the replica's process does (duty) -----------------------------------------------------------------
def test_duty_follows_the_role_and_a_replica_that_served_never_turns_back() -> None:
    m = Leadership("a", "a:1", CFG)
    assert duty(m.view(), serving=False) is Duty.WAIT  # nobody known: campaign first
    m.campaign_started(0.0)
    assert duty(m.view(), serving=False) is Duty.WAIT
    m.lost(OTHER, 0.01)
    assert duty(m.view(), serving=False) is Duty.FOLLOW and m.view().leader == OTHER
    m.observed(None, 3.0)  # the leader's key is gone: campaign, keep what it holds meanwhile
    assert duty(m.view(), serving=False) is Duty.WAIT
    m.campaign_started(3.0)
    m.won(9, 3.0, 3.01)
    assert duty(m.view(), serving=False) is Duty.SERVE  # promotion
    assert duty(m.view(), serving=True) is Duty.SERVE
    m.tick(3.0 + CFG.fence_after_s)  # fenced: may_accept is already false, and the server retires
    assert m.role is Role.FENCED and duty(m.view(), serving=True) is Duty.RETIRE
    m.resigned(5.0)
    assert duty(m.view(), serving=True) is Duty.RETIRE  # still retiring: its state may be behind the next leader
    assert duty(m.view(), serving=False) is Duty.WAIT


def test_duty_of_a_deposed_leader_and_of_a_stopped_replica() -> None:
    m = leader(epoch=5)
    m.observed(LeaderInfo("b", "b:1", 8), 0.2)
    assert duty(m.view(), serving=True) is Duty.RETIRE
    assert duty(m.view(), serving=False) is Duty.FOLLOW
    m.close(0.3)
    assert duty(m.view(), serving=False) is Duty.RETIRE
    # a replica restarted under its own id while its old key still lives waits for that key to go
    same = Leadership("a", "a:2", CFG)
    same.campaign_started(0.0)
    same.lost(LeaderInfo("a", "a:1", 4), 0.01)
    assert duty(same.view(), serving=False) is Duty.WAIT


def test_failover_goes_to_the_named_leader_else_round_robin() -> None:
    addrs = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert failover_target(addrs, "127.0.0.1:1", "connection refused") == "127.0.0.1:2"
    assert failover_target(addrs, "127.0.0.1:3", "") == "127.0.0.1:1"
    assert failover_target(addrs, "10.0.0.9:5", "") == "127.0.0.1:1"  # a hint followed earlier, not in the list
    named = "not the leader; leader is at 127.0.0.1:3"
    assert failover_target(addrs, "127.0.0.1:1", named) == "127.0.0.1:3"
    assert leader_hint("not the leader; leader is at [::1]:7070") == "[::1]:7070"
    assert leader_hint("not the leader; the leader is not known yet") == ""
    assert leader_hint("not the leader; leader is at evil host:1") == ""
    with pytest.raises(InvalidArgument):
        failover_target((), "a:1", "")


def test_coordinator_address_lists() -> None:
    assert coordinator_addresses("127.0.0.1:1") == ("127.0.0.1:1",)
    assert coordinator_addresses(" a:1, [::1]:2 ") == ("a:1", "[::1]:2")
    for bad, says in [
        ("", "HOST:PORT"),
        ("a:1,,b:2", "'' is not one"),
        ("a:1,nohost", "'nohost' is not one"),
        ("a:1,b :2", "is not one"),
        (",".join(f"h:{p}" for p in range(9)), "9 addresses; give up to 8"),
        ("a:" + "1" * 3000, "at most 2048 characters"),
    ]:
        with pytest.raises(InvalidArgument, match=says):
            coordinator_addresses(bad)


def test_an_announced_leader_stands_while_it_repeats_itself_and_lapses_when_it_goes_quiet() -> None:
    named = AnnouncedLeader()
    assert named.current(0.0) == (0, "")
    assert named.announce(7, "b:1", 100.0)  # a new leader: news
    assert not named.announce(3, "a:1", 101.0)  # a deposed leader's late word
    assert not named.announce(7, "c:1", 101.0)  # another address at the epoch that stands: the first word stands
    for t in range(1, 10):  # it repeats itself: it never lapses
        assert not named.announce(7, "b:1", 100.0 + t * ANNOUNCE_EVERY_S)
    last = 100.0 + 9 * ANNOUNCE_EVERY_S
    assert named.current(last + ANNOUNCED_FOR_S) == (7, "b:1")
    assert named.current(last + ANNOUNCED_FOR_S + 0.001) == (0, "")  # gone quiet: none named
    # a leadership store whose epochs started over: its leader is named, not held to epoch 7 forever
    assert named.announce(2, "a:1", last + ANNOUNCED_FOR_S + 1.0)
    assert named.current(last + ANNOUNCED_FOR_S + 1.0) == (2, "a:1")
    assert named.announce(9, "c:1", last + ANNOUNCED_FOR_S + 2.0)  # a higher epoch replaces it at once
    assert named.announce(9, "c:1", last + 3 * ANNOUNCED_FOR_S)  # back after a lapse: news again
