"""LearnerCore: every transition on a fake clock, the status-code table, and properties over random event orders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.coordinator import Lease, WorkPlan
from diloco.core.learner import (
    REACTIONS,
    STATUS_CODES,
    Deregister,
    Exit,
    ExitReason,
    FetchPlan,
    LearnerConfig,
    LearnerCore,
    LearnerState,
    Load,
    Reaction,
    Rebase,
    Register,
    Rpc,
    Submit,
    Train,
    Wait,
    react,
)
from diloco.core.ledger import ShardRange
from diloco.errors import ConfigError, InvalidArgument

H = 3
TOK = 10  # tokens per step


def state(core: LearnerCore) -> LearnerState:
    """The state, read through a call (mypy keeps an attribute narrowed across the event calls in between)."""
    return core.state


def plan(*shards: tuple[int, int, int], local_steps: int = H, seq: int = 1) -> WorkPlan:
    return WorkPlan(tuple(Lease(*s) for s in shards), local_steps, seq, 0)


def started(mode: str = "decoupled", version: int = 2, **cfg: float) -> LearnerCore:
    """A learner registered (epoch 7, worker w1, shards 0 and 1) that has loaded `version`."""
    core = LearnerCore(LearnerConfig(id_prefix="p-", **cfg))
    assert core.next_action(0.0) == Register()
    core.registered(0.0, "w1", 7, mode, plan((0, 1, 0), (1, 1, 100)))
    assert state(core) is LearnerState.WAITING_PARAMS
    assert core.next_action(0.0) == Wait(None)
    assert core.params_arrived(0.1, version, 7)
    assert core.next_action(0.1) == Load(version, version * H, reset_codec=False)
    assert state(core) is LearnerState.TRAINING
    return core


def train(core: LearnerCore, n: int, now: float = 1.0) -> None:
    for _ in range(n):
        a = core.next_action(now)
        assert isinstance(a, Train), a
        core.stepped(a.shard_id, a.epoch, a.cursor, a.cursor + TOK)


def submit(core: LearnerCore, now: float = 1.0) -> Submit:
    a = core.next_action(now)
    assert isinstance(a, Submit), a
    return a


# --- the status table ------------------------------------------------------------------------------------------
def test_every_rpc_has_a_reaction_for_every_status_code() -> None:
    for rpc in Rpc:
        assert set(REACTIONS[rpc]) == set(STATUS_CODES), rpc
    assert "OK" not in STATUS_CODES


@pytest.mark.parametrize(
    ("rpc", "code", "reaction"),
    [
        (Rpc.REGISTER, "UNAVAILABLE", Reaction.FAILOVER),
        (Rpc.REGISTER, "NOT_FOUND", Reaction.RETRY),
        (Rpc.REGISTER, "INVALID_ARGUMENT", Reaction.RETRY),
        (Rpc.REGISTER, "UNIMPLEMENTED", Reaction.RETRY),
        (Rpc.WATCH_PARAMETERS, "UNIMPLEMENTED", Reaction.RETRY),
        (Rpc.GET_WORK_PLAN, "NOT_FOUND", Reaction.REREGISTER),
        (Rpc.GET_WORK_PLAN, "FAILED_PRECONDITION", Reaction.REREGISTER),
        (Rpc.GET_WORK_PLAN, "DEADLINE_EXCEEDED", Reaction.RETRY),
        (Rpc.WATCH_PARAMETERS, "NOT_FOUND", Reaction.REREGISTER),
        (Rpc.SUBMIT, "UNAVAILABLE", Reaction.FAILOVER),
        (Rpc.WATCH_PARAMETERS, "UNAVAILABLE", Reaction.FAILOVER),
        (Rpc.GET_UPLOAD_STATUS, "UNAVAILABLE", Reaction.FAILOVER),
        (Rpc.HEARTBEAT, "UNAVAILABLE", Reaction.RETRY),  # healthd is not replicated
        (Rpc.SUBMIT, "RESOURCE_EXHAUSTED", Reaction.RETRY),
        (Rpc.SUBMIT, "FAILED_PRECONDITION", Reaction.RESYNC),
        (Rpc.SUBMIT, "NOT_FOUND", Reaction.REREGISTER),
        (Rpc.SUBMIT, "INVALID_ARGUMENT", Reaction.DROP_UPLOAD),
        (Rpc.GET_UPLOAD_STATUS, "NOT_FOUND", Reaction.RETRY),
        (Rpc.DEREGISTER, "NOT_FOUND", Reaction.SKIP),
        (Rpc.DEREGISTER, "UNAVAILABLE", Reaction.FAILOVER),
        (Rpc.HEARTBEAT, "UNIMPLEMENTED", Reaction.RETRY),
    ],
)
def test_reaction_examples(rpc: Rpc, code: str, reaction: Reaction) -> None:
    assert react(rpc, code) is reaction


def test_failover_retries_and_is_what_unavailable_means_for_every_coordinator_call() -> None:
    assert Reaction.FAILOVER.retries and Reaction.RETRY.retries and not Reaction.RESYNC.retries
    coordinator_calls = [rpc for rpc in Rpc if rpc is not Rpc.HEARTBEAT]
    assert all(react(rpc, "UNAVAILABLE") is Reaction.FAILOVER for rpc in coordinator_calls)
    assert react(Rpc.HEARTBEAT, "UNAVAILABLE") is Reaction.RETRY  # healthd is not replicated


def test_an_unknown_code_is_an_error() -> None:
    with pytest.raises(InvalidArgument, match="no reaction"):
        react(Rpc.REGISTER, "OK")


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        LearnerConfig(drain_timeout_s=0)
    with pytest.raises(ConfigError):
        LearnerConfig(plan_poll_initial_s=3, plan_poll_max_s=2)
    with pytest.raises(ConfigError):
        LearnerConfig(give_up_after_s=float("inf"))
    core = LearnerCore()
    with pytest.raises(InvalidArgument, match="round mode"):
        core.registered(0.0, "w1", 1, "eager", plan())


# --- training and submitting -----------------------------------------------------------------------------------
def test_decoupled_round_trip() -> None:
    core = started(version=2)
    train(core, H)
    s = submit(core)
    assert not s.drain
    d = s.draft
    assert (d.worker_id, d.coordinator_epoch, d.submission_id, d.base_version) == ("w1", 7, "p-1", 2)
    assert d.ranges == (ShardRange(0, 1, 0, 20), ShardRange(1, 1, 100, 110))
    assert (d.steps, d.tokens, d.plan_seq) == (H, H * TOK, 1)
    # keeps training while the upload is in flight, and past H_m while its round is pending
    train(core, H + 2)
    core.upload_accepted(2.0, "p-1", pending_round=3)
    assert core.awaiting == "p-1" and core.uploading is None
    train(core, 1)
    # the round is applied: rebase first, then submit against the new version
    assert core.params_arrived(3.0, 3, 7, applied=["p-1"])
    assert core.next_action(3.0) == Rebase(3)
    s2 = submit(core, 3.0)
    assert (s2.draft.submission_id, s2.draft.base_version, s2.draft.steps) == ("p-2", 3, H + 3)
    assert s2.draft.ranges[0].start == 20  # contiguous with the first submission


def test_a_version_at_least_the_pending_round_clears_the_wait_without_applied_ids() -> None:
    core = started()
    train(core, H)
    submit(core)
    core.upload_accepted(1.0, "p-1", pending_round=4)
    core.params_arrived(2.0, 3, 7)  # an earlier round: still waiting
    assert core.awaiting == "p-1"
    core.params_arrived(2.0, 4, 7)  # e.g. the watch skipped the broadcast that named it
    assert core.awaiting is None and core.can_submit


def test_an_already_applied_duplicate_clears_the_wait() -> None:
    core = started()
    train(core, H)
    submit(core)
    core.upload_accepted(1.0, "p-1", pending_round=3, applied=True)
    assert core.can_submit


def test_stale_or_foreign_versions_are_ignored() -> None:
    core = LearnerCore()
    assert not core.params_arrived(0.0, 5, 1)  # not registered
    core = started(version=2)
    assert not core.params_arrived(1.0, 2, 7)
    assert not core.params_arrived(1.0, 1, 7)
    assert core.next_action(1.0) == Train(0, 1, 0)


def test_a_newer_version_mid_training_rebases_in_every_mode() -> None:
    for mode in ("sync", "decoupled", "async"):
        core = started(mode)
        train(core, 1)
        core.params_arrived(1.0, 3, 7)
        assert core.next_action(1.0) == Rebase(3)
        assert core.base_version == 3
        assert core.progress.steps == 1  # the step is kept


def test_sync_waits_for_the_round_then_loads() -> None:
    core = started("sync", version=2)
    train(core, H)
    submit(core)
    assert state(core) is LearnerState.WAITING_ROUND
    assert core.next_action(1.0) == Wait(None)
    core.upload_accepted(1.5, "p-1", pending_round=3)
    assert core.next_action(1.5) == Wait(None)
    core.params_arrived(2.0, 3, 7, applied=["p-1"])
    assert core.next_action(2.0) == Load(3, 0, reset_codec=False)
    assert state(core) is LearnerState.TRAINING
    train(core, 1, 2.0)


def test_sync_rounds_are_exactly_h_steps_even_when_the_version_outruns_the_upload_answer() -> None:
    core = started("sync", version=2)
    train(core, H)
    submit(core)
    # the coordinator closed the round inside the upload call and broadcast it before answering
    core.params_arrived(2.0, 3, 7, applied=["p-1"])
    assert core.next_action(2.0) == Load(3, 0, reset_codec=False)
    train(core, H, 2.0)
    assert core.next_action(2.0) == Wait(None)  # H steps done, the last upload's answer still due: no step H+1
    core.upload_accepted(2.5, "p-1", pending_round=3)
    assert submit(core, 2.5).draft.steps == H


def test_the_broadcast_plan_is_adopted() -> None:
    core = started()
    train(core, 1)
    core.params_arrived(1.0, 3, 7, plan=plan((0, 1, 0), (5, 2, 40), local_steps=5, seq=9))
    assert core.next_action(1.0) == Rebase(3)
    assert core.local_steps == 5 and core.plan_seq == 9
    assert core.progress.cursors == {0: (1, 10), 5: (2, 40)}
    assert core.steps_to_submit == 4


def test_asking_again_before_stepping_proposes_the_same_batch() -> None:
    core = started()
    assert core.next_action(1.0) == core.next_action(1.5) == Train(0, 1, 0)  # e.g. the simulator, asking early
    core.stepped(0, 1, 0, TOK)
    assert core.next_action(1.0) == core.next_action(1.0) == Train(1, 1, 100)
    core.plan_received(1.0, plan((0, 1, 0), (1, 2, 500)))  # shard 1 re-leased: the proposal is withdrawn
    assert core.next_action(1.0) == Train(0, 1, 10)


# --- without shards ---------------------------------------------------------------------------------------------
def test_a_learner_without_shards_polls_with_capped_backoff() -> None:
    core = LearnerCore(LearnerConfig(plan_poll_initial_s=0.1, plan_poll_max_s=0.4))
    core.next_action(0.0)
    core.registered(0.0, "w1", 1, "decoupled", plan())
    core.params_arrived(0.0, 0, 1)
    assert core.next_action(0.0) == Load(0, 0, reset_codec=False)
    assert state(core) is LearnerState.SHARDLESS
    assert core.next_action(0.0) == Wait(0.1)
    assert core.next_deadline() == 0.1
    now, gaps = 0.1, []
    for _ in range(5):
        assert core.next_action(now) == FetchPlan()
        core.plan_received(now, plan())
        wait = core.next_action(now)
        assert isinstance(wait, Wait) and wait.until is not None
        gaps.append(round(wait.until - now, 3))
        now = wait.until
    assert gaps == [0.2, 0.4, 0.4, 0.4, 0.4]
    core.plan_received(now, plan((3, 1, 0)))
    assert core.next_action(now) == Train(3, 1, 0)


def test_shards_in_a_broadcast_end_the_polling() -> None:
    core = LearnerCore()
    core.registered(0.0, "w1", 1, "decoupled", plan())
    core.params_arrived(0.0, 0, 1)
    core.next_action(0.0)
    core.params_arrived(0.5, 1, 1, plan=plan((2, 1, 0)))
    assert core.next_action(0.5) == Rebase(1)
    assert core.next_action(0.5) == Train(2, 1, 0)


def test_losing_every_shard_asks_for_a_plan_at_once() -> None:
    core = started()
    train(core, 1)
    core.plan_received(1.0, plan())
    assert core.next_action(1.0) == FetchPlan()
    assert state(core) is LearnerState.SHARDLESS


# --- refusals, re-registration, epochs -------------------------------------------------------------------------
@pytest.mark.parametrize("reaction", [Reaction.RESYNC, Reaction.DROP_UPLOAD])
def test_a_refused_upload_resyncs(reaction: Reaction) -> None:
    core = started(version=2)
    train(core, H)
    submit(core)
    train(core, 2)
    core.params_arrived(1.0, 4, 7)
    core.upload_failed(1.0, "p-1", reaction, "stale")
    assert state(core) is LearnerState.RESYNCING and core.detail == "stale"
    assert core.next_action(1.0) == Load(4, 0, reset_codec=True)
    assert core.progress.steps == 0 and core.can_submit
    assert core.next_action(1.0) == FetchPlan()
    core.plan_received(1.1, plan((0, 1, 20), (1, 1, 110)))
    assert core.next_action(1.1) in (Train(0, 1, 20), Train(1, 1, 110))  # the ledger's cursors


def test_an_upload_outcome_for_another_submission_is_ignored() -> None:
    core = started()
    train(core, H)
    submit(core)
    core.upload_failed(1.0, "other", Reaction.RESYNC)
    core.upload_accepted(1.0, "other", 3)
    assert core.uploading == "p-1" and state(core) is LearnerState.TRAINING


@pytest.mark.parametrize(
    "event",
    [
        lambda c: c.upload_failed(1.0, "p-1", Reaction.REREGISTER),
        lambda c: c.rpc_failed(1.0, Rpc.GET_WORK_PLAN, "NOT_FOUND"),
        lambda c: c.rpc_failed(1.0, Rpc.WATCH_PARAMETERS, "FAILED_PRECONDITION"),
        lambda c: c.params_arrived(1.0, 9, 8),  # a new coordinator epoch, without this learner's plan
        lambda c: c.params_arrived(1.0, 9, 6, plan((0, 1, 0))),  # an older one, even with a plan
        lambda c: c.session_ended(1.0, "declared dead by healthd"),
    ],
)
def test_losing_the_registration_registers_again(event: object) -> None:
    core = started()
    train(core, H)
    submit(core)
    event(core)  # type: ignore[operator]
    assert state(core) is LearnerState.UNREGISTERED
    assert core.worker_id == "" and core.progress.steps == 0 and core.can_submit
    assert core.next_action(1.0) == Register()
    core.registered(1.0, "w2", 8, "decoupled", plan((4, 2, 0)))
    core.params_arrived(1.0, 9, 8)
    assert core.next_action(1.0) == Load(9, 9 * H, reset_codec=False)  # a new session catches the LR up again
    assert core.next_action(1.0) == Train(4, 2, 0)


def test_a_leader_that_took_the_learner_over_keeps_the_registration_and_the_unsent_steps() -> None:
    """A standby took over with the learner table (ALGORITHM.md section 11): its broadcast comes under a higher
    epoch with this learner's plan. The learner stays registered, adopts the epoch for its next submission and keeps
    training where it was."""
    core = started()
    train(core, 3)
    assert not core.params_arrived(1.0, 2, 9, plan((0, 1, 3 * TOK), (1, 1, 100)))  # the version it holds
    assert core.worker_id == "w1" and core.coordinator_epoch == 9 and state(core) is LearnerState.TRAINING
    assert core.progress.steps == 3
    train(core, H - 3)
    d = submit(core).draft
    assert (d.worker_id, d.coordinator_epoch, d.base_version) == ("w1", 9, 2)
    assert d.ranges[0].start == 0  # the steps trained before the takeover are in it
    assert core.params_arrived(1.0, 3, 9)  # later versions of that leader as usual
    assert core.next_action(1.0) == Rebase(3)


def test_a_leader_that_took_over_behind_the_versions_received_makes_the_learner_resync() -> None:
    """The new leader's standby did not hold a version the learner received (asynchronous replication): what the
    learner trained since is void; it loads the leader's version and fetches its plan, still registered."""
    core = started(version=4)
    train(core, 2)
    assert core.params_arrived(1.0, 3, 9, plan((0, 1, 0), (1, 1, 100)))
    assert core.worker_id == "w1" and core.coordinator_epoch == 9 and state(core) is LearnerState.RESYNCING
    assert core.next_action(1.0) == Load(3, 0, reset_codec=True)
    assert core.progress.steps == 0 and core.base_version == 3
    assert core.next_action(1.0) == FetchPlan()


