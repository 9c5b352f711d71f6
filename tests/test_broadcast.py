"""Compressed broadcasts (ALGORITHM.md section 10): the pure shadow and follower (bit-identical reconstruction by a
learner following every delta, one that skips versions, one too far behind), the coordinator's WatchParameters
answers through a real channel, the learner's watcher refusing a corrupted delta and re-fetching a snapshot (a real
gRPC proxy that corrupts one message), a fresh learner that names the version 0 it built (the rule, the watch
through a real channel, the simulator's bytes), and real multi-process clusters: int8 broadcasts, and a fresh learner
that downloads no snapshot beside one with another seed that does."""

from __future__ import annotations

import dataclasses
import queue
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import structlog
import torch

from diloco.cluster import wait_for
from diloco.core import broadcast
from diloco.core.broadcast import BroadcastFollower, BroadcastShadow, Delta, HeldParams, Refusal, params_checksum
from diloco.core.codecs import CodecError, get_codec
from diloco.errors import ConfigError
from diloco.rpc.payload import NEVER, SPILL_ABOVE, PayloadBytes, PayloadReceiver, SpillFile, meta_from_proto
from diloco.sim.config import SimConfig, parse_failures
from diloco.sim.engine import simulate
from diloco.sim.result import SimResult
from diloco.sim.result import encoded_size as timing_size
from diloco.task.factory import TaskConfig, build_task
from diloco.task.params import flatten_params
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.config import parse
from services.coordinator.state import Broadcast
from services.worker.session import SessionLost
from services.worker.watcher import Delivered, Watcher, WatchFailed
from tests.support import (
    Env,
    Events,
    T,
    assert_finished_and_learned,
    cluster_config,
    make_upload,
    pb,
    register,
    running,
    submit,
)

pytestmark = pytest.mark.timeout(60)
LOSSY = ["bf16", "int8", "int4"]


