"""The upload protocol (`diloco.core.uploads.Uploads`) driven directly, one call per transport event, with a
fake clock (plain numbers) and the real streaming decoder: open, resume, restart, duplicates, truncation, bad
bytes, expiry and eviction."""

from __future__ import annotations

import pytest
import torch

from diloco.core.codecs import EncodedMeta, get_codec
from diloco.core.coordinator import Accepted, Submission
from diloco.core.merge import EncodedDelta, Segment
from diloco.core.uploads import (
    Complete,
    Decoder,
    Opened,
    Outcome,
    Stream,
    UploadHeader,
    UploadLimits,
    UploadRefused,
    Uploads,
)
from diloco.errors import AlreadyExists, ConfigError, FailedPrecondition, InvalidArgument, ResourceExhausted
from diloco.rpc.payload import BufferPool, PayloadReceiver, UploadReceiver

N = 1000
TTL = 10.0


class Table:
    """An `Uploads` over a model of N parameters, counting the decoders it made."""

    def __init__(self, *, max_partial: int = 4, max_per_worker: int = 2, max_bytes: int = 4 * N + 64) -> None:
        self.made = 0
        self.uploads = Uploads(UploadLimits(N, max_bytes, TTL, max_partial, max_per_worker), self._decoder)

    def _decoder(self, h: UploadHeader) -> Decoder:
        self.made += 1
        return PayloadReceiver(h.meta, N)


def payload(seed: int = 0, codec: str = "fp32") -> tuple[bytes, EncodedMeta, torch.Tensor]:
    delta = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    data, meta = get_codec(codec).encode(delta)
    return bytes(data), meta, delta


def header(sid: str, meta: EncodedMeta, worker: str = "w-1", offset: int = 0, base: int = 0) -> UploadHeader:
    return UploadHeader(Submission(worker, sid, base, 128, 1, ()), 7, meta, offset)


def opened(result: Outcome | Opened) -> Stream:
    assert isinstance(result, Opened), result
    return result.stream


def refused(reason: str, call: object, *args: object) -> UploadRefused:
    with pytest.raises(UploadRefused) as e:
        call(*args)  # type: ignore[operator]
    assert e.value.reason == reason, e.value
    return e.value


def test_a_whole_upload_is_handed_over_decoded_and_dropped() -> None:
    t = Table()
    data, meta, delta = payload()
    s = opened(t.uploads.open(header("s1", meta), 1.0, None, 0))
    assert s.expected_bytes == len(data) and t.uploads.counts() == (1, 1)
    for i in range(0, len(data), 300):
        t.uploads.chunk(s, data[i : i + 300], 2.0)
    done = t.uploads.end(s)
    assert isinstance(done, Complete) and torch.equal(done.payload, delta)
    assert done.sub.submission_id == "s1" and done.started_at == 1.0
    t.uploads.closed(s)
    assert t.uploads.counts() == (0, 0)
    assert t.uploads.status("w-1", "s1", None, 3.0) == (0, False)


def test_a_stream_taken_over_gets_no_storage_and_its_writes_change_nothing_checked() -> None:
    """The bulk port receives in place, into `storage`. A stream taken over by a resume gets none any more, and what
    it goes on writing into the storage it was lent (a receive the kernel completes after the takeover) lands where
    the upload no longer reads: the payload handed over is the bytes as they were checked."""
    pool = BufferPool(4, 1 << 20)
    uploads = Uploads(
        UploadLimits(N, 4 * N + 64, TTL, 4, 2), lambda h: UploadReceiver(h.meta, N, [Segment(0, N)], pool)
    )
    data, meta, _ = payload(codec="int8")
    half = len(data) // 2
    s1 = opened(uploads.open(header("s1", meta), 1.0, None, 0))
    lent = uploads.storage(s1)
    assert lent is not None and len(lent) == len(data)
    lent[:half] = data[:half]
    uploads.chunk(s1, lent[:half], 1.5)
    s2 = opened(uploads.open(header("s1", meta, offset=half), 2.0, None, 0))  # a resume while s1 still streams
    assert uploads.storage(s1) is None  # superseded: nowhere to write
    lent[:] = b"\xff" * len(lent)  # s1 goes on writing into what it was lent
    mine = uploads.storage(s2)
    assert mine is not None and len(mine) == len(data) - half
    mine[:] = data[half:]
    uploads.chunk(s2, mine, 2.5)
    done = uploads.end(s2)
    assert isinstance(done.payload, EncodedDelta) and bytes(done.payload.data) == bytes(data)
    refused("superseded", uploads.chunk, s1, lent[half:], 3.0)


