"""The state checksum (ALGORITHM.md section 10): what a learner's `Θ̂_v` and the coordinator's are compared by, after
every delta a learner applies and when it names the version it holds.

h(x) = Σ_i K_{i div 4096} · W_{i mod 4096} · bits(x_i) mod 2^64 over a flat float32 vector's elements (the weights
and keys: `diloco.core.kernels`). A sum, so it is made of independent terms: a window's term depends only on its
values and where they sit. Rewriting a window moves h by (its new term − its old term) (`moved`), and the block
codecs' fused loops return both terms of what they rewrite while it is in cache: a delta over a fragment costs a
pass over that fragment only, and the windows of a delta may arrive in any order."""

from __future__ import annotations

import torch

from diloco.core import parallel

MASK = (1 << 64) - 1


def checksum(flat: torch.Tensor, element: int = 0) -> int:
    """The term of a contiguous 1-D float32 CPU tensor whose first value sits at absolute index `element` (0: the
    checksum h of a whole vector), its parts on `parallel.threads()` threads."""
    from diloco.core import kernels  # numba's start-up stays out of processes that never check a state

    x = flat.numpy()
    parts = parallel.map_parts(lambda lo, hi: int(kernels.checksum_term(x[lo:hi], element + lo)), 0, x.size)
    return sum(parts) & MASK


def moved(h: int, old: int, new: int) -> int:
    """h once a window whose term was `old` holds values whose term is `new`."""
    return (h - old + new) & MASK
