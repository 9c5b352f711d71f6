"""The learner's coordinator addresses (`--coordinator A,B,...`): one channel at a time, to the address in use,
and a move to another one on FAILOVER (`diloco.core.learner`: UNAVAILABLE from a coordinator call). Where it moves
is the pure `failover_target`: the leader a refusal names ("not the leader; leader is at HOST:PORT"), else the
next address round robin.

`Coordinators` stands in for a `CoordinatorStub` (every RPC attribute is the current stub's), so the control
calls, the uploader and the watcher use it unchanged; each calls `failover(details)` on a FAILOVER. Calls already
running on the old channel end CANCELLED (retried) when it is closed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from diloco.core.learner import failover_target, leader_hint
from diloco.errors import ConfigError
from diloco.v1 import coordinator_pb2_grpc
from services.worker.config import WorkerConfig

# Several threads see one outage at once (the watcher, the uploader, a control call): without a leader hint, a
# move within this long of the previous one is taken as the same outage and not made again.
MIN_DWELL_S = 0.5


class Coordinators:
    def __init__(
        self,
        cfg: WorkerConfig,
        log: Callable[[], structlog.stdlib.BoundLogger],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.addresses = cfg.coordinators
        self._cfg, self._log, self._clock = cfg, log, clock
        self._lock = threading.Lock()
        self._closed = False
        self.moves = 0
        self._switched_at = -MIN_DWELL_S
        self.address = self.addresses[0]
        self._channel = cfg.security.channel(self.address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def __getattr__(self, name: str) -> Any:  # the RPCs: the current stub's
        return getattr(self.__dict__["_stub"], name)

    def failover(self, details: str = "") -> None:
        """A coordinator call got FAILOVER: move to the leader `details` names, else to the next address."""
        with self._lock:
            if self._closed:
                return
            now = self._clock()
            target = failover_target(self.addresses, self.address, details)
            hinted = bool(leader_hint(details))
            if hinted:
                try:
                    self._cfg.security.check_client(target)  # a hint meets the rules of a configured address
                except ConfigError as e:
                    self._log().warning("worker.leader_hint_refused", address=target, error=str(e))
                    target, hinted = failover_target(self.addresses, self.address, ""), False
            if target == self.address or (not hinted and now - self._switched_at < MIN_DWELL_S):
                return
            old, previous = self._channel, self.address
            self._channel = self._cfg.security.channel(target)
            self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
            self.address, self._switched_at, self.moves = target, now, self.moves + 1
        self._log().warning("worker.coordinator_moved", previous=previous, address=target, hinted=hinted)
        old.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel: grpc.Channel = self._channel
        channel.close()
