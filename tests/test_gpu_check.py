"""scripts/gpu_check.sh on a machine without CUDA: it says why it skips, exits 0 and writes nothing (the check
itself runs only where a GPU is lent; see diloco/bench/gpu_check.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.bench.gpu_check import peak_flops

ROOT = Path(__file__).resolve().parents[1]


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