def bits(x: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns (equal bits, not merely equal values: -0.0 differs from 0.0)."""
    return x.contiguous().view(torch.int32)


def walk(numel: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Θ_0..Θ_steps: a random walk of the global parameters, as outer steps move them."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(numel, generator=g)]
    for _ in range(steps):
        out.append(out[-1] + torch.randn(numel, generator=g) * 0.01)
    return out


def decode_streamed(delta_data: bytes | bytearray | memoryview, meta: object, numel: int, chunk: int) -> torch.Tensor:
    """What a learner's watcher decodes of a snapshot: the payload fed in chunks of `chunk` bytes."""
    receiver = PayloadReceiver(meta, numel)  # type: ignore[arg-type]
    view = memoryview(delta_data)
    for i in range(0, len(view), chunk):
        receiver.feed(view[i : i + chunk])
    return receiver.finish()


def received(d: Delta, chunk: int = 1 << 20) -> memoryview:
    """A delta's bytes as a learner's watcher keeps them: fed in chunks of `chunk` bytes, size and crc32 checked."""
    receiver = PayloadBytes(d.meta, d.meta.numel)
    view = memoryview(d.data)  # type: ignore[arg-type]
    for i in range(0, len(view), chunk):
        receiver.feed(view[i : i + chunk])
    return receiver.finish()


def take(f: BroadcastFollower, d: Delta, checksum: int | None = None) -> torch.Tensor | Refusal:
    """`d` queued by `f` (with `checksum` in place of the right one) and applied where it is adopted."""
    held = f.delta(d.version, d.base, d.meta, received(d), d.checksum if checksum is None else checksum, d.start)
    return held if isinstance(held, Refusal) else held.at(d.version)


def held_params(f: BroadcastFollower) -> torch.Tensor:
    assert f.held is not None
    return f.held.params


# --- the pure core --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", LOSSY)
def test_learners_reconstruct_the_shadow_bit_for_bit(codec: str) -> None:
    numel, steps = 1000, 12  # 1000: a short last block for int8/int4
    thetas = walk(numel, steps)
    shadow = BroadcastShadow(thetas[0], 0, codec, history=3, history_bytes_ratio=2.0)
    every, skipper, behind = BroadcastFollower(), BroadcastFollower(), BroadcastFollower()
    snap = shadow.snapshot()
    for f in (every, skipper, behind):
        f.snapshot(snap.version, torch.frombuffer(bytearray(snap.data), dtype=torch.float32))
    checksums = {0: shadow.checksum}
    for v in range(1, steps + 1):
        delta = shadow.advance(thetas[v], v)
        assert delta is not None and delta.base == v - 1 and delta.version == v
        shadow.record(delta)
        checksums[v] = shadow.checksum
        held = every.delta(v, v - 1, delta.meta, received(delta, chunk=333), delta.checksum)
        assert isinstance(held, HeldParams)
        got = held.at(v)
        assert not isinstance(got, Refusal)
        assert torch.equal(bits(got), bits(shadow.shadow)) and params_checksum(got) == shadow.checksum
        if v % 3 == 0:  # the skipper catches up every third version with a chain of deltas
            chain = shadow.updates_since(skipper.version, v)
            assert chain is not None and [d.version for d in chain] == [v - 2, v - 1, v]
            for d in chain:  # queued, then applied in order where the newest is adopted
                assert isinstance(skipper.delta(d.version, d.base, d.meta, received(d), d.checksum), HeldParams)
            assert skipper.held is not None and skipper.held.applied == v - 3
            assert torch.equal(bits(skipper.held.at(v)), bits(shadow.shadow))  # type: ignore[arg-type]
    # the shadow tracks Θ (error feedback: the residual does not grow)
    err = (thetas[-1] - shadow.shadow).abs().max().item()
    assert err < {"bf16": 1e-2, "int8": 2e-2, "int4": 0.5}[codec]
    # too far behind (the history holds 3): a full snapshot, bit-identical too
    assert behind.version == 0 and shadow.updates_since(0, steps) is None
    assert shadow.updates_since(None, steps) is None and shadow.updates_since(steps, steps) == []
    snap = shadow.snapshot()
    assert snap is shadow.snapshot()  # encoded once per version
    got = behind.snapshot(snap.version, decode_streamed(snap.data, snap.meta, numel, chunk=1000)).params
    assert torch.equal(bits(got), bits(shadow.shadow)) and snap.checksum == checksums[steps]


@pytest.mark.parametrize(("codec", "kept"), [("bf16", 1), ("int8", 1), ("int4", 3)])
def test_the_history_holds_at_most_half_a_snapshot_of_deltas(codec: str, kept: int) -> None:
    thetas = walk(1000, 6)
    shadow = BroadcastShadow(thetas[0], 0, codec)  # history 8 by count; the bytes decide
    for v in range(1, 7):
        shadow.record(shadow.advance(thetas[v], v))
    assert shadow.oldest_delta == 7 - kept
    assert [d.version for d in shadow.updates_since(6 - kept, 6) or []] == list(range(7 - kept, 7))
    assert shadow.updates_since(5 - kept, 6) is None  # further behind: a snapshot


@pytest.mark.parametrize(("codec", "kept"), [("bf16", 1), ("int8", 1), ("int4", 3)])
def test_room_is_made_before_the_encode_so_the_budget_bounds_the_deltas_held_then(codec: str, kept: int) -> None:
    """`make_room` before `advance` (the coordinator's order) drops the oldest deltas until they and the one about
    to be encoded fit half a snapshot's bytes; once recorded, the same deltas are kept as with `record` alone, and
    the chains served lead to the same bits."""
    thetas = walk(1000, 6)
    early, late = BroadcastShadow(thetas[0], 0, codec), BroadcastShadow(thetas[0], 0, codec)
    budget = 0.5 * 4 * 1000
    for v in range(1, 7):
        early.make_room()
        oldest = early.oldest_delta
        chain = [] if oldest is None else early.updates_since(oldest - 1, v - 1)
        assert chain is not None  # every delta kept, from the oldest on
        held = sum(d.meta.encoded_bytes for d in chain)
        delta = early.advance(thetas[v], v)
        assert delta is not None and held + delta.meta.encoded_bytes <= budget
        early.record(delta)
        late.record(late.advance(thetas[v], v))
        assert early.oldest_delta == late.oldest_delta and early.checksum == late.checksum
    assert early.oldest_delta == 7 - kept
    assert torch.equal(bits(early.shadow), bits(late.shadow))


def test_a_reset_keeps_the_deltas_that_lead_to_the_published_version_until_it_is_recorded() -> None:
    """`advance` resets the shadow (a version skipped, non-finite parameters) without the lock the watchers read the
    deltas under: the kept deltas still serve the version published until `record(None)` publishes the reset."""
    thetas = walk(1000, 3)
    shadow = BroadcastShadow(thetas[0], 0, "int4")
    for v in (1, 2):
        shadow.record(shadow.advance(thetas[v], v))
    assert shadow.advance(thetas[3], 5) is None  # version 5 after 2: a reset, learners need a snapshot of it
    assert [d.version for d in shadow.updates_since(0, 2) or []] == [1, 2]
    shadow.record(None)
    assert shadow.updates_since(0, 5) is None and shadow.updates_since(2, 5) is None and shadow.oldest_delta is None


@pytest.mark.parametrize("codec", ["fp32", *LOSSY])
def test_a_learner_holding_its_own_version_0_gets_deltas_only_when_its_checksum_matches(codec: str) -> None:
    """A fresh learner built version 0 itself and names its checksum: the same bits get the chain from version 0
    (nothing while 0 is current) and end bit-identical; other bits (another seed) get a snapshot, and so does
    everyone once version 0 has left the window."""
    thetas = walk(1000, 4)
    own, wrong = params_checksum(thetas[0].clone()), params_checksum(walk(1000, 0, seed=1)[0])
    shadow = BroadcastShadow(thetas[0], 0, codec)
    assert shadow.checksum_of(0) == own and own != wrong
    assert shadow.updates_since(0, 0, own) == [] and shadow.updates_since(0, 0, wrong) is None
    served = []
    for v in range(1, 5):
        shadow.record(shadow.advance(thetas[v], v))
        assert shadow.updates_since(0, v, wrong) is None and shadow.updates_since(0, v, own ^ 1) is None
        chain = shadow.updates_since(0, v, own)
        if chain is None:  # version 0 left the window (fp32 keeps no delta, bf16/int8 one, int4 three)
            assert shadow.checksum_of(0) is None
            continue
        served.append(v)
        follower = BroadcastFollower()
        follower.snapshot(0, thetas[0].clone())  # what the learner built from the task and seed
        for d in chain:
            assert not isinstance(take(follower, d), Refusal)
        assert torch.equal(bits(held_params(follower)), bits(shadow.shadow))
    assert served == {"fp32": [], "bf16": [1], "int8": [1], "int4": [1, 2, 3]}[codec]
    assert shadow.updates_since(4, 4, shadow.checksum_of(4)) == [] and shadow.updates_since(4, 4, wrong) is None


def test_fp32_broadcasts_are_full_snapshots_of_theta() -> None:
    thetas = walk(100, 3)
    shadow = BroadcastShadow(thetas[0], 5, "fp32")
    for v, theta in enumerate(thetas[1:], start=6):
        assert shadow.advance(theta, v) is None
        shadow.record(None)
        assert shadow.updates_since(v - 1, v) is None and shadow.updates_since(v, v) == []
        snap = shadow.snapshot()
        assert snap.version == v and torch.equal(torch.frombuffer(bytearray(snap.data), dtype=torch.float32), theta)


def test_a_refused_delta_changes_nothing() -> None:
    thetas = walk(256, 2)
    shadow = BroadcastShadow(thetas[0], 0, "int8")
    f = BroadcastFollower()
    f.snapshot(0, shadow.shadow.clone())
    d1 = shadow.advance(thetas[1], 1)
    assert d1 is not None
    assert take(BroadcastFollower(), d1) is Refusal.NO_BASE  # holds nothing yet
    held = f.held
    assert held is not None
    before = held.params.clone()
    assert take(f, dataclasses.replace(d1, version=2, base=1)) is Refusal.NO_BASE  # not for the version held
    assert take(f, dataclasses.replace(d1, start=1)) is Refusal.SPAN  # past the parameters' end
    assert f.version == 0 and f.held is held and held.latest == 0 and torch.equal(bits(held.params), bits(before))
    got = take(f, d1)
    assert isinstance(got, torch.Tensor) and got is held.params  # Θ̂_0 became Θ̂_1 in place: no second vector
    assert torch.equal(bits(got), bits(shadow.shadow))
    assert take(f, d1) is Refusal.NO_BASE  # the same delta again: never applied twice
    assert f.version == 1 and held.at(0) is Refusal.NO_BASE  # a version left behind


def test_a_delta_whose_checksum_differs_where_it_is_applied_breaks_what_is_held() -> None:
    """The checksum of `Θ̂` is checked after the delta was added in place: a mismatch leaves the tensor partly written,
    so every later `at` refuses (the learner registers again: `Replica.adopt` raises `ParamsLost`)."""
    thetas = walk(256, 2)
    shadow = BroadcastShadow(thetas[0], 0, "int8")
    f = BroadcastFollower()
    f.snapshot(0, shadow.shadow.clone())
    d1 = shadow.advance(thetas[1], 1)
    assert d1 is not None
    shadow.record(d1)
    d2 = shadow.advance(thetas[2], 2)
    assert d2 is not None
    held = f.delta(1, 0, d1.meta, received(d1), d1.checksum ^ 1)
    assert isinstance(held, HeldParams) and f.version == 1  # the checksum is checked where it is applied
    assert isinstance(f.delta(2, 1, d2.meta, received(d2), d2.checksum), HeldParams)
    assert held.at(2) is Refusal.CHECKSUM and held.applied == 0
    assert held.at(1) is Refusal.CHECKSUM and held.broken is Refusal.CHECKSUM
    garbled = f.snapshot(0, thetas[0].clone())
    bad = bytearray(received(d1))
    bad[:4] = b"\xff\xff\xff\x7f"  # the first int8 block's scale becomes NaN: content the payload crc32 let through
    meta = dataclasses.replace(d1.meta, crc32=zlib.crc32(bad))
    assert isinstance(f.delta(1, 0, meta, bytes(bad), d1.checksum), HeldParams)
    assert garbled.at(1) is Refusal.UNREADABLE


def test_queued_deltas_are_applied_in_order_up_to_the_version_adopted() -> None:
    thetas = walk(3000, 3)
    shadow = BroadcastShadow(thetas[0], 0, "int4", history=3, history_bytes_ratio=2.0)
    f = BroadcastFollower()
    held = f.snapshot(0, shadow.shadow.clone())
    want = {}
    for v in (1, 2, 3):
        d = shadow.advance(thetas[v], v)
        assert d is not None
        shadow.record(d)
        want[v] = shadow.shadow.clone()
        assert f.delta(v, v - 1, d.meta, received(d), d.checksum) is held
    assert held.applied == 0 and held.latest == 3
    assert torch.equal(bits(held.at(2)), bits(want[2])) and held.applied == 2  # type: ignore[arg-type]
    assert held.at(4) is Refusal.NO_BASE  # not told of yet
    assert torch.equal(bits(held.at(3)), bits(want[3])) and held.at(2) is Refusal.NO_BASE  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", LOSSY)
def test_a_delta_added_window_by_window_as_it_decodes_is_bit_identical(codec: str) -> None:
    numel = 3 * (1 << 20) + 5  # several decode windows, a short last block
    thetas = walk(numel, 1)
    shadow = BroadcastShadow(thetas[0], 0, codec)
    f = BroadcastFollower()
    f.snapshot(0, shadow.shadow.clone())
    d1 = shadow.advance(thetas[1], 1)
    assert d1 is not None
    got = take(f, d1)
    assert not isinstance(got, Refusal) and torch.equal(bits(got), bits(shadow.shadow)) and f.version == 1


def test_a_rebase_onto_the_base_moving_in_place_matches_one_onto_a_new_vector() -> None:
    """A trainer whose base is the learner's `Θ̂` (adopted, nothing submitted since) rebases onto the next version
    window by window as `Θ̂` changes in place (`InnerTrainer.base_moving`): the same bits as `rebase` onto a new
    vector, with `Θ̂` itself as the base afterwards."""
    from diloco.task.inner import InnerTrainer

    def trainer() -> InnerTrainer:
        cfg = TaskConfig()
        task = build_task(cfg)
        model = task.model_fn(0)
        return InnerTrainer(model, task.corpus, cfg.inner, seq_len=cfg.model.seq_len, device=torch.device("cpu"))

    a, b = trainer(), trainer()
    v0 = a.params_flat()
    shadow = BroadcastShadow(v0, 0, "int8")
    d1 = shadow.advance(v0 + 0.01 * torch.randn(v0.numel(), generator=torch.Generator().manual_seed(1)), 1)
    assert d1 is not None
    follower = BroadcastFollower()
    held = follower.snapshot(0, v0.clone())
    a.load_global(held.params, share=True)
    b.load_global(v0.clone(), share=True)
    for t in (a, b):
        x, y, _ = t.corpus.batch(0, 0, t.cfg.batch_size, t.seq_len)
        t.step(x, y)
    hook = a.base_moving(held.params)
    assert hook is not None
    assert follower.delta(1, 0, d1.meta, received(d1), d1.checksum) is held
    assert held.at(1, hook) is held.params
    b.rebase(shadow.shadow.clone(), share=True)
    assert torch.equal(bits(a.params_flat()), bits(b.params_flat()))
    assert torch.equal(bits(a.base), bits(shadow.shadow)) and torch.equal(bits(held.params), bits(shadow.shadow))
    assert torch.equal(bits(a.pseudo_gradient()), bits(b.pseudo_gradient()))
    assert b.base_moving(held.params) is None  # its base is its own


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_fused_advance_is_bit_identical_to_decoding_the_bytes_sent(codec: str) -> None:
    numel = (1 << 18) + 77  # several fused slabs, a short last block
    thetas = walk(numel, 1)
    base = thetas[0].clone()
    base[::7] = -0.0  # a rounded -0.0 added to a -0.0 would give -0.0 where the decoder's 0.0 gives 0.0
    target = thetas[1].clone()
    target[::7] = -1e-9
    target[:128] = base[:128]  # an all-zero block
    shadow = BroadcastShadow(base, 0, codec)
    d1 = shadow.advance(target, 1)
    assert d1 is not None
    decoded = get_codec(codec).decode(d1.data, d1.meta)
    assert torch.equal(bits(shadow.shadow), bits(base + decoded))
    assert d1.checksum == params_checksum(shadow.shadow) and d1.base_checksum == params_checksum(base)


def test_windows_out_of_order_give_the_same_version_and_checksum() -> None:
    numel = 10_000
    thetas = walk(numel, 1)
    shadow = BroadcastShadow(thetas[0], 0, "int8")
    d1 = shadow.advance(thetas[1], 1)
    assert d1 is not None
    decoded = get_codec("int8").decode(d1.data, d1.meta)
    held = thetas[0].clone()
    sink = broadcast._InPlaceDelta(held, 0, numel, None)
    sink.dense(6000, decoded[6000:])  # not the next window: the checksum is taken over the whole vector at the end
    sink.dense(0, decoded[:6000])
    assert sink.checksum() == d1.checksum and torch.equal(bits(held), bits(shadow.shadow))


@pytest.mark.parametrize("codec", LOSSY)
def test_a_fragment_s_delta_moves_only_its_range_as_one_shadow_per_fragment_would(codec: str) -> None:
    """Streaming fragments in the services (ALGORITHM.md section 10): a round's delta covers the fragments it
    stepped. The learner applying it, streamed window by window, holds `Θ̂` bit for bit with the whole vector's
    checksum; outside the range `Θ̂` keeps its values (that residual waits for its fragment's own step); and each
    delta's bytes are those of a shadow kept per fragment (the simulator's `FragmentShadows`)."""
    from diloco.core.fragments import FragmentLayout, FragmentShadows

    numel = 3 * (1 << 19) + 13  # several decode windows per fragment, short last blocks
    layout = FragmentLayout.balanced([numel // 3, numel // 3, numel - 2 * (numel // 3)], 3)
    thetas = walk(numel, 7)
    shadow = BroadcastShadow(thetas[0], 0, codec, history=8, history_bytes_ratio=2.0)
    per_fragment = FragmentShadows(thetas[0], layout, codec)
    follower, skipper = BroadcastFollower(), BroadcastFollower()
    for f in (follower, skipper):
        f.snapshot(0, thetas[0].clone())
    steps = [0] * layout.fragments
    for v in range(1, 8):
        p = v % layout.fragments
        start, end = layout.range(p)
        before = shadow.shadow.clone()
        d = shadow.advance(thetas[v], v, span=(start, end))
        assert d is not None and d.start == start and d.meta.numel == end - start
        shadow.record(d)
        steps[p] += 1
        ref = per_fragment.advance(thetas[v], p, steps[p])
        assert ref is not None and bytes(ref.data) == bytes(d.data)
        assert torch.equal(bits(shadow.shadow), bits(per_fragment.shadow))
        outside = torch.ones(numel, dtype=torch.bool)
        outside[start:end] = False
        assert torch.equal(bits(shadow.shadow[outside]), bits(before[outside]))
        assert d.checksum == params_checksum(shadow.shadow) and d.base_checksum == params_checksum(before)
        got = take(follower, d)
        assert not isinstance(got, Refusal) and torch.equal(bits(got), bits(shadow.shadow))
    chain = shadow.updates_since(skipper.version, 7)  # a learner behind gets the ranged deltas in order
    assert chain is not None and [d.version for d in chain] == list(range(1, 8))
    for d in chain:
        assert isinstance(skipper.delta(d.version, d.base, d.meta, received(d), d.checksum, d.start), HeldParams)
    assert torch.equal(bits(skipper.held.at(7)), bits(shadow.shadow))  # type: ignore[union-attr,arg-type]


def test_fp32_broadcasts_of_ranged_versions_are_deltas_over_the_range() -> None:
    """Streaming fragments with `--broadcast-codec fp32`: a version sends its range's `fl(Θ − Θ̂)` (a quarter of
    the model here), not a full snapshot; `Θ̂` reaches `Θ` there exactly where the two were within a factor of two
    (Sterbenz: nearly every value), else within two roundings; the rest of `Θ̂` keeps its values, and a learner
    holds `Θ̂` bit for bit. Without `ranged`, fp32 versions are snapshots as before."""
    numel = 1 << 16
    thetas = walk(numel, 4)
    plain = BroadcastShadow(thetas[0], 0, "fp32")
    assert not plain.shadowed and plain.advance(thetas[1], 1, span=(0, numel // 4)) is None  # a snapshot
    shadow = BroadcastShadow(thetas[0], 0, "fp32", ranged=True)
    assert shadow.shadowed
    follower = BroadcastFollower()
    follower.snapshot(0, thetas[0].clone())
    for v in range(1, 5):
        start, end = (v % 4) * numel // 4, (v % 4 + 1) * numel // 4
        before = shadow.shadow.clone()
        d = shadow.advance(thetas[v], v, span=(start, end))
        assert d is not None and d.meta.codec == "fp32" and (d.start, d.meta.numel) == (start, end - start)
        assert d.meta.encoded_bytes == 4 * (end - start)
        shadow.record(d)
        new, old, target = shadow.shadow[start:end], before[start:end], thetas[v][start:end]
        sterbenz = (old.sign() == target.sign()) & (old.abs() <= 2 * target.abs()) & (target.abs() <= 2 * old.abs())
        assert torch.equal(bits(new[sterbenz]), bits(target[sterbenz])) and sterbenz.float().mean() > 0.95
        eps = torch.finfo(torch.float32).eps
        assert ((new - target).abs() <= eps * (target.abs() + (target - old).abs())).all()
        assert torch.equal(bits(shadow.shadow[:start]), bits(before[:start]))
        assert torch.equal(bits(shadow.shadow[end:]), bits(before[end:]))
        got = take(follower, d)
        assert not isinstance(got, Refusal) and torch.equal(bits(got), bits(shadow.shadow))
        assert d.checksum == params_checksum(shadow.shadow)


def test_a_ranged_delta_sent_while_a_snapshot_is_held_leaves_the_held_bytes_alone() -> None:
    thetas = walk(4096, 1)
    shadow = BroadcastShadow(thetas[0], 0, "int8")
    snap, release = shadow.hold()
    held = bytes(snap.data)
    d = shadow.advance(thetas[1], 1, span=(1024, 3072))
    assert d is not None and bytes(snap.data) == held
    release()
    expected = thetas[0].clone()
    expected[1024:3072] += get_codec("int8").decode(d.data, d.meta)
    assert torch.equal(bits(shadow.shadow), bits(expected)) and d.checksum == params_checksum(expected)


def test_a_delta_whose_range_does_not_fit_is_refused() -> None:
    thetas = walk(100, 1)
    shadow = BroadcastShadow(thetas[0], 0, "int8")
    with pytest.raises(CodecError, match="span"):
        shadow.advance(thetas[1], 1, span=(50, 101))
    f = BroadcastFollower()
    f.snapshot(0, thetas[0].clone())
    assert f.check_delta(1, 0, 90, 11) is Refusal.SPAN and f.check_delta(1, 0, 0, 0) is Refusal.SPAN
    assert f.check_delta(1, 0, 90, 10) is None and f.version == 0
    sink = broadcast._InPlaceDelta(thetas[0].clone(), 90, 10, None)
    with pytest.raises(CodecError, match="past the delta's range"):
        sink.dense(0, torch.zeros(11))


def test_non_finite_parameters_fall_back_to_a_snapshot() -> None:
    thetas = walk(64, 1)
    shadow = BroadcastShadow(thetas[0], 0, "int8")
    bad = thetas[1].clone()
    bad[3] = float("nan")
    assert shadow.advance(bad, 1) is None
    shadow.record(None)
    assert shadow.version == 1 and shadow.updates_since(0, 1) is None


def test_bad_broadcast_settings_are_refused() -> None:
    with pytest.raises(CodecError, match="broadcast codec"):
        BroadcastShadow(torch.zeros(4), 0, "topk")
    with pytest.raises(ConfigError, match="broadcast_codec"):
        parse(["--insecure", "--broadcast-codec", "int3"], env={})
    with pytest.raises(ConfigError, match="broadcast_history"):
        parse(["--insecure", "--broadcast-history", "0"], env={})
    assert parse(["--insecure", "--broadcast-codec", "int4"], env={}).broadcast_codec == "int4"


# --- the simulator --------------------------------------------------------------------------------------------------
def test_simulated_bytes_down_follow_the_broadcast_codec() -> None:
    def run(bcast: str) -> SimResult:
        cfg = SimConfig(mode="sync", speeds=(1.0, 1.0), train=False, model_numel=100_000, outer_steps=5)
        return simulate(dataclasses.replace(cfg, broadcast_codec=bcast))

    fp32, int4 = run("fp32"), run("int4")
    assert fp32.rounds == int4.rounds == 5 and fp32.bytes_up == int4.bytes_up
    # each learner holds version 0 itself (no first download); the last round's version is not broadcast
    assert fp32.bytes_down == 4 * 2 * 4 * 100_000
    assert int4.bytes_down == 4 * 2 * timing_size(get_codec("int4"), 100_000)  # the --no-train estimate
    with pytest.raises(ConfigError, match="broadcast_codec"):
        SimConfig(broadcast_codec="topk")


def test_simulated_learners_download_only_what_their_own_version_0_lacks() -> None:
    """A learner process builds version 0 from the seed: at the start it downloads nothing, a learner revived
    while version 0 is in the window only the deltas from it, one revived later a full snapshot."""

    def run(revive_at: float) -> SimResult:
        cfg = SimConfig(
            mode="sync", speeds=(1.0, 1.0), train=False, model_numel=100_000, outer_steps=6, local_steps=10,
            step_time_s=1.0, latency_s=0.0, bandwidth_bytes_per_s=1e12, dead_after_s=1.0,
            failures=parse_failures(f"kill:1@5,revive:1@{revive_at}"),
        )  # fmt: skip
        return simulate(dataclasses.replace(cfg, broadcast_codec="int4"))

    delta = timing_size(get_codec("int4"), 100_000)
    # learner 1 dies at 5 s; learner 0 alone publishes a version every 10 s, broadcast to it (versions 1-5; the
    # last, 6, is not broadcast)
    assert run(1e9).bytes_down == 5 * delta  # revived after the run
    # revived at version 1: the delta from its own version 0, then versions 2-5 as learner 0
    assert run(15.5).bytes_down == 5 * delta + 1 * delta + 4 * delta
    # revived at version 5: version 0 left the window (int4 keeps three deltas): a full snapshot
    assert run(55.5).bytes_down == 5 * delta + 4 * 100_000


# --- the coordinator through a real channel ------------------------------------------------------------------------
def read_one(stream: Iterator[coordinator_pb2.ParametersChunk], numel: int) -> tuple[pb.ParametersHeader, torch.Tensor]:
    """The next version: its header and, for a snapshot, its parameters; for a delta, its bytes as a tensor of
    uint8 (queue them with `take_read`)."""
    first = next(stream)
    assert first.HasField("header")
    meta = meta_from_proto(first.header.payload)
    delta = first.header.HasField("delta_from")
    receiver = PayloadBytes(meta, meta.numel) if delta else PayloadReceiver(meta, numel)
    while receiver.received < meta.encoded_bytes:
        receiver.feed(next(stream).data)
    got = receiver.finish()
    return first.header, torch.frombuffer(got, dtype=torch.uint8) if isinstance(got, memoryview) else got


def take_read(f: BroadcastFollower, header: pb.ParametersHeader, data: torch.Tensor) -> torch.Tensor | Refusal:
    """A delta from `read_one` queued by `f` and applied, as a learner does when it adopts the version."""
    meta = meta_from_proto(header.payload)
    held = f.delta(
        header.version, header.delta_from, meta, data.numpy().data, header.params_checksum, header.delta_start
    )
    return held if isinstance(held, Refusal) else held.at(header.version)


def adopted(d: Delivered) -> torch.Tensor:
    """The parameters of a delivered version, as the learner adopts them (its queued deltas applied)."""
    got = d.held.at(d.broadcast.version)
    assert isinstance(got, torch.Tensor), got
    return got


def rounds(env: Env, reg: pb.RegisterResponse, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        h, data, _ = make_upload(env, reg, f"s{i}", seed=i)
        assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_APPLIED


@pytest.mark.parametrize(("above", "spill"), [(NEVER, False), (SPILL_ABOVE, False), (0, True)])
def test_watchers_get_deltas_since_what_they_hold_or_a_snapshot(
    start: Callable[..., Env], tmp_path: Path, above: int, spill: bool
) -> None:
    # 2 int4 deltas: well within the bytes kept; spill: they are kept in files (`--spill-dir`), sent from there: with
    # `--spill-above 0`; this small model's deltas stay in memory under the default size. A second learner that
    # never submits holds version 0 as far as the coordinator knows: every delta may be needed
    env = start(
        broadcast_codec="int4",
        broadcast_history=2,
        spill_dir=str(tmp_path),
        spill_above=above,
        min_quorum=1,
        grace_max_s=0.0,
    )
    numel, state = env.numel, env.server.state
    reg = register(env)
    register(env, "fresh")
    call = env.stub.WatchParameters(pb.WatchParametersRequest(worker_id=reg.worker_id, follow=True), timeout=30)
    stream = iter(call)
    follower = BroadcastFollower()
    header, flat = read_one(stream, numel)
    assert not header.HasField("delta_from") and header.version == 0
    follower.snapshot(0, flat)
    for v in range(1, 4):
        rounds(env, reg, 1, start=v)
        header, decoded = read_one(stream, numel)
        assert header.version == v and header.delta_from == v - 1 and header.payload.codec == common_pb2.CODEC_INT4
        assert list(header.applied_submission_ids) == [f"s{v}"] and header.plan.shards
        got = take_read(follower, header, decoded)
        assert not isinstance(got, Refusal)
        with state.work:
            assert torch.equal(bits(got), bits(state.shadow.shadow))
    call.cancel()
    kept = [d.data for d in state.shadow.updates_since(1, 3) or []]
    assert len(kept) == 2 and all(isinstance(k, SpillFile) for k in kept) is spill
    # the shadow differs from Θ (the residual is carried), and learners train from the shadow
    assert not torch.equal(state.shadow.shadow, env.server.core.params)
    # one version behind: the one delta; two behind (history 2): a chain; further (gone from history): a snapshot
    msgs = list(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=2), timeout=T))
    assert [m.header.delta_from for m in msgs if m.HasField("header")] == [2]
    msgs = list(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=1), timeout=T))
    assert [(m.header.version, m.header.delta_from) for m in msgs if m.HasField("header")] == [(2, 1), (3, 2)]
    header, flat = read_one(
        iter(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=0), timeout=T)), numel
    )
    assert header.version == 3 and not header.HasField("delta_from") and header.payload.codec == common_pb2.CODEC_FP32
    assert torch.equal(bits(flat), bits(held_params(follower)))
    assert header.params_checksum == params_checksum(flat)
    # a version this coordinator never had (it restarted from an older checkpoint): a full snapshot of the current
    header, _ = read_one(iter(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=99), timeout=T)), numel)
    assert header.version == 3 and not header.HasField("delta_from")


