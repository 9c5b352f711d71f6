"""The coordinator service in-process on port 0, through a real gRPC channel: registration, parameter streams,
uploads (happy path, every kind of bad input, idempotency, resume), checkpoints and the operator RPCs."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.core.codecs import get_codec
from diloco.errors import ConfigError
from diloco.rpc.payload import NEVER, PayloadReceiver, meta_from_proto
from diloco.rpc.server import channel
from diloco.task.data import evaluate
from diloco.task.params import load_flat_
from diloco.v1 import common_pb2, coordinator_pb2_grpc
from services.coordinator import checkpoint
from services.coordinator.__main__ import main
from services.coordinator.config import CoordinatorServiceConfig, CrashFault, parse
from tests.support import (
    CHUNK,
    Clock,
    Env,
    T,
    code_of,
    frozen,
    gauge,
    make_upload,
    pb,
    register,
    requests,
    submit,
    tiny_task,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)


def fetch_params(env: Env, after: int = 0) -> tuple[pb.ParametersHeader, torch.Tensor]:
    msgs = list(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=after), timeout=T))
    header = msgs[0].header
    receiver = PayloadReceiver(meta_from_proto(header.payload), env.numel)
    for m in msgs[1:]:
        receiver.feed(m.data)
    return header, receiver.finish()


def assert_unchanged(env: Env, before: tuple[torch.Tensor, bytes, int]) -> None:
    params, ledger, version = frozen(env)
    assert torch.equal(params, before[0]) and ledger == before[1] and version == before[2]
    assert env.server.core.acc.count == 0


# --- registration and parameters ----------------------------------------------------------------------------------
def test_register_returns_id_plan_and_settings(env: Env) -> None:
    reg = register(env)
    assert reg.worker_id and reg.coordinator_epoch > 0 and reg.version == 0
    assert len(reg.plan.shards) == 8 and reg.plan.local_steps == 30 and reg.plan.plan_seq >= 1
    assert reg.mode == pb.ROUND_MODE_DECOUPLED and reg.codec == common_pb2.CODEC_INT8
    assert reg.task_json == tiny_task().to_json() and '"batch_size": 4' in reg.task_json
    # an empty fingerprint means "send me the task": the learner adopts task_json
    assert env.stub.Register(pb.RegisterRequest(worker_name="observer-ish"), timeout=T).worker_id


def test_register_refuses_another_model_and_bad_names(env: Env) -> None:
    code, details = code_of(
        lambda: env.stub.Register(pb.RegisterRequest(worker_name="w", model_fingerprint="0" * 16), timeout=T)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "task_json" in details
    code, _ = code_of(lambda: env.stub.Register(pb.RegisterRequest(worker_name=""), timeout=T))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert not env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers


def test_health_and_reflection_are_served(env: Env) -> None:
    health = health_pb2_grpc.HealthStub(env.chan)
    resp = health.Check(health_pb2.HealthCheckRequest(service="diloco.v1.Coordinator"), timeout=T)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_watch_parameters_streams_version_zero_then_each_new_version(env: Env) -> None:
    header, params = fetch_params(env)
    assert header.version == 0 and header.coordinator_epoch == env.server.state.epoch
    assert [t.name for t in header.payload.tensors] == [s.name for s in env.specs]
    assert torch.equal(params, env.server.core.params)
    reg = register(env)
    call = env.stub.WatchParameters(pb.WatchParametersRequest(worker_id=reg.worker_id, follow=True), timeout=30)
    stream = iter(call)
    first = next(stream)
    assert first.header.version == 0 and len(first.header.plan.shards) == 8
    receiver = PayloadReceiver(meta_from_proto(first.header.payload), env.numel)
    while receiver.received < receiver.meta.encoded_bytes:
        receiver.feed(next(stream).data)
    h, data, _ = make_upload(env, reg, "s1")
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_APPLIED
    second = next(stream)
    assert second.header.version == 1 and list(second.header.applied_submission_ids) == ["s1"]
    assert second.header.plan.shards[0].cursor == h.ranges[0].end
    call.cancel()
    # not following: nothing newer than the current version means an empty stream
    assert not list(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=1), timeout=T))
    code, _ = code_of(
        lambda: list(env.stub.WatchParameters(pb.WatchParametersRequest(worker_id="nobody-9"), timeout=T))
    )
    assert code == grpc.StatusCode.NOT_FOUND


def test_stop_ends_following_parameter_streams(env: Env) -> None:
    call = env.stub.WatchParameters(pb.WatchParametersRequest(follow=True), timeout=30)
    got = list(itertools.islice(call, 2))  # header and the one data chunk of version 0
    assert got[0].header.version == 0
    env.server.stop(5.0)
    assert list(call) == [] and call.code() == grpc.StatusCode.OK
    health = health_pb2_grpc.HealthStub(env.chan)
    assert code_of(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=T))[0] == grpc.StatusCode.UNAVAILABLE


# --- submissions --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("codec", "spill"), [("fp32", False), ("int8", False), ("int8", True)])
def test_submission_closes_a_round_and_commits_the_ledger(
    start: Callable[..., Env], tmp_path: Path, codec: str, spill: bool
) -> None:
    # spill: the bytes held in a file, not memory (every upload, however small: `--spill-above 0`)
    env = start(spill_dir=str(tmp_path), spill_above=0 if spill else NEVER)
    reg = register(env)
    before = env.server.core.params.clone()
    h, data, delta = make_upload(env, reg, "s1", codec=codec)
    resp = submit(env, h, data)
    assert resp.outcome == pb.SUBMISSION_OUTCOME_APPLIED and resp.version == 1 and resp.round == 1
    assert resp.staleness == 0
    decoded = get_codec(codec).decode(data, meta_from_proto(h.payload))
    torch.testing.assert_close(env.server.core.params, before - 0.7 * 1.9 * decoded)  # first Nesterov step
    if codec == "fp32":
        assert torch.equal(decoded, delta)
    ledger = env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    shard = ledger.shards[h.ranges[0].shard_id]
    assert ledger.version == 1 and ledger.tokens_applied == 128 and shard.committed == shard.accepted == h.ranges[0].end
    assert [(r.start, r.end) for r in shard.committed_ranges] == [(h.ranges[0].start, h.ranges[0].end)]
    status = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    assert status.version == 1 and status.tokens_applied == 128 and status.bytes_received == len(data)
    header, params = fetch_params(env)  # the broadcast shadow Θ̂ (ALGORITHM.md section 10): Θ up to the codec
    assert header.version == 1 and torch.equal(params, env.server.state.shadow.shadow)
    torch.testing.assert_close(params, env.server.core.params, rtol=0, atol=2e-2)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_uploads_of_one_size_land_in_one_reused_buffer_until_a_round_closes(env: Env, codec: str) -> None:
    reg = register(env)
    assert gauge(env, "idle_upload_buffer_bytes") == 0

    def refused(sid: str) -> int:
        h, data, _ = make_upload(env, reg, sid, codec=codec)
        header, corrupt = _flipped(h, data)
        assert code_of(lambda: submit(env, header, corrupt))[0] == INVALID  # type: ignore[arg-type]
        return len(data)

    for i in range(3):
        size = refused(f"bad{i}")
        # the refused upload's buffer is back (a new one per upload would make this grow)
        wait_for("the refused upload's buffer back", lambda: gauge(env, "idle_upload_buffer_bytes") == size)  # noqa: B023
    h, data, _ = make_upload(env, reg, "s0", codec=codec)
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_APPLIED
    # it took the idle buffer, was folded in and the round closed: idle buffers went back to the system at the close
    assert gauge(env, "idle_upload_buffer_bytes") == 0


Mutation = Callable[[pb.SubmissionHeader, bytes], tuple[pb.SubmissionHeader | None, bytes]]


def _set(**fields: Any) -> Mutation:
    def mutate(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
        for k, v in fields.items():
            setattr(h, k, v)
        return h, data

    return mutate


def _payload(**fields: Any) -> Mutation:
    def mutate(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
        for k, v in fields.items():
            setattr(h.payload, k, v)
        return h, data

    return mutate


def _range(**fields: int) -> Mutation:
    def mutate(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
        for k, v in fields.items():
            setattr(h.ranges[0], k, getattr(h.ranges[0], k) + v)
        return h, data

    return mutate


def _no_header(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
    return None, data


def _wrong_shape(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
    h.payload.tensors[0].shape[0] += 1
    return h, data


def _truncated(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
    return h, data[: len(data) - 100]


def _flipped(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0x01  # the low mantissa bit of an fp32 value: still finite, wrong crc
    return h, bytes(corrupt)


def _extra(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
    return h, bytes(data) + b"\0" * 8


def _oversized(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
    n = h.payload.numel
    h.payload.codec, h.payload.topk_count, h.payload.encoded_bytes = common_pb2.CODEC_TOPK, n, 8 * n
    return h, b""


def _nan(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
    values = torch.frombuffer(bytearray(data), dtype=torch.float32).clone()
    values[7] = float("nan")
    nan_data, meta = get_codec("fp32").encode(values)
    h.payload.crc32 = meta.crc32
    return h, nan_data


def _sparse(corrupt: Callable[[bytearray], None]) -> Mutation:
    """The same delta as a `sparse` payload whose first chunk record `corrupt` spoils (with a matching crc)."""

    def mutate(h: pb.SubmissionHeader, data: bytes) -> tuple[pb.SubmissionHeader | None, bytes]:
        values = torch.frombuffer(bytearray(data), dtype=torch.float32).clone()
        sparse, meta = get_codec("sparse").encode(values)
        bad = bytearray(sparse)
        corrupt(bad)
        h.payload.codec, h.payload.block_size, h.payload.topk_count = common_pb2.CODEC_SPARSE, 4096, meta.topk_count
        h.payload.encoded_bytes, h.payload.crc32 = meta.encoded_bytes, zlib.crc32(bad)
        return h, bytes(bad)

    return mutate


def _repeat_offset(record: bytearray) -> None:
    record[10:12] = record[8:10]  # offset 1 = offset 0


def _nan_low(record: bytearray) -> None:
    record[0:4] = b"\x00\x00\xc0\x7f"  # float32 NaN


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
BAD_INPUTS: dict[str, tuple[Mutation, grpc.StatusCode]] = {
    "no-header-first": (_no_header, INVALID),
    "wrong-numel": (_payload(numel=10), INVALID),
    "wrong-tensor-shape": (_wrong_shape, INVALID),
    "unknown-codec-enum": (_payload(codec=99), INVALID),
    "nan-fp32": (_nan, INVALID),
    "truncated": (_truncated, INVALID),
    "checksum-mismatch": (_flipped, INVALID),
    "extra-bytes": (_extra, INVALID),
    "sparse-offsets-not-increasing": (_sparse(_repeat_offset), INVALID),
    "sparse-nan-scale": (_sparse(_nan_low), INVALID),
    "oversized": (_oversized, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "empty-submission-id": (_set(submission_id=""), INVALID),
    "tokens-disagree-with-ranges": (_set(tokens=127), INVALID),
    "more-steps-than-tokens": (_set(steps=1000), INVALID),  # would shrink its norm per step
    "unknown-worker": (_set(worker_id="nobody-9"), grpc.StatusCode.NOT_FOUND),
    "future-base-version": (_set(base_version=5), PRECONDITION),
    "stale-shard-epoch": (_range(epoch=-1), PRECONDITION),
    "wrong-cursor": (_range(start=64, end=64), PRECONDITION),
    "wrong-coordinator-epoch": (_set(coordinator_epoch=1), PRECONDITION),
    "fragment-on-a-run-without": (_set(fragment=1), INVALID),  # --fragments 1: no fragment, no layout
    "layout-on-a-run-without": (_set(fragment_layout="0" * 16), INVALID),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_submissions_are_refused_and_change_nothing(env: Env, case: str) -> None:
    mutate, expected = BAD_INPUTS[case]
    reg = register(env)
    h, data, _ = make_upload(env, reg, "s1")
    before = frozen(env)
    header, payload = mutate(h, data)
    code, details = code_of(lambda: env.stub.SubmitPseudoGradient(iter(requests(header, payload)), timeout=T))
    assert code == expected, details
    assert details
    assert_unchanged(env, before)
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).rejected_submissions == 1


def test_too_stale_submission_is_refused(start: Callable[..., Env]) -> None:
    env = start(max_staleness=1)
    reg = register(env)
    for i in range(2):
        h, data, _ = make_upload(env, reg, f"s{i}", seed=i)
        submit(env, h, data)
    h, data, _ = make_upload(env, reg, "late")
    h.base_version = 0
    before = frozen(env)
    code, details = code_of(lambda: submit(env, h, data))
    assert code == PRECONDITION and "stale" in details
    assert_unchanged(env, before)


def test_duplicate_submission_is_idempotent(start: Callable[..., Env]) -> None:
    env = start(expected_workers=2)
    a, b = register(env, "a"), register(env, "b")
    h, data, _ = make_upload(env, a, "a1")
    first = submit(env, h, data)
    assert first.outcome == pb.SUBMISSION_OUTCOME_ACCEPTED and first.round == 1
    pending = frozen(env)
    again = submit(env, h, data)
    assert again.outcome == pb.SUBMISSION_OUTCOME_ACCEPTED and again.round == 1
    assert torch.equal(env.server.core.params, pending[0]) and env.server.core.acc.count == 1
    hb, data_b, _ = make_upload(env, b, "b1", seed=1)
    assert submit(env, hb, data_b).outcome == pb.SUBMISSION_OUTCOME_APPLIED
    applied = frozen(env)
    third = submit(env, h, data)
    assert third.outcome == pb.SUBMISSION_OUTCOME_APPLIED and third.round == 1 and third.version == 1
    status = env.stub.GetUploadStatus(pb.GetUploadStatusRequest(worker_id=a.worker_id, submission_id="a1"), timeout=T)
    assert status.complete and status.received_bytes == len(data)
    assert_unchanged(env, applied)
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).version == 1


@pytest.mark.parametrize("spill", [False, True])
def test_interrupted_upload_resumes_from_the_bytes_held(start: Callable[..., Env], tmp_path: Path, spill: bool) -> None:
    env = start(spill_dir=str(tmp_path), spill_above=0 if spill else NEVER)
    reg = register(env)
    h, data, _ = make_upload(env, reg, "big")
    msgs = requests(h, data)
    half = len(msgs) // 2
    held = min(len(data), (half - 1) * CHUNK)
    release = threading.Event()

    def first_attempt() -> Iterator[pb.SubmitPseudoGradientRequest]:
        yield from msgs[:half]
        release.wait(20)

    future = env.stub.SubmitPseudoGradient.future(first_attempt(), timeout=30)

    def status() -> pb.GetUploadStatusResponse:
        req = pb.GetUploadStatusRequest(worker_id=reg.worker_id, submission_id="big")
        resp: pb.GetUploadStatusResponse = env.stub.GetUploadStatus(req, timeout=T)
        return resp

    wait_for("half the chunks to arrive", lambda: status().received_bytes == held)
    future.cancel()  # the link breaks
    release.set()
    assert status().received_bytes == held and not status().complete
    assert len(open_files_in(tmp_path)) == (1 if spill else 0)  # with spill, the held bytes are in a file there
    wrong = pb.SubmissionHeader()
    wrong.CopyFrom(h)
    wrong.resume_offset = held + 1
    code, details = code_of(lambda: env.stub.SubmitPseudoGradient(iter(requests(wrong, data, held + 1)), timeout=T))
    assert code == PRECONDITION and f"resume from offset {held}" in details
    h.resume_offset = held
    resp = env.stub.SubmitPseudoGradient(iter(requests(h, data, held)), timeout=T)
    assert resp.outcome == pb.SUBMISSION_OUTCOME_APPLIED and resp.version == 1
    assert status().complete
    assert gauge(env, "partial_uploads") == 0
    assert list(tmp_path.iterdir()) == []  # a spill file is unlinked when made: nothing is ever left behind


def open_files_in(directory: Path) -> list[str]:
    """The files this process holds open in `directory` (unlinked ones included)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if link.startswith(f"{directory}/"):
            found.append(link)
    return found


