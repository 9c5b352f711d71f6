"""Section `fragments`: streaming fragments on the simulator (issue #13, point 2; `diloco.core.fragments`).

Four equal learners train a 118,528-parameter GPT (d_model 64, 2 layers) in `decoupled` mode at H = 40 on the
far-apart-islands link (400 Mbit/s, 0.5 s latency) to the same token budget, once per P in {1, 2, 4} and with
every seed of the settings (the same seeds for every P). The budget is a whole number of whole-model outer steps
(`FragmentSettings.whole_step_tokens`: every learner's H inner steps), so every P's rounds end exactly on it and
every run stops, and is evaluated, at the same applied tokens: the loss at the budget is that evaluation, read at
exactly the budget for every P (a run that applied other tokens stops the section). Reported per P: the peak
bytes per second on the busiest learner link, up and down, over a sliding window of 1 virtual second (an inner
step), and the same summed over the links at the coordinator (`diloco.sim.links`; the snapshot a learner gets when
it registers is the same for every P and left out), the bytes moved in all, the validation loss at the budget and
its change against P = 1, seed by seed, and a noise floor: P = 1 run again with torch on 2 threads instead of 1,
the same arithmetic with its float sums taken in another order, whose loss change seed by seed is what rounding
amplified by training moves a seed's comparison without any change of P (no target; it says how far the per-seed
figures can be read).

Targets (rule: mean and every seed):
- the peak link bandwidth, up and down, drops by at least P/2 times against P = 1. A fragment is whole tensors,
  so the largest fragment is more than 1/P of the model (this model: 56% at P = 2, 28% at P = 4) and P times
  is out of reach; the ideal for the layout, 1 / (largest fragment's share), is reported beside it.
- the loss at the budget is at most 2% above P = 1's (seed by seed; a lower loss passes).

Until 2026-12-02 the budget was 600,000 tokens, which is not a whole number of rounds for every P: the simulator
stops at the first round that reaches the budget, so P = 1 and P = 2 (rounds of 40,960 and 20,480 tokens) stopped
at 614,400 tokens and P = 4 (10,240) at 604,160, and the loss at 600,000 was interpolated between the evaluation at
409,600 and those last ones: P = 1's figure rested on an evaluation 10,240 applied tokens later than P = 4's (and
P = 4's on one after 59 rounds, fragment 0 one outer step short). The budget then became 614,400 tokens, 15
whole-model outer steps. At 15, still early in training, the seeds' losses at the budget spread 2.13-2.39 and P = 4
against P = 1 went from -1.63% to +2.86% seed by seed (at 2e80ac07c0): a spread between seeds as wide as the 2%
target. Since 2026-12-03 the budget is 40 whole-model outer steps (1,638,400 tokens; the cosine schedule spans its
1,600 inner steps), the length issue #13 asks of the sparse-upload comparison so that it is not noise. This change
was made after seeing that result, and the report says so; docs/fragments.md has the runs of other lengths (one,
seed 1 at 30 steps, was +3.4%).

Since 2026-12-06 the inner warmup is 200 steps (an eighth of the run), was 20. With 20 steps at lr 3e-3 the loss
rose again between the first two whole-model outer steps (seed 1, P = 1: 2.94 then 2.95) and each run settled in a
basin that the last bits decided: the seeds ended at 1.68-1.98 on the same validation sample, P = 1 on 2 threads
instead of 1 moved a seed's loss by up to 1.8%, and P = 4 against P = 1 went from -2.60% to +2.53% seed by seed (a
FAIL at d9e9579630), each seed's gap set in the first ten outer steps and kept. Two changes were tried on P = 1
and P = 4, 3 seeds each (noise floor on P = 1): lr 1e-3 (losses 1.80-1.85, noise floor under 0.02%, P = 4
-0.35%, +0.70%, +0.03%) and 200 warmup steps (losses 1.59-1.64, noise floor up to 0.49%, P = 4 -0.72%, -0.89%,
-1.48%); the second was kept for its lower loss: the short warmup was a poor setting, as the comparison's spread
showed. This was chosen after seeing those results; docs/fragments.md has the runs.

`python -m diloco.bench.bench_fragments` runs the section on its own (`--quick` for the small settings).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from diloco.bench.section import Context, Result, quick_flag, save_figure, standalone, table
from diloco.bench.seeds import changes, check, fmt, target_met, values
from diloco.bench.sim_bench import SimRunner
from diloco.core.fragments import FragmentLayout
from diloco.errors import ConfigError
from diloco.sim.config import SimConfig
from diloco.task.data import DataConfig
from diloco.task.factory import TaskConfig
from diloco.task.inner import InnerConfig
from diloco.task.model import GPT, ModelConfig
from diloco.task.params import merge_segments

MAX_LOSS_CHANGE = 0.02  # loss at the budget above P = 1's, at most
DIRECTIONS = (("up", "link_up"), ("down", "link_down"))


@dataclass(frozen=True)
class FragmentSettings:
    d_model: int = 64
    n_layers: int = 2  # 118,528 parameters in 28 tensors
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8
    learners: int = 4
    mode: str = "decoupled"
    local_steps: int = 40  # H; P = 4 syncs a fragment every 10 inner steps
    token_budget: int = 1_638_400  # 40 whole-model outer steps: a multiple of `whole_step_tokens` (checked)
    inner_lr: float = 3e-3
    warmup_steps: int = 200  # 20 until 2026-12-06 (see the module docstring)
    max_bytes: int = 4_000_000
    num_shards: int = 16
    codec: str = "int8"
    bandwidth_mbps: float = 400.0
    latency_s: float = 0.5
    step_time_s: float = 1.0
    peak_window_s: float = 1.0
    eval_every: int = 5  # whole-model outer steps between evaluations
    eval_tokens: int = 16_384
    fragments: tuple[int, ...] = (1, 2, 4)
    seeds: tuple[int, ...] = (0, 1, 2)
    noise_threads: int = 2  # P = 1 again with torch on this many threads: the noise floor of a seed's comparison

    def __post_init__(self) -> None:
        if self.token_budget <= 0 or self.token_budget % self.whole_step_tokens:
            raise ConfigError(
                f"token_budget ({self.token_budget:,}) must be a positive multiple of the tokens of one whole-model "
                f"outer step ({self.whole_step_tokens:,}: {self.learners} learners x H = {self.local_steps} x "
                f"{self.batch_size * self.seq_len} tokens), else P's rounds end on it for some P and not others and "
                "the runs stop at different applied tokens; use a multiple of it"
            )

    @property
    def whole_step_tokens(self) -> int:
        """Tokens applied by one whole-model outer step: every learner's H inner steps, in one round at P = 1 and in
        P rounds (one fragment each) otherwise."""
        return self.learners * self.local_steps * self.batch_size * self.seq_len


FULL = FragmentSettings()
QUICK = FragmentSettings(
    d_model=32, n_layers=1, local_steps=8, token_budget=40_960, warmup_steps=2, eval_tokens=4_096, seeds=(0,)
)


def sim_config(s: FragmentSettings, fragments: int, seed: int) -> SimConfig:
    steps = s.token_budget // (s.learners * s.batch_size * s.seq_len)
    task = TaskConfig(
        model=ModelConfig(seq_len=s.seq_len, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads),
        data=DataConfig(num_shards=s.num_shards, max_bytes=s.max_bytes),
        inner=InnerConfig(lr=s.inner_lr, warmup_steps=s.warmup_steps, total_steps=steps, batch_size=s.batch_size),
    )
    return SimConfig(
        mode=s.mode,
        speeds=(1.0,) * s.learners,
        step_time_s=s.step_time_s,
        bandwidth_bytes_per_s=s.bandwidth_mbps * 1e6 / 8,
        latency_s=s.latency_s,
        local_steps=s.local_steps,
        min_local_steps=max(1, s.local_steps // 4),
        codec=s.codec,
        num_shards=s.num_shards,
        token_budget=s.token_budget,
        eval_every=s.eval_every,
        eval_tokens=s.eval_tokens,
        seed=seed,
        task=task,
        fragments=fragments,
        peak_window_s=s.peak_window_s,
    )


def layout_shares(s: FragmentSettings, fragments: int) -> tuple[int, list[float]]:
    """The model's parameter count and each fragment's share of it."""
    model = GPT(ModelConfig(seq_len=s.seq_len, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads))
    segments = merge_segments(model)
    layout = FragmentLayout.of_segments(segments, fragments)
    return layout.numel, [layout.size(p) / layout.numel for p in range(fragments)]


def check_at_budget(row: dict[str, Any], budget: int, fragments: int) -> None:
    """Every seed's run stopped at exactly `budget` applied tokens with an evaluation there, so its loss at the
    budget is that evaluation's and every P is judged at the same tokens; RuntimeError otherwise."""
    for seed, one in zip(row["seeds"], row["per_seed"], strict=True):
        last = one["history"][-1]
        if one["tokens"] != budget or last[1] != budget:
            raise RuntimeError(
                f"P = {fragments}, seed {seed}: the run stopped at {one['tokens']:,} applied tokens (last evaluation "
                f"at {last[1]:,.0f}), not at the budget {budget:,}: its loss would be compared at other tokens than "
                "the other P's. The rounds did not each take one fragment from every learner; check the settings"
            )


