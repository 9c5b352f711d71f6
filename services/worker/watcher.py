"""The parameter watcher: one thread per registration that streams every new version of the global parameters
(WatchParameters, follow) and posts each as a `Delivered` to the worker's inbox. The header carries the
learner's plan, the applied submission ids and whether the job finished, so the learner needs no GetStatus or
GetWorkPlan per round. It reconnects with capped, jittered backoff; what each status code means comes from
`diloco.core.learner.REACTIONS`.

A broadcast is a full snapshot or a delta to the version held (ALGORITHM.md section 10); `BroadcastFollower` says
whether a delta applies. A delta is kept encoded, its crc32 checked, and queued on the learner's `HeldParams`: the
training loop applies it in place when it adopts the version (no second model-sized vector; `replica.py`). A
refused delta (not for the version held, or outside the parameters) or a corrupt payload is dropped and the watch
restarts from version 0 (a full snapshot).

A fresh learner hands the watcher the version 0 it built itself (`version0`: the task's model from the coordinator's
init seed); until the first version is delivered, each watch names it with its checksum (`held_checksum`), and the
coordinator answers with the deltas from it, or a header saying it holds the current version (`held`), or, when its
own version 0 differs or is gone, a full snapshot as for any learner.

A header from another coordinator epoch ends the registration (`SessionLost`), unless the epoch is higher and the
header carries this learner's plan: a standby that took over with the learner table knows it, so the watcher
adopts the new epoch and the learner goes on (`LearnerCore.params_arrived`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
import torch

from diloco.core.broadcast import BroadcastFollower, HeldParams, Refusal, params_checksum
from diloco.core.learner import Reaction, Rpc, react
from diloco.errors import InvalidArgument
from diloco.rpc.payload import PayloadBytes, PayloadReceiver, meta_from_proto, release_pages
from diloco.rpc.retry import Backoff
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.worker.session import Broadcast, SessionLost


@dataclass(frozen=True)
class Delivered:
    """One complete version: its header and the learner's `Θ̂` that leads to it (`held.at(version)`: the deltas
    queued until then applied in place)."""

    broadcast: Broadcast
    held: HeldParams


@dataclass(frozen=True)
class WatchFailed:
    """A stream attempt failed with a code the table retries."""

    worker_id: str
    code: str


class Watcher:
    def __init__(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        worker_id: str,
        epoch: int,
        numel: int,
        post: Callable[[object], None],
        log: structlog.stdlib.BoundLogger,
        failover: Callable[[str, str], bool] = lambda _details, _tried: False,
        version0: torch.Tensor | None = None,
        address: Callable[[], str] = lambda: "",
        vector: Callable[[], torch.Tensor | None] = lambda: None,
    ) -> None:
        self.stub, self.worker_id, self.epoch, self.numel = stub, worker_id, epoch, numel
        self.post, self.log = post, log
        self.failover = failover  # FAILOVER: move to another coordinator address (`rpc.coordinators`)
        self.address = address  # the coordinator address in use
        self.vector = vector  # where a snapshot is decoded (`Replica.theta_hat_vector`); None: a new vector
        self.follower = BroadcastFollower()  # touched by the watch thread only
        # the version 0 this learner built and its checksum, named until a version is delivered or it is refused
        self._own: tuple[torch.Tensor, int] | None = None
        if version0 is not None:
            self._own = (version0, params_checksum(version0))
            release_pages(version0)  # read whole for its checksum (a mapped file's pages leave resident memory)
        self._closed = threading.Event()
        self._call: grpc.Future | None = None  # type: ignore[type-arg]
        self._thread = threading.Thread(target=self._run, name=f"watch-{worker_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop streaming (safe to call twice); returns once the thread has ended."""
        self._closed.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = Backoff()
        after = 0
        while not self._closed.is_set():
            req = coordinator_pb2.WatchParametersRequest(worker_id=self.worker_id, after_version=after, follow=True)
            if after == 0 and self._own is not None:
                self.follower.snapshot(0, *self._own)  # the base of the deltas from version 0
                req.held_checksum = self._own[1]
            refusal: grpc.RpcError | None = None  # its retry hint, if any, sets the least wait before the next try
            tried = self.address()
            try:
                call = self.stub.WatchParameters(req)
                self._call = call
                if self._closed.is_set():
                    call.cancel()
                receiver: PayloadReceiver | PayloadBytes | None = None
                receiving_since = 0.0
                header: coordinator_pb2.ParametersHeader | None = None
                for msg in call:
                    if msg.HasField("header"):
                        header = msg.header
                        if header.coordinator_epoch != self.epoch:
                            if header.coordinator_epoch < self.epoch or not header.HasField("plan"):
                                self.post(SessionLost(self.worker_id, "coordinator restarted (new epoch)"))
                                return
                            # a standby took over knowing this learner (its plan came): stay registered
                            self.log.info("worker.taken_over", epoch=header.coordinator_epoch, version=header.version)
                            self.epoch = header.coordinator_epoch
                            if header.HasField("delta_from"):  # a delta of another leader's broadcast history
                                call.cancel()
                                after = 0
                                break
                        if header.held:
                            if not self._held(header):
                                call.cancel()
                                after = 0
                                break
                            after, receiver = header.version, None
                            backoff.reset()
                            continue
                        receiver = self._receiver(header)
                        receiving_since = time.monotonic()
                        continue
                    if receiver is None or header is None:
                        continue
                    receiver.feed(msg.data)
                    if receiver.received == receiver.meta.encoded_bytes:
                        held = self._apply(header, receiver)
                        if held is None:
                            self._own = None  # refused: from now on a snapshot, as for any learner
                            call.cancel()
                            after = 0
                            break
                        self.log.info(
                            "worker.broadcast_received",
                            version=header.version,
                            delta_from=header.delta_from if header.HasField("delta_from") else None,
                            start=header.delta_start,  # a delta covers numel values from here (fragments: a range)
                            numel=receiver.meta.numel,
                            bytes=receiver.meta.encoded_bytes,
                            # a snapshot: received and decoded; a delta: received (applied where it is adopted)
                            seconds=round(time.monotonic() - receiving_since, 4),
                        )
                        self._own = None
                        self.post(Delivered(Broadcast.from_proto(self.worker_id, header), held))
                        after, receiver = header.version, None
                        backoff.reset()
            except grpc.RpcError as e:
                refusal = e
                if self._closed.is_set():
                    return
                reaction = react(Rpc.WATCH_PARAMETERS, e.code().name)
                if reaction is Reaction.REREGISTER:
                    self.post(SessionLost(self.worker_id, e.details() or e.code().name))
                    return
                if reaction is Reaction.FAILOVER and self.failover(e.details() or "", tried):
                    backoff.reset()  # another replica: the first try there is prompt, not this outage's n-th
                self.log.warning("worker.watch_retry", code=e.code().name, details=e.details())
                self.post(WatchFailed(self.worker_id, e.code().name))  # counts toward giving up
                after = 0  # the next stream starts with the current version: its arrival shows contact again
            except InvalidArgument as e:  # a codec or enum value this build does not know: retried, never fatal
                self.log.error("worker.watch_unreadable", error=str(e))
                self.post(WatchFailed(self.worker_id, "UNIMPLEMENTED"))
                after = 0
            except Exception:  # a fault no status covers: the thread goes on, else the learner waits for good
                if self._closed.is_set():
                    return
                self.log.exception("worker.watch_crashed")
                self.post(WatchFailed(self.worker_id, "UNKNOWN"))
                after = 0
            if self._closed.wait(backoff.next_s(refusal)):
                return

    def _held(self, header: coordinator_pb2.ParametersHeader) -> bool:
        """The coordinator says this learner holds `header`'s version (its own version 0, named with its checksum):
        deliver it. False (logged): it named nothing, or something else; the watch restarts from a snapshot."""
        own, self._own = self._own, None
        held = self.follower.held
        if own is None or held is None or self.follower.version != header.version or own[1] != header.params_checksum:
            self.log.warning("worker.broadcast_refused", reason="held", version=header.version)
            return False
        self.log.info("worker.broadcast_held", version=header.version, checksum=own[1])
        self.post(Delivered(Broadcast.from_proto(self.worker_id, header), held))
        return True

    def _receiver(self, header: coordinator_pb2.ParametersHeader) -> PayloadReceiver | PayloadBytes:
        """A snapshot is decoded into a new vector; a delta is kept encoded, to be queued if its base is held
        (else refused at its end: received to keep the stream in step). One that does not fit the model is
        received against the whole model's size, which refuses it."""
        meta = meta_from_proto(header.payload)
        # a delta covers payload.numel values from delta_start (fragments: the range a round stepped)
        if header.HasField("delta_from") and meta.numel >= 1 and header.delta_start + meta.numel <= self.numel:
            return PayloadBytes(meta, meta.numel)
        out = self.vector() if meta.numel == self.numel and not header.HasField("delta_from") else None
        return PayloadReceiver(meta, self.numel, out=out)

    def _apply(
        self, header: coordinator_pb2.ParametersHeader, receiver: PayloadReceiver | PayloadBytes
    ) -> HeldParams | None:
        """The learner's `Θ̂` leading to `header`'s version, from its received payload; None: refused (logged)."""
        if isinstance(receiver, PayloadReceiver):
            flat = receiver.finish()
            if not header.HasField("delta_from"):
                release_pages(flat)  # decoded (a mapped file's pages: out of resident memory until adopted)
                return self.follower.snapshot(header.version, flat, header.params_checksum)
            got: HeldParams | Refusal = Refusal.NO_BASE  # does not fit the model: received, then refused
        else:
            data = receiver.finish()
            meta = receiver.meta
            got = self.follower.delta(
                header.version, header.delta_from, meta, data, header.params_checksum, header.delta_start
            )
        if isinstance(got, Refusal):
            self.log.warning(
                "worker.broadcast_refused",
                reason=got.value,
                version=header.version,
                delta_from=header.delta_from,
                held=self.follower.version,
            )
            return None
        return got
