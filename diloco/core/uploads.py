"""Resumable, idempotent uploads of pseudo-gradients (ALGORITHM.md section 9) as one pure object.

No gRPC, no clock reads (`now` is a parameter), no threads, no locks. Both transports (the gRPC stream and the
raw-TCP bulk port) drive the same `Uploads` with one call per transport event:

    open(header, now, known, version)   a stream starts: a new upload, a resume at a byte offset, or a
                                        duplicate of an accepted submission (answered with its earlier outcome:
                                        `known`, what the round's side holds of it, `CoordinatorCore.accepted`)
    storage(stream)                     where the stream may receive its bytes in place (bulk port), if anywhere
    chunk(stream, data, now)            payload bytes: checked (decoded) at once and kept by the upload's receiver
    end(stream)                         the stream ended: verify the payload and hand it over (`Complete`)
    broken(stream)                      the stream broke mid-payload: the bytes held stay for a resume
    closed(stream)                      the stream is gone, however it ended (every `open` has one `closed`)
    status(worker_id, id, known, now)   (bytes held, complete), for a client deciding where to resume
    tick(now)                           expire uploads idle for `ttl_s`

and two calls from the round's side: `accepted` (an upload was accepted: its size, for `status`) and `drop_worker`.

What a duplicate is answered with comes from the round's side alone (`Accepted`: whose it is, its round, its
staleness, applied or not), not from this table: the table is this process's, while applied outcomes are in the
coordinator's checkpoints and round log, so a coordinator that took over from another answers a duplicate of a
submission applied there the same way (ALGORITHM.md section 11).

An upload's life, per submission id:

    (none) --open @0--> RECEIVING --chunk*--> RECEIVING --end, all bytes, valid--> COMPLETE (handed over, dropped)
    RECEIVING --broken / a stream that just goes--> IDLE (bytes kept) --open @held--> RECEIVING (resumed)
    RECEIVING/IDLE --open @0--> RECEIVING (restarted; the older stream stops)     IDLE --ttl_s--> (dropped)
    RECEIVING --bad bytes--> FAILED (dropped; the client restarts at 0)            IDLE --room needed--> (evicted)

Every `open` hands out a `Stream` with a generation; a newer stream of the same upload (a resume or a restart)
bumps it, so an older stream still sending gets `FailedPrecondition` and stops.

Bounds: `max_per_worker` uploads per learner and `max_partial` in all, counting idle ones kept for a resume.
Idle ones are evicted oldest first to make room; when every upload in the way is streaming, the new one is
refused (RESOURCE_EXHAUSTED).

Concurrency is the caller's: calls about one submission id must not run at the same time, and the table calls
(`open`, `closed`, `status`, `tick`, `accepted`, `drop_worker`, `counts`) must not run at the
same time as each other; `storage`, `chunk`, `end` and `broken` touch only their own upload, so uploads of different
submissions decode in parallel. Refusals are `UploadRefused`, carrying the domain error and a short reason for
metrics; the caller decides how to count and log them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.core.codecs import CodecError, EncodedMeta
from diloco.core.coordinator import Accepted, Submission
from diloco.core.merge import EncodedDelta
from diloco.errors import (
    AlreadyExists,
    ConfigError,
    DilocoError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)

_DONE_RECORDS = 8192  # sizes of accepted uploads remembered (GetUploadStatus of a duplicate)


class UploadRefused(Exception):
    """An upload event refused: `error` is what the client gets, `reason` a short label for metrics."""

    def __init__(self, error: DilocoError, reason: str, dropped: tuple[Dropped, ...] = ()) -> None:
        super().__init__(str(error))
        self.error = error
        self.reason = reason
        self.dropped = dropped  # idle uploads evicted before the refusal (room was made, but not enough)


class Decoder(Protocol):
    """A streaming payload receiver (`diloco.rpc.payload.UploadReceiver`; tests may use `PayloadReceiver`)."""

    @property
    def received(self) -> int: ...

    def feed(self, data: bytes | memoryview) -> None: ...

    def finish(self) -> torch.Tensor | EncodedDelta: ...

    def storage(self) -> memoryview | None:
        """Where the bytes not yet received will be kept (a transport may receive straight into it, and `feed`
        views of it), or None: `feed` copies them in."""
        ...

    def resumed(self) -> None:
        """Another stream takes the upload over: what `storage` lent an earlier one is no longer where the bytes
        are kept (that stream may still be writing into it)."""
        ...


@dataclass(frozen=True)
class UploadLimits:
    numel: int  # the model's parameters: every payload decodes to this many (without fragments)
    max_bytes: int  # the largest encoded payload accepted
    ttl_s: float  # an idle partial upload is kept this long for a resume
    max_partial: int  # uploads held in all (streaming or idle)
    max_per_worker: int = 2
    # streaming fragments (`diloco.core.fragments`): fragment p's payload decodes to fragment_numels[p]; () none
    fragment_numels: tuple[int, ...] = ()

    def numel_of(self, fragment: int) -> int:
        """What a payload of `fragment` decodes to (the caller checked the index: `FragmentLayout.check_index`)."""
        return self.fragment_numels[fragment] if self.fragment_numels else self.numel

    def __post_init__(self) -> None:
        if self.numel < 1 or self.max_bytes < 1:
            raise ConfigError("upload limits: numel and max_bytes must be >= 1")
        if not self.ttl_s > 0:
            raise ConfigError(f"upload ttl_s must be > 0, got {self.ttl_s}")
        if not 1 <= self.max_per_worker <= self.max_partial:
            raise ConfigError(f"max_per_worker ({self.max_per_worker}) must be in [1, max_partial={self.max_partial}]")


@dataclass(frozen=True)
class UploadHeader:
    """A decoded `SubmissionHeader`."""

    sub: Submission
    coordinator_epoch: int
    meta: EncodedMeta
    resume_offset: int
    fragment: int = 0  # streaming fragments: the fragment the payload is of (0 without)
    layout: str = ""  # streaming fragments: the layout's fingerprint the learner cut it with ("" without)


@dataclass(frozen=True)
class Outcome:
    """What a submission came to (the reply of its upload, and of any duplicate of it)."""

    applied: bool  # merged into the global parameters (else pending)
    version: int  # newest global version at the time of the reply
    staleness: int
    round: int  # the version the submission produces (or produced)


@dataclass
class Upload:
    """One submission's bytes so far."""

    sub: Submission
    meta: EncodedMeta
    decoder: Decoder
    started_at: float
    touched_at: float
    fragment: int = 0  # streaming fragments: the fragment the payload is of
    gen: int = 0  # bumped by every stream that takes the upload over, and when it completes or fails
    streams: int = 0  # streams feeding it now; 0: idle, kept for a resume
    over: bool = False  # completed or failed: the table drops it

    @property
    def received(self) -> int:
        return self.decoder.received


