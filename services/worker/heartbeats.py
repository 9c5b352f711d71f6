"""Heartbeats to healthd: one per interval with the measured throughput, from a thread that never blocks
training. A DEAD verdict in a reply means the coordinator was told to drop this learner: the worker registers
again. `leave(worker_id)` sends one last heartbeat that says the node is leaving, so healthd reports it LEFT, not
DEAD; `left` is set once healthd answered it (or at once when there is no healthd to tell). Each reply also names
the newest coordinator leader announced to healthd (epoch and address), handed to `on_leader`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import structlog

from diloco.core.failure import NodeState
from diloco.errors import ConfigError, InvalidArgument
from diloco.rpc.retry import Backoff, BackoffConfig
from diloco.rpc.vocab import NODE_STATES, power_to_proto
from diloco.v1 import common_pb2, healthd_pb2, healthd_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.power import Reading
from services.worker.session import SessionLost


@dataclass(frozen=True)
class Beat:
    """What a heartbeat reports, read from the worker when it is sent."""

    worker_id: str
    version: int
    steps_done: int
    tokens_per_s: float
    step_time_s: float
    device_kind: str
    power: Reading | None = None  # watts while training and their source (`power.py`); None: none to report


class Heartbeats:
    def __init__(
        self,
        cfg: WorkerConfig,
        view: Callable[[], Beat | None],
        post: Callable[[object], None],
        log: Callable[[], structlog.stdlib.BoundLogger],
        on_leader: Callable[[int, str], None] = lambda epoch, address: None,
    ) -> None:
        self.cfg, self.view, self.post, self.log, self.on_leader = cfg, view, post, log, on_leader
        self.address = cfg.healthd  # else the one the coordinator names (set after Register)
        self.left = threading.Event()
        self._leaving = ""  # the worker id that leaves
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def leave(self, worker_id: str) -> None:
        """Send the leaving heartbeat of `worker_id` now; `left` is set when healthd has it."""
        self._leaving = worker_id
        if not self.address:
            self.left.set()
        self._wake.set()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = Backoff(BackoffConfig(initial_s=0.2, max_s=2.0))
        chan: grpc.Channel | None = None
        while not self._closed.is_set():
            beat = self.view()
            if not self.address or beat is None or self.left.is_set():
                self._wake.wait(0.2)
                self._wake.clear()
                continue
            if chan is None:
                try:
                    chan = self.cfg.security.channel(self.address)
                except ConfigError as e:  # e.g. plaintext to a healthd that is not on loopback
                    self.log().error("worker.heartbeat_config", error=str(e))
                    self.left.set()
                    self._closed.wait(5.0)
                    continue
            try:
                for resp in healthd_pb2_grpc.HealthDaemonStub(chan).Heartbeat(self._beats(beat.worker_id)):
                    backoff.reset()
                    if resp.leader_epoch:
                        self.on_leader(resp.leader_epoch, resp.leader_address)
                    try:
                        state = NODE_STATES.from_proto(resp.state)
                    except InvalidArgument as e:
                        self.log().error("worker.heartbeat_reply", error=str(e))
                        continue
                    if state is NodeState.LEFT:
                        self.left.set()
                    elif state is NodeState.DEAD and self._leaving != beat.worker_id:
                        self.log().warning("worker.declared_dead")
                        self.post(SessionLost(beat.worker_id, "declared dead by healthd"))
                        break
            except grpc.RpcError as e:
                if not self._closed.is_set():
                    self.log().debug("worker.heartbeat_retry", code=e.code().name)
                self._closed.wait(backoff.next_s(e))
        if chan is not None:
            chan.close()

    def _beats(self, worker_id: str) -> Iterator[healthd_pb2.HeartbeatRequest]:
        """One heartbeat per interval while `worker_id` is the worker's registration; the leaving one ends it."""
        seq = 0
        while not self._closed.is_set():
            beat = self.view()
            if beat is None or beat.worker_id != worker_id:
                return  # a new registration: a new stream under the new id
            seq += 1
            leaving = self._leaving == worker_id
            yield healthd_pb2.HeartbeatRequest(
                node_id=worker_id,
                role=healthd_pb2.NODE_ROLE_WORKER,
                sequence=seq,
                throughput=common_pb2.Throughput(
                    tokens_per_s=beat.tokens_per_s,
                    step_time_s=beat.step_time_s,
                    device_kind=beat.device_kind,
                    watts=beat.power.watts if beat.power else 0.0,
                    power_source=power_to_proto(beat.power.source if beat.power else None),
                ),
                version=max(0, beat.version),
                steps_done=beat.steps_done,
                leaving=leaving,
            )
            if leaving:
                return
            self._wake.wait(self.cfg.heartbeat_interval_s)  # wakes at once when the worker leaves
            self._wake.clear()
