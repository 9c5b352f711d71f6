"""The GPU check: the whole system on one CUDA machine, measured.

healthd, the coordinator and 2 learners (real processes, `LocalCluster`, loopback) train a ~100M-parameter
Llama-style model (`--model hf:llama-100m`) in bf16 on the GPU(s) for a few outer steps; the check writes what
it measured to a JSON file: tokens/s per learner (what the coordinator measured from accepted submissions), an
MFU estimate (6 x parameters x tokens/s over the device's dense bf16 peak, when the device is in `PEAK_BF16`),
the GPU memory each learner process used (nvidia-smi), round times and the loss.

    bash scripts/gpu_check.sh             # or: python -m diloco.bench.gpu_check --out docs/benchmarks/gpu_check.json

Without CUDA it does nothing and says why (exit 0, nothing written), so it passes on CPU-only machines and in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from diloco.cluster import ClusterConfig, LocalCluster, seconds_until

# dense bf16 peak FLOP/s by device name fragment (vendor data sheets, without sparsity)
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}


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


def run(outer_steps: int, local_steps: int, seq_len: int, batch_size: int, model: str) -> dict[str, Any]:
    device = torch.cuda.get_device_name(0)
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory(prefix="diloco-gpu-check-") as tmp:
        cfg = ClusterConfig(
            workers=2,
            mode="decoupled",
            outer_steps=outer_steps,
            local_steps=local_steps,
            min_local_steps=max(1, local_steps // 2),
            min_quorum=1,
            run_dir=Path(tmp),
            insecure=True,
            task_args=("--model", model, "--seq-len", str(seq_len), "--batch-size", str(batch_size)),
            coordinator_args=("--eval-tokens", "65536"),
            worker_args={i: ("--device", f"cuda:{i % gpus}", "--precision", "bf16") for i in range(2)},
        )
        started = time.monotonic()
        memory: dict[str, int] = {}
        with LocalCluster(cfg) as cluster:
            cluster.start(timeout_s=600)

            def finished() -> bool:
                used = gpu_memory_mib()
                for name, proc in cluster.procs.items():
                    if proc.popen.pid in used:
                        memory[name] = max(memory.get(name, 0), used[proc.popen.pid])
                return cluster.status().finished

            seconds_until("the job to finish", finished, timeout_s=1800, interval_s=2.0)
            status = cluster.status()
            workers = cluster.workers().workers
        wall = time.monotonic() - started
    speeds = {w.worker_id: w.measured_tokens_per_s for w in workers}
    total = sum(speeds.values())
    params = _parameters(model, seq_len)
    peak = peak_flops(device)
    return {
        "device": device,
        "gpus": gpus,
        "model": model,
        "parameters": params,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "outer_steps": status.version,
        "wall_s": round(wall, 1),
        "validation_loss": status.validation_loss,
        "tokens_applied": status.tokens_applied,
        "tokens_per_s_measured": speeds,
        "tokens_per_s_total": total,
        # both learners' tokens over the peak of the GPUs they ran on (one each, or both on one)
        "mfu_estimate": 6 * params * total / (peak * min(2, gpus)) if peak else None,
        "gpu_memory_mib": memory,
        "bytes_received": status.bytes_received,
        "bytes_sent": status.bytes_sent,
    }


def _parameters(model: str, seq_len: int) -> int:
    from diloco.task.factory import TaskConfig, build_task
    from diloco.task.model import ModelConfig

    task = build_task(TaskConfig(model=ModelConfig(seq_len=seq_len), model_name=model))
    return sum(p.numel() for p in task.model_fn(0).parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/benchmarks/gpu_check.json", help="where the measured figures go")
    p.add_argument("--model", default="hf:llama-100m")
    p.add_argument("--outer-steps", type=int, default=4)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    a = p.parse_args(argv)
    why = skip_reason()
    if why:
        print(f"gpu check skipped: {why}")
        return 0
    result = run(a.outer_steps, a.local_steps, a.seq_len, a.batch_size, a.model)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
