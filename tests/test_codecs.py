"""Codecs (ALGORITHM.md sections 2 and 9): byte layouts, round-trip bounds, streaming decode, error feedback
and malformed input."""

from __future__ import annotations

import dataclasses
import itertools
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from diloco.core import codecs
from diloco.core.checksum import checksum, moved
from diloco.core.codecs import (
    ALLOWED_BLOCK_SIZES,
    CODEC_NAMES,
    Codec,
    CodecError,
    EncodedMeta,
    ErrorFeedback,
    encoded_size,
    get_codec,
    iter_chunks,
)
from diloco.errors import InvalidArgument, ResourceExhausted
from diloco.rpc.payload import SpilledVector

# Values with |x| either 0 or >= 1e-30: blocks far below float32's normal range are out of scope.
_VALUE = st.floats(-1e4, 1e4, width=32).map(lambda v: 0.0 if abs(v) < 1e-30 else v)
_VECTORS = hnp.arrays(np.float32, st.integers(1, 300), elements=_VALUE)
_SMALL_BLOCKS = st.sampled_from([16, 32, 64])
_PROPERTY = settings(max_examples=60, deadline=None)


Values = np.ndarray | torch.Tensor | list[float]


def _encode(
    name: str, values: Values, *, block_size: int = 128, topk_fraction: float = 0.01
) -> tuple[Codec, bytes, EncodedMeta]:
    codec = get_codec(name, block_size=block_size, topk_fraction=topk_fraction)
    x = torch.as_tensor(values, dtype=torch.float32)
    data, meta = codec.encode(x)
    return codec, bytes(data), meta  # payloads may be any bytes-like; the tests slice and join bytes


def _stream(codec: Codec, data: bytes, meta: EncodedMeta, sizes: list[int]) -> torch.Tensor:
    decoder = codec.decoder(meta)
    pos, i = 0, 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        decoder.feed(memoryview(data)[pos : pos + size])
        pos, i = min(len(data), pos + size), i + 1
        assert decoder.bytes_received == pos
    return decoder.finish()


def _with_crc(meta: EncodedMeta, data: bytes) -> EncodedMeta:
    return dataclasses.replace(meta, crc32=zlib.crc32(data))


# --- registry and configuration ---------------------------------------------------------------------------


def test_get_codec_covers_every_name_and_marks_lossy() -> None:
    for name in CODEC_NAMES:
        codec = get_codec(name)
        assert codec.name == name
        assert codec.lossy == (name != "fp32")


def test_unknown_codec_names_the_allowed_values() -> None:
    with pytest.raises(CodecError, match=r"unknown codec 'zstd'.*fp32, bf16, int8, int4, topk"):
        get_codec("zstd")
    assert issubclass(CodecError, InvalidArgument)


@pytest.mark.parametrize("block_size", [0, 8, 100, 8192])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_bad_block_size_is_rejected(name: str, block_size: int) -> None:
    with pytest.raises(CodecError, match=r"block_size .* not allowed; use a power of two from 16 to 4096"):
        get_codec(name, block_size=block_size)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan")])
def test_bad_topk_fraction_is_rejected(fraction: float) -> None:
    with pytest.raises(CodecError, match="topk fraction must be in"):
        get_codec("topk", topk_fraction=fraction)


def test_encoded_meta_fields_match_the_proto_payload_spec() -> None:
    common_pb2 = pytest.importorskip("diloco.v1.common_pb2")
    proto_fields = set(common_pb2.PayloadSpec.DESCRIPTOR.fields_by_name)
    assert {f.name for f in dataclasses.fields(EncodedMeta)} <= proto_fields


# --- byte layouts (golden values) -------------------------------------------------------------------------


def test_fp32_layout() -> None:
    _, data, meta = _encode("fp32", [1.5, -2.0, 0.0])
    assert data == struct.pack("<3f", 1.5, -2.0, 0.0)
    assert meta == EncodedMeta("fp32", 3, 12, zlib.crc32(data))


def test_bf16_layout_rounds_to_nearest_even() -> None:
    # 1 + 2**-8 is halfway between 1 and 1 + 2**-7: the even mantissa wins (1.0); 1 + 3 * 2**-8 goes up to
    # 1 + 2**-6.
    _, data, meta = _encode("bf16", [1.0, -2.0, 1 + 2**-8, 1 + 3 * 2**-8])
    assert data == struct.pack("<4H", 0x3F80, 0xC000, 0x3F80, 0x3F82)
    assert meta.encoded_bytes == 8


def test_int8_layout_scales_first_then_values() -> None:
    # block 0: amax 254 -> scale 2; 127 * 127/254 = 63.5 rounds to even (64). Block 1 is short and all zero.
    x = [254.0, -254.0, 127.0] + [0.0] * 13 + [0.0] * 4
    _, data, meta = _encode("int8", x, block_size=16)
    expected = struct.pack("<2f", 2.0, 0.0) + struct.pack("<3b", 127, -127, 64) + bytes(13) + bytes(4)
    assert data == expected
    assert meta == EncodedMeta("int8", 20, len(expected), zlib.crc32(expected), block_size=16)