@pytest.mark.parametrize("applied_by_new_leader", [False, True])
def test_a_takeover_settles_the_accepted_submission_the_learner_waits_for(applied_by_new_leader: bool) -> None:
    """The old leader accepted the learner's submission for round 3 and died before closing it. A new leader at
    version 2 never applies it (its ledger rolled the cursors back): the learner resyncs instead of waiting for
    round 3, which it would do for good (no submission while one waits: the job stalled at quorum). A new leader
    at version 3 holds that round: the submission is applied, and the learner goes on."""
    core = started()
    train(core, H)
    submit(core)
    core.upload_accepted(1.0, "p-1", 3)
    assert not core.can_submit
    at = 3 if applied_by_new_leader else 2
    core.params_arrived(1.0, at, 9, plan((0, 1, H * TOK), (1, 1, 100)))
    assert core.worker_id == "w1" and core.coordinator_epoch == 9
    if applied_by_new_leader:
        assert core.can_submit and core.next_action(1.0) == Rebase(3)
    else:
        assert state(core) is LearnerState.RESYNCING
        assert core.next_action(1.0) == Load(2, 0, reset_codec=True)
        assert core.next_action(1.0) == FetchPlan() and core.can_submit


def test_a_submission_the_new_leader_accepted_before_its_first_broadcast_is_waited_for() -> None:
    """The learner's upload reached the new leader (epoch 9) before that leader's first broadcast reached the
    learner: the acceptance names epoch 9, so the takeover keeps it (the new leader holds it for round 3) and the
    learner trains on instead of throwing its steps away."""
    core = started()
    train(core, H)
    submit(core)
    core.upload_accepted(1.0, "p-1", 3, epoch=9)
    train(core, 2)
    assert not core.params_arrived(1.0, 2, 9, plan((0, 1, H * TOK), (1, 1, 100)))  # the version it holds
    assert state(core) is LearnerState.TRAINING and core.progress.steps == 2 and not core.can_submit
    assert core.params_arrived(1.0, 3, 9)  # round 3 closed at the new leader: applied
    assert core.can_submit and core.next_action(1.0) == Rebase(3)


