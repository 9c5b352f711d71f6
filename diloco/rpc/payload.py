"""Tensor payloads on the wire (ALGORITHM.md section 9): codec metadata to and from `PayloadSpec`, chunking,
and the receivers: `PayloadReceiver` decodes chunk by chunk into a vector (a learner's broadcasts), checking
order, size and checksum; `UploadReceiver` (the coordinator's uploads) keeps the bytes as they come, checked and
measured by the same decoder, and hands over an `EncodedDelta` that the merge decodes again window by window. The
bytes are kept in a buffer from a `BufferPool`, which reuses the buffers of uploads that are done with, or, with a
spill directory, in a `SpillFile` there: the coordinator's resident memory then does not grow with the uploads it
holds at once (up to `--max-partial-uploads` of them, each the size of an encoded model)."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from zlib_ng.zlib_ng import crc32

from diloco.core.codecs import (
    CodecError,
    EncodedMeta,
    Payload,
    StreamDecoder,
    WindowSink,
    payload_chunks,
    payload_decoder,
)
from diloco.core.merge import EncodedDelta, Segment, SegmentSquares
from diloco.errors import ConfigError, InvalidArgument, ResourceExhausted
from diloco.flags import NEVER
from diloco.rpc.vocab import CODECS
from diloco.task.params import ParamSpec
from diloco.v1 import common_pb2 as pb

CHUNK_BYTES = 1 << 20
T = TypeVar("T")


def meta_to_proto(meta: EncodedMeta, specs: Sequence[ParamSpec] = ()) -> pb.PayloadSpec:
    return pb.PayloadSpec(
        tensors=[pb.TensorSpec(name=s.name, shape=list(s.shape), dtype="float32", offset=s.offset) for s in specs],
        codec=CODECS.to_proto(meta.codec),
        numel=meta.numel,
        encoded_bytes=meta.encoded_bytes,
        crc32=meta.crc32,
        block_size=meta.block_size,
        topk_count=meta.topk_count,
    )


def meta_from_proto(spec: pb.PayloadSpec) -> EncodedMeta:
    try:
        codec = CODECS.from_proto(spec.codec)
    except InvalidArgument as e:
        raise CodecError(str(e)) from None
    return EncodedMeta(codec, spec.numel, spec.encoded_bytes, spec.crc32, spec.block_size, spec.topk_count)


def check_layout(spec: pb.PayloadSpec, expected: Sequence[ParamSpec]) -> None:
    """When the sender lists tensors, they must match the receiver's model exactly."""
    if not spec.tensors:
        return
    got = [(t.name, tuple(t.shape), t.offset) for t in spec.tensors]
    want = [(s.name, tuple(s.shape), s.offset) for s in expected]
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        raise CodecError(
            f"tensor layout differs from the model at tensor {first} "
            f"(got {got[first] if first < len(got) else 'nothing'}, "
            f"expected {want[first] if first < len(want) else 'nothing'}); learners must train the same model"
        )
    if any(t.dtype not in ("", "float32") for t in spec.tensors):
        raise CodecError("tensor dtype must be float32")


def chunks(payload: Payload, offset: int = 0, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes | memoryview]:
    return payload_chunks(payload, chunk_bytes, offset)


class PayloadReceiver:
    """Feeds chunks into a streaming decoder, starting at `resume_offset` bytes (for resumed uploads)."""

    def __init__(
        self,
        meta: EncodedMeta,
        numel: int,
        max_bytes: int | None = None,
        out: torch.Tensor | None = None,
        *,
        sink: WindowSink | None = None,
    ) -> None:
        meta.validate(expected_numel=numel, max_bytes=max_bytes)
        self.meta = meta
        self.decoder: StreamDecoder = payload_decoder(meta, out, sink=sink)

    @property
    def received(self) -> int:
        return self.decoder.bytes_received

    def feed(self, data: bytes | memoryview) -> None:
        self.decoder.feed(data)

    def storage(self) -> memoryview | None:
        return None  # decoded as fed, nothing kept

    def resumed(self) -> None:
        pass  # nothing lent

    def finish(self) -> torch.Tensor:
        return self.decoder.finish()

    def verify(self) -> None:
        """Complete and intact (a receiver with a sink has no vector to return)."""
        self.decoder.verify()