def test_int4_layout_packs_low_nibble_first_with_odd_padding() -> None:
    # block 0: amax 7 -> scale 1, values 7, -7, 3.5 -> 4 (even); stored as q + 8: 15, 1, 12, 8 ...
    # block 1: a single -1 -> scale 1/7, q = -7 (nibble 1); the missing partner nibble is padding (8)
    x = [7.0, -7.0, 3.5] + [0.0] * 13 + [-1.0]
    _, data, meta = _encode("int4", x, block_size=16)
    scale1 = (np.float32(1.0) / np.float32(7.0)).tobytes()
    expected = struct.pack("<f", 1.0) + scale1 + bytes([0x1F, 0x8C] + [0x88] * 6 + [0x81])
    assert data == expected
    assert meta.encoded_bytes == encoded_size("int4", 17, 16) == 4 * 2 + 9


def test_int4_packs_every_pair_of_values_as_the_layout_says() -> None:
    # one block of 16 per pair (lo, hi): lo, hi, then fourteen 7s, so the scale is 1 and q = x
    pairs = [(lo, hi) for lo in range(-7, 8) for hi in range(-7, 8)]
    x = [v for lo, hi in pairs for v in (lo, hi, *[7.0] * 14)]
    _, data, _ = _encode("int4", x, block_size=16)
    values = np.frombuffer(data[4 * len(pairs) :], dtype=np.uint8).reshape(len(pairs), 8)
    assert values[:, 0].tolist() == [(lo + 8) | (hi + 8) << 4 for lo, hi in pairs]
    assert (values[:, 1:] == 0xFF).all()


@pytest.mark.parametrize("block_size", [16, 4096])
def test_int4_decodes_every_nibble_as_the_layout_says(block_size: int) -> None:
    numel = 2 * codecs._SLAB + 3 * block_size + 5  # several encoder slabs and a short last block
    codec = get_codec("int4", block_size=block_size)
    data, meta = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(3)))
    blocks = -(-numel // block_size)
    raw = np.frombuffer(bytes(data), dtype=np.uint8)
    scales = raw[: 4 * blocks].view("<f4")
    nibbles = np.stack([raw[4 * blocks :] & 15, raw[4 * blocks :] >> 4], axis=1).reshape(-1)[:numel]
    expected = (nibbles.astype(np.float32) - np.float32(8)) * np.repeat(scales, block_size)[:numel]
    assert np.array_equal(codec.decode(data, meta).numpy().view(np.int32), expected.view(np.int32))


def test_topk_layout_is_ascending_index_value_records() -> None:
    _, data, meta = _encode("topk", [0.0, 5.0, -1.0, -9.0, 2.0], topk_fraction=0.4)
    assert data == struct.pack("<IfIf", 1, 5.0, 3, -9.0)
    assert (meta.topk_count, meta.encoded_bytes) == (2, 16)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_every_length_around_block_boundaries(name: str) -> None:
    gen = torch.Generator().manual_seed(9)
    for numel in range(1, 3 * 16 + 2):
        x = torch.randn(numel, generator=gen)
        codec, data, meta = _encode(name, x, block_size=16)
        assert len(data) == meta.encoded_bytes == encoded_size(name, numel, 16)
        whole = codec.decode(data, meta)
        assert float((whole - x).abs().max()) <= float(x.abs().max()) / (127 if name == "int8" else 7)
        assert torch.equal(_stream(codec, data, meta, [1]), whole), numel
        assert torch.equal(_stream(codec, data, meta, [3, 8]), whole), numel


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_all_zero_block_decodes_to_zeros(name: str) -> None:
    x = torch.zeros(40)
    x[20:30] = torch.arange(1.0, 11.0)  # block 1 is not zero, blocks 0 and 2 are
    codec, data, meta = _encode(name, x, block_size=16)
    out = codec.decode(data, meta)
    assert torch.equal(out[:16], torch.zeros(16))
    assert torch.equal(out[32:], torch.zeros(8))
    feedback = ErrorFeedback(codec, 40)
    feedback.compress(x)
    assert torch.equal(feedback.residual[:16], torch.zeros(16)), "the residual of a zero block must stay zero"
    assert bool(torch.isfinite(feedback.residual).all())


# --- round-trip bounds ------------------------------------------------------------------------------------


@_PROPERTY
@given(_VECTORS)
def test_fp32_round_trip_is_exact(values: np.ndarray) -> None:
    codec, data, meta = _encode("fp32", values)
    assert np.array_equal(codec.decode(data, meta).numpy(), values)


@_PROPERTY
@given(_VECTORS)
def test_bf16_relative_error_at_most_2_pow_minus_8(values: np.ndarray) -> None:
    codec, data, meta = _encode("bf16", values)
    out = codec.decode(data, meta).numpy().astype(np.float64)
    x = values.astype(np.float64)
    assert np.all(np.abs(out - x) <= np.abs(x) * 2.0**-8)


@_PROPERTY
@given(_VECTORS, _SMALL_BLOCKS, st.sampled_from([("int8", 127), ("int4", 7)]))
def test_block_codecs_error_at_most_half_a_step(
    values: np.ndarray, block_size: int, codec_qmax: tuple[str, int]
) -> None:
    name, qmax = codec_qmax
    codec, data, meta = _encode(name, values, block_size=block_size)
    out = codec.decode(data, meta).numpy().astype(np.float64)
    x = values.astype(np.float64)
    pad = -len(x) % block_size
    amax = np.abs(np.pad(x, (0, pad))).reshape(-1, block_size).max(axis=1)
    step = np.repeat(amax / qmax, block_size)[: len(x)]
    assert np.all(np.abs(out - x) <= step * (0.5 + 1e-4)), np.max(np.abs(out - x) / np.maximum(step, 1e-30))


@_PROPERTY
@given(
    hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
    _SMALL_BLOCKS,
    st.sampled_from([("int8", 127), ("int4", 7)]),
)
def test_block_codecs_write_the_bytes_the_layout_defines(
    values: np.ndarray, block_size: int, codec_qmax: tuple[str, int]
) -> None:
    """The fused loops (diloco/core/kernels.py) against the layout's formulas in numpy float32, bit for bit, over
    the whole float range (subnormal, all-zero and huge blocks included): scale = amax / qmax, q = rint(x * (qmax /
    amax)), 0 where qmax / amax is not finite."""
    name, qmax = codec_qmax
    _, data, _ = _encode(name, values, block_size=block_size)
    blocks = -(-len(values) // block_size)
    padded = np.zeros(blocks * block_size, dtype=np.float32)
    padded[: len(values)] = values
    x = padded.reshape(blocks, block_size)
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.float32(qmax) / amax
    inv[~np.isfinite(inv)] = 0.0
    q = np.rint(x * inv[:, None]).astype(np.int8).reshape(-1)[: len(values)]
    raw = np.frombuffer(data, dtype=np.uint8)
    assert np.array_equal(raw[: 4 * blocks].view("<f4"), amax / np.float32(qmax))
    if name == "int8":
        assert np.array_equal(raw[4 * blocks :].view(np.int8), q)
    else:
        nibbles = np.append(q + 8, [8] * (len(q) % 2)).astype(np.uint8)
        assert np.array_equal(raw[4 * blocks :], nibbles[0::2] | nibbles[1::2] << 4)


_DISTINCT = st.integers(1, 300).flatmap(
    lambda n: st.tuples(
        hnp.arrays(np.float32, n, elements=st.floats(1.0, 1e4, width=32), unique=True),
        hnp.arrays(np.bool_, n),
        st.floats(0.001, 1.0),
    )
)


@_PROPERTY
@given(_DISTINCT)
def test_topk_keeps_exactly_the_largest_entries(case: tuple[np.ndarray, np.ndarray, float]) -> None:
    magnitudes, negative, fraction = case
    values = np.where(negative, -magnitudes, magnitudes)
    codec, data, meta = _encode("topk", values, topk_fraction=fraction)
    k = max(1, round(fraction * len(values)))
    assert meta.topk_count == k
    top = np.sort(np.argsort(-magnitudes, kind="stable")[:k])
    expected = np.zeros_like(values)
    expected[top] = values[top]
    assert np.array_equal(codec.decode(data, meta).numpy(), expected)


def _reference_top(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k).indices.sort().values


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.2])
def test_topk_sampled_path_matches_full_topk(fraction: float) -> None:
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    assert x.numel() >= codecs._TOPK_SAMPLED_MIN_NUMEL
    codec, data, meta = _encode("topk", x, topk_fraction=fraction)
    out = codec.decode(data, meta)
    keep = _reference_top(x, meta.topk_count)
    assert torch.equal(out.nonzero().squeeze(1), keep)
    assert torch.equal(out[keep], x[keep])


