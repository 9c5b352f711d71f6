"""Streaming fragments (diloco.core.fragments): layout, schedule, the fragmented coordinator (outer step per
fragment, bad input refused without a change, checkpoints), the learner core's schedule and rebases, the trainer's
per-range submit and rebase, the simulator (`--fragments`) and the peak link bandwidth."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.cli.main import main
from diloco.core.coordinator import CoordinatorConfig, Lease, Submission, SubmissionRejected, WorkPlan
from diloco.core.fragments import (
    FragmentedCoordinator,
    FragmentLayout,
    FragmentShadows,
    FragmentSubmission,
    check_fragments,
    first_fragment,
    schedule_gap,
)
from diloco.core.guard import GuardConfig
from diloco.core.learner import LearnerCore, LearnerState, Load, Rebase, Submit, Train, Wait
from diloco.core.ledger import ShardRange
from diloco.core.merge import Segment
from diloco.core.outer import Nesterov, OuterConfig
from diloco.core.rounds import RoundConfig
from diloco.errors import AlreadyExists, ConfigError, InvalidArgument
from diloco.sim.config import SimConfig, parse_failures
from diloco.sim.engine import Simulator, simulate
from diloco.sim.links import Transfer, link_peaks, peak_rate
from diloco.task.factory import build_task
from diloco.task.inner import InnerTrainer, LocalParams
from diloco.task.model import GPT
from diloco.task.params import merge_segments, param_specs
from tests.support import tiny_task

SIZES = (6, 2, 2, 10, 4)  # numel of five tensors: 24 values


# --- layout and schedule -----------------------------------------------------------------------------------------
def test_layout_cuts_at_tensor_boundaries_balanced_by_numel() -> None:
    assert FragmentLayout.balanced(SIZES, 1).bounds == (0, 24)
    assert FragmentLayout.balanced(SIZES, 2).bounds == (0, 10, 24)  # 10 | 14: the boundary nearest 12
    four = FragmentLayout.balanced(SIZES, 4)
    assert four.bounds == (0, 6, 10, 20, 24)
    assert FragmentLayout.balanced(SIZES, 5).bounds == (0, 6, 8, 10, 20, 24)  # one tensor each
    assert [four.size(p) for p in range(4)] == [6, 4, 10, 4]
    segments = [Segment(o, n) for o, n in zip((0, 6, 8, 10, 20), SIZES, strict=True)]
    assert four.segments(segments, 2) == [Segment(0, 10)]
    assert FragmentLayout.of_segments(segments, 4) == four
    flat = torch.arange(24.0)
    four.view(flat, 1).zero_()
    assert flat[6:10].eq(0).all() and flat[10] == 10  # a view: writes reach the flat vector


def test_layout_fingerprint_is_stable_and_tells_layouts_apart() -> None:
    a, b = FragmentLayout.balanced(SIZES, 2), FragmentLayout.balanced(SIZES, 4)
    assert a.fingerprint == FragmentLayout((0, 10, 24)).fingerprint and len(a.fingerprint) == 16
    assert a.fingerprint != b.fingerprint
    with pytest.raises(InvalidArgument, match="not the coordinator's"):
        a.check_fingerprint(b.fingerprint)
    for bad in (-1, 2, 1.0, True, "0"):
        with pytest.raises(InvalidArgument, match="out of range"):
            a.check_index(bad)
    with pytest.raises(ConfigError, match="increase strictly"):
        FragmentLayout((0, 5, 5))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.data())
def test_balanced_layouts_cover_the_vector_in_whole_tensors(sizes: list[int], data: st.DataObject) -> None:
    p = data.draw(st.integers(1, len(sizes)))
    layout = FragmentLayout.balanced(sizes, p)
    ends = {0, *itertools.accumulate(sizes)}
    assert layout.fragments == p and layout.numel == sum(sizes)
    assert set(layout.bounds) <= ends  # cut only at tensor boundaries, every fragment non-empty (bounds increase)


@pytest.mark.parametrize(
    ("p", "h", "tensors", "message"),
    [
        (0, 10, 5, "integer >= 1"),
        (-2, 10, 5, "integer >= 1"),
        (2.0, 10, 5, "integer >= 1"),
        (True, 10, 5, "integer >= 1"),
        ("2", 10, 5, "integer >= 1"),
        (4, 3, 5, r"<= H \(local_steps = 3\)"),
        (6, 10, 5, "5 parameter tensors"),
    ],
)
def test_bad_fragment_counts_are_refused_with_a_message(p: object, h: int, tensors: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_fragments(p, h, tensors)


@pytest.mark.parametrize(("h", "p"), [(10, 4), (12, 4), (40, 4), (7, 2), (5, 5), (9, 1)])
def test_fragment_p_is_due_at_steps_p_times_floor_h_over_p_mod_h(h: int, p: int) -> None:
    gaps = [schedule_gap(f, p, h) for f in range(p)]
    assert sum(gaps) == h and min(gaps) >= 1
    t, fragment = 0, first_fragment([0] * p)
    for _ in range(3 * p):  # three cycles from the start
        t += schedule_gap(fragment, p, h)
        assert t % h == fragment * (h // p) % h
        fragment = (fragment + 1) % p
    assert schedule_gap(0, 4, 2) == schedule_gap(3, 4, 2) == 1  # a slow learner's H_m below P


def test_a_joiner_starts_after_the_most_recently_stepped_fragment() -> None:
    assert first_fragment([0, 0, 0, 0]) == 1  # fragment 0 is due at step H
    assert first_fragment([5, 6, 4, 3]) == 2
    assert first_fragment([8, 5, 6, 7]) == 1
    assert first_fragment([4, 4, 3, 2]) == 2  # one round stepped 0 and 1: next is 2
    assert first_fragment([3]) == 0


# --- the fragmented coordinator ----------------------------------------------------------------------------------
def fragmented(mode: str = "sync", workers: int = 2) -> FragmentedCoordinator:
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode=mode, min_quorum=workers, grace_max_s=1.0),
        local_steps=4,
        min_local_steps=2,
        expected_workers=workers,
    )
    layout = FragmentLayout.balanced(SIZES, 2)
    return FragmentedCoordinator(cfg, torch.zeros(24), [1000] * 4, layout)


def frag_sub(f: FragmentedCoordinator, worker: str, sid: str, fragment: int, tokens: int = 10) -> FragmentSubmission:
    plan = f.core.plan(worker)
    lease = plan.shards[0]
    state = f.core.ledger.state(lease.shard_id)
    rng = ShardRange(lease.shard_id, lease.epoch, state.accepted, state.accepted + tokens)
    sub = Submission(worker, sid, f.core.version, tokens, 2, (rng,), plan.plan_seq)
    return FragmentSubmission(sub, fragment, f.layout.fingerprint)


def test_a_round_steps_only_the_fragments_submitted_with_their_own_momentum() -> None:
    f = fragmented()
    a, b = f.core.register("a", 0.0).worker_id, f.core.register("b", 0.0).worker_id
    da, db = torch.full((14,), 1.0), torch.full((14,), 3.0)
    assert f.accept(frag_sub(f, a, "a1", 1), da, 1.0).applied is None
    done = f.accept(frag_sub(f, b, "b1", 1, tokens=30), db, 1.0).applied
    assert done is not None and done.version == 1 and done.tokens == 40
    merged = (10 * da + 30 * db) / 40
    expect, ref = torch.zeros(14), Nesterov(0.7, 0.9)
    ref.step(expect, merged.clone())
    assert torch.equal(f.core.params[10:], expect)
    assert f.core.params[:10].eq(0).all()  # fragment 0 was not in the round
    assert f.fragment_versions == [0, 1] and f.fragment_steps == [0, 1] and f.stepped_in(1) == [1]
    assert f.core.tokens_applied == 40  # every token once
    # the next round steps fragment 0 with its own (fresh) momentum; fragment 1's is untouched
    f.accept(frag_sub(f, a, "a2", 0), torch.ones(10), 2.0)
    done = f.accept(frag_sub(f, b, "b2", 0), torch.ones(10), 2.0).applied
    assert done is not None and f.fragment_versions == [2, 1] and f.stepped_in(2) == [0]
    assert torch.allclose(f.core.params[:10], torch.full((10,), -0.7 * 1.9))
    assert torch.equal(f.core.params[10:], expect)
    assert f.core.tokens_applied == 60


def test_a_partial_decoupled_round_takes_a_partial_step_per_fragment() -> None:
    f = FragmentedCoordinator(
        CoordinatorConfig(
            rounds=RoundConfig(mode="decoupled", min_quorum=1, grace_max_s=1.0),
            outer=OuterConfig("fedavg", 1.0, 0.0),
            local_steps=4,
            min_local_steps=2,
            expected_workers=2,
        ),
        torch.zeros(24),
        [1000] * 4,
        FragmentLayout.balanced(SIZES, 2),
    )
    a = f.core.register("a", 0.0).worker_id
    b = f.core.register("b", 0.0).worker_id
    assert f.accept(frag_sub(f, a, "a1", 1), torch.ones(14), 1.0).applied is None  # b is still expected
    done = f.poll(2.5)  # the grace window passed without b
    assert done is not None and done.reason.value == "quorum_grace"
    gap = schedule_gap(1, 2, f.core.plan(b).local_steps)
    assert torch.allclose(f.core.params[10:], torch.full((14,), -2 / (2 + gap)))  # 2 steps in, b's gap missing
    assert f.core.params[:10].eq(0).all()


def snapshot_of(f: FragmentedCoordinator) -> tuple[object, ...]:
    return (
        f.core.params.tolist(),
        f.core.ledger.snapshot(),
        f.core.version,
        list(f.core.receipts),
        list(f.fragment_versions),
        [acc.count for acc in f.accs],
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"fragment": 2}, InvalidArgument, "fragment index 2 is out of range"),
        ({"fragment": -1}, InvalidArgument, "out of range"),
        ({"fingerprint": "0123456789abcdef"}, InvalidArgument, "is not the coordinator's"),
        ({"length": 10}, InvalidArgument, "the fragment has 14"),
    ],
)
def test_bad_fragment_submissions_are_refused_and_change_nothing(
    change: dict[str, object], error: type[Exception], message: str
) -> None:
    f = fragmented()
    a = f.core.register("a", 0.0).worker_id
    f.core.register("b", 0.0)
    f.accept(frag_sub(f, a, "a0", 0), torch.ones(10), 0.5)  # something pending
    before = snapshot_of(f)
    fs = frag_sub(f, a, "a1", 1)
    fs = dataclasses.replace(fs, **{k: v for k, v in change.items() if k != "length"})  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        f.accept(fs, torch.ones(int(change.get("length", 14))), 1.0)  # type: ignore[call-overload]
    assert snapshot_of(f) == before


def test_a_duplicate_fragment_submission_is_never_applied_twice() -> None:
    f = fragmented()
    a, b = f.core.register("a", 0.0).worker_id, f.core.register("b", 0.0).worker_id
    first = frag_sub(f, a, "a1", 1)
    f.accept(first, torch.ones(14), 1.0)
    before = snapshot_of(f)
    with pytest.raises(AlreadyExists):
        f.accept(first, torch.ones(14), 1.0)
    assert snapshot_of(f) == before
    f.accept(frag_sub(f, b, "b1", 1), torch.ones(14), 1.0)
    with pytest.raises(AlreadyExists):  # applied now: still refused
        f.accept(first, torch.ones(14), 2.0)
    assert f.core.tokens_applied == 20


def test_the_norm_guard_judges_each_fragment_against_its_own_median() -> None:
    """Fragments' per-step norms differ (sizes, layers): fragment 1's ten times fragment 0's is no outlier, while
    ten times fragment 1's own median still is."""
    cfg = CoordinatorConfig(
        rounds=RoundConfig(mode="async"),
        local_steps=4,
        min_local_steps=2,
        guard=GuardConfig(outlier_factor=5.0, min_samples=2),
    )
    f = FragmentedCoordinator(cfg, torch.zeros(24), [1000] * 4, FragmentLayout.balanced(SIZES, 2))
    a = f.core.register("a", 0.0).worker_id
    for i in range(3):
        f.accept(frag_sub(f, a, f"s{i}", 0), torch.full((10,), 1e-3), 1.0 + i)
    assert f.accept(frag_sub(f, a, "big", 1), torch.full((14,), 1e-2), 5.0).applied is not None
    f.accept(frag_sub(f, a, "big2", 1), torch.full((14,), 1e-2), 6.0)
    with pytest.raises(SubmissionRejected, match="median"):
        f.accept(frag_sub(f, a, "huge", 1), torch.full((14,), 1.0), 7.0)
    # a fragment's pseudo-gradient holds every step since the learner's last submission of it: the submission's own
    # steps (2) and those of its accepted submissions of the other fragment since ("big", "big2": 2 steps each)
    fs = frag_sub(f, a, "next", 0)
    assert f.steps_behind(fs) == 2 + 4 and f.check(fs, torch.full((10,), 1.0)) == pytest.approx(10**0.5 / 6)
    g = FragmentedCoordinator(cfg, torch.zeros(24), [1000] * 4, FragmentLayout.balanced(SIZES, 2))
    g.restore(f.snapshot())
    assert [x.snapshot() for x in g.guards] == [x.snapshot() for x in f.guards] and g.guards[1].warm