class PayloadBytes:
    """A payload kept as it comes, encoded: its size and crc32 checked here, its content where it is decoded (a
    learner's broadcast delta, applied in place when the version is adopted: `diloco.core.broadcast.HeldParams`).
    Memory: the encoded bytes."""

    def __init__(self, meta: EncodedMeta, numel: int) -> None:
        meta.validate(expected_numel=numel)
        self.meta = meta
        self._data = np.empty(meta.encoded_bytes, dtype=np.uint8)
        self._received = 0
        self._crc = 0

    @property
    def received(self) -> int:
        return self._received

    def feed(self, data: bytes | memoryview) -> None:
        at, end = self._received, self._received + len(data)
        if end > self.meta.encoded_bytes:
            raise CodecError(f"payload has more than the {self.meta.encoded_bytes} bytes announced")
        self._data[at:end] = np.frombuffer(data, dtype=np.uint8)
        self._crc = crc32(data, self._crc)
        self._received = end

    def finish(self) -> memoryview:
        """The bytes, once all came and their crc32 matches the announced one."""
        if self._received != self.meta.encoded_bytes:
            raise CodecError(f"payload ended after {self._received} of {self.meta.encoded_bytes} bytes")
        if self._crc != self.meta.crc32:
            raise CodecError("payload crc32 mismatch: the bytes were corrupted on the way; fetch them again")
        return self._data.data