def test_topk_sampled_path_with_ties_keeps_exactly_k() -> None:
    x = torch.ones(300_000)
    x[::3] = -1.0
    x[1000] = 5.0
    codec, data, meta = _encode("topk", x, topk_fraction=0.01)
    out = codec.decode(data, meta)
    assert int((out != 0).sum()) == meta.topk_count == 3000
    assert out[1000] == 5.0
    assert bool((out.abs() <= 5.0).all())


def test_topk_falls_back_when_the_sample_threshold_is_too_high(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "_sample_threshold", lambda x, k: float("inf"))
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(2))
    codec, data, meta = _encode("topk", x, topk_fraction=0.01)
    assert torch.equal(codec.decode(data, meta).nonzero().squeeze(1), _reference_top(x, meta.topk_count))


def test_encode_accepts_any_contiguity_and_leaves_the_input_alone() -> None:
    base = torch.randn(64, 3)
    x = base[:, 1]  # strided
    before = x.clone()
    for name in CODEC_NAMES:
        codec, data, meta = _encode(name, x, block_size=16)
        assert torch.equal(x, before)
        assert meta.numel == 64
        assert codec.decode(data, meta).shape == (64,)


# --- streaming ---------------------------------------------------------------------------------------------


@_PROPERTY
@given(
    st.sampled_from(CODEC_NAMES),
    _VECTORS,
    _SMALL_BLOCKS,
    st.lists(st.integers(1, 100), min_size=1, max_size=20),
)
def test_streaming_with_random_chunks_equals_whole_decode(
    name: str, values: np.ndarray, block_size: int, sizes: list[int]
) -> None:
    codec, data, meta = _encode(name, values, block_size=block_size, topk_fraction=0.1)
    whole = codec.decode(data, meta)
    assert torch.equal(_stream(codec, data, meta, sizes), whole)


class _Collect:
    """A window sink that rebuilds the vector and records every window it was given."""

    def __init__(self, numel: int) -> None:
        self.out = torch.zeros(numel)
        self.covered = torch.zeros(numel, dtype=torch.int32)
        self.windows: list[int] = []

    def dense(self, start: int, values: torch.Tensor) -> None:
        self.out[start : start + values.numel()] = values
        self.covered[start : start + values.numel()] += 1
        self.windows.append(values.numel())

    def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
        self.out[index] = values
        self.windows.append(values.numel())


def _stream_to_sink(codec: Codec, data: bytes, meta: EncodedMeta, size: int) -> _Collect:
    sink = _Collect(meta.numel)
    decoder = codec.decoder(meta, sink=sink)
    for pos in range(0, len(data), size):
        decoder.feed(memoryview(data)[pos : pos + size])
    decoder.verify()
    return sink