def test_an_upload_in_flight_at_the_takeover_is_not_void_its_outcome_decides() -> None:
    """The upload follows the leader: a takeover while it is in flight leaves it alone. Accepted there, it is waited
    for; an acceptance that comes from the old leader after the takeover (a late reply) is void: resync."""
    for epoch, resyncs in ((9, False), (7, True)):
        core = started()
        train(core, H)
        submit(core)
        core.params_arrived(1.0, 2, 9, plan((0, 1, H * TOK), (1, 1, 100)))
        assert state(core) is LearnerState.TRAINING and core.uploading == "p-1"
        core.upload_accepted(1.0, "p-1", 3, epoch=epoch)
        assert (state(core) is LearnerState.RESYNCING) is resyncs
        if resyncs:
            assert core.next_action(1.0) == Load(2, 0, reset_codec=True) and core.can_submit
        else:
            assert core.awaiting == "p-1" and core.awaiting_round == 3


def test_a_learner_that_cannot_submit_trains_at_most_max_unsent_rounds_then_waits() -> None:
    """Its upload is stuck (an outage): it trains on up to `max_unsent_rounds` submissions' worth of steps (the
    ledger would refuse a longer range, voiding all of it), then waits for the upload's outcome or a version."""
    core = started(max_unsent_rounds=2)
    train(core, H)
    submit(core)
    train(core, 2 * H)
    assert core.next_action(1.0) == Wait(None) and core.progress.steps == 2 * H
    core.upload_accepted(1.0, "p-1", 3)
    assert core.params_arrived(1.0, 3, 7)
    assert core.next_action(1.0) == Rebase(3)
    assert isinstance(core.next_action(1.0), Submit)  # the 2 H steps waiting go out at once
    with pytest.raises(ConfigError):
        LearnerConfig(max_unsent_rounds=0)


