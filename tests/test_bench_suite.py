"""The benchmark suite (`diloco bench`): the `--quick` variant runs every section, including one short real-cluster
run, into a temp dir, so the report code cannot rot; plus the pure helpers it measures with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from diloco.bench.bench_bytes import CHOSEN
from diloco.bench.bench_large import dirtied_bytes
from diloco.bench.cluster_bench import rate, recovery_s
from diloco.bench.report import update_readme
from diloco.bench.seeds import fmt, target_met
from diloco.bench.settings import QUICK
from diloco.bench.sim_bench import first_time_at_or_below, loss_at_tokens
from diloco.bench.suite import NAMES, SECTIONS, parse_only, run_suite
from diloco.cli.main import main
from diloco.errors import ConfigError
from diloco.ha.etcd_server import etcd_binary
from diloco.rpc.payload import default_spill_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("bench-quick")
    results = run_suite(out, quick=True, log=lambda line: None)
    yield out, results


def rows_of(readme: str, first_cells: str) -> list[str]:
    return [line for line in readme.splitlines() if line.startswith(f"| {first_cells} |")]


def section_of(readme: str, title: str) -> str:
    """The text of the report's section `title` (e.g. "2. Scale sweep"), up to the next section."""
    start = readme.index(f"## {title}")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end >= 0 else len(readme)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_suite_writes_every_section_table_and_plot(quick: tuple[Path, dict[str, Any]]) -> None:
    out, results = quick
    readme = (out / "README.md").read_text()
    titles: tuple[str, ...] = (
        "1. Time to target",
        "2. Scale sweep",
        "3. Compression sweep",
        "4. Real cluster",
        "5. Outer-opt",
    )
    titles += ("6. Start-up time", "7. Core operations", "8. Upload of a pseudo-gradient", "9. Kill storm")
    titles += ("10. Batch layout", "11. Control calls", "12. Load", "13. Islands", "14. SparseLoCo-class uploads")
    for title in titles:
        assert f"## {title}" in readme, f"section {title!r} missing"
    headings = [line for line in readme.splitlines() if line.startswith("## ") and line[3].isdigit()]
    assert len(headings) == len(NAMES) and all("— measured at commit `" in h for h in headings), headings
    for name in NAMES:
        assert f"--only {name}" in readme, f"no regenerate command for {name}"
    for profile in ("uniform", "mixed", "mixed+failures"):
        for mode in ("dp", "sync", "decoupled"):
            assert rows_of(readme, f"{profile} | {mode}"), f"no row for {profile}/{mode}"
    for m in results["meta"]["profile"]["scale"]["learners"]:
        scale = section_of(readme, "2. Scale sweep")
        assert len(rows_of(scale, str(m))) == 2, f"scale: M={m} should have a row per network"
    for label in ("fp32", "bf16 + EF", "bf16 no EF", "int8 + EF", "int8 no EF", "int4 + EF", "int4 no EF", "topk + EF"):
        assert rows_of(readme, label), f"compression: no row for {label}"
    assert rows_of(readme, "decoupled"), "cluster: no row for the decoupled run"
    for name in ("Nesterov", "FedAvg", "Delayed Nesterov"):
        assert rows_of(readme, name), f"outer: no row for {name}"
    for name in ("`python -m services.healthd`", "`diloco healthd`", "`diloco coordinator`", "`diloco ctl status`"):
        assert rows_of(readme, name), f"startup: no row for {name}"
    assert rows_of(readme, "int8") and rows_of(readme, "bulk upload port, fp32"), "core/upload rows missing"
    assert rows_of(readme, "accept + round close: CoordinatorCore.accept"), "upload: no breakdown"
    assert rows_of(readme, "`spread`") and rows_of(readme, "`contiguous`"), "layout: a row per batch layout"
    assert "| model | calls | over 50 ms | p50 (ms) | p99 (ms) |" in readme, "control: no latency table"
    assert "| N | registered / ready | GetStatus p50 / p99 (ms) |" in readme, "load: no latency table"
    for n in results["sections"]["load"]["settings"]["learners"]:
        assert f"\n| {n} | {n} / {n} in " in readme, f"load: no row for N={n} with every learner ready"
    assert rows_of(readme, "1 rank") and rows_of(readme, "2 ranks (torchrun, DDP)"), "island: a row per learner"
    assert all(rows_of(readme, f"`{c}`") for c in ("fp32", "sparse", "topk")), "sparse: a row per codec"
    assert all(rows_of(readme, f"P = {p}") for p in (1, 2, 4)), "fragments: a row per P"
    large = section_of(readme, "16. A ~100M-parameter model")
    assert "| process | default (GB) | --spill-above never (GB) | the rule's, per round (MB) |" in large, (
        "large: writes"
    )
    assert rows_of(large, "worker0") and rows_of(large, "coordinator"), "large: a row per process"
    payload = section_of(readme, "20. A ~1B-parameter payload")
    assert rows_of(payload, "1") and rows_of(payload, "peak, whole run"), "payload: a row per round and the peak"
    if etcd_binary() is not None:  # without it the section says it did not run (conftest: CI has it)
        assert rows_of(readme, "kill → first round committed by the new leader"), (
            f"ha: no failover row; the soak said: {results['sections']['ha']['error']!r}"
        )
        assert rows_of(readme, "default model (`diloco coordinator` defaults)"), "ha: no replication-cost rows"
    assert "| seeds (rule) |" in readme and "2 (mean and every seed)" in readme, "targets: seeds and rule"
    for name in ("time-to-target", "compression", "outer", "layout"):  # every loss comparison ran every seed
        for run in results["sections"][name]["runs"]:
            assert run["seeds"] == [0, 1] and len(run["per_seed"]) == 2, (name, run.get("seeds"))
    assert "## Targets" in readme and ("**pass**" in readme or "**FAIL**" in readme)
    chosen = f"**{CHOSEN.label(QUICK.sim)}**"  # int4 up, int4 down, H = 40, outer (0.9, 0.5)
    assert rows_of(readme, chosen), "bytes-per-token: no row for the chosen configuration"
    pngs = ("time_to_target", "scale", "compression", "cluster", "cluster_timeline", "outer", "layout")
    for png in (*pngs, "bytes_per_token", "fragments", "large"):
        path = out / f"{png}.png"
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000, f"{png}.png missing or empty"
        assert f"]({png}.png)" in readme, f"{png}.png not linked from the report"
    doc = json.loads((out / "results.json").read_text())  # strict JSON: NaN would have been written as null
    assert set(doc["sections"]) == set(NAMES)
    for name in NAMES:  # where each section was measured
        where = doc["meta"]["measured"][name]
        assert len(where["commit"]) == 40 and isinstance(where["dirty"], bool) and where["date"], where
    kill = next(r for r in doc["sections"]["cluster"]["runs"] if r["kill"])
    assert 0 < kill["reassign_s"] < 10 and kill["samples"], "the failure run measured no reassignment"
    # a guard against a full-size section slipping into the quick profile, not a performance figure: about 4
    # minutes on 2 quiet cores (eight sections, four of them starting real processes)
    assert doc["meta"]["wall_s"]["total"] < 600, "the quick suite should stay well under 10 minutes"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_only_one_section_keeps_the_others(quick: tuple[Path, dict[str, Any]]) -> None:
    out, _ = quick
    before = json.loads((out / "results.json").read_text())
    run_suite(out, quick=True, only=("outer",), log=lambda line: None)
    after = json.loads((out / "results.json").read_text())
    assert after["meta"]["sections_run"] == ["outer"]
    assert after["sections"]["cluster"] == before["sections"]["cluster"]
    assert (
        after["sections"]["outer"]["runs"][0]["loss_at_budget"]
        == before["sections"]["outer"]["runs"][0]["loss_at_budget"]
    ), "the simulator is deterministic"
    assert "## 4. Real cluster" in (out / "README.md").read_text()
    (out / "README.md").unlink()
    assert main(["bench", "--report-only", "--out", str(out)]) == 0
    assert "## 4. Real cluster" in (out / "README.md").read_text()