class BufferPool:
    """Byte buffers for uploads, reused: the bytes of an upload land in memory already mapped, where a fresh
    buffer's pages are faulted in (and zeroed by the kernel) as they arrive, one 4 KiB page at a time (the bulk
    port's fp32 upload fell from 0.65x to 0.48x raw TCP with a fresh buffer per upload).

    The rule: a buffer comes back when nothing refers to the array `take` handed out any more: no upload feeding
    it or kept for a resume, no `EncodedDelta` waiting or being folded in, no view of it (every array, memoryview
    or tensor made from it keeps it alive). One still referenced is never handed out again. Idle buffers are kept
    by size, at most `max_buffers` of them and `max_bytes` in all (the longest idle go first; one larger than
    `max_bytes` is not kept); the next `take` of that size gets one. Thread-safe: a buffer comes back on whichever
    thread lets go of it last."""

    def __init__(self, max_buffers: int, max_bytes: int) -> None:
        if max_buffers < 0 or max_bytes < 0:
            raise ConfigError(f"buffer pool bounds must be >= 0, got {max_buffers} buffers and {max_bytes} bytes")
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._idle: list[np.ndarray] = []  # the longest idle first
        self._idle_bytes = 0
        # re-entrant: a buffer may come back inside a garbage collection that an allocation under the lock started
        self._lock = threading.RLock()

    @property
    def idle(self) -> tuple[int, int]:
        """(buffers, bytes) idle now."""
        with self._lock:
            return len(self._idle), self._idle_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of `nbytes` with undefined contents: an idle buffer of that size, else a new one, neither
        zeroed nor touched (a bytearray would be zeroed holding the GIL: ~0.1 s per 400 MB, stalling every other
        call of the service; its pages come as bytes arrive)."""
        with self._lock:
            same = [i for i, b in enumerate(self._idle) if b.nbytes == nbytes]
            buf = self._idle.pop(same[-1]) if same else None  # the one idle the shortest
            if buf is not None:
                self._idle_bytes -= nbytes
        if buf is None:
            buf = np.empty(nbytes, dtype=np.uint8)
        return np.asarray(_Lease(self, buf))

    def drop_idle(self) -> int:
        """Let go of every idle buffer (their memory goes back to the system); returns the bytes they held. Buffers
        in use come back later as usual."""
        with self._lock:
            dropped, self._idle, self._idle_bytes = self._idle_bytes, [], 0
        return dropped

    def _give_back(self, buf: np.ndarray) -> None:
        if buf.nbytes > self.max_bytes or not self.max_buffers:
            return  # never kept: the idle ones stay
        with self._lock:
            self._idle.append(buf)
            self._idle_bytes += buf.nbytes
            while self._idle and (len(self._idle) > self.max_buffers or self._idle_bytes > self.max_bytes):
                self._idle_bytes -= self._idle.pop(0).nbytes


class _Lease:
    """What the array `BufferPool.take` hands out is made over (its base): every view of that array, numpy's, a
    memoryview's or a tensor's, keeps the lease alive (numpy stops at a base that is not an array, so a view of a
    view refers to the lease, never to the pooled buffer itself). When the last goes, the buffer goes back."""

    def __init__(self, pool: BufferPool, buf: np.ndarray) -> None:
        self._pool, self._buf = pool, buf
        self.__array_interface__: dict[str, Any] = buf.__array_interface__

    def __del__(self) -> None:
        self._pool._give_back(self._buf)


_UNPOOLED = BufferPool(0, 0)  # a new buffer for every upload


SPILL_ABOVE = 64 << 20  # bytes: a payload or vector bigger than this is held in a file by default (`--spill-above`)


def default_spill_dir() -> str:
    """Where spill files go when `--spill-dir` names none: `$TMPDIR`, else /var/tmp (on disk where /tmp may be a
    tmpfs, i.e. memory), else Python's temporary directory."""
    if os.environ.get("TMPDIR"):
        return os.environ["TMPDIR"]
    return "/var/tmp" if os.access("/var/tmp", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class Spill:
    """The rule for what a process holds in unlinked files rather than memory: a payload (an upload being received,
    a broadcast delta kept for late learners) or a model-sized vector (a learner's residual and θ_at_submit) whose
    bytes exceed `above` (`NEVER`: none, `IN_MEMORY`), in `directory`. Small models stay in memory; a large model's
    cold bytes go to the kernel's page cache, which it can write out and reclaim, so a process's resident memory
    does not grow with the uploads it holds at once nor with the history it keeps."""

    directory: str
    above: int = SPILL_ABOVE

    @classmethod
    def checked(cls, directory: str, above: int) -> Spill:
        """The flags' rule, its directory checked at start (`check_spill_dir`; "": `default_spill_dir`), unless
        nothing is ever spilled (`NEVER`)."""
        if above == NEVER:
            return IN_MEMORY
        return cls(check_spill_dir(directory or default_spill_dir()), above)

    def directory_for(self, nbytes: int) -> str | None:
        """Where a payload of `nbytes` goes: this directory, or None (memory)."""
        return self.directory if self.above != NEVER and nbytes > self.above else None


IN_MEMORY = Spill("", NEVER)  # `--spill-above never`: every payload and vector in memory


def check_spill_dir(path: str) -> str:
    """`--spill-dir` checked at start: an existing directory where this process can create a file (the
    error names the flag and what to do). Returns the absolute path."""
    if not os.path.isdir(path):
        raise ConfigError(f"--spill-dir {path!r} is not a directory: create it or name another one")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"--spill-dir {path!r}: cannot create a file there ({e.strerror})") from None
    return os.path.abspath(path)


def _write_all(fd: int, view: memoryview, at: int, when_full: str) -> None:
    """All of `view` into file `fd` at byte `at`; a full disk (or quota, or file size limit) raises
    `ResourceExhausted` with `when_full`, which says what to do."""
    try:
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise ResourceExhausted(when_full) from None
        raise


