"""The coordinator's upload buffers (`diloco.rpc.payload.BufferPool`, `UploadReceiver`): a buffer is reused once
nothing refers to it, never while anything does (a view, an upload, a merge replaying it), idle ones are bounded,
and a reused buffer holds exactly the new upload's bytes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diloco.core.codecs import CodecError, get_codec
from diloco.core.merge import EncodedDelta, MergeAccumulator, Segment
from diloco.errors import ConfigError, ResourceExhausted
from diloco.rpc.payload import (
    IN_MEMORY,
    NEVER,
    SPILL_ABOVE,
    BufferPool,
    Spill,
    SpillFile,
    UploadReceiver,
    check_spill_dir,
    chunks,
    default_spill_dir,
    mapped_vector,
    release_pages,
)
from tests.support import resident_kb

pytestmark = pytest.mark.timeout(30)
SEGMENTS = [Segment(0, 300, embedding=True), Segment(300, 700)]
NUMEL = 1000


def address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def received(pool: BufferPool, codec: str, seed: int) -> tuple[EncodedDelta, torch.Tensor]:
    """A random pseudo-gradient uploaded in pieces into a buffer of `pool`, handed over; and what it decodes to."""
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    data, meta = get_codec(codec).encode(delta)
    receiver = UploadReceiver(meta, NUMEL, SEGMENTS, pool)
    for piece in chunks(data, chunk_bytes=333):
        receiver.feed(piece)
    return receiver.finish(), get_codec(codec).decode(data, meta)


def test_a_buffer_nothing_refers_to_is_handed_out_again() -> None:
    pool = BufferPool(4, 1 << 20)
    a = pool.take(5000)
    at = address(a)
    a[:] = 7  # written through the array handed out
    assert pool.idle == (0, 0)
    del a
    assert pool.idle == (1, 5000)
    other = pool.take(4000)  # another size: a new buffer
    assert address(other) != at and pool.idle == (1, 5000)
    again = pool.take(5000)
    assert address(again) == at and bool((again == 7).all())  # the same memory, not zeroed
    assert pool.idle == (0, 0)


VIEWS: dict[str, Callable[[np.ndarray], Any]] = {
    "numpy slice": lambda a: a[10:20],
    "slice of a slice": lambda a: a[10:20][2:5],
    "memoryview": lambda a: a.data,
    "memoryview slice": lambda a: a.data[5:9],
    "tensor": lambda a: torch.frombuffer(a.data, dtype=torch.uint8),
    "tensor of a memoryview slice": lambda a: torch.frombuffer(a.data[8:16], dtype=torch.float32),
}


@pytest.mark.parametrize("kind", list(VIEWS))
def test_a_view_keeps_its_buffer_out_of_the_pool(kind: str) -> None:
    pool = BufferPool(4, 1 << 20)
    a = pool.take(1000)
    at = address(a)
    view = VIEWS[kind](a)
    del a
    assert pool.idle == (0, 0)
    b = pool.take(1000)
    assert address(b) != at  # still referenced: a new buffer
    del view
    assert pool.idle == (1, 1000)
    assert address(pool.take(1000)) == at


def test_idle_buffers_are_bounded_in_count_and_bytes() -> None:
    pool = BufferPool(2, 2500)
    a, b, c = (pool.take(1000) for _ in range(3))
    at_b, at_c = address(b), address(c)
    del a, b, c
    assert pool.idle == (2, 2000)  # at most 2: the longest idle went
    first, second = pool.take(1000), pool.take(1000)
    assert address(first) == at_c and address(second) == at_b  # the newest first
    assert pool.idle == (0, 0)
    del first, second
    x, y = pool.take(1000), pool.take(2000)
    del x, y
    assert pool.idle == (1, 2000)  # at most 2500 bytes: the longest idle went
    huge = pool.take(3000)
    del huge
    assert pool.idle == (1, 2000)  # larger than the pool holds: not kept, the others stay
    unpooled = BufferPool(0, 0)
    one = unpooled.take(10)
    del one
    assert unpooled.idle == (0, 0)
    with pytest.raises(ConfigError, match=">= 0"):
        BufferPool(-1, 0)


@pytest.mark.parametrize("codec", ["fp32", "int8", "topk"])
def test_a_reused_buffer_holds_exactly_the_next_upload(codec: str) -> None:
    pool = BufferPool(4, 1 << 20)
    first, _ = received(pool, codec, seed=1)
    at = address(np.frombuffer(first.data, dtype=np.uint8))
    acc = MergeAccumulator(NUMEL, "mean", SEGMENTS)
    acc.add(first, 3)
    del first  # folded in and let go: its buffer goes back
    second, decoded = received(pool, codec, seed=2)
    assert address(np.frombuffer(second.data, dtype=np.uint8)) == at
    acc.reset()
    acc.add(second, 3)
    ref = MergeAccumulator(NUMEL, "mean", SEGMENTS)
    ref.add(decoded, 3)
    assert torch.equal(acc.result(), ref.result())


class _Taking:
    """A window sink that folds like the merge and, at every window, takes a buffer of the size being replayed."""

    def __init__(self, pool: BufferPool, nbytes: int, acc: torch.Tensor) -> None:
        self.pool, self.nbytes, self.acc = pool, nbytes, acc
        self.addresses: list[int] = []

    def dense(self, start: int, values: torch.Tensor) -> None:
        self.acc[start : start + values.numel()].add_(values)
        self.addresses.append(address(self.pool.take(self.nbytes)))

    def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
        self.acc.index_add_(0, index, values)
        self.addresses.append(address(self.pool.take(self.nbytes)))


def test_a_buffer_is_never_handed_out_while_a_merge_replays_it() -> None:
    pool = BufferPool(4, 1 << 20)
    delta, decoded = received(pool, "int8", seed=3)
    nbytes = len(delta.data)
    at = address(np.frombuffer(delta.data, dtype=np.uint8))
    _ = pool.take(nbytes)  # an idle buffer of the same size, returned below: the pool is not empty meanwhile
    del _
    assert pool.idle == (1, nbytes)
    sink = _Taking(pool, nbytes, torch.zeros(NUMEL))
    delta.replay(sink)  # the merge in flight: every take meanwhile gets another buffer
    assert sink.addresses and at not in sink.addresses
    assert torch.equal(sink.acc, decoded)
    del delta
    assert address(pool.take(nbytes)) == at


def test_an_upload_kept_for_a_resume_keeps_its_buffer_until_dropped() -> None:
    pool = BufferPool(4, 1 << 20)
    data, meta = get_codec("fp32").encode(torch.ones(NUMEL))
    receiver = UploadReceiver(meta, NUMEL, SEGMENTS, pool)
    receiver.feed(memoryview(data)[:1000])
    assert pool.idle == (0, 0)
    del receiver  # the upload dropped (expired, evicted, its learner gone)
    assert pool.idle == (1, len(data))


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_bytes_received_into_the_lent_storage_are_checked_in_place(codec: str) -> None:
    """The bulk port receives straight into `storage()` and feeds views of it: the bytes are checked where they lie
    and kept there (no copy), and the upload holds exactly them."""
    pool = BufferPool(4, 1 << 20)
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
    data, meta = get_codec(codec).encode(delta)
    receiver = UploadReceiver(meta, NUMEL, SEGMENTS, pool)
    storage = receiver.storage()
    assert storage is not None and len(storage) == len(data) and not storage.readonly
    at = 0
    for piece in chunks(data, chunk_bytes=333):
        storage[at : at + len(piece)] = piece  # what the transport's recv_into does
        receiver.feed(storage[at : at + len(piece)])
        at += len(piece)
    got = receiver.finish()
    assert bytes(got.data) == bytes(data)
    assert address(np.frombuffer(got.data, dtype=np.uint8)) == address(np.frombuffer(storage, dtype=np.uint8))
    acc = MergeAccumulator(NUMEL, segments=SEGMENTS)
    acc.add(got, 1)
    assert torch.equal(acc.result(), get_codec(codec).decode(data, meta))


def test_a_resume_moves_the_upload_away_from_what_the_stream_taken_over_was_lent() -> None:
    """A stream taken over by a resume may still write into the storage it was lent (its kernel receive completes
    after the takeover, bytes still queued on its connection arrive): after `resumed()` those writes land in a buffer
    the upload no longer reads, the bytes already checked stay as they were checked, and the payload completes."""
    pool = BufferPool(4, 1 << 20)
    data, meta = get_codec("int8").encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(4)))
    receiver = UploadReceiver(meta, NUMEL, SEGMENTS, pool)
    old = receiver.storage()
    assert old is not None
    old[:500] = data[:500]
    receiver.feed(old[:500])  # the first stream's checked bytes
    receiver.resumed()  # a second stream resumes at 500
    old[:] = b"\xff" * len(old)  # the first stream, taken over, goes on writing where it was lent
    new = receiver.storage()
    assert new is not None and len(new) == len(data) - 500
    assert address(np.frombuffer(new, dtype=np.uint8)) != address(np.frombuffer(old, dtype=np.uint8)) + 500
    new[:] = data[500:]
    receiver.feed(new)
    assert bytes(receiver.finish().data) == bytes(data)  # the crc32 of the bytes as checked


def test_bad_bytes_let_go_of_the_buffer_at_once() -> None:
    pool = BufferPool(4, 1 << 20)
    data, meta = get_codec("int8").encode(torch.ones(NUMEL))
    corrupt = bytearray(data)
    corrupt[-1] ^= 0xFF
    receiver = UploadReceiver(meta, NUMEL, SEGMENTS, pool)
    receiver.feed(bytes(corrupt))
    with pytest.raises(CodecError, match="crc32"):
        receiver.finish()
    assert pool.idle == (1, len(data))  # the receiver is still referenced (its refusal's traceback may keep it)
    again = UploadReceiver(meta, NUMEL, SEGMENTS, pool)
    assert pool.idle == (0, 0)
    with pytest.raises(CodecError):
        again.feed(bytes(data) + b"\0")
    assert pool.idle == (1, len(data))


def test_dropping_idle_buffers_leaves_those_in_use() -> None:
    pool = BufferPool(4, 1 << 20)
    held, idle = pool.take(1000), pool.take(2000)
    del idle
    assert pool.drop_idle() == 2000 and pool.idle == (0, 0)
    at = address(held)
    del held  # in use while dropping: it comes back as usual
    assert pool.idle == (1, 1000) and address(pool.take(1000)) == at


# --- spilled uploads (`--spill-dir`) --------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "topk"])
def test_a_spilled_upload_merges_to_the_same_bits_and_leaves_no_file(codec: str, tmp_path: Path) -> None:
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    data, meta = get_codec(codec).encode(delta)
    pool = BufferPool(4, 1 << 20)
    receiver = UploadReceiver(meta, NUMEL, SEGMENTS, pool, spill_dir=str(tmp_path))
    for piece in chunks(data, chunk_bytes=333):
        receiver.feed(piece)
    spilled = receiver.finish()
    assert isinstance(spilled.data, SpillFile) and list(tmp_path.iterdir()) == []  # unlinked from the start
    held, _ = received(pool, codec, seed=5)
    assert spilled.norm() == held.norm()
    merged = [MergeAccumulator(NUMEL, "rda", SEGMENTS) for _ in range(2)]
    merged[0].add(spilled, 3)
    merged[1].add(held, 3)
    assert torch.equal(merged[0].result(), merged[1].result())
    assert pool.idle == (0, 0)  # no memory buffer was taken for the spilled one


def test_a_spilled_upload_cut_off_resumes_and_bad_bytes_close_its_file(tmp_path: Path) -> None:
    data, meta = get_codec("int8").encode(torch.ones(NUMEL))
    receiver = UploadReceiver(meta, NUMEL, SEGMENTS, spill_dir=str(tmp_path))
    receiver.feed(memoryview(data)[:500])  # the link breaks here; the upload is kept for a resume
    receiver.feed(memoryview(data)[500:])
    acc = MergeAccumulator(NUMEL, "mean", SEGMENTS)
    acc.add(receiver.finish(), 1)
    torch.testing.assert_close(acc.result(), get_codec("int8").decode(data, meta))
    corrupt = bytearray(data)
    corrupt[-1] ^= 0xFF
    bad = UploadReceiver(meta, NUMEL, SEGMENTS, spill_dir=str(tmp_path))
    spill = bad._data
    assert isinstance(spill, SpillFile)
    bad.feed(bytes(corrupt))
    with pytest.raises(CodecError, match="crc32"):
        bad.finish()
    assert spill._file.closed  # its disk space goes back at once, whatever keeps the receiver


_FULL_DISK = """
import resource, signal, sys
import torch
from diloco.core.codecs import get_codec
from diloco.core.merge import Segment
from diloco.errors import ResourceExhausted
from diloco.rpc.payload import UploadReceiver
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
data, meta = get_codec("fp32").encode(torch.ones(1000))
receiver = UploadReceiver(meta, 1000, [Segment(0, 1000)], spill_dir=sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))  # room for half the upload
receiver.feed(memoryview(data)[:1500])
try:
    receiver.feed(memoryview(data)[1500:])
