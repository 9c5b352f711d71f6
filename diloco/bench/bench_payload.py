"""A ~1B-parameter payload through the real coordinator alone: its memory and where a round's time goes (issue #13
item 4, the timing-only part beside `bench_large`).

No training: `python -m services.coordinator` (its own process, plaintext on loopback, no healthd: nothing here
needs one) holds a GPT of about `--numel` parameters (`bench_upload.pick_model`: the coordinator builds it from its
own flags, no download), `sync` rounds of 2 learners, `--eval-every 0` and no checkpoints, so only the round path
runs. This process plays the 2 learners over the real RPCs: `Register`, then per round each learner's
`GetWorkPlan` and its upload on the bulk upload port (as a worker sends it; `SubmitPseudoGradient` where the
coordinator offers no bulk port) of one full-size pseudo-gradient: random values encoded once with the upload
codec (`int8`, as `bench_large`) and the same bytes sent every time. The learners upload one after the other: the
first upload's reply comes once it is decoded and folded into the merge buffer; the second's, once its round
closed too (merge, outer step, broadcast encode), so the round's close is in it. The first learner also holds a
`WatchParameters` stream through the worker's own `Watcher` (`BroadcastFollower`: the version 0 snapshot, then
each version's delta in the default broadcast codec, decoded and applied to Θ̂).

Per round: the client-side seconds of each upload (first message to reply); the coordinator's `merge_s` (checking
and folding the uploads), `step_s` (the outer step) and `encode_s` (Θ̂ updated and the version encoded once for
every learner) from its `round.closed` log line; the watcher's `seconds` from its `worker.broadcast_received` line
(receiving, decoding and applying the delta) and, from the closing upload's reply to the version delivered, the
delivery time. No learner model here, so no rebase (`bench_large` has it).

Memory: the coordinator's peak RSS (`VmHWM` of /proc/PID/status, after the last round, start-up included) minus
the peak of the same run at `baseline_numel` (the Python, torch and gRPC runtime), in fp32 model sizes, against
`bench_large`'s target for the coordinator; beside it the peak during the rounds alone (`VmHWM` reset after
start-up, where the kernel allows it). A run that would not fit in the memory available (`memory_needed`) is
refused before anything starts; the suite runs without the watcher (`FULL`), which at 1B needs one more fp32
model size (its Θ̂, which each delta is applied to in place) and the encoded delta in this process beside the
coordinator's ~4.5.

    python -m diloco.bench.bench_payload [--numel 1000000000] [--rounds 3] [--no-watch]
    diloco bench --only payload
"""

from __future__ import annotations

import argparse
import queue
import resource
import statistics
import tempfile
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import structlog
import torch

from diloco.bench.bench_large import COORDINATOR_TARGET, _s
from diloco.bench.bench_upload import (
    Coordinator,
    Learner,
    gpt_numel,
    hwm_bytes,
    pick_model,
    register,
    reset_hwm,
    rss_bytes,
    send_bulk,
    send_stream,
    submission_header,
)
from diloco.bench.section import Context, Log, standalone, table
from diloco.core.broadcast import Refusal
from diloco.core.codecs import EncodedMeta, get_codec
from diloco.errors import ConfigError
from diloco.rpc.server import channel
from diloco.task.model import GPT, ModelConfig
from diloco.task.params import param_specs
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.worker.watcher import Delivered, Watcher

LEARNERS = 2
SHARDS = 2 * LEARNERS  # data shards: one or more for each learner
PHASES = ("merge", "step", "encode")  # the coordinator's round.closed fields, `<phase>_s`


@dataclass(frozen=True)
class PayloadSettings:
    numel: int = 1_000_000_000  # about this many parameters (the nearest GPT shape)
    baseline_numel: int = 1_000_000
    rounds: int = 3
    codec: str = "int8"  # the upload codec
    watch: bool = True  # a learner receives every version (this process then holds its Θ̂: 1 more fp32 model size)
    spill: bool = False  # the coordinator holds uploads and broadcast deltas in files (`--spill-above 0`), not memory
    start_timeout_s: float = 900.0  # the coordinator building a 1B model on a busy CPU
    round_timeout_s: float = 900.0  # each upload and each delivery

    def __post_init__(self) -> None:
        if self.numel < 1 or self.baseline_numel < 1 or self.rounds < 1:
            raise ConfigError("numel, baseline_numel and rounds must be >= 1")
        get_codec(self.codec)  # an unknown codec is refused here, before any process starts