class SpillFile:
    """A payload's bytes (an upload being received, or a broadcast delta kept for late learners) in an unnamed
    temporary file in `directory` (unlinked at once, so nothing is left behind whatever happens to the process; its
    space is freed when the last reference goes). Written at byte offsets as they arrive, read back in order by
    `chunks` (a `ChunkSource`). The pages sit in the kernel's page cache, which it can write out and reclaim, not in
    the coordinator's resident memory."""

    def __init__(self, directory: str, nbytes: int) -> None:
        self.nbytes = nbytes
        try:
            self._file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 (held until the bytes are let go of)
        except OSError as e:
            raise ResourceExhausted(
                f"the coordinator cannot create a file in its --spill-dir ({e.strerror}); send the upload again "
                "later (an operator checks the directory)"
            ) from None

    @classmethod
    def holding(cls, directory: str, data: bytes | bytearray | memoryview) -> SpillFile:
        """A spill file holding `data` (e.g. an encoded broadcast delta kept for learners that come later)."""
        view = memoryview(data).cast("B")
        spilled = cls(directory, len(view))
        spilled.write(0, view)
        return spilled

    def write(self, at: int, data: bytes | memoryview) -> None:
        _write_all(
            self._file.fileno(),
            memoryview(data).cast("B"),
            at,
            "the coordinator's --spill-dir is full; send the upload again later (an operator frees space there or "
            "lowers --max-partial-uploads)",
        )

    def chunks(self, chunk_bytes: int = CHUNK_BYTES, offset: int = 0) -> Iterator[bytes]:
        """The bytes from `offset`, `chunk_bytes` at a time (a `ChunkSource`)."""
        if chunk_bytes < 1:
            raise CodecError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        for at in range(offset, self.nbytes, chunk_bytes):
            chunk = os.pread(self._file.fileno(), min(chunk_bytes, self.nbytes - at), at)
            if not chunk:
                raise CodecError(f"the spilled payload ends at byte {at} of {self.nbytes}: send it again")
            yield chunk

    def close(self) -> None:
        self._file.close()


class SpilledVector:
    """A flat fp32 vector of `numel` values in an unnamed temporary file in `directory` (unlinked at once; zeros at
    first, a sparse file), read and written a slab at a time (`diloco.core.codecs.SlabStore`): a learner's
    error-feedback residual and θ_at_submit with `--spill-dir`, in the kernel's page cache (which it can write out
    and reclaim), not in the learner's resident memory. A full disk raises `ResourceExhausted` naming the flag."""

    def __init__(self, directory: str, numel: int) -> None:
        self.numel = numel
        try:
            self._file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 (held as long as the vector)
            os.ftruncate(self._file.fileno(), 4 * numel)
        except OSError as e:
            raise ResourceExhausted(
                f"the learner cannot make a spill file in --spill-dir {directory!r} ({e.strerror}): free "
                "space there, name another directory, or run without --spill-dir"
            ) from None

    def read(self, start: int, out: torch.Tensor) -> None:
        view = out.numpy().data.cast("B")
        at = 4 * start
        while view:
            n = os.preadv(self._file.fileno(), [view], at)
            if n == 0:
                raise ResourceExhausted(f"a spill file ends at byte {at}; it was truncated under the learner")
            view, at = view[n:], at + n

    def write(self, start: int, values: torch.Tensor) -> None:
        _write_all(
            self._file.fileno(),
            values.numpy().data.cast("B"),
            4 * start,
            "the learner's --spill-dir is full: free space there, or run without --spill-dir",
        )

    def zero(self) -> None:
        """Every value 0 again: the file emptied and grown back (its blocks given back to the disk)."""
        os.ftruncate(self._file.fileno(), 0)
        os.ftruncate(self._file.fileno(), 4 * self.numel)

    def close(self) -> None:
        self._file.close()


_MAPPED: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()  # address -> its mapping


def mapped_vector(directory: str, numel: int) -> torch.Tensor:
    """A flat fp32 tensor of `numel` zeros whose bytes live in an unlinked file in `directory`, mapped shared into
    this process: it reads and writes like any tensor, and `release_pages` drops its pages from the process's
    resident memory (the kernel's page cache keeps them, writes them out and reclaims them under pressure; the next
    access faults them back in). For a vector touched once a round: a learner's Θ̂ above `--spill-above`. The file's
    blocks are reserved here, so a full disk raises `ResourceExhausted` now, never a fault mid-write."""
    nbytes = 4 * max(1, numel)
    try:
        with tempfile.TemporaryFile(dir=directory) as f:  # the mapping keeps the file once it is closed
            os.posix_fallocate(f.fileno(), 0, nbytes)
            mapping = mmap.mmap(f.fileno(), nbytes)  # MAP_SHARED: its pages are the file's
    except OSError as e:
        raise ResourceExhausted(
            f"the learner cannot map a {nbytes >> 20} MiB vector in --spill-dir {directory!r} ({e.strerror}): "
            "free space there, name another directory, or raise --spill-above"
        ) from None
    tensor = torch.frombuffer(mapping, dtype=torch.float32, count=numel)  # keeps the mapping alive
    _MAPPED[tensor.data_ptr()] = mapping
    return tensor


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the pages of a `mapped_vector` tensor from this process's resident memory (their contents stay in the
    file's page cache: a shared file mapping loses nothing); any other tensor is left as it is."""
    mapping = _MAPPED.get(tensor.data_ptr())
    if mapping is not None and tensor.numel() * 4 <= len(mapping):
        mapping.madvise(mmap.MADV_DONTNEED)


