"""The learner's control calls to the coordinator (Register, GetWorkPlan, Deregister), made from the training
loop and retried with capped, jittered backoff (`diloco.rpc.retry.retry_while`) for as long as the learner core's
status table says RETRY and the learner neither stops nor gives up. Every failure is reported to the core
(`rpc_failed`), which applies the table's reaction (re-register, resync, skip); a call that ends without a result
returns None."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import structlog

from diloco.core import learner as core
from diloco.core.coordinator import WorkPlan
from diloco.errors import InvalidArgument
from diloco.rpc.retry import Backoff, StatusError, retry_while
from diloco.rpc.vocab import power_to_proto
from diloco.task.inner import Throughput
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.power import Reading
from services.worker.session import Registration, plan_from_proto

T = TypeVar("T")
POLL_S = 0.1  # how often a backoff sleep looks at the stop request


def register_request(
    cfg: WorkerConfig, name: str, tp: Throughput | None, device_kind: str, power: Reading | None
) -> coordinator_pb2.RegisterRequest:
    """What the learner registers with: its speed so far, its power (`power.py`), zone, price and capacity."""
    return coordinator_pb2.RegisterRequest(
        worker_name=name,
        throughput=common_pb2.Throughput(
            tokens_per_s=tp.tokens_per_s if tp else 0.0,
            step_time_s=tp.step_time_s if tp else 0.0,
            device_kind=device_kind,
            watts=power.watts if power else 0.0,
            power_source=power_to_proto(power.source if power else None),
        ),
        zone=cfg.zone,
        price_per_hour=cfg.price_per_hour,
        spot=cfg.spot,
    )


class Control:
    def __init__(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        cfg: WorkerConfig,
        learner: core.LearnerCore,
        stopping: Callable[[], bool],
        log: Callable[[], structlog.stdlib.BoundLogger],
        failover: Callable[[str, str], bool] = lambda _details, _tried: False,
        address: Callable[[], str] = lambda: "",
    ) -> None:
        self.stub, self.cfg, self.learner, self.stopping, self.log = stub, cfg, learner, stopping, log
        self.failover = failover  # FAILOVER: move to another coordinator address (`rpc.coordinators`)
        self.address = address  # the coordinator address in use

    def register(
        self, name: str, tp: Throughput | None, device_kind: str, power: Reading | None = None
    ) -> Registration | None:
        req = register_request(self.cfg, name, tp, device_kind, power)

        def register() -> Registration:
            resp = self.stub.Register(req, timeout=self.cfg.rpc_timeout_s)
            try:
                return Registration.from_proto(resp)
            except InvalidArgument as e:  # a mode or codec this build does not know: retried like UNIMPLEMENTED
                raise StatusError(grpc.StatusCode.UNIMPLEMENTED, f"the coordinator's reply: {e}") from e

        return self.call(core.Rpc.REGISTER, register)

    def work_plan(self, worker_id: str) -> WorkPlan | None:
        req = coordinator_pb2.GetWorkPlanRequest(worker_id=worker_id)
        resp = self.call(core.Rpc.GET_WORK_PLAN, lambda: self.stub.GetWorkPlan(req, timeout=self.cfg.rpc_timeout_s))
        return None if resp is None else plan_from_proto(resp.plan, resp.version)

    def deregister(self, worker_id: str, reason: str = "drained") -> bool:
        """Best effort, retried until the drain deadline; True when the coordinator took it."""
        req = coordinator_pb2.DeregisterRequest(worker_id=worker_id, reason=reason)
        return (
            self.call(core.Rpc.DEREGISTER, lambda: self.stub.Deregister(req, timeout=self.cfg.rpc_timeout_s))
            is not None
        )

    def call(self, rpc: core.Rpc, fn: Callable[[], T]) -> T | None:
        """`fn()`, retried while the table says RETRY; None when it failed for good (the core has applied the
        reaction), the learner is stopping (Deregister: past the drain deadline) or gave up."""
        leaving = rpc is core.Rpc.DEREGISTER

        backoff, tried = Backoff(), [""]

        def attempt() -> T:
            tried[0] = self.address()
            return fn()

        def retry(e: grpc.RpcError) -> bool:
            now = time.monotonic()
            reaction = self.learner.rpc_failed(now, rpc, e.code().name, e.details() or "")
            if reaction is core.Reaction.FAILOVER:
                if self.failover(e.details() or "", tried[0]):
                    backoff.reset()  # another replica: the first try there is prompt, not this outage's n-th
            elif reaction is not core.Reaction.RETRY:
                self.log().warning("worker.rpc_refused", call=rpc.value, code=e.code().name, action=reaction.value)
            return reaction.retries and not self.learner.give_up_due(now)

        def wait(seconds: float) -> bool:
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                if self.stopping() and not leaving:
                    return True
                time.sleep(min(left, POLL_S))
            return leaving and time.monotonic() >= self.learner.drain_deadline

        try:
            result = retry_while(attempt, rpc.value, retry=retry, wait=wait, backoff=backoff)
        except grpc.RpcError as e:
            self.log().debug("worker.rpc_ended", call=rpc.value, code=e.code().name)
            return None
        self.learner.contact(time.monotonic())
        return result
