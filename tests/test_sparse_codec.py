"""The `sparse` codec (chunked top-k with 2-bit values, SparseLoCo-class): byte layout, sizes, streaming, malformed
payloads and error feedback with a decaying residual. The generic codec tests (tests/test_codecs.py) run it too."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from diloco.core.codecs import CodecError, EncodedMeta, ErrorFeedback, SparseCodec, check_ef_decay, get_codec

_VALUE = st.floats(-1e4, 1e4, width=32).map(lambda v: 0.0 if abs(v) < 1e-30 else v)
_VECTORS = hnp.arrays(np.float32, st.integers(1, 300), elements=_VALUE)


def _codec(block_size: int = 16, fraction: float = 0.125) -> SparseCodec:
    codec = get_codec("sparse", block_size=block_size, topk_fraction=fraction)
    assert isinstance(codec, SparseCodec)
    return codec


def _payload(records: list[bytes], numel: int, block_size: int = 16, per_chunk: int = 2) -> tuple[bytes, EncodedMeta]:
    data = b"".join(records)
    return data, EncodedMeta("sparse", numel, len(data), zlib.crc32(data), block_size, per_chunk)


def _record(low: float, step: float, offsets: tuple[int, int], codes: int) -> bytes:
    return struct.pack("<ffHHB", low, step, *offsets, codes)


# --- layout ------------------------------------------------------------------------------------------------


def test_golden_bytes() -> None:
    """Two chunks (16 elements and a short one of 4), two entries kept per chunk."""
    x = torch.zeros(20)
    x[1], x[5] = 3.0, -2.0
    x[16:] = torch.tensor([1.0, 0.0, -4.0, 0.5])
    codec = _codec()
    data, meta = codec.encode(x)
    # chunk 0: offsets 1, 5; magnitudes 3, 2 -> low 2, step 1; codes 1 (m=1, +) and 2 (m=0, -): 1 | 2 << 2
    # chunk 1: offsets 0, 2; magnitudes 1, 4 -> low 1, step 3; codes 0 (m=0, +) and 3 (m=1, -): 0 | 3 << 2
    assert data == _record(2.0, 1.0, (1, 5), 0x09) + _record(1.0, 3.0, (0, 2), 0x0C)
    assert meta == EncodedMeta("sparse", 20, 26, zlib.crc32(data), block_size=16, topk_count=2)
    expected = torch.zeros(20)
    expected[1], expected[5], expected[16], expected[18] = 3.0, -2.0, 1.0, -4.0
    assert torch.equal(codec.decode(data, meta), expected)


def test_defaults_and_size_at_one_million_elements() -> None:
    codec = _codec(4096, SparseCodec.DEFAULT_FRACTION)
    assert (get_codec("sparse").block_size, get_codec("sparse").per_chunk) == (4096, 64)  # type: ignore[attr-defined]
    x = torch.randn(1_032_576, generator=torch.Generator().manual_seed(0))
    data, meta = codec.encode(x)
    chunks = -(-x.numel() // 4096)
    assert len(data) == meta.encoded_bytes == SparseCodec.payload_bytes(x.numel(), 4096, 64)
    assert len(data) == (chunks - 1) * 152 + 152  # the last chunk (384 elements) still keeps 64 entries
    assert 4 * x.numel() / len(data) > 100  # over 100x below fp32
    out = codec.decode(data, meta)
    assert int((out != 0).sum()) == 64 * chunks


def test_short_last_chunk_keeps_at_most_its_length() -> None:
    codec = _codec(16, 0.5)  # 8 per chunk
    data, meta = codec.encode(torch.arange(1.0, 20.0))  # 16 + 3
    assert meta.topk_count == 8
    assert len(data) == SparseCodec.record_bytes(8) + SparseCodec.record_bytes(3) == 8 + 16 + 2 + 8 + 6 + 1
    out = codec.decode(data, meta)
    assert out[16:].tolist() != [0.0, 0.0, 0.0] and bool((out[16:] != 0).all())


@settings(max_examples=60, deadline=None)
@given(_VECTORS, st.sampled_from([16, 32, 64]), st.sampled_from([0.05, 0.125, 0.5, 1.0]))
def test_kept_entries_and_exact_subtraction(values: np.ndarray, block_size: int, fraction: float) -> None:
    """Per chunk at most k entries survive, each with its input's sign, within the chunk's kept magnitudes; and
    `encode_and_subtract` leaves exactly input - decoded (what error feedback relies on)."""
    codec = _codec(block_size, fraction)
    x = torch.from_numpy(values.copy())
    data, meta = codec.encode(x)
    out = codec.decode(data, meta)
    assert len(data) == SparseCodec.payload_bytes(x.numel(), block_size, meta.topk_count)
    for start in range(0, x.numel(), block_size):
        chunk, got = x[start : start + block_size], out[start : start + block_size]
        kept = got != 0
        assert int(kept.sum()) <= meta.topk_count
        assert bool((torch.sign(got[kept]) == torch.sign(chunk[kept])).all())
        if bool(kept.any()):
            top = chunk.abs().max()
            assert float(got.abs().max()) <= float(top) * (1 + 1e-6)
    target = x.clone()
    assert codec.encode_and_subtract(target) == (data, meta)
    assert torch.equal(target, x - out)


def test_streaming_writes_each_chunk_as_its_record_arrives() -> None:
    codec = _codec()
    x = torch.randn(48, generator=torch.Generator().manual_seed(1))
    data, meta = codec.encode(x)
    expected = codec.decode(data, meta)
    out = torch.full((48,), 7.0)
    decoder = codec.decoder(meta, out)
    decoder.feed(data[: SparseCodec.record_bytes(2) + 1])  # one record and one byte
    assert torch.equal(out[:16], expected[:16])
    assert bool((out[16:] == 7.0).all())
    decoder.feed(data[SparseCodec.record_bytes(2) + 1 :])
    assert decoder.finish() is out and torch.equal(out, expected)


# --- malformed payloads ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([_record(1, 1, (5, 1), 0), _record(1, 1, (0, 1), 0)], "chunk 0: offset 1 does not increase"),
        ([_record(1, 1, (0, 1), 0), _record(1, 1, (3, 3), 0)], "chunk 1: offset 3 does not increase"),
        ([_record(1, 1, (0, 16), 0), _record(1, 1, (0, 1), 0)], "chunk 0: offset 16 is out of range for a chunk of 16"),
        ([_record(1, 1, (0, 1), 0), _record(1, 1, (0, 4), 0)], "chunk 1: offset 4 is out of range for a chunk of 4"),
        ([_record(float("nan"), 1, (0, 1), 0), _record(1, 1, (0, 1), 0)], "chunk 0 has low nan"),
        ([_record(1, 1, (0, 1), 0), _record(1, float("inf"), (0, 1), 0)], "chunk 1 has low 1.0 and step inf"),
        ([_record(-1, 1, (0, 1), 0), _record(1, 1, (0, 1), 0)], "chunk 0 has low -1.0"),
    ],
)
def test_malformed_records_are_refused(records: list[bytes], message: str) -> None:
    data, meta = _payload(records, 20)
    codec = get_codec("sparse")
    with pytest.raises(CodecError, match=message):
        codec.decode(data, meta)
    decoder = codec.decoder(meta)  # also when the bad record comes in a later chunk of the stream
    decoder.feed(data[:5])
    with pytest.raises(CodecError, match=message):
        decoder.feed(data[5:])
    with pytest.raises(CodecError, match="decoder already failed"):
        decoder.finish()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"topk_count": 17, "encoded_bytes": SparseCodec.payload_bytes(20, 16, 17)}, r"outside \[1, block_size=16\]"),
        ({"topk_count": 0}, r"topk_count 0 is outside"),
        ({"block_size": 100}, "block_size 100 is not allowed"),
        ({"encoded_bytes": 27}, "encoded_bytes 27 does not match codec sparse"),
    ],
)
def test_malformed_meta_is_refused(change: dict[str, int], message: str) -> None:
    _, meta = _codec().encode(torch.randn(20))
    meta.validate(expected_numel=20)
    bad = dataclasses.replace(
        meta,
        block_size=change.get("block_size", meta.block_size),
        topk_count=change.get("topk_count", meta.topk_count),
        encoded_bytes=change.get("encoded_bytes", meta.encoded_bytes),
    )
    with pytest.raises(CodecError, match=message):
        bad.validate(expected_numel=20)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(CodecError, match=r"chunk \(block_size\) 100 is not allowed"):
        get_codec("sparse", block_size=100)
    with pytest.raises(CodecError, match=r"fraction must be in \(0, 1\]"):
        get_codec("sparse", topk_fraction=0.0)
    with pytest.raises(CodecError, match="cannot encode NaN or inf"):
        _codec().encode(torch.tensor([1.0, float("inf"), 0.0]))


# --- error feedback ----------------------------------------------------------------------------------------


def test_exact_feedback_sends_everything_eventually() -> None:
    """β = 1: what was sent plus the residual is the sum of every delta (float64 bookkeeping)."""
    codec = _codec(64, 1 / 16)
    feedback = ErrorFeedback(codec, 1000, decay=1.0)
    gen = torch.Generator().manual_seed(2)
    sent = torch.zeros(1000, dtype=torch.float64)
    total = torch.zeros(1000, dtype=torch.float64)
    for _ in range(50):
        delta = torch.randn(1000, generator=gen)
        data, meta = feedback.compress(delta)
        total += delta.double()
        sent += codec.decode(data, meta).double()
    assert torch.allclose(sent + feedback.residual.double(), total, atol=1e-4)


def test_decayed_feedback_keeps_exactly_what_was_not_sent() -> None:
    codec = _codec(64, 1 / 16)
    feedback = ErrorFeedback(codec, 1000)
    assert feedback.enabled and feedback.decay == SparseCodec.residual_decay < 1.0
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        delta = torch.randn(1000, generator=gen)
        target = delta + feedback.decay * feedback.residual
        data, meta = feedback.compress(delta)
        assert torch.equal(feedback.residual, target - codec.decode(data, meta))


@pytest.mark.parametrize("beta", [0.0, -0.5, 1.5, float("nan")])
def test_ef_decay_is_bounded(beta: float) -> None:
    with pytest.raises(CodecError, match=r"decay \(beta\) must be in \(0, 1\]"):
        check_ef_decay(beta)
    with pytest.raises(CodecError, match=r"decay \(beta\) must be in \(0, 1\]"):
        ErrorFeedback(_codec(), 10, decay=beta)
    assert check_ef_decay(1) == 1.0
