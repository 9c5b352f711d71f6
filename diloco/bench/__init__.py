"""Benchmarks, part of the package: `diloco bench` (= `python -m diloco.bench.run_all`) runs the suite
(`suite.py`: the registry of sections; `section.py`: how a module joins it; `settings.py`; `report.py`) and writes
the report in `docs/benchmarks/`. `bench_core`, `bench_upload` and `bench_bulk` also run on their own:
`python -m diloco.bench.bench_core --help`. Nothing here imports `diloco.cli`."""
