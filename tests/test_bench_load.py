"""The load benchmark (`diloco.bench.bench_load`): its smallest profile against the real services (result shape,
every child reaped), and its delivery rule on plain data."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

import pytest

from diloco.bench.bench_load import QUICK, LoadSettings, _analyse, markdown, run
from diloco.errors import ConfigError

LATENCIES = ("GetStatus", "GetWorkPlan", "Heartbeat", "GetWorkPlan (learners)", "SubmitPseudoGradient", "Register")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_smallest_profile_measures_every_figure_and_reaps_every_child() -> None:
    s = replace(QUICK, learners=QUICK.learners[:1], active_s=6.0, settle_s=1.0, submit_interval_s=2.0)
    lines: list[str] = []
    result = run(s, lines.append)
    (r,) = result["runs"]
    n = s.learners[0]
    assert r["error"] == "", r["error"]
    assert r["registered"] == r["ready"] == n, r
    for kind in LATENCIES:
        lat = r["latency"][kind]
        assert lat["calls"] > 0 and lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"], (kind, lat)
    assert r["rounds_in_window"] >= 1 and r["delivery"]["pairs"] == r["versions"] * n
    assert r["submissions"].get("ACCEPTED", 0) + r["submissions"].get("APPLIED", 0) > 0, r["submissions"]
    for name in ("coordinator", "healthd"):
        res = r["resources"][name]
        assert res["rss_kb"]["base"] > 0 and res["threads"]["base"] > 0 and res["cpu"]["active_s"] >= 0
        assert not math.isnan(res["rss_kb"]["per_learner"])
    assert [c["name"].split(",")[0] for c in result["checks"]] == [
        "every watcher receives every version",
        "GetStatus p99 latency",
        "coordinator RSS growth per idle learner",
        "healthd RSS growth per idle learner",
        "no thread count proportional to N",
    ]
    assert all(isinstance(c["pass"], bool) for c in result["checks"]), result["checks"]
    # every child is gone: the services (reaped by LocalCluster) and the load generators
    assert r["reaped"]
    for pid in [*r["pids"].values(), *r["generator_pids"]]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    text = markdown(result)
    assert "| N | registered / ready | GetStatus p50 / p99 (ms) |" in text and f"| {n} | {n} / {n} in " in text


def _learner(received: list[tuple[int, float]]) -> dict[str, Any]:
    return {
        "worker_id": "w",
        "lost": "",
        "register_s": 0.01,
        "received": received,
        "beats": [],
        "plans": [],
        "submits": [],
        "declared_dead": 0,
    }


def test_a_watcher_may_skip_a_version_but_must_hold_a_newer_one_in_time() -> None:
    s = LoadSettings(learners=(3,), deliver_within_s=2.0)
    published = {0: 0.0, 1: 10.0, 2: 11.0, 3: 12.0}
    learners = [
        _learner([(0, 1.0), (1, 10.1), (2, 11.1), (3, 12.1)]),  # every version
        _learner([(0, 1.0), (1, 10.2), (3, 12.5)]),  # skipped 2, held 3 within 1.5 s of 2's publication
        _learner([(0, 1.0), (1, 10.1), (2, 13.5)]),  # 2 late (2.5 s), never got 3
    ]
    results = [{"learners": learners, "applied": {}, "errors": {}}]
    out = _analyse(3, s, results, [], published, (0.0, 5.0, 14.0, 20.0))
    d = out["delivery"]
    assert out["versions"] == 3 and d["pairs"] == 9
    assert (d["within"], d["late"], d["missing"]) == (7, 1, 1)
    assert not out["every_version"]
    assert d["max_ms"] == pytest.approx(2500.0)


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="learners"):
        LoadSettings(learners=())
    with pytest.raises(ConfigError, match="dead_after_s"):
        LoadSettings(heartbeat_interval_s=2.0, dead_after_s=3.0)
