"""Round-log replication through real gRPC: an in-process leader coordinator on port 0 serving
`diloco.v1.Replication`, and standbys (`services.coordinator.standby`) following it over real channels. A standby
holds the leader's Θ and outer momentum bit for bit at every version; one killed and restarted catches up from its
checkpoint (entries only) or, once the log moved past it, from a snapshot; `--sync-replicas` holds each version
back until a standby holds it, and a stalled standby costs one bounded wait; refusals carry the right codes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
import torch
from google.protobuf.message import DecodeError

from diloco.cluster import LogFollower, LogLine
from diloco.core.fragments import layout_for
from diloco.core.replication import digest
from diloco.rpc.server import channel
from diloco.task.factory import Fingerprint
from diloco.task.params import merge_segments
from diloco.v1 import common_pb2, replication_pb2_grpc
from diloco.v1 import replication_pb2 as rpb
from services.coordinator import checkpoint
from services.coordinator.replication import LOG_CHUNK_BYTES, data_message, digest_to_proto, read_message
from services.coordinator.server import CoordinatorServer
from services.coordinator.standby import StandbyConfig, StandbyFollower
from tests.support import (
    Env,
    T,
    code_of,
    config,
    gauge,
    make_upload,
    pb,
    register,
    requests,
    scrape,
    submit,
    wait_for,
)

pytestmark = pytest.mark.timeout(90)
State = tuple[torch.Tensor, dict[str, Any]]
DECLARED = common_pb2.POWER_SOURCE_DECLARED


def copy_state(params: torch.Tensor, outer: dict[str, Any]) -> State:
    return params.clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in outer.items()}


def same_bits(a: State, b: State) -> bool:
    if not torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)) or a[1].keys() != b[1].keys():
        return False
    for k, v in a[1].items():
        w = b[1][k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and torch.equal(v.view(torch.int32), w.view(torch.int32))):
                return False
        elif v != w:
            return False
    return True


class Leader:
    """The leader in process, one learner (declaring its power: its work is counted in joules), and a copy of Θ and
    the outer state at every version it publishes."""

    def __init__(self, env: Env, ids: str = "s") -> None:
        self.env = env
        self.ids = ids  # submission ids are ids + a count: unique per learner, as a real learner's (a uuid prefix)
        self.reg = register(env, throughput=common_pb2.Throughput(watts=300.0, power_source=DECLARED))
        self.states: dict[int, State] = {}
        self._keep()
        self.n = 0

    def _keep(self) -> None:
        core = self.env.server.core
        with self.env.server.state.work:
            self.states[core.version] = copy_state(core.params, core.outer.state_dict())

    def round(self, codec: str = "fp32") -> int:
        """One learner submission, which closes a round (the only learner): returns the version it made."""
        self.n += 1
        h, data, _ = make_upload(self.env, self.reg, f"{self.ids}{self.n}", codec=codec, seed=self.n)
        resp = submit(self.env, h, data)
        assert resp.outcome == pb.SUBMISSION_OUTCOME_APPLIED
        self._keep()
        return int(resp.version)


class Follower:
    """A standby following the leader, with a copy of its state at every version it reached."""

    def __init__(self, env: Env, replica_id: str = "standby-1", **kw: Any) -> None:
        self.chan = channel(env.server.address)
        self.states: dict[int, State] = {}
        self.f = StandbyFollower(
            StandbyConfig(replica_id, **kw),
            self.chan,
            fingerprint=env.server.task.fingerprint,
            numel=env.numel,
            on_version=self._record,
        )

    def _record(self, version: int) -> None:  # on the follower's thread, right after it applied `version`
        s = self.f.standby
        self.states[version] = copy_state(s.params, s.outer.state_dict())

    def start(self) -> Follower:
        self.f.start()
        return self

    def stop(self) -> None:
        self.f.stop()
        self.chan.close()

    def reach(self, version: int) -> None:
        """Wait until the standby holds `version` (and `on_version` recorded it)."""
        wait_for(f"the standby to hold version {version}", lambda: max(self.states, default=-1) >= version, 20.0)


@pytest.fixture
def followers() -> Iterator[Callable[..., Follower]]:
    made: list[Follower] = []

    def make(env: Env, replica_id: str = "standby-1", **kw: Any) -> Follower:
        f = Follower(env, replica_id, **kw)
        made.append(f)
        return f.start()

    yield make
    for f in made:
        f.stop()


def test_a_standby_holds_the_leaders_bits_at_every_version(
    start: Callable[..., Env], followers: Callable[..., Follower]
) -> None:
    env = start(replication_log=4)
    leader = Leader(env)
    leader.round()  # before the standby: it starts from a snapshot of version 1
    f = followers(env)
    f.reach(1)
    for i in range(6):
        v = leader.round("int8" if i % 2 else "fp32")
        f.reach(v)
    assert set(f.states) == set(range(1, 8))
    for v, state in f.states.items():
        assert same_bits(state, leader.states[v]), f"version {v} differs"
    assert "buf" in leader.states[7][1] and leader.states[7][1]["buf"] is not None  # momentum was compared too
    assert f.f.snapshots == 1 and f.f.resyncs == 0 and not f.f.failed
    assert list(f.f.standby.applied) == [f"s{i}" for i in range(1, 8)]


def test_a_restarted_standby_catches_up_from_its_checkpoint_or_else_from_a_snapshot(
    start: Callable[..., Env], followers: Callable[..., Follower], tmp_path: Path
) -> None:
    env = start(replication_log=2)
    leader = Leader(env)
    ckpt = tmp_path / "standby"
    f = followers(env, checkpoint_dir=str(ckpt), checkpoint_every=1)
    for _ in range(3):
        f.reach(leader.round())
    assert f.f.snapshots == 1
    f.stop()  # killed
    v = leader.round()  # version 4: the log (2 entries) still holds what the standby misses
    again = followers(env, checkpoint_dir=str(ckpt), checkpoint_every=1)
    again.reach(v)
    assert again.f.snapshots == 0, "resumed from its checkpoint at version 3: entry 4 was enough"
    # it told its version at the start (what a replica publishes in etcd: the newest holder takes over first)
    assert sorted(again.states) == [3, 4] and same_bits(again.states[3], leader.states[3])
    assert same_bits(again.states[4], leader.states[4])
    again.stop()
    for _ in range(4):
        v = leader.round()  # versions 5..8: the log now starts after version 6
    third = followers(env, checkpoint_dir=str(ckpt), checkpoint_every=1)
    third.reach(v)
    assert third.f.snapshots == 1, "version 4 is no longer in the leader's log: a snapshot"
    assert same_bits(third.states[v], leader.states[v])
    v = leader.round()
    third.reach(v)
    assert same_bits(third.states[v], leader.states[v])

    # a coordinator started on the standby's checkpoints resumes where the leader is (a manual failover)
    third.stop()
    successor = CoordinatorServer(config(checkpoint_dir=str(ckpt)))
    try:
        successor.start()
        assert successor.core.version == v
        state = copy_state(successor.core.params, successor.core.outer.state_dict())
        assert same_bits(state, leader.states[v])
        assert successor.core.ledger.committed_tokens() == env.server.core.ledger.committed_tokens()
        # the fleet's energy came with the round log's bookkeeping, into the standby's checkpoints
        assert successor.state.placement.book.joules == env.server.state.placement.book.joules > 0
    finally:
        successor.stop(0)
    assert checkpoint.load_latest(ckpt) is not None


def test_with_a_byte_cap_of_one_entry_a_late_or_restarted_standby_catches_up_from_a_snapshot_bit_for_bit(
    start: Callable[..., Env], followers: Callable[..., Follower], tmp_path: Path
) -> None:
    """`--replication-log 8 --replication-log-bytes 1`: the log keeps the newest entry alone (the byte cap, not the
    entry count, drops the others): a standby joining late, or restarted two versions behind, gets a snapshot and
    then tails entry by entry, holding the leader's bits; the metrics show what the log holds."""
    env = start(replication_log=8, replication_log_bytes=1)
    metric = env.server.metrics.registry.get_sample_value
    leader = Leader(env)
    for _ in range(3):
        leader.round()
    assert metric("diloco_replication_log_entries") == 1 and metric("diloco_replication_log_max_bytes") == 1
    entry_bytes = metric("diloco_replication_log_bytes")
    assert entry_bytes is not None and 4 * env.numel < entry_bytes < 4 * env.numel + (1 << 20)  # Δ + bookkeeping
    ckpt = tmp_path / "standby"
    f = followers(env, checkpoint_dir=str(ckpt), checkpoint_every=1)
    f.reach(3)
    for _ in range(2):
        f.reach(leader.round())
    assert f.f.snapshots == 1 and f.f.resyncs == 0 and not f.f.failed
    for v, state in f.states.items():
        assert same_bits(state, leader.states[v]), f"version {v} differs"
    f.stop()
    for _ in range(2):
        v = leader.round()  # versions 6, 7: 8 entries would have covered them; one entry's bytes do not
    again = followers(env, checkpoint_dir=str(ckpt), checkpoint_every=1)
    again.reach(v)
    assert again.f.snapshots == 1, "version 5 is behind the byte-capped window: a snapshot"
    v = leader.round()
    again.reach(v)
    assert same_bits(again.states[v], leader.states[v]) and same_bits(again.states[v - 1], leader.states[v - 1])
    assert metric("diloco_replication_log_entries") == 1
    ha = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).ha
    assert (ha.log_oldest_version, ha.log_version, ha.log_entries) == (v - 1, v, 1)
    assert ha.log_bytes == metric("diloco_replication_log_bytes") and ha.log_max_bytes == 1


