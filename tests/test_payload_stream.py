"""The upload path's helpers: `prefetch` (receive the next chunk while this one decodes) and `BufferPool`."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from diloco.rpc.payload import BufferPool, prefetch

pytestmark = pytest.mark.timeout(30)


def test_prefetch_yields_every_item_in_order() -> None:
    assert list(prefetch(iter(range(1000)), depth=3)) == list(range(1000))


def test_prefetch_reads_ahead_at_most_depth_items() -> None:
    produced: list[int] = []
    gate = threading.Event()

    def items() -> Iterator[int]:
        for i in range(100):
            produced.append(i)
            yield i

    it = prefetch(items(), depth=4)
    assert next(it) == 0
    # the reader may hold `depth` items in the queue plus one in hand
    gate.wait(0.3)
    assert len(produced) <= 1 + 4 + 1
    assert list(it) == list(range(1, 100))


def test_prefetch_reraises_the_source_error_after_the_items_before_it() -> None:
    class Broken(Exception):
        pass

    def items() -> Iterator[int]:
        yield 1
        yield 2
        raise Broken("stream reset")

    got: list[int] = []
    with pytest.raises(Broken, match="stream reset"):
        for x in prefetch(items()):
            got.append(x)
    assert got == [1, 2]


def test_prefetch_stops_its_reader_when_the_consumer_stops_early() -> None:
    pulled: list[int] = []

    def items() -> Iterator[int]:
        for i in range(10_000):
            pulled.append(i)
            yield i

    before = {t.ident for t in threading.enumerate()}
    it = prefetch(items(), depth=2)
    assert next(it) == 0
    (reader,) = [t for t in threading.enumerate() if t.ident not in before and t.name == "prefetch"]
    it.close()  # the consumer gives up (e.g. a bad chunk was refused)
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert len(pulled) < 10_000


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