def test_a_spill_dir_gone_refuses_uploads_and_keeps_broadcast_deltas_in_memory(
    start: Callable[..., Env], tmp_path: Path
) -> None:
    clock, spill = Clock(), tmp_path / "spill"
    spill.mkdir()
    env = start(clock=clock, expected_workers=2, min_quorum=1, grace_max_s=5.0, spill_dir=str(spill), spill_above=0)
    a, _ = register(env, "a"), register(env, "b")
    h, data, _ = make_upload(env, a, "a1")
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED  # received into the spill dir, folded
    spill.rmdir()  # the directory goes (an operator, a lost mount) while the round is open: its file was unlinked
    clock.t += 10  # past the grace window: the round closes
    wait_for("the round to close", lambda: env.server.core.version == 1)
    # its broadcast delta could not be written there: kept in memory, and the version published all the same (the
    # shadow records the version's delta just after the round steps the parameters: waited for, not read at once)
    kept = wait_for("version 1's delta kept", lambda: env.server.state.shadow.updates_since(0, 1), timeout_s=10)
    assert len(kept) == 1 and isinstance(kept[0].data, memoryview)
    assert fetch_params(env)[0].version == 1
    # an upload cannot be held there: refused, saying what to do, and nothing changes
    h, data, _ = make_upload(env, a, "a2")
    before = frozen(env)
    code, details = code_of(lambda: submit(env, h, data))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--spill-dir" in details and "again later" in details
    assert_unchanged(env, before)
    spill.mkdir()  # back: the same upload is taken
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED


