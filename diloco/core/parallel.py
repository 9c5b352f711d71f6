"""How many threads a process's model-sized passes use: torch's intra-op threads (the outer step, the merge's adds,
a learner's AdamW and rebase) and the parts the codecs' compiled loops (`diloco.core.kernels`, which release the
GIL) and zlib-ng's crc32 are split into (`map_parts`). One setting, `set_threads`, for both: the services take it
from `--threads` (default 1: a service per core, as `diloco local` and the tests run them; a coordinator or an
island alone on a many-core host gives it its cores).

A vector split into parts gives the same bits as one pass over it: every part covers whole blocks of the codec,
each block is computed as before, and crc32s of consecutive parts combine into the crc32 of the whole
(`crc32_combine`). Parts are contiguous and about equal, one per thread, each at least `MIN_PART_ELEMENTS`: a
thread per small slab would cost more in hand-offs than it saves."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from zlib_ng.zlib_ng import crc32, crc32_combine

from diloco.errors import ConfigError

MAX_THREADS = 1024
MIN_PART_ELEMENTS = 1 << 20  # below this many elements a part is not worth a thread of its own

T = TypeVar("T")

_threads = 1
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def check_threads(n: object, what: str = "threads") -> int:
    """`n` as a thread count, or ConfigError saying what is allowed."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise ConfigError(f"{what} must be an integer in [1, {MAX_THREADS}], got {n!r}: use about one per core")
    return n


def set_threads(n: int) -> None:
    """Use `n` threads for model-sized passes, torch's and the codecs'."""
    import torch  # here: the services' flag parsing checks --threads without loading torch

    global _threads, _pool
    n = check_threads(n)
    torch.set_num_threads(n)
    with _lock:
        if n != _threads and _pool is not None:
            _pool.shutdown(wait=False)  # parts running on it finish; new ones go to the next pool
            _pool = None
        _threads = n


def threads() -> int:
    return _threads


def split(start: int, end: int, align: int, parts: int, min_part: int = MIN_PART_ELEMENTS) -> list[tuple[int, int]]:
    """[start, end) cut into at most `parts` contiguous ranges of about equal length: one (the whole) when it is
    shorter than twice `min_part`, else each but the last at least `min_part` long and a multiple of `align` (the
    last takes what is left). Pure."""
    n = end - start
    if n <= 0:
        return []
    count = max(1, min(parts, n // max(min_part, align, 1)))
    step = -(-n // count)
    step = -(-step // align) * align
    out, lo = [], start
    while lo < end:
        hi = min(lo + step, end)
        out.append((lo, hi))
        lo = hi
    return out


def map_parts(fn: Callable[[int, int], T], start: int, end: int, align: int = 1) -> list[T]:
    """`fn(lo, hi)` for each part of [start, end) (`split` into up to `threads()` parts), run at once on a shared
    pool, the last on this thread; results in order. `fn` must only write to its own part's memory."""
    ranges = split(start, end, align, _threads, MIN_PART_ELEMENTS)
    if len(ranges) <= 1:
        return [fn(lo, hi) for lo, hi in ranges]
    futures = [_executor().submit(fn, lo, hi) for lo, hi in ranges[:-1]]
    last = fn(*ranges[-1])
    return [f.result() for f in futures] + [last]


def crc_combine(crcs: list[tuple[int, int]], crc: int = 0) -> int:
    """The crc32 of consecutive byte ranges, given each one's (crc32, length), chained after `crc`."""
    for part_crc, length in crcs:
        crc = crc32_combine(crc, part_crc, length)
    return crc


def parallel_crc32(data: memoryview, crc: int = 0) -> int:
    """crc32 of `data` (a contiguous byte view) chained after `crc`, its parts on `threads()` threads."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    parts = map_parts(lambda lo, hi: (crc32(view[lo:hi]), hi - lo), 0, len(view), 1)
    return crc_combine(parts, crc)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, _threads - 1), thread_name_prefix="diloco-part")
        return _pool
