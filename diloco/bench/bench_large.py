"""A large model through the real services: memory per process and where a round's time goes (issue #13 item 4).

Runs of the same real cluster (`LocalCluster`: healthd, the coordinator and 2 learners, child processes on
loopback, plaintext), `sync` rounds, the upload codec and the default broadcast codec: first with a tiny model (the
*baseline*: the Python, torch, transformers and gRPC runtime of every process, and the tiny model's training), then
with a ~100M-parameter Hugging Face Llama (`hf:llama-100m`, random init, byte tokenizer). Each process's peak
resident memory (`VmHWM` of /proc/PID/status, read every 0.1 s while it runs, until the job finishes) minus the
baseline's peak is what the model costs it; the report sets it against the fp32 model bytes:

- the coordinator holds Θ, the outer momentum, the merge buffer and the broadcast shadow Θ̂ (4 model-sized
  vectors; its evaluation model views Θ, and a third run of the large model turns evaluation off), the uploads it
  is receiving (encoded; by default, `--spill-above 64M`, an upload this size is received into an unlinked file in
  `--spill-dir`, the kernel's page cache) and the broadcast history's encoded deltas (in memory below that size);
  target ≤ 4.5x the fp32 model bytes;
- a learner holds the model, the AdamW state (2x), its broadcast Θ̂ (the base of its pseudo-gradient, brought to
  each new version in place: `diloco.core.broadcast.HeldParams`; by default, as a model-sized vector above
  `--spill-above`, in a shared mapping of an unlinked file whose pages leave resident memory after each adopt and
  submission) and the error-feedback residual (by the same rule in an unlinked file, read and written a slab at a
  time at each submission), plus, with the default gradient clipping, every gradient during a step (one more model
  size); target ≤ model + AdamW state + 2 fp32 buffers = 5x the fp32 model bytes. The activations a step keeps for
  backward come on top (at batch 4 x 128 about 1.1x of this model's size). A fourth run holds everything in memory
  on every process (`--spill-above never`: what the rule saves). A fifth run trains with `--grad-clip 0` (each
  parameter takes its AdamW step in backward and drops its gradient there) and learners with
  `--activation-checkpointing` (only each transformer block's input kept for backward); a sixth runs those learners
  in `decoupled` rounds, where each also keeps θ_at_submit between its submission and the rebase onto the next
  version (in a file as well, by the same rule).

Beside the peak, each process's page cache dirtied over the run (`dirtied_bytes`: what it sent or will send to
storage), at the default rule and with everything in memory: what the spill rule costs in disk writes.

Per round (means over the rounds after the first, whose times include start-up), from the services' own log
lines: the coordinator's `round.closed` (merge: checking and folding the uploads; the outer step; the broadcast:
Θ̂ updated and the version encoded once, for every learner), the learners' `worker.round` (inner steps;
pseudo-gradient and encode; rebase), `worker.submitted` (upload) and `worker.broadcast_received` (receiving a
version's encoded delta; it is decoded into Θ̂, in place, where the version is adopted: `rebase`).

    python -m diloco.bench.bench_large [--model hf:llama-100m --outer-steps 3]
    diloco bench --only large
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from diloco.bench.section import Context, Log, save_figure, standalone, table
from diloco.cluster import ClusterConfig, LocalCluster, LogFollower, seconds_until

COORDINATOR_TARGET = 4.5  # x fp32 model bytes: Θ, momentum, merge buffer, shadow (issue #13 item 4)
LEARNER_TARGET = 5.0  # x fp32 model bytes: model + AdamW state (2x) + 2 fp32 buffers
COORDINATOR_PHASES = ("merge", "step", "encode")
LEARNER_PHASES = ("inner", "encode", "rebase", "wait")


@dataclass(frozen=True)
class LargeSettings:
    model: str = "hf:llama-100m"
    baseline_model: str = "hf:llama-tiny"
    workers: int = 2
    outer_steps: int = 3
    local_steps: int = 2
    batch_size: int = 4
    seq_len: int = 128
    codec: str = "int8"
    timeout_s: float = 1800.0


FULL = LargeSettings()
QUICK = LargeSettings(model="hf:llama-small", outer_steps=2, local_steps=1, timeout_s=600.0)


def model_numel(model: str, seq_len: int) -> int:
    """Parameters of `model` as the task builds it (on the meta device: nothing is allocated)."""
    from diloco.task import hf
    from diloco.task.factory import TaskConfig
    from diloco.task.model import ModelConfig

    with torch.device("meta"):
        m = hf.build_model(TaskConfig(model=ModelConfig(seq_len=seq_len), model_name=model), 0)
    return sum(p.numel() for p in m.parameters())


def peak_rss(pid: int) -> int | None:
    """Peak resident set size of a process, in bytes (`VmHWM`); None once it has exited (a zombie has none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def dirtied_bytes(pid: int) -> int | None:
    """The bytes of page cache a process has dirtied (`write_bytes` of /proc/PID/io, less `cancelled_write_bytes`:
    pages dropped unwritten when their file was truncated or went away): what it has sent or will send to storage,
    its spill files included. A page rewritten while still dirty counts once. None once it has exited, or where
    /proc/PID/io cannot be read."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


class PeakRss:
    """Each named process's peak resident memory, read every `interval_s` by a thread while it runs: a process that
    exits when the job finishes (a learner) keeps its last reading, taken at most `interval_s` before its exit; and
    beside it the page cache it dirtied so far (`dirtied_bytes`), its last reading likewise."""

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.1) -> None:
        self._pids = dict(pids)
        self._interval_s = interval_s
        self.peaks: dict[str, int] = {}
        self.dirtied: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def _read(self) -> None:
        for name, pid in self._pids.items():
            peak = peak_rss(pid)
            if peak is not None:
                self.peaks[name] = max(peak, self.peaks.get(name, 0))
            dirtied = dirtied_bytes(pid)
            if dirtied is not None:
                self.dirtied[name] = dirtied

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._read()

    def __enter__(self) -> PeakRss:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def spill_args(directory: Path, memory: bool) -> tuple[str, ...]:
    """`--spill-dir` for a process of its own: `directory`, made here; `memory`: nothing spilled
    (`--spill-above never`), else the default rule."""
    directory.mkdir()
    return ("--spill-dir", str(directory), *(("--spill-above", "never") if memory else ()))


LEAN_WORKER_ARGS = ("--activation-checkpointing", "true")  # a learner's flag for the least memory


def read_logs(cluster: LocalCluster) -> dict[str, list[dict[str, Any]]]:
    """Every process's structured log lines, by process name."""
    return {
        name: [line.fields for line in LogFollower(cluster.run_dir / f"{name}.log").read()] for name in cluster.procs
    }


def round_times(
    logs: Mapping[str, Sequence[Mapping[str, Any]]],
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Mean seconds per round of each coordinator phase (`round.closed`) and each learner phase (`worker.round`,
    `worker.submitted`: upload, `worker.broadcast_received` of a delta: receive), over the rounds after the first,
    whose times include start-up."""
    closed = [f for f in logs["coordinator"] if f.get("event") == "round.closed"]
    coordinator = {p: _mean([float(f[f"{p}_s"]) for f in closed[1:] if f"{p}_s" in f]) for p in COORDINATOR_PHASES}
    learner: dict[str, list[float]] = {p: [] for p in (*LEARNER_PHASES, "upload", "receive")}
    for name in [n for n in logs if n.startswith("worker")]:
        lines = logs[name]
        rounds = [f for f in lines if f.get("event") == "worker.round"]
        for f in rounds[1:]:
            for p in LEARNER_PHASES:
                learner[p].append(float(f.get(f"{p}_s", 0.0)))
        submitted = [float(f["seconds"]) for f in lines if f.get("event") == "worker.submitted"]
        learner["upload"] += submitted[1:]
        received = [f for f in lines if f.get("event") == "worker.broadcast_received"]
        learner["receive"] += [float(f["seconds"]) for f in received if f.get("delta_from") is not None]
    return coordinator, {p: _mean(v) for p, v in learner.items()}


def run_one(
    model: str,
    s: LargeSettings,
    log: Log,
    evaluate: bool = True,
    memory: bool = False,
    clip: bool = True,
    mode: str = "sync",
) -> dict[str, Any]:
    """One cluster run in `mode` rounds; `evaluate` False runs the coordinator with `--eval-every 0` (no evaluation
    model), `memory` every process with `--spill-above never` (uploads, kept broadcast deltas and learners' residuals
    held in memory, whatever their size), `clip` False the task with `--grad-clip 0` (the learners step each
    parameter in backward: no model-sized gradient buffer) and the learners with `LEAN_WORKER_ARGS`."""
    eval_args = () if evaluate else ("--eval-every", "0")
    lean = () if clip else LEAN_WORKER_ARGS
    with tempfile.TemporaryDirectory(prefix="diloco-bench-large-") as tmp:
        coordinator_spill = spill_args(Path(tmp) / "spill", memory)
        cfg = ClusterConfig(
            workers=s.workers,
            mode=mode,
            outer_steps=s.outer_steps,
            local_steps=s.local_steps,
            min_local_steps=s.local_steps,
            min_quorum=s.workers,
            codec=s.codec,
            checkpoint_every=1000,
            run_dir=Path(tmp),
            insecure=True,
            task_args=(
                "--model",
                model,
                "--batch-size",
                str(s.batch_size),
                "--seq-len",
                str(s.seq_len),
                *(() if clip else ("--grad-clip", "0")),
            ),
            coordinator_args=("--eval-tokens", str(4 * s.seq_len), *eval_args, *coordinator_spill),
            worker_args={i: (*spill_args(Path(tmp) / f"spill-w{i}", memory), *lean) for i in range(s.workers)},
        )
        started = time.monotonic()
        with LocalCluster(cfg) as cluster:
            cluster.start(timeout_s=300)
            with PeakRss({name: p.popen.pid for name, p in cluster.procs.items()}) as rss:
                seconds_until(
                    "the job to finish", lambda: cluster.status().finished, timeout_s=s.timeout_s, interval_s=1
                )
            wall = time.monotonic() - started
            peaks, dirtied = rss.peaks, rss.dirtied
            status = cluster.final_status() if evaluate else cluster.status()
            logs = read_logs(cluster)
    coordinator, learner = round_times(logs)
    result = {
        "model": model,
        "evaluate": evaluate,
        "memory": memory,
        "clip": clip,
        "mode": mode,
        "numel": model_numel(model, s.seq_len),
        "wall_s": round(wall, 1),
        "version": status.version,
        "validation_loss": status.validation_loss,
        "peak_rss": peaks,
        "dirtied": dirtied,
        "coordinator_s": coordinator,
        "learner_s": learner,
        "broadcast_bytes": sorted(
            {
                int(f["bytes"])
                for n in logs
                for f in logs[n]
                if f.get("event") == "worker.broadcast_received" and f.get("delta_from") is not None
            }
        ),
    }
    log(
        f"  {model}: {result['numel']:,} parameters, {status.version} rounds in {wall:.0f} s, peak RSS "
        + ", ".join(f"{n} {b / 1e9:.2f} GB" for n, b in sorted(peaks.items()))
    )
    return result


def run(s: LargeSettings, log: Log) -> dict[str, Any]:
    base = run_one(s.baseline_model, s, log)
    big = run_one(s.model, s, log)
    no_eval = run_one(s.model, s, log, evaluate=False)  # the coordinator without its evaluation model
    in_memory = run_one(s.model, s, log, memory=True)  # nothing in files, whatever its size (`--spill-above never`)
    unclipped = run_one(s.model, s, log, clip=False)  # no gradient buffer, activations checkpointed
    # the same learners training on while their upload is in flight: θ_at_submit held until they rebase
    decoupled = run_one(s.model, s, log, clip=False, mode="decoupled")
    model_bytes = 4 * big["numel"]
    rows = []
    for name in sorted(big["peak_rss"]):
        net = big["peak_rss"][name] - base["peak_rss"].get(name, 0)
        rows.append(
            {
                "process": name,
                "peak": big["peak_rss"][name],
                "baseline": base["peak_rss"].get(name, 0),
                "net": net,
                "x_model": net / model_bytes,
                "judged": True,
            }
        )
    variants = [("coordinator (--eval-every 0)", "coordinator", no_eval)]
    variants += [(f"{w} (--spill-above never)", w, in_memory) for w in sorted(in_memory["peak_rss"]) if w != "healthd"]
    lean = "--grad-clip 0, --activation-checkpointing"
    for flags, run_ in ((lean, unclipped), (f"{lean}, decoupled", decoupled)):
        variants += [(f"{w} ({flags})", w, run_) for w in sorted(run_["peak_rss"]) if w.startswith("worker")]
    # the default coordinator again, beside the lean learners: how much its peak moves from run to run
    variants += [
        ("coordinator (default flags, fifth run)", "coordinator", unclipped),
        ("coordinator (default flags, sixth run: decoupled)", "coordinator", decoupled),
    ]
    for process, name, variant in variants:
        net = variant["peak_rss"][name] - base["peak_rss"][name]
        rows.append(
            {
                "process": process,
                "peak": variant["peak_rss"][name],
                "baseline": base["peak_rss"][name],
                "net": net,
                "x_model": net / model_bytes,
                # `--spill-above never` shows what the spill rule saves; the targets are for the default rule
                "judged": variant is not in_memory,
            }
        )
    checks = []
    for r in rows:
        if not r["judged"]:
            continue
        if r["process"].startswith("coordinator"):
            target = COORDINATOR_TARGET
        elif r["process"].startswith("worker"):
            target = LEARNER_TARGET
        else:
            continue
        checks.append(
            {
                "name": f"{r['process']}: peak RSS over the baseline, in fp32 model sizes",
                "target": f"≤ {target:g}x",
                "measured": f"{r['x_model']:.2f}x ({r['net'] / 1e9:.2f} GB over {r['baseline'] / 1e9:.2f} GB; "
                f"model {model_bytes / 1e9:.2f} GB)",
                "pass": r["x_model"] <= target,
            }
        )
    return {
        "settings": asdict(s),
        "baseline": base,
        "large": big,
        "large_no_eval": no_eval,
        "large_in_memory": in_memory,
        "large_no_clip": unclipped,
        "large_no_clip_decoupled": decoupled,
        "model_bytes": model_bytes,
        "memory": rows,
        "checks": checks,
    }


def section(ctx: Context) -> dict[str, Any]:
    return run(QUICK if ctx.quick else FULL, ctx.log)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(r: dict[str, Any]) -> str:
    s, big, base = r["settings"], r["large"], r["baseline"]
    head = (
        f"Command: `python -m diloco.bench.bench_large --model {s['model']} --outer-steps {s['outer_steps']}`. "
        f"healthd, the coordinator and {s['workers']} learners (real processes, loopback), `sync` rounds of H = "
        f"{s['local_steps']} inner steps, batch {s['batch_size']} x {s['seq_len']} tokens, upload codec "
        f"`{s['codec']}`, the default broadcast codec; `{big['model']}` has {big['numel']:,} parameters "
        f"({r['model_bytes'] / 1e9:.2f} GB in fp32). The baseline is the same cluster with `{base['model']}` "
        f"({base['numel']:,} parameters): the runtime every process carries whatever the model. Peak RSS is "
        "`VmHWM`, read every 0.1 s until the job finishes. The coordinator evaluates every version by default, on a "
        "model whose parameters view Θ (a round closing during an evaluation steps a copy of Θ); the row `--eval-every "
        "0` is a third run of the large model without evaluation. By default (`--spill-above 64M`) every process holds "
        "a payload or model-sized vector bigger than 64 MiB in an unlinked file in `--spill-dir` (the kernel's page "
        "cache, which it can write out and reclaim), not its own memory: here the coordinator's uploads being received "
        "(`int8`, about a quarter of the model each; its `int4` broadcast deltas, about an eighth, stay in memory), "
        "the learners' error-feedback residual, read and written a slab at a time at each submission, and their Θ̂, "
        "mapped from a file and dropped from resident memory after each adopt and submission (the two points of a "
        "round that touch it). The rows "
        "`--spill-above never` are a fourth run, every process holding all of it in memory: what the rule saves (no "
        "target is judged there). The rows `--grad-clip 0, --activation-checkpointing` are a fifth, whose learners "
        "train without gradient clipping (each parameter takes its AdamW step in backward and drops its gradient "
        "there: no model-sized gradient buffer during a step) and keep only each transformer block's input for "
        "backward; the rows `..., decoupled` a sixth, the fifth's learners in `decoupled` rounds, where a learner "
        "trains on while its upload and the next version are in flight and so also keeps θ_at_submit, the parameters "
        "whose pseudo-gradient it sent, until it rebases (ALGORITHM.md section 5): in a file as well by the same rule, "
        "written at the first step after the submission and read back a slice at a time by the rebase. A `sync` "
        "learner's resident steady state is the model and the AdamW state (3x; Θ̂ and the residual, a 4th and 5th, "
        "in the page cache, Θ̂ resident while a submission or an adopt works on it); the activations of a step (about "
        "1.1x of this model at batch 4 x 128, hand-measured), the "
        "gradients with clipping, and the encoded upload come on top of it at their peaks. The coordinator's steady "
        "state is Θ, the outer momentum, the merge buffer and its broadcast Θ̂ (4x); on top of it at their peaks come "
        "the broadcast deltas kept (none that every live learner has trained from or past) and the delta being "
        "encoded. The fifth and sixth runs' coordinators have the default flags too: their rows show how far its "
        "peak moves from run to run."
    )
    mem = table(
        ["process", "peak RSS (GB)", "baseline (GB)", "over baseline (GB)", "x fp32 model"],
        [
            [
                m["process"],
                f"{m['peak'] / 1e9:.2f}",
                f"{m['baseline'] / 1e9:.2f}",
                f"{m['net'] / 1e9:.2f}",
                f"{m['x_model']:.2f}",
            ]
            for m in r["memory"]
        ],
    )
    c, lr = big["coordinator_s"], big["learner_s"]
    times = table(
        ["where", "phase", "seconds per round"],
        [
            ["coordinator", "merge (check + fold the uploads)", _s(c.get("merge"))],
            ["coordinator", "outer step", _s(c.get("step"))],
            ["coordinator", "broadcast encode (once per version)", _s(c.get("encode"))],
            ["learner", "inner steps", _s(lr.get("inner"))],
            ["learner", "pseudo-gradient + encode (the residual from its file and back)", _s(lr.get("encode"))],
            ["learner", "upload", _s(lr.get("upload"))],
            ["learner", "broadcast receive (the encoded delta)", _s(lr.get("receive"))],
            ["learner", "adopt (decode the delta into Θ̂ in place, load or rebase θ)", _s(lr.get("rebase"))],
            ["learner", "waiting", _s(lr.get("wait"))],
        ],
    )
    held = r.get("large_in_memory", {})
    if held:
        times += (
            f"\n\nWith everything in memory (fourth run, `--spill-above never`): merge "
            f"{_s(held['coordinator_s'].get('merge'))} s (the default: the uploads read back from their files), "
            f"pseudo-gradient + encode {_s(held['learner_s'].get('encode'))} s, adopt "
            f"{_s(held['learner_s'].get('rebase'))} s (the default: Θ̂'s pages faulted back from the page cache) a "
            "round."
        )
    lean = r.get("large_no_clip", {}).get("learner_s", {})
    if lean:
        times += (
            f"\n\nThe lean learners (fifth run): inner steps {_s(lean.get('inner'))} s (activations recomputed in "
            f"backward), pseudo-gradient + encode {_s(lean.get('encode'))} s a round."
        )
    decoupled = r.get("large_no_clip_decoupled", {}).get("learner_s", {})
    if decoupled:
        times += (
            f" In `decoupled` rounds (sixth run): inner steps {_s(decoupled.get('inner'))} s, pseudo-gradient + "
            f"encode {_s(decoupled.get('encode'))} s, adopt {_s(decoupled.get('rebase'))} s (θ_at_submit read back "
            f"from its file by the rebase), waiting {_s(decoupled.get('wait'))} s a round."
        )
    sizes = ", ".join(f"{b / 1e6:.1f} MB" for b in big["broadcast_bytes"]) or "-"
    return (
        f"{head}\n\n{mem}\n\n{times}{_writes(r)}\n\nDelta broadcasts as received: {sizes}.\n\n"
        "![memory and round time of the ~100M run](large.png)"
    )


PHASES = {  # what the round-time panel stacks, per process: (key in `coordinator_s` / `learner_s`, label)
    "coordinator": (("merge", "merge"), ("step", "outer step"), ("encode", "broadcast encode")),
    "learner": (
        ("inner", "inner steps"),
        ("encode", "pseudo-gradient + encode"),
        ("upload", "upload"),
        ("receive", "broadcast receive"),
        ("rebase", "adopt"),
        ("wait", "waiting"),
    ),
}


def plots(r: dict[str, Any], out: Path) -> list[str]:
    """Two panels: each judged process's peak RSS over the baseline in fp32 model sizes with its target, and the
    default run's seconds per round by phase, the coordinator's and a learner's."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [1.6, 1]})
    rows = [m for m in r["memory"] if m["judged"] and not m["process"].startswith("healthd")]
    targets = [COORDINATOR_TARGET if m["process"].startswith("coordinator") else LEARNER_TARGET for m in rows]
    y = range(len(rows))
    a.barh(
        list(y),
        [m["x_model"] for m in rows],
        color=["C0" if m["x_model"] <= t else "C3" for m, t in zip(rows, targets, strict=True)],
    )
    a.scatter(targets, list(y), marker="|", s=200, color="black", label="target", zorder=3)
    a.set_yticks(list(y), [m["process"] for m in rows], fontsize=7)
    a.invert_yaxis()
    a.set_xlabel("peak RSS over the baseline (x fp32 model bytes)")
    a.grid(alpha=0.3, axis="x")
    a.legend(fontsize=8)
    big, color = r["large"], 0
    for i, (who, phases) in enumerate(PHASES.items()):
        times = big["coordinator_s" if who == "coordinator" else "learner_s"]
        left = 0.0
        for key, label in phases:
            width = times.get(key) or 0.0
            b.barh(i, width, left=left, color=f"C{color}", label=f"{who}: {label}")
            left, color = left + width, color + 1
    b.set_yticks([0, 1], list(PHASES))
    b.invert_yaxis()
    b.set_xlabel("seconds per round (default flags)")
    b.grid(alpha=0.3, axis="x")
    b.legend(fontsize=7)
    return [save_figure(fig, out / "large.png")]


def _writes(r: dict[str, Any]) -> str:
    """What the spill rule costs in disk writes: each process's page cache dirtied over the whole default run against
    the run holding everything in memory ("" for results from before it was measured)."""
    big, held = r["large"], r.get("large_in_memory", {})
    if "dirtied" not in big or "dirtied" not in held:
        return ""
    rounds = max(1, int(big["version"]))
    rows = [
        [
            name,
            f"{big['dirtied'][name] / 1e9:.2f}",
            f"{held['dirtied'][name] / 1e9:.2f}",
            f"{(big['dirtied'][name] - held['dirtied'][name]) / rounds / 1e6:,.0f}",
        ]
        for name in sorted(big["dirtied"])
        if name in held["dirtied"]
    ]
    return (
        "\n\nDisk writes: the page cache each process dirtied over the whole run (`write_bytes` less "
        "`cancelled_write_bytes` of /proc/PID/io, read with the peak RSS: what it sent or will send to storage, logs "
        "and the coordinator's final checkpoint included; a page rewritten while still dirty counts once), at the "
        f"default rule (second run) and with everything in memory (fourth run), over {rounds} rounds.\n\n"
        + table(["process", "default (GB)", "--spill-above never (GB)", "the rule's, per round (MB)"], rows)
    )


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=FULL.model)
    p.add_argument("--outer-steps", type=int, default=FULL.outer_steps)


def main(argv: Sequence[str] | None = None) -> int:
    def go(a: argparse.Namespace, log: Log) -> dict[str, Any]:
        return run(LargeSettings(model=a.model, outer_steps=a.outer_steps), log)

    return standalone(__doc__, _flags, go, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
