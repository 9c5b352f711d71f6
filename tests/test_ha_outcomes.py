"""Nothing acknowledged is lost across a takeover (issue #14 point 3, ALGORITHM.md section 11: "Submission ids are
in the log, so a resubmission to the new leader is answered as before and never applied twice"), in process over
real gRPC: a leader with a round log, a standby following it (`StandbyFollower`, writing checkpoints) and a
coordinator resumed from the standby's checkpoints under a new epoch, as a promoted `--etcd` replica is.

A learner resending a submission the leader applied (its first answer lost) gets the same answer from the new
leader, though its header names the old coordinator epoch and a learner id the new leader never registered; it
is not applied again. One the leader held pending (its round never closed) is refused like any submission of the
old epoch (the learner registers again and trains the range again). With mutual TLS the learner's own certificate
may resend it, another learner's may not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from diloco.rpc.security import SecurityConfig
from diloco.rpc.server import channel
from diloco.rpc.tls import ADMIN_TOKEN_FILE, JOIN_TOKEN_FILE, TlsFiles, channel_credentials, write_bundle
from diloco.task.params import param_specs
from diloco.v1 import coordinator_pb2_grpc
from services.coordinator import checkpoint
from services.coordinator.server import CoordinatorServer
from services.coordinator.standby import StandbyConfig, StandbyFollower
from tests.support import (
    Env,
    T,
    code_of,
    config,
    frozen,
    make_upload,
    pb,
    register,
    requests,
    submit,
    wait_for,
)

pytestmark = pytest.mark.timeout(90)
APPLIED, ACCEPTED = pb.SUBMISSION_OUTCOME_APPLIED, pb.SUBMISSION_OUTCOME_ACCEPTED
Upload = tuple[pb.SubmissionHeader, bytes]
TakenOver = tuple[pb.RegisterResponse, dict[str, Upload]]  # worker0's registration at the old leader, its uploads


@pytest.fixture
def taken_over(tmp_path: Path) -> Iterator[TakenOver]:
    """A leader that applied learner worker0's submission "a" and holds its submission "p" pending (paused: the
    round stays open), then stops; its standby's checkpoints are in tmp_path/standby. Yields worker0's
    registration at the leader and the two uploads (header, payload)."""
    leader = CoordinatorServer(config(replication_log=4))
    leader.start()
    chan = channel(leader.address)
    env = Env(leader, coordinator_pb2_grpc.CoordinatorStub(chan), chan, param_specs(leader.task.model_fn(0)))
    standby_dir = tmp_path / "standby"
    follow = channel(leader.address)
    follower = StandbyFollower(
        StandbyConfig("standby-1", checkpoint_dir=str(standby_dir), checkpoint_every=1),
        follow,
        fingerprint=leader.task.fingerprint,
        numel=env.numel,
    )
    follower.start()
    try:
        reg = register(env, "worker0")
        wait_for("the standby to follow", lambda: follower.version == 0, 20.0)
        a, a_data, _ = make_upload(env, reg, "a", seed=1)
        first = submit(env, a, a_data)
        assert first.outcome == APPLIED and first.round == first.version == 1
        saved = lambda: [v for v, _ in checkpoint.list_checkpoints(standby_dir)]  # noqa: E731
        wait_for("the standby's checkpoint of version 1", lambda: 1 in saved(), 20.0)
        leader.state.set_paused(True)
        p, p_data, _ = make_upload(env, reg, "p", seed=2)
        pending = submit(env, p, p_data)
        assert pending.outcome == ACCEPTED and pending.round == 2 and leader.core.version == 1
    finally:
        follower.stop()
        follow.close()
        chan.close()
        leader.stop(0)
    yield reg, {"a": (a, a_data), "p": (p, p_data)}


def successor(tmp_path: Path, security: SecurityConfig | None = None) -> CoordinatorServer:
    kw = {"security": security} if security is not None else {}
    server = CoordinatorServer(config(checkpoint_dir=str(tmp_path / "standby"), replication_log=4, **kw))
    server.start()
    return server


def test_a_resubmission_of_an_applied_submission_gets_its_first_answer_and_is_not_applied_again(
    taken_over: TakenOver, tmp_path: Path
) -> None:
    reg, uploads = taken_over
    server = successor(tmp_path)
    try:
        with channel(server.address) as chan:
            stub = coordinator_pb2_grpc.CoordinatorStub(chan)
            env = Env(server, stub, chan, param_specs(server.task.model_fn(0)))
            assert server.core.version == 1 and server.state.epoch != reg.coordinator_epoch
            assert not server.core.workers  # the learner registered with the old leader only
            before = frozen(env)
            a, a_data = uploads["a"]
            # where to resume: complete (the learner then sends only the header), though worker0 is unknown here
            status = stub.GetUploadStatus(
                pb.GetUploadStatusRequest(worker_id=reg.worker_id, submission_id="a"), timeout=T
            )
            assert status.complete
            again = submit(env, a, a_data)  # the old epoch, the old learner id: answered from the outcome
            assert (again.outcome, again.round, again.staleness, again.version) == (APPLIED, 1, 0, 1)
            header_only = stub.SubmitPseudoGradient(iter(requests(a, b"")), timeout=T)
            assert header_only == again
            after = frozen(env)
            assert after[1:] == before[1:] and after[0].equal(before[0])  # not applied again: nothing changed
            assert server.core.tokens_applied == a.tokens

            # the pending one died with the leader: refused as of the old epoch (register again, train it again)
            p, p_data = uploads["p"]
            code, details = code_of(lambda: submit(env, p, p_data))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "register again" in details
            assert f"epoch {server.state.epoch}" in details
            (rng,) = p.ranges
            shard = server.core.ledger.state(rng.shard_id)
            assert shard.committed == rng.start and shard.epoch > rng.epoch  # its range is not committed, fenced

            # the id is worker0's: another learner id naming it is refused; an unknown learner is still NOT_FOUND
            other = pb.SubmissionHeader()
            other.CopyFrom(a)
            other.worker_id = "worker1-7"
            code, details = code_of(lambda: submit(env, other, a_data))
            assert code == grpc.StatusCode.ALREADY_EXISTS and "another learner" in details
            code, _ = code_of(
                lambda: stub.GetUploadStatus(
                    pb.GetUploadStatusRequest(worker_id="worker1-7", submission_id="a"), timeout=T
                )
            )
            assert code == grpc.StatusCode.NOT_FOUND
            assert frozen(env)[1:] == before[1:]
    finally:
        server.stop(0)


def test_with_mutual_tls_only_the_learners_own_certificate_may_resend_it(taken_over: TakenOver, tmp_path: Path) -> None:
    """The new leader never registered worker0: the name it checks the certificate against is the one in the
    learner id its accepted submission names."""
    reg, uploads = taken_over
    pki = tmp_path / "tls"
    write_bundle(pki, clients=["worker0", "worker1"])
    join = (pki / JOIN_TOKEN_FILE).read_text().strip()
    admin = (pki / ADMIN_TOKEN_FILE).read_text().strip()
    server = successor(
        tmp_path,
        SecurityConfig(tls_dir=str(pki), tls_name="coordinator", insecure=False, join_token=join, admin_token=admin),
    )
    a, a_data = uploads["a"]
    ask = pb.GetUploadStatusRequest(worker_id=reg.worker_id, submission_id="a")

    channels: list[grpc.Channel] = []

    def stub(name: str) -> coordinator_pb2_grpc.CoordinatorStub:
        creds = channel_credentials(TlsFiles.from_dir(pki, name))
        channels.append(channel(server.address, credentials=creds, token=join))
        return coordinator_pb2_grpc.CoordinatorStub(channels[-1])

    try:
        own, other = stub("worker0"), stub("worker1")
        resp = own.SubmitPseudoGradient(iter(requests(a, a_data)), timeout=T)
        assert (resp.outcome, resp.round) == (APPLIED, 1)
        assert own.GetUploadStatus(ask, timeout=T).complete
        for call in (
            lambda: other.SubmitPseudoGradient(iter(requests(a, a_data)), timeout=T),
            lambda: other.GetUploadStatus(ask, timeout=T),
        ):
            code, details = code_of(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "worker1" in details
        assert server.core.tokens_applied == a.tokens  # applied once, at the old leader
    finally:
        for ch in channels:
            ch.close()
        server.stop(0)
