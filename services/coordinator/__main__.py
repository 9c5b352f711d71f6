"""`python -m services.coordinator`: run the coordinator until SIGTERM/SIGINT, then drain and checkpoint."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from diloco import log as logging
from diloco.core import parallel
from diloco.errors import ConfigError
from diloco.heap import return_freed_memory
from diloco.rpc.metrics import serve_metrics
from diloco.rpc.payload import Spill
from diloco.rpc.server import tune_gc
from diloco.signals import on_stop_signal
from services.coordinator.config import CoordinatorServiceConfig, parse
from services.coordinator.ha import HaReplica
from services.coordinator.metrics import ReplicaCollector, ReplicaRole
from services.coordinator.server import CoordinatorServer, load_carbon
from services.coordinator.standby import follower_from


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    try:
        cfg = parse(argv, env)
        load_carbon(cfg)  # a bad --carbon-trace or --carbon-provider: exit 2 before anything starts
        Spill.checked(cfg.spill_dir, cfg.spill_above)  # missing or not writable: the same
    except ConfigError as e:
        print(f"diloco coordinator: configuration error: {e}", file=sys.stderr)
        return 2
    parallel.set_threads(cfg.threads)  # torch's and the codecs' (default 1: one service per core)
    return_freed_memory()  # freed model-sized and layer-sized tensors leave the process's memory (`diloco.heap`)
    log = logging.configure("coordinator", level=cfg.log_level)
    if cfg.follow:
        return _standby(cfg, log)
    if cfg.etcd:
        return _replica(cfg, log)
    server = CoordinatorServer(cfg)
    try:
        port = server.start()
    except ConfigError as e:
        print(f"diloco coordinator: configuration error: {e}", file=sys.stderr)
        return 2
    tune_gc()
    log.info("coordinator.started", port=port, address=server.address, metrics_port=server.metrics_port)

    def stop(name: str) -> None:
        log.info("coordinator.signal", signal=name)
        server.stop()  # blocks for the grace period, on the signal's own thread

    on_stop_signal(stop, "coordinator-stop")
    server.wait()
    return 0


def _standby(cfg: CoordinatorServiceConfig, log: Any) -> int:
    """`--follow`: a hot standby of the leader at `cfg.follow` until SIGTERM/SIGINT (exit 0) or until the leader
    refuses it for good (exit 2)."""
    try:
        follower, chan = follower_from(cfg)
    except ConfigError as e:
        print(f"diloco coordinator: configuration error: {e}", file=sys.stderr)
        return 2
    registry = CollectorRegistry()
    counts = lambda: (follower.snapshots, follower.resyncs)  # noqa: E731
    registry.register(ReplicaCollector(lambda: ReplicaRole.STANDBY, follower.view, counts))
    try:
        metrics, metrics_port = serve_metrics(registry, cfg.host, cfg.metrics_port)
    except OSError as e:
        print(f"diloco coordinator: cannot serve metrics on port {cfg.metrics_port}: {e}", file=sys.stderr)
        chan.close()
        return 2

    def stop(name: str) -> None:
        log.info("coordinator.signal", signal=name)
        follower.stop()

    on_stop_signal(stop, "standby-stop")
    log.info("standby.started", leader=cfg.follow, replica_id=follower.cfg.replica_id, metrics_port=metrics_port)
    follower.start()
    follower.wait()
    chan.close()
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()
    if follower.failed:
        print(f"diloco coordinator: the leader refused this standby: {follower.failed}", file=sys.stderr)
        return 2
    return 0


def _replica(cfg: CoordinatorServiceConfig, log: Any) -> int:
    """`--etcd`: campaign; lead (serve) or follow the leader as a hot standby, and take over when it is gone.
    Exit 0 after SIGTERM/SIGINT, 3 after losing leadership (restart it: it comes back as a standby), 2 when the
    leader refuses it as a standby (another task), 4 when it cannot serve on its address (logged in one line)."""
    replica = HaReplica(cfg)

    def stop(name: str) -> None:
        log.info("coordinator.signal", signal=name)
        replica.stop()

    on_stop_signal(stop, "replica-stop")
    tune_gc()
    return replica.run()


if __name__ == "__main__":
    sys.exit(main())
