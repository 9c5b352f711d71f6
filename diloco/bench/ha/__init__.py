"""The parts of the coordinator high-availability benchmark; `diloco.bench.bench_ha` is its entry (the section,
the profiles and the module run on its own) and its docstring says what is measured and how.

- `settings.py`: the settings of the soak and of the cost runs, the kill points, the targets.
- `supervisor.py`: etcd, healthd, two coordinator replicas and the learners as real processes; the supervisor
  that reads every log into each replica's state and starts again a replica that ended.
- `soak.py`: the leader-kill soak driven on that supervisor, and the invariants checked at its end.
- `cost.py`: the cost of synchronous replication: the same `sync` job with one coordinator and with two replicas.
- `summary.py`: the figures of a run (recovery times, throughput, lag) and the checks against the targets.
- `report.py`: the section's Markdown.
"""