def test_cli_and_script_reject_an_unknown_section(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown section"):
        parse_only("scale,warp")
    assert parse_only("scale, cluster") == ("scale", "cluster")
    assert main(["bench", "--only", "warp", "--out", "/nonexistent"]) == 2
    assert "unknown section" in capsys.readouterr().err
    proc = subprocess.run(  # from another directory: the suite is part of the package
        [sys.executable, "-m", "diloco.bench.run_all", "--only", "warp"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown section" in proc.stderr


def _fs_type(path: str) -> str:
    """The type of the file system `path` is on (the longest mount point above it in /proc/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fs = line.split()[1:3]
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind = mount, fs
    return kind


def test_dirtied_bytes_counts_the_page_cache_a_process_dirtied_less_what_it_dropped_unwritten() -> None:
    directory = os.path.realpath(default_spill_dir())
    if _fs_type(directory) == "tmpfs":
        pytest.skip(f"{directory} is a tmpfs: its pages are never written to storage, nor counted")
    before = dirtied_bytes(os.getpid())
    assert before is not None
    with tempfile.TemporaryFile(dir=directory) as f:  # unlinked: its dirty pages go unwritten when it is closed
        f.write(os.urandom(8 << 20))
        f.flush()
        during = dirtied_bytes(os.getpid())
    after = dirtied_bytes(os.getpid())
    assert during is not None and after is not None
    assert during - before >= 8 << 20, (before, during)
    assert after - before < 8 << 20, (before, during, after)  # written back within a second: not by default
    assert dirtied_bytes(2**22 + 12345) is None  # above pid_max's default: no such process


def test_loss_at_tokens_interpolates_between_evaluations() -> None:
    h = [[0.0, 0.0, 5.0], [10.0, 100.0, 3.0], [20.0, 200.0, 2.0]]
    assert loss_at_tokens(h, 150) == pytest.approx(2.5)
    assert loss_at_tokens(h, 100) == 3.0
    assert loss_at_tokens(h, 500) == 2.0  # past the end: the last evaluation
    assert first_time_at_or_below(h, 3.0) == 10.0
    assert first_time_at_or_below(h, 1.0) is None


def test_recovery_is_the_first_full_window_after_the_kill_back_at_90_percent() -> None:
    # 100 tokens/s, nothing from t=10 (kill) to t=14, then 100 tokens/s again
    samples = [{"t": float(t), "tokens": 100 * min(t, 10) + 100 * max(0, t - 14)} for t in range(0, 31)]
    assert rate(samples, 0, 10) == pytest.approx(100)
    pre, rec = recovery_s(samples, kill_t=10.0, end_t=30.0, window_s=4.0, fraction=0.9)
    assert pre == pytest.approx(100) and rec == pytest.approx(4.0)
    never = [{"t": float(t), "tokens": 100 * min(t, 10)} for t in range(0, 31)]
    assert recovery_s(never, kill_t=10.0, end_t=30.0, window_s=4.0, fraction=0.9)[1] is None


def test_readme_blocks_are_rewritten_from_results_and_nothing_else(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n<!-- bench:targets -->\nold\n<!-- /bench:targets -->\nmiddle\n"
        "<!-- bench:core -->\nstale table\n<!-- /bench:core -->\n<!-- bench:upload -->\n<!-- /bench:upload -->\nend\n"
    )
    check = {"name": "outer step", "target": "<= 1.2x", "measured": "0.9x", "pass": True}
    core = {"codecs": [], "outer": [], "checks": [check]}
    results = {
        "meta": {"quick": False, "measured": {"core": {"commit": "a" * 40, "dirty": True, "date": "2026-12-01"}}},
        "sections": {"core": core},
    }
    real = SECTIONS[NAMES.index("core")]  # its excerpt needs real rows: a stand-in excerpt, numbered last
    sections = [*(s for s in SECTIONS if s.name != "core"), replace(real, readme=lambda r: "THE TABLE")]
    assert update_readme(results, readme, sections)
    text = readme.read_text()
    assert text.startswith("intro\n") and "\nmiddle\n" in text and text.endswith("\nend\n")
    assert "old" not in text and "stale table" not in text
    assert f"| §{len(sections)} core | outer step | <= 1.2x | 0.9x | - | **pass** |" in text  # no seeds: "-"
    assert "commit `aaaaaaaaaa` + uncommitted changes, 2026-12-01" in text and "THE TABLE" in text
    assert "Not measured yet: run `.venv/bin/diloco bench --only upload" in text
    assert not update_readme(results, readme, sections), "a second pass changes nothing"


def test_a_seeded_target_is_met_only_on_the_mean_and_every_seed() -> None:
    assert target_met([0.35, 0.40, 0.31], 0.30, at_least=True)
    assert not target_met([0.50, 0.50, 0.25], 0.30, at_least=True)  # the mean holds, one seed crosses
    assert not target_met([0.31, None], 0.30, at_least=True)  # a seed that never got there
    assert target_met([0.01, 0.02], 0.02, at_least=False) and not target_met([0.01, 0.03], 0.02, at_least=False)
    assert (
        fmt([1.0, 2.0, 3.0], ".1f") == "2.0 (1.0–3.0)" and fmt([1.5]) == "1.5000" and fmt([1.01, 1.02], ".1f") == "1.0"
    )
    assert fmt([1.0, None]) == "never (1 of 2 seeds)" and fmt([None]) == "never"
