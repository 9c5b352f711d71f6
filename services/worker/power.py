"""A learner's live power draw (issue #15): the watts it draws while it trains, and where the figure comes from
(`diloco.core.energy.PowerSource`).

Sources (`open_meter`; `--power-meter auto` takes the first that works for the learner's device):
- `nvml`, for a learner on CUDA: NVIDIA's management library through `pynvml` (the nvidia-ml-py package, imported
  only then). Per GPU of the learner (an island: each rank's GPU on this host): its total energy counter
  (`nvmlDeviceGetTotalEnergyConsumption`, mJ since the driver loaded; Volta and newer), else its power reading
  (`nvmlDeviceGetPowerUsage`, mW) integrated over time between reads (trapezoids). GPUs only: the host's CPUs
  and memory are not in the figure.
- `rapl`, for a learner on CPU: Linux RAPL energy counters, `/sys/class/powercap/intel-rapl:*/energy_uj` (µJ),
  of every CPU package (a zone named `package-N`) and every `dram` zone (not inside a package's count); the
  `psys` platform zone is left out, since it contains the packages. Only when readable: most kernels let only
  root read them (since CVE-2020-8694). A counter wraps to 0 past `max_energy_range_uj`: a read lower than the
  previous one counts the distance to the wrap plus the new value (`wrap_delta`; reads are far more frequent
  than a wrap, minutes at full load).
- `declared`: the operator's `--power-w`, when no counter can be read (0: the learner reports no power).

Only training counts. The training loop brackets its inner steps with `begin(now)` / `end(now)`; the meter adds
up energy and seconds over those windows and, once they hold `window_s` seconds of training, publishes
energy / seconds as the learner's watts (`reading()`), which go to the coordinator with the registration and
every heartbeat. So a learner that waits (for a broadcast, a plan, or paused by the placement policy) still
reports what it draws while it trains: the figure joules per token needs. A window whose figure is not a finite
number in [0, MAX_WATTS] (`out_of_range`: a counter reset, a driver glitch), or whose counter could not be read
(`unreadable`), is dropped and the previous figure stays; until a first window is measured the declared figure (if
any) is reported. `on_drop` hears of each dropped window (the worker counts them in
`diloco_worker_power_windows_dropped_total{reason}` and logs the first of each run of drops).

Time is a parameter (`now`, seconds of a monotonic clock); the counters read their files or NVML when asked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from diloco.core.energy import PowerSource
from diloco.errors import ConfigError
from diloco.rpc.limits import MAX_WATTS

POWERCAP = Path("/sys/class/powercap")
METER_MODES = ("auto", "nvml", "rapl", "declared")
WINDOW_S = 1.0  # seconds of training a published figure averages over
JOIN_GAP_S = 0.05  # a window opened this soon after the last one closed reuses that read (one read per step)
_RAPL_ZONE = re.compile(r"intel-rapl(:\d+)+$")
UNREADABLE, OUT_OF_RANGE = "unreadable", "out_of_range"  # why a window was dropped


class MeterUnavailable(Exception):
    """This source cannot be read here (the message says why)."""


@dataclass(frozen=True)
class Reading:
    watts: float
    source: PowerSource


class EnergyCounter(Protocol):
    """Cumulative energy in joules since the counter was opened, never decreasing."""

    source: PowerSource

    def read_j(self, now: float) -> float: ...


def wrap_delta(prev: int, cur: int, max_range: int) -> int:
    """Units between two reads of a counter that wraps to 0 past `max_range` (at most one wrap between reads)."""
    if cur >= prev:
        return cur - prev
    return max_range - prev + cur


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


@dataclass
class RaplZone:
    """One RAPL zone's counter: `path` holds `energy_uj` and `max_energy_range_uj`."""

    path: Path
    name: str
    max_range_uj: int
    last_uj: int

    def delta_uj(self) -> int:
        """µJ since the previous read (raises OSError or ValueError when the file cannot be read)."""
        cur = _read_int(self.path / "energy_uj")
        if not 0 <= cur <= self.max_range_uj:
            raise ValueError(f"{self.path}/energy_uj is {cur}, outside [0, {self.max_range_uj}]")
        d = wrap_delta(self.last_uj, cur, self.max_range_uj)
        self.last_uj = cur
        return d