def test_a_broken_stream_keeps_its_bytes_and_resumes_from_the_offset_held() -> None:
    t = Table()
    data, meta, delta = payload()
    half = len(data) // 2
    s = opened(t.uploads.open(header("s1", meta), 1.0, None, 0))
    t.uploads.chunk(s, data[:half], 1.5)
    assert t.uploads.broken(s).received == half
    t.uploads.closed(s)
    assert t.uploads.counts() == (1, 0)
    assert t.uploads.status("w-1", "s1", None, 2.0) == (half, False)
    assert t.uploads.status("w-2", "s1", None, 2.0) == (0, False)  # another learner's upload is not shown
    e = refused("resume_offset", t.uploads.open, header("s1", meta, offset=half + 1), 2.0, None, 0)
    assert isinstance(e.error, FailedPrecondition) and f"resume from offset {half}" in str(e)
    other = payload(seed=1)[1]
    e = refused("resume_mismatch", t.uploads.open, header("s1", other, offset=half), 2.0, None, 0)
    assert "started with another header" in str(e)
    s2 = opened(t.uploads.open(header("s1", meta, offset=half), 2.0, None, 0))
    assert s2.expected_bytes == len(data) - half
    t.uploads.chunk(s2, data[half:], 2.5)
    assert torch.equal(t.uploads.end(s2).payload, delta)
    assert t.made == 1  # one decoder across both streams


def test_resuming_an_upload_not_held_says_to_start_at_zero() -> None:
    t = Table()
    _, meta, _ = payload()
    e = refused("resume_offset", t.uploads.open, header("s1", meta, offset=64), 1.0, None, 0)
    assert "holds 0 bytes" in str(e) and "resume from offset 0" in str(e)


def test_a_newer_stream_takes_over_and_the_older_one_stops() -> None:
    t = Table()
    data, meta, delta = payload()
    old = opened(t.uploads.open(header("s1", meta), 1.0, None, 0))
    t.uploads.chunk(old, data[:100], 1.0)
    new = opened(t.uploads.open(header("s1", meta), 2.0, None, 0))  # a restart from offset 0
    e = refused("superseded", t.uploads.chunk, old, data[100:200], 2.0)
    assert isinstance(e.error, FailedPrecondition) and "newer stream" in str(e)
    t.uploads.closed(old)
    t.uploads.chunk(new, data, 2.0)
    assert torch.equal(t.uploads.end(new).payload, delta)
    refused("superseded", t.uploads.chunk, new, b"x", 3.0)  # complete: nothing more may be fed


def test_a_short_payload_is_refused_and_kept_for_a_resume() -> None:
    t = Table()
    data, meta, delta = payload()
    s = opened(t.uploads.open(header("s1", meta), 1.0, None, 0))
    t.uploads.chunk(s, data[:-10], 1.0)
    e = refused("truncated", t.uploads.end, s)
    assert isinstance(e.error, InvalidArgument) and f"resume from offset {len(data) - 10}" in str(e)
    t.uploads.closed(s)
    s2 = opened(t.uploads.open(header("s1", meta, offset=len(data) - 10), 2.0, None, 0))
    t.uploads.chunk(s2, data[-10:], 2.0)
    assert torch.equal(t.uploads.end(s2).payload, delta)


def test_bad_bytes_fail_the_upload_and_drop_it() -> None:
    t = Table()
    data, meta, _ = payload()
    s = opened(t.uploads.open(header("s1", meta), 1.0, None, 0))
    t.uploads.chunk(s, data[:-1] + bytes([data[-1] ^ 0xFF]), 1.0)  # the checksum no longer matches
    e = refused("bad_payload", t.uploads.end, s)
    assert isinstance(e.error, InvalidArgument)
    refused("superseded", t.uploads.chunk, s, b"", 1.0)
    t.uploads.closed(s)
    assert t.uploads.counts() == (0, 0) and t.uploads.status("w-1", "s1", None, 1.0) == (0, False)
    s2 = opened(t.uploads.open(header("s1", meta), 2.0, None, 0))  # a fresh start works
    assert s2.expected_bytes == len(data)