@_PROPERTY
@given(st.sampled_from(CODEC_NAMES), _VECTORS, _SMALL_BLOCKS, st.integers(1, 100))
def test_a_sink_gets_exactly_the_whole_decode(name: str, values: np.ndarray, block_size: int, size: int) -> None:
    codec, data, meta = _encode(name, values, block_size=block_size, topk_fraction=0.1)
    sink = _stream_to_sink(codec, data, meta, size)
    assert torch.equal(sink.out, codec.decode(data, meta))
    if name != "topk":  # every other codec hands over dense windows, covering every element once
        assert bool((sink.covered == 1).all())


def _fp32_windows_inside(fed: torch.Tensor, cuts: Sequence[int], numel: int) -> tuple[torch.Tensor, list[bool]]:
    """Decode the fp32 payload `fed` (uint8) fed in pieces cut at `cuts` into a sink: what it rebuilt, and for each
    window whether it was a view of `fed` itself."""
    base, end = fed.data_ptr(), fed.data_ptr() + fed.numel()
    inside: list[bool] = []

    class Where(_Collect):
        def dense(self, start: int, values: torch.Tensor) -> None:
            inside.append(base <= values.data_ptr() < end)
            super().dense(start, values)

    sink = Where(numel)
    meta = EncodedMeta("fp32", numel, fed.numel(), zlib.crc32(fed.numpy().data))
    decoder = get_codec("fp32").decoder(meta, sink=sink)
    bounds = [0, *cuts, fed.numel()]
    for lo, hi in itertools.pairwise(bounds):
        decoder.feed(fed.numpy().data[lo:hi])
    decoder.verify()
    return sink.out, inside


def test_an_fp32_sink_reads_the_fed_bytes_themselves_where_they_are_aligned() -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(6))
    data = x.numpy().tobytes()
    fed = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out, inside = _fp32_windows_inside(fed, [4000, 4002], x.numel())
    # whole values: a view; half a value kept and joined with the next feed's first bytes: a copy; then a view
    assert torch.equal(out, x) and inside == [True, False, True]
    shifted = torch.frombuffer(bytearray(b"\0" + data), dtype=torch.uint8)[1:]  # values at odd addresses: copied
    out, inside = _fp32_windows_inside(shifted, [], x.numel())
    assert torch.equal(out, x) and inside and not any(inside)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_sink_windows_stay_small_however_large_the_pieces_fed(name: str) -> None:
    numel = 3 * (1 << 20) + 77
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    codec, data, meta = _encode(name, x, block_size=4096 if name == "sparse" else 128, topk_fraction=0.01)
    sink = _stream_to_sink(codec, data, meta, len(data))  # the whole payload in one feed
    assert torch.equal(sink.out, codec.decode(data, meta))
    assert len(sink.windows) >= 3
    assert max(sink.windows) <= 1.25 * (1 << 20)  # about _WINDOW_ELEMENTS (block scales make pieces a bit longer)


def test_a_decoder_takes_a_sink_or_an_output_not_both() -> None:
    codec, data, meta = _encode("int8", [1.0, 2.0])
    with pytest.raises(CodecError, match="either into an output buffer or into a sink"):
        codec.decoder(meta, torch.empty(2), sink=_Collect(2))
    decoder = codec.decoder(meta, sink=_Collect(2))
    decoder.feed(data)
    with pytest.raises(CodecError, match="no output buffer"):
        decoder.finish()


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_streaming_one_byte_at_a_time(name: str) -> None:
    x = torch.randn(101, generator=torch.Generator().manual_seed(3))
    codec, data, meta = _encode(name, x, block_size=16, topk_fraction=0.2)
    assert torch.equal(_stream(codec, data, meta, [1]), codec.decode(data, meta))


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4"])
def test_complete_units_are_decoded_as_soon_as_they_arrive(name: str) -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(4)) + 10.0  # no zeros
    codec, data, meta = _encode(name, x, block_size=16)
    expected = codec.decode(data, meta)
    per_element = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}[name]
    header = 4 * 4 if name in ("int8", "int4") else 0
    out = torch.zeros(64)
    decoder = codec.decoder(meta, out)
    decoder.feed(data[: header + int(16 * per_element) + 1])  # the scales, one block and one more byte
    assert torch.equal(out[:16], expected[:16])
    assert bool((out[16:] == 0).all())
    decoder.feed(data[header + int(16 * per_element) + 1 :])
    assert decoder.finish() is out
    assert torch.equal(out, expected)


def test_topk_decoder_clears_a_reused_buffer() -> None:
    codec, data, meta = _encode("topk", [0.0, 3.0, 0.0, 1.0], topk_fraction=0.25)
    out = torch.full((4,), 7.0)
    decoder = codec.decoder(meta, out)
    decoder.feed(bytearray(data))
    assert decoder.finish().tolist() == [0.0, 3.0, 0.0, 0.0]


def test_iter_chunks_slices_without_copying() -> None:
    data = bytes(range(10))
    chunks = list(iter_chunks(data, 4))
    assert [bytes(c) for c in chunks] == [data[0:4], data[4:8], data[8:10]]
    assert all(c.obj is data for c in chunks)
    with pytest.raises(CodecError, match="chunk_bytes must be >= 1"):
        list(iter_chunks(data, 0))


# --- error feedback ----------------------------------------------------------------------------------------

