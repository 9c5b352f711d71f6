"""The GPU check: the whole system on one CUDA machine, measured.

healthd, the coordinator and 2 learners (real processes, `LocalCluster`, loopback) train a ~100M-parameter
Llama-style model (`--model hf:llama-100m`) in bf16 on the GPU(s) for a few outer steps; the check writes what
it measured to a JSON file:

- throughput per learner, twice: what the coordinator measured from accepted submissions (end to end: the round's
  inner steps, its upload and the wait for a version included), and the tokens over the learner's inner-step
  seconds alone (`worker.round`'s `inner_s`: training only);
- an MFU estimate of each (6 x parameters x tokens/s over the dense bf16 peak of the GPUs the learners ran on, when
  the device is in `PEAK_BF16`);
- the GPU memory each learner process used (nvidia-smi, sampled while it runs) and every process's peak resident
  host memory;
- each learner's device as its heartbeats name it and the power it reported (watts and their source: `nvml` on a
  CUDA machine with `nvidia-ml-py`), with joules per token; the coordinator's energy account;
- where a round's time goes (the coordinator's merge, outer step and broadcast encode; a learner's inner steps,
  pseudo-gradient and encode, upload, receive, rebase; `bench_large.round_times`), and the loss.

    bash scripts/gpu_check.sh             # or: python -m diloco.bench.gpu_check --out docs/benchmarks/gpu_check.json

Without CUDA it does nothing and says why (exit 0, nothing written), so it passes on CPU-only machines and in CI.
`--cpu` rehearses the same check on the CPU with a tiny model, so that what it measures and writes is tested where
no GPU is (tests/test_gpu_check.py); its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from diloco.bench.bench_large import PeakRss, model_numel, read_logs, round_times
from diloco.bench.section import table
from diloco.cluster import ClusterConfig, LocalCluster, seconds_until
from diloco.rpc.vocab import POWER_SOURCES

# dense bf16 peak FLOP/s by device name fragment (vendor data sheets, without sparsity)
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}
WORKERS = 2


@dataclass(frozen=True)
class CheckSettings:
    model: str = "hf:llama-100m"
    outer_steps: int = 4
    local_steps: int = 40
    seq_len: int = 512
    batch_size: int = 16
    eval_tokens: int = 8_192  # scored once, on the last version (the coordinator evaluates on its CPU)
    device: str = "cuda"  # cuda, or cpu for the rehearsal
    island: str = ""  # ddp or fsdp: each learner a 1-rank island (torchrun's environment), NCCL on CUDA
    timeout_s: float = 1800.0


# `--cpu`: the same check on a CPU-only machine, small enough for a test
REHEARSAL = CheckSettings(
    model="hf:llama-tiny", outer_steps=2, local_steps=4, seq_len=64, batch_size=4, eval_tokens=1024, device="cpu"
)


def skip_reason() -> str:
    """Empty when this machine can run the check; else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False (a CPU-only machine or a CPU build of torch)"
    return ""


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def gpu_memory_mib() -> dict[int, int]:
    """pid -> MiB of GPU memory in use (nvidia-smi); empty when nvidia-smi is missing."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout
    used: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = int(mib)
    return used


def threads_each() -> int:
    """`--threads` of the coordinator and of each learner: a quarter of the cores each (3 processes doing
    model-sized passes share them), at least 1."""
    return max(1, (os.cpu_count() or 1) // 4)


ISLANDS = ("ddp", "fsdp")


def island_env() -> dict[str, str]:
    """The environment torchrun gives a 1-rank island (`services/worker/island.py` reads it): the learner joins a
    process group of its own (NCCL on CUDA, gloo on the CPU) on a free loopback port."""
    from services.coordinator.ha import free_port

    return {
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1"))},
    }


def run(s: CheckSettings, keep_dir: Path | None = None) -> dict[str, Any]:
    cuda = s.device == "cuda"
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    gpus = torch.cuda.device_count() if cuda else 0
    threads = threads_each()

    def worker_flags(i: int) -> tuple[str, ...]:
        if s.island:  # the island's rank picks its GPU (LOCAL_RANK), as under torchrun
            place: tuple[str, ...] = ("--device", "auto" if cuda else "cpu")
            place += ("--shard-model", "true") if s.island == "fsdp" else ()
        else:
            place = ("--device", f"cuda:{i % gpus}") if cuda else ("--device", "cpu")
        return (*place, *(("--precision", "bf16") if cuda else ()), "--threads", str(threads))

    with tempfile.TemporaryDirectory(prefix="diloco-gpu-check-") as tmp:
        run_dir = keep_dir or Path(tmp)
        cfg = ClusterConfig(
            workers=WORKERS,
            mode="decoupled",
            outer_steps=s.outer_steps,
            local_steps=s.local_steps,
            min_local_steps=max(1, s.local_steps // 2),
            min_quorum=1,
            run_dir=run_dir,
            insecure=True,
            task_args=("--model", s.model, "--seq-len", str(s.seq_len), "--batch-size", str(s.batch_size)),
            coordinator_args=(
                *("--eval-tokens", str(s.eval_tokens), "--eval-every", str(s.outer_steps)),
                *("--threads", str(threads)),
            ),
            worker_args={i: worker_flags(i) for i in range(WORKERS)},
            worker_env={i: island_env() for i in range(WORKERS)} if s.island else {},
        )
        started = time.monotonic()
        memory: dict[str, int] = {}
        with LocalCluster(cfg) as cluster:
            cluster.start(timeout_s=600)

            def finished() -> bool:
                used = gpu_memory_mib() if cuda else {}
                for name, proc in cluster.procs.items():
                    code = proc.popen.poll()
                    if code not in (None, 0):  # a learner exits 0 once the job is done; anything else is a failure
                        raise RuntimeError(f"{name} exited with code {code}; its log ends:\n{cluster.tail(name)}")
                    if proc.popen.pid in used:
                        memory[name] = max(memory.get(name, 0), used[proc.popen.pid])
                return cluster.status().finished

            with PeakRss({name: p.popen.pid for name, p in cluster.procs.items()}) as rss:
                seconds_until("the job to finish", finished, timeout_s=s.timeout_s, interval_s=2.0)
            wall = time.monotonic() - started
            status = cluster.final_status()
            workers = cluster.workers().workers
            logs = read_logs(cluster)
    coordinator_s, learner_s = round_times(logs)
    params = model_numel(s.model, s.seq_len)
    peak = peak_flops(device)
    learners: dict[str, dict[str, Any]] = {}
    for w in workers:
        inner_s = sum(
            float(f.get("inner_s", 0.0)) for f in logs.get(w.worker_name, ()) if f.get("event") == "worker.round"
        )
        tp = w.throughput
        joined = [f for f in logs.get(w.worker_name, ()) if f.get("event") == "island.joined"]
        learners[w.worker_name] = {
            "device_kind": tp.device_kind,
            # the process group it joined, as its log says (None: not an island)
            "island": {k: joined[-1].get(k) for k in ("backend", "world", "sharded", "device")} if joined else None,
            "tokens": w.tokens,
            "tokens_per_s_measured": round(w.measured_tokens_per_s, 1),
            "tokens_per_s_inner": round(w.tokens / inner_s, 1) if inner_s > 0 else None,
            "watts": round(tp.watts, 1),
            "power_source": POWER_SOURCES.from_proto(tp.power_source).value if tp.power_source else "",
            "joules_per_token": (tp.watts / w.measured_tokens_per_s) if tp.watts and w.measured_tokens_per_s else None,
            "gpu_memory_mib": memory.get(w.worker_name),
        }
    end_to_end = sum(x["tokens_per_s_measured"] for x in learners.values())
    inner = sum(x["tokens_per_s_inner"] or 0.0 for x in learners.values())
    # both learners' tokens over the peak of the GPUs they ran on (one each, or both on one)
    peak_total = peak * min(WORKERS, gpus) if peak and cuda else None
    return {
        "device": device,
        "gpus": gpus,
        # learners sharing one GPU each report its whole draw (NVML measures a GPU, not a process)
        "learners_per_gpu": WORKERS / gpus if gpus else None,
        "torch": torch.__version__,
        "model": s.model,
        "island": s.island or None,
        "parameters": params,
        "seq_len": s.seq_len,
        "batch_size": s.batch_size,
        "local_steps": s.local_steps,
        "threads_each": threads,
        "outer_steps": status.version,
        "wall_s": round(wall, 1),
        "validation_loss": status.validation_loss,
        "tokens_applied": status.tokens_applied,
        "learners": learners,
        "tokens_per_s_total": round(end_to_end, 1),
        "tokens_per_s_inner_total": round(inner, 1),
        "mfu_estimate": 6 * params * end_to_end / peak_total if peak_total else None,
        "mfu_inner_estimate": 6 * params * inner / peak_total if peak_total else None,
        "peak_rss_bytes": rss.peaks,
        "coordinator_round_s": coordinator_s,
        "learner_round_s": learner_s,
        "energy_kwh": status.energy_kwh,
        "bytes_received": status.bytes_received,
        "bytes_sent": status.bytes_sent,
    }


def markdown(r: dict[str, Any]) -> str:
    """The check's JSON (`--out`) as the benchmark report shows it."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def mfu(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    m = r.get("measured", {})
    island = f"each learner a 1-rank {r['island'].upper()} island (torchrun's environment), " if r.get("island") else ""
    precision = "bf16 autocast" if r["gpus"] else "fp32 (the CPU rehearsal)"  # as `run` starts the learners
    learners = r["learners"]
    rows = [
        [
            name,
            w["device_kind"],
            f"{w['tokens']:,}",
            num(w["tokens_per_s_measured"], ",.0f"),
            num(w["tokens_per_s_inner"], ",.0f"),
            f"{w['watts']:,.0f} W ({w['power_source'] or 'none'})",
            num(w["joules_per_token"] and 1000 * w["joules_per_token"], ".2f"),
            num(w["gpu_memory_mib"], ","),
            f"{r['peak_rss_bytes'].get(name, 0) / 1e9:.2f}",
        ]
        for name, w in sorted(learners.items())
    ]
    phases = ", ".join(f"{k} {num(v, '.3f')} s" for k, v in r["learner_round_s"].items())
    coordinator = ", ".join(f"{k} {num(v, '.3f')} s" for k, v in r["coordinator_round_s"].items())
    shared = (
        f" The {len(learners)} learners share {r['gpus']} GPU(s): each one's NVML watts are its GPU's whole draw, "
        "so joules per token count a shared GPU's energy once per learner on it."
        if (r.get("learners_per_gpu") or 0) > 1
        else ""
    )
    return "\n".join(
        [
            f"Measured at commit `{str(m.get('commit'))[:10]}`, {m.get('date', '?')}: {r['device']} x{r['gpus']}, "
            f"torch {r['torch']}. `{r['model']}` ({r['parameters']:,} parameters), seq {r['seq_len']} x batch "
            f"{r['batch_size']}, H = {r['local_steps']}, {precision}, {island}decoupled rounds; "
            f"{r['outer_steps']} outer steps in {r['wall_s']} s (start-up included), validation loss "
            f"{num(r['validation_loss'], '.3f')}, "
            f"{r['tokens_applied']:,} tokens applied. Regenerate on a CUDA machine: `bash scripts/gpu_check.sh` "
            "(writes `docs/benchmarks/gpu_check.json`; then `diloco bench --report-only`).",
            "",
            table(
                [
                    "learner",
                    "device (heartbeats)",
                    "tokens",
                    "tokens/s (coordinator)",
                    "tokens/s (inner steps)",
                    "power",
                    "mJ/token",
                    "GPU MiB",
                    "host peak RSS GB",
                ],
                rows,
            ),
            "",
            f"- MFU estimate (6 x parameters x tokens/s over {r['gpus']} GPU's dense bf16 peak): "
            f"{mfu(r['mfu_estimate'])} end to end, {mfu(r['mfu_inner_estimate'])} over inner-step time.{shared}",
            f"- A learner's round (means after the first): {phases}. The coordinator's: {coordinator}.",
            f"- Coordinator peak RSS {r['peak_rss_bytes'].get('coordinator', 0) / 1e9:.2f} GB; bytes received "
            f"{r['bytes_received'] / 1e6:,.0f} MB, sent {r['bytes_sent'] / 1e6:,.0f} MB.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    d = CheckSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/benchmarks/gpu_check.json", help="where the measured figures go")
    p.add_argument("--model", default=None, help=f"default {d.model} ({REHEARSAL.model} with --cpu)")
    p.add_argument("--outer-steps", type=int, default=None, help=f"default {d.outer_steps}")
    p.add_argument("--local-steps", type=int, default=None, help=f"default {d.local_steps}")
    p.add_argument("--seq-len", type=int, default=None, help=f"default {d.seq_len}")
    p.add_argument("--batch-size", type=int, default=None, help=f"default {d.batch_size}")
    p.add_argument(
        "--island",
        choices=ISLANDS,
        default=None,
        help="each learner a 1-rank island (torchrun's environment; NCCL on CUDA): ddp, or fsdp (--shard-model)",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="keep the services' logs here (default: deleted)")
    p.add_argument("--cpu", action="store_true", help="rehearse the check on the CPU with a tiny model (tests)")
    a = p.parse_args(argv)
    s = REHEARSAL if a.cpu else d
    given = {
        k: v
        for k, v in (
            ("model", a.model),
            ("outer_steps", a.outer_steps),
            ("local_steps", a.local_steps),
            ("seq_len", a.seq_len),
            ("batch_size", a.batch_size),
            ("island", a.island),
        )
        if v is not None
    }
    for flag in ("outer_steps", "local_steps", "seq_len", "batch_size"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:  # 0 outer steps would be a job without end
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(a, flag)}")
    s = replace(s, **given)
    why = "" if a.cpu else skip_reason()
    if why:
        print(f"gpu check skipped: {why}")
        return 0
    from diloco.bench.suite import now, provenance

    result = {"measured": {**provenance(), "date": now()}, **run(s, a.run_dir)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