def test_retryable_failures_change_nothing_but_the_give_up_clock() -> None:
    core = started()
    assert core.rpc_failed(1.0, Rpc.GET_WORK_PLAN, "UNAVAILABLE") is Reaction.FAILOVER
    assert core.rpc_failed(1.0, Rpc.REGISTER, "NOT_FOUND") is Reaction.RETRY
    assert state(core) is LearnerState.TRAINING and core.failing_since == 1.0
    assert core.next_deadline() is None  # never gives up by default
    assert isinstance(core.next_action(1e9), Train)


@pytest.mark.parametrize("rpc", [r for r in Rpc if r is not Rpc.DEREGISTER])
def test_no_status_ends_a_learner(rpc: Rpc) -> None:
    """Issue #16: whatever a call answers, a learner that is not leaving never exits on it."""
    for code in STATUS_CODES:
        core = started()
        assert react(rpc, code) is not Reaction.SKIP, (rpc, code)
        core.rpc_failed(1.0, rpc, code)
        assert not isinstance(core.next_action(1e9), Exit), (rpc, code)


def test_give_up_after_an_outage_only() -> None:
    core = LearnerCore(LearnerConfig(give_up_after_s=10.0))
    assert core.next_action(0.0) == Register()
    core.rpc_failed(0.0, Rpc.REGISTER, "UNAVAILABLE")
    assert core.next_deadline() == 10.0
    assert core.next_action(9.9) == Register()
    core.contact(9.9)  # the coordinator answered: the clock starts over
    core.rpc_failed(12.0, Rpc.REGISTER, "UNAVAILABLE")
    assert core.next_action(21.9) == Register()
    assert not core.give_up_due(21.9) and core.give_up_due(22.0)
    a = core.next_action(22.0)
    assert isinstance(a, Exit) and (a.reason, a.code) == (ExitReason.GAVE_UP, 1)


