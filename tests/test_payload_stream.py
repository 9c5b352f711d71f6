"""The upload path's decode buffers: `BufferPool`."""

from __future__ import annotations

import pytest
import torch

from diloco.rpc.payload import BufferPool

pytestmark = pytest.mark.timeout(30)


def test_buffer_pool_reuses_buffers_up_to_its_size() -> None:
    pool = BufferPool(numel=16, size=1)
    assert pool.take() is None  # empty until a buffer comes back
    a, b = torch.empty(16), torch.empty(16)
    pool.give(a)
    pool.give(b)  # beyond the size: dropped
    assert pool.take() is a
    assert pool.take() is None


def test_buffer_pool_refuses_buffers_of_another_shape_or_dtype() -> None:
    pool = BufferPool(numel=16, size=4)
    pool.give(torch.empty(8))
    pool.give(torch.empty(16, dtype=torch.float64))
    pool.give(torch.empty(32)[::2])  # not contiguous
    assert pool.take() is None