def test_truncated_upload_keeps_its_bytes_for_a_resume(env: Env) -> None:
    reg = register(env)
    h, data, _ = make_upload(env, reg, "t1")
    cut = 2 * CHUNK
    code, details = code_of(lambda: env.stub.SubmitPseudoGradient(iter(requests(h, data[:cut])), timeout=T))
    assert code == INVALID and f"resume from offset {cut}" in details
    h.resume_offset = cut
    assert env.stub.SubmitPseudoGradient(iter(requests(h, data, cut)), timeout=T).version == 1


def test_decoupled_round_closes_at_the_grace_deadline(start: Callable[..., Env]) -> None:
    env = start(expected_workers=2, min_quorum=1, grace_max_s=0.2)
    a, _ = register(env, "a"), register(env, "b")
    h, data, _ = make_upload(env, a, "a1")
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED
    wait_for("the grace window to close the round", lambda: env.server.core.version == 1)
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).pending_submissions == 0


def test_validation_loss_is_evaluated_after_rounds(start: Callable[..., Env]) -> None:
    env = start(eval_every=1, eval_tokens=256, metrics_port=0)
    reg = register(env)
    h, data, _ = make_upload(env, reg, "s1")
    submit(env, h, data)
    wait_for("an evaluation of version 1", lambda: env.server.state.validation_version == 1)
    status = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    assert 0 < status.validation_loss < 10
    assert status.validation_tokens == 256  # the sample the evaluation scored (eval_tokens=256)
    body = urllib.request.urlopen(f"http://127.0.0.1:{env.server.metrics_port}/metrics", timeout=T).read().decode()
    assert "diloco_coordinator_rounds_total 1.0" in body and "diloco_coordinator_validation_loss" in body


