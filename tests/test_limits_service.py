"""Limits and robust merge through a real gRPC channel: oversize and too many concurrent uploads get
RESOURCE_EXHAUSTED; an outlier pseudo-gradient is refused, its learner quarantined (visible in ListWorkers) and
released by ReleaseWorker. Each refusal leaves the parameters and the ledger as they were."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from diloco.rpc.server import MAX_MESSAGE_BYTES
from diloco.v1 import common_pb2
from tests.support import Env, T, code_of, frozen, gauge, make_upload, pb, register, requests, submit, wait_for

pytestmark = pytest.mark.timeout(60)
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def test_upload_larger_than_the_model_allows_is_refused_before_buffering(start: Callable[..., Env]) -> None:
    env = start(max_upload_bytes=1024)
    reg = register(env)
    h, data, _ = make_upload(env, reg, "big")  # fp32: 4 bytes per parameter, far above 1 KiB
    before = frozen(env)
    code, details = code_of(lambda: submit(env, h, data))
    assert code == EXHAUSTED and "limit of 1024 bytes" in details
    assert gauge(env, "partial_uploads") == 0
    params, ledger, version = frozen(env)
    assert (params.equal(before[0]), ledger, version) == (True, before[1], before[2])


def test_a_message_above_the_grpc_limit_is_refused(start: Callable[..., Env]) -> None:
    env = start()
    reg = register(env)
    h, _, _ = make_upload(env, reg, "huge")
    msgs = [
        pb.SubmitPseudoGradientRequest(header=h),
        pb.SubmitPseudoGradientRequest(data=b"\0" * (MAX_MESSAGE_BYTES + 1)),
    ]
    code, _ = code_of(lambda: env.stub.SubmitPseudoGradient(iter(msgs), timeout=T))
    assert code == EXHAUSTED


def test_too_many_concurrent_uploads_from_one_worker(start: Callable[..., Env]) -> None:
    env = start(max_uploads_per_worker=2)
    reg = register(env)
    before = frozen(env)
    hold = threading.Event()
    futures = []
    for i in range(2):
        h, data, _ = make_upload(env, reg, f"u{i}", seed=i)
        msgs = requests(h, data)[:2]  # the header and one chunk, then the stream stays open

        def stalled(msgs: list[pb.SubmitPseudoGradientRequest] = msgs) -> Iterator[pb.SubmitPseudoGradientRequest]:
            yield from msgs
            hold.wait(30)

        futures.append(env.stub.SubmitPseudoGradient.future(stalled(), timeout=30))
    wait_for("two uploads in flight", lambda: gauge(env, "partial_uploads") == 2)
    h3, data3, _ = make_upload(env, reg, "u3", seed=3)
    code, details = code_of(lambda: submit(env, h3, data3))
    assert code == EXHAUSTED and "limit is 2 concurrent uploads per worker" in details
    params, ledger, version = frozen(env)
    assert params.equal(before[0]) and ledger == before[1] and version == before[2]
    # the streams break: their partial uploads are kept for a resume, but no longer block new ones
    for f in futures:
        f.cancel()
    hold.set()
    wait_for("streams to end", lambda: gauge(env, "streaming_uploads") == 0)
    assert submit(env, h3, data3).outcome == pb.SUBMISSION_OUTCOME_APPLIED  # the oldest idle one was evicted
    assert gauge(env, "partial_uploads") <= 2
    assert env.server.metrics.registry.get_sample_value("diloco_coordinator_uploads_evicted_total") == 1.0
    assert len(requests(h3, data3)) > 2  # the payload spans several chunks (CHUNK bytes each)


def test_outlier_is_refused_quarantined_listed_and_released(start: Callable[..., Env]) -> None:
    env = start(outlier_factor=10.0, outlier_min_samples=2, expected_workers=3, min_quorum=3)
    a, b, m = register(env, "a"), register(env, "b"), register(env, "m")

    def small(seed: int) -> torch.Tensor:
        # 1e-4 per parameter and step: x30 is an outlier against the median yet under the AdamW ceiling (lr 3e-3)
        return torch.randn(env.numel, generator=torch.Generator().manual_seed(seed)) * 1e-4

    for reg, seed in ((a, 1), (b, 2)):
        h, data, _ = make_upload(env, reg, f"{reg.worker_id}-1", delta=small(seed))
        assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED
    delta = small(3)
    hb, data_bad, _ = make_upload(env, m, "m-1", delta=delta * 30)
    before = frozen(env)
    code, details = code_of(lambda: submit(env, hb, data_bad))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "quarantined" in details and "median" in details
    params, ledger, version = frozen(env)
    assert params.equal(before[0]) and ledger == before[1] and version == before[2]
    infos = {w.worker_id: w for w in env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers}
    assert infos[m.worker_id].state == common_pb2.WORKER_STATE_QUARANTINED
    assert "refused" in infos[m.worker_id].state_reason
    assert infos[a.worker_id].state == common_pb2.WORKER_STATE_ACTIVE
    reg_ = env.server.metrics.registry
    assert reg_.get_sample_value("diloco_coordinator_quarantines_total") == 1.0
    assert reg_.get_sample_value("diloco_coordinator_quarantined_workers") == 1.0
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).rejected_submissions == 1
    released = env.stub.ReleaseWorker(pb.ReleaseWorkerRequest(worker_id=m.worker_id), timeout=T)
    assert released.state == common_pb2.WORKER_STATE_ACTIVE
    assert reg_.get_sample_value("diloco_coordinator_quarantined_workers") == 0.0
    # the refused range was not accepted: the same range again, clean, closes the round
    h2, data2, _ = make_upload(env, m, "m-2", delta=delta)
    assert h2.ranges[0].start == hb.ranges[0].start
    assert submit(env, h2, data2).outcome == pb.SUBMISSION_OUTCOME_APPLIED
