#!/usr/bin/env bash
# The GPU check (issue #12): healthd, the coordinator and 2 learners training a ~100M-parameter Llama-style model in
# bf16 on this machine's GPU(s); writes throughput, an MFU estimate and memory to docs/benchmarks/gpu_check.json.
# On a machine without CUDA it prints why it skipped and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m diloco.bench.gpu_check "$@"