_LOSSY = [get_codec("bf16"), get_codec("int8", block_size=64), get_codec("int4", block_size=64)]
_LOSSY.append(get_codec("topk", topk_fraction=0.1))


@pytest.mark.parametrize("codec", _LOSSY, ids=lambda c: c.name)
def test_error_feedback_keeps_exactly_what_was_not_sent(codec: Codec) -> None:
    gen = torch.Generator().manual_seed(5)
    feedback = ErrorFeedback(codec, 1000)
    assert feedback.enabled and feedback.decay == (0.5 if codec.name == "topk" else 1.0)
    for _ in range(5):
        delta = torch.randn(1000, generator=gen)
        target = delta + feedback.decay * feedback.residual
        data, meta = feedback.compress(delta)
        assert torch.equal(feedback.residual, target - codec.decode(data, meta))


def _run_feedback(codec: Codec, steps: int, enabled: bool, numel: int = 2048) -> tuple[list[float], list[float], float]:
    """Exact feedback (β = 1), per step: the norm of sum(true deltas) - sum(decoded) and of the residual; and the
    delta norm."""
    gen = torch.Generator().manual_seed(6)
    feedback = ErrorFeedback(codec, numel, enabled=enabled, decay=1.0)
    sent = torch.zeros(numel, dtype=torch.float64)
    true = torch.zeros(numel, dtype=torch.float64)
    drift, residual = [], []
    for _ in range(steps):
        delta = torch.randn(numel, generator=gen)
        data, meta = feedback.compress(delta)
        true += delta.double()
        sent += codec.decode(data, meta).double()
        drift.append(float((true - sent).norm()))
        residual.append(float(feedback.residual.norm()))
    return drift, residual, float(numel**0.5)


@pytest.mark.parametrize(("codec", "bound"), list(zip(_LOSSY, [0.005, 0.015, 0.2, 2.5], strict=True)), ids=str)
def test_error_feedback_residual_stays_bounded(codec: Codec, bound: float) -> None:
    drift, residual, delta_norm = _run_feedback(codec, 400, enabled=True)
    # the decoded sum tracks the true sum up to the carried residual (float64 bookkeeping vs float32 state)
    assert abs(drift[-1] - residual[-1]) <= 1e-3 * delta_norm
    assert max(residual) <= bound * delta_norm
    late, early = max(residual[200:]), max(residual[50:100])
    assert late <= 1.5 * early, "the residual grows with the number of steps"


def test_topk_without_feedback_drifts_away() -> None:
    codec = get_codec("topk", topk_fraction=0.1)
    drift_fb, _, _ = _run_feedback(codec, 400, enabled=True)
    drift_plain, residual_plain, _ = _run_feedback(codec, 400, enabled=False)
    assert max(residual_plain) == 0.0
    assert drift_plain[-1] > 1.5 * drift_plain[99], "without feedback the error should keep growing"
    assert drift_plain[-1] > 3.0 * max(drift_fb)


def test_decayed_feedback_bounds_the_residual_of_a_repeated_delta() -> None:
    """A learner that restarts from Θ pushes its unsent entries the same way every round. With exact feedback
    their residual grows without bound; with β < 1 it stays under |Δ|/(1-β), and what is sent is still the
    largest entries of Δ + β·e."""
    codec = get_codec("topk", topk_fraction=0.01)
    delta = torch.linspace(0.5, 1.0, 1000)  # the same pseudo-gradient every round
    exact, decayed = ErrorFeedback(codec, 1000, decay=1.0), ErrorFeedback(codec, 1000)
    for _ in range(200):
        exact.compress(delta)
        decayed.compress(delta)
    assert float(exact.residual.max()) > 50.0
    assert float(decayed.residual.max()) <= 1.0 / (1 - decayed.decay) + 1e-4
    with pytest.raises(CodecError, match="decay"):
        ErrorFeedback(codec, 10, decay=1.5)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("block_size", [16, 128, 4096])
@pytest.mark.parametrize("numel", [1, 15, 1001, (1 << 17) + 77])
def test_fused_encode_toward_is_bit_identical_to_the_plain_path(name: str, block_size: int, numel: int) -> None:
    codec = get_codec(name, block_size=block_size)
    g = torch.Generator().manual_seed(numel)
    shadow = torch.randn(numel, generator=g)
    params = shadow + 1e-3 * torch.randn(numel, generator=g)
    shadow[::7] = -0.0  # rounded to -0.0: the decoder's 0.0 keeps Θ̂'s -0.0 a 0.0 after the add
    params[::7] = -1e-9
    params[::11] = shadow[::11]
    params[:block_size] = shadow[:block_size]  # an all-zero block
    fused = torch.empty(numel)
    base = 0xFEDCBA9876543210  # the checksum of a vector whose range from element 5 `shadow` is
    data, meta, moved_to = codec.encode_toward(params, shadow, fused, element=5, base=base)
    plain = Codec.encode_toward(codec, params, shadow, plain_out := torch.empty(numel), element=5, base=base)
    assert bytes(data) == bytes(plain[0]) and (meta, moved_to) == plain[1:]  # the plain path: sub, encode, ...
    assert torch.equal(fused.view(torch.int32), plain_out.view(torch.int32))
    assert moved_to == moved(base, checksum(shadow, 5), checksum(fused, 5))
    whole = torch.empty(numel)
    assert (
        codec.encode_toward(params, shadow, whole)[2]
        == checksum(whole)
        == Codec.encode_toward(codec, params, shadow, torch.empty(numel))[2]
    )
    for element in (4000, 8192):  # 4000: blocks of 128 or more straddle a period; 8192: by pairs, any block size
        assert codec.encode_toward(params, shadow, whole, element=element)[2] == checksum(whole, element)
    in_place = shadow.clone()
    codec.encode_toward(params, in_place, in_place)
    assert torch.equal(in_place.view(torch.int32), fused.view(torch.int32))