def test_deltas_every_live_learner_is_past_are_let_go(start: Callable[..., Env]) -> None:
    """The history keeps no delta that every live learner is past: a learner holds the version it trained its last
    submission from, or a newer one, and one that has not submitted may hold version 0. When both learners trained
    from version v - 1, its delta goes before version v's is encoded; a watcher naming an older version gets a
    snapshot. A learner that has not submitted holds the window open; once it leaves, it no longer does."""
    env = start(broadcast_codec="int4", grace_max_s=0.0)  # int4: the budget alone would keep 3 deltas
    state = env.server.state
    a, b = register(env, "a"), register(env, "b")

    def close_round(v: int) -> None:
        for i, reg in enumerate((a, b)):
            header, data, _ = make_upload(env, reg, f"{reg.worker_id}-{v}", seed=10 * v + i)
            submit(env, header, data)
        assert state.published().version == v

    def kept() -> list[int]:
        with state.lock:
            oldest = state.shadow.oldest_delta
            return [] if oldest is None else list(range(oldest, state.published().version + 1))

    close_round(1)  # both from version 0: delta 1 is kept for a learner at 0
    assert kept() == [1]
    close_round(2)  # both from version 1: delta 1 went before delta 2 was encoded
    assert kept() == [2]
    assert state.broadcasts_since(1)[1] is not None and state.broadcasts_since(0)[1] is None  # 0: a snapshot
    c = register(env, "c")  # has not submitted: as far as the coordinator knows, it holds version 0
    close_round(3)
    assert kept() == [2, 3]
    env.stub.Deregister(pb.DeregisterRequest(worker_id=c.worker_id, reason="done"), timeout=T)
    close_round(4)  # a and b trained from version 3: deltas 2 and 3 go
    assert kept() == [4]


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_version_s_bytes_are_held_once_and_never_change(start: Callable[..., Env], codec: str) -> None:
    """Watchers send a delta from the broadcast history's own bytes (no copy per version or per watcher), an fp32
    snapshot from the bytes made with its version, a lossy one from Θ̂'s own bytes, held: later rounds leave them."""
    env = start(broadcast_codec=codec)
    state = env.server.state
    reg = register(env)
    rounds(env, reg, 1)
    snap, release = state.snapshot_broadcast()

    def intact() -> bool:  # the bytes and both checks agree: the payload's crc32 and Θ̂'s checksum
        return (
            zlib.crc32(snap.data) == snap.meta.crc32
            and params_checksum(torch.frombuffer(bytearray(snap.data), dtype=torch.float32)) == snap.checksum
        )

    assert snap.version == 1 and intact()
    assert snap.data is state.shadow.snapshot().data  # no copy
    if codec != "fp32":
        _, chain = state.broadcasts_since(0)
        history = state.shadow.updates_since(0, 1)
        assert chain is not None and history is not None and chain[0].data is history[0].data
    rounds(env, reg, 1, start=1)
    assert state.published().version == 2 and intact()  # as it was sent
    release()