def test_rounds_during_an_evaluation_get_the_newest_version_evaluated_after_it(start: Callable[..., Env]) -> None:
    """The evaluation model views Θ (no copy of its own) and is never touched while it is scored: a round closing
    meanwhile steps a copy of Θ, and the newest version is evaluated once it ends, on Θ itself (the loss equals a
    fresh evaluation of Θ); then the model views Θ again."""
    env = start(eval_every=1, eval_tokens=256)
    server = env.server
    scoring, release = threading.Event(), threading.Event()
    evaluate_for_real = server._evaluate

    def slow_evaluate(version: int) -> None:  # holds the first evaluation open until the rounds below are done
        if version == 1:
            scoring.set()
            release.wait(timeout=T)
        evaluate_for_real(version)

    server._evaluate = slow_evaluate  # type: ignore[method-assign]
    reg = register(env)
    one_round(env, reg, "s1", seed=1)
    assert scoring.wait(timeout=T)
    first = next(server._eval_model.parameters())  # type: ignore[union-attr]
    assert first.data_ptr() == server.core.params.data_ptr()  # a view of Θ
    held = [p.detach().clone() for p in server._eval_model.parameters()]  # type: ignore[union-attr]
    one_round(env, reg, "s2", seed=2)
    one_round(env, reg, "s3", seed=3)
    assert server.core.version == 3 and server.core.params.data_ptr() != first.data_ptr()
    after = list(server._eval_model.parameters())  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(held, after, strict=True)), "the model changed while scored"
    release.set()
    wait_for("the newest version to be evaluated", lambda: server.state.validation_version == 3)
    with server.state.work:  # the evaluation let go of the Θ it held: the model views the current one
        assert next(server._eval_model.parameters()).data_ptr() == server.core.params.data_ptr()  # type: ignore[union-attr]
    model = server.task.model_fn(0)
    load_flat_(model, server.core.params)
    expected = evaluate(model, server.task.corpus, server.task.config.model.seq_len, 256, torch.device("cpu"))
    assert server.state.validation_loss == pytest.approx(expected.loss, rel=1e-6)


