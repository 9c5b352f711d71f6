"""Benchmarks. `bench_core.py` and `bench_upload.py` are standalone scripts; the suite behind `diloco bench`
(`suite.py`, `settings.py`, `sim_bench.py`, `cluster_bench.py`, `report.py`, `run_all.py`) writes the report in
`docs/benchmarks/`."""