def test_a_held_snapshot_costs_a_copy_only_when_a_round_closes_during_its_send() -> None:
    thetas = walk(1000, 4)
    shadow = BroadcastShadow(thetas[0], 0, "int8")
    in_place = BroadcastShadow(thetas[0], 0, "int8")  # never held: the reference bits
    snap, release = shadow.hold()
    sent = bytes(snap.data)
    tensor = shadow.shadow
    shadow.record(shadow.advance(thetas[1], 1))
    in_place.record(in_place.advance(thetas[1], 1))
    assert bytes(snap.data) == sent and shadow.shadow is not tensor  # the next Θ̂ went into a new tensor
    assert torch.equal(bits(shadow.shadow), bits(in_place.shadow))  # the same adds
    again, release_again = shadow.hold()
    release()  # a release of the earlier tensor's hold does not count against this one
    release()  # twice: nothing more
    tensor = shadow.shadow
    shadow.record(shadow.advance(thetas[2], 2))
    assert shadow.shadow is not tensor and torch.equal(
        bits(tensor), bits(torch.frombuffer(again.data, dtype=torch.float32))
    )
    release_again()
    tensor = shadow.shadow
    shadow.record(shadow.advance(thetas[3], 3))  # nothing held: in place
    in_place.record(in_place.advance(thetas[2], 2))
    in_place.record(in_place.advance(thetas[3], 3))
    assert shadow.shadow is tensor and torch.equal(bits(shadow.shadow), bits(in_place.shadow))


