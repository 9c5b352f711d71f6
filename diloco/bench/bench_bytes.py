"""Section `bytes-per-token`: bytes on the learner links against data-parallel at equal loss (issue #13, point 5).

Section 1 compares bytes per token at equal tokens, where DiLoCo's loss is still well above data-parallel's; this
section compares them at equal loss (`diloco.bench.sim_bench.EQUAL_LOSS_RULE`: the loss a DiLoCo run reached at
the budget, the bytes each of it and data-parallel of the same seed had sent when they first got that low). It runs
section 1's setup (`uniform`, `sync`, M = 4, the token budget, the settings' seeds) over a small grid of upload
codec x broadcast codec x H, and judges the ≥ 1,000x goal on one configuration, `CHOSEN`, picked before the run.

`CHOSEN` was picked on seeds 3, 4 and 5, which the suite never runs, so the target is not judged on the seeds the
choice was made with. Tried there (upload / broadcast / H: data-parallel's bytes over DiLoCo's at equal loss).
Over seeds 3-5: int4/int4/200 572x (559-579x); int4/int4/250 495x (446-557x); int8/int4/200 446x (436-462x);
int4/int4/100 404x (380-423x); int8/int4/100 (section 1's) 301x (283-311x). Seed 3 only: int4/int8/200 474x;
int4/int8/100 293x; int4/int4/300 363x; int4/int4/400 260x; int4/int4/500 208x; int8/int4/400 206x;
int4/int4/50 132x; int8/int4/50 86x; sparse/int4 at H = 50, 100, 200: 81x, 122x, 137x (loss at the budget 2.7-3.5
against about 2.2: at these H, 1/64 of the entries with β = 0.5 lose too much on this model); sparse/int8/100 84x.
The loss at the budget holds up to H = 200 (2.18-2.20 against 2.14-2.17 at H = 100) and climbs beyond it
(2.23-2.27 at 250, 2.37 at 300), so H = 200 with int4 both ways sends the fewest bytes at equal loss. The first
fp32 snapshots (4 x 4 x numel = 352 kB) were 46% of its 761 kB; without them it would be about 1,070x. Learners
now build version 0 themselves and download no snapshot (docs/protocol-changes.md, section 10): on the suite's seeds
0-2 that took int4/int4/200 from 543x (494-588x) to 1,009x (918-1,094x), and int4/int4/250 to 1,081x (975-1,165x).

The outer optimizer then still had section 1's Nesterov (lr 0.7, momentum 0.9). At H = 200 the budget holds about
5 outer steps (1,000,000 tokens / (4 learners x 200 x 256)), fewer than momentum 0.9's memory of about 10 steps. On
2026-12-03 (after the FAIL above: worst seed 918x) lr and momentum were searched, again on seeds 3-5 only (no
snapshots; int4/int4/200, lr/momentum: ratio): 0.7/0.9 1,063x (1,040-1,076x); 0.5/0.9 701x; 0.9/0.9 1,135x;
1.0/0.9 1,130x; 1.2/0.9 788x; 0.9/0.95 1,084x; 0.9/0.8 1,237x; 0.8/0.8 1,208x; 1.0/0.8 1,222x; 0.9/0.7 1,280x;
0.9/0.5 1,321x (1,280-1,373x); 0.8/0.5 1,282x; 1.0/0.5 1,328x (1,270-1,374x); 0.9/0.3 1,253x; 0.9/0.0 1,103x.
Also int4/int4/250 at 0.9/0.9 1,332x and 0.9/0.8 1,487x, int4/int4/300 at 0.9/0.8 1,650x: more bytes saved, but
with the loss at the budget worse (2.17-2.20 against 2.12 at H = 200, 0.9/0.5) and 3-4 outer steps in all, so H
stays 200. `CHOSEN` became int4/int4/200 with outer Nesterov (0.9, 0.5), the best worst seed of the flat top.

Section 14's 1M-parameter model does not change the arithmetic (both sides' bytes scale with numel, and its
larger batches and 2 learners lower data-parallel's bytes per token), and running it at H >= 200 for enough rounds
to amortize the snapshots would take hours on this machine, so the section stays on section 1's model.

`python -m diloco.bench.bench_bytes` runs the section on its own (`--quick` for the small settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from diloco.bench.section import Context, Log, Result, quick_flag, save_figure, standalone, table
from diloco.bench.seeds import check, fmt, target_met, values
from diloco.bench.settings import FULL, PROFILES, QUICK, SimSettings
from diloco.bench.sim_bench import (
    EQUAL_LOSS_RULE,
    SimRunner,
    equal_loss,
    equal_loss_fmt,
    model_numel,
    sim_config,
)
from diloco.core.outer import OuterConfig
from diloco.sim.config import SimConfig

SECTION_1_OUTER = OuterConfig()
GOAL = 1000.0  # data-parallel's bytes over DiLoCo's at equal loss, at least (issue #13)


@dataclass(frozen=True)
class Setup:
    """One DiLoCo configuration of the grid; H as a multiple of the settings' H (section 1's: 100)."""

    upload: str
    broadcast: str
    h_factor: float
    outer: OuterConfig = SECTION_1_OUTER  # section 1's outer Nesterov (0.7, 0.9) unless a row names others

    def local_steps(self, s: SimSettings) -> int:
        return round(s.local_steps * self.h_factor)

    def label(self, s: SimSettings) -> str:
        label = f"{self.upload} up, {self.broadcast} down, H = {self.local_steps(s)}"
        if self.outer != SECTION_1_OUTER:
            label += f", outer ({self.outer.lr:g}, {self.outer.momentum:g})"
        return label


DEFAULT = Setup("int8", "int4", 1.0)  # section 1's configuration (its uniform/sync runs, reused)
CHOSEN = Setup("int4", "int4", 2.0, OuterConfig(lr=0.9, momentum=0.5))
GRID: tuple[Setup, ...] = (
    DEFAULT,
    Setup("int4", "int4", 1.0),
    Setup("sparse", "int4", 1.0),
    Setup("int8", "int4", 2.0),
    Setup("int4", "int4", 2.0),  # the choice before 2026-12-03, with section 1's outer optimizer
    CHOSEN,
    Setup("int4", "int8", 2.0),
    Setup("int4", "int4", 2.5),
)
QUICK_GRID: tuple[Setup, ...] = (DEFAULT, CHOSEN)


def config(s: SimSettings, setup: Setup, seed: int) -> SimConfig:
    """Section 1's `sync` run on `uniform` with the setup's codecs and H (the same `SimConfig` as section 1's for
    `DEFAULT`, so a suite run shares it)."""
    h = setup.local_steps(s)
    cfg = sim_config(
        dataclasses.replace(s, local_steps=h), mode="sync", codec=setup.upload, seed=seed, outer=setup.outer
    )
    return dataclasses.replace(cfg, broadcast_codec=setup.broadcast)


def run(s: SimSettings, grid: tuple[Setup, ...], runner: SimRunner) -> Result:
    dp = runner.seeds(lambda seed: sim_config(s, mode="dp", seed=seed), "uniform/dp", s.token_budget, s.seeds)
    rows: list[dict[str, Any]] = []
    for setup in grid:

        def make(seed: int, setup: Setup = setup) -> SimConfig:
            return config(s, setup, seed)

        row = runner.seeds(make, setup.label(s), s.token_budget, s.seeds)
        equal_loss(dp, row)
        row["dp_bytes_ratio"] = statistics.fmean(
            a / b for a, b in zip(values(dp, "bytes_per_token"), values(row, "bytes_per_token"), strict=True)
        )
        rows.append({**dataclasses.asdict(setup), "local_steps": setup.local_steps(s), "label": setup.label(s), **row})
    chosen, default = rows[grid.index(CHOSEN)], rows[grid.index(DEFAULT)]
    best = max(rows, key=lambda r: r["dp_bytes_ratio_equal_loss"])
    measured = f"{equal_loss_fmt(chosen)}; section 1's {default['label']}: {equal_loss_fmt(default)}"
    if best is not chosen:
        measured += f"; highest mean on these seeds: {best['label']}, {equal_loss_fmt(best)}"
    checks = [
        check(
            f"bytes against data-parallel at equal loss (uniform/sync, {chosen['label']})",
            f"≥ {GOAL:,.0f}x fewer",
            measured,
            target_met(chosen["equal_loss_ratios"], GOAL, at_least=True),
            len(s.seeds),
        )
    ]
    settings = {
        "token_budget": s.token_budget,
        "local_steps": s.local_steps,
        "seeds": list(s.seeds),
        "numel": model_numel(s),
        "learners": len(PROFILES["uniform"]),
        "chosen": CHOSEN.label(s),
        "version0": "built",
    }
    return {"settings": settings, "dp": dp, "rows": rows, "checks": checks}


def section(ctx: Context) -> Result:
    return run(ctx.profile.sim, QUICK_GRID if ctx.quick else GRID, ctx.sim)


def _kb(x: float) -> str:
    return f"{x / 1e3:,.0f}"


def markdown(result: Result) -> str:
    s, dp = result["settings"], result["dp"]
    snapshots = s["learners"] * 4 * s["numel"]
    head = (
        f"Section 1's setup: `sync` on `uniform` (M = {s['learners']}, no failures), the {s['numel']:,}-parameter "
        f"GPT, a budget of {s['token_budget']:,} applied tokens, outer Nesterov (0.7, 0.9) unless a row names its "
        "(lr, momentum), error feedback on every upload; only the upload codec, the broadcast codec (deltas of the "
        "broadcast shadow, ALGORITHM.md section 10), H and the outer optimizer change. Data-parallel: section 1's "
        f"`uniform` run, loss at budget {fmt(values(dp, 'loss_at_budget'))}, {dp['bytes'] / 1e6:,.0f} MB. The "
        f"target is judged on one configuration, **{s['chosen']}**, picked before this run on seeds the suite does "
        "not run (3, 4, 5; `diloco.bench.bench_bytes` lists what was tried), so it is not chosen on the seeds it is "
        "judged on; the other rows are reported. " + EQUAL_LOSS_RULE
    )
    rows = []
    for r in result["rows"]:
        eq = [one["equal_loss"] for one in r["per_seed"]]
        rows.append(
            [
                f"**{r['label']}**" if r["label"] == s["chosen"] else r["label"],
                fmt(values(r, "loss_at_budget")),
                fmt([e["bytes"] / 1e3 for e in eq], ",.0f"),
                fmt([e["dp_bytes"] / 1e6 for e in eq], ",.0f"),
                fmt([e["dp_tokens"] / s["token_budget"] for e in eq], ".0%"),
                f"{r['dp_bytes_ratio']:,.0f}x",
                equal_loss_fmt(r),
            ]
        )
    headers = [
        "configuration",
        "loss at budget",
        "bytes to reach it (kB)",
        "data-parallel's bytes to reach it (MB)",
        "data-parallel's tokens to reach it (of the budget)",
        "DP bytes ÷ this at equal tokens",
        "DP bytes ÷ this at equal loss",
    ]
    chosen = next(r for r in result["rows"] if r["label"] == s["chosen"])
    eq = [one["equal_loss"] for one in chosen["per_seed"]]
    if s.get("version0") == "built":
        first = (
            "Every learner builds version 0 itself from the task and the seed and names its checksum when it watches "
            "(docs/protocol-changes.md, section 10): the learners start at version 0, so none downloads a snapshot "
            f"(the {s['learners']} x 4 x {s['numel']:,} = {_kb(snapshots)} kB they used to cost); data-parallel is "
            f"still charged one fp32 download per learner at its start, {_kb(snapshots)} kB of its "
            f"{fmt([e['dp_bytes'] / 1e6 for e in eq], ',.0f')} MB to reach the loss. "
        )
    else:  # results measured before learners built version 0
        without = [e["dp_bytes"] / (e["bytes"] - snapshots) for e in eq]
        first = (
            f"Every learner's first parameters are a full fp32 snapshot ({s['learners']} x 4 x {s['numel']:,} = "
            f"{_kb(snapshots)} kB in all), whatever the broadcast codec; data-parallel downloads as much at its "
            f"start. At this budget that is {fmt([snapshots / e['bytes'] for e in eq], '.0%')} of what "
            f"{s['chosen']} sends to reach its loss; without it the ratio would be {fmt(without, ',.0f', 'x')}. "
        )
    note = first + (
        "Each round costs (upload + broadcast bytes per parameter) x numel x M, so bytes at equal loss fall with H "
        "only as long as the loss at the budget holds."
    )
    return "\n\n".join([head, table(headers, rows), note, "![loss against bytes](bytes_per_token.png)"])


def plots(result: Result, out: Path) -> list[str]:
    """Validation loss against bytes on the learner links (log scale): data-parallel and every configuration,
    every seed (the first one labelled)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab10")
    curves: list[tuple[str, dict[str, Any], Any]] = [("data-parallel", result["dp"], "tab:gray")]
    curves += [(r["label"], r, colors(i)) for i, r in enumerate(result["rows"])]
    for label, run, color in curves:
        for i, h in enumerate(values(run, "history")):
            ax.plot(
                [p[3] for p in h[1:]],
                [p[2] for p in h[1:]],
                color=color,
                alpha=1.0 if i == 0 else 0.4,
                label=label if i == 0 else None,
            )
    ax.set_xscale("log")
    ax.set_xlabel("bytes on the learner links, both directions (log scale)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return [save_figure(fig, out / "bytes_per_token.png")]


def main(argv: Sequence[str] | None = None) -> int:
    def go(a: argparse.Namespace, log: Log) -> Result:
        return run((QUICK if a.quick else FULL).sim, QUICK_GRID if a.quick else GRID, SimRunner(log))

    return standalone(__doc__, quick_flag, go, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
