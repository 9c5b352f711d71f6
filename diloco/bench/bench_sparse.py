"""Section `sparse`: SparseLoCo-class uploads on the simulator (issue #13, point 3).

A model of about 1M parameters trained by 2 equal learners in `sync` mode for 40 outer steps, per upload codec:
`fp32` (the baseline) and `sparse` (chunked top-k with 2-bit values and error feedback whose residual decays by β
each round; `diloco.core.codecs.SparseCodec`). Each of the two runs every outer setting of the grid (Nesterov
learning rate and momentum) on the tuning seeds (3 and 4), takes the one with its lowest mean final loss there,
and is judged at it on the other seeds (0, 1 and 2): a codec compared against a baseline run at settings that suit
the baseline badly would be judged against a weak baseline, and a setting picked on the seeds it is judged on
would flatter both. `topk` at the same density (8-byte records, its own β) runs with the setting chosen for
`sparse`, for reference. A noise floor: fp32 at its setting again with torch on 2 threads instead of 1. Reported:
every grid cell's final loss on the tuning seeds, and per codec at its chosen setting the final validation loss
(mean and min–max over the judged seeds), its penalty against fp32's, seed by seed, the noise floor beside it, and
the upload bytes against fp32's. Targets: the sparse codec's penalty at most 2% (mean and every seed) at 50x or
more fewer upload bytes.

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

Until the second change of 2026-12-06 each codec was judged at its best cell on the judged seeds themselves; that
run's seed-0 penalty (+2.15%, the only seed over 2%) then proved to be inside what float rounding moves: fp32 and
sparse at their cells, seed 0, on 2 torch threads instead of 1 ended at 2.1937 (+0.42%) and 2.2285 (-0.14%), a
penalty of +1.59%. So the section now chooses the outer settings on seeds it does not judge and prints the noise
floor beside the penalties. Diagnostics run then, with 20 warmup steps, where a seed's noise floor proved to be up
to 1.2% (so read them as rough; seed 0, sparse at lr 1 / momentum 0.5, final loss; the judged run's 2.2316):
dense 2-bit values with feedback (fraction 1) 2.568, as fp32 at that setting (2.563); fraction 1/4 2.363 and 1/32
2.230: at one outer setting a denser upload did *worse*, as if sparse's best outer step were about twice fp32's
(what is held back each round lands later); β = 1 2.297. On seeds 3 and 4 at 1.5 / 0.5 (mean; 2.214 as the codec
is): chunks of 16384 and 65536 2.222 and 2.258, 8-bit values 2.234, β 0.5 2.221. At H = 12 (same 40 outer steps)
the penalty at the H = 6 cells was +2.1% to +4.8% (seeds 0 and 3).

The run with the settings chosen on seeds 3 and 4 (at 7829f85) chose fp32 0.5 / 0.5 and sparse 1.5 / 0.5 and gave
+1.74% (+1.31%..+2.35%): a FAIL on seed 1, whose noise floor was +1.20% (seeds 0 and 2: +0.42%, +0.29%). A seed's
comparison was not known closer than the margin it was judged by. As in section 19 (`bench_fragments`), a short
warmup at lr 3e-3 made each run's end depend on the last bits. The inner warmup was then chosen on fp32 alone (its
cell, 0.5 / 0.5) on seeds 3, 4 and 5, by the noise floor, without running sparse: 20 steps gave final losses
2.1808, 2.1740, 2.2057 and noise floors +0.00%, -0.10%, +0.45%; 100 steps 2.1266, 2.1383, 2.1619 and +0.02%,
0.00%, 0.00%; lr 1.5e-3 (seed 3 only) 2.2479 and 0.00%. Warmup became 100 steps (of 240).

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
from diloco.bench.seeds import changes, check, fmt, target_met, values
from diloco.bench.sim_bench import SimRunner
from diloco.core.codecs import SparseCodec, get_codec
from diloco.core.outer import OuterConfig
from diloco.errors import ConfigError
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
    warmup_steps: int = 100  # 20 until 2026-12-06 (see the module docstring)
    max_bytes: int = 4_000_000
    num_shards: int = 16
    eval_tokens: int = 16_384
    fraction: float = SparseCodec.DEFAULT_FRACTION  # entries sent, for sparse and the topk reference
    beta: float = 0.9  # sparse's error-feedback decay (the codec's default, 0.5, suits Nesterov 0.7 / 0.9)
    # (lr, momentum): DiLoCo's, and lr 0.5, 1, 1.5 with momentum 0 and 0.5
    outers: tuple[tuple[float, float], ...] = ((0.7, 0.9), (0.5, 0), (1, 0), (1.5, 0), (0.5, 0.5), (1, 0.5), (1.5, 0.5))
    tune_seeds: tuple[int, ...] = (3, 4)  # the grid runs on these; the chosen cells are judged on `seeds`
    seeds: tuple[int, ...] = (0, 1, 2)
    noise_threads: int = 2  # fp32 again with torch on this many threads: the noise floor of a seed's comparison

    def __post_init__(self) -> None:
        if set(self.tune_seeds) & set(self.seeds):
            raise ConfigError(
                f"tune_seeds {self.tune_seeds} and seeds {self.seeds} overlap: the outer setting must be chosen on "
                "seeds the comparison is not judged on; use disjoint seeds"
            )


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
    tune_seeds=(1,),
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
    def one(codec: str, outer: Sequence[float], seeds: Sequence[int], threads: int | None = None) -> dict[str, Any]:
        lr, momentum = outer
        label = f"{codec} ({lr:g}, {momentum:g})" + (f" on {threads} torch threads" if threads else "")
        row = runner.seeds(lambda seed: sim_config(s, codec, seed, (lr, momentum)), label, 0, seeds, threads)
        ef = get_codec(codec, topk_fraction=s.fraction if codec != "fp32" else None)
        beta = s.beta if codec == "sparse" else ef.residual_decay if ef.lossy else None
        for seed_run in row["per_seed"]:
            seed_run.pop("history", None)
        row.pop("history", None)
        return {"codec": codec, "beta": beta, "outer": [lr, momentum], **row}

    # each codec's outer setting is chosen on the tuning seeds, then judged on the others
    grid = {codec: [one(codec, outer, s.tune_seeds) for outer in s.outers] for codec in TUNED}
    chosen = {codec: best(cells)["outer"] for codec, cells in grid.items()}
    rows = [one(codec, chosen[codec], s.seeds) for codec in TUNED]
    rows.append(one("topk", chosen["sparse"], s.seeds))
    fp32 = rows[0]
    noise = one("fp32", chosen["fp32"], s.seeds, s.noise_threads)
    noise_changes = changes(noise, fp32, "final_loss")
    for r in rows:
        r["upload_ratio"] = fp32["bytes_up"] / r["bytes_up"]
        penalties = changes(r, fp32, "final_loss")
        for seed_run, p in zip(r["per_seed"], penalties, strict=True):
            seed_run["penalty_vs_fp32"] = p
        r["penalty_vs_fp32"] = statistics.fmean(penalties)
        r["penalties"] = penalties
    sparse = rows[1]
    n = len(s.seeds)
    checks = [
        check(
            "sparse uploads: loss penalty against fp32 (each at the outer setting chosen on other seeds)",
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
        "grid": [  # every cell's loss on the tuning seeds, the mean and each seed's
            {k: c[k] for k in ("codec", "outer", "final_loss")}
            | {"per_seed": [{k: r[k] for k in ("seed", "final_loss")} for r in c["per_seed"]]}
            for cells in grid.values()
            for c in cells
        ],
        "noise": {"losses": values(noise, "final_loss"), "changes": noise_changes},
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
    tune = s.get("tune_seeds")
    if outers and "grid" in result:
        if tune:
            chose = (
                f"fp32 and sparse each ran with every outer setting (learning rate / momentum) on seeds "
                f"{', '.join(map(str, tune))}, which the comparison below does not use; each codec's setting with "
                "the lowest mean final loss there is the one it is judged at, on the other seeds; topk ran with "
                "sparse's. Final validation loss on the tuning seeds, mean (min–max):"
            )
        else:  # results from before 2026-12-06's second change: chosen on the judged seeds
            chose = (
                "fp32 and sparse each ran with every outer setting (learning rate / momentum); each is judged at its "
                "own best (lowest mean final loss), topk ran with sparse's. Final validation loss, mean (min–max):"
            )
        parts.append(chose)
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
    if "noise" in result:
        floor = result["noise"]["changes"]
        note += (
            f" Noise floor: fp32 at its setting run again with torch on {s['noise_threads']} threads instead of 1 "
            f"(the same floats summed in another order) ended {', '.join(f'{c:+.2%}' for c in floor)} away, seed "
            "by seed: a seed's penalty is not known closer than that."
        )
    if not outers:  # results from before the grid
        note += " Every codec ran the same outer optimizer."
    else:
        note += (
            " Until 2026-12-06 every codec ran Nesterov 0.7 / 0.9 and sparse β = 0.5: fp32's loss stalled there "
            "(2.76 mean) and sparse showed 15% below it. Later that day each codec was judged at its best cell on "
            "the judged seeds themselves (optimistic for both): sparse +1.54% (+1.19%..+2.15%); then at cells "
            "chosen on seeds 3 and 4, with 20 inner warmup steps: +1.74% (+1.31%..+2.35%), a FAIL on seed 1 whose "
            "noise floor was +1.20%; the warmup became 100 steps, chosen on fp32's noise floor on seeds 3-5. See the "
            "module docstring of `diloco.bench.bench_sparse`."
        )
    return "\n\n".join([*parts, table(headers, rows), note])


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(
        __doc__, quick_flag, lambda a, log: run(QUICK if a.quick else FULL, SimRunner(log)), markdown, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