def test_checkpoint_round_trip_keeps_per_fragment_state_and_refuses_another_layout() -> None:
    f = fragmented()
    a, b = f.core.register("a", 0.0).worker_id, f.core.register("b", 0.0).worker_id
    for fragment, sid in ((1, "1"), (0, "2"), (1, "3")):
        f.accept(frag_sub(f, a, "a" + sid, fragment), torch.rand(f.layout.size(fragment)), 1.0)
        f.accept(frag_sub(f, b, "b" + sid, fragment), torch.rand(f.layout.size(fragment)), 1.0)
    snap = f.snapshot()
    g = fragmented()
    g.restore(snap)
    assert torch.equal(g.core.params, f.core.params) and g.core.version == 3
    assert g.fragment_versions == [2, 3] and g.fragment_steps == [1, 2]
    for mine, theirs in zip(g.outers, f.outers, strict=True):
        assert torch.equal(mine.state_dict()["buf"], theirs.state_dict()["buf"])
    other = FragmentedCoordinator(
        CoordinatorConfig(rounds=RoundConfig(mode="sync")), torch.zeros(24), [1000] * 4, FragmentLayout((0, 6, 24))
    )
    before = other.core.params.clone()
    with pytest.raises(InvalidArgument, match="--fragments the checkpoint was written with"):
        other.restore(snap)
    with pytest.raises(InvalidArgument, match="written without fragments"):
        other.restore(f.core.snapshot())
    assert torch.equal(other.core.params, before) and other.fragment_versions == [0, 0]