def run(s: FragmentSettings, runner: SimRunner) -> Result:
    rows: list[dict[str, Any]] = []
    for p in s.fragments:

        def make(seed: int, p: int = p) -> SimConfig:
            return sim_config(s, p, seed)

        row = runner.seeds(make, f"P = {p}", s.token_budget, s.seeds)
        check_at_budget(row, s.token_budget, p)
        numel, shares = layout_shares(s, p)
        row.update(fragments=p, numel=numel, shares=shares, ideal_ratio=1 / max(shares))
        row.pop("history", None)  # the first seed's again; each seed keeps its own in `per_seed`
        rows.append(row)
    base = rows[0]
    noise = runner.seeds(
        lambda seed: sim_config(s, 1, seed),
        f"P = 1 on {s.noise_threads} torch threads",
        s.token_budget,
        s.seeds,
        threads=s.noise_threads,
    )
    check_at_budget(noise, s.token_budget, 1)
    noise_changes = changes(noise, base, "loss_at_budget")
    checks = []
    n = len(s.seeds)
    for r in rows:
        for name, key in DIRECTIONS:
            r[f"{name}_ratios"] = [
                a / b if b else float("nan")
                for a, b in zip(values(base, f"peak_{key}"), values(r, f"peak_{key}"), strict=True)
            ]
        r["loss_changes"] = changes(r, base, "loss_at_budget")
    for r in rows[1:]:
        p = r["fragments"]
        for name, _ in DIRECTIONS:
            checks.append(
                check(
                    f"P = {p}: peak link bandwidth {name} against P = 1 (ideal for the layout {r['ideal_ratio']:.2f}x)",
                    f"≥ {p / 2:g}x lower",
                    fmt(r[f"{name}_ratios"], ".2f", "x") + " lower",
                    target_met(r[f"{name}_ratios"], p / 2, at_least=True),
                    n,
                )
            )
        checks.append(
            check(
                f"P = {p}: loss at the budget against P = 1",
                f"≤ {MAX_LOSS_CHANGE:+.0%} (a lower loss passes)",
                f"{fmt(r['loss_changes'], '+.2%')}: {fmt(values(r, 'loss_at_budget'))} vs "
                f"{fmt(values(base, 'loss_at_budget'))}",
                target_met(r["loss_changes"], MAX_LOSS_CHANGE, at_least=False),
                n,
            )
        )
    return {
        "settings": dataclasses.asdict(s),
        "rows": rows,
        "noise": {"losses": values(noise, "loss_at_budget"), "changes": noise_changes},
        "checks": checks,
    }


