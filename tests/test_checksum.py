"""The state checksum of Θ̂ (ALGORITHM.md section 10, `diloco.core.checksum`): a sum of window terms, so windows
combine in any order and a rewrite moves it by its own terms; and the changes a broken decoder or a wrong base make
(a value changed, signs flipped, values swapped, nibbles in the wrong order) change it."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core import kernels, parallel
from diloco.core.checksum import MASK, checksum, moved, numpy_term


def vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20_000), cuts=st.lists(st.integers(0, 20_000), max_size=6), seed=st.integers(0, 99))
def test_window_terms_add_up_to_the_whole_in_any_order(n: int, cuts: list[int], seed: int) -> None:
    x = vector(n, seed)
    bounds = sorted({0, n, *(c % (n + 1) for c in cuts)})
    terms = [checksum(x[lo:hi], lo) for lo, hi in itertools.pairwise(bounds)]
    assert sum(reversed(terms)) & MASK == checksum(x)
    assert 0 <= checksum(x) <= MASK


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 10_000), lo=st.integers(0, 9_999), size=st.integers(1, 5_000), seed=st.integers(0, 99))
def test_rewriting_a_window_moves_the_checksum_by_its_terms(n: int, lo: int, size: int, seed: int) -> None:
    x = vector(n, seed)
    lo = lo % n
    hi = min(n, lo + size)
    before, old = checksum(x), checksum(x[lo:hi], lo)
    x[lo:hi] = vector(hi - lo, seed + 1)
    assert moved(before, old, checksum(x[lo:hi], lo)) == checksum(x)


def test_the_changes_a_broken_apply_makes_change_it() -> None:
    x = vector(3 * kernels.PERIOD + 77, 5)
    h = checksum(x)
    bits = x.view(torch.int32)
    changed = []
    one = x.clone()
    one.view(torch.int32)[4000] ^= 1  # one ulp
    changed.append(one)
    signs = x.clone()
    signs.view(torch.int32)[[10, 11]] ^= np.int32(-(1 << 31))  # two sign bits
    changed.append(signs)
    same_weight = x.clone()
    same_weight.view(torch.int32)[[10, 10 + kernels.PERIOD]] ^= np.int32(-(1 << 31))  # same weight, other periods
    changed.append(same_weight)
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]  # neighbours swapped (an int4 decoder taking the nibbles in the wrong order)
    changed.append(swapped)
    far = x.clone()
    far[[7, 7 + kernels.PERIOD]] = x[[7 + kernels.PERIOD, 7]]  # the same position in two periods
    changed.append(far)
    second_difference = x.clone()
    second_difference.view(torch.int32)[[100, 101, 102]] += torch.tensor([1, -2, 1], dtype=torch.int32)
    changed.append(second_difference)
    for y in changed:
        assert not torch.equal(y.view(torch.int32), bits)
        assert checksum(y) != h


def test_the_weights_are_fixed_and_odd() -> None:
    """Part of the protocol: every process derives the same table (a change here breaks mixed versions)."""
    assert kernels.WEIGHTS.dtype == np.uint32 and kernels.WEIGHTS.size == kernels.PERIOD
    assert bool(np.all(kernels.WEIGHTS & 1))
    assert int(kernels.WEIGHTS[0]) == 0xF1FC5E61 and checksum(torch.tensor([1.0, -2.0])) == 0xA09D2B94CF800000


def test_the_same_on_any_number_of_threads() -> None:
    x = vector(5 * (1 << 20) + 3, 2)
    got = []
    try:
        for n in (1, 2, 3):
            parallel.set_threads(n)
            got.append(checksum(x))
    finally:
        parallel.set_threads(1)
    assert len(set(got)) == 1


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12_000), element=st.integers(0, 1 << 34), seed=st.integers(0, 99))
def test_numpy_takes_the_same_checksum_as_the_kernels(n: int, element: int, seed: int) -> None:
    """Small vectors are checksummed in numpy (no numba import on a small job's start-up path)."""
    x = vector(n, seed).numpy()
    assert numpy_term(x, element) == int(kernels.checksum_term(x, element))