# the suite's full run fits a 24 GB machine: at 1B the coordinator alone takes ~17 GB (~18 GB without spilling), a
# watcher 4-5 GB more; the uploads it receives and the deltas it keeps are held in files (section 16 measures the
# coordinator both ways at 100M)
FULL = PayloadSettings(watch=False, spill=True)
QUICK = PayloadSettings(numel=2_000_000, baseline_numel=200_000, rounds=2, start_timeout_s=300, round_timeout_s=300)
COORDINATOR_X = 4.6  # fp32 model sizes the coordinator peaks at (measured: 4.5x at 200M and 500M), for the memory check
JUDGED_FROM = 100_000_000  # parameters: below, the runtime's own noise outweighs the model (the check says n/a)
WATCHER_X = 1.25  # ... this process's watcher: Θ̂, and an encoded delta until it is applied (int8: a quarter)


def model_for(numel: int) -> tuple[ModelConfig, int]:
    """The GPT the coordinator builds for about `numel` parameters, and its exact parameter count."""
    cfg = pick_model(numel)
    return cfg, gpt_numel(cfg.d_model, cfg.n_layers, cfg.seq_len, cfg.vocab_size)


def check_memory(s: PayloadSettings) -> None:
    """Refuse a size whose run would not fit in the memory available now (ConfigError), before anything starts."""
    _, numel = model_for(s.numel)
    need, available = memory_needed(numel, s), mem_available()
    if available is not None and need > available:
        raise ConfigError(
            f"{numel:,} parameters need about {need / 1e9:.1f} GB of memory, {available / 1e9:.1f} GB is available: "
            "give a smaller --numel" + (" or --no-watch" if s.watch else "")
        )


def memory_needed(numel: int, s: PayloadSettings) -> int:
    """Bytes the run holds at once beyond the runtime: the coordinator, the encoded upload and the watcher."""
    upload = numel  # int8: a byte a value, about (in the page cache when spilled: memory all the same)
    return int(4 * numel * (COORDINATOR_X + (WATCHER_X if s.watch else 0.0))) + upload