def _address(payload: bytes | bytearray | memoryview) -> int:
    return int(np.frombuffer(payload, dtype=np.uint8).ctypes.data)


def test_encode_toward_checks_its_buffers() -> None:
    codec = get_codec("int8")
    with pytest.raises(CodecError, match="one size"):
        codec.encode_toward(torch.zeros(4), torch.zeros(4), torch.zeros(5))
    with pytest.raises(CodecError, match="contiguous 1-D float32"):
        codec.encode_toward(torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4))


def test_encode_and_subtract_needs_a_contiguous_cpu_target() -> None:
    codec = get_codec("int8", block_size=16)
    with pytest.raises(CodecError, match="works in place"):
        codec.encode_and_subtract(torch.randn(64, 2)[:, 0])
    target = torch.randn(64)
    expected = target - codec.decode(*codec.encode(target))
    codec.encode_and_subtract(target)
    assert torch.equal(target, expected)


def test_error_feedback_defaults_and_reset() -> None:
    assert not ErrorFeedback(get_codec("fp32"), 4).enabled
    lossless = ErrorFeedback(get_codec("fp32"), 4, enabled=True)
    lossless.compress(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(lossless.residual, torch.zeros(4))
    feedback = ErrorFeedback(get_codec("topk", topk_fraction=0.25), 4)
    feedback.compress(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert feedback.residual.tolist() == [1.0, 2.0, 3.0, 0.0]
    feedback.compress(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # + 0.5 x the residual: 1.5, 3, 4.5, 4; 4.5 is sent
    assert feedback.residual.tolist() == [1.5, 3.0, 0.0, 4.0]
    feedback.reset()
    assert torch.equal(feedback.residual, torch.zeros(4))


def test_error_feedback_disabled_sends_the_delta_as_is() -> None:
    codec = get_codec("int8", block_size=16)
    feedback = ErrorFeedback(codec, 32, enabled=False)
    delta = torch.randn(32, generator=torch.Generator().manual_seed(7))
    assert feedback.compress(delta) == codec.encode(delta)
    assert feedback.residual.numel() == 0  # nothing is kept between rounds


def _address(data: bytes | bytearray | memoryview) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


def test_fp32_without_feedback_sends_the_buffer_the_delta_was_built_in() -> None:
    """No copy of an fp32 upload: the payload is the buffer `compress_added` built the delta in; `compress` with
    `owned` sends the caller's tensor as it is; plain `encode` copies (the caller may change its tensor after)."""
    codec = get_codec("fp32")
    feedback = ErrorFeedback(codec, 1000)
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    built: list[torch.Tensor] = []

    def add(buffer: torch.Tensor) -> None:
        built.append(buffer)
        buffer.add_(delta)

    data, meta = feedback.compress_added(add)
    assert _address(data) == built[0].data_ptr()
    assert torch.equal(codec.decode(data, meta), delta)
    assert meta.crc32 == zlib.crc32(delta.numpy().tobytes())
    data, meta = feedback.compress(delta, owned=True)
    assert _address(data) == delta.data_ptr()
    copied, _ = codec.encode(delta)
    assert _address(copied) != delta.data_ptr()
    delta.zero_()
    assert not torch.equal(codec.decode(copied, meta), delta)


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "topk", "sparse"])
def test_an_encode_allocates_its_payload_once(name: str) -> None:
    """The payload is written where it is sent from, not joined from pieces: the bytes allocated while encoding
    (numpy's and Python's, as tracemalloc sees them) peak at the payload plus a slab's records, not twice it. (topk
    keeps 30%: above 25% it selects with torch alone, whose working memory tracemalloc does not see; sparse, 108x
    below fp32, gets a longer vector so that its payload outweighs a slab's records.)"""
    codec = get_codec(name, topk_fraction=0.3 if name == "topk" else None)
    x = torch.randn(32_000_000 if name == "sparse" else 4_000_000, generator=torch.Generator().manual_seed(5))
    codec.encode(x[:1024])  # imports and compiles the kernels outside the measurement
    tracemalloc.start()
    try:
        data, meta = codec.encode(x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert codec.decode(data, meta).numel() == x.numel()  # whole, and its crc32 checks
    assert peak < len(data) + (512 << 10), f"{name}: {peak} bytes allocated for a {len(data)}-byte payload"


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_error_feedback_resets_after_a_non_finite_delta(name: str) -> None:
    feedback = ErrorFeedback(get_codec(name, block_size=16, topk_fraction=0.5), 32)
    feedback.compress(torch.randn(32))
    bad = torch.randn(32)
    bad[5] = float("nan")
    with pytest.raises(CodecError, match="cannot encode NaN or inf"):
        feedback.compress(bad)
    assert torch.equal(feedback.residual, torch.zeros(32))
    with pytest.raises(CodecError, match="delta has 31 elements"):
        feedback.compress(torch.randn(31))


# --- malformed input ---------------------------------------------------------------------------------------


def _decode_all(codec: Codec, data: bytes, meta: EncodedMeta) -> torch.Tensor:
    decoder = codec.decoder(meta)
    for chunk in iter_chunks(data, 5):
        decoder.feed(chunk)
    return decoder.finish()


@pytest.fixture(params=CODEC_NAMES)
def encoded(request: pytest.FixtureRequest) -> tuple[Codec, bytes, EncodedMeta]:
    x = torch.randn(50, generator=torch.Generator().manual_seed(8))
    return _encode(request.param, x, block_size=16, topk_fraction=0.2)


def test_truncated_payload(encoded: tuple[Codec, bytes, EncodedMeta]) -> None:
    codec, data, meta = encoded
    with pytest.raises(CodecError, match=rf"truncated: got {len(data) - 1} of {len(data)} bytes; resume"):
        _decode_all(codec, data[:-1], meta)


def test_extra_bytes(encoded: tuple[Codec, bytes, EncodedMeta]) -> None:
    codec, data, meta = encoded
    decoder = codec.decoder(meta)
    decoder.feed(data[:-1])
    with pytest.raises(CodecError, match=rf"received {len(data) + 1} bytes but the payload has {len(data)}"):
        decoder.feed(data[-1:] + b"\x00")
    with pytest.raises(CodecError, match="decoder already failed"):
        decoder.finish()


def test_crc_mismatch(encoded: tuple[Codec, bytes, EncodedMeta]) -> None:
    codec, data, meta = encoded
    bad = dataclasses.replace(meta, crc32=(meta.crc32 + 1) % (1 << 32))
    with pytest.raises(CodecError, match=r"crc32 mismatch.*send them again"):
        _decode_all(codec, data, bad)


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_flipped_byte(encoded: tuple[Codec, bytes, EncodedMeta], where: float) -> None:
    codec, data, meta = encoded
    pos = min(len(data) - 1, int(where * len(data)))
    corrupt = bytearray(data)
    corrupt[pos] ^= 0x10
    with pytest.raises(CodecError, match=r"crc32 mismatch|corrupt"):
        _decode_all(codec, bytes(corrupt), meta)


def _topk_payload(records: list[tuple[int, float]], numel: int) -> tuple[bytes, EncodedMeta]:
    data = b"".join(struct.pack("<If", i, v) for i, v in records)
    return data, EncodedMeta("topk", numel, len(data), zlib.crc32(data), topk_count=len(records))


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([(1, 1.0), (10, 2.0)], "topk record 1: index 10 is out of range for numel 10"),
        ([(3, 1.0), (3, 2.0)], "topk record 1: index 3 does not increase"),
        ([(4, 1.0), (2, 2.0)], "topk record 1: index 2 does not increase"),
    ],
)
def test_topk_malformed_indices(records: list[tuple[int, float]], message: str) -> None:
    data, meta = _topk_payload(records, 10)
    codec = get_codec("topk")
    with pytest.raises(CodecError, match=message):
        codec.decode(data, meta)
    # also when the bad record arrives in a later chunk than the good one
    decoder = codec.decoder(meta)
    decoder.feed(data[:8])
    with pytest.raises(CodecError, match=message):
        decoder.feed(data[8:])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_bad_scale(name: str, scale: float) -> None:
    codec, data, meta = _encode(name, torch.randn(40), block_size=16)
    data = data[:4] + struct.pack("<f", scale) + data[8:]  # block 1's scale
    with pytest.raises(CodecError, match=rf"{name} scale of block 1 is .*must be finite and >= 0"):
        codec.decode(data, _with_crc(meta, data))