def test_a_watch_cancelled_while_its_snapshot_is_taken_lets_go_of_it(start: Callable[..., Env]) -> None:
    """A snapshot taken for a watch that ended meanwhile is let go of: the next round updates Θ̂ in place."""
    env = start(broadcast_codec="int4")
    state = env.server.state
    taking, go = threading.Event(), threading.Event()
    take_for_real = state.snapshot_broadcast

    def slow_take() -> tuple[Broadcast, Callable[[], None]]:
        taking.set()
        go.wait(timeout=T)
        return take_for_real()

    state.snapshot_broadcast = slow_take  # type: ignore[method-assign]
    call = env.stub.WatchParameters(pb.WatchParametersRequest(after_version=0), timeout=T)
    assert taking.wait(timeout=T)
    call.cancel()
    go.set()
    wait_for("the hold let go", lambda: state.shadow._holds._count == 0, timeout_s=T)
    tensor = state.shadow.shadow
    rounds(env, register(env), 1)
    assert state.shadow.shadow is tensor  # in place: nobody held it


def own_version0(env: Env, reg: pb.RegisterResponse, seed: int | None = None) -> torch.Tensor:
    """What a fresh learner builds: the task of `reg` (its task_json) with the coordinator's init seed (or `seed`)."""
    task = build_task(TaskConfig.from_json(reg.task_json))
    return flatten_params(task.model_fn(reg.init_seed if seed is None else seed)).to("cpu")


