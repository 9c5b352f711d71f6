"""Benchmarks, part of the package: `diloco bench` (= `python -m diloco.bench.run_all`, from any directory) runs
the suite and writes the report in `docs/benchmarks/` and the generated blocks of the repository README.

- `suite.py`: `SECTIONS`, the registry (report order), and the runner that records where each section was
  measured (commit, dirty flag, date, machine); `section.py`: how a module joins the registry.
- sections: `sim_bench.py` (time to target, scale, compression, outer optimizers, batch layout),
  `cluster_bench.py` (the real cluster), `startup_bench.py` (process start to serving), `bench_core.py` (outer
  step, codecs), `bench_upload.py` (a pseudo-gradient into the coordinator), `bench_control.py` (GetStatus
  latency while a round closes); `settings.py` (the simulator and cluster settings), `seeds.py` (mean and spread
  over seeds, and the one rule by which a seeded target passes), `report.py` (Markdown and plots from
  `results.json` alone).
- the section modules but `sim_bench` and `cluster_bench` (and `bench_bulk`, outside the suite) also run on their
  own, all through one entry (`section.standalone`: the module's flags and `--json`, torch on the suite's one
  thread, progress on stderr): `python -m diloco.bench.bench_core --help`.

Nothing here imports `diloco.cli`; the CLI imports this package only when `diloco bench` runs.
"""