class UploadReceiver:
    """An upload on the coordinator: every chunk is decoded at once into the sums of squares of the merge's
    segments (which checks its content, as `PayloadReceiver` does) and its bytes are kept in a buffer of `pool`,
    or in a `SpillFile` in `spill_dir` when one is given; `finish` checks size and checksum and hands the bytes over
    in the `EncodedDelta` (the buffer goes back to the pool, or the file's space to the disk, once that is let go
    of). Memory: the encoded bytes (with `spill_dir`, none), not a decoded vector."""

    def __init__(
        self,
        meta: EncodedMeta,
        numel: int,
        segments: Sequence[Segment],
        pool: BufferPool | None = None,
        spill_dir: str | None = None,
    ) -> None:
        meta.validate(expected_numel=numel)
        self.meta = meta
        self._squares = SegmentSquares(segments)
        self.decoder = payload_decoder(meta, sink=self._squares)
        self._pool = pool or _UNPOOLED
        self._data: np.ndarray | SpillFile | None = (
            SpillFile(spill_dir, meta.encoded_bytes) if spill_dir else self._pool.take(meta.encoded_bytes)
        )
        self._lent = False  # `storage` handed the buffer to a stream

    @property
    def received(self) -> int:
        return self.decoder.bytes_received

    def feed(self, data: bytes | memoryview) -> None:
        at = self.decoder.bytes_received
        if isinstance(self._data, SpillFile):
            # written first: a full disk refuses the chunk before the decoder counts it, so a resume sends it again
            # (bytes past the announced size land past the end of the file, harmless: the decoder refuses them)
            self._data.write(at, data)
        self._checked(self.decoder.feed, data)  # refuses more bytes than announced (so any after `finish`) first
        if isinstance(self._data, np.ndarray):
            src, dst = np.frombuffer(data, dtype=np.uint8), self._data[at : at + len(data)]
            if src.ctypes.data != dst.ctypes.data:  # not received in place (`storage`): copied in
                dst[...] = src

    def storage(self) -> memoryview | None:
        """The buffer the bytes not yet received go to (None with `spill_dir`, or once finished or failed): the bulk
        port receives straight into it and feeds views of it, which are checked in place, not copied."""
        data = self._data
        if not isinstance(data, np.ndarray):
            return None
        self._lent = True
        return data[self.received :].data

    def resumed(self) -> None:
        """A resume takes the upload over from a stream that may still be receiving into the buffer `storage` lent
        it (the kernel fills a receive after the takeover, or bytes still queued on the old connection arrive): the
        bytes received so far move to a fresh buffer, and the old one stays with that stream (its views keep it
        from the pool) until it ends. Nothing is then written where bytes were checked."""
        data = self._data
        if self._lent and isinstance(data, np.ndarray):
            fresh = self._pool.take(len(data))
            n = self.received
            fresh[:n] = data[:n]
            self._data, self._lent = fresh, False

    def finish(self) -> EncodedDelta:
        self._checked(self.decoder.verify)
        data, self._data = self._data, None  # the upload, kept until its stream ends, no longer holds the bytes
        assert data is not None, "an upload is finished once (`Uploads.end`)"
        return EncodedDelta(self.meta, data if isinstance(data, SpillFile) else data.data, self._squares)

    def _checked(self, step: Callable[..., None], *args: Any) -> None:
        """A decoder step. Bad bytes fail the upload, which lets go of its buffer at once: the refusal's traceback
        may keep the receiver until the garbage collector runs."""
        try:
            step(*args)
        except CodecError:
            if isinstance(self._data, SpillFile):
                self._data.close()
            self._data = None
            raise
