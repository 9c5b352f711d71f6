"""The benchmark suite behind `diloco bench` and `python -m diloco.bench.run_all`: runs the sections, writes
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
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diloco.bench import (
    bench_bytes,
    bench_control,
    bench_core,
    bench_energy,
    bench_fragments,
    bench_ha,
    bench_island,
    bench_large,
    bench_load,
    bench_payload,
    bench_sparse,
    bench_upload,
    cluster_bench,
    report,
    sim_bench,
    startup_bench,
    storm,
)
from diloco.bench.section import TORCH_THREADS, Context, Log, Section, pin_threads
from diloco.bench.settings import FULL, QUICK
from diloco.errors import ConfigError

# The sections, in report order (the report numbers them so). A new module joins with one line; see section.py.
SECTIONS: tuple[Section, ...] = (
    Section(
        "time-to-target",
        "Time to target (simulator)",
        lambda c: sim_bench.time_to_target(c.profile.sim, c.sim),
        report.time_to_target_md,
        report.time_to_target_plot,
        readme=report.time_to_target_readme,
    ),
    Section(
        "scale",
        "Scale sweep (simulator, timing only)",
        lambda c: sim_bench.scale(c.profile.scale, c.sim),
        report.scale_md,
        report.scale_plot,
    ),
    Section(
        "compression",
        "Compression sweep (simulator)",
        lambda c: sim_bench.compression(c.profile.sim, c.sim),
        report.compression_md,
        report.compression_plot,
    ),
    Section(
        "cluster",
        "Real cluster (`LocalCluster`, processes on loopback)",
        cluster_bench.section,
        report.cluster_md,
        report.cluster_plot,
    ),
    Section(
        "outer",
        "Outer-optimizer ablation (simulator)",
        lambda c: sim_bench.outer(c.profile.outer, c.sim),
        report.outer_md,
        report.outer_plot,
    ),
    Section(
        "startup",
        "Start-up time (real processes)",
        startup_bench.section,
        startup_bench.markdown,
        readme=startup_bench.summary,
    ),
    Section(
        "core",
        "Core operations (outer step, codecs)",
        bench_core.section,
        bench_core.markdown,
        readme=bench_core.summary,
    ),
    Section(
        "upload",
        "Upload of a pseudo-gradient into the coordinator",
        bench_upload.section,
        bench_upload.markdown,
        readme=bench_upload.summary,
    ),
    Section("kill-storm", "Kill storm (real processes, no supervisor)", storm.section, storm.markdown),
    Section(
        "layout",
        "Batch layout: rows spread across the shard vs contiguous (simulator)",
        lambda c: sim_bench.layout(c.profile.sim, c.sim),
        report.layout_md,
        report.layout_plot,
    ),
    Section(
        "control",
        "Control calls while a round closes (GetStatus latency)",
        bench_control.section,
        bench_control.markdown,
    ),
    Section(
        "load", "Load: N fake learners against one coordinator and healthd", bench_load.section, bench_load.markdown
    ),
    Section("island", "Islands: a 2-rank torchrun learner vs one process", bench_island.section, bench_island.markdown),
    Section(
        "sparse",
        "SparseLoCo-class uploads: chunked top-k, 2-bit values (simulator)",
        bench_sparse.section,
        bench_sparse.markdown,
    ),
    Section(
        "energy",
        "Energy-, carbon- and cost-aware placement (simulator)",
        bench_energy.section,
        bench_energy.markdown,
        report.energy_plot,
    ),
    Section(
        "large",
        "A ~100M-parameter model through the real services: memory and round time",
        bench_large.section,
        bench_large.markdown,
        bench_large.plots,
    ),
    Section(
        "bytes-per-token",
        "Bytes against data-parallel at equal loss (simulator)",
        bench_bytes.section,
        bench_bytes.markdown,
        bench_bytes.plots,
    ),
    Section(
        "ha",
        "Coordinator high availability: leader-kill soak, standby lag, cost of synchronous replication",
        bench_ha.section,
        bench_ha.markdown,
    ),
    Section(
        "fragments",
        "Streaming fragments: peak link bandwidth and loss against P (simulator)",
        bench_fragments.section,
        bench_fragments.markdown,
        bench_fragments.plots,
    ),
    Section(
        "payload",
        "A ~1B-parameter payload through the coordinator alone: memory and round time",
        bench_payload.section,
        bench_payload.markdown,
    ),
)
NAMES = tuple(s.name for s in SECTIONS)
CHECKOUT = Path(__file__).resolve().parents[2]


def _machine() -> str:
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), no GPU used, "
        f"Python {platform.python_version()}, torch {torch.__version__} with {TORCH_THREADS} "
        f"thread{'s' if TORCH_THREADS > 1 else ''}"
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


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """The commit the code under measurement is at and whether tracked files differ from it (the report folder
    itself aside, since the suite writes there); `commit` is null outside a git checkout."""
    commit = _git("rev-parse", "HEAD")
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/benchmarks")
    return {"commit": commit, "dirty": None if commit is None or changed is None else bool(changed)}


def now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def parse_only(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ConfigError(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    return names


def render(out: Path, log: Log = print) -> dict[str, Any]:
    """Write the report and plots again from `out/results.json`, without running anything."""
    path = out / "results.json"
    if not path.is_file():
        raise ConfigError(f"--report-only: {path} does not exist; run the suite first")
    results: dict[str, Any] = json.loads(path.read_text())
    _write(results, out, log)
    return results


def _write(results: dict[str, Any], out: Path, log: Log) -> None:
    """The report and plots into `out`; and, when `out` is this checkout's docs/benchmarks, the README's
    generated blocks (so every table there comes from the committed results.json)."""
    for f in report.write_report(results, out, SECTIONS):
        log(f"wrote {f}")
    readme = CHECKOUT / "README.md"
    ours = out.resolve() == (CHECKOUT / "docs" / "benchmarks").resolve() and readme.is_file()
    if ours and report.update_readme(results, readme, SECTIONS):
        log(f"wrote {readme} (its generated blocks)")


def run_suite(out: Path, *, quick: bool = False, only: Sequence[str] = (), log: Log = print) -> dict[str, Any]:
    """Run the selected sections (all by default) and write the report into `out`; returns the results.

    Each section run records where it was measured (`meta.measured[name]`: commit, dirty flag, date, machine,
    wall time), so a report that keeps some sections from an earlier run says which commit each one is from."""
    pin_threads()
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
    selected = [s for s in SECTIONS if not only or s.name in only]
    sections: dict[str, Any] = dict(previous.get("sections", {}))
    old_meta: dict[str, Any] = previous.get("meta", {})
    measured: dict[str, Any] = {n: m for n, m in old_meta.get("measured", {}).items() if n in sections}
    wall: dict[str, float] = dict(old_meta.get("wall_s", {})) if only else {}
    ctx = Context(quick=quick, profile=profile, log=log, sim=sim_bench.SimRunner(log))
    started = time.monotonic()
    for section in selected:
        log(f"[{section.name}]")
        where = {**provenance(), "date": now(), "machine": _machine()}
        t = time.monotonic()
        sections[section.name] = section.run(ctx)
        wall[section.name] = time.monotonic() - t
        measured[section.name] = {**where, "wall_s": wall[section.name]}
        log(f"[{section.name}] {wall[section.name]:.0f} s")
    if not only:
        wall["total"] = time.monotonic() - started
    results = {
        "meta": {
            "quick": quick,
            "profile": profile.to_dict(),
            "date": now(),
            "machine": _machine(),
            "wall_s": wall,
            "sections_run": [s.name for s in selected],
            "measured": measured,
        },
        "sections": {n: sections[n] for n in NAMES if n in sections},
    }
    results = _clean(results)
    path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    _write(results, out, log)
    return results