# --- checkpoints --------------------------------------------------------------------------------------------------
def one_round(env: Env, reg: pb.RegisterResponse, sid: str, seed: int = 0) -> None:
    h, data, _ = make_upload(env, reg, sid, seed=seed)
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_APPLIED


def test_restart_resumes_version_params_and_ledger(start: Callable[..., Env], tmp_path: Path) -> None:
    env = start(checkpoint_dir=str(tmp_path), checkpoint_every=1000)
    reg = register(env)
    one_round(env, reg, "s1")
    saved = env.stub.Checkpoint(pb.CheckpointRequest(), timeout=T)
    assert saved.version == 1 and Path(saved.path).exists()
    params, ledger = env.server.core.params.clone(), env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    h, data, _ = make_upload(env, reg, "s2")  # made against the old coordinator
    env.server.stop(1.0)
    env.server.stop(1.0)  # idempotent
    again = start(checkpoint_dir=str(tmp_path))
    assert again.server.resumed_from == Path(saved.path)
    assert again.server.core.version == 1 and torch.equal(again.server.core.params, params)
    resumed = again.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    assert [(s.committed, list(s.committed_ranges)) for s in resumed.shards] == [
        (s.committed, list(s.committed_ranges)) for s in ledger.shards
    ]
    assert again.server.state.epoch != reg.coordinator_epoch
    code, details = code_of(lambda: submit(again, h, data))
    assert code == PRECONDITION and "register again" in details
    new = register(again)
    one_round(again, new, "s3")
    assert again.server.core.version == 2


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(start: Callable[..., Env], tmp_path: Path) -> None:
    env = start(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    reg = register(env)
    one_round(env, reg, "s1")
    first = env.stub.Checkpoint(pb.CheckpointRequest(), timeout=T)
    params_v1 = env.server.core.params.clone()
    one_round(env, reg, "s2", seed=1)
    env.server.stop(1.0)  # writes version 2 on the way out (if the jobs thread has not yet)
    newest = checkpoint.checkpoint_path(tmp_path, 2)
    assert newest.exists()
    blob = bytearray(newest.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    newest.write_bytes(bytes(blob))
    again = start(checkpoint_dir=str(tmp_path))
    assert again.server.resumed_from == Path(first.path)
    assert again.server.core.version == 1 and torch.equal(again.server.core.params, params_v1)


def test_checkpoint_files_are_atomic_checksummed_and_pruned(tmp_path: Path) -> None:
    for v in range(5):
        checkpoint.save(tmp_path, {"version": v, "params": torch.full((3,), float(v))}, keep=3)
    assert [v for v, _ in checkpoint.list_checkpoints(tmp_path)] == [4, 3, 2]
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    snap, path = checkpoint.load_latest(tmp_path) or ({}, None)
    assert snap["version"] == 4 and path == checkpoint.checkpoint_path(tmp_path, 4)
    checkpoint.checkpoint_path(tmp_path, 4).write_bytes(b"DLCKPT01" + b"\0" * 40)  # torn write
    checkpoint.checkpoint_path(tmp_path, 3).write_bytes(checkpoint.checkpoint_path(tmp_path, 3).read_bytes()[:-10])
    snap, path = checkpoint.load_latest(tmp_path) or ({}, None)
    assert snap["version"] == 2 and torch.equal(snap["params"], torch.full((3,), 2.0))
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_a_standby_taking_over_writes_its_state_as_the_newest_checkpoint(tmp_path: Path) -> None:
    # files from the replica's earlier life as leader: versions 5 and 6 of a history the new leader never had
    for v in (4, 5, 6):
        checkpoint.save(tmp_path, {"version": v, "params": torch.full((3,), -1.0)}, keep=5)
    standby = {"version": 5, "params": torch.full((3,), 5.0)}
    stale = checkpoint.discard_after(tmp_path, 5)
    path, _ = checkpoint.save(tmp_path, standby, keep=5)
    assert stale == [checkpoint.checkpoint_path(tmp_path, 6)]
    snap, newest = checkpoint.load_latest(tmp_path) or ({}, None)
    assert newest == path == checkpoint.checkpoint_path(tmp_path, 5)
    assert torch.equal(snap["params"], torch.full((3,), 5.0))  # the standby's version 5 replaced the other one


def test_a_checkpoint_of_live_tensors_is_serialised_under_the_lock_given(tmp_path: Path) -> None:
    lock = threading.Lock()
    live = torch.arange(4, dtype=torch.float32)
    seen: list[bool] = []

    def snapshot() -> dict[str, Any]:
        seen.append(lock.locked())
        return {"version": 7, "params": live}

    path, version = checkpoint.save(tmp_path, snapshot, hold=lock)
    live.add_(100.0)  # changed after the save: the file holds what it was under the lock
    assert seen == [True] and not lock.locked() and version == 7
    assert torch.equal(checkpoint.load(path)["params"], torch.arange(4, dtype=torch.float32))


def test_loading_a_checkpoint_reads_its_tensors_from_the_file_without_a_copy_of_it(tmp_path: Path) -> None:
    n = 1 << 20
    snap = {"version": 3, "params": torch.arange(n, dtype=torch.float32), "outer": {"buf": torch.full((n,), 0.5)}}
    path, _ = checkpoint.save(tmp_path, snap)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        loaded = checkpoint.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the file's bytes never sat in one Python object (reading it whole, then unpickling from that, held them twice)
    assert peak < size // 4, f"{peak} bytes allocated loading a {size}-byte checkpoint"
    assert torch.equal(loaded["params"], snap["params"]) and torch.equal(loaded["outer"]["buf"], snap["outer"]["buf"])
    flipped = bytearray(path.read_bytes())
    flipped[-100] ^= 1  # still caught: the hash is taken over the same bytes, a slab at a time
    path.write_bytes(bytes(flipped))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="sha256"):
        checkpoint.load(path)


def test_checkpoint_rpc_without_a_folder_is_refused(env: Env) -> None:
    code, details = code_of(lambda: env.stub.Checkpoint(pb.CheckpointRequest(), timeout=T))
    assert code == PRECONDITION and "--checkpoint-dir" in details


# --- operator and membership RPCs ---------------------------------------------------------------------------------
def state_of(env: Env, worker_id: str) -> int:
    workers = env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers
    return next(w.state for w in workers if w.worker_id == worker_id)


def test_status_workers_and_ledger(start: Callable[..., Env]) -> None:
    env = start(expected_workers=2)
    a, b = register(env, "a"), register(env, "b")
    status = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    assert status.mode == pb.ROUND_MODE_DECOUPLED and status.live_workers == 2 and status.codec == "int8"
    assert status.min_quorum == 2 and status.coordinator_epoch == a.coordinator_epoch and not status.paused
    assert status.validation_loss != status.validation_loss  # NaN: never evaluated (eval_every=0)
    assert status.started_unix_s > 0 and not status.finished
    workers = env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers
    assert [w.worker_name for w in workers] == ["a", "b"]
    assert all(w.state == common_pb2.WORKER_STATE_ACTIVE and len(w.shards) == 4 for w in workers)
    ledger = env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    assert len(ledger.shards) == 8 and {s.owner for s in ledger.shards} == {a.worker_id, b.worker_id}
    env.stub.ReportThroughput(
        pb.ReportThroughputRequest(worker_id=a.worker_id, throughput=common_pb2.Throughput(tokens_per_s=100.0)),
        timeout=T,
    )
    assert env.server.core.worker(a.worker_id).speed == 100.0
    # healthd's batch: one call for many learners; one that is gone meanwhile is skipped, not an error
    env.stub.EvictWorker(pb.EvictWorkerRequest(worker_id=b.worker_id), timeout=T)
    batch = [
        pb.ThroughputReport(worker_id=wid, throughput=common_pb2.Throughput(tokens_per_s=tps))
        for wid, tps in ((a.worker_id, 250.0), (b.worker_id, 7.0), ("never-registered-9", 1.0))
    ]
    env.stub.ReportThroughput(pb.ReportThroughputRequest(reports=batch), timeout=T)
    assert env.server.core.worker(a.worker_id).speed == 250.0
    too_many = pb.ReportThroughputRequest(reports=[batch[0]] * 10_001)
    code, details = code_of(lambda: env.stub.ReportThroughput(too_many, timeout=T))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "reports" in details


def test_node_failure_reassigns_shards_once(start: Callable[..., Env]) -> None:
    env = start(expected_workers=2)
    a, b = register(env, "a"), register(env, "b")
    owned = sorted(s.shard_id for s in b.plan.shards)
    req = pb.ReportNodeFailureRequest(
        worker_id=b.worker_id, reason="missed heartbeats", declared_dead_unix_s=time.time()
    )
    resp = env.stub.ReportNodeFailure(req, timeout=T)
    assert resp.known and sorted(resp.reassigned_shards) == owned
    assert state_of(env, b.worker_id) == common_pb2.WORKER_STATE_DEAD
    ledger = env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    assert {s.owner for s in ledger.shards} == {a.worker_id}
    assert not env.stub.ReportNodeFailure(req, timeout=T).known  # already gone
    assert not env.stub.ReportNodeFailure(pb.ReportNodeFailureRequest(worker_id="nobody-9"), timeout=T).known
    code, _ = code_of(lambda: env.stub.ReportNodeFailure(pb.ReportNodeFailureRequest(), timeout=T))
    assert code == INVALID
    code, _ = code_of(lambda: env.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=b.worker_id), timeout=T))
    assert code == PRECONDITION


