"""The learner's power meter (`services.worker.power`): RAPL counters read from a sysfs tree written in tmp_path
(real files, read by the real reader), the training windows driven by explicit times, the sources' order and
their refusals, and a learner whose counter breaks while it trains (against a real in-process coordinator). NVML is
exercised only where a CUDA device and pynvml are present."""

from __future__ import annotations

import importlib.util
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
import torch

from diloco.core.energy import PowerSource
from diloco.errors import ConfigError
from diloco.rpc.limits import MAX_WATTS
from services.worker.config import WorkerConfig
from services.worker.power import (
    JOIN_GAP_S,
    OUT_OF_RANGE,
    UNREADABLE,
    NvmlCounter,
    PowerMeter,
    RaplCounter,
    Reading,
    open_meter,
    rapl_zones,
    wrap_delta,
)
from services.worker.worker import Worker
from tests.support import Env, wait_for

pytestmark = pytest.mark.timeout(30)
MAX_RANGE = 262_143_328_850  # a real package's max_energy_range_uj


def zone(root: Path, name: str, label: str, energy_uj: int, max_range: int = MAX_RANGE) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "name").write_text(label + "\n")
    (d / "energy_uj").write_text(f"{energy_uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_range}\n")
    return d


def set_energy(d: Path, energy_uj: int) -> None:
    (d / "energy_uj").write_text(f"{energy_uj}\n")


@pytest.fixture
def powercap(tmp_path: Path) -> Path:
    """Two packages (with their core/uncore parts), a DRAM zone, the platform zone and a broken zone."""
    root = tmp_path / "powercap"
    zone(root, "intel-rapl:0", "package-0", 1_000_000)
    zone(root, "intel-rapl:0:0", "core", 500_000)
    zone(root, "intel-rapl:0:1", "dram", 2_000_000)
    zone(root, "intel-rapl:1", "package-1", 3_000_000)
    zone(root, "intel-rapl:1:0", "uncore", 7)
    zone(root, "intel-rapl:2", "psys", 9_000_000)
    broken = zone(root, "intel-rapl:3", "package-3", 0)
    (broken / "energy_uj").unlink()  # as unreadable as a root-only counter
    (root / "intel-rapl").mkdir()  # the control type folder: not a zone
    return root


def test_wrap_delta() -> None:
    assert wrap_delta(10, 25, 100) == 15
    assert wrap_delta(90, 5, 100) == 15  # 10 to the wrap, 5 after it
    assert wrap_delta(7, 7, 100) == 0


def test_rapl_zones_are_packages_and_dram_only(powercap: Path) -> None:
    zones = rapl_zones(powercap)
    assert [(z.path.name, z.name) for z in zones] == [
        ("intel-rapl:0", "package-0"),
        ("intel-rapl:0:1", "dram"),
        ("intel-rapl:1", "package-1"),
    ]
    assert rapl_zones(powercap / "missing") == []


def test_rapl_watts_are_energy_over_training_time(powercap: Path) -> None:
    meter = PowerMeter(RaplCounter(powercap), declared_w=50.0, window_s=1.0)
    assert meter.reading() == Reading(50.0, PowerSource.DECLARED)  # nothing measured yet
    meter.begin(100.0)
    set_energy(powercap / "intel-rapl:0", 1_000_000 + 60_000_000)  # 60 J
    set_energy(powercap / "intel-rapl:0:1", 2_000_000 + 10_000_000)  # 10 J
    set_energy(powercap / "intel-rapl:1", 3_000_000 + 50_000_000)  # 50 J
    set_energy(powercap / "intel-rapl:2", 9_999_999_999)  # psys: not counted
    meter.end(102.0)
    assert meter.reading() == Reading(60.0, PowerSource.RAPL)  # 120 J / 2 s


def test_rapl_counter_wrap_is_counted(powercap: Path) -> None:
    pkg = powercap / "intel-rapl:0"
    set_energy(pkg, MAX_RANGE - 5_000_000)  # 5 J before the wrap
    counter = RaplCounter(powercap)
    assert counter.read_j(0.0) == 0.0
    set_energy(pkg, 15_000_000)  # wrapped: 5 J + 15 J
    assert counter.read_j(1.0) == pytest.approx(20.0)
    set_energy(pkg, 45_000_000)
    assert counter.read_j(2.0) == pytest.approx(50.0)


def test_only_training_windows_count_and_short_ones_add_up(powercap: Path) -> None:
    pkg = powercap / "intel-rapl:0"
    meter = PowerMeter(RaplCounter(powercap), window_s=1.0)
    energy = 1_000_000
    for start in (0.0, 10.0, 20.0):  # three 0.4 s windows of 40 W, with idle gaps drawing 1 kW between them
        meter.begin(start)
        energy += 16_000_000
        set_energy(pkg, energy)
        meter.end(start + 0.4)
        energy += 9_600_000_000  # the gap: never in a window
        set_energy(pkg, energy)
        if start < 20.0:
            assert meter.reading() is None  # 0.4 and 0.8 s: below the window, and no declared figure
    reading = meter.reading()
    assert reading is not None and reading.source is PowerSource.RAPL and reading.watts == pytest.approx(40.0)


def test_back_to_back_steps_reuse_the_last_read(powercap: Path) -> None:
    pkg = powercap / "intel-rapl:0"
    meter = PowerMeter(RaplCounter(powercap), window_s=1.0)
    meter.begin(0.0)
    set_energy(pkg, 1_000_000 + 30_000_000)
    meter.end(0.6)
    set_energy(pkg, 1_000_000 + 31_000_000)  # 1 J in the JOIN_GAP_S between two steps: counted as training
    meter.begin(0.6 + JOIN_GAP_S / 2)
    set_energy(pkg, 1_000_000 + 50_000_000)
    meter.end(1.0)
    assert meter.reading() == Reading(50.0, PowerSource.RAPL)  # 50 J over 1.0 s