def section(ctx: Context) -> Result:
    return run(QUICK if ctx.quick else FULL, ctx.sim)


def markdown(result: Result) -> str:
    s = result["settings"]
    head = (
        f"{result['rows'][0]['numel']:,}-parameter GPT (d_model {s['d_model']}, layers: {s['n_layers']}), "
        f"{s['learners']} equal learners, `{s['mode']}`, H = {s['local_steps']}, `{s['codec']}` uploads, default "
        f"broadcast codec, {s['bandwidth_mbps']:g} Mbit/s and {s['latency_s']:g} s per learner link, "
        f"{s['token_budget']:,} tokens; seeds {', '.join(map(str, s['seeds']))}, the same for every P. Peaks are "
        f"the most bytes in any {s['peak_window_s']:g} s window (an inner step is {s['step_time_s']:g} s), per "
        "second: on the busiest learner link, and summed over the links at the coordinator; a registering "
        "learner's snapshot is left out (the same for every P)."
    )
    rows = [
        [
            f"P = {r['fragments']}",
            " / ".join(f"{x:.0%}" for x in r["shares"]),
            fmt(values(r, "peak_link_up"), ",.0f"),
            fmt(values(r, "peak_link_down"), ",.0f"),
            "-" if r["fragments"] == 1 else fmt(r["up_ratios"], ".2f", "x"),
            "-" if r["fragments"] == 1 else fmt(r["down_ratios"], ".2f", "x"),
            fmt(values(r, "peak_coordinator_up"), ",.0f"),
            fmt(values(r, "peak_coordinator_down"), ",.0f"),
            f"{r['bytes_up'] / 1e6:.2f} / {r['bytes_down'] / 1e6:.2f}",
            fmt(values(r, "tokens"), ",.0f"),
            fmt(values(r, "loss_at_budget")),
            "-" if r["fragments"] == 1 else fmt(r["loss_changes"], "+.2%"),
        ]
        for r in result["rows"]
    ]
    headers = [
        "P",
        "fragment sizes",
        "peak up, link (B/s)",
        "peak down, link (B/s)",
        "up: lower than P = 1",
        "down: lower than P = 1",
        "peak up, coordinator (B/s)",
        "peak down, coordinator (B/s)",
        "MB up / down",
        "tokens applied",
        "loss at budget",
        "loss vs P = 1",
    ]
    note = (
        "A round with fragments steps only the fragments submitted in it, so P = 4 makes about 4 times as many "
        "rounds of a quarter of the model each; the bytes in all stay about the same, spread over time. Tokens "
        "applied count every token once whatever P. "
    )
    whole = s["learners"] * s["local_steps"] * s["batch_size"] * s["seq_len"]  # FragmentSettings.whole_step_tokens
    if s["token_budget"] % whole == 0:
        note += (
            f"The budget is {s['token_budget'] // whole} whole-model outer steps of {whole:,} tokens, so every P's "
            "runs stop at exactly the budget and the loss at budget is the evaluation there, at the same tokens for "
            "every P (until 2026-12-02 the full settings' budget was 600,000 tokens: P = 4 stopped at 604,160 applied "
            "tokens, P = 1 and 2 at 614,400, and the loss at 600,000 was interpolated between evaluations)."
        )
        if s["token_budget"] // whole >= 40:
            note += (
                " Until 2026-12-03 the budget was 15 whole-model outer steps; there the seeds' losses spread "
                "2.13-2.39 and P = 4 against P = 1 went from -1.63% to +2.86% seed by seed (a FAIL on one seed, at "
                "2e80ac07c0), a spread as wide as the target. The budget became 40 outer steps after that result was "
                "seen, the length issue #13 asks of a loss comparison; docs/fragments.md lists runs of other "
                "lengths (seed 1 at 30 outer steps: +3.4%)."
            )
    else:  # results written before the budget was checked
        note += (
            f"The budget is not a whole number of whole-model outer steps ({whole:,} tokens): the runs stopped at "
            "the tokens applied shown, which differ with P, and the loss at budget is interpolated between "
            "evaluations."
        )
    if "noise" in result:
        floor = result["noise"]["changes"]
        note += (
            f" Noise floor: P = 1 run again with torch on {s['noise_threads']} threads instead of 1 (the same "
            "arithmetic, its float sums taken in another order) lands "
            + ", ".join(f"{c:+.2%}" for c in floor)
            + " from P = 1 seed by seed: the part of a seed's loss change that is rounding amplified by training, "
            "not P."
        )
    if s["token_budget"] // whole >= 40 and s["warmup_steps"] > 20:
        note += (
            f" Until 2026-12-06 the inner warmup was 20 steps (now {s['warmup_steps']}): at lr {s['inner_lr']:g} "
            "the loss rose again between the first two whole-model outer steps and each run settled in a basin "
            "that bits decided (seeds at 1.68-1.98; the noise floor above was then up to 1.8%, and P = 4 against "
            "P = 1 went -2.60% to +2.53% seed by seed, a FAIL at d9e9579630); docs/fragments.md has those runs."
        )
    return "\n\n".join([head, table(headers, rows), note, "![peak link bandwidth and loss against P](fragments.png)"])


