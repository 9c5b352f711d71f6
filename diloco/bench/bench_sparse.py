"""Section `sparse`: SparseLoCo-class uploads on the simulator (issue #13, point 3).

A model of about 1M parameters trained by 2 equal learners in `sync` mode for 40 outer steps, with every seed of
the settings, per upload codec: `fp32` (the baseline) and `sparse` (chunked top-k with 2-bit values and error
feedback whose residual decays by β each round; `diloco.core.codecs.SparseCodec`), each with every outer setting
of the grid (Nesterov learning rate and momentum), and `topk` at the same density (8-byte records, its own β) with
the outer setting chosen for `sparse`, for reference. Each of fp32 and sparse is judged at its own best outer
setting (the lowest mean final loss over the seeds): a codec compared against a baseline run at settings that
suit the baseline badly would be judged against a weak baseline. Reported: every grid cell's final loss, and per
codec at its chosen setting the final validation loss (mean and min–max over the seeds), its penalty against
fp32's, seed by seed, and the upload bytes against fp32's. Targets: the sparse codec's penalty at most 2% (mean
and every seed) at 50x or more fewer upload bytes.

Until 2026-12-06 every codec ran DiLoCo's outer setting (Nesterov 0.7 / 0.9) and sparse used its default β = 0.5:
there fp32's loss stalled from the 24th outer step on (seed 0: 2.81, 2.78, 2.79, 2.79, 2.77 at steps 24-40), the
Nesterov step overshooting at H = 6, while sparse's decayed feedback, sending less of each pseudo-gradient, kept
going; the report then showed sparse 15% *below* fp32 (2.34 vs 2.76), a comparison against a baseline that
setting had stalled. Seed 0 with other settings (final loss): fp32 at (lr 1.0, momentum 0) 2.18, (0.5, 0.5)
2.18, (0.7, 0.5) 2.31, (0.85, 0.3) 2.32, (1.0, 0.5) 2.56; sparse at (1.0, 0.5) with β 0.9 2.23, 0.95 (0.7, 0.5)
2.26, β 0.9 (0.7, 0.5) 2.25, β 0.9 (1.0, 0) 2.28, β 0.5 (0.7, 0.5) 2.37; at 1/32 density, β 0.9 (0.7, 0.5) 2.24.
Sparse's β = 0.9 was chosen from those seed-0 runs. The first grid (0.7 / 0.9, 1 / 0, 0.5 / 0.5, 1 / 0.5), run at
b831c5b, put fp32 best at 0.5 / 0.5 (2.1893) and sparse at 1 / 0.5 (2.2230, the edge of that grid): +1.54% (+2.15%
on seed 0), a FAIL on one seed. The grid was then made the full lr 0.5, 1, 1.5 x momentum 0, 0.5 (with DiLoCo's),
the same cells for both codecs; a seed-0 run of sparse at 1.4 / 0.3 (2.21) had suggested that its best lay beyond
the first grid's edge. This was done after seeing that result; the report says so. Over three seeds the full grid
chose the same cells (sparse 1 / 0.5, fp32 0.5 / 0.5) and the same +1.54%.

Tried before, at Nesterov 0.7 / 0.9 (seed 0, final loss; fp32 2.72 then): β = 1, 0.9, 0.5, 0.3 with 2-bit values
at 1/64: 3.14, 2.63, 2.33, 2.35; 4-bit values at β = 0.5: 2.34 (98x instead of 107x); 2-bit at 1/128, β = 0.5:
2.42 (204x).

`python -m diloco.bench.bench_sparse` runs the section on its own (`--quick` for the small settings).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from diloco.bench.section import Context, Result, quick_flag, standalone, table
from diloco.bench.seeds import check, fmt, target_met, values
from diloco.bench.sim_bench import SimRunner
from diloco.core.codecs import SparseCodec, get_codec
from diloco.core.outer import OuterConfig
from diloco.sim.config import SimConfig
from diloco.task.data import DataConfig
from diloco.task.factory import TaskConfig
from diloco.task.inner import InnerConfig
from diloco.task.model import GPT, ModelConfig

MAX_PENALTY = 0.02  # loss penalty of the sparse codec against fp32, at most
MIN_RATIO = 50.0  # upload bytes of fp32 over the sparse codec's, at least


@dataclass(frozen=True)
class SparseSettings:
    d_model: int = 128
    n_layers: int = 5  # with d_model 128: 1,032,576 parameters
    n_heads: int = 4
    seq_len: int = 64
    batch_size: int = 8
    learners: int = 2
    local_steps: int = 6  # H
    outer_steps: int = 40
    inner_lr: float = 3e-3
    warmup_steps: int = 20
    max_bytes: int = 4_000_000
    num_shards: int = 16
    eval_tokens: int = 16_384
    fraction: float = SparseCodec.DEFAULT_FRACTION  # entries sent, for sparse and the topk reference
    beta: float = 0.9  # sparse's error-feedback decay (the codec's default, 0.5, suits Nesterov 0.7 / 0.9)
    # (lr, momentum): DiLoCo's, and lr 0.5, 1, 1.5 with momentum 0 and 0.5
    outers: tuple[tuple[float, float], ...] = ((0.7, 0.9), (0.5, 0), (1, 0), (1.5, 0), (0.5, 0.5), (1, 0.5), (1.5, 0.5))
    seeds: tuple[int, ...] = (0, 1, 2)


FULL = SparseSettings()
QUICK = SparseSettings(
    d_model=32,
    n_layers=1,
    seq_len=32,
    local_steps=2,
    outer_steps=4,
    warmup_steps=2,
    eval_tokens=4_096,
    outers=((0.7, 0.9), (1.0, 0.0)),
    seeds=(0,),
)
CODECS = ("fp32", "sparse", "topk")
TUNED = ("fp32", "sparse")  # run with every outer setting of the grid; topk with sparse's chosen one


def sim_config(s: SparseSettings, codec: str, seed: int, outer: tuple[float, float]) -> SimConfig:
    steps = s.outer_steps * s.local_steps
    task = TaskConfig(
        model=ModelConfig(seq_len=s.seq_len, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads),
        data=DataConfig(num_shards=s.num_shards, max_bytes=s.max_bytes),
        inner=InnerConfig(lr=s.inner_lr, warmup_steps=s.warmup_steps, total_steps=steps, batch_size=s.batch_size),
    )
    return SimConfig(
        mode="sync",
        speeds=(1.0,) * s.learners,
        local_steps=s.local_steps,
        outer_steps=s.outer_steps,
        codec=codec,
        topk_fraction=s.fraction if codec in ("sparse", "topk") else None,
        ef_decay=s.beta if codec == "sparse" else None,
        outer=OuterConfig("nesterov", *outer),
        num_shards=s.num_shards,
        eval_every=s.outer_steps,  # the start and the end
        eval_tokens=s.eval_tokens,
        seed=seed,
        task=task,
    )


def best(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The grid cell with the lowest mean final loss over the seeds (the first of equals)."""
    return min(cells, key=lambda c: c["final_loss"])


