"""`diloco simulate`: run the virtual-clock simulator and print loss against virtual time."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from diloco.core.broadcast import BROADCAST_CODECS, DEFAULT_BROADCAST_CODEC
from diloco.core.codecs import CODEC_NAMES
from diloco.core.energy import INTERPOLATIONS, POLICY_NAMES, CarbonTrace
from diloco.core.outer import OUTER_NAMES, OuterConfig
from diloco.sim.config import SIM_MODES, SimConfig, parse_failures, parse_speeds
from diloco.sim.engine import SimResult, simulate
from diloco.sim.fleet import PROFILES, parse_fleet
from diloco.task.factory import task_from_flags


def add_task_args(p: argparse.ArgumentParser, *, d_model: int = 64, seq_len: int = 64) -> None:
    """Model, data and inner-optimizer flags shared by every command that trains."""
    g = p.add_argument_group("task")
    g.add_argument(
        "--data",
        default="stdlib",
        help="'stdlib' (the interpreter's own sources), a text file or folder, or a uint16 .bin file",
    )
    g.add_argument("--max-bytes", type=int, default=4_000_000, help="cap on corpus size in bytes")
    g.add_argument("--d-model", type=int, default=d_model)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--seq-len", type=int, default=seq_len)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--inner-lr", type=float, default=3e-3)
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip of inner steps (0: none)")
    g.add_argument("--warmup-steps", type=int, default=20)
    g.add_argument("--total-steps", type=int, default=2000, help="inner steps of the cosine schedule")
    g.add_argument("--factory", default="", help="your own model/data: 'package.module:function'")
    g.add_argument("--model", default="", help="'' (the built-in GPT) or hf:<preset-or-path> (diloco.task.hf)")
    g.add_argument("--tokenizer", default="", help="'' (bytes) or a local tokenizers JSON file")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate M learners on a virtual clock (deterministic)",
        description="Simulate Decoupled DiLoCo with M learners on a virtual clock.",
    )
    p.add_argument("--mode", choices=SIM_MODES, default="decoupled")
    p.add_argument("--speeds", default="1,1,0.5,0.25", help="relative learner speeds, one per learner")
    p.add_argument("--step-time-s", type=float, default=1.0, help="virtual seconds per inner step at speed 1")
    p.add_argument("--bandwidth-mbps", type=float, default=800.0, help="per-learner link, megabits/s")
    p.add_argument("--latency-s", type=float, default=0.5)
    p.add_argument("--failures", default="", help="explicit schedule, e.g. kill:3@40,revive:3@120")
    p.add_argument("--mtbf-s", type=float, default=0.0, help="mean time between failures per learner (0: none)")
    p.add_argument("--repair-s", type=float, default=60.0, help="downtime after a random failure")
    p.add_argument("--dead-after-s", type=float, default=2.0, help="failure detection delay")
    p.add_argument("-H", "--local-steps", type=int, default=20)
    p.add_argument("--min-local-steps", type=int, default=2)
    p.add_argument("--fixed-local-steps", action="store_true", help="same H for every learner")
    p.add_argument("-K", "--min-quorum", type=int, default=2)
    p.add_argument("--grace-max-s", type=float, default=5.0)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--codec", choices=CODEC_NAMES, default="int8")
    p.add_argument(
        "--broadcast-codec",
        choices=BROADCAST_CODECS,
        default=DEFAULT_BROADCAST_CODEC,
        help="parameter broadcasts: fp32 snapshots, or deltas with downlink error feedback (bytes_down counts them)",
    )
    p.add_argument("--no-error-feedback", action="store_true")
    p.add_argument(
        "--ef-decay",
        type=float,
        default=None,
        help="error feedback's residual decay beta, in (0, 1] (1: exact; default: the codec's, see ErrorFeedback)",
    )
    p.add_argument(
        "--topk-fraction", type=float, default=None, help="topk/sparse: fraction of entries sent (default: the codec's)"
    )
    p.add_argument("--outer", choices=OUTER_NAMES, default="nesterov")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--merge", choices=("mean", "rda"), default="mean")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--tokens", type=int, default=0, help="stop after this many applied tokens")
    p.add_argument("--outer-steps", type=int, default=0, help="stop after this many rounds")
    p.add_argument("--max-time-s", type=float, default=0.0, help="stop at this virtual time")
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument(
        "--eval-tokens", type=int, default=32_768, help="validation tokens per evaluation (0: the whole split)"
    )
    p.add_argument("--target-loss", type=float, default=0.0)
    p.add_argument("--no-train", action="store_true", help="timing only: no model, for large sweeps")
    p.add_argument("--model-numel", type=int, default=0, help="payload size for --no-train")
    p.add_argument("--seed", type=int, default=0, help="initial parameters, failure times and data order")
    p.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="streaming fragments P (diloco.core.fragments): fragment p syncs at inner steps p·⌊H/P⌋ mod H, alone; "
        "1: the whole model every H steps",
    )
    p.add_argument(
        "--peak-window-s", type=float, default=1.0, help="sliding window of the reported peak link bandwidth"
    )
    g = p.add_argument_group("energy, carbon and cost (diloco.sim.fleet, diloco.core.energy)")
    g.add_argument(
        "--fleet",
        default="",
        help=f"one PROFILE@ZONE[:spot] per learner, e.g. h100@hydro,a100@solar:spot (profiles: {', '.join(PROFILES)});"
        " sets the speeds",
    )
    g.add_argument("--placement", choices=POLICY_NAMES, default="speed", help="placement policy (needs --fleet)")
    g.add_argument("--carbon-trace", type=Path, help="CSV zone,time_s,gco2_per_kwh (examples/carbon/diurnal.csv)")
    g.add_argument("--carbon-interpolation", choices=INTERPOLATIONS, default="step")
    g.add_argument("--carbon-threshold", type=float, default=0.0, help="gCO2/kWh; 0: the dirtiest zone is dirty")
    g.add_argument("--deadline-s", type=float, default=0.0, help="virtual time the job must end by (0: none)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG of validation loss against virtual time")
    add_task_args(p)
    p.set_defaults(func=run)


def config_from_args(a: argparse.Namespace) -> SimConfig:
    fleet = parse_fleet(a.fleet)
    trace = CarbonTrace.load(a.carbon_trace, a.carbon_interpolation) if a.carbon_trace else None
    return SimConfig(
        mode=a.mode,
        speeds=tuple(f.hw.speed for f in fleet) if fleet else parse_speeds(a.speeds),
        fleet=fleet,
        placement=a.placement,
        carbon_trace=trace,
        carbon_threshold=a.carbon_threshold,
        deadline_s=a.deadline_s,
        step_time_s=a.step_time_s,
        bandwidth_bytes_per_s=a.bandwidth_mbps * 1e6 / 8,
        latency_s=a.latency_s,
        failures=parse_failures(a.failures),
        mtbf_s=a.mtbf_s,
        repair_s=a.repair_s,
        dead_after_s=a.dead_after_s,
        local_steps=a.local_steps,
        min_local_steps=a.min_local_steps,
        dynamic_local_steps=not a.fixed_local_steps,
        min_quorum=a.min_quorum,
        grace_max_s=a.grace_max_s,
        max_staleness=a.max_staleness,
        codec=a.codec,
        broadcast_codec=a.broadcast_codec,
        error_feedback=not a.no_error_feedback,
        ef_decay=a.ef_decay,
        topk_fraction=a.topk_fraction,
        outer=OuterConfig(a.outer, a.outer_lr, a.outer_momentum),
        merge=a.merge,
        num_shards=a.shards,
        token_budget=a.tokens,
        outer_steps=a.outer_steps,
        max_time_s=a.max_time_s,
        eval_every=a.eval_every,
        eval_tokens=a.eval_tokens,
        target_loss=a.target_loss,
        train=not a.no_train,
        model_numel=a.model_numel,
        seed=a.seed,
        fragments=a.fragments,
        peak_window_s=a.peak_window_s,
        task=task_from_flags(a),
    )


def print_result(console: Console, r: SimResult) -> None:
    scored = int(r.history[-1].get("eval_tokens", 0))
    table = Table(title=f"{r.mode}: validation loss ({scored:,} tokens scored) against virtual time")
    for col in ("time (s)", "tokens", "version", "val loss"):
        table.add_column(col, justify="right")
    step = max(1, len(r.history) // 20)
    for p in r.history[::step] + ([r.history[-1]] if (len(r.history) - 1) % step else []):
        table.add_row(f"{p['time_s']:.1f}", f"{int(p['tokens']):,}", str(int(p["version"])), f"{p['val_loss']:.4f}")
    console.print(table)
    summary = Table(title="summary", show_header=False)
    rows = {
        "virtual time (s)": f"{r.time_s:.1f}",
        "rounds": str(r.rounds),
        "tokens applied": f"{r.tokens:,}",
        "val loss (start -> end)": f"{r.initial_loss:.4f} -> {r.final_loss:.4f}",
        "goodput": f"{r.goodput:.1%}",
        "bytes up / down": f"{r.bytes_up:,} / {r.bytes_down:,}",
        f"peak bytes/s up / down (busiest link, {r.peak_window_s:g} s window)": (
            f"{r.peak_bytes_per_s.get('link_up', 0):,.0f} / {r.peak_bytes_per_s.get('link_down', 0):,.0f}"
        ),
        "staleness mean / max": f"{r.mean_staleness:.2f} / {r.max_staleness}",
        "rejected / lost uploads": f"{r.rejected} / {r.lost_uploads}",
        "time to target (s)": "-" if r.time_to_target_s is None else f"{r.time_to_target_s:.1f}",
    }
    if r.per_learner and r.energy_j:
        rows[f"placement {r.placement}: energy / carbon / cost"] = (
            f"{r.energy_j / 3.6e6:.3f} kWh / {r.carbon_g:.1f} gCO2 / {r.cost:.2f}"
        )
    for k, v in rows.items():
        summary.add_row(k, v)
    console.print(summary)


def plot(results: list[SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([p["time_s"] for p in r.history], [p["val_loss"] for p in r.history], label=r.mode)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("validation loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # like the services: one thread each; 2 threads contend on these machines
    cfg = config_from_args(a)
    console = Console(stderr=a.json)
    result = simulate(cfg)
    if a.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print_result(console, result)
    if a.plot:
        plot([result], a.plot)
    return 0