def plots(result: Result, out: Path) -> list[str]:
    """Three panels: validation loss against applied tokens per P (every seed; results from before the histories
    were kept leave it empty), the peak bytes per second on the busiest learner link up and down per P (mean over
    the seeds, the layout's ideal marked), and each seed's loss change against P = 1 with the target's line."""
    rows = result["rows"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, r in enumerate(rows):
        for j, one in enumerate(r["per_seed"]):
            h = one.get("history") or []
            a.plot(
                [p[1] for p in h[1:]],
                [p[2] for p in h[1:]],
                color=f"C{i}",
                alpha=1.0 if j == 0 else 0.4,
                label=f"P = {r['fragments']}" if j == 0 else None,
            )
    a.set_xlabel("applied tokens")
    a.set_ylabel("validation loss (every seed)")
    a.grid(alpha=0.3)
    if a.get_legend_handles_labels()[0]:
        a.legend(fontsize=8)
    x = range(len(rows))
    base = statistics.fmean(values(rows[0], "peak_link_up")), statistics.fmean(values(rows[0], "peak_link_down"))
    for k, (name, key) in enumerate(DIRECTIONS):
        peaks = [statistics.fmean(values(r, f"peak_{key}")) / 1e3 for r in rows]
        b.bar([i + (k - 0.5) * 0.4 for i in x], peaks, width=0.4, label=name, color=f"C{k + 3}")
        b.scatter(
            [i + (k - 0.5) * 0.4 for i in x],
            [base[k] / r["ideal_ratio"] / 1e3 for r in rows],
            marker="_",
            s=300,
            color="black",
            label="P = 1 / ideal for the layout" if k == 0 else None,
        )
    b.set_xticks(list(x), [f"P = {r['fragments']}" for r in rows])
    b.set_ylabel("peak kB/s, busiest learner link")
    b.grid(alpha=0.3, axis="y")
    b.legend(fontsize=8)
    for i, r in enumerate(rows[1:], start=1):
        pct = [100 * v for v in r["loss_changes"]]
        c.bar(i, statistics.fmean(pct), width=0.5, color=f"C{i}", alpha=0.5, label="mean" if i == 1 else None)
        c.scatter([i] * len(pct), pct, color=f"C{i}", zorder=3, label="seeds" if i == 1 else None)
    c.axhline(100 * MAX_LOSS_CHANGE, color="red", linestyle="--", label="target")
    c.axhline(0, color="black", linewidth=0.8)
    c.set_xticks(list(x)[1:], [f"P = {r['fragments']}" for r in rows[1:]])
    c.set_ylabel("loss at the budget against P = 1 (%)")
    c.grid(alpha=0.3, axis="y")
    c.legend(fontsize=8)
    return [save_figure(fig, out / "fragments.png")]


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(
        __doc__, quick_flag, lambda a, log: run(QUICK if a.quick else FULL, SimRunner(log)), markdown, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