def model_numel(s: SparseSettings) -> int:
    model = GPT(ModelConfig(seq_len=s.seq_len, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads))
    return sum(p.numel() for p in model.parameters())


def run(s: SparseSettings, runner: SimRunner) -> Result:
    def one(codec: str, outer: tuple[float, float]) -> dict[str, Any]:
        row = runner.seeds(lambda seed: sim_config(s, codec, seed, outer), f"{codec} {outer}", 0, s.seeds)
        ef = get_codec(codec, topk_fraction=s.fraction if codec != "fp32" else None)
        beta = s.beta if codec == "sparse" else ef.residual_decay if ef.lossy else None
        for seed_run in row["per_seed"]:
            seed_run.pop("history", None)
        row.pop("history", None)
        return {"codec": codec, "beta": beta, "outer": list(outer), **row}

    grid = {codec: [one(codec, outer) for outer in s.outers] for codec in TUNED}
    rows = [best(grid["fp32"]), best(grid["sparse"])]
    rows.append(one("topk", tuple(rows[1]["outer"])))
    fp32 = rows[0]
    for r in rows:
        r["upload_ratio"] = fp32["bytes_up"] / r["bytes_up"]
        penalties = [a / b - 1 for a, b in zip(values(r, "final_loss"), values(fp32, "final_loss"), strict=True)]
        for seed_run, p in zip(r["per_seed"], penalties, strict=True):
            seed_run["penalty_vs_fp32"] = p
        r["penalty_vs_fp32"] = statistics.fmean(penalties)
        r["penalties"] = penalties
    sparse = rows[1]
    n = len(s.seeds)
    checks = [
        check(
            "sparse uploads: loss penalty against fp32 (each at its best outer setting)",
            f"≤ {MAX_PENALTY:.0%}",
            fmt(sparse["penalties"], "+.2%"),
            target_met(sparse["penalties"], MAX_PENALTY, at_least=False),
            n,
        ),
        check(
            "sparse uploads: fewer upload bytes than fp32",
            f"≥ {MIN_RATIO:.0f}x",
            f"{sparse['upload_ratio']:.1f}x",
            sparse["upload_ratio"] >= MIN_RATIO,
            n,
        ),
    ]
    return {
        "settings": {**dataclasses.asdict(s), "numel": model_numel(s), "mode": "sync"},
        "rows": rows,
        "grid": [  # every cell's loss, the mean and each seed's
            {k: c[k] for k in ("codec", "outer", "final_loss")}
            | {"per_seed": [{"final_loss": r["final_loss"]} for r in c["per_seed"]]}
            for cells in grid.values()
            for c in cells
        ],
        "checks": checks,
    }


