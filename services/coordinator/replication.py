"""The leader's side of round-log replication (ALGORITHM.md section 11; the rules are in
`diloco.core.replication`): `ReplicationLog` appends an entry after every round and holds a version back from the
learners until enough standbys acknowledged it, and `ReplicationServicer` (`diloco.v1.Replication`) streams the log
to standbys (`services.coordinator.standby`).

Threads and locks. `CoordinatorCore.on_step` hands over each round's Δ just before the outer step (with fragments,
`FragmentedCoordinator.on_step` each stepped fragment's Δ[p] before its step), the state's
`on_stepped` hook calls `round_stepped` just after it, and the server's round hook calls `round_applied` once the
broadcast is encoded: all run holding the state's `work` lock, before the new version is published.
`round_stepped` builds the entry (the bookkeeping read under the state's `lock`), appends it and wakes the
streams, which send it while the leader encodes its broadcast; `round_applied`, with `sync_replicas` > 0, then
waits, still holding `work`, until the standbys acknowledged it or the wait ends (`SyncGate`; with
`--when-no-standby wait` it ends only with the acks, or when the log stops: the version is then withheld): while it
waits, uploads are not folded in (control calls go on). Snapshots for standbys are copied under `work` on a thread of
their own, never on the event loop; while a round holds `work` waiting, that round's thread copies them for the
standbys that ask (a standby joining then could otherwise never acknowledge the version held). The log's own
condition (`_cond`) is a leaf lock.

Epoch. The coordinator epoch is the log's: under etcd leadership (`--etcd`) it is the leadership epoch; without
it, a new one at every start, so a restarted leader's messages are newer than its previous incarnation's and a
standby never goes back to an older one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from diloco import log as logging
from diloco.core.coordinator import Accepted, RoundApplied
from diloco.core.leadership import LeadershipView, Role
from diloco.core.replication import (
    Digest,
    EntryMeta,
    Gate,
    GateDecision,
    LogEntry,
    LogUsage,
    ReplicaLag,
    RoundLog,
    Snapshot,
    SnapshotMeta,
    SyncGate,
    WhenNoStandby,
    snapshot_tensor_bytes,
    state_digest,
)
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.rpc import status
from diloco.rpc.limits import MAX_ID_CHARS
from diloco.rpc.payload import chunks
from diloco.rpc.server import LoopSignal
from diloco.task.factory import fingerprint_mismatch
from diloco.v1 import replication_pb2 as rpb
from diloco.v1 import replication_pb2_grpc
from services.coordinator.state import CoordinatorState

SERVICE_NAME = "diloco.v1.Replication"
# the payload's pieces on FollowLog: few messages (each costs the stream a fixed overhead), each under gRPC's
# default limit on a received message (4 MiB)
LOG_CHUNK_BYTES = (4 << 20) - (1 << 10)
_DATA_TAG = b"\x1a"  # LogMessage.data: field 3, length-delimited
HOLD_COUNT_S = 1.0  # while a version is held (--when-no-standby wait), the held time is counted this often
SNAPSHOT_RETRY_S = 0.05  # a snapshot asked for tries to take `work` this often (a round holding it takes it meanwhile)
T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]


# --- protos <-> domain (both ends use these) ---------------------------------------------------------------------


def digest_to_proto(d: Digest) -> rpb.StateDigest:
    return rpb.StateDigest(params_crc32=d.params_crc32, outer_crc32=d.outer_crc32)


def digest_from_proto(d: rpb.StateDigest) -> Digest:
    return Digest(d.params_crc32, d.outer_crc32)


def header_to_proto(meta: EntryMeta | SnapshotMeta) -> rpb.LogMessage:
    if isinstance(meta, EntryMeta):
        return rpb.LogMessage(
            entry=rpb.EntryHeader(
                version=meta.version,
                epoch=meta.epoch,
                learners=meta.learners,
                numel=meta.numel,
                bookkeeping_bytes=meta.bookkeeping_bytes,
                payload_crc32=meta.payload_crc32,
                digest=digest_to_proto(meta.digest),
                fragments=list(meta.fragments),
            )
        )
    return rpb.LogMessage(
        snapshot=rpb.SnapshotHeader(
            version=meta.version,
            epoch=meta.epoch,
            numel=meta.numel,
            outer_tensors=list(meta.outer_tensors),
            bookkeeping_bytes=meta.bookkeeping_bytes,
            payload_crc32=meta.payload_crc32,
            digest=digest_to_proto(meta.digest),
        )
    )


def header_from_proto(msg: rpb.LogMessage) -> EntryMeta | SnapshotMeta | None:
    """The header a message holds (None: it holds data)."""
    kind = msg.WhichOneof("kind")
    if kind == "entry":
        e = msg.entry
        return EntryMeta(
            e.version,
            e.epoch,
            e.learners,
            e.numel,
            e.bookkeeping_bytes,
            e.payload_crc32,
            digest_from_proto(e.digest),
            tuple(e.fragments),  # checked against the standby's layout by its `Receiver` (`entry_numel`)
        )
    if kind == "snapshot":
        s = msg.snapshot
        return SnapshotMeta(
            s.version,
            s.epoch,
            s.numel,
            tuple(s.outer_tensors),
            s.bookkeeping_bytes,
            s.payload_crc32,
            digest_from_proto(s.digest),
        )
    return None


def encode(item: LogEntry | Snapshot, chunk_bytes: int = LOG_CHUNK_BYTES) -> Iterator[rpb.LogMessage | bytes]:
    """The messages of one entry or snapshot, made as they are taken: its header, then its payload in pieces of at
    most `chunk_bytes`, already serialised (`data_message`)."""
    yield header_to_proto(item.meta)
    for part in item.payload():
        for c in chunks(part, chunk_bytes=chunk_bytes):
            yield data_message(c)


def data_message(chunk: bytes | memoryview) -> bytes:
    """A `LogMessage` holding only `data`, serialised byte for byte as protobuf does it, made with one copy of
    `chunk` (building the message, then serialising it, copies the chunk twice)."""
    return b"".join((_DATA_TAG, _varint(len(chunk)), chunk))


def read_message(raw: bytes) -> rpb.LogMessage | memoryview:
    """FollowLog's response deserializer on the standby: a message holding only `data` as a view of its bytes (not
    copied out of a parsed message), anything else parsed."""
    if raw[:1] == _DATA_TAG:
        size, at = _read_varint(raw, 1)
        if at + size == len(raw):
            return memoryview(raw)[at:]
    return rpb.LogMessage.FromString(raw)


def _serialize(message: rpb.LogMessage | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(raw: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and where it ends (-1 for the value when `raw` holds no complete one of at most 64 bits)."""
    n = shift = 0
    for i in range(at, min(len(raw), at + 10)):
        n |= (raw[i] & 0x7F) << shift
        if raw[i] < 0x80:
            return n, i + 1
        shift += 7
    return -1, len(raw)


