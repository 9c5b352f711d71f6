"""A learner's upload moving to another replica (the leader a refusal names, or the next address): the first try
there is prompt (issue #14: across a takeover the upload backoff, grown while the old leader was gone, delayed the
first round by seconds). A bulk port that is gone is not a reason to move: tests/test_coordinator_bulk.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from diloco.rpc.coordinators import Coordinators
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.metrics import Metrics
from services.worker.uploader import Uploader, UploadJob
from tests.support import CoordinatorEndpoint


class Refusing(coordinator_pb2_grpc.CoordinatorServicer):
    """Refuses the first `refusals` uploads with UNAVAILABLE (`details()` names what to say), then accepts."""

    def __init__(self, refusals: int, details: Callable[[], str]) -> None:
        self.left, self.details, self.calls = refusals, details, 0

    def SubmitPseudoGradient(self, request_iterator, context):  # type: ignore[no-untyped-def]
        for _ in request_iterator:
            pass
        self.calls += 1
        if self.left > 0:
            self.left -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, self.details())
        return coordinator_pb2.SubmitPseudoGradientResponse(
            outcome=coordinator_pb2.SUBMISSION_OUTCOME_APPLIED, version=1, coordinator_epoch=4
        )


@pytest.fixture
def serve() -> Iterator[Callable[[Refusing], str]]:
    """Starts a real gRPC server for a servicer; returns its address."""
    endpoints: list[CoordinatorEndpoint] = []

    def start(servicer: Refusing) -> str:
        endpoints.append(CoordinatorEndpoint(servicer=servicer))
        return endpoints[-1].address

    yield start
    for e in endpoints:
        e.stop()


def upload(addresses: list[str], bulk_port: int = 0) -> tuple[list[dict[str, Any]], Coordinators]:
    """One upload through the leader-following client over `addresses`, as a learner makes it."""
    cfg = WorkerConfig(coordinator=",".join(addresses), retry_total_s=60.0)
    coords = Coordinators(cfg.coordinators, cfg.security, who="worker", log=structlog.get_logger)
    header = coordinator_pb2.SubmissionHeader(worker_id="w-1", submission_id="s1", base_version=0, tokens=1)
    stub = cast(coordinator_pb2_grpc.CoordinatorStub, coords)
    uploader = Uploader(
        stub, cfg, Metrics(), lambda _: None, structlog.get_logger, coords.failover, lambda: coords.address
    )
    try:
        with capture_logs() as logs:
            result = uploader.upload(UploadJob(header, b"\0" * 16, bulk_port))
    finally:
        uploader.close()
        coords.close()
    assert result.reaction is None and result.epoch == 4, result
    return logs, coords


def sleeps(logs: list[dict[str, Any]]) -> list[float]:
    return [e["sleep_s"] for e in logs if e["event"] == "worker.upload_retry"]


def test_a_move_to_another_replica_is_tried_at_once_there(serve: Callable[[Refusing], str]) -> None:
    """Two replicas that each name the other as the leader (as a standby does while the leader it names is gone):
    every refusal moves the upload, and every try after a move starts the backoff afresh. On one address that
    refuses without a name the delays grow: the same outage, seen again."""
    addresses: list[str] = []
    addresses += [serve(Refusing(3, lambda: f"not the leader; leader is at {addresses[1]}"))]
    addresses += [serve(Refusing(3, lambda: f"not the leader; leader is at {addresses[0]}"))]
    logs, coords = upload(addresses)
    assert len(sleeps(logs)) == 6 and coords.moves == 6
    assert max(sleeps(logs)) <= 0.1
    logs, coords = upload([serve(Refusing(5, lambda: "coordinator is draining"))])
    assert len(sleeps(logs)) == 5 and coords.moves == 0
    assert sleeps(logs)[-1] > 0.5