def test_a_broken_or_absurd_window_is_dropped_and_the_last_figure_stays(powercap: Path) -> None:
    pkg = powercap / "intel-rapl:0"
    meter = PowerMeter(RaplCounter(powercap), window_s=1.0)
    drops: list[tuple[str, str, int]] = []
    meter.on_drop = lambda *drop: drops.append(drop)
    meter.begin(0.0)
    set_energy(pkg, 1_000_000 + 100_000_000)
    meter.end(1.0)
    assert meter.reading() == Reading(100.0, PowerSource.RAPL)
    meter.begin(5.0)
    (pkg / "energy_uj").write_text("not a number\n")
    meter.end(6.0)
    assert meter.reading() == Reading(100.0, PowerSource.RAPL) and meter.dropped == 1
    set_energy(pkg, 1_000_000 + 100_000_000)
    meter.begin(10.0)  # the counter read works again
    set_energy(pkg, 1_000_000 + 100_000_000 + int(2 * MAX_WATTS * 1e6))  # 2 x the limit in one second
    meter.end(11.0)
    assert meter.reading() == Reading(100.0, PowerSource.RAPL) and meter.dropped == 2
    assert [(reason, in_a_row) for reason, _, in_a_row in drops] == [(UNREADABLE, 1), (OUT_OF_RANGE, 2)]
    assert "invalid literal" in drops[0][1] and "200000 W over 1 s" in drops[1][1]
    meter.begin(20.0)
    set_energy(pkg, 1_000_000 + 100_000_000 + int(2 * MAX_WATTS * 1e6) + 50_000_000)
    meter.end(21.0)  # a window measured again ends the run of drops
    assert meter.reading() == Reading(50.0, PowerSource.RAPL) and meter.dropped_in_a_row == 0


def test_declared_figure_and_bad_declarations() -> None:
    assert PowerMeter(None, declared_w=0.0).reading() is None
    assert PowerMeter(None, declared_w=300.0).reading() == Reading(300.0, PowerSource.DECLARED)
    for bad in (-1.0, math.nan, math.inf, MAX_WATTS * 2):
        with pytest.raises(ConfigError, match="--power-w"):
            PowerMeter(None, declared_w=bad)


def test_open_meter_modes(powercap: Path, tmp_path: Path) -> None:
    empty = tmp_path / "none"
    assert isinstance(open_meter("auto", 0.0, [], root=powercap).counter, RaplCounter)
    fallback = open_meter("auto", 250.0, [], root=empty)
    assert fallback.counter is None and fallback.reading() == Reading(250.0, PowerSource.DECLARED)
    assert "rapl" in fallback.note
    assert open_meter("declared", 10.0, [], root=powercap).counter is None
    with pytest.raises(ConfigError, match="--power-meter rapl"):
        open_meter("rapl", 0.0, [], root=empty)
    with pytest.raises(ConfigError, match="--power-meter nvml"):
        open_meter("nvml", 0.0, [], root=powercap)
    with pytest.raises(ConfigError, match="--power-meter"):
        open_meter("psu", 0.0, [], root=powercap)


@pytest.mark.timeout(120)
def test_a_learner_whose_counter_breaks_counts_logs_and_trains_on(powercap: Path, start: Callable[..., Env]) -> None:
    env = start(min_quorum=1, local_steps=2, min_local_steps=1, grace_max_s=0.0, bulk_port=-1)
    meter = PowerMeter(RaplCounter(powercap), window_s=0.01)  # the counters stand still: 0 W measured

    def dropped() -> float:
        value = w.metrics.registry.get_sample_value("diloco_worker_power_windows_dropped_total", {"reason": UNREADABLE})
        return value or 0.0

    with structlog.testing.capture_logs() as logs:
        w = Worker(WorkerConfig(coordinator=env.server.address, upload_path="grpc"), power=meter)
        t = threading.Thread(target=w.run, daemon=True)
        try:
            t.start()
            wait_for("a window measured", lambda: meter.reading() is not None, timeout_s=60)
            broken = powercap / "energy_uj.new"  # replaced whole: a reader never sees the file half-written
            broken.write_text("gone\n")
            broken.replace(powercap / "intel-rapl:0" / "energy_uj")
            wait_for("windows dropped", lambda: dropped() >= 3, timeout_s=60)
            version = env.server.core.version
            wait_for("training to go on", lambda: env.server.core.version >= version + 2, timeout_s=60)
            assert meter.reading() == Reading(0.0, PowerSource.RAPL)  # the last good figure
        finally:
            w.stop()
            t.join(timeout=40)
    warned = [r for r in logs if r["event"] == "power.window_dropped"]
    assert len(warned) == 1, "the first drop of a run is logged, the rest counted"
    assert (warned[0]["reason"], warned[0]["kept_watts"], warned[0]["kept_source"]) == (UNREADABLE, 0.0, "rapl")
    assert "gone" in warned[0]["detail"] and warned[0]["log_level"] == "warning"


@pytest.mark.skipif(
    importlib.util.find_spec("pynvml") is None or not torch.cuda.is_available(), reason="needs pynvml and CUDA"
)
def test_nvml_counter_reads_a_real_gpu() -> None:
    counter = NvmlCounter([0])
    meter = PowerMeter(counter, window_s=0.2)
    x = torch.randn(4096, 4096, device="cuda")
    import time

    meter.begin(time.monotonic())
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:
        x = x @ x
        x /= x.norm()
    torch.cuda.synchronize()
    meter.end(time.monotonic())
    reading = meter.reading()
    assert reading is not None and reading.source is PowerSource.NVML and 10 < reading.watts < 2000