def test_a_standby_ahead_of_a_restarted_leader_goes_back_to_its_state(
    start: Callable[..., Env], followers: Callable[..., Follower], tmp_path: Path
) -> None:
    """The leader crashes after version 5 with its newest checkpoint at version 4 and restarts (same address, a newer
    epoch): the standby, holding the lost version 5, gets a snapshot of version 4 and then the new history."""
    ckpt = tmp_path / "leader"
    env = start(replication_log=4, checkpoint_dir=str(ckpt), checkpoint_every=2)
    leader = Leader(env)
    f = followers(env)
    for _ in range(4):
        f.reach(leader.round())
    # checkpoints are written off the round path, the newest one due at a time: under load version 4's could be
    # passed over for version 5's (which the crash below takes away)
    wait_for("version 4's checkpoint", lambda: checkpoint.checkpoint_path(ckpt, 4).exists(), 20.0)
    f.reach(leader.round())
    port, epoch = env.server.port, env.server.state.epoch
    env.chan.close()
    env.server.stop(0)
    checkpoint.checkpoint_path(ckpt, 5).unlink()  # the crash came before version 5 was checkpointed
    env2 = start(replication_log=4, checkpoint_dir=str(ckpt), checkpoint_every=2, port=port)
    assert env2.server.core.version == 4 and env2.server.state.epoch > epoch
    wait_for("the standby to take the new leader's snapshot", lambda: f.f.snapshots == 2, 20.0)
    assert f.f.version == 4 and f.f.standby.epoch == env2.server.state.epoch
    assert same_bits(f.states[4], leader.states[4])
    f.states.clear()  # what it recorded of the lost history
    successor = Leader(env2, ids="b")  # another learner: its own ids (the restart remembers s1..s4 as applied)
    for _ in range(2):
        v = successor.round()
        f.reach(v)
        assert same_bits(f.states[v], successor.states[v])
    assert not same_bits(successor.states[5], leader.states[5])  # a new history: another version 5
    assert f.f.resyncs == 0 and not f.f.failed