@dataclass(frozen=True)
class Stream:
    """One transport stream feeding one upload."""

    upload: Upload
    gen: int

    @property
    def expected_bytes(self) -> int:
        """The payload bytes this stream must still carry."""
        return self.upload.meta.encoded_bytes - self.upload.received


@dataclass(frozen=True)
class Dropped:
    """An upload dropped before it completed: evicted to make room, or expired."""

    submission_id: str
    worker_id: str
    received: int
    why: str  # "per_worker", "total" (evicted for room) or "expired"


@dataclass(frozen=True)
class Opened:
    stream: Stream
    dropped: tuple[Dropped, ...]  # idle uploads evicted to make room for this one


@dataclass(frozen=True)
class Complete:
    """A payload received in full and verified, handed to the round's side."""

    sub: Submission
    meta: EncodedMeta
    payload: torch.Tensor | EncodedDelta
    started_at: float
    fragment: int = 0  # streaming fragments: the fragment the payload is of


class Uploads:
    """The upload table (see the module docstring). `decoder(header)` makes the decoder of a new upload."""

    def __init__(self, limits: UploadLimits, decoder: Callable[[UploadHeader], Decoder]) -> None:
        self.limits = limits
        self._decoder = decoder
        self._table: OrderedDict[str, Upload] = OrderedDict()  # oldest first
        self._done: OrderedDict[str, int] = OrderedDict()  # submission id -> encoded bytes, of accepted uploads

    # --- transport events -------------------------------------------------------------------------------------
    def open(self, h: UploadHeader, now: float, known: Accepted | None, version: int) -> Outcome | Opened:
        """A stream starts with header `h`. `known`: what the round's side holds of the submission id (None: the
        caller has admitted a submission it does not know); `version`: the newest global version. Returns the
        earlier outcome of a duplicate, or the stream to feed."""
        earlier = self._earlier(h.sub, known, version)
        if earlier is not None:
            return earlier
        sub, lim = h.sub, self.limits
        self._prune(now)
        try:
            h.meta.validate(expected_numel=lim.numel_of(h.fragment))
        except CodecError as e:
            raise UploadRefused(e, "bad_payload_spec") from None
        if h.meta.encoded_bytes > lim.max_bytes:
            raise UploadRefused(
                ResourceExhausted(
                    f"payload of {h.meta.encoded_bytes} bytes exceeds the limit of {lim.max_bytes} bytes; "
                    "send it with a more compact codec (e.g. int8)"
                ),
                "too_large",
            )
        up = self._table.get(sub.submission_id)
        if up is not None and up.over:  # completed or failed, its last stream not closed yet: gone
            up = None
        if h.resume_offset != 0:
            if up is not None and (up.sub != sub or up.meta != h.meta or up.fragment != h.fragment):
                raise UploadRefused(
                    FailedPrecondition(
                        f"submission {sub.submission_id} was started with another header; "
                        "resume with the same header or restart it from offset 0"
                    ),
                    "resume_mismatch",
                )
            held = up.received if up is not None else 0
            if up is None or held != h.resume_offset:
                raise UploadRefused(
                    FailedPrecondition(
                        f"upload {sub.submission_id}: the coordinator holds {held} bytes, not {h.resume_offset}; "
                        f"resume from offset {held}"
                    ),
                    "resume_offset",
                )
            dropped: tuple[Dropped, ...] = ()
            up.decoder.resumed()  # the stream it takes over may still be writing into what it was lent
        else:
            if up is not None:
                up.gen += 1  # a restart: a stream still feeding the old upload stops
                up.over = True
                del self._table[sub.submission_id]
                dropped = ()
            else:
                dropped = self._make_room(sub.worker_id)  # before the decoder takes a buffer
            up = Upload(sub, h.meta, self._decoder(h), now, now, fragment=h.fragment)
        up.gen += 1
        up.streams += 1
        up.touched_at = now
        self._table[sub.submission_id] = up
        self._table.move_to_end(sub.submission_id)
        return Opened(Stream(up, up.gen), dropped)

    def chunk(self, stream: Stream, data: bytes | memoryview, now: float) -> None:
        """Payload bytes of `stream`, decoded into its upload's buffer."""
        up = self._current(stream)
        try:
            up.decoder.feed(data)
        except CodecError as e:
            self._fail(up)
            raise UploadRefused(e, "bad_payload") from None
        up.touched_at = now

    def storage(self, stream: Stream) -> memoryview | None:
        """Where `stream` may receive its bytes in place (`Decoder.storage`); None once another stream took the
        upload over (or it completed or failed): a stream taken over must never write where the newer one does."""
        up = stream.upload
        return up.decoder.storage() if up.gen == stream.gen else None

    def end(self, stream: Stream) -> Complete:
        """`stream` ended after its last byte: verify the payload and hand it over. A short payload stays for a
        resume (INVALID_ARGUMENT tells the client where to resume)."""
        up = self._current(stream)
        held, total = up.received, up.meta.encoded_bytes
        if held < total:
            raise UploadRefused(
                InvalidArgument(
                    f"payload truncated: got {held} of {total} bytes; resume from offset {held} "
                    "(GetUploadStatus tells the bytes held)"
                ),
                "truncated",
            )
        try:
            payload = up.decoder.finish()
        except CodecError as e:
            self._fail(up)
            raise UploadRefused(e, "bad_payload") from None
        self._fail(up)  # complete: no stream may feed it again, and the table drops it
        return Complete(up.sub, up.meta, payload, up.started_at, up.fragment)

    def broken(self, stream: Stream) -> Upload:
        """`stream` broke mid-payload: the bytes held stay for a resume until `ttl_s` passes. Returns the upload
        (for the caller's log)."""
        return stream.upload

    def closed(self, stream: Stream) -> None:
        """`stream` is gone (after `end`, `broken` or a refusal): it no longer counts as streaming."""
        up = stream.upload
        up.streams = max(0, up.streams - 1)
        if up.over and self._table.get(up.sub.submission_id) is up:
            del self._table[up.sub.submission_id]

    def status(self, worker_id: str, submission_id: str, known: Accepted | None, now: float) -> tuple[int, bool]:
        """(bytes held, complete) of learner `worker_id`'s upload; (0, False) for one not held. An accepted one is
        complete (its size is known only where it was uploaded: 0 elsewhere)."""
        if known is not None:
            return self._done.get(submission_id, 0), True
        self._prune(now)
        up = self._table.get(submission_id)
        if up is None or up.sub.worker_id != worker_id:
            return 0, False
        return up.received, False

    def tick(self, now: float) -> list[Dropped]:
        """Drop uploads idle for `ttl_s` (and completed or failed ones). Returns the expired ones."""
        return self._prune(now)

    # --- the round's side -------------------------------------------------------------------------------------
    def accepted(self, sub: Submission, encoded_bytes: int) -> None:
        """`sub`'s upload of `encoded_bytes` was accepted: remember its size for `status`."""
        self._done[sub.submission_id] = encoded_bytes
        while len(self._done) > _DONE_RECORDS:
            self._done.popitem(last=False)

    def drop_worker(self, worker_id: str) -> None:
        """The learner is gone: its partial uploads go too."""
        for sid in [s for s, u in self._table.items() if u.sub.worker_id == worker_id]:
            self._fail(self._table.pop(sid))

    def counts(self) -> tuple[int, int]:
        """(uploads held, uploads streaming) now; completed and failed ones not counted."""
        live = [u for u in self._table.values() if not u.over]
        return len(live), sum(u.streams > 0 for u in live)

    # --- rules ------------------------------------------------------------------------------------------------
    def _earlier(self, sub: Submission, known: Accepted | None, version: int) -> Outcome | None:
        """The outcome of an accepted submission id, for a duplicate of it (None: not accepted)."""
        if known is None:
            return None
        if known.worker_id != sub.worker_id:
            raise AlreadyExists(
                f"submission id {sub.submission_id!r} was used by another learner; make submission ids unique"
            )
        return Outcome(known.applied, version, known.staleness, known.round)

    def earlier(self, sub: Submission, known: Accepted, version: int) -> Outcome:
        """The earlier outcome of a submission the round's side already holds (an upload that lost a race
        with another stream of the same submission)."""
        outcome = self._earlier(sub, known, version)
        assert outcome is not None
        return outcome

    def _current(self, stream: Stream) -> Upload:
        up = stream.upload
        if up.gen != stream.gen:
            raise UploadRefused(
                FailedPrecondition(
                    f"upload {up.sub.submission_id} was taken over by a newer stream; "
                    "only the newest stream of a submission may send data"
                ),
                "superseded",
            )
        return up

    @staticmethod
    def _fail(up: Upload) -> None:
        up.gen += 1
        up.over = True

    def _prune(self, now: float) -> list[Dropped]:
        expired: list[Dropped] = []
        for sid, up in list(self._table.items()):
            if up.over and up.streams == 0:
                del self._table[sid]
            elif now - up.touched_at > self.limits.ttl_s:
                del self._table[sid]
                self._fail(up)
                expired.append(Dropped(sid, up.sub.worker_id, up.received, "expired"))
        return expired

    def _make_room(self, worker_id: str) -> tuple[Dropped, ...]:
        """Evict idle uploads (oldest first) until a new one of `worker_id` fits; refuse when it cannot."""
        lim = self.limits
        evicted: list[Dropped] = []
        for scope, limit in (("per_worker", lim.max_per_worker), ("total", lim.max_partial)):
            held = [
                s for s, u in self._table.items() if not u.over and (scope == "total" or u.sub.worker_id == worker_id)
            ]
            idle = [s for s in held if self._table[s].streams == 0]
            while len(held) >= limit and idle:
                sid = idle.pop(0)
                held.remove(sid)
                up = self._table.pop(sid)
                self._fail(up)
                evicted.append(Dropped(sid, up.sub.worker_id, up.received, scope))
            if len(held) >= limit:
                what = (
                    f"concurrent uploads per worker ({worker_id})"
                    if scope == "per_worker"
                    else "concurrent uploads in all"
                )
                raise UploadRefused(
                    ResourceExhausted(
                        f"too many uploads in flight: the limit is {limit} {what}; "
                        "finish or resume the uploads in flight first, then retry"
                    ),
                    f"too_many_uploads_{scope}",
                    tuple(evicted),
                )
        return tuple(evicted)
