"""The coordinator's bulk upload path, in-process on free ports: the port is advertised at registration; an
upload over it is the same upload as `SubmitPseudoGradient` (accepted, idempotent, resumable, refused with the same
statuses, nothing changed on refusal), and it checks the join token like the gRPC side."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from typing import cast

import grpc
import pytest
import structlog
import torch
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from diloco.rpc.auth import Tokens
from diloco.rpc.bulk import MAGIC, BulkError, bulk_upload
from diloco.rpc.coordinators import Coordinators
from diloco.rpc.security import SecurityConfig
from diloco.rpc.server import channel
from diloco.task.params import param_specs
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.bulk import BulkUploads
from services.coordinator.server import CoordinatorServer
from services.worker.config import WorkerConfig
from services.worker.metrics import Metrics
from services.worker.uploader import Uploader, UploadJob
from tests.proto_fuzz import garbage, mutated, mutated_bytes
from tests.support import Env, T, config, make_upload, register, wait_for

pytestmark = pytest.mark.timeout(60)
pb = coordinator_pb2


def upload(
    env: Env, reg: pb.RegisterResponse, header: pb.SubmissionHeader, data: bytes, token: bytes = b""
) -> pb.SubmitPseudoGradientResponse:
    return bulk_upload(
        f"127.0.0.1:{reg.bulk_port}",
        token,
        pb.SubmitPseudoGradientRequest(header=header),
        memoryview(data)[header.resume_offset :],
        timeout_s=T,
    )


def frozen(env: Env) -> tuple[list[float], str, int]:
    core = env.server.core
    return core.params[:64].tolist(), repr(core.ledger.snapshot()), core.version


def test_registration_advertises_the_bulk_port_and_an_upload_over_it_is_accepted(env: Env) -> None:
    a, b = register(env, "a"), register(env, "b")
    assert a.bulk_port > 0 and a.bulk_port != env.server.port
    header, data, _ = make_upload(env, a, "s1")
    resp = upload(env, a, header, data)
    assert resp.outcome == pb.SUBMISSION_OUTCOME_ACCEPTED and resp.coordinator_epoch == a.coordinator_epoch
    # the headers a learner's watch gets name the bulk port too: a leader that took it over has its own
    watch = env.stub.WatchParameters(pb.WatchParametersRequest(worker_id=a.worker_id, follow=False), timeout=T)
    first = next(iter(watch))
    assert first.header.bulk_port == a.bulk_port
    watch.cancel()
    header_b, data_b, _ = make_upload(env, b, "s2", seed=1)
    assert upload(env, b, header_b, data_b).outcome == pb.SUBMISSION_OUTCOME_APPLIED
    assert env.server.core.version == 1 and env.server.core.ledger.committed_tokens() == 256
    # idempotent: the same submission again is answered with its outcome, nothing changes
    before = frozen(env)
    assert upload(env, a, header, data).outcome in (pb.SUBMISSION_OUTCOME_ACCEPTED, pb.SUBMISSION_OUTCOME_APPLIED)
    assert frozen(env) == before


def test_the_upload_that_closes_a_round_holds_no_buffer_while_it_closes(env: Env) -> None:
    """The bulk port receives into the upload's own buffer and lets go of its views of it before `finish`, which
    folds the upload and closes the round: every upload buffer is back in the pool by the close, which lets the idle
    ones go (the close is the coordinator's peak), so none is left after the round."""
    a, b = register(env, "a"), register(env, "b")
    state = env.server.state
    header, data, _ = make_upload(env, a, "s1", codec="int8")
    assert upload(env, a, header, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED
    assert state.buffers.idle == (1, len(data))  # back in the pool once folded in
    header_b, data_b, _ = make_upload(env, b, "s2", codec="int8", seed=1)
    assert upload(env, b, header_b, data_b).outcome == pb.SUBMISSION_OUTCOME_APPLIED
    assert state.buffers.idle == (0, 0)


def test_bulk_port_off(start: Callable[..., Env]) -> None:
    env = start(bulk_port=-1)
    assert register(env).bulk_port == 0


def test_bad_uploads_get_the_grpc_statuses_and_change_nothing(env: Env) -> None:
    a = register(env, "a")
    register(env, "b")
    before = frozen(env)
    header, data, _ = make_upload(env, a, "s1")
    bad = pb.SubmissionHeader()
    bad.CopyFrom(header)
    bad.worker_id = "ghost"
    with pytest.raises(BulkError) as e:
        upload(env, a, bad, data)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    nan = torch.full((env.numel,), float("nan"))
    header_nan, data_nan, _ = make_upload(env, a, "s2", delta=nan)
    with pytest.raises(BulkError) as e:
        upload(env, a, header_nan, data_nan)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    corrupt = bytearray(data)
    corrupt[len(corrupt) // 2] ^= 0xFF
    with pytest.raises(BulkError) as e:
        upload(env, a, header, bytes(corrupt))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "crc" in e.value.details().lower()
    assert frozen(env) == before


def test_an_interrupted_bulk_upload_resumes_from_the_offset_the_coordinator_holds(env: Env) -> None:
    a = register(env, "a")
    register(env, "b")
    header, data, _ = make_upload(env, a, "s1")
    request = pb.SubmitPseudoGradientRequest(header=header).SerializeToString()
    cut = len(data) // 3
    with socket.create_connection(("127.0.0.1", a.bulk_port), timeout=T) as s:
        s.sendall(MAGIC + struct.pack(">I", 0) + struct.pack(">I", len(request)) + request + data[:cut])
    status = pb.GetUploadStatusRequest(worker_id=a.worker_id, submission_id="s1")

    def held() -> int:
        return int(env.stub.GetUploadStatus(status, timeout=T).received_bytes)

    wait_for("the coordinator to hold the bytes sent before the cut", lambda: held() == cut)
    header.resume_offset = cut
    assert upload(env, a, header, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED


def test_the_join_token_is_required_when_the_coordinator_has_tokens(env: Env) -> None:
    sec = SecurityConfig(join_token="join-secret", admin_token="admin-secret")
    handler = BulkUploads(env.server.state, env.specs, Tokens(sec.join_token, sec.admin_token))
    req = pb.SubmitPseudoGradientRequest(header=pb.SubmissionHeader())
    with pytest.raises(Exception) as missing:
        handler.open(b"", req, None)
    assert getattr(missing.value, "code", "") == "UNAUTHENTICATED"
    with pytest.raises(Exception) as wrong:
        handler.open(b"not-the-token", req, None)
    assert getattr(wrong.value, "code", "") == "UNAUTHENTICATED"
    with pytest.raises(Exception) as bad_header:  # past the token check: the header itself is refused
        handler.open(b"join-secret", req, None)
    assert getattr(bad_header.value, "code", "") == "INVALID_ARGUMENT"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_the_bulk_port_with_mutated_uploads(
    fuzz_env: tuple[Env, list[pb.RegisterResponse]], data: st.DataObject
) -> None:
    """A mutated header (one field changed), mutated payload bytes, or garbage after the magic: every answer is a
    proper status frame or a closed connection, within the deadline; the server keeps serving; parameters and the
    committed ledger change only by an accepted submission (one version, its own ranges)."""
    env, learner = fuzz_env
    if not env.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=learner[0].worker_id), timeout=T).plan.shards:
        # refused pseudo-gradients (a mutated header can decode to a finite but huge one) quarantined it and its
        # strikes moved its shards away: go on with a new incarnation
        learner[0] = register(env, "fuzz")
    reg = learner[0]
    sid = f"f{data.draw(st.integers(0, 1 << 30))}"
    header, payload, _ = make_upload(env, reg, sid, codec=data.draw(st.sampled_from(["fp32", "int8"])))
    kind = data.draw(st.sampled_from(["header", "payload", "garbage"]))
    request: Message = pb.SubmitPseudoGradientRequest(header=header)
    if kind == "header":
        request, _what = data.draw(mutated(request))
    elif kind == "payload":
        payload = data.draw(mutated_bytes(payload))
    body = request.SerializeToString() if kind != "garbage" else data.draw(garbage())
    before = frozen(env)
    with socket.create_connection(("127.0.0.1", reg.bulk_port), timeout=T) as s:
        s.settimeout(T)
        try:
            s.sendall(MAGIC + struct.pack(">I", 0) + struct.pack(">I", len(body)) + body + payload)
            s.shutdown(socket.SHUT_WR)
            answer = s.recv(1)
        except OSError:  # the server answered early and closed: fine, as long as it still serves (below)
            answer = b""
    if answer == b"\x00" and frozen(env) != before:  # accepted: a valid submission may change the state
        assert env.server.core.version in (before[2], before[2] + 1)
    elif env.server.core.version == before[2]:
        assert frozen(env) == before
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).version == env.server.core.version
    assert torch.isfinite(env.server.core.params).all()


@pytest.fixture(scope="module")
def fuzz_env() -> Iterator[tuple[Env, list[pb.RegisterResponse]]]:
    srv = CoordinatorServer(config(min_quorum=1, max_staleness=1000))
    srv.start()
    chan = channel(srv.address)
    env = Env(srv, coordinator_pb2_grpc.CoordinatorStub(chan), chan, param_specs(srv.task.model_fn(0)))
    try:
        yield env, [register(env, "fuzz")]  # the current learner (replaced when it has lost its shards)
    finally:
        chan.close()
        srv.stop(0)


def test_a_worker_whose_bulk_port_went_away_finishes_the_upload_over_the_rpc(env: Env) -> None:
    """The bulk port changes with every coordinator start; the RPC address does not. A worker whose upload to the
    advertised port fails goes on over SubmitPseudoGradient (here: accepted; after a restart: told to resync)."""
    cfg = WorkerConfig(coordinator=env.server.address, retry_total_s=10.0)
    reg = register(env, "w")
    register(env, "b")
    assert reg.bulk_port > 0
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    header, data, _ = make_upload(env, reg, "s1")
    metrics = Metrics()
    coords = Coordinators(cfg.coordinators, cfg.security, who="worker", log=structlog.get_logger)
    stub = cast(coordinator_pb2_grpc.CoordinatorStub, coords)
    uploader = Uploader(stub, cfg, metrics, lambda _: None, structlog.get_logger, coords.failover)
    try:
        with capture_logs() as logs:
            result = uploader.upload(UploadJob(header, data, dead_port))
    finally:
        uploader.close()
        coords.close()
    assert result.reaction is None and result.pending_round >= 1 and result.epoch == reg.coordinator_epoch
    assert env.server.state.upload_status(reg.worker_id, "s1") == (len(data), True)
    assert metrics.uploads.labels(outcome="accepted")._value.get() == 1
    # at once, and without moving: a refused bulk port says nothing about which replica leads (a learner taken over
    # by a new leader held the old one's port; it used to move off the leader and back on every upload)
    assert coords.moves == 0 and not [e for e in logs if e["event"] == "worker.upload_retry"]
    assert [e["port"] for e in logs if e["event"] == "worker.bulk_unavailable"] == [dead_port]
