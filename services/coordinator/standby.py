"""A hot standby coordinator (ALGORITHM.md section 11): follows the leader's round log (`diloco.v1.Replication`)
and holds its state bit for bit, version by version (`diloco.core.replication.Standby`).

One thread: it opens `FollowLog` with what it holds (nothing at first), loads the snapshot the leader sends when
it must, applies every entry after it in order, and acknowledges each version (`AckLog`, which is what the
leader's `--sync-replicas` waits for). A refused message (a gap, an older epoch, a corrupt payload, a digest that
does not match) changes nothing; the standby then drops the stream and asks again holding nothing, so the next
thing it gets is a snapshot (`replication.resync`); one of another fragment layout (`LayoutMismatch`: started
with another `--fragments` than the leader's) is final, as a refusal by the leader is. A broken stream (the leader
restarted, the network) is opened again with capped, jittered backoff, holding what it holds, so the leader sends
only the entries it misses. A refusal by the leader (another task: FAILED_PRECONDITION) is final: `failed` says
why and the thread ends.

With `checkpoint_dir`, the standby writes its state every `checkpoint_every` versions in the coordinator's
checkpoint format: a coordinator started on that folder resumes from the standby's version (a manual failover
until leadership is wired in; see docs/ha.md).

    python -m services.coordinator --follow LEADER:PORT --replica-id standby-1 [the leader's task flags]
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from diloco import log as logging
from diloco.core.fragments import FragmentLayout, layout_for
from diloco.core.replication import LayoutMismatch, Receiver, ResyncReason, ResyncRequired, Snapshot, Standby
from diloco.errors import ConfigError
from diloco.rpc.retry import Backoff, BackoffConfig
from diloco.task.factory import build_task
from diloco.task.params import flatten_params, merge_segments
from diloco.v1 import replication_pb2 as rpb
from diloco.v1 import replication_pb2_grpc
from services.coordinator import checkpoint
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.metrics import StandbyView
from services.coordinator.replication import digest_to_proto, follow_log, header_from_proto


@dataclass(frozen=True)
class StandbyConfig:
    replica_id: str
    call_timeout_s: float = 5.0  # the deadline of an AckLog call
    checkpoint_dir: str = ""  # "": no checkpoints
    checkpoint_every: int = 5  # versions between checkpoints
    keep_checkpoints: int = 3
    backoff: BackoffConfig = field(default_factory=lambda: BackoffConfig(initial_s=0.1, max_s=2.0))

    def __post_init__(self) -> None:
        if not self.replica_id or len(self.replica_id) > 256 or not self.replica_id.isprintable():
            raise ConfigError(f"replica_id must be 1-256 printable characters, got {self.replica_id!r}")
        if not self.call_timeout_s > 0:
            raise ConfigError(f"call_timeout_s must be > 0, got {self.call_timeout_s}")
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise ConfigError("checkpoint_every and keep_checkpoints must be >= 1")


class StandbyFollower:
    """Follows one leader over `channel` (made with the admin token: the Replication RPCs need it). `start()` and
    `stop()` are safe to call twice; `version` is what it holds (None: nothing yet)."""

    def __init__(
        self,
        cfg: StandbyConfig,
        channel: grpc.Channel,
        *,
        fingerprint: str,
        numel: int,
        layout: FragmentLayout | None = None,
        on_version: Callable[[int], None] | None = None,
        on_acked: Callable[[int], None] | None = None,
    ) -> None:
        """`on_version(v)`: the standby's state is at version v (applied, or resumed from its checkpoint at the start);
        `on_acked(v)`: the leader accepted its acknowledgement of v (the leader holds the same bits at v: this
        standby is in step with it); `layout`: the fragments it runs (the leader's --fragments; None: none)."""
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.standby = Standby(numel, layout)
        self.on_version = on_version
        self.on_acked = on_acked
        self.failed = ""  # why the leader refused this standby for good ("" while following)
        self.resyncs = 0  # refusals that made it ask for a snapshot
        self.snapshots = 0  # snapshots loaded from the leader
        self._stub = replication_pb2_grpc.ReplicationStub(channel)
        self._follow_log = follow_log(channel)  # data messages as views of the received bytes
        self._rx = Receiver(numel, reuse=True, layout=layout)  # each message is applied before the next starts
        self._lock = threading.Lock()  # the standby's state: applied on the thread, read by `held`/`checkpoint`
        self._stop = threading.Event()
        self._call: Any = None  # the open FollowLog call (cancelled by `stop`)
        self._thread: threading.Thread | None = None
        self._resync = False  # ask holding nothing: the next thing is a snapshot
        self._last_ckpt = -1
        self._header_at = 0.0  # when the header of the message being received came (monotonic)
        self.written: int | None = None  # the version of the newest checkpoint this follower wrote itself
        self._leader_version: int | None = None  # under `_lock`: the leader's newest, as its last ack answer said
        self.log = logging.get("coordinator", role="standby", replica_id=cfg.replica_id)

    @property
    def version(self) -> int | None:
        with self._lock:
            return self.standby.version

    def view(self) -> StandbyView:
        """What this standby holds, for its metrics."""
        with self._lock:
            s = self.standby
            return StandbyView(s.version, self._leader_version, s.epoch, self.snapshots, self.resyncs)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="standby-follow", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the thread ends (stopped, or refused for good)."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout_s)
        return not t.is_alive()

    # --- the loop ---------------------------------------------------------------------------------------------------
    def _request(self) -> rpb.FollowLogRequest:
        with self._lock:
            s = self.standby
            req = rpb.FollowLogRequest(replica_id=self.cfg.replica_id, fingerprint=self.fingerprint, epoch=s.epoch)
            if s.version is not None and s.digest is not None and not self._resync:
                req.held_version = s.version
                req.held_digest.CopyFrom(digest_to_proto(s.digest))
        return req

    def _resume(self) -> None:
        """Start from the newest checkpoint in `checkpoint_dir`, if any: the leader then sends only the entries
        after it when its log still holds them (else a snapshot, as for a standby holding nothing)."""
        found = checkpoint.load_latest(self.cfg.checkpoint_dir) if self.cfg.checkpoint_dir else None
        if found is None:
            return
        snap, path = found
        try:
            with self._lock:
                self.standby.load(Snapshot.of_core(snap, 0))
        except (ResyncRequired, KeyError, TypeError, ValueError) as e:
            self.log.warning("replication.resume_failed", path=str(path), error=str(e))
            return
        self._last_ckpt = version = self.standby.version or 0
        self.log.info("replication.resumed", path=str(path), version=version)
        if self.on_version is not None:
            self.on_version(version)

    def _run(self) -> None:
        self._resume()
        backoff = Backoff(self.cfg.backoff)
        while not self._stop.is_set():
            request = self._request()
            call = self._follow_log(request)  # endless: keepalive, not a deadline, finds a dead leader
            self._call = call
            if self._stop.is_set():  # `stop` ran before the call was visible to it
                call.cancel()
            try:
                for msg in call:
                    if self._receive(msg):
                        backoff.reset()
                if self._stop.is_set():
                    break
                self.log.info("replication.stream_ended", version=self.version)
            except LayoutMismatch as e:  # another --fragments than the leader's: final, as another task is
                call.cancel()
                self.failed = str(e)
                self.log.error("replication.refused", error=self.failed)
                return
            except ResyncRequired as e:
                call.cancel()
                self._resync, self.resyncs = True, self.resyncs + 1
                self.log.warning("replication.resync", reason=e.reason.value, error=str(e), version=self.version)
            except grpc.RpcError as e:
                if self._stop.is_set():
                    break
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.failed = e.details() or "refused"
                    self.log.error("replication.refused", error=self.failed)
                    return
                self.log.info("replication.retry", code=e.code().name, version=self.version)
            except Exception:  # e.g. a checkpoint that could not be written: keep following after a pause
                call.cancel()
                self.log.exception("replication.follow_failed", version=self.version)
            finally:
                self._call = None
                self._rx.reset()  # a stream cut mid-payload leaves nothing half received
            self._stop.wait(backoff.next_s())

    def _receive(self, msg: rpb.LogMessage | memoryview) -> bool:
        """One message (a data message as the bytes it holds); True when it completed a snapshot or an entry
        (applied and acknowledged)."""
        meta = None if isinstance(msg, memoryview) else header_from_proto(msg)
        if meta is not None:
            self._header_at = time.monotonic()
            got = self._rx.start(meta)
        else:
            got = self._rx.feed(msg if isinstance(msg, memoryview) else msg.data)
        if got is None:
            return False
        received = time.monotonic()
        with self._lock:
            if isinstance(got, Snapshot):
                self.standby.load(got)
                self._resync = False
                self.snapshots += 1
                self.log.info("replication.snapshot_loaded", version=got.version, epoch=got.epoch)
            else:
                self.standby.apply(got, scratch_delta=True)  # its Δ came off the wire: ours
                # one line per version, as the leader's `round.closed`: what the standby holds and when, and how
                # long the entry took to arrive (header to last byte) and to apply (the step, the digest)
                held = self.standby.digest
                assert held is not None
                self.log.info(
                    "replication.applied",
                    version=got.version,
                    epoch=got.epoch,
                    params_crc32=held.params_crc32,  # the leader's `replication.appended` line has the same
                    outer_crc32=held.outer_crc32,
                    **({"fragments": list(got.fragments)} if got.fragments else {}),
                    receive_s=round(received - self._header_at, 4),
                    apply_s=round(time.monotonic() - received, 4),
                )
            version = got.version
        if self.on_version is not None:
            self.on_version(version)
        self._ack(version)
        self._checkpoint(version)
        with self._lock:  # off the critical path: the next entry's step then starts without copying the state
            self.standby.prepare()
        return True

    def _ack(self, version: int) -> None:
        """Tell the leader (best effort: a lost ack only makes the leader's gate wait or degrade); a leader that
        holds other bits at this version refuses it, and the standby resyncs."""
        with self._lock:
            digest = self.standby.digest
            epoch = self.standby.epoch
        assert digest is not None
        request = rpb.AckLogRequest(
            replica_id=self.cfg.replica_id, version=version, epoch=epoch, digest=digest_to_proto(digest)
        )
        try:
            answer = self._stub.AckLog(request, timeout=self.cfg.call_timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the leader holds other bits at this version
                raise ResyncRequired(ResyncReason.CHECKSUM, f"the leader refused the ack: {e.details()}") from None
            self.log.info("replication.ack_failed", version=version, code=e.code().name)  # the gate copes
            return
        with self._lock:
            self._leader_version = answer.leader_version
        if self.on_acked is not None:
            self.on_acked(version)

    def _checkpoint(self, version: int) -> None:
        cfg = self.cfg
        if not cfg.checkpoint_dir or (self._last_ckpt >= 0 and version - self._last_ckpt < cfg.checkpoint_every):
            return
        started = time.monotonic()
        path, saved = checkpoint.save(cfg.checkpoint_dir, self.standby.core_snapshot, keep=cfg.keep_checkpoints)
        self._last_ckpt = self.written = saved
        self.log.info("checkpoint.saved", path=str(path), version=saved, seconds=round(time.monotonic() - started, 3))


def follower_from(cfg: CoordinatorServiceConfig) -> tuple[StandbyFollower, grpc.Channel]:
    """The standby a coordinator configuration with `follow` describes (its task, security and checkpoints), and
    the channel it follows the leader over (the caller closes it after `stop`)."""
    task = build_task(cfg.task)
    model = task.model_fn(cfg.seed)
    numel = flatten_params(model).numel()
    layout = layout_for(cfg.fragments, cfg.local_steps, merge_segments(model))  # the leader's, from the same flags
    replica_id = cfg.replica_id or f"standby-{socket.gethostname()}"
    scfg = StandbyConfig(
        replica_id,
        checkpoint_dir=cfg.checkpoint_dir,
        checkpoint_every=cfg.checkpoint_every,
        keep_checkpoints=cfg.keep_checkpoints,
    )
    chan = cfg.security.channel(cfg.follow, admin=True)
    return StandbyFollower(scfg, chan, fingerprint=task.fingerprint, numel=numel, layout=layout), chan