except ResourceExhausted as e:
    print("refused:", e)
    print("received:", receiver.received)
"""


def test_a_full_spill_disk_refuses_the_chunk_before_counting_it(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # RESOURCE_EXHAUSTED, saying what to do; the chunk is not counted, so a resume sends it again from 1500
    assert "refused: the coordinator's --spill-dir is full" in proc.stdout and "received: 1500" in proc.stdout


@pytest.mark.parametrize(("make", "why"), [("missing", "is not a directory"), ("file", "is not a directory")])
def test_a_spill_dir_that_cannot_hold_files_is_refused_at_start(tmp_path: Path, make: str, why: str) -> None:
    path = tmp_path / make
    if make == "file":
        path.write_text("")
    with pytest.raises(ConfigError, match=f"--spill-dir .*{why}"):
        check_spill_dir(str(path))
    assert check_spill_dir(str(tmp_path)) == str(tmp_path)


def test_the_spill_rule_sends_only_payloads_above_its_size_to_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    never = Spill.checked(str(tmp_path / "nowhere"), NEVER)  # never: nothing checked, nothing spilled
    assert never == IN_MEMORY and never.directory_for(1 << 62) is None
    with pytest.raises(ConfigError, match="--spill-dir"):
        Spill.checked(str(tmp_path / "nowhere"), 0)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    rule = Spill.checked("", 1000)  # no directory named: $TMPDIR
    assert rule == Spill(str(tmp_path), 1000)
    assert rule.directory_for(1000) is None and rule.directory_for(1001) == str(tmp_path)
    monkeypatch.delenv("TMPDIR")
    assert Spill.checked("", SPILL_ABOVE) == Spill(default_spill_dir(), SPILL_ABOVE) and default_spill_dir()
    # an upload's bytes: in a pooled buffer below the size, in a file above it
    data, meta = get_codec("int8").encode(torch.randn(NUMEL))
    for above, filed in ((len(data), False), (len(data) - 1, True)):
        receiver = UploadReceiver(meta, NUMEL, SEGMENTS, spill_dir=Spill(str(tmp_path), above).directory_for(len(data)))
        for c in chunks(data):
            receiver.feed(c)
        assert isinstance(receiver.finish().data, SpillFile) is filed


def test_a_mapped_vector_leaves_resident_memory_when_released_and_keeps_its_values(tmp_path: Path) -> None:
    numel = 1 << 20
    t = mapped_vector(str(tmp_path), numel)
    assert list(tmp_path.iterdir()) == [] and t.numel() == numel and not t.any()  # unlinked, zeros
    t.copy_(torch.arange(numel, dtype=torch.float32))
    assert resident_kb(t) >= 4 * numel // 1024  # written: every page resident
    release_pages(t)
    assert resident_kb(t) == 0
    assert torch.equal(t, torch.arange(numel, dtype=torch.float32))  # faulted back from the page cache, intact
    plain = torch.arange(10, dtype=torch.float32)
    release_pages(plain)  # not a mapped vector: nothing happens to it
    assert torch.equal(plain, torch.arange(10, dtype=torch.float32))
    with pytest.raises(ResourceExhausted, match=r"--spill-dir .*nowhere.*raise --spill-above"):
        mapped_vector(str(tmp_path / "nowhere"), numel)