def test_fragment_shadows_broadcast_each_fragment_on_its_own() -> None:
    params = torch.zeros(24)
    layout = FragmentLayout.balanced(SIZES, 2)
    shadows = FragmentShadows(params, layout, "int8")
    params[10:] = 0.5
    delta = shadows.advance(params, 1, 1)
    assert delta is not None and delta.meta.numel == 14  # the fragment only
    assert shadows.shadow[:10].eq(0).all() and torch.allclose(shadows.shadow[10:], params[10:], atol=0.01)
    assert FragmentShadows(params, layout, "fp32").advance(params, 0, 1) is None  # fp32: a snapshot of it


# --- the learner core -------------------------------------------------------------------------------------------
def learner(mode: str = "decoupled", h: int = 8, p: int = 4) -> LearnerCore:
    core = LearnerCore()
    core.use_fragments(p)
    core.next_action(0.0)
    core.registered(0.0, "w", 1, mode, WorkPlan((Lease(0, 1, 0),), h, 1, 0))
    assert core.params_arrived(0.0, 0, 1, fragment_versions=(0,) * p)
    assert core.next_action(0.0) == Load(0, 0, reset_codec=False)
    return core


def steps(core: LearnerCore, n: int) -> None:
    for _ in range(n):
        a = core.next_action(1.0)
        assert isinstance(a, Train), a
        core.stepped(a.shard_id, a.epoch, a.cursor, a.cursor + 10)


