"""The state checksum (ALGORITHM.md section 10): what a learner's `Θ̂_v` and the coordinator's are compared by, after
every delta a learner applies and when it names the version it holds.

h(x) = Σ_i K_{i div 4096} · W_{i mod 4096} · bits(x_i) mod 2^64 over a flat float32 vector's elements: `WEIGHTS`
(odd, 32 bits) and the keys K_p (odd, 64 bits: `period_keys`), both from splitmix64, are part of the protocol. A
sum, so it is made of independent terms: a window's term depends only on its values and where they sit. Rewriting
a window moves h by (its new term − its old term) (`moved`), and the block codecs' fused loops
(`diloco.core.kernels`) return both terms of what they rewrite while it is in cache: a delta over a fragment costs
a pass over that fragment only, and the windows of a delta may arrive in any order."""

from __future__ import annotations

import numpy as np
import torch

from diloco.core import parallel

MASK = (1 << 64) - 1
PERIOD = 4096  # elements per key, the weight table's length: at least the largest block size
# below this many elements numpy takes the checksum: a small job's start-up does not wait for numba's import
NUMPY_BELOW = 1 << 20


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping); `kernels._key` is the same for one period."""
    with np.errstate(over="ignore"):
        z = z * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


WEIGHTS = (_splitmix64(np.arange(1 << 32, (1 << 32) + PERIOD, dtype=np.uint64)) | np.uint64(1)).astype(np.uint32)


def period_keys(first: int, count: int) -> np.ndarray:
    """K_p for periods first .. first + count − 1 (uint64)."""
    return _splitmix64(np.arange(first, first + count, dtype=np.uint64)) | np.uint64(1)


def numpy_term(x: np.ndarray, element: int) -> int:
    """`kernels.checksum_term` in numpy (the same value; a pass per operation, so for small vectors only)."""
    if x.size == 0:
        return 0
    index = np.arange(element, element + x.size, dtype=np.int64)
    products = x.view(np.uint32).astype(np.uint64) * WEIGHTS[index % PERIOD].astype(np.uint64)
    period = index // PERIOD
    starts = np.flatnonzero(np.diff(period, prepend=period[0] - 1))  # where each period's run begins
    sums = np.add.reduceat(products, starts)
    with np.errstate(over="ignore"):
        return int((sums * period_keys(int(period[0]), len(starts))).sum(dtype=np.uint64))


def checksum(flat: torch.Tensor, element: int = 0) -> int:
    """The term of a contiguous 1-D float32 CPU tensor whose first value sits at absolute index `element` (0: the
    checksum h of a whole vector), its parts on `parallel.threads()` threads."""
    x = flat.numpy()
    if x.size < NUMPY_BELOW:
        return numpy_term(x, element) & MASK
    from diloco.core import kernels  # numba's start-up stays out of processes that never check a large state

    parts = parallel.map_parts(lambda lo, hi: int(kernels.checksum_term(x[lo:hi], element + lo)), 0, x.size)
    return sum(parts) & MASK


def moved(h: int, old: int, new: int) -> int:
    """h once a window whose term was `old` holds values whose term is `new`."""
    return (h - old + new) & MASK
