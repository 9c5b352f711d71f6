"""The coordinator's bulk upload path, in-process on free ports: the port is advertised at registration; an
upload over it is the same upload as `SubmitPseudoGradient` (accepted, idempotent, resumable, refused with the same
statuses, nothing changed on refusal), and it checks the join token like the gRPC side."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import grpc
import pytest
import torch

from diloco.rpc.auth import Tokens
from diloco.rpc.bulk import MAGIC, BulkError, bulk_upload
from diloco.rpc.security import SecurityConfig
from diloco.v1 import coordinator_pb2
from services.coordinator.bulk import BulkUploads
from tests.test_coordinator_service import Env, T, env, make_upload, register, start, wait_for

__all__ = ["env", "start"]  # fixtures

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
    assert resp.outcome == pb.SUBMISSION_OUTCOME_ACCEPTED
    header_b, data_b, _ = make_upload(env, b, "s2", seed=1)
    assert upload(env, b, header_b, data_b).outcome == pb.SUBMISSION_OUTCOME_APPLIED
    assert env.server.core.version == 1 and env.server.core.ledger.committed_tokens() == 256
    # idempotent: the same submission again is answered with its outcome, nothing changes
    before = frozen(env)
    assert upload(env, a, header, data).outcome in (pb.SUBMISSION_OUTCOME_ACCEPTED, pb.SUBMISSION_OUTCOME_APPLIED)
    assert frozen(env) == before


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
        handler.open(b"", req)
    assert getattr(missing.value, "code", "") == "UNAUTHENTICATED"
    with pytest.raises(Exception) as wrong:
        handler.open(b"not-the-token", req)
    assert getattr(wrong.value, "code", "") == "UNAUTHENTICATED"
    with pytest.raises(Exception) as bad_header:  # past the token check: the header itself is refused
        handler.open(b"join-secret", req)
    assert getattr(bad_header.value, "code", "") == "INVALID_ARGUMENT"
