"""The HA benchmark's figures from a run's results: the soak's recovery times, throughput and lag, and the checks
against the targets (`results.json` alone is enough, so the report can be rendered again)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from diloco.bench.ha.settings import MAX_TARGET_S, MEDIAN_TARGET_S, KillPoint


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def spread(xs: Sequence[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": median(xs), "p90": quantile(xs, 0.9), "max": max(xs, default=None)}


def summarize(soak: dict[str, Any]) -> dict[str, Any]:
    """The soak's figures for the report: recovery times, throughput, lag."""
    kills = soak["kills"]
    times = {
        key: spread([k[key] for k in kills if k[key] is not None])
        for key in ("elected_s", "serving_s", "first_round_s", "standby_back_s")
    }
    by_point = {
        p.value: spread([k["first_round_s"] for k in kills if k["point"] == p.value and k["first_round_s"] is not None])
        for p in KillPoint
    }
    st = soak["steady"]
    steady_rate = st["tokens"] / (st["end"] - st["start"]) if st["end"] > st["start"] else None
    lost = [c["end"] - c["start"] - c["tokens"] / steady_rate for c in soak["cycles"]] if steady_rate else []
    rates = [c["tokens"] / (c["end"] - c["start"]) / steady_rate for c in soak["cycles"]] if steady_rate else []
    lag = soak["lag_samples"]
    return {
        "times": times,
        "first_round_by_point": by_point,
        "steady_tokens_per_s": steady_rate,
        "soak_tokens_per_s": soak["soak_tokens"] / soak["soak_s"] if soak["soak_s"] > 0 else None,
        "cycle_rate_ratio": spread(rates),
        "lost_steady_s_per_failover": {**spread(lost), "mean": statistics.fmean(lost) if lost else None},
        "cycle_s": spread([c["end"] - c["start"] for c in soak["cycles"]]),
        "lag_versions": {
            "samples": len(lag),
            "histogram": {str(v): lag.count(v) for v in sorted(set(lag))},
            "max": max(lag, default=None),
            "mean": statistics.fmean(lag) if lag else None,
        },
        "applied_to_published_s": spread(soak["applied_to_published_s"]),
        "stale_wins": sum(1 for k in kills if k["new_leader"] == k["victim"]),
    }


def checks(
    soak: dict[str, Any], summary: dict[str, Any], costs: list[dict[str, Any]], error: str
) -> list[dict[str, Any]]:
    first = summary["times"]["first_round_s"] if summary else {"n": 0, "median": None, "max": None}
    n = first["n"]
    out = [
        {
            "name": f"leader SIGKILL → first round committed by the new leader, median over {n} kills",
            "target": f"≤ {MEDIAN_TARGET_S:g} s",
            "measured": "not measured (see the section)" if error else f"{num(first['median'])} s",
            "pass": None if error else first["median"] is not None and first["median"] <= MEDIAN_TARGET_S,
        },
        {
            "name": f"leader SIGKILL → first round committed by the new leader, max over {n} kills",
            "target": f"≤ {MAX_TARGET_S:g} s",
            "measured": "not measured (see the section)" if error else f"{num(first['max'])} s",
            "pass": None if error else first["max"] is not None and first["max"] <= MAX_TARGET_S,
        },
    ]
    if not error:
        problems = invariant_list(soak)
        out.append(
            {
                "name": "after the soak: versions never backwards, ledger exactly once, job finished, no learner lost",
                "target": "no problem",
                "measured": f"{len(problems)} problem(s)" + (": " + "; ".join(problems)[:300] if problems else ""),
                "pass": not problems,
            }
        )
    for c in costs:
        s, share = c["settings"], c["close_extra_fraction"]
        raw = "" if c["ratio"] is None else f"; whole rounds {c['ratio'] - 1:+.1%}, see the section"
        closes = f"close {num(ms(c['replicated']['close_s']), 1)} vs {num(ms(c['plain']['close_s']), 1)} ms"
        out.append(
            {
                "name": f"synchronous replication (1 standby): its latency on a round, {s['label']}",
                "target": f"≤ +{s['target']:.0%} of the round",
                "measured": "n/a" if share is None else f"{share:+.1%} ({closes}{raw})",
                "pass": None if share is None else share <= s["target"],
            }
        )
    return out


def invariant_list(soak: dict[str, Any]) -> list[str]:
    out = list(soak["invariant_problems"])
    out += [f"ledger: {p}" for p in soak["ledger_problems"]]
    if not soak["finished"] or soak["version"] < soak["target"]:
        out.append(f"the job did not finish: version {soak['version']} of {soak['target']}")
    out += [f"{name} exited: {why.splitlines()[0]}" for name, why in soak["learner_exits"].items()]
    return out


def ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def min_ratio(soak: dict[str, Any], m: dict[str, Any]) -> float | None:
    rate = m["steady_tokens_per_s"]
    xs = [c["tokens"] / (c["end"] - c["start"]) / rate for c in soak["cycles"]] if rate else []
    return min(xs, default=None)
