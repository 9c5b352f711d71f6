"""scripts/gpu_check.sh on a machine without CUDA: it says why it skips, exits 0 and writes nothing (the check
itself runs only where a GPU is lent; see diloco/bench/gpu_check.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.bench.gpu_check import markdown, peak_flops

ROOT = Path(__file__).resolve().parents[1]


def cpu_check(out: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python -m diloco.bench.gpu_check --cpu --out OUT ARGS` in a clean environment, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "diloco.bench.gpu_check", "--cpu", "--out", str(out), *args],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run for real")
def test_the_gpu_check_skips_with_a_reason_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(out)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "gpu check skipped: no CUDA device" in proc.stdout
    assert not out.exists()


def test_peak_flops_by_device_name() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Future Accelerator") is None


@pytest.mark.slow
@pytest.mark.parametrize("island", ["", "fsdp"])
def test_the_cpu_rehearsal_measures_and_writes_every_figure(tmp_path: Path, island: str) -> None:
    """`--cpu` runs the same check (healthd, the coordinator, 2 learners, a tiny model on the CPU) end to end, so
    what the GPU run measures and writes is exercised where there is no GPU; `--island fsdp` makes each learner a
    1-rank island (torchrun's environment, one per learner) that shards its model."""
    out = tmp_path / "gpu.json"
    proc = cpu_check(out, *(("--island", island) if island else ()), timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["device"], r["gpus"], r["model"], r["outer_steps"]) == ("cpu", 0, "hf:llama-tiny", 2)
    assert r["island"] == (island or None)
    assert r["parameters"] > 100_000 and math.isfinite(r["validation_loss"])
    assert sorted(r["learners"]) == ["worker0", "worker1"]
    for w in r["learners"].values():
        assert w["device_kind"] == "cpu" and w["tokens"] > 0 and w["tokens_per_s_measured"] > 0
        assert w["tokens_per_s_inner"] > 0 and w["gpu_memory_mib"] is None
        joined = {"backend": "gloo", "world": 1, "sharded": True, "device": "cpu"} if island else None
        assert w["island"] == joined
    assert r["tokens_applied"] == sum(w["tokens"] for w in r["learners"].values())
    assert r["mfu_estimate"] is None  # no peak for a CPU
    assert set(r["peak_rss_bytes"]) == {"healthd", "coordinator", "worker0", "worker1"}
    assert r["coordinator_round_s"]["merge"] is not None and r["learner_round_s"]["inner"] > 0
    assert r["bytes_received"] > 0 and r["bytes_sent"] > 0
    assert r["measured"]["commit"] and r["measured"]["date"]
    shown = markdown(r)  # as the benchmark report shows it
    assert "| worker0 | cpu |" in shown and "0 W (none)" in shown and "MFU estimate" in shown
    assert "fp32 (the CPU rehearsal)" in shown and "bf16 autocast" not in shown


@pytest.mark.parametrize("flag", ["--outer-steps", "--local-steps", "--seq-len", "--batch-size"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_sizes_below_one_exit_2_naming_the_flag(flag: str, value: str, tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = cpu_check(out, flag, value, timeout_s=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{flag} must be at least 1, got {value}" in proc.stderr
    assert not out.exists()
