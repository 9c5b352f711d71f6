"""The C heap of a process that holds model-sized tensors: memory it frees goes back to the system.

glibc's `malloc` serves a block below its mmap threshold from the heap, and raises that threshold (up to 32 MiB)
every time a larger mapped block is freed. Heap memory freed in the middle of the heap stays resident. A learner
allocates its gradients (one block per parameter, a few MiB each) in every step and frees them after it: from the
heap, their pages would stay resident after the step, so what comes next (a broadcast's new Θ̂, the payload of an
upload) would add to them. With the threshold fixed at `MMAP_THRESHOLD_BYTES`, every block that large is a mapping
of its own, unmapped when freed. Measured with `hf:llama-100m` (0.30 GB fp32) in one process taking the learner's
path: resident memory after a step fell from 6.4x to 5.1x the fp32 model bytes. The coordinator sets it too: the
model it builds at start is freed once flattened (its layers are blocks of a few MiB), and without the fixed
threshold 0.2-0.4 GB of it stayed resident at 100M parameters, a different amount in every run.
"""

from __future__ import annotations

import ctypes
import ctypes.util

MMAP_THRESHOLD_BYTES = 1 << 20  # blocks of 1 MiB and more: their own mapping (the page faults cost little)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)


def return_freed_memory(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold_bytes` for this process (and so stop it from moving). False where
    the C library has no `mallopt` (not glibc), which then keeps its own policy."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold_bytes)))