def _meta_cases() -> list[tuple[str, Callable[[EncodedMeta], EncodedMeta], str]]:
    r = dataclasses.replace
    return [
        ("int8", lambda m: r(m, codec="zstd"), "unknown codec 'zstd'"),
        ("int8", lambda m: r(m, numel=41, encoded_bytes=encoded_size("int8", 41, 16)), "numel 41 but .* 40"),
        ("int8", lambda m: r(m, encoded_bytes=m.encoded_bytes + 1), "encoded_bytes 53 does not match .* 52"),
        ("int8", lambda m: r(m, block_size=100), "block_size 100 is not allowed"),
        ("int4", lambda m: r(m, block_size=0), "block_size 0 is not allowed"),
        ("fp32", lambda m: r(m, block_size=16), "block_size must be 0 for codec fp32"),
        ("fp32", lambda m: r(m, topk_count=1), "topk_count must be 0 for codec fp32"),
        ("topk", lambda m: r(m, topk_count=0, encoded_bytes=0), r"topk_count 0 is outside \[1, numel=40\]"),
        ("topk", lambda m: r(m, topk_count=41, encoded_bytes=328), r"topk_count 41 is outside"),
        ("bf16", lambda m: r(m, crc32=-1), "crc32 must be a uint32"),
    ]


@pytest.mark.parametrize(("name", "change", "message"), _meta_cases())
def test_meta_mismatch(name: str, change: Callable[[EncodedMeta], EncodedMeta], message: str) -> None:
    _, _, meta = _encode(name, torch.randn(40), block_size=16, topk_fraction=0.1)
    meta.validate(expected_numel=40)
    with pytest.raises(CodecError, match=message):
        change(meta).validate(expected_numel=40)


def test_meta_too_large() -> None:
    _, _, meta = _encode("fp32", torch.randn(40))
    meta.validate(expected_numel=40, max_bytes=160)
    with pytest.raises(CodecError, match="160 bytes exceeds the limit of 159 bytes"):
        meta.validate(expected_numel=40, max_bytes=159)


