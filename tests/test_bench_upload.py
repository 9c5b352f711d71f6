"""`python -m diloco.bench.bench_upload` at a tiny size, so the benchmark cannot rot: it starts a real coordinator,
uploads fp32 and int8 pseudo-gradients through it, and reaps every child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_bench_upload_runs_at_a_tiny_size(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.bench.bench_upload", "--params", "200000", "--repeats", "1", "--json"],
        cwd=tmp_path,  # any directory: the benchmark is part of the package
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["coordinator"]["exit_code"] == 0
    assert doc["model"]["numel"] > 0
    assert doc["tcp"]["gb_per_s"] > 0
    assert [g["codec"] for g in doc["grpc"]] == ["fp32", "int8"]
    for g in doc["grpc"]:
        assert g["rpc_gb_per_s"] > 0 and g["upload_s"] > 0
    assert [(b["path"], b["codec"]) for b in doc["bulk"]] == [("bulk", "fp32"), ("bulk", "int8")]
    for b in doc["bulk"]:
        assert b["rpc_gb_per_s"] > 0 and b["upload_s"] > 0
    # every upload (fp32 over gRPC and the bulk port, then int8 over both) closed one round, in order
    assert [(u["path"], u["codec"]) for u in doc["uploads"]] == [
        ("grpc", "fp32"),
        ("bulk", "fp32"),
        ("grpc", "int8"),
        ("bulk", "int8"),
    ]
    assert [u["version"] for u in doc["uploads"]] == [1, 2, 3, 4]
    assert doc["grpc"][0]["payload_bytes"] == 4 * doc["model"]["numel"]
    assert {s["name"] for s in doc["sink"]} >= {"gRPC sink + decode fp32", "gRPC sink + decode int8"}
    assert any(b["stage"].startswith("accept + round close") for b in doc["breakdown"])
    assert isinstance(doc["target"]["rpc_met"], bool) and isinstance(doc["target"]["bulk_upload_met"], bool)
