"""Seeds and spread: how the suite turns several seeded runs of one configuration into a mean and a spread, and
the one rule by which a target on a loss comparison passes (issue #17).

Spread is the min–max range over the seeds (the report writes `mean (min–max)`); the standard deviation is kept
in `results.json` too. The rule (`target_met`): a target passes only if it holds on the mean over the seeds AND
on every seed, i.e. the min–max spread does not cross the threshold. With one seed it is the plain comparison.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

RULE = "mean and every seed"  # how the Targets table names the rule


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """`{n, mean, min, max, std}` of the values; `None` entries (a seed that never got there) make every figure
    None but keep `n` and the count of them in `missing`."""
    missing = sum(v is None for v in values)
    xs = [float(v) for v in values if v is not None]
    if missing or not xs:
        return {"n": len(values), "missing": missing, "mean": None, "min": None, "max": None, "std": None}
    return {
        "n": len(xs),
        "missing": 0,
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "std": statistics.pstdev(xs) if len(xs) > 1 else 0.0,
    }


def target_met(values: Sequence[float | None], threshold: float, *, at_least: bool, strict: bool = False) -> bool:
    """THE rule of every target on a loss comparison: the mean over the seeds meets the threshold (`>=` when
    `at_least`, else `<=`; `>` and `<` when `strict`) and so does every seed, so the spread does not cross it. A
    seed without a value (e.g. it never reached a target) fails it."""
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return False
    xs = [float(v) for v in values if v is not None]
    s = spread(xs)

    def ok(x: float) -> bool:
        if strict:
            return x > threshold if at_least else x < threshold
        return x >= threshold if at_least else x <= threshold

    return ok(s["mean"]) and ok(s["min"]) and ok(s["max"])


def fmt(values: Sequence[float | None], spec: str = ".4f", unit: str = "") -> str:
    """`mean (min–max)` of the values, e.g. `1.9123 (1.9050–1.9201)`; the mean alone for one value or when the
    range rounds to one number; `never (k of n seeds)` when some are None."""
    s = spread(values)
    if s["missing"]:
        return "never" if s["n"] == 1 else f"never ({s['missing']} of {s['n']} seeds)"
    lo, hi = f"{s['min']:{spec}}", f"{s['max']:{spec}}"
    if s["n"] == 1 or lo == hi:  # one seed, or seeds that agree to the digits shown
        return f"{s['mean']:{spec}}{unit}"
    return f"{s['mean']:{spec}}{unit} ({lo}–{hi}{unit})"


def aggregate(per_seed: Sequence[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """One row from the summaries of the same configuration run with `seeds` (in order): every number is the
    mean over the seeds (integers stay integers when all seeds agree), `spread` holds `spread()` of the key
    figures, `per_seed` the summaries themselves (with their loss histories); `history` is the first seed's,
    for code that plots one curve."""
    first = per_seed[0]
    out: dict[str, Any] = {}
    for k, v in first.items():
        vals = [r.get(k) for r in per_seed]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or all(isinstance(x, int) and x == v for x in vals):
            out[k] = v
        elif all(isinstance(x, (int, float)) for x in vals):
            out[k] = statistics.fmean(float(x) for x in vals if x is not None)
        else:
            out[k] = v
    out["seeds"] = list(seeds)
    out["spread"] = {
        k: spread([r[k] for r in per_seed])
        for k in ("loss_at_budget", "best_loss", "final_loss", "time_s", "goodput", "bytes_per_token")
        if k in first
    }
    out["per_seed"] = [{**r, "seed": s} for r, s in zip(per_seed, seeds, strict=True)]
    out["history"] = first.get("history", [])
    return out


def values(run: dict[str, Any], key: str) -> list[Any]:
    """`key` of every seed of an aggregated row (a row from before seeds were run: its one value)."""
    return [r[key] for r in run.get("per_seed", [run])]


def changes(run: dict[str, Any], base: dict[str, Any], key: str) -> list[float]:
    """The relative change of `key` of `run` against `base`'s, seed by seed (the rows ran the same seeds; negative:
    lower than the base's)."""
    return [a / b - 1 for a, b in zip(values(run, key), values(base, key), strict=True)]


def check(name: str, target: str, measured: str, ok: bool | None, seeds: int) -> dict[str, Any]:
    """A Targets-table entry of a seeded comparison: states the number of seeds and the rule it was judged by."""
    return {"name": name, "target": target, "measured": measured, "pass": ok, "seeds": seeds, "rule": RULE}