def mem_available() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _recording_log(events: list[dict[str, Any]]) -> structlog.stdlib.BoundLogger:
    """A logger that keeps every event dict (the watcher's lines) in `events` and prints nothing."""

    def keep(_logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        events.append(dict(event_dict))
        raise structlog.DropEvent

    return cast(
        structlog.stdlib.BoundLogger,
        structlog.wrap_logger(None, processors=[keep], wrapper_class=structlog.stdlib.BoundLogger),
    )


def _delivered(inbox: queue.Queue[object], version: int, timeout_s: float) -> float:
    """Wait for the watcher to deliver `version` (or newer); returns when it did (perf_counter)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            item = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"the watcher did not deliver version {version} within {timeout_s} s") from None
        if isinstance(item, Delivered):
            # applied where a learner adopts it: its queued deltas, in place
            if isinstance(item.held.at(item.broadcast.version), Refusal):
                raise RuntimeError(f"version {item.broadcast.version} was refused where it was applied")
            if item.broadcast.version >= version:
                return time.perf_counter()
        else:
            raise RuntimeError(f"the watcher stopped: {item}")


def _upload(learner: Learner, data: bytes | bytearray | memoryview, meta: EncodedMeta) -> tuple[float, int, int]:
    """One learner's submission of `data`: (client seconds, the version it was based on, the version after it)."""
    header = submission_header(learner, meta)
    st = send_bulk(learner, header, data) if learner.bulk_address else send_stream(learner.stub, header, data)
    if st.response.outcome not in (
        coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED,
        coordinator_pb2.SUBMISSION_OUTCOME_APPLIED,
    ):
        raise RuntimeError(f"upload not accepted: {st.response}")
    return st.done - st.first, header.base_version, st.response.version


def run_one(numel: int, s: PayloadSettings, log: Log) -> dict[str, Any]:
    """One coordinator with a GPT of about `numel` parameters, `s.rounds` rounds of 2 full-size uploads."""
    cfg, numel = model_for(numel)
    with torch.device("meta"):  # the tensor layout the headers name, without allocating the model
        specs = param_specs(GPT(cfg, seed=0))
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)).mul_(1e-3)
    data, meta = get_codec(s.codec).encode(grad)  # once: every upload sends these bytes
    del grad
    flags = ["--mode", "sync", "--min-quorum", str(LEARNERS), "--expected-workers", str(LEARNERS)]
    flags += ["--eval-every", "0", "--checkpoint-dir", "", "--codec", s.codec]
    rounds: list[dict[str, Any]] = []
    watch_events: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="diloco-bench-payload-") as tmp:
        (Path(tmp) / "spill").mkdir()
        flags += ["--spill-dir", str(Path(tmp) / "spill"), "--spill-above", "0" if s.spill else "never"]
        coord = Coordinator(cfg, Path(tmp), max_bytes=200_000, shards=SHARDS, extra=flags)
        watcher: Watcher | None = None
        try:
            started = time.perf_counter()
            coord.start(s.start_timeout_s)
            start_s = time.perf_counter() - started
            rss_started = rss_bytes(coord.pid)
            peak_start = hwm_bytes(coord.pid)
            with channel(coord.address) as ch:
                stub = coordinator_pb2_grpc.CoordinatorStub(ch)
                learners = [register(stub, specs, name=f"bench-payload-{i}") for i in range(LEARNERS)]
                inbox: queue.Queue[object] = queue.Queue()
                if s.watch:
                    first = learners[0]
                    recorder = _recording_log(watch_events)
                    watcher = Watcher(stub, first.worker_id, first.epoch, numel, inbox.put, recorder)
                    _delivered(inbox, 0, s.round_timeout_s)  # version 0, a full snapshot: before the rounds
                hwm_reset = reset_hwm(coord.pid)
                for r in range(1, s.rounds + 1):
                    uploads = [_upload(lr, data, meta) for lr in learners]
                    closed_at = time.perf_counter()
                    if any(base != r - 1 for _, base, _ in uploads) or uploads[-1][2] != r:
                        raise RuntimeError(
                            f"round {r}: expected both uploads on version {r - 1} to close it: {uploads}"
                        )
                    deliver_s = _delivered(inbox, r, s.round_timeout_s) - closed_at if watcher else None
                    rounds.append({"version": r, "upload_s": [u[0] for u in uploads], "deliver_s": deliver_s})
                peak = hwm_bytes(coord.pid)
                rss_end = rss_bytes(coord.pid)
                if watcher is not None:
                    watcher.close()
                    watcher = None
            events = coord.events()
        finally:
            if watcher is not None:
                watcher.close()
            exit_code = coord.close()
    closed = {int(e["version"]): e for e in events if e.get("event") == "round.closed"}
    received = {
        int(e["version"]): e
        for e in watch_events
        if e.get("event") == "worker.broadcast_received" and e.get("delta_from") is not None
    }
    for row in rounds:
        c, w = closed.get(row["version"], {}), received.get(row["version"], {})
        row["submissions"] = c.get("submissions")
        row.update({f"{p}_s": c.get(f"{p}_s") for p in PHASES})
        row["receive_s"], row["broadcast_bytes"] = w.get("seconds"), w.get("bytes")
    result: dict[str, Any] = {
        "numel": numel,
        "model": asdict(cfg),
        "codec": s.codec,
        "upload_bytes": len(data),
        "start_s": start_s,
        "exit_code": exit_code,
        "rss_started": rss_started,
        "peak_start": peak_start,
        "peak": max(peak, peak_start),
        "peak_rounds": peak if hwm_reset else None,  # VmHWM from after start-up to the last round
        "rss_end": rss_end,
        "rounds": rounds,
        "learners_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # this process, so far
    }
    log(
        f"  {numel:,} parameters: started in {start_s:.0f} s, {len(rounds)} rounds, coordinator peak RSS "
        f"{result['peak'] / 1e9:.2f} GB"
    )
    return result


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def means(rounds: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Means over the rounds after the first (whose times include warm-up), or the only round."""
    rs = rounds[1:] or rounds
    out = {f"upload{i}_s": _mean([r["upload_s"][i] for r in rs]) for i in range(LEARNERS)}
    for key in (*(f"{p}_s" for p in PHASES), "receive_s", "deliver_s"):
        out[key] = _mean([r[key] for r in rs])
    return out


def run(s: PayloadSettings, log: Log) -> dict[str, Any]:
    check_memory(s)
    base = run_one(s.baseline_numel, s, log)
    big = run_one(s.numel, s, log)
    model_bytes = 4 * big["numel"]
    net = big["peak"] - base["peak"]
    rounds_net = None if big["peak_rounds"] is None else big["peak_rounds"] - base["peak"]
    check = {
        "name": f"coordinator at {big['numel']:,} parameters{' (--spill-above 0)' if s.spill else ''}: peak RSS "
        "over the baseline, in fp32 model sizes",
        "target": f"≤ {COORDINATOR_TARGET:g}x",
        "measured": f"{net / model_bytes:.2f}x ({net / 1e9:.2f} GB over {base['peak'] / 1e9:.2f} GB; "
        f"model {model_bytes / 1e9:.2f} GB)",
        "pass": net / model_bytes <= COORDINATOR_TARGET if big["numel"] >= JUDGED_FROM else None,
    }
    return {
        "settings": asdict(s),
        "baseline": base,
        "large": big,
        "model_bytes": model_bytes,
        "x_model": net / model_bytes,
        "x_model_rounds": None if rounds_net is None else rounds_net / model_bytes,
        "means": means(big["rounds"]),
        "checks": [check],
    }


def section(ctx: Context) -> dict[str, Any]:
    return run(QUICK if ctx.quick else FULL, ctx.log)


def markdown(r: dict[str, Any]) -> str:
    s, big, base = r["settings"], r["large"], r["baseline"]
    gb = 1e9
    watch = (
        "the first learner receives every version through the worker's `Watcher` (default broadcast codec)"
        if s["watch"]
        else "no learner receives the versions (`--no-watch`: a watcher's Θ̂, one more fp32 model size, and the "
        "encoded delta do not fit beside the coordinator on a 24 GB machine at 1B)"
    )
    head = (
        f"Command: `python -m diloco.bench.bench_payload --numel {s['numel']} --rounds {s['rounds']}"
        f"{'' if s['watch'] else ' --no-watch'}{' --spill' if s.get('spill') else ''}`. One "
        f"coordinator process (`sync` rounds, `--eval-every 0`, no checkpoints"
        f", `--spill-above {'0' if s.get('spill') else 'never'}`: uploads and the deltas it keeps held in "
        f"{'files' if s.get('spill') else 'memory'}) "
        f"holding a GPT of {big['numel']:,} "
        f"parameters ({r['model_bytes'] / gb:.2f} GB in fp32); this process is its {LEARNERS} learners: each round "
        f"both upload the same random pseudo-gradient, `{s['codec']}`-encoded once ({big['upload_bytes'] / 1e6:,.0f} "
        f"MB), one after the other on the bulk upload port; {watch}. The second upload's reply waits for its round "
        "to close. "
        f"The baseline is the same run at {base['numel']:,} parameters. Peak RSS is the coordinator's `VmHWM`."
    )
    mem = table(
        ["coordinator", "GB", "x fp32 model over the baseline"],
        [
            ["after start-up (RSS)", f"{big['rss_started'] / gb:.2f}", "-"],
            ["peak, whole run", f"{big['peak'] / gb:.2f}", f"{r['x_model']:.2f}"],
            [
                "peak during the rounds",
                "-" if big["peak_rounds"] is None else f"{big['peak_rounds'] / gb:.2f}",
                "-" if r["x_model_rounds"] is None else f"{r['x_model_rounds']:.2f}",
            ],
            ["baseline peak", f"{base['peak'] / gb:.2f}", "-"],
        ],
    )
    rows = [
        [
            str(x["version"]),
            *(_s(u) for u in x["upload_s"]),
            *(_s(x[f"{p}_s"]) for p in PHASES),
            _s(x["receive_s"]),
            _s(x["deliver_s"]),
        ]
        for x in big["rounds"]
    ]
    m = r["means"]
    rows.append(
        [
            "mean (after the first)" if len(big["rounds"]) > 1 else "mean",
            *(_s(m[f"upload{i}_s"]) for i in range(LEARNERS)),
            *(_s(m[f"{p}_s"]) for p in PHASES),
            _s(m["receive_s"]),
            _s(m["deliver_s"]),
        ]
    )
    times = table(
        [
            "round",
            "upload 1 (s)",
            "upload 2, closes the round (s)",
            "merge (s)",
            "outer step (s)",
            "broadcast encode (s)",
            "broadcast receive (s)",
            "reply to delivered (s)",
        ],
        rows,
    )
    sizes = sorted({int(x["broadcast_bytes"]) for x in big["rounds"] if x["broadcast_bytes"]})
    tail = ", ".join(f"{b / 1e6:.0f} MB" for b in sizes) or "-"
    return (
        f"{head}\n\n{mem}\n\n{times}\n\nCoordinator start-up: {big['start_s']:.0f} s. Delta broadcasts: {tail}. "
        f"This process (the learners, the payload encoded here) peaked at {big['learners_peak'] / gb:.2f} GB."
    )


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=int, default=FULL.numel, help="parameters, about (the nearest GPT shape)")
    p.add_argument("--rounds", type=int, default=FULL.rounds)
    p.add_argument("--baseline-numel", type=int, default=FULL.baseline_numel)
    p.add_argument(
        "--watch", action=argparse.BooleanOptionalAction, default=True, help="a learner receives every version"
    )
    p.add_argument(
        "--spill",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the coordinator holds uploads and broadcast deltas in files (--spill-above 0), not in memory (never)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    def go(a: argparse.Namespace, log: Log) -> dict[str, Any]:
        s = replace(FULL, numel=a.numel, rounds=a.rounds, baseline_numel=a.baseline_numel, watch=a.watch, spill=a.spill)
        return run(s, log)

    return standalone(__doc__, _flags, go, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