def test_a_pending_round_closes_when_the_missing_learner_dies(start: Callable[..., Env]) -> None:
    env = start(mode="sync", expected_workers=2)
    a, b = register(env, "a"), register(env, "b")
    h, data, _ = make_upload(env, a, "a1")
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED
    env.stub.ReportNodeFailure(pb.ReportNodeFailureRequest(worker_id=b.worker_id), timeout=T)
    wait_for("the round to close", lambda: env.server.core.version == 1)  # the round poller closes it


def test_drain_evict_release_and_deregister(start: Callable[..., Env]) -> None:
    env = start(expected_workers=3)
    a, b, c = register(env, "a"), register(env, "b"), register(env, "c")
    ledger = env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    assert [s for s in ledger.shards if s.owner == a.worker_id]
    drained = env.stub.DrainWorker(pb.DrainWorkerRequest(worker_id=a.worker_id), timeout=T)
    assert drained.state == common_pb2.WORKER_STATE_DRAINING
    assert not env.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=a.worker_id), timeout=T).plan.shards
    ledger = env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    assert {s.owner for s in ledger.shards} == {b.worker_id, c.worker_id}  # a's shards moved at once
    owned_by_b = sorted(s.shard_id for s in ledger.shards if s.owner == b.worker_id)
    evicted = env.stub.EvictWorker(pb.EvictWorkerRequest(worker_id=b.worker_id, reason="misbehaves"), timeout=T)
    assert owned_by_b and sorted(evicted.reassigned_shards) == owned_by_b
    assert state_of(env, b.worker_id) == common_pb2.WORKER_STATE_EVICTED
    released = env.stub.ReleaseWorker(pb.ReleaseWorkerRequest(worker_id=c.worker_id), timeout=T)
    assert released.state == common_pb2.WORKER_STATE_ACTIVE
    code, _ = code_of(lambda: env.stub.ReleaseWorker(pb.ReleaseWorkerRequest(worker_id=b.worker_id), timeout=T))
    assert code == PRECONDITION
    env.stub.Deregister(pb.DeregisterRequest(worker_id=c.worker_id, reason="SIGTERM"), timeout=T)
    assert state_of(env, c.worker_id) == common_pb2.WORKER_STATE_LEFT
    code, _ = code_of(lambda: env.stub.DrainWorker(pb.DrainWorkerRequest(worker_id=c.worker_id), timeout=T))
    assert code == PRECONDITION


