"""`diloco.core.parallel`: model-sized passes split over `--threads` threads give the same bits as one pass (the
codecs' encodes, the broadcast shadow's encode and its crc32), and the fused decode-and-add a learner's `Θ̂` takes
a delta with gives the bits of a decode then an add."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from diloco.cli.main import main
from diloco.core import broadcast, codecs, kernels, parallel
from diloco.core.broadcast import BroadcastFollower, BroadcastShadow, Refusal
from diloco.core.checksum import checksum
from diloco.core.codecs import CodecError, get_codec
from diloco.errors import ConfigError


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Parts of a few thousand elements, so that small vectors are split too; threads back to 1 afterwards."""
    monkeypatch.setattr(parallel, "MIN_PART_ELEMENTS", 4096)
    yield
    parallel.set_threads(1)


@given(
    start=st.integers(0, 10_000),
    n=st.integers(0, 100_000),
    align=st.sampled_from([1, 2, 64, 128, 4096]),
    parts=st.integers(1, 16),
    min_part=st.integers(1, 50_000),
)
def test_split_covers_the_range_in_aligned_parts(start: int, n: int, align: int, parts: int, min_part: int) -> None:
    ranges = parallel.split(start, start + n, align, parts, min_part)
    if n == 0:
        assert ranges == []
        return
    assert ranges[0][0] == start and ranges[-1][1] == start + n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous, in order
    assert all(lo < hi for lo, hi in ranges)
    assert len(ranges) <= parts
    assert all((hi - lo) % align == 0 for lo, hi in ranges[:-1])
    if len(ranges) > 1:
        assert all(hi - lo >= min(min_part, n) for lo, hi in ranges[:-1])


def test_map_parts_runs_every_part_once_in_order(small_parts: None) -> None:
    parallel.set_threads(3)
    seen = parallel.map_parts(lambda lo, hi: (lo, hi), 0, 20_000, 128)
    assert len(seen) == 3 and seen[0][0] == 0 and seen[-1][1] == 20_000
    data = np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8)
    assert parallel.parallel_crc32(memoryview(data), 7) == zlib.crc32(data.tobytes(), 7)


def test_set_threads_sets_torch_and_refuses_bad_counts() -> None:
    try:
        parallel.set_threads(2)
        assert torch.get_num_threads() == 2 and parallel.threads() == 2
    finally:
        parallel.set_threads(1)
    for bad in (0, -1, parallel.MAX_THREADS + 1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"threads must be an integer in \[1, 1024\]"):
            parallel.check_threads(bad)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_encodes_give_the_same_bits_on_any_number_of_threads(codec: str, small_parts: None) -> None:
    c = get_codec(codec)
    gen = torch.Generator().manual_seed(1)
    n = 50_000 + 37  # a short last block
    x, shadow = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = []
    for threads in (1, 2, 5):
        parallel.set_threads(threads)
        data, meta = c.encode(x.clone())
        residual = x.clone()
        data_ef, meta_ef = c.encode_and_subtract(residual)
        out = torch.empty(n)
        data_t, meta_t, new = c.encode_toward(x, shadow, out, element=99)
        results.append(
            (bytes(data), meta, bytes(data_ef), meta_ef, residual.numpy().tobytes(), bytes(data_t), meta_t, new, out)
        )
    for other in results[1:]:
        assert other[:8] == results[0][:8]
        assert torch.equal(other[8], results[0][8])
    assert results[0][7] == checksum(results[0][8], 99)  # the checksum term of out, sitting at element 99
    assert results[0][1].crc32 == zlib.crc32(results[0][0])


def test_a_bad_input_found_in_one_part_fails_the_whole_encode(small_parts: None) -> None:
    parallel.set_threads(4)
    x = torch.zeros(40_000)
    x[33_333] = float("nan")  # in the last part but one
    with pytest.raises(CodecError, match="NaN or inf"):
        get_codec("int8").encode(x)