def test_with_sync_replicas_a_version_is_published_only_once_the_standby_holds_it(
    start: Callable[..., Env], followers: Callable[..., Follower]
) -> None:
    env = start(replication_log=4, sync_replicas=1, replica_ack_timeout_s=20.0)
    leader = Leader(env)
    f = followers(env)
    f.reach(0)
    for _ in range(4):
        started = time.monotonic()
        v = leader.round()
        assert (f.f.version or 0) >= v, "the leader answered the round's submission before the standby held it"
        assert time.monotonic() - started < 10.0  # acks, not the 20 s timeout
        assert same_bits(f.states[v], leader.states[v])
    f.stop()  # gone: the next rounds do not wait for it
    started = time.monotonic()
    leader.round()
    assert time.monotonic() - started < 5.0


def test_a_run_of_degraded_versions_is_logged_once_and_counted_each(
    start: Callable[..., Env], followers: Callable[..., Follower]
) -> None:
    """No standby follows: every version is published degraded. One warning when that starts (not one per round),
    the metric counts every version, and `replication.restored` says how many there were once a standby holds the
    newest version again."""
    with structlog.testing.capture_logs() as logs:
        env = start(replication_log=4, sync_replicas=1, replica_ack_timeout_s=20.0)
        leader = Leader(env)
        for _ in range(3):
            leader.round()
        assert [r["version"] for r in logs if r["event"] == "replication.degraded"] == [1]
        assert gauge(env, "degraded_versions_total") == 3
        f = followers(env)
        f.reach(3)
        leader.round()  # waited for the standby: restored
        (restored,) = [r for r in logs if r["event"] == "replication.restored"]
        assert (restored["version"], restored["degraded_versions"], restored["quiet_versions"]) == (4, 3, 2)
        assert gauge(env, "degraded_versions_total") == 3
        assert len([r for r in logs if r["event"] == "replication.degraded"]) == 1