def rapl_zones(root: Path = POWERCAP) -> list[RaplZone]:
    """The readable RAPL zones under `root` to add up: CPU packages and DRAM (not `psys`, nor a package's `core`
    and `uncore` parts, which its own count holds)."""
    try:
        entries = sorted(p for p in root.iterdir() if _RAPL_ZONE.match(p.name))
    except OSError:
        return []
    zones = []
    for d in entries:
        try:
            name = (d / "name").read_text().strip()
            if not (name.startswith("package") or name == "dram"):
                continue
            max_range = _read_int(d / "max_energy_range_uj")
            first = _read_int(d / "energy_uj")
        except (OSError, ValueError):  # not readable (root only), or not a counter
            continue
        if max_range > 0 and 0 <= first <= max_range:
            zones.append(RaplZone(d, name, max_range, first))
    return zones


class RaplCounter:
    source = PowerSource.RAPL

    def __init__(self, root: Path = POWERCAP) -> None:
        self.zones = rapl_zones(root)
        if not self.zones:
            raise MeterUnavailable(f"no readable RAPL energy counter (package or dram zone) under {root}")
        self._total_uj = 0

    def read_j(self, now: float) -> float:
        self._total_uj += sum(z.delta_uj() for z in self.zones)
        return self._total_uj / 1e6


class NvmlCounter:
    """The learner's GPUs (torch CUDA device indices) through NVML."""

    source = PowerSource.NVML

    def __init__(self, devices: Sequence[int]) -> None:
        try:
            import pynvml  # nvidia-ml-py: optional, only on CUDA learners
        except ImportError:
            raise MeterUnavailable("pynvml is not installed (pip install nvidia-ml-py)") from None
        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
            self._handles = [_nvml_handle(pynvml, i) for i in devices]
        except pynvml.NVMLError as e:
            raise MeterUnavailable(f"NVML cannot be read: {e}") from None
        try:
            for h in self._handles:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
            self.energy_counter = True
        except pynvml.NVMLError:  # before Volta: power readings only
            self.energy_counter = False
        self._start_mj: float | None = None
        self._last: tuple[float, float] | None = None  # (now, watts) of the previous power reading
        self._total_j = 0.0

    def read_j(self, now: float) -> float:
        nvml = self._nvml
        if self.energy_counter:
            mj = float(sum(nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles))
            if self._start_mj is None:
                self._start_mj = mj
            return (mj - self._start_mj) / 1e3
        watts = sum(nvml.nvmlDeviceGetPowerUsage(h) for h in self._handles) / 1e3
        if self._last is not None:
            t0, w0 = self._last
            self._total_j += (w0 + watts) / 2 * max(0.0, now - t0)
        self._last = (now, watts)
        return self._total_j