# --- draining and finishing ------------------------------------------------------------------------------------
def test_stop_waits_for_the_upload_then_hands_back_the_rest_and_deregisters() -> None:
    core = started()
    train(core, H)
    submit(core)
    train(core, 2)
    core.stop(1.0)
    assert state(core) is LearnerState.DRAINING
    assert core.next_action(1.0) == Wait(31.0)
    assert core.next_deadline() == 31.0
    core.upload_accepted(2.0, "p-1", 3)
    s = submit(core, 2.0)
    assert s.drain and s.draft.steps == 2  # may join any round: it does not wait for p-1's round
    assert core.next_action(2.0) == Wait(31.0)
    core.upload_accepted(3.0, s.draft.submission_id, 3)
    assert core.next_action(3.0) == Deregister("w1")
    assert core.next_action(3.0) == Exit(ExitReason.STOPPED, 0, "")


def test_the_drain_deadline_bounds_the_wait() -> None:
    core = started()
    train(core, H)
    submit(core)
    core.stop(1.0)
    assert core.next_action(30.9) == Wait(31.0)
    assert core.next_action(31.0) == Deregister("w1")


def test_stop_without_work_or_registration() -> None:
    core = started()
    core.stop(1.0)
    assert core.next_action(1.0) == Deregister("w1")
    core.rpc_failed(1.0, Rpc.DEREGISTER, "NOT_FOUND")
    assert core.next_action(1.0) == Exit(ExitReason.STOPPED, 0, "")
    idle = LearnerCore()
    idle.stop(0.0)
    assert idle.next_action(0.0) == Exit(ExitReason.STOPPED, 0, "")