def held_submission(env: Env, leader: Leader) -> tuple[threading.Thread, list[object]]:
    """A submission closing a round, sent on a thread of its own (a held round answers it late): the thread, and
    what it got (the response or the RpcError)."""
    leader.n += 1
    h, data, _ = make_upload(env, leader.reg, f"{leader.ids}{leader.n}", seed=leader.n)
    got: list[object] = []

    def send() -> None:
        try:
            got.append(env.stub.SubmitPseudoGradient(iter(requests(h, data)), timeout=60))
        except grpc.RpcError as e:
            got.append(e)

    thread = threading.Thread(target=send, name="held-submission", daemon=True)
    thread.start()
    return thread, got


def test_waiting_for_a_standby_a_version_is_held_until_a_new_standby_holds_it(
    start: Callable[..., Env], followers: Callable[..., Follower]
) -> None:
    """--when-no-standby wait, no standby: the round's version is not published and its submission not answered,
    however long (here past the 1 s ack timeout); the time held is counted as it passes. A standby that joins then
    gets its snapshot (taken by the round holding the tensors) and acknowledges; the version goes out."""
    with structlog.testing.capture_logs() as logs:
        env = start(replication_log=4, sync_replicas=1, replica_ack_timeout_s=1.0, when_no_standby="wait")
        leader = Leader(env)
        thread, got = held_submission(env, leader)
        wait_for("the round to be held", lambda: any(r["event"] == "replication.holding" for r in logs), 20.0)
        wait_for("1.5 s held, counted", lambda: (gauge(env, "held_seconds_total") or 0.0) >= 1.5, 20.0)
        assert env.server.state.published().version == 0 and not got, "a held version reached learners"
        assert gauge(env, "holding") == 1 and gauge(env, "held_versions_total") == 1
        f = followers(env)
        thread.join(30)
        (resp,) = got
        assert isinstance(resp, pb.SubmitPseudoGradientResponse) and resp.outcome == pb.SUBMISSION_OUTCOME_APPLIED
        assert resp.version == 1 and env.server.state.published().version == 1 and f.f.version == 1
        (released,) = [r for r in logs if r["event"] == "replication.released"]
        assert released["version"] == 1 and released["acked"] == ["standby-1"] and released["held_s"] >= 1.5
        assert gauge(env, "holding") == 0 and gauge(env, "degraded_versions_total") == 0
        assert not [r for r in logs if r["event"] == "replication.degraded"]
        leader._keep()
        f.reach(1)
        assert same_bits(f.states[1], leader.states[1])
        leader.round()  # followed now: acknowledged, published at once
        assert gauge(env, "held_versions_total") == 1


def test_a_held_version_is_withheld_when_the_coordinator_stops(start: Callable[..., Env]) -> None:
    """Stopping while a version is held: it is never published, and the submission that closed its round is told to
    resend (UNAVAILABLE), not that it was applied."""
    with structlog.testing.capture_logs() as logs:
        env = start(replication_log=4, sync_replicas=1, replica_ack_timeout_s=1.0, when_no_standby="wait")
        leader = Leader(env)
        thread, got = held_submission(env, leader)
        wait_for("the round to be held", lambda: any(r["event"] == "replication.holding" for r in logs), 20.0)
        env.server.stop(0)
        thread.join(30)
        (err,) = got
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
        assert "resend" in (err.details() or "")
        assert env.server.state.published().version == 0 and env.server.core.version == 1
        assert [r["version"] for r in logs if r["event"] == "replication.withheld"] == [1]
        assert [r["version"] for r in logs if r["event"] == "round.unpublished"] == [1]