def test_control_calls_do_not_wait_on_tensor_work(start: Callable[..., Env]) -> None:
    """ALGORITHM.md section 9: while a round steps, encodes or is copied for a checkpoint (all under the state's
    tensor lock, held here), status, plans, registration and throughput reports still answer at once."""
    env = start(expected_workers=2)
    a = register(env, "a")
    with env.server.state.work:
        started = time.monotonic()
        assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=2.0).live_workers == 1
        assert env.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=a.worker_id), timeout=2.0).plan.shards
        register(env, "b")
        env.stub.ReportThroughput(
            pb.ReportThroughputRequest(worker_id=a.worker_id, throughput=common_pb2.Throughput(tokens_per_s=5.0)),
            timeout=2.0,
        )
        assert len(env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=2.0).workers) == 2
        env.stub.GetLedger(pb.GetLedgerRequest(), timeout=2.0)
        assert time.monotonic() - started < 2.0


def test_pause_holds_rounds_and_resume_applies_them(env: Env) -> None:
    reg = register(env)
    assert env.stub.Pause(pb.PauseRequest(), timeout=T).paused
    h, data, _ = make_upload(env, reg, "s1")
    assert submit(env, h, data).outcome == pb.SUBMISSION_OUTCOME_ACCEPTED
    assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).paused and env.server.core.version == 0
    assert not env.stub.Resume(pb.ResumeRequest(), timeout=T).paused
    wait_for("the round to close", lambda: env.server.core.version == 1)  # the round poller closes it


RPCS_WITH_A_WORKER: dict[str, Callable[[coordinator_pb2_grpc.CoordinatorStub, str], object]] = {
    "GetWorkPlan": lambda s, w: s.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=w), timeout=T),
    "GetUploadStatus": lambda s, w: s.GetUploadStatus(
        pb.GetUploadStatusRequest(worker_id=w, submission_id="x"), timeout=T
    ),
    "Deregister": lambda s, w: s.Deregister(pb.DeregisterRequest(worker_id=w), timeout=T),
    "ReportThroughput": lambda s, w: s.ReportThroughput(pb.ReportThroughputRequest(worker_id=w), timeout=T),
    "DrainWorker": lambda s, w: s.DrainWorker(pb.DrainWorkerRequest(worker_id=w), timeout=T),
    "EvictWorker": lambda s, w: s.EvictWorker(pb.EvictWorkerRequest(worker_id=w), timeout=T),
    "ReleaseWorker": lambda s, w: s.ReleaseWorker(pb.ReleaseWorkerRequest(worker_id=w), timeout=T),
}


@pytest.mark.parametrize("rpc", list(RPCS_WITH_A_WORKER))
def test_unknown_and_empty_worker_ids(env: Env, rpc: str) -> None:
    call = RPCS_WITH_A_WORKER[rpc]
    assert code_of(lambda: call(env.stub, "nobody-9"))[0] == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: call(env.stub, ""))[0] == INVALID