def test_a_learner_naming_its_own_version_0_gets_only_what_it_lacks(start: Callable[..., Env]) -> None:
    """WatchParameters with `held_checksum`: the right checksum of version 0 gets a `held` header (no data) while 0 is
    current and the deltas from it later; a wrong one, or a version gone from the window, a full snapshot."""
    env = start(broadcast_codec="int4", seed=3, min_quorum=1, grace_max_s=0.0)
    trainer = register(env, "trainer")
    reg = register(env)  # fresh: it never submits, so every delta kept may still be asked for
    assert reg.init_seed == 3
    v0 = own_version0(env, reg)
    own, other = params_checksum(v0), params_checksum(own_version0(env, reg, seed=4))
    assert own != other

    def headers(after: int, crc: int | None) -> list[pb.ParametersHeader]:
        req = pb.WatchParametersRequest(worker_id=reg.worker_id, after_version=after, held_checksum=crc)
        return [m.header for m in env.stub.WatchParameters(req, timeout=T) if m.HasField("header")]

    msgs = list(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=0, held_checksum=own), timeout=T))
    assert len(msgs) == 1 and msgs[0].header.held and msgs[0].header.version == 0
    assert msgs[0].header.params_checksum == own and not msgs[0].header.HasField("payload")
    wrong = headers(0, other)
    assert [(h.version, h.held, h.HasField("delta_from")) for h in wrong] == [(0, False, False)]  # a snapshot
    rounds(env, trainer, 2)
    chain = headers(0, own)
    assert [(h.version, h.delta_from, h.held) for h in chain] == [(1, 0, False), (2, 1, False)]
    follower = BroadcastFollower()
    follower.snapshot(0, v0)
    stream = iter(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=0, held_checksum=own), timeout=T))
    for v in (1, 2):
        header, decoded = read_one(stream, env.numel)
        assert header.version == v and not isinstance(take_read(follower, header, decoded), Refusal)
    with env.server.state.work:
        assert torch.equal(bits(held_params(follower)), bits(env.server.state.shadow.shadow))
    assert [(h.version, h.HasField("delta_from")) for h in headers(0, other)] == [(2, False)]
    assert [(h.version, h.held) for h in headers(2, params_checksum(held_params(follower)))] == [(2, True)]
    assert [(h.version, h.HasField("delta_from")) for h in headers(2, own)] == [(2, False)]  # not Θ̂_2's checksum
    rounds(env, trainer, 2, start=2)  # int4 keeps three deltas: version 0 has left the window
    assert [(h.version, h.HasField("delta_from")) for h in headers(0, own)] == [(4, False)]
    assert [(h.version, h.HasField("delta_from")) for h in headers(7, own)] == [(4, False)]  # never had it


