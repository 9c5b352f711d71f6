"""Token-weighted mean and RDA against hand-computed cases (ALGORITHM.md section 4)."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.core.codecs import get_codec
from diloco.core.merge import EncodedDelta, MergeAccumulator, Segment, SegmentSquares, merge
from diloco.errors import ConfigError, InvalidArgument


def test_token_weighted_mean_hand_computed() -> None:
    out = merge([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 4.0])], [300, 100])
    # (300 * [1, 0] + 100 * [0, 4]) / 400 = [0.75, 1.0]
    assert out.tolist() == pytest.approx([0.75, 1.0])


def test_equal_tokens_is_the_plain_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    ds = [torch.randn(50, generator=gen) for _ in range(4)]
    assert torch.allclose(merge(ds, [7, 7, 7, 7]), torch.stack(ds).mean(0), atol=1e-6)


def test_rda_keeps_the_norm_of_orthogonal_updates() -> None:
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 3.0])
    mean = merge([a, b], [1, 1])
    rda = merge([a, b], [1, 1], method="rda")
    assert torch.linalg.vector_norm(mean).item() == pytest.approx(3 / math.sqrt(2))
    # norm = mean of norms = 3; direction = unit(unit(a) + unit(b)) = [1, 1] / sqrt(2)
    assert rda.tolist() == pytest.approx([3 / math.sqrt(2), 3 / math.sqrt(2)])


def test_rda_hand_computed_weighted_per_segment() -> None:
    d1 = torch.tensor([2.0, 0.0, 1.0])
    d2 = torch.tensor([0.0, 4.0, 3.0])
    segs = [Segment(0, 2), Segment(2, 1, embedding=True)]
    out = merge([d1, d2], [1, 3], method="rda", segments=segs)
    # segment 0: norm = (1*2 + 3*4)/4 = 3.5; direction = unit(1*[1,0] + 3*[0,1]) = [1,3]/sqrt(10)
    assert out[:2].tolist() == pytest.approx([3.5 / math.sqrt(10), 3.5 * 3 / math.sqrt(10)])
    # embedding segment: plain token-weighted mean (1*1 + 3*3)/4 = 2.5
    assert out[2].item() == pytest.approx(2.5)


def test_accumulator_reset_and_errors() -> None:
    acc = MergeAccumulator(2)
    with pytest.raises(InvalidArgument, match="no pseudo-gradient"):
        acc.result()
    with pytest.raises(InvalidArgument, match="tokens > 0"):
        acc.add(torch.zeros(2), 0)
    with pytest.raises(InvalidArgument, match="expected 2"):
        acc.add(torch.zeros(3), 1)
    acc.add(torch.ones(2), 5)
    acc.reset()
    acc.add(torch.full((2,), 2.0), 1)
    assert acc.result().tolist() == [2.0, 2.0]
    with pytest.raises(ConfigError, match="allowed: mean, rda"):
        MergeAccumulator(2, method="median")


def _encoded(delta: torch.Tensor, codec: str, segments: list[Segment]) -> tuple[EncodedDelta, torch.Tensor]:
    """`delta` encoded with `codec` and measured on arrival as the coordinator does, and what it decodes to."""
    data, meta = get_codec(codec, block_size=64, topk_fraction=0.05).encode(delta)
    squares = SegmentSquares(segments)
    decoder = get_codec(codec, block_size=64).decoder(meta, sink=squares)
    for i in range(0, len(data), 1000):  # as chunks arrive
        decoder.feed(memoryview(data)[i : i + 1000])
    decoder.verify()
    return EncodedDelta(meta, data, squares), get_codec(codec, block_size=64).decode(data, meta)


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "topk", "sparse"])
@pytest.mark.parametrize("method", ["mean", "rda"])
def test_an_encoded_delta_folds_exactly_like_its_decoded_tensor(codec: str, method: str) -> None:
    gen = torch.Generator().manual_seed(7)
    segments = [Segment(0, 700, embedding=True), Segment(700, 1300), Segment(2000, 1001)]
    numel = 3001
    deltas = [torch.randn(numel, generator=gen) * (i + 1) for i in range(3)]
    held, decoded = zip(*(_encoded(d, codec, segments) for d in deltas), strict=True)
    a, b = MergeAccumulator(numel, method, segments), MergeAccumulator(numel, method, segments)
    for i in range(3):
        a.add(held[i], 10 + i)
        b.add(decoded[i], 10 + i)
        assert held[i].norm() == pytest.approx(float(torch.linalg.vector_norm(decoded[i])), rel=1e-6)
    if method == "mean" and codec != "topk":  # the same fp32 add per element
        assert torch.equal(a.result(), b.result())
    else:  # rda's norms are sums over windows of different sizes; topk folds through index_add_
        assert torch.allclose(a.result(), b.result(), rtol=1e-5, atol=1e-6)


def test_the_lent_buffer_is_zeroed_before_the_next_round_folds() -> None:
    acc = MergeAccumulator(4)
    assert acc.lend() is None  # nothing folded yet: no buffer
    acc.add(torch.ones(4), 1)
    with pytest.raises(InvalidArgument, match="open round"):
        acc.lend()
    acc.result()
    acc.reset()
    scratch = acc.lend()
    assert scratch is not None
    scratch.fill_(123.0)  # used as scratch meanwhile
    acc.add(torch.full((4,), 2.0), 1)
    assert acc.result().tolist() == [2.0] * 4


def test_non_finite_values_make_the_measured_norm_non_finite() -> None:
    held, _ = _encoded(torch.tensor([1.0, float("nan"), 2.0]), "fp32", [Segment(0, 3)])
    assert math.isnan(held.norm())