def test_decoder_rejects_a_foreign_meta_or_a_bad_buffer() -> None:
    _, _, meta = _encode("int8", torch.randn(40), block_size=16)
    with pytest.raises(CodecError, match="payload codec 'int8' cannot be decoded by the fp32 codec"):
        get_codec("fp32").decoder(meta)
    with pytest.raises(CodecError, match="encoded_bytes"):
        get_codec("int8").decoder(dataclasses.replace(meta, encoded_bytes=1))
    for out in (torch.empty(41), torch.empty(40, dtype=torch.float64), torch.empty(80)[::2]):
        with pytest.raises(CodecError, match="contiguous 1-D float32 CPU tensor of 40 elements"):
            get_codec("int8").decoder(meta, out)


@pytest.mark.parametrize(
    "value",
    [torch.randn(4, 4), torch.randn(8, dtype=torch.float64), torch.empty(0)],
    ids=["2d", "f64", "empty"],
)
def test_encode_rejects_bad_input(value: torch.Tensor) -> None:
    with pytest.raises(CodecError, match=r"1-D float32|empty"):
        get_codec("fp32").encode(value)


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_encode_rejects_non_finite_input(name: str, bad: float) -> None:
    x = torch.randn(300_000 if name == "topk" else 40)
    x[7] = bad
    with pytest.raises(CodecError, match=f"{name} cannot encode NaN or inf"):
        get_codec(name, block_size=16).encode(x)


def test_allowed_block_sizes() -> None:
    assert ALLOWED_BLOCK_SIZES == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@pytest.mark.parametrize("enabled", [True, False], ids=["feedback", "no-feedback"])
@pytest.mark.parametrize("codec", [*_LOSSY, get_codec("fp32")], ids=lambda c: c.name)
def test_compress_added_is_compress_bit_for_bit(codec: Codec, enabled: bool) -> None:
    """The learner's path (the delta added into the residual by a callback, no copy of it) sends the same bytes and
    keeps the same residual as `compress`, round after round (β < 1 for topk included)."""
    gen = torch.Generator().manual_seed(8)
    whole, added = ErrorFeedback(codec, 1000, enabled=enabled), ErrorFeedback(codec, 1000, enabled=enabled)
    for _ in range(4):
        delta = torch.randn(1000, generator=gen)
        assert added.compress_added(partial(torch.Tensor.add_, other=delta)) == whole.compress(delta)
        assert torch.equal(added.residual, whole.residual)
    if not enabled:
        assert added.residual.numel() == 0  # nothing is kept between rounds


def test_compress_added_resets_after_a_non_finite_delta() -> None:
    feedback = ErrorFeedback(get_codec("int8", block_size=16), 32)
    feedback.compress(torch.randn(32))
    bad = torch.randn(32)
    bad[3] = float("inf")
    with pytest.raises(CodecError, match="cannot encode NaN or inf"):
        feedback.compress_added(lambda residual: residual.add_(bad))
    assert torch.equal(feedback.residual, torch.zeros(32))


@pytest.mark.parametrize("decay", [None, 0.5], ids=["exact", "decayed"])
@pytest.mark.parametrize("codec", [*_LOSSY, get_codec("int8", block_size=16)], ids=lambda c: repr(c))
def test_a_residual_held_in_a_file_gives_the_same_bytes_and_residual(
    codec: Codec, decay: float | None, tmp_path: Path
) -> None:
    """`--spill-dir` on a learner: the residual in an unlinked file, read and written a slab at a time
    (`compress_slabs`), sends the same bytes and keeps the same residual as the one in memory, bit for bit, round
    after round; several slabs and a short last block (blockwise codecs), the whole vector at once (the others)."""
    numel = 3 * (1 << 20) + 77
    gen = torch.Generator().manual_seed(3)
    memory = ErrorFeedback(codec, numel, decay=decay)
    filed = ErrorFeedback(codec, numel, decay=decay, store=SpilledVector(str(tmp_path), numel))
    assert filed.residual.numel() == 0  # nothing model-sized in memory
    for _ in range(3):
        delta = torch.randn(numel, generator=gen)
        sent = filed.compress_slabs(lambda start, slab, d=delta: slab.add_(d[start : start + slab.numel()]))
        assert sent == memory.compress_added(partial(torch.Tensor.add_, other=delta))
        held = torch.empty(numel)
        assert filed.store is not None
        filed.store.read(0, held)
        assert torch.equal(held, memory.residual)
    filed.reset()
    filed.store.read(0, held)
    assert not held.any()


def test_a_residual_file_that_cannot_be_made_or_written_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ResourceExhausted, match="--spill-dir"):
        SpilledVector(str(tmp_path / "gone"), 10)
    with pytest.raises(CodecError, match="error feedback on"):
        ErrorFeedback(get_codec("fp32"), 10, store=SpilledVector(str(tmp_path), 10))
    with pytest.raises(CodecError, match="10 values"):
        ErrorFeedback(get_codec("int8"), 10, store=SpilledVector(str(tmp_path), 11))


def test_warm_up_compiles_the_block_kernels_only_for_blockwise_codecs() -> None:
    from diloco.core import kernels

    assert codecs.warm_up("fp32", "bf16", "topk", "sparse") is None
    thread = codecs.warm_up("fp32", "int4")
    assert thread is not None
    thread.join(timeout=120)
    assert not thread.is_alive()
    for kernel in (kernels.quantize, kernels.quantize_toward, kernels.dequantize):
        assert kernel.signatures, kernel  # compiled (or loaded from numba's cache) for the arrays the codecs pass