@pytest.mark.parametrize("seed", [None, 4], ids=["same_seed", "other_seed"])
def test_the_watcher_adopts_its_own_version_0_only_when_the_coordinator_holds_the_same(
    start: Callable[..., Env], seed: int | None
) -> None:
    env = start(broadcast_codec="int4")
    reg = register(env)
    inbox: queue.Queue[object] = queue.Queue()
    v0 = own_version0(env, reg, seed)
    w = Watcher(
        env.stub, reg.worker_id, reg.coordinator_epoch, env.numel, inbox.put, structlog.get_logger(), version0=v0
    )
    try:
        first = inbox.get(timeout=30)
        assert isinstance(first, Delivered) and first.broadcast.version == 0 and first.broadcast.plan is not None
        assert (first.held.params is v0) == (seed is None)  # its own tensor, or a snapshot
        with env.server.state.work:
            assert torch.equal(bits(adopted(first)), bits(env.server.state.shadow.shadow))
        rounds(env, reg, 2)
        got = [inbox.get(timeout=30) for _ in range(2)]
        delivered = [g for g in got if isinstance(g, Delivered)]
        assert [d.broadcast.version for d in delivered] == [1, 2]
        with env.server.state.work:
            assert torch.equal(bits(adopted(delivered[-1])), bits(env.server.state.shadow.shadow))
    finally:
        w.close()