def test_a_stalled_standby_costs_one_bounded_wait(start: Callable[..., Env]) -> None:
    env = start(replication_log=4, sync_replicas=1, replica_ack_timeout_s=1.0)
    leader = Leader(env)
    chan = channel(env.server.address)
    stub = replication_pb2_grpc.ReplicationStub(chan)
    request = rpb.FollowLogRequest(replica_id="stalled", fingerprint=env.server.task.fingerprint)
    stream = stub.FollowLog(request, timeout=60)  # follows, never acknowledges
    try:
        first = next(stream)
        assert first.WhichOneof("kind") == "snapshot" and first.snapshot.version == 0
        started = time.monotonic()
        leader.round()
        waited = time.monotonic() - started
        assert 1.0 <= waited < 6.0, f"the first round waited {waited:.2f} s for the stalled standby"
        started = time.monotonic()
        leader.round()
        assert time.monotonic() - started < 1.0, "a lagging standby is not waited for again"
        # it acknowledges the newest version (caught up): it is waited for again
        version = env.server.core.version
        with env.server.state.work:
            held = digest_to_proto(digest(env.server.core.params, env.server.core.outer))
        resp = stub.AckLog(rpb.AckLogRequest(replica_id="stalled", version=version, digest=held), timeout=T)
        assert resp.leader_version == version
        started = time.monotonic()
        leader.round()
        assert time.monotonic() - started >= 1.0
    finally:
        stream.cancel()
        chan.close()


