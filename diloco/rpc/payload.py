"""Tensor payloads on the wire (ALGORITHM.md section 9): codec metadata to and from `PayloadSpec`, chunking,
and the receivers: `PayloadReceiver` decodes chunk by chunk into a vector (a learner's broadcasts), checking
order, size and checksum; `UploadReceiver` (the coordinator's uploads) keeps the bytes as they come, checked and
measured by the same decoder, and hands over an `EncodedDelta` that the merge decodes again window by window."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import numpy as np
import torch

from diloco.core.codecs import CodecError, EncodedMeta, StreamDecoder, WindowSink, iter_chunks, payload_decoder
from diloco.core.merge import EncodedDelta, Segment, SegmentSquares
from diloco.errors import InvalidArgument
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


def chunks(
    payload: bytes | bytearray | memoryview, offset: int = 0, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[memoryview]:
    yield from iter_chunks(memoryview(payload)[offset:], chunk_bytes)


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

    def finish(self) -> torch.Tensor:
        return self.decoder.finish()

    def verify(self) -> None:
        """Complete and intact (a receiver with a sink has no vector to return)."""
        self.decoder.verify()


class UploadReceiver:
    """An upload on the coordinator: every chunk is decoded at once into the sums of squares of the merge's
    segments (which checks its content, as `PayloadReceiver` does) and its bytes are kept; `finish` checks size
    and checksum and hands over the `EncodedDelta`. Memory: the encoded bytes, not a decoded vector."""

    def __init__(self, meta: EncodedMeta, numel: int, segments: Sequence[Segment]) -> None:
        meta.validate(expected_numel=numel)
        self.meta = meta
        self._squares = SegmentSquares(segments)
        self.decoder = payload_decoder(meta, sink=self._squares)
        # neither zeroed nor touched (a bytearray would be zeroed holding the GIL: ~0.1 s per 400 MB, stalling every
        # other call of the service); its pages come as bytes arrive
        self._data = np.empty(meta.encoded_bytes, dtype=np.uint8)

    @property
    def received(self) -> int:
        return self.decoder.bytes_received

    def feed(self, data: bytes | memoryview) -> None:
        at = self.decoder.bytes_received
        self.decoder.feed(data)  # refuses more bytes than announced before anything is kept
        self._data[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def finish(self) -> EncodedDelta:
        self.decoder.verify()
        return EncodedDelta(self.meta, self._data.data, self._squares)