def add_to_server(servicer: ReplicationServicer, server: grpc.aio.Server) -> None:
    """Registers `servicer` as the generated `add_ReplicationServicer_to_server` does, except that FollowLog's
    responses made by `data_message` go out as they are."""
    handlers = {
        "FollowLog": grpc.unary_stream_rpc_method_handler(
            servicer.FollowLog,
            request_deserializer=rpb.FollowLogRequest.FromString,
            response_serializer=_serialize,
        ),
        "AckLog": grpc.unary_unary_rpc_method_handler(
            servicer.AckLog,
            request_deserializer=rpb.AckLogRequest.FromString,
            response_serializer=rpb.AckLogResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]  # not in the stubs


def follow_log(channel: grpc.Channel) -> Callable[..., Any]:
    """The standby's FollowLog callable: as the generated stub's, with `read_message` as the deserializer."""
    return channel.unary_stream(
        f"/{SERVICE_NAME}/FollowLog",
        request_serializer=rpb.FollowLogRequest.SerializeToString,
        response_deserializer=read_message,
    )


# --- the log ------------------------------------------------------------------------------------------------------


class _SnapshotAsk:
    """A snapshot a standby waits for: taken by whichever thread holds `work` first (`ReplicationLog.snapshot`)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.snapshot: Snapshot | None = None

    def give(self, snapshot: Snapshot) -> None:
        if not self.done.is_set():
            self.snapshot = snapshot
            self.done.set()


class ReplicationLog:
    """The leader's round log, its followers and the publish gate; thread-safe (module docstring)."""

    def __init__(
        self,
        state: CoordinatorState,
        *,
        entries: int,
        max_bytes: int = 0,
        sync_replicas: int = 0,
        ack_timeout_s: float = 5.0,
        when_no_standby: WhenNoStandby = WhenNoStandby.PUBLISH,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.epoch = state.epoch
        self.clock = clock
        core = state.core
        with state.work:  # max_bytes 0: the bytes of a snapshot's tensors (docs/ha.md, "The round log's size")
            cap = max_bytes or snapshot_tensor_bytes(core.params.numel(), core.outer)
            self._log = RoundLog(core.version, self._digest(), entries, cap)
        self._gate = SyncGate(sync_replicas, ack_timeout_s, when_no_standby)
        self._gate.appended(core.version)
        self._cond = threading.Condition()
        # under `work`: the round stepping: its version, the live learners, and its Δ (with fragments: each stepped
        # fragment's, in order)
        self._pending: tuple[int, int, list[tuple[int, torch.Tensor]]] | None = None
        self._appended_at = 0.0  # under `work`: when the newest entry was appended (its ack wait counts from then)
        self._listeners: list[Callable[[], None]] = []
        self._degraded = 0  # versions published degraded in a row (0: not degraded)
        self._quiet = 0  # of those, the ones not logged (nobody missed a deadline: no standby followed, or lagged)
        self._asks: list[_SnapshotAsk] = []  # under `_cond`: snapshots wanted by standbys, not taken yet
        self._held: tuple[int, float] | None = None  # under `_cond`: the version held back (WAIT) and since when
        self.stopping = False
        self.log = logging.get("coordinator", epoch=state.epoch)
        core.on_step = self._on_step
        if state.frag is not None:
            state.frag.on_step = self._on_fragment_step
        state.on_stepped = self.round_stepped

    @property
    def sync_replicas(self) -> int:
        return self._gate.required

    @property
    def max_entries(self) -> int:
        return self._log.max_entries

    @property
    def newest(self) -> int:
        with self._cond:
            return self._log.newest

    def usage(self) -> LogUsage:
        with self._cond:
            return self._log.usage()

    def held(self) -> tuple[int, float] | None:
        """The version held back now (`--when-no-standby wait`: too few standbys acknowledged it) and the seconds
        it has been held; None when none is."""
        with self._cond:
            held = self._held
        return None if held is None else (held[0], max(0.0, self.clock() - held[1]))

    def _digest(self) -> Digest:
        """Under `work`: the digest of the state now (with fragments, over their outer optimizers)."""
        core, frag = self.state.core, self.state.frag
        return state_digest(core.params, core.outer, frag.outers if frag is not None else ())

    def _on_step(self, version: int, delta: torch.Tensor, learners: int) -> None:
        """Under `work`, just before the outer step: keep a copy of the Δ it takes (the merge buffer is reused)."""
        self._pending = (version, learners, [(-1, delta.clone())])

    def _on_fragment_step(self, version: int, p: int, delta: torch.Tensor, learners: int) -> None:
        """Under `work`, just before fragment p's outer step (with fragments): keep a copy of its Δ[p]; a round
        stepping several fragments calls it for each, in fragment order."""
        if self._pending is None or self._pending[0] != version:
            self._pending = (version, learners, [])
        self._pending[2].append((p, delta.clone()))

    def round_stepped(self, applied: RoundApplied) -> None:
        """Under `work`, just after a round's step: append its entry and wake the streams."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != applied.version or not pending[2]:
            raise RuntimeError(f"round {applied.version} was applied without its Δ reaching the replication log")
        _, learners, parts = pending
        fragments = [p for p, _ in parts if p >= 0]
        delta = torch.cat([d for _, d in parts]) if len(parts) > 1 else parts[0][1]
        after = self._digest()
        snap = self.state.snapshot()  # the bookkeeping (its tensors are not used)
        outcomes = {p.submission_id: Accepted.of(p, applied.version, True) for p in applied.submissions}
        entry = LogEntry.make(applied.version, self.epoch, learners, delta, snap, outcomes, after, fragments)
        with self._cond:
            self._log.append(entry)
            self._gate.appended(entry.version)
            listeners = list(self._listeners)

        self._appended_at = self.clock()
        # one line per version: the digest a standby's `replication.applied` line must show for it
        self.log.info(
            "replication.appended",
            version=entry.version,
            params_crc32=after.params_crc32,
            outer_crc32=after.outer_crc32,
            **({"fragments": fragments} if self.state.frag is not None else {}),
        )
        for listener in listeners:
            listener()

    def round_applied(self, applied: RoundApplied) -> bool:
        """Under `work`, after a round's step and its broadcast, before it is published: with `sync_replicas`, wait
        for the standbys to acknowledge its entry (appended by `round_stepped`). False: do not publish it (the log
        stopped while the version was held for a standby: no learner may receive a version no standby holds)."""
        with self._cond:
            newest = self._log.newest
        if newest != applied.version:
            raise RuntimeError(f"round {applied.version} was applied without its entry in the replication log")
        return self._await_acks(applied.version, self._appended_at)

    def _await_acks(self, version: int, since: float) -> bool:
        if not self._gate.required:
            return True
        held_at: float | None = None  # when the gate first said HOLD for this version
        counted = 0.0  # of the time held, what `held_seconds` counts already
        while True:
            with self._cond:
                asks, self._asks = self._asks, []
                if not asks:
                    d = self._gate.decide(version, since, self.clock())
                    if self.stopping or d.gate in (Gate.PUBLISH, Gate.DEGRADED):
                        break
                    if d.gate is Gate.HOLD and held_at is None:
                        held_at = self.clock()
                        self._held = (version, held_at)
                        self._holding(version, d)
                    self._cond.wait(HOLD_COUNT_S if d.gate is Gate.HOLD else max(0.0, d.deadline - self.clock()))
            for ask in asks:  # standbys asking for a snapshot while this thread holds `work`: it takes them
                ask.give(self._snapshot_now())
            if held_at is not None:
                counted = self._count_held(held_at, counted)
        if held_at is not None:
            self._count_held(held_at, counted)
            self.state.metrics.holding.set(0)
            with self._cond:
                self._held = None
        if d.gate in (Gate.WAIT, Gate.HOLD):  # the log stopped first
            if self._gate.when_no_standby is WhenNoStandby.PUBLISH:
                return True
            self.log.warning("replication.withheld", version=version, reason="stopping", acked=list(d.acked))
            return False
        if held_at is not None:
            self.log.info(
                "replication.released", version=version, acked=list(d.acked), held_s=round(self.clock() - held_at, 4)
            )
            return True
        self._published_after(version, d, since)
        return True

    def _holding(self, version: int, d: GateDecision) -> None:
        self.state.metrics.held_versions.inc()
        self.state.metrics.holding.set(1)
        self.log.warning(
            "replication.holding",
            version=version,
            required=self._gate.required,
            acked=list(d.acked),
            behind=list(d.missing),
            hint="--when-no-standby wait: learners get this version once a standby acknowledges it; start a "
            "standby (another replica with the same flags) or see `diloco ctl status`",
        )

    def _count_held(self, held_at: float, counted: float) -> float:
        """Add the time held since the last count to `held_seconds`; returns the time counted so far."""
        total = self.clock() - held_at
        self.state.metrics.held_seconds.inc(max(0.0, total - counted))
        return max(counted, total)

    def _published_after(self, version: int, d: GateDecision, since: float) -> None:
        """Log and count a version published after the bounded wait (degraded, or restored after degraded ones)."""
        with self._cond:
            degraded, was, quiet = d.gate is Gate.DEGRADED, self._degraded, self._quiet
            # logged when it starts and when a standby misses a deadline (a wait it cost); the rest is counted
            logged = degraded and (not was or bool(d.missing))
            self._degraded = was + 1 if degraded else 0
            self._quiet = (quiet + (not logged)) if degraded else 0
        waited_s = round(self.clock() - since, 4)
        if degraded:
            self.state.metrics.degraded_versions.inc()
        if logged:
            self.log.warning(
                "replication.degraded",
                version=version,
                required=self._gate.required,
                acked=list(d.acked),
                lagging=list(d.missing),
                waited_s=waited_s,
            )
        elif was and not degraded:
            self.log.info(
                "replication.restored",
                version=version,
                acked=list(d.acked),
                waited_s=waited_s,
                degraded_versions=was,
                quiet_versions=quiet,
            )

    def snapshot(self) -> Snapshot:
        """The whole state at the newest version, copied under `work` (heavy: run it off the event loop). While a
        round holds `work` waiting for acknowledgements, the waiting thread takes the copy (a standby joining then
        must get its snapshot, or it could never acknowledge the version held)."""
        ask = _SnapshotAsk()
        with self._cond:
            self._asks.append(ask)
            self._cond.notify_all()
        try:
            while not ask.done.is_set():
                if self.state.work.acquire(timeout=SNAPSHOT_RETRY_S):
                    try:
                        if not ask.done.is_set():
                            ask.give(self._snapshot_now())
                    finally:
                        self.state.work.release()
            assert ask.snapshot is not None
            return ask.snapshot
        finally:
            with self._cond:
                if ask in self._asks:
                    self._asks.remove(ask)

    def _snapshot_now(self) -> Snapshot:
        with self.state.work:
            return Snapshot.of_core(self.state.snapshot(), self.epoch)

    def since(self, held: int | None, held_digest: Digest | None) -> list[LogEntry] | None:
        with self._cond:
            return self._log.since(held, held_digest)

    def follow(self, replica_id: str) -> None:
        with self._cond:
            self._gate.follow(replica_id)

    def unfollow(self, replica_id: str) -> None:
        with self._cond:
            self._gate.unfollow(replica_id)
            self._cond.notify_all()  # a waiting round may now be short of followers

    def ack(self, replica_id: str, version: int, held: Digest) -> int:
        """A standby holds `version` with digest `held`. Returns the newest version appended. A digest other than
        the log's for that version is refused (the standby must resync) and not counted."""
        with self._cond:
            known = self._log.digest_of(version)
            newest = self._log.newest
            if known is not None and known != held:
                raise FailedPrecondition(
                    f"standby {replica_id} holds other bits than the leader at version {version}; resync from a "
                    "snapshot"
                )
            if version > newest:
                raise FailedPrecondition(
                    f"standby {replica_id} acknowledges version {version}, beyond this leader's {newest}; resync "
                    "from a snapshot"
                )
            self._gate.ack(replica_id, version)
            self._cond.notify_all()
        return newest

    def replicas(self) -> tuple[ReplicaLag, ...]:
        """The standbys following now and how far behind the newest entry each is."""
        with self._cond:
            return self._gate.replicas()

    def wait_held(self, version: int, timeout_s: float) -> tuple[str, ...]:
        """Wait up to `timeout_s` until a following standby acknowledged `version` (or a newer one); returns those
        holding it (empty: none did in time, or the log stopped)."""
        deadline = self.clock() + timeout_s
        with self._cond:
            while True:
                held = self._gate.holding(version)
                left = deadline - self.clock()
                if held or left <= 0 or self.stopping:
                    return held
                self._cond.wait(left)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` after every appended entry and on stop; it must not block."""
        with self._cond:
            self._listeners.append(listener)

    def stop(self) -> None:
        """Stop waiting for acks and end the streams. Safe to call twice."""
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


# --- what operators see -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HaView:
    """High availability as GetStatus and the metrics show it (docs/ha.md): who leads under which epoch, and the
    standbys following this coordinator's round log with their lag."""

    replica_id: str  # "" without --etcd
    leader_id: str  # "" without --etcd, or when nobody is known to lead
    leader_address: str
    epoch: int  # the leadership epoch (0 without --etcd)
    is_leader: bool  # this replica holds the leader key (without --etcd: it leads its standbys)
    sync_replicas: int
    log_version: int  # the newest version in the round log (lag counts from it)
    replicas: tuple[ReplicaLag, ...]
    log: LogUsage | None = None  # what the round log holds (None: no round log)
    held: tuple[int, float] | None = None  # the version held back for a standby's acknowledgement, and seconds held


def ha_view(leadership: LeadershipView | None, log: ReplicationLog | None, address: str) -> HaView | None:
    """The view of a coordinator at `address` under `leadership` (None: no --etcd) keeping `log` (None: no round
    log); None when it has neither."""
    if leadership is None and log is None:
        return None
    leader = leadership.leader if leadership is not None else None
    return HaView(
        replica_id=leadership.replica_id if leadership is not None else "",
        leader_id=leader.replica_id if leader is not None else "",
        leader_address=leader.address if leader is not None else ("" if leadership is not None else address),
        epoch=leadership.epoch if leadership is not None else 0,
        is_leader=leadership.role is Role.LEADER if leadership is not None else True,
        sync_replicas=log.sync_replicas if log is not None else 0,
        log_version=log.newest if log is not None else 0,
        replicas=log.replicas() if log is not None else (),
        log=log.usage() if log is not None else None,
        held=log.held() if log is not None else None,
    )


# --- the servicer -------------------------------------------------------------------------------------------------


def _require_id(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(f"{field} is required")
    if len(value) > MAX_ID_CHARS or not value.isprintable():
        raise InvalidArgument(f"{field} must be at most {MAX_ID_CHARS} printable characters")
    return value


class ReplicationServicer(replication_pb2_grpc.ReplicationServicer):
    """Thin gRPC layer over `ReplicationLog`. `work`: the executor snapshots are copied on (off the loop). Messages
    are made as they are sent (`encode`: one copy of each piece, on the loop), so an entry's first bytes go out at
    once and no stream holds a serialised copy of a whole entry."""

    def __init__(
        self, log: ReplicationLog, *, fingerprint: str, work: Executor, chunk_bytes: int = LOG_CHUNK_BYTES
    ) -> None:
        self.log = log
        self.fingerprint = fingerprint
        self.work = work
        self.chunk_bytes = chunk_bytes
        self.changed = LoopSignal()
        log.add_listener(self.changed.notify)

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.work, fn, *args)

    @status.streaming
    async def FollowLog(self, request: rpb.FollowLogRequest, context: Context) -> AsyncIterator[rpb.LogMessage | bytes]:
        replica = _require_id(request.replica_id, "replica_id")
        if not request.fingerprint:
            raise InvalidArgument("fingerprint is required: send the fingerprint of the task the standby built")
        mismatch = fingerprint_mismatch(request.fingerprint, self.fingerprint)
        if mismatch:
            raise FailedPrecondition(f"standby {replica} was refused: {mismatch}")
        if request.epoch > self.log.epoch:
            raise FailedPrecondition(
                f"standby {replica} has seen leadership epoch {request.epoch}, newer than this coordinator's "
                f"({self.log.epoch}): this coordinator is not the leader; follow the current one"
            )
        held: int | None = request.held_version if request.HasField("held_version") else None
        held_digest: Digest | None = digest_from_proto(request.held_digest) if held is not None else None
        self.log.follow(replica)
        self.log.log.info("replication.follower_joined", replica_id=replica, held_version=held)
        try:
            while not self.log.stopping:
                changed = self.changed.waiter()  # before reading: an entry appended after this wakes it
                entries = self.log.since(held, held_digest)
                if entries is None:
                    snap = await self._blocking(self.log.snapshot)
                    for m in encode(snap, self.chunk_bytes):
                        yield m
                    self.log.log.info(
                        "replication.snapshot_sent", replica_id=replica, version=snap.version, held_version=held
                    )
                    held, held_digest = snap.version, snap.digest
                    continue
                if not entries:
                    await changed.wait()
                    continue
                for entry in entries:
                    for m in encode(entry, self.chunk_bytes):  # sent as made: the first bytes go out at once
                        yield m
                    held, held_digest = entry.version, entry.digest
        finally:
            self.log.unfollow(replica)
            self.log.log.info("replication.follower_left", replica_id=replica, held_version=held)

    @status.unary
    async def AckLog(self, request: rpb.AckLogRequest, context: Context) -> rpb.AckLogResponse:
        replica = _require_id(request.replica_id, "replica_id")
        newest = self.log.ack(replica, request.version, digest_from_proto(request.digest))
        return rpb.AckLogResponse(leader_version=newest)
