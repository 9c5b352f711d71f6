"""Holds on a tensor its owner otherwise writes in place, so that a reader outside the owner's lock needs no copy.

A reader takes a hold (under the owner's lock, so the tensor is as it should be) and reads the tensor at its own
pace; it calls the release it was given when done. Before writing, the owner calls `let_go()`: True means a hold
is out, so the owner writes a new tensor instead (the holders keep the old one, freed with the last reference);
False means it may write in place. Either way later holds are on the tensor it writes next. A model-sized copy is
thus made only when a write comes while someone reads. Thread-safe: a release may come from any thread (the count
has its own leaf lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Holds"]


class Holds:
    """The holds out on one owner's current tensor (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0  # holds out on the current tensor
        self._generation = 0  # which tensor that is: a release of a hold on an earlier one counts nothing

    def hold(self) -> Callable[[], None]:
        """A hold on the current tensor; call the returned function once done (more calls do nothing)."""
        with self._lock:
            self._count += 1
            generation = self._generation
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released and generation == self._generation:
                    self._count -= 1
                released = True

        return release

    def let_go(self) -> bool:
        """The owner is about to write or replace the tensor: whether any hold was out on it (then it must not be
        written again). Later holds are on the next tensor."""
        with self._lock:
            held = self._count > 0
            self._count = 0
            self._generation += 1
        return held
