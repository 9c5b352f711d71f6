"""Section `energy`: energy-, carbon- and cost-aware placement on the simulator (issue #15, "Measured").

A mixed fleet of four hardware generations in three zones (`diloco.sim.fleet`'s approximate H100-, A100-, V100- and
P100-class profiles; zones `hydro`, `solar` and `coal` of the *synthetic* trace `examples/carbon/diurnal.csv`)
trains a small GPT in `decoupled` mode to the same token budget, with every seed of the settings, once per
placement policy (`diloco.core.energy`): `speed` (today's placement), `energy`, `carbon` (a zone is dirty above
`carbon_threshold` gCO2/kWh) and `cost` (finish by a deadline of `deadline_factor` x that seed's `speed` time). A
virtual inner step of the fastest part takes `step_time_s`, chosen so that the `speed` run spans about a day of the
trace. Energy is power x busy time, carbon that x the zone's intensity at the time, cost the price x wall hours of
every learner while not paused (paused learners are taken as powered down and released).

Targets (the mean and every seed): `energy` spends at least 20% less energy than `speed` at most 10% more wall time
and a final loss at most 1% above `speed`'s (a lower loss passes); `carbon` emits at most 40% of `speed`'s at most
25% more wall time; `cost` meets its deadline (reported against `speed`'s cost, no threshold).

`python -m diloco.bench.bench_energy` runs the section on its own (`--quick` for the small settings).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.bench.section import Context, Result, quick_flag, standalone, table
from diloco.bench.seeds import aggregate, check, fmt, target_met, values
from diloco.bench.sim_bench import summarize
from diloco.core.energy import POLICY_NAMES, CarbonTrace
from diloco.sim.config import SimConfig
from diloco.sim.engine import simulate
from diloco.sim.fleet import parse_fleet
from diloco.task.data import DataConfig
from diloco.task.factory import TaskConfig
from diloco.task.inner import InnerConfig
from diloco.task.model import ModelConfig

TRACE = Path(__file__).resolve().parents[2] / "examples" / "carbon" / "diurnal.csv"
ENERGY_SAVING = 0.20  # energy vs speed: at least this much less energy
ENERGY_SLOWDOWN = 0.10  # ... at most this much more wall time
LOSS_TOLERANCE = 0.01  # ... and a final loss at most this much above speed's (relative; lower passes)
CARBON_SHARE = 0.40  # carbon vs speed: at most this share of the emissions
CARBON_SLOWDOWN = 0.25  # ... at most this much more wall time


@dataclass(frozen=True)
class EnergySettings:
    fleet: str = (
        "h100@hydro:spot,h100@hydro,a100@solar:spot,a100@solar,v100@solar,v100@coal,p100@coal,p100@coal,p100@coal"
    )
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8
    inner_lr: float = 3e-3
    warmup_steps: int = 20
    max_bytes: int = 2_000_000
    num_shards: int = 18
    token_budget: int = 400_000
    local_steps: int = 20  # H
    min_local_steps: int = 2
    min_quorum: int = 2  # K, also the fewest active learners a policy keeps
    step_time_s: float = 150.0  # virtual seconds per inner step of the fastest part (a large model's step)
    carbon_threshold: float = 300.0  # gCO2/kWh
    deadline_factor: float = 1.5  # cost: deadline = this x the seed's `speed` time
    eval_tokens: int = 16_384
    seeds: tuple[int, ...] = (0, 1, 2)


FULL = EnergySettings()
QUICK = EnergySettings(token_budget=120_000, eval_tokens=4_096, seeds=(0,))


def sim_config(s: EnergySettings, placement: str, seed: int, deadline_s: float = 0.0) -> SimConfig:
    fleet = parse_fleet(s.fleet)
    tokens_per_step = s.batch_size * s.seq_len
    # the cosine schedule spans the steps the fastest learner makes in the budget under `speed` placement
    speeds = [f.hw.speed for f in fleet]
    steps = max(s.warmup_steps + 1, round(s.token_budget / tokens_per_step * max(speeds) / sum(speeds)))
    task = TaskConfig(
        model=ModelConfig(seq_len=s.seq_len, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads),
        data=DataConfig(num_shards=s.num_shards, max_bytes=s.max_bytes),
        inner=InnerConfig(lr=s.inner_lr, warmup_steps=s.warmup_steps, total_steps=steps, batch_size=s.batch_size),
    )
    return SimConfig(
        mode="decoupled",
        speeds=tuple(f.hw.speed for f in fleet),
        fleet=fleet,
        placement=placement,
        carbon_trace=CarbonTrace.load(TRACE),
        carbon_threshold=s.carbon_threshold,
        deadline_s=deadline_s,
        step_time_s=s.step_time_s,
        local_steps=s.local_steps,
        min_local_steps=s.min_local_steps,
        min_quorum=s.min_quorum,
        num_shards=s.num_shards,
        token_budget=s.token_budget,
        eval_every=1_000_000,  # the start and the end
        eval_tokens=s.eval_tokens,
        seed=seed,
        task=task,
    )


def run_one(cfg: SimConfig, label: str, log: Any) -> dict[str, Any]:
    start = time.monotonic()
    r = simulate(cfg)
    out = summarize(r, time.monotonic() - start, cfg.token_budget)
    out.pop("history", None)
    out.update(
        placement=r.placement,
        energy_j=r.energy_j,
        carbon_g=r.carbon_g,
        cost=r.cost,
        deadline_s=cfg.deadline_s,
        placements=r.placements,
    )
    log(
        f"  {label}: loss {out['final_loss']:.4f}, {out['time_s'] / 3600:.1f} h virtual, "
        f"{r.energy_j / 3.6e6:.1f} kWh, {r.carbon_g / 1000:.2f} kgCO2, cost {r.cost:.2f}, {out['wall_s']:.1f} s wall"
    )
    return out


def run(s: EnergySettings, log: Any) -> Result:
    per: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICY_NAMES}
    for seed in s.seeds:
        speed = run_one(sim_config(s, "speed", seed), f"speed [seed {seed}]", log)
        per["speed"].append(speed)
        for policy in POLICY_NAMES[1:]:
            deadline = s.deadline_factor * speed["time_s"] if policy == "cost" else 0.0
            per[policy].append(run_one(sim_config(s, policy, seed, deadline), f"{policy} [seed {seed}]", log))
    rows = []
    base = per["speed"]
    for policy in POLICY_NAMES:
        runs = per[policy]
        for one, ref in zip(runs, base, strict=True):
            one["energy_vs_speed"] = one["energy_j"] / ref["energy_j"]
            one["carbon_vs_speed"] = one["carbon_g"] / ref["carbon_g"]
            one["cost_vs_speed"] = one["cost"] / ref["cost"]
            one["time_vs_speed"] = one["time_s"] / ref["time_s"]
            one["loss_vs_speed"] = one["final_loss"] / ref["final_loss"] - 1
            one["met_deadline"] = not one["deadline_s"] or one["time_s"] <= one["deadline_s"]
        rows.append({"policy": policy, **aggregate(runs, s.seeds)})
    by = {r["policy"]: r for r in rows}
    n = len(s.seeds)
    energy, carbon, cost = by["energy"], by["carbon"], by["cost"]

    def against(name: str, target: str, xs: list[float], spec: str, limit: float, at_least: bool) -> dict[str, Any]:
        """A check of one figure over the seeds: measured and judged on the same values."""
        return check(name, target, fmt(xs, spec), target_met(xs, limit, at_least=at_least), n)

    checks = [
        against(
            "energy placement: less energy than speed",
            f"≥ {ENERGY_SAVING:.0%} less",
            [1 - x for x in values(energy, "energy_vs_speed")],
            ".1%",
            ENERGY_SAVING,
            at_least=True,
        ),
        against(
            "energy placement: wall time vs speed",
            f"≤ +{ENERGY_SLOWDOWN:.0%}",
            [x - 1 for x in values(energy, "time_vs_speed")],
            "+.1%",
            ENERGY_SLOWDOWN,
            at_least=False,
        ),
        against(
            "energy placement: final loss vs speed",
            f"≤ +{LOSS_TOLERANCE:.0%}",
            values(energy, "loss_vs_speed"),
            "+.2%",
            LOSS_TOLERANCE,
            at_least=False,
        ),
        against(
            "carbon placement: emissions vs speed (diurnal trace)",
            f"≤ {CARBON_SHARE:.0%}",
            values(carbon, "carbon_vs_speed"),
            ".1%",
            CARBON_SHARE,
            at_least=False,
        ),
        against(
            "carbon placement: wall time vs speed",
            f"≤ +{CARBON_SLOWDOWN:.0%}",
            [x - 1 for x in values(carbon, "time_vs_speed")],
            "+.1%",
            CARBON_SLOWDOWN,
            at_least=False,
        ),
        check(
            f"cost placement: meets a deadline of {s.deadline_factor:g}x speed's time",
            "every seed",
            f"{sum(values(cost, 'met_deadline'))} of {n}; cost {fmt(values(cost, 'cost_vs_speed'), '.1%')} of speed's",
            all(values(cost, "met_deadline")),
            n,
        ),
    ]
    return {"settings": dataclasses.asdict(s), "rows": rows, "checks": checks}


def section(ctx: Context) -> Result:
    return run(QUICK if ctx.quick else FULL, ctx.log)


def markdown(result: Result) -> str:
    s = result["settings"]
    head = (
        f"Fleet `{s['fleet']}` (`PROFILE@ZONE[:spot]`, approximate profiles of `diloco.sim.fleet`), `decoupled`, "
        f"K = {s['min_quorum']}, H = {s['local_steps']}, {s['token_budget']:,} tokens of a {s['d_model']}-wide "
        f"{s['n_layers']}-layer GPT, a virtual step of the fastest part {s['step_time_s']:g} s; carbon from the "
        f"**synthetic** diurnal trace `examples/carbon/diurnal.csv` (threshold {s['carbon_threshold']:g} gCO2/kWh); "
        f"`cost` with a deadline of {s['deadline_factor']:g}x `speed`'s time. Seeds "
        f"{', '.join(map(str, s['seeds']))}; values are means (min–max)."
    )
    rows = [
        [
            f"`{r['policy']}`",
            fmt([x / 3600 for x in values(r, "time_s")], ".1f"),
            fmt([x / 3.6e6 for x in values(r, "energy_j")], ".1f"),
            fmt([x / 1000 for x in values(r, "carbon_g")], ".2f"),
            fmt(values(r, "cost"), ".2f"),
            fmt(values(r, "final_loss")),
            fmt(values(r, "energy_vs_speed"), ".0%"),
            fmt(values(r, "carbon_vs_speed"), ".0%"),
            fmt(values(r, "cost_vs_speed"), ".0%"),
        ]
        for r in result["rows"]
    ]
    headers = ["policy", "time (h)", "energy (kWh)", "carbon (kg)", "cost ($)", "final loss"]
    headers += ["energy", "carbon", "cost"]
    timeline = []
    for r in result["rows"]:
        first = r["per_seed"][0]
        changes = "; ".join(f"{p['time_s'] / 3600:.1f} h: {p['reason']}" for p in first["placements"])
        timeline.append(f"- `{r['policy']}` (seed {first['seed']}): {changes}")
    note = "The last three columns are against `speed`, seed by seed. Placement changes (`placement.changed`):"
    return "\n\n".join([head, table(headers, rows), note, "\n".join(timeline)])


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, quick_flag, lambda a, log: run(QUICK if a.quick else FULL, log), markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