class CorruptingProxy(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Forwards Register and WatchParameters to `backend`; `corrupt(fn)` rewrites the next parameter message that
    carries a delta's data (the first data message after a delta header) or a delta's header."""

    def __init__(self, backend: str) -> None:
        self._chan = grpc.insecure_channel(backend)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._chan)
        self.pending: list[Callable[[coordinator_pb2.ParametersChunk, bool], bool]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)
        self._chan.close()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:  # type: ignore[type-arg]
        method = details.method
        if method.endswith("/Register"):
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: self._stub.Register(req, timeout=T),
                request_deserializer=coordinator_pb2.RegisterRequest.FromString,
                response_serializer=coordinator_pb2.RegisterResponse.SerializeToString,
            )
        if method.endswith("/WatchParameters"):
            return grpc.unary_stream_rpc_method_handler(
                self._watch,
                request_deserializer=coordinator_pb2.WatchParametersRequest.FromString,
                response_serializer=coordinator_pb2.ParametersChunk.SerializeToString,
            )
        return None

    def _watch(
        self, req: coordinator_pb2.WatchParametersRequest, ctx: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.ParametersChunk]:
        call = self._stub.WatchParameters(req, timeout=60)
        ctx.add_callback(call.cancel)
        in_delta = False
        for msg in call:
            if msg.HasField("header"):
                in_delta = msg.header.HasField("delta_from")
            if in_delta and self.pending and self.pending[0](msg, msg.HasField("header")):
                self.pending.pop(0)
            yield msg


def flip_data(msg: coordinator_pb2.ParametersChunk, is_header: bool) -> bool:
    if is_header:
        return False
    data = bytearray(msg.data)
    data[len(data) // 2] ^= 0x40
    msg.data = bytes(data)
    return True


def wrong_checksum(msg: coordinator_pb2.ParametersChunk, is_header: bool) -> bool:
    if not is_header:
        return False
    msg.header.params_checksum ^= 1
    return True


def shifted_range(msg: coordinator_pb2.ParametersChunk, is_header: bool) -> bool:
    """The delta claims to start one value later: it no longer fits the parameters (ParametersHeader.delta_start)."""
    if not is_header:
        return False
    msg.header.delta_start += 1
    return True


@pytest.mark.parametrize(
    "fault", [flip_data, wrong_checksum, shifted_range], ids=["payload_crc", "params_checksum", "delta_range"]
)
def test_a_corrupted_delta_is_refused_and_refetched(
    start: Callable[..., Env], fault: Callable[[coordinator_pb2.ParametersChunk, bool], bool]
) -> None:
    env = start(broadcast_codec="int4")
    proxy = CorruptingProxy(env.server.address)
    inbox: queue.Queue[object] = queue.Queue()
    try:
        with grpc.insecure_channel(proxy.address) as chan:
            stub = coordinator_pb2_grpc.CoordinatorStub(chan)
            reg = register(env, "learner")  # the plan and uploads go to the coordinator directly
            w = Watcher(stub, reg.worker_id, reg.coordinator_epoch, env.numel, inbox.put, structlog.get_logger())
            try:
                first = inbox.get(timeout=30)
                assert isinstance(first, Delivered) and first.broadcast.version == 0
                proxy.pending.append(fault)
                rounds(env, reg, 1)
                got = inbox.get(timeout=30)
                if fault is flip_data:  # the payload crc fails: counted like an unreadable stream
                    assert got == WatchFailed(reg.worker_id, "UNIMPLEMENTED")
                    got = inbox.get(timeout=30)
                assert isinstance(got, Delivered) and got.broadcast.version == 1
                if fault is wrong_checksum:
                    # queued (its bytes are intact), refused where it is applied: the learner registers again
                    # (`Replica.adopt` raises `ParamsLost`: test_replica.py)
                    assert got.held.at(1) is Refusal.CHECKSUM
                    return
                # the delta was dropped, the watch restarted from scratch: version 1 as a full snapshot
                assert got.held is not first.held
                with env.server.state.work:
                    assert torch.equal(bits(adopted(got)), bits(env.server.state.shadow.shadow))
                assert not proxy.pending
                rounds(env, reg, 2, start=1)  # and deltas again from there, applied once each
                delivered: list[Delivered] = []
                for _ in range(2):
                    d = inbox.get(timeout=30)
                    assert isinstance(d, Delivered), d
                    delivered.append(d)
                assert [d.broadcast.version for d in delivered] == [2, 3] and w.follower.version == 3
                with env.server.state.work:
                    assert torch.equal(bits(adopted(delivered[-1])), bits(env.server.state.shadow.shadow))
                assert inbox.empty() or not isinstance(inbox.get_nowait(), (Delivered, SessionLost))
            finally:
                w.close()
    finally:
        proxy.close()


# --- a real cluster -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cluster_with_int8_broadcasts_learns_exactly_once(tmp_path: Path) -> None:
    cfg = cluster_config(
        tmp_path, workers=2, outer_steps=8, coordinator_args=("--broadcast-codec", "int8", "--broadcast-history", "4")
    )
    with running(cfg) as c:
        assert_finished_and_learned(c)
        status = c.final_status()
        header = next(iter(c.stub.WatchParameters(pb.WatchParametersRequest(), timeout=T))).header
        fp32_bytes = 4 * header.payload.numel
        # every learner built version 0 itself, then got int8 deltas (about a quarter of fp32 each)
        assert status.bytes_sent < 0.6 * fp32_bytes * cfg.workers * (status.version + 1), status.bytes_sent
        for name in ("worker0", "worker1"):
            assert "worker.broadcast_refused" not in (tmp_path / f"{name}.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cluster_fresh_learners_build_version_0_and_download_no_snapshot(tmp_path: Path) -> None:
    """Real processes: worker0 (the coordinator's seed, by default) holds version 0 from the start and receives
    only deltas, each checked against the coordinator's checksum after it is applied (bit-identical, or refused);
    worker1, started with another seed, builds a different version 0 and gets a full snapshot first. `sync` rounds:
    every pseudo-gradient is H inner steps, so the loss check does not depend on timing (in decoupled rounds a
    learner waiting for a version trains on, and one round's 80-step pseudo-gradient against the other's 8 can
    overshoot the outer step's momentum past the loss the check asks for: seen once in CI, 5.75 after 6 versions)."""
    cfg = cluster_config(
        tmp_path,
        workers=2,
        mode="sync",
        outer_steps=6,
        coordinator_args=("--broadcast-codec", "int4", "--seed", "5"),
        worker_args={1: ("--seed", "6")},
    )
    with running(cfg) as c:
        assert_finished_and_learned(c)
        numel = next(iter(c.stub.WatchParameters(pb.WatchParametersRequest(), timeout=T))).header.payload.numel
        logs = {name: Events(tmp_path / f"{name}.log") for name in ("worker0", "worker1")}
        same, other = logs["worker0"], logs["worker1"]
        assert [e["version"] for e in same.all("worker.broadcast_held")] == [0]
        received = same.all("worker.broadcast_received")
        assert received and all(e["delta_from"] == e["version"] - 1 for e in received), received  # type: ignore[operator]
        assert sum(int(e["bytes"]) for e in received) < 4 * numel  # type: ignore[call-overload]
        assert not other.all("worker.broadcast_held")
        first = other.all("worker.broadcast_received")[0]
        assert first["delta_from"] is None and first["bytes"] == 4 * numel  # a full fp32 snapshot
        for events in logs.values():
            assert not events.all("worker.broadcast_refused")