def test_a_refused_hand_back_still_deregisters() -> None:
    core = started()
    train(core, 2)
    core.stop(1.0)
    s = submit(core)
    core.upload_failed(1.5, s.draft.submission_id, Reaction.RESYNC)
    assert state(core) is LearnerState.DRAINING
    assert core.next_action(1.5) == Deregister("w1")


def test_a_finished_job_deregisters_without_handing_back() -> None:
    core = started()
    train(core, 2)
    core.params_arrived(1.0, 3, 7, finished=True)
    assert core.next_action(1.0) == Deregister("w1")
    assert core.next_action(1.0) == Exit(ExitReason.FINISHED, 0, "")


@pytest.mark.parametrize("epoch", [7, 8])  # the same leader, or a new one that took the learner over there
def test_a_job_finished_at_the_version_held_ends_the_learner(epoch: int) -> None:
    """A leader that resumes at the job's target after a failover publishes no newer version: the header of the
    version the learner holds, saying finished, is the only word it gets."""
    core = started(version=3)
    train(core, 2)
    taken_over = plan((0, 1, 2), (1, 1, 102)) if epoch != 7 else None
    assert not core.params_arrived(1.0, 3, epoch, taken_over, finished=True)
    assert core.next_action(1.0) == Deregister("w1")
    assert core.next_action(1.0) == Exit(ExitReason.FINISHED, 0, "")


