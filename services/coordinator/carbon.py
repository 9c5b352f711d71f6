"""Live carbon intensities from an operator's provider function (`--carbon-provider package.module:function`).

The function is called as `function(zone, unix_s)` and returns the zone's intensity in gCO2/kWh (say, from a grid
operator's API or a local cache), or a mapping of zones to intensities that holds it (one answer for the whole
grid, say); `None`, or a mapping without the zone, is no value for it. It is someone else's code on someone else's
network, so it is kept off everything that matters:
- `CarbonFeed` calls it from a thread of its own, every `refresh_s` (and soon after `wake()`, when a learner
  brings a zone not asked yet), for the zones `zones()` names; the coordinator's event loop and its locks never
  wait for it: placement reads the last values (`services.coordinator.energy.CarbonSignal`).
- each call runs in a daemon thread and is abandoned after `timeout_s`. While an abandoned call is still running,
  the feed does not start another (a provider that hangs costs one thread, not one per refresh); the zones it
  would have asked are reported `still_running`.
- a call that raises, times out, gives no value for the zone or anything but an intensity (a finite number from 0
  to `MAX_GCO2_PER_KWH`) is reported through `on_failure`, and the zone keeps its last good value (or, with none
  yet, the carbon trace's value, else it is unknown: `services.coordinator.energy.CarbonSignal.fail`; the
  coordinator counts every failure by reason and zone, and logs each change). Nothing it does stops the feed or
  the coordinator.
- its module is imported once, at start-up (`load_provider`), bounded by the same `timeout_s`: a module that
  cannot be imported, raises as it loads or takes longer (waits on a network) is a start-up error.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from diloco.core.energy import MAX_GCO2_PER_KWH, valid_intensity
from diloco.errors import ConfigError

Provider = Callable[[str, float], Any]
ERROR, TIMEOUT, MISSING, BAD_VALUE, STILL_RUNNING = "error", "timeout", "missing", "bad_value", "still_running"
FAILURE_REASONS = (ERROR, TIMEOUT, MISSING, BAD_VALUE, STILL_RUNNING)


def load_provider(spec: str, timeout_s: float) -> Provider:
    """The function `spec` ('package.module:function') names; `ConfigError` naming --carbon-provider otherwise: its
    module cannot be imported (missing, or raising as it loads), has no such function, or takes longer than
    `timeout_s` to import (it waits on a network, say: the import is left behind in a daemon thread)."""
    module_name, _, attr = spec.partition(":")
    box: dict[str, Any] = {}

    def load() -> None:
        try:
            box["module"] = importlib.import_module(module_name)
        except BaseException as e:  # ImportError, or whatever the module raises as it loads
            box["error"] = e

    t = threading.Thread(target=load, name="carbon-provider-import", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ConfigError(
            f"--carbon-provider {spec}: importing {module_name} took more than {timeout_s:g} s "
            "(--carbon-provider-timeout-s); a provider's module must not wait on a network as it loads"
        )
    if "error" in box:
        raise ConfigError(f"--carbon-provider {spec}: cannot import {module_name} ({box['error']!r})")
    fn = getattr(box["module"], attr, None)
    if not callable(fn):
        raise ConfigError(f"--carbon-provider {spec}: {module_name} has no function {attr}")
    return fn


class CarbonFeed:
    def __init__(
        self,
        provider: Provider,
        zones: Callable[[], set[str]],
        on_value: Callable[[str, float], None],
        on_failure: Callable[[str, str, str], None],  # (zone, reason, detail)
        clock: Callable[[], float],
        *,
        refresh_s: float,
        timeout_s: float,
    ) -> None:
        self.provider, self.zones, self.on_value, self.on_failure, self.clock = (
            provider,
            zones,
            on_value,
            on_failure,
            clock,
        )
        self.refresh_s, self.timeout_s = refresh_s, timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._running: threading.Thread | None = None  # the provider call in flight, if any
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="carbon-feed", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop asking (a call in flight is abandoned: its thread is a daemon). Safe to call twice."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1.0)

    def wake(self) -> None:
        """Ask soon (a new zone appeared)."""
        self._wake.set()

    def busy(self) -> bool:
        """A provider call is running (an abandoned one included)."""
        running = self._running
        return running is not None and running.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._wake.wait(self.refresh_s)
            self._wake.clear()

    def refresh(self) -> None:
        """One round: ask for every zone in turn (each call bounded by `timeout_s`)."""
        for zone in sorted(self.zones()):
            if self._stop.is_set():
                return
            self._ask(zone)

    def _ask(self, zone: str) -> None:
        if self.busy():
            self.on_failure(zone, STILL_RUNNING, "an earlier call has not returned yet; it was not asked again")
            return
        box: dict[str, Any] = {}
        done = threading.Event()
        now = self.clock()

        def call() -> None:
            try:
                box["value"] = self.provider(zone, now)
            except BaseException as e:  # whatever it raises is reported, never propagated
                box["error"] = e
            finally:
                done.set()

        t = threading.Thread(target=call, name="carbon-provider-call", daemon=True)
        self._running = t
        t.start()
        if not done.wait(self.timeout_s):
            self.on_failure(zone, TIMEOUT, f"no answer within {self.timeout_s:g} s")
            return
        if "error" in box:
            self.on_failure(zone, ERROR, repr(box["error"])[:200])
            return
        value = box.get("value")
        if isinstance(value, Mapping):
            if zone not in value:
                self.on_failure(zone, MISSING, f"returned a mapping without {zone!r}")
                return
            value = value[zone]
        if value is None:
            self.on_failure(zone, MISSING, "returned None (no value for this zone)")
            return
        if not valid_intensity(value):
            self.on_failure(
                zone, BAD_VALUE, f"returned {value!r:.100}; expected a number from 0 to {MAX_GCO2_PER_KWH:g} (gCO2/kWh)"
            )
            return
        self.on_value(zone, float(value))