def test_the_learner_submits_one_fragment_at_a_time_on_the_schedule() -> None:
    core = learner("sync")
    steps(core, 2)  # H = 8, P = 4: a fragment every 2 steps, fragment 1 first
    s = core.next_action(1.0)
    assert isinstance(s, Submit) and (s.draft.fragment, s.draft.steps, s.draft.tokens) == (1, 2, 20)
    assert core.state is LearnerState.TRAINING  # sync with fragments: trains on while the fragment syncs
    steps(core, 2)
    core.upload_accepted(1.0, s.draft.submission_id, pending_round=1)
    assert core.next_action(1.0).__class__.__name__ == "Wait"  # due, but its round is not applied yet
    assert core.params_arrived(2.0, 1, 1, fragment_versions=(0, 1, 0, 0))
    assert core.next_action(2.0) == Rebase(1, (1,))  # only the fragment that changed
    s2 = core.next_action(2.0)
    assert isinstance(s2, Submit) and (s2.draft.fragment, s2.draft.base_version) == (2, 1)
    assert s2.draft.ranges == (ShardRange(0, 1, 20, 40),)  # the steps since the previous submission only


def test_a_sync_learner_answered_applied_before_the_version_arrives_waits_for_it() -> None:
    """The upload's answer ("applied in round 1") can overtake the broadcast of version 1 (the services: two
    streams); the next fragment is submitted against version 1, not refused as stale."""
    core = learner("sync")
    steps(core, 2)
    s = core.next_action(1.0)
    assert isinstance(s, Submit)
    steps(core, 2)
    core.upload_accepted(1.0, s.draft.submission_id, pending_round=1, applied=True)
    assert isinstance(core.next_action(1.0), Wait)  # due, its round applied, but version 1 not here yet
    assert core.params_arrived(2.0, 1, 1, fragment_versions=(0, 1, 0, 0))
    assert core.next_action(2.0) == Rebase(1, (1,))
    s2 = core.next_action(2.0)
    assert isinstance(s2, Submit) and s2.draft.base_version == 1


