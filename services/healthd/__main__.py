"""`python -m services.healthd`: run healthd until SIGTERM or SIGINT."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

from diloco import log as dlog
from diloco.errors import ConfigError
from diloco.rpc.server import tune_gc
from diloco.signals import on_stop_signal
from services.healthd.config import parse
from services.healthd.server import HealthdServer


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse(argv)
    except ConfigError as e:
        print(f"healthd: configuration error: {e}", file=sys.stderr)
        return 2
    log = dlog.configure("healthd", level=cfg.log_level)
    server = HealthdServer(cfg)
    stop = threading.Event()

    def on_signal(name: str) -> None:
        log.info("healthd.signal", signal=name)
        stop.set()

    on_stop_signal(on_signal, "healthd-stop")
    try:
        port = server.start()
    except OSError as e:
        log.error("healthd.start_failed", error=str(e))
        return 1
    tune_gc()
    log.info(
        "healthd.started",
        port=port,
        address=server.address,
        metrics_port=server.metrics_port,
        coordinator_address=cfg.coordinator_address or None,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        suspect_after_missed=cfg.suspect_after_missed,
        dead_after_s=cfg.dead_after_s,
    )
    stop.wait()
    server.stop()
    log.info("healthd.stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