def test_forgotten_while_draining_exits_without_deregistering() -> None:
    core = started()
    train(core, H)
    submit(core)
    core.stop(1.0)
    core.upload_failed(1.0, "p-1", Reaction.REREGISTER)
    assert core.next_action(1.0) == Exit(ExitReason.STOPPED, 0, "")


# --- properties ------------------------------------------------------------------------------------------------
EVENTS = st.lists(
    st.sampled_from(["act", "act", "act", "accept", "refuse", "broadcast", "applied_broadcast", "plan", "forget"]),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(EVENTS, st.sampled_from(["sync", "decoupled", "async"]))
def test_at_most_one_outstanding_submission_and_contiguous_ranges(events: list[str], mode: str) -> None:
    core = started(mode, version=1)
    version, epoch = 1, 7
    committed: dict[int, int] = {0: 0, 1: 100}  # what the ledger would hold, for uncontested accepted ranges
    in_flight: list[Submit] = []
    now = 1.0
    for e in events:
        now += 0.1
        if e == "act":
            a = core.next_action(now)
            if isinstance(a, Train):
                core.stepped(a.shard_id, a.epoch, a.cursor, a.cursor + TOK)
            elif isinstance(a, Submit):
                assert not in_flight, "a second submission while one is outstanding"
                in_flight.append(a)
            elif isinstance(a, Register):
                core.registered(now, "w1", epoch, mode, plan((0, 1, committed[0]), (1, 1, committed[1])))
            elif isinstance(a, FetchPlan):
                core.plan_received(now, plan((0, 1, committed[0]), (1, 1, committed[1])))
        elif e == "accept" and in_flight and core.uploading == in_flight[0].draft.submission_id:
            for r in in_flight[0].draft.ranges:
                assert r.start == committed[r.shard_id], "a range that does not start at the committed cursor"
                committed[r.shard_id] = r.end
            core.upload_accepted(now, in_flight[0].draft.submission_id, version + 1)
        elif e == "refuse" and in_flight and core.uploading == in_flight[0].draft.submission_id:
            core.upload_failed(now, in_flight.pop().draft.submission_id, Reaction.RESYNC)
        elif e in ("broadcast", "applied_broadcast"):
            version += 1
            applied = [s.draft.submission_id for s in in_flight] if e == "applied_broadcast" else []
            core.params_arrived(now, version, epoch, applied=applied)
            if core.awaiting is None and core.uploading is None:
                in_flight.clear()
        elif e == "plan":
            core.plan_received(now, plan((0, 1, committed[0]), (1, 1, committed[1])))
        elif e == "forget":
            core.session_ended(now, "forgotten")
            epoch += 1
            in_flight.clear()
        if core.awaiting is None and core.uploading is None:
            in_flight.clear()
        assert core.state is not LearnerState.DONE
        assert core.base_version <= core.latest_version