def test_a_learner_refuses_a_broadcast_without_every_fragment_s_version() -> None:
    core = learner()
    with pytest.raises(InvalidArgument, match="each of the 4 fragments"):
        core.params_arrived(1.0, 1, 1, fragment_versions=(0, 1))
    with pytest.raises(InvalidArgument, match="the newest being 1"):
        core.params_arrived(1.0, 1, 1, fragment_versions=(0, 0, 0, 0))
    assert core.latest_version == 0 and core.fragment_versions == (0, 0, 0, 0)  # nothing changed
    with pytest.raises(InvalidArgument, match="integer >= 1"):
        core.use_fragments(0)


def test_the_catch_up_and_the_first_fragment_follow_the_fragment_versions() -> None:
    core = LearnerCore()
    core.use_fragments(4)
    core.next_action(0.0)
    core.registered(0.0, "w", 1, "decoupled", WorkPlan((Lease(0, 1, 0),), 8, 1, 9))
    core.params_arrived(0.0, 9, 1, fragment_versions=(9, 6, 7, 8))
    assert core.next_action(0.0) == Load(9, 9 * 8 // 4, reset_codec=False)  # P rounds per H_m steps
    assert core.next_fragment == 1 and core.due_steps == 2


# --- the trainer ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flat", [True, False])
def test_the_trainer_submits_and_rebases_only_the_given_ranges(flat: bool) -> None:
    """`flat`: θ is one vector read in place; else (an island's parameters) each range's tensors are read and written
    on their own (`ParamIO.read_range`), so the ranges are whole tensors, as fragments are."""
    cfg = tiny_task(4)
    task = build_task(cfg)
    corpus = task.corpus
    model = task.model_fn(0)
    io = LocalParams(model, torch.device("cpu"), flat=flat)
    t = InnerTrainer(model, corpus, cfg.inner, seq_len=cfg.model.seq_len, device=torch.device("cpu"), params=io)
    assert (t.io.flat_view is not None) == flat
    base = t.base.clone()
    x, y, _ = corpus.batch(0, 0, 4, cfg.model.seq_len)
    t.step(x, y)
    whole = t.pseudo_gradient()
    offsets = [s.offset for s in param_specs(model)]  # the ranges below cut the vector where tensors start
    first, lo, hi = offsets[1], offsets[2], offsets[5]
    part = t.submit_range(lo, hi)
    assert torch.equal(part, whole[lo:hi])
    assert torch.equal(t.base[:lo], base[:lo]) and not torch.equal(t.base[lo:hi], base[lo:hi])
    assert torch.equal(t.pseudo_gradient()[lo:hi], torch.zeros(hi - lo))
    theta = (t.base - t.pseudo_gradient()).clone()
    new = torch.randn_like(theta)
    t.rebase_ranges(new, [(0, first), (lo, hi)])
    after = t.base - t.pseudo_gradient()
    assert torch.equal(t.base[lo:hi], new[lo:hi]) and torch.equal(t.base[first:lo], base[first:lo])
    assert torch.allclose(after[lo:hi], new[lo:hi])  # nothing unsent there
    assert torch.equal(after[first:lo], theta[first:lo])  # untouched outside the ranges
    assert torch.equal(after[hi:], theta[hi:])


# --- the simulator ----------------------------------------------------------------------------------------------
def cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = {
        "task": tiny_task(8),
        "speeds": (1.0, 1.0, 1.0),
        "num_shards": 8,
        "local_steps": 8,
        "min_local_steps": 4,
        "outer_steps": 4,
        "codec": "int8",
        "latency_s": 0.2,
        "bandwidth_bytes_per_s": 1e6,
        "eval_tokens": 1024,
    }
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_fragments_send_a_fragment_at_a_time_and_count_every_token_once(mode: str) -> None:
    one = simulate(cfg(mode=mode))
    sim = Simulator(cfg(mode=mode, fragments=4))
    four = sim.run()
    assert four.rejected == 0 and four.fragments == 4
    assert four.rounds >= 4 * 4 - 1 and four.tokens == one.tokens  # P rounds per whole-model step; tokens once
    assert sim.core.ledger.committed_tokens() == four.tokens
    assert four.final_loss < four.initial_loss - 0.5
    up1, up4 = one.peak_bytes_per_s["link_up"], four.peak_bytes_per_s["link_up"]
    assert up4 < up1 / 2 and four.peak_bytes_per_s["link_down"] < one.peak_bytes_per_s["link_down"] / 2
    assert four.bytes_up == pytest.approx(one.bytes_up, rel=0.1)  # the same bytes in all, spread over time


def test_fragments_survive_a_killed_learner_with_every_token_counted_once() -> None:
    c = cfg(fragments=2, outer_steps=8, failures=parse_failures("kill:2@12,revive:2@40"), min_quorum=2)
    sim = Simulator(c)
    result = sim.run()
    assert result.reassign_latency_s == [pytest.approx(2.0)]
    for shard in sim.core.ledger.states():
        cursor = 0
        for r in shard.committed_ranges:
            assert r.start == cursor, f"shard {shard.shard_id}: gap or overlap at {r}"
            cursor = r.end
    assert sim.core.ledger.committed_tokens() == result.tokens
    assert result.final_loss < result.initial_loss - 0.5


def test_one_fragment_is_exactly_the_simulator_without_fragments() -> None:
    a, b = Simulator(cfg(mode="decoupled")), Simulator(cfg(mode="decoupled", fragments=1))
    assert a.frag is None and b.frag is None
    ra, rb = a.run(), b.run()
    assert torch.equal(a.core.params, b.core.params) and ra.history == rb.history


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fragments": 0}, "fragments must be an integer >= 1"),
        ({"fragments": 9}, r"<= H \(local_steps = 8\)"),
        ({"fragments": 2, "mode": "dp"}, "data-parallel"),
        ({"fragments": 2, "train": False}, "no-train"),
        ({"peak_window_s": 0.0}, "peak_window_s"),
    ],
)
def test_bad_fragment_settings_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg(**change)