@pytest.mark.parametrize("qmax", [127, 7])
@pytest.mark.parametrize(("element", "with_old"), [(4000, True), (4000, False), (4001, False), (12928, False)])
def test_fused_decode_and_add_gives_the_bits_of_decode_then_add(qmax: int, element: int, with_old: bool) -> None:
    """Blocks that straddle a period (element 4000, 4001: the terms value by value) and blocks from a block
    boundary (12,928: the new term by pairs, its period keys past the first)."""
    rng = np.random.default_rng(2)
    bs, blocks = 128, 300
    packed = rng.integers(0, 256, blocks * bs if qmax > 7 else blocks * bs // 2, dtype=np.uint8)
    scales = rng.random(blocks, dtype=np.float32) * np.float32(1e-2)
    base = rng.standard_normal(blocks * bs).astype(np.float32)
    decoded = np.empty_like(base)
    kernels.dequantize(packed, scales, bs, qmax, decoded)
    expected = (torch.from_numpy(base.copy()) + torch.from_numpy(decoded)).numpy()
    fused = base.copy()
    old, new = kernels.dequantize_add(packed, scales, bs, qmax, fused, element, with_old)
    assert np.array_equal(fused.view(np.int32), expected.view(np.int32))
    before = checksum(torch.from_numpy(base), element) if with_old else 0
    assert (old, new) == (before, checksum(torch.from_numpy(expected), element))


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_learner_applies_a_delta_to_the_coordinators_bits_and_sees_every_window_change(codec: str) -> None:
    """The fused path (`AddingSink`): Θ̂ reaches the coordinator's bits, and `on_window` (a rebase window by
    window) is told of every element's old and new value, once."""
    gen = torch.Generator().manual_seed(3)
    n = 3 * (1 << 20) + 5  # several decode windows and a short last block
    theta0 = torch.randn(n, generator=gen)
    shadow = BroadcastShadow(theta0, 0, codec)
    follower = BroadcastFollower()
    held0 = follower.snapshot(0, shadow.shadow.clone())
    before = held0.params.clone()
    delta = shadow.advance(theta0 + 1e-2 * torch.randn(n, generator=gen), 1)
    assert delta is not None
    held = follower.delta(1, 0, delta.meta, delta.data, delta.checksum)
    assert not isinstance(held, Refusal)
    old_seen, new_seen = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    covered = torch.zeros(n, dtype=torch.int32)

    def on_window(lo: int, hi: int, old: torch.Tensor, new: torch.Tensor) -> None:
        old_seen[lo:hi], new_seen[lo:hi] = old, new
        covered[lo:hi] += 1

    got = held.at(1, on_window)
    assert not isinstance(got, Refusal)
    assert torch.equal(got, shadow.shadow)
    assert bool((covered == 1).all())
    assert torch.equal(old_seen, before) and torch.equal(new_seen, shadow.shadow)


def test_a_queued_delta_is_applied_in_windows_every_thread_shares() -> None:
    """A learner's apply (`HeldParams.at`) gets windows of the decoder's full size, split across its threads: none
    cut short by where the scales section ended, only by where a fed chunk ends."""
    parallel.set_threads(2)
    try:
        n = 9 * (1 << 20) + 5
        theta0 = torch.randn(n, generator=torch.Generator().manual_seed(6))
        shadow = BroadcastShadow(theta0, 0, "int4")
        follower = BroadcastFollower()
        follower.snapshot(0, shadow.shadow.clone())
        delta = shadow.advance(theta0 + 1e-2, 1)
        assert delta is not None
        held = follower.delta(1, 0, delta.meta, delta.data, delta.checksum)
        assert not isinstance(held, Refusal)
        windows: list[int] = []
        got = held.at(1, lambda lo, hi, old, new: windows.append(hi - lo))
        assert not isinstance(got, Refusal) and torch.equal(got, shadow.shadow)
        full = codecs._WINDOW_ELEMENTS * 2
        chunks = -(-delta.meta.encoded_bytes // broadcast._APPLY_CHUNK_BYTES)
        assert sum(windows) == n and sum(w < full - 128 for w in windows) <= 2 * chunks + 1, windows
        assert full >= 2 * parallel.MIN_PART_ELEMENTS  # a full window is split across both threads
    finally:
        parallel.set_threads(1)


def test_services_refuse_a_bad_thread_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--insecure", "--coordinator", "127.0.0.1:7", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err
    assert main(["coordinator", "--insecure", "--threads", "5000"]) == 2
    assert "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_decodes_give_the_same_bits_on_any_number_of_threads(codec: str, small_parts: None) -> None:
    """Into a buffer, window by window into a sink (the coordinator's fold), and added into a learner's `Θ̂` in
    place with its checksum (a delta broadcast): the parts of each window decoded at once change no bit."""
    gen = torch.Generator().manual_seed(4)
    n = 2 * (1 << 20) + 77
    theta0 = torch.randn(n, generator=gen)
    data, meta = get_codec(codec).encode(theta0)
    shadow = BroadcastShadow(theta0, 0, codec)
    delta = shadow.advance(theta0 + 1e-2 * torch.randn(n, generator=gen), 1)
    assert delta is not None

    class Collect:
        def __init__(self) -> None:
            self.values = torch.full((n,), float("nan"))

        def dense(self, start: int, values: torch.Tensor) -> None:
            self.values[start : start + values.numel()] = values

        def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
            raise AssertionError("dense codecs only")

    results = []
    for threads in (1, 3):
        parallel.set_threads(threads)
        out = torch.empty(n)
        decoder = get_codec(codec).decoder(meta, out)
        for at in range(0, len(data), 1 << 20):
            decoder.feed(memoryview(data)[at : at + (1 << 20)])
        decoder.finish()
        sink = Collect()
        windows = get_codec(codec).decoder(meta, sink=sink)
        windows.feed(data)
        windows.verify()
        follower = BroadcastFollower()
        follower.snapshot(0, theta0.clone())
        held = follower.delta(1, 0, delta.meta, delta.data, delta.checksum)
        assert not isinstance(held, Refusal)
        got = held.at(1)
        assert not isinstance(got, Refusal), got  # the checksum, taken in parts, matched the coordinator's
        results.append((out, sink.values, got))
    for one, more in zip(results[0], results[1], strict=True):
        assert torch.equal(one, more)
    assert torch.equal(results[1][2], shadow.shadow)
