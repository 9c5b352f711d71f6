"""The benchmark suite behind `diloco bench` and `python bench/run_all.py`: runs the sections, writes
`results.json`, the Markdown report and the plots.

With `only`, the other sections are kept from an existing `results.json` in the output folder (when it was made
with the same `--quick` setting), so one section can be regenerated without rerunning the rest.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import cluster_bench, sim_bench
from bench.report import write_report
from bench.settings import FULL, QUICK, Profile
from diloco.cli.bench import SECTIONS
from diloco.errors import ConfigError

Log = Callable[[str], None]


def _machine() -> str:
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), no GPU used, "
        f"Python {platform.python_version()}, torch {torch.__version__} with 1 thread"
    )


def _clean(x: Any) -> Any:
    """NaN and infinities become null, so results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def parse_only(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ConfigError(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return names


def run_section(name: str, profile: Profile, runner: sim_bench.SimRunner, log: Log) -> dict[str, Any]:
    if name == "time-to-target":
        return sim_bench.time_to_target(profile.sim, runner)
    if name == "scale":
        return sim_bench.scale(profile.scale, runner)
    if name == "compression":
        return sim_bench.compression(profile.sim, runner)
    if name == "outer":
        return sim_bench.outer(profile.sim, runner)
    run_root = Path(tempfile.mkdtemp(prefix="diloco-bench-cluster-"))
    try:
        result = cluster_bench.cluster(profile.cluster, run_root, log)
    except BaseException:
        log(f"  the cluster logs are kept in {run_root}")
        raise
    shutil.rmtree(run_root, ignore_errors=True)
    return result


def render(out: Path, log: Log = print) -> dict[str, Any]:
    """Write the report and plots again from `out/results.json`, without running anything."""
    path = out / "results.json"
    if not path.is_file():
        raise ConfigError(f"--report-only: {path} does not exist; run the suite first")
    results: dict[str, Any] = json.loads(path.read_text())
    for f in write_report(results, out):
        log(f"wrote {f}")
    return results


def run_suite(out: Path, *, quick: bool = False, only: Sequence[str] = (), log: Log = print) -> dict[str, Any]:
    """Run the selected sections (all by default) and write the report into `out`; returns the results."""
    torch.set_num_threads(1)
    profile = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    previous: dict[str, Any] = {}
    if only and path.exists():
        try:
            loaded = json.loads(path.read_text())
            if bool(loaded.get("meta", {}).get("quick")) == quick:
                previous = loaded
        except (OSError, ValueError):
            log(f"ignoring an unreadable {path}")
    selected = [n for n in SECTIONS if not only or n in only]
    sections: dict[str, Any] = dict(previous.get("sections", {}))
    wall: dict[str, float] = dict(previous.get("meta", {}).get("wall_s", {}))
    runner = sim_bench.SimRunner(log)
    started = time.monotonic()
    for name in selected:
        log(f"[{name}]")
        t = time.monotonic()
        sections[name] = run_section(name, profile, runner, log)
        wall[name] = time.monotonic() - t
        log(f"[{name}] {wall[name]:.0f} s")
    if not only:
        wall["total"] = time.monotonic() - started
    results = {
        "meta": {
            "quick": quick,
            "profile": profile.to_dict(),
            "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "machine": _machine(),
            "wall_s": wall,
            "sections_run": selected,
        },
        "sections": {n: sections[n] for n in SECTIONS if n in sections},
    }
    results = _clean(results)
    path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    for f in write_report(results, out):
        log(f"wrote {f}")
    return results