def test_more_fragments_than_tensors_is_refused_when_the_model_is_built() -> None:
    tensors = len(merge_segments(GPT(tiny_task(8).model)))
    with pytest.raises(ConfigError, match=f"{tensors} parameter tensors"):
        Simulator(cfg(local_steps=64, fragments=tensors + 1))


def test_cli_takes_fragments_and_names_a_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--fragments", "0", "--outer-steps", "1"]) == 2
    assert "fragments must be an integer >= 1" in capsys.readouterr().err


# --- peak link bandwidth ----------------------------------------------------------------------------------------
def test_peak_rate_is_the_most_bytes_in_any_window() -> None:
    assert peak_rate([], 100.0, 1.0) == 0.0
    assert peak_rate([(0.0, 0.5)], 100.0, 1.0) == pytest.approx(50.0)  # 50 bytes, all inside one window
    assert peak_rate([(0.0, 0.5), (10.0, 10.5)], 100.0, 1.0) == pytest.approx(50.0)
    assert peak_rate([(0.0, 0.5), (0.8, 1.3)], 100.0, 1.0) == pytest.approx(70.0)  # [0, 1]: 0.5 s + 0.2 s
    assert peak_rate([(0.0, 4.0)], 100.0, 1.0) == pytest.approx(100.0)  # a long transfer: the link's rate
    peaks = link_peaks(
        [Transfer(0, True, 0.0, 50), Transfer(1, True, 0.1, 50), Transfer(0, False, 0.0, 400, snapshot=True)],
        100.0,
        1.0,
    )
    assert peaks == pytest.approx({"link_up": 50.0, "coordinator_up": 100.0, "link_down": 0.0, "coordinator_down": 0.0})