# --- configuration and the entry point ----------------------------------------------------------------------------
def test_parse_reads_flags_with_env_fallbacks() -> None:
    env = {"DILOCO_MODE": "sync", "DILOCO_CODEC": "bf16", "DILOCO_PORT": "7000", "DILOCO_SHARDS": "4"}
    env["DILOCO_INSECURE"] = "1"  # plaintext, allowed on loopback only (tests/test_security.py covers TLS)
    cfg = parse(["--port", "7001", "--d-model", "32", "--heads", "2"], env)
    assert (cfg.mode, cfg.codec, cfg.port) == ("sync", "bf16", 7001)
    assert cfg.task.data.num_shards == 4 and cfg.task.model.d_model == 32
    assert parse([], {"DILOCO_TASK_JSON": tiny_task().to_json(), "DILOCO_INSECURE": "1"}).task == tiny_task()
    crash = parse(["--fault-crash-before-answer", "accepted@7", "--insecure"], {}).crash_fault()
    assert crash == CrashFault(applied=False, round=7) and crash.matches(False, 8) and not crash.matches(True, 8)
    assert parse(["--insecure"], {}).crash_fault() is None
    replicated = ["--replication-log", "2", "--sync-replicas", "1", "--insecure"]
    assert parse(replicated, {"DILOCO_WHEN_NO_STANDBY": "wait"}).when_no_standby == "wait"
    assert parse(replicated, {}).when_no_standby == "publish"


def test_the_replication_log_byte_cap_takes_a_count_or_a_size_within_bounds_and_names_the_flag() -> None:
    log = ["--replication-log", "8", "--insecure"]
    assert parse(log, {}).replication_log_bytes == 0  # the default: a snapshot's tensors, from the model
    for text, want in (
        ("1048576", 1 << 20),
        ("2G", 2 << 30),
        ("2g", 2 << 30),
        ("512MiB", 512 << 20),
        (" 64K ", 64 << 10),
    ):
        assert parse([*log, "--replication-log-bytes", text], {}).replication_log_bytes == want
    assert parse(log, {"DILOCO_REPLICATION_LOG_BYTES": "1T"}).replication_log_bytes == 1 << 40
    for bad in ("-1", "2X", "0.5G", "G", "", "1e9"):
        with pytest.raises(ConfigError, match="--replication-log-bytes"):
            parse([*log, "--replication-log-bytes", bad], {})
        with pytest.raises(ConfigError, match="--replication-log-bytes"):
            parse(log, {"DILOCO_REPLICATION_LOG_BYTES": bad})
    with pytest.raises(ConfigError, match=r"--replication-log-bytes\) must be a byte count in \[1, 1099511627776\]"):
        parse([*log, "--replication-log-bytes", "2T"], {})
    with pytest.raises(ConfigError, match=r"--replication-log-bytes\) caps the round log: set replication_log"):
        parse(["--replication-log-bytes", "2G", "--insecure"], {})
    for value in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="--replication-log-bytes"):
            CoordinatorServiceConfig(replication_log=2, replication_log_bytes=value)


@pytest.mark.parametrize(
    ("argv", "env", "field"),
    [
        (["--mode", "fast"], {}, "mode"),
        ([], {"DILOCO_CODEC": "int3"}, "codec"),
        ([], {"DILOCO_PORT": "http"}, "DILOCO_PORT"),
        (["--min-local-steps", "99"], {}, "min_local_steps"),
        (["--expected-workers", "40"], {}, "expected_workers"),
        (["--bogus"], {}, "bogus"),
        (["--fault-crash-before-answer", "applied"], {}, "--fault-crash-before-answer"),
        (["--fault-crash-before-answer", "dropped@3"], {}, "--fault-crash-before-answer"),
        ([], {"DILOCO_FAULT_CRASH_BEFORE_ANSWER": "accepted@0"}, "--fault-crash-before-answer"),
        (["--when-no-standby", "maybe"], {}, "when_no_standby"),
        (["--when-no-standby", "wait", "--replication-log", "2"], {}, "--sync-replicas"),
        (["--unheard-after-s", "-1"], {}, "unheard_after_s"),
        ([], {"DILOCO_UNHEARD_AFTER_S": "nan"}, "unheard_after_s"),
    ],
)
def test_bad_configuration_names_the_field(argv: list[str], env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse(argv, env)


def test_main_exits_2_on_bad_configuration(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--mode", "fast"], {}) == 2
    assert "mode" in capsys.readouterr().err
    # a spill directory that is not there: refused before anything starts, saying what to do
    assert main(["--insecure"], {"DILOCO_SPILL_DIR": str(tmp_path / "nowhere")}) == 2
    assert "--spill-dir" in (err := capsys.readouterr().err) and "create it" in err, err


def test_python_m_services_coordinator_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    task = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "4"]
    args = [*task, "--max-bytes", "400000", "--shards", "8", "--checkpoint-dir", str(tmp_path), "--insecure"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.coordinator", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DILOCO_EVAL_EVERY": "0"},
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout is not None
        port = 0
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "coordinator.started":
                port = int(event["port"])
                break
        assert port > 0, "the coordinator never reported coordinator.started"
        with channel(f"127.0.0.1:{port}") as chan:
            status = coordinator_pb2_grpc.CoordinatorStub(chan).GetStatus(pb.GetStatusRequest(), timeout=T)
            assert status.version == 0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert '"coordinator.stopped"' in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert checkpoint.load_latest(tmp_path) is not None