def test_a_bad_spec_or_an_oversized_payload_is_refused_before_a_decoder_is_made() -> None:
    t = Table(max_bytes=2 * N)
    _, meta, _ = payload()
    e = refused("too_large", t.uploads.open, header("s1", meta), 1.0, None, 0)
    assert isinstance(e.error, ResourceExhausted) and "more compact codec" in str(e)
    wrong = EncodedMeta("int8", N + 1, 10, 0, 128, 0)
    e = refused("bad_payload_spec", t.uploads.open, header("s2", wrong), 1.0, None, 0)
    assert isinstance(e.error, InvalidArgument)
    assert t.made == 0 and t.uploads.counts() == (0, 0)


def test_a_duplicate_is_answered_with_the_earlier_outcome() -> None:
    """What the round's side holds of the id (`Accepted`) is the answer, whether this table saw the upload or not
    (a coordinator that took over holds only the outcome, from the round log)."""
    t = Table()
    data, meta, _ = payload()
    sub = header("s1", meta, base=3).sub
    t.uploads.accepted(sub, len(data))
    pending = t.uploads.open(header("s1", meta, base=3), 1.0, Accepted("w-1", 5, 1, applied=False), 4)
    assert pending == Outcome(applied=False, version=4, staleness=1, round=5)
    applied = t.uploads.open(header("s1", meta, base=3), 2.0, Accepted("w-1", 5, 1, applied=True), 6)
    assert applied == Outcome(applied=True, version=6, staleness=1, round=5)
    assert t.uploads.status("w-1", "s1", Accepted("w-1", 5, 1, True), 2.0) == (len(data), True)
    with pytest.raises(AlreadyExists, match="another learner"):
        t.uploads.open(header("s1", meta, worker="w-2"), 2.0, Accepted("w-1", 5, 1, True), 6)
    # an id applied elsewhere (at the leader this coordinator took over from): the outcome, the size unknown
    elsewhere = Accepted("w-1", 3, 0, applied=True)
    assert t.uploads.open(header("old", meta, base=2), 3.0, elsewhere, 6) == Outcome(True, 6, 0, 3)
    assert t.uploads.status("w-1", "old", elsewhere, 3.0) == (0, True)
    assert t.made == 0


def test_idle_uploads_expire_after_the_ttl() -> None:
    t = Table()
    data, meta, _ = payload()
    s = opened(t.uploads.open(header("s1", meta), 1.0, None, 0))
    t.uploads.chunk(s, data[:100], 2.0)
    t.uploads.closed(s)
    assert t.uploads.tick(2.0 + TTL) == []  # not yet
    expired = t.uploads.tick(2.0 + TTL + 0.1)
    assert [(d.submission_id, d.received, d.why) for d in expired] == [("s1", 100, "expired")]
    assert t.uploads.status("w-1", "s1", None, 20.0) == (0, False)


def test_room_is_made_by_evicting_idle_uploads_oldest_first_never_streaming_ones() -> None:
    t = Table(max_partial=3, max_per_worker=2)
    _, meta, _ = payload()
    a = opened(t.uploads.open(header("a", meta), 1.0, None, 0))
    b = opened(t.uploads.open(header("b", meta), 2.0, None, 0))
    e = refused("too_many_uploads_per_worker", t.uploads.open, header("c", meta), 3.0, None, 0)
    assert isinstance(e.error, ResourceExhausted) and "limit is 2 concurrent uploads per worker (w-1)" in str(e)
    t.uploads.closed(a)  # idle now, kept for a resume
    t.uploads.closed(b)
    got = t.uploads.open(header("c", meta), 4.0, None, 0)
    assert isinstance(got, Opened) and [(d.submission_id, d.why) for d in got.dropped] == [("a", "per_worker")]
    opened(t.uploads.open(header("x", meta, worker="w-2"), 5.0, None, 0))  # the third in all
    got = t.uploads.open(header("y", meta, worker="w-3"), 6.0, None, 0)  # "b" is the oldest idle one
    assert isinstance(got, Opened) and [(d.submission_id, d.why) for d in got.dropped] == [("b", "total")]
    refused("too_many_uploads_total", t.uploads.open, header("z", meta, worker="w-4"), 7.0, None, 0)


def test_a_departed_learner_s_uploads_go() -> None:
    t = Table()
    data, meta, _ = payload()
    s = opened(t.uploads.open(header("s1", meta), 1.0, None, 0))
    t.uploads.drop_worker("w-1")
    refused("superseded", t.uploads.chunk, s, data[:10], 1.0)
    t.uploads.closed(s)
    assert t.uploads.counts() == (0, 0)


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError):
        UploadLimits(N, 4 * N, TTL, max_partial=1, max_per_worker=2)
    with pytest.raises(ConfigError):
        UploadLimits(N, 4 * N, 0.0, max_partial=2)