def _nvml_handle(nvml: Any, index: int) -> Any:
    """NVML's handle of torch's CUDA device `index`, matched by UUID (torch's indices follow CUDA_VISIBLE_DEVICES,
    NVML's do not); by index when the UUID is not available."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # an older torch without .uuid, or a UUID NVML does not know
        return nvml.nvmlDeviceGetHandleByIndex(index)


class PowerMeter:
    """Watts while training, from `counter` (None: the declared figure only). Call `begin`/`end` from the training
    thread; `reading()` from any thread."""

    def __init__(self, counter: EnergyCounter | None, declared_w: float = 0.0, window_s: float = WINDOW_S) -> None:
        if not (math.isfinite(declared_w) and 0 <= declared_w <= MAX_WATTS):
            raise ConfigError(f"--power-w must be a finite number in [0, {MAX_WATTS:g}], got {declared_w!r}")
        if not (math.isfinite(window_s) and window_s > 0):
            raise ConfigError(f"window_s must be > 0, got {window_s!r}")
        self.counter = counter
        self.declared_w = declared_w
        self.window_s = window_s
        self.note = ""  # why the sources tried before this one were not used (for the log)
        self.dropped = 0  # windows dropped: a counter that could not be read, or a figure out of range
        self.dropped_in_a_row = 0  # since the last window measured
        # told of each dropped window: (reason, detail, dropped_in_a_row); called on the training thread
        self.on_drop: Callable[[str, str, int], None] | None = None
        self._open: tuple[float, float] | None = None  # (now, joules) at `begin`
        self._closed: tuple[float, float] | None = None  # (now, joules) at the last `end`
        self._joules = 0.0
        self._seconds = 0.0
        self._measured: float | None = None

    def begin(self, now: float) -> None:
        """Training starts (inner steps follow)."""
        if self.counter is None:
            return
        last = self._closed
        if last is not None and 0 <= now - last[0] <= JOIN_GAP_S:
            self._open = last
            return
        e = self._read(now)
        self._open = None if e is None else (now, e)

    def end(self, now: float) -> None:
        """Training stopped (for now)."""
        if self._open is None:
            return
        t0, e0 = self._open
        self._open = None
        e1 = self._read(now)
        if e1 is None:
            self._closed = None
            return
        self._closed = (now, e1)
        self._joules += e1 - e0
        self._seconds += max(0.0, now - t0)
        if self._seconds < self.window_s:
            return
        watts, seconds = self._joules / self._seconds, self._seconds
        self._joules = self._seconds = 0.0
        if math.isfinite(watts) and 0 <= watts <= MAX_WATTS:
            self._measured = watts
            self.dropped_in_a_row = 0
        else:
            self._drop(OUT_OF_RANGE, f"{watts:g} W over {seconds:g} s; expected 0 to {MAX_WATTS:g} W")

    def _read(self, now: float) -> float | None:
        assert self.counter is not None
        try:
            return self.counter.read_j(now)
        except Exception as e:  # a meter must never stop training: the window is dropped, the last figure stays
            self._drop(UNREADABLE, repr(e)[:200])
            return None

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped += 1
        self.dropped_in_a_row += 1
        if self.on_drop is not None:
            self.on_drop(reason, detail, self.dropped_in_a_row)

    def reading(self) -> Reading | None:
        """The learner's watts and their source: the last measured window, else the declared figure, else None."""
        measured = self._measured
        if self.counter is not None and measured is not None:
            return Reading(measured, self.counter.source)
        if self.declared_w > 0:
            return Reading(self.declared_w, PowerSource.DECLARED)
        return None


def open_meter(
    mode: str, declared_w: float, cuda_devices: Sequence[int], root: Path = POWERCAP, window_s: float = WINDOW_S
) -> PowerMeter:
    """The meter `--power-meter mode` asks for: `auto` measures with NVML on CUDA learners (`cuda_devices`, torch
    indices; empty on CPU) and with RAPL on CPU learners, else reports `declared_w`; `nvml` and `rapl` insist (a
    `ConfigError` naming the flag when they cannot be read); `declared` reads no counter."""
    if mode not in METER_MODES:
        raise ConfigError(f"--power-meter: allowed {', '.join(METER_MODES)}; got {mode!r}")
    notes: list[str] = []
    counter: EnergyCounter | None = None
    if mode == "nvml" or (mode == "auto" and cuda_devices):
        if not cuda_devices:
            raise ConfigError("--power-meter nvml needs a learner on CUDA (--device cuda)")
        try:
            counter = NvmlCounter(cuda_devices)
        except MeterUnavailable as e:
            if mode == "nvml":
                raise ConfigError(f"--power-meter nvml: {e}") from None
            notes.append(f"nvml: {e}")
    elif mode == "rapl" or mode == "auto":
        try:
            counter = RaplCounter(root)
        except MeterUnavailable as e:
            if mode == "rapl":
                raise ConfigError(f"--power-meter rapl: {e}") from None
            notes.append(f"rapl: {e}")
    meter = PowerMeter(counter, declared_w, window_s)
    meter.note = "; ".join(notes)
    return meter