def section(ctx: Context) -> Result:
    return run(QUICK if ctx.quick else FULL, ctx.sim)


def _outer(outer: Sequence[float]) -> str:
    return f"Nesterov {outer[0]:g} / {outer[1]:g}"


def markdown(result: Result) -> str:
    s = result["settings"]
    outers = s.get("outers")
    head = (
        f"{s['numel']:,}-parameter GPT (d_model {s['d_model']}, layers: {s['n_layers']}), {s['learners']} equal "
        f"learners, `sync`, H = {s['local_steps']}, {s['outer_steps']} outer steps, batch {s['batch_size']} x "
        f"{s['seq_len']} tokens; seeds {', '.join(map(str, s['seeds']))}, each run on the same seeds; loss on "
        f"{s['eval_tokens']:,} validation tokens after the last round. `sparse` and `topk` send "
        f"{s['fraction']:.2%} of the entries; β is the error feedback's residual decay per round."
    )
    parts = [head]
    if outers and "grid" in result:
        parts.append(
            "fp32 and sparse each ran with every outer setting (learning rate / momentum); each is judged at its "
            "own best (lowest mean final loss), topk ran with sparse's. Final validation loss, mean (min–max):"
        )
        by = {(c["codec"], tuple(c["outer"])): c for c in result["grid"]}
        parts.append(
            table(
                ["outer step", *(f"`{codec}`" for codec in TUNED)],
                [[_outer(o), *(fmt(values(by[(codec, tuple(o))], "final_loss")) for codec in TUNED)] for o in outers],
            )
        )
    rows = [
        [
            f"`{r['codec']}`",
            _outer(r["outer"]) if "outer" in r else "Nesterov 0.7 / 0.9",
            "-" if r["beta"] is None else f"{r['beta']:g}",
            f"{r['bytes_up'] / r['rounds'] / s['learners']:,.0f}",
            f"{r['upload_ratio']:.1f}x",
            fmt(values(r, "final_loss")),
            "-" if r["codec"] == "fp32" else fmt(r["penalties"], "+.2%"),
        ]
        for r in result["rows"]
    ]
    headers = [
        "codec",
        "outer step",
        "β",
        "bytes per upload",
        "fewer bytes than fp32",
        "final val loss",
        "penalty vs fp32",
    ]
    note = (
        "The penalty is the relative change of the final loss against fp32's, seed by seed (negative: lower than "
        "fp32's)."
    )
    if not outers:  # results from before the grid
        note += " Every codec ran the same outer optimizer."
    else:
        note += (
            " Until 2026-12-06 every codec ran Nesterov 0.7 / 0.9 and sparse β = 0.5: fp32's loss stalled there "
            "(2.76 mean) and sparse showed 15% below it; see the module docstring of `diloco.bench.bench_sparse`."
        )
    return "\n\n".join([*parts, table(headers, rows), note])


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(
        __doc__, quick_flag, lambda a, log: run(QUICK if a.quick else FULL, SimRunner(log)), markdown, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