def test_refusals(start: Callable[..., Env]) -> None:
    env = start(replication_log=2)
    Leader(env).round()
    chan = channel(env.server.address)
    stub = replication_pb2_grpc.ReplicationStub(chan)
    fp = env.server.task.fingerprint
    try:
        parts = Fingerprint.parse(fp)
        assert parts is not None
        other = str(dataclasses.replace(parts, model="0" * len(parts.model)))
        code, details = code_of(
            lambda: next(stub.FollowLog(rpb.FollowLogRequest(replica_id="x", fingerprint=other), timeout=T))
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "model" in details and "standby x" in details
        code, _ = code_of(lambda: next(stub.FollowLog(rpb.FollowLogRequest(fingerprint=fp), timeout=T)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, details = code_of(
            lambda: next(
                stub.FollowLog(
                    rpb.FollowLogRequest(replica_id="x", fingerprint=fp, epoch=env.server.state.epoch + 1), timeout=T
                )
            )
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not the leader" in details
        code, details = code_of(
            lambda: stub.AckLog(
                rpb.AckLogRequest(replica_id="x", version=1, digest=rpb.StateDigest(params_crc32=1)), timeout=T
            )
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "resync" in details
        code, _ = code_of(lambda: stub.AckLog(rpb.AckLogRequest(replica_id="x" * 300), timeout=T))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        chan.close()
    plain = start()  # no --replication-log: no replication service
    chan = channel(plain.server.address)
    try:
        stub = replication_pb2_grpc.ReplicationStub(chan)
        code, _ = code_of(lambda: next(stub.FollowLog(rpb.FollowLogRequest(replica_id="x", fingerprint=fp), timeout=T)))
        assert code == grpc.StatusCode.UNIMPLEMENTED
    finally:
        chan.close()


def test_python_m_services_coordinator_follow_of_another_task_exits_2_naming_what_differs(
    start: Callable[..., Env],
) -> None:
    env = start(replication_log=2)
    # the default task: another model and data than the leader's tiny one
    args = ["--follow", env.server.address, "--insecure", "--replica-id", "s-cli", "--max-bytes", "200000"]
    proc = subprocess.run(
        [sys.executable, "-m", "services.coordinator", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "refused this standby" in proc.stderr and "model" in proc.stderr


def test_a_follow_standby_serves_its_role_version_lag_and_epoch_on_its_metrics_port(
    start: Callable[..., Env], tmp_path: Path
) -> None:
    """`python -m services.coordinator --follow ... --metrics-port 0`: a real standby process, scraped over HTTP."""
    env = start(replication_log=4)
    leader = Leader(env)
    leader.round()
    task = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "4"]
    args = ["--follow", env.server.address, "--insecure", "--replica-id", "s-metrics", "--metrics-port", "0"]
    log = tmp_path / "standby.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.coordinator", *args, *task, "--max-bytes", "400000", "--shards", "8"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        events = LogFollower(log)
        lines: list[LogLine] = []

        def started() -> LogLine | None:
            lines.extend(events.read())
            assert proc.poll() is None, [x.fields for x in lines]
            return next((x for x in lines if x.event == "standby.started"), None)

        port = int(str(wait_for("the standby to start", started, 60.0).fields["metrics_port"]))
        assert port > 0

        def at(version: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            """The scrape once the standby applied `version` and the leader answered its ack of it (the lag is
            the leader's word: no series before that answer)."""
            m = scrape(port)
            lag_known = ("diloco_standby_lag_versions", ()) in m
            return m if m.get(("diloco_standby_version", ())) == version and lag_known else None

        m = wait_for("the standby to report version 1", lambda: at(1), 60.0)
        role = {labels[0][1]: v for (name, labels), v in m.items() if name == "diloco_replica_role"}
        assert role == {"leader": 0.0, "standby": 1.0, "candidate": 0.0}
        assert m[("diloco_standby_epoch", ())] == float(env.server.state.epoch)
        assert m[("diloco_standby_lag_versions", ())] == 0
        assert m[("diloco_standby_snapshots_total", ())] == 1 and m[("diloco_standby_resyncs_total", ())] == 0
        assert not [k for k in m if k[0].startswith("diloco_coordinator_")], "a standby serves no leader metrics"
        leader.round()
        leader.round()
        m = wait_for("the standby to report version 3", lambda: at(3), 30.0)
        assert m[("diloco_standby_lag_versions", ())] == 0 and m[("diloco_standby_snapshots_total", ())] == 1
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


# --- the data messages' bytes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, LOG_CHUNK_BYTES])
def test_a_data_message_is_the_bytes_protobuf_makes_and_reads_back_as_a_view(size: int) -> None:
    chunk = memoryview(bytes(range(256)) * (size // 256 + 1))[:size]
    raw = data_message(chunk)
    assert raw == rpb.LogMessage(data=bytes(chunk)).SerializeToString()
    got = read_message(raw)
    assert isinstance(got, memoryview) and bytes(got) == bytes(chunk)


def test_read_message_parses_anything_but_a_lone_data_field() -> None:
    header = rpb.LogMessage(entry=rpb.EntryHeader(version=3, numel=5, payload_crc32=9))
    assert read_message(header.SerializeToString()) == header
    mixed = data_message(memoryview(b"abc")) + header.SerializeToString()  # the oneof's last field wins
    assert read_message(mixed) == rpb.LogMessage.FromString(mixed) == header
    with pytest.raises(DecodeError):
        read_message(data_message(memoryview(b"abcdef"))[:-1])  # cut short: not taken as a shorter chunk


def test_a_client_of_the_generated_stub_reads_the_stream(start: Callable[..., Env]) -> None:
    """The data messages made without protobuf are protobuf: a client built from the protos alone (the generated
    stub, gRPC's default channel) reassembles a snapshot whose payload checks against its header."""
    env = start(replication_log=2)
    Leader(env).round()
    chan = grpc.insecure_channel(env.server.address)
    stub = replication_pb2_grpc.ReplicationStub(chan)
    request = rpb.FollowLogRequest(replica_id="plain", fingerprint=env.server.task.fingerprint)
    stream = stub.FollowLog(request, timeout=60)
    try:
        header = next(stream).snapshot
        size = 4 * header.numel * (1 + len(header.outer_tensors)) + header.bookkeeping_bytes
        payload = bytearray()
        while len(payload) < size:
            msg = next(stream)
            assert msg.WhichOneof("kind") == "data"
            payload += msg.data
        assert len(payload) == size and zlib.crc32(payload) == header.payload_crc32 and header.version == 1
    finally:
        stream.cancel()
        chan.close()


@pytest.mark.parametrize(("leader_fragments", "standby_fragments"), [(1, 2), (2, 1), (2, 3)])
def test_a_standby_with_another_fragment_layout_than_the_leaders_is_refused_for_good(
    start: Callable[..., Env], leader_fragments: int, standby_fragments: int
) -> None:
    """A standby started with another `--fragments` than the leader's: the leader's snapshot is refused as another
    layout (`LayoutMismatch`), which no snapshot can fix: the follower stops, `failed` naming the flag, as for a
    leader refusing another task, instead of asking for a snapshot again and again."""
    env = start(replication_log=2, fragments=leader_fragments, min_quorum=1, expected_workers=1)
    model = env.server.task.model_fn(env.server.cfg.seed)
    layout = layout_for(standby_fragments, env.server.cfg.local_steps, merge_segments(model))
    chan = channel(env.server.address)
    follower = StandbyFollower(
        StandbyConfig("standby-other"), chan, fingerprint=env.server.task.fingerprint, numel=env.numel, layout=layout
    )
    try:
        follower.start()
        assert follower.wait(20.0), "the follower went on asking"
        assert "--fragments" in follower.failed and follower.version is None, follower.failed
        assert follower.snapshots == 0 and follower.resyncs == 0
    finally:
        follower.stop()
        chan.close()
