"""healthd: the failure detector service. Nodes stream heartbeats; healthd declares the silent ones suspect, then
dead, and tells the coordinator so their shards move to live learners (ALGORITHM.md section 8).

- `config.py`: `HealthdConfig` and `parse(argv, env)` (flags with `DILOCO_*` fallbacks).
- `diloco/core/failure.py`: the pure detector (no gRPC, no clock reads).
- `monitor.py`: the detector behind a lock, a ticker thread that sleeps until the next deadline, logs, metrics
  and event fan-out (`hub.py`).
- `reporter.py`: a thread that tells the coordinator about dead workers (retried until delivered) and forwards
  throughput (best effort), so a slow or absent coordinator never blocks heartbeats.
- `servicer.py`: the thin gRPC layer; `server.py`: wiring and lifecycle; `__main__.py`: the process.
"""
