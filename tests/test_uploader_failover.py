"""A learner's upload moving to the leader a refusal names: the first try there is prompt (issue #14: across a
takeover the upload backoff, grown while the old leader was gone, used to delay the first round by seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.metrics import Metrics
from services.worker.uploader import ClosedChannel, Uploader, UploadJob


class Refusing(coordinator_pb2_grpc.CoordinatorServicer):
    """Refuses the first `refusals` uploads with UNAVAILABLE (`details`), then accepts."""

    def __init__(self, refusals: int, details: str) -> None:
        self.left, self.details = refusals, details

    def SubmitPseudoGradient(self, request_iterator, context):  # type: ignore[no-untyped-def]
        for _ in request_iterator:
            pass
        if self.left > 0:
            self.left -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, self.details)
        return coordinator_pb2.SubmitPseudoGradientResponse(
            outcome=coordinator_pb2.SUBMISSION_OUTCOME_APPLIED, version=1
        )


@pytest.fixture
def serve() -> Iterator[list[grpc.Server]]:
    servers: list[grpc.Server] = []
    yield servers
    for s in servers:
        s.stop(0)


def retry_sleeps(serve: list[grpc.Server], details: str, refusals: int = 5) -> list[float]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Refusing(refusals, details), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    serve.append(server)
    address = f"127.0.0.1:{port}"
    cfg = WorkerConfig(coordinator=address, retry_total_s=60.0)
    chan = grpc.insecure_channel(address)
    header = coordinator_pb2.SubmissionHeader(worker_id="w-1", submission_id="s1", base_version=0, tokens=1)
    uploader = Uploader(
        coordinator_pb2_grpc.CoordinatorStub(chan), cfg, Metrics(), lambda _: None, structlog.get_logger
    )
    try:
        with capture_logs() as logs:
            result = uploader.upload(UploadJob(header, b"\0" * 16, 0))
    finally:
        uploader.close()
        chan.close()
    assert result.reaction is None, result
    return [e["sleep_s"] for e in logs if e["event"] == "worker.upload_retry"]


def test_a_refusal_naming_the_leader_is_retried_at_once_there(serve: list[grpc.Server]) -> None:
    hinted = retry_sleeps(serve, "not the leader; leader is at 127.0.0.1:1")
    unhinted = retry_sleeps(serve, "coordinator is draining")
    assert len(hinted) == len(unhinted) == 5
    assert max(hinted) <= 0.1  # every try after a named leader starts the backoff afresh
    assert unhinted[-1] > 0.5  # without a name the delays grow: the same outage, seen again


def test_a_closed_channel_error_reads_as_unavailable_and_nothing_else_does() -> None:
    """The leader-following client closes a channel when it moves; a call already holding that channel's stub gets
    grpc's ValueError, which killed the upload thread (seen in test_ha_failover: the learner then waited for its
    upload for good). The uploader now reads it as UNAVAILABLE (`ClosedChannel`), retried at the address now
    followed; any other ValueError is raised as before. (A call on a closed channel is not made here: with this grpc
    build it can crash the test process.)"""
    e = ClosedChannel.of(ValueError("Cannot invoke RPC on closed channel!"))
    assert e.code() is grpc.StatusCode.UNAVAILABLE and "failover" in e.details()
    with pytest.raises(ValueError, match="another fault"):
        ClosedChannel.of(ValueError("not that, another fault"))
