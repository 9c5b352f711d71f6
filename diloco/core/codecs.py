"""Codecs for flat float32 vectors (ALGORITHM.md sections 2 and 9), with chunk-by-chunk decoding.

A sender encodes a 1-D float32 vector into bytes plus an `EncodedMeta` (which maps 1:1 onto the proto
`PayloadSpec`); a receiver checks the meta against what it expects (`EncodedMeta.validate`), then feeds the
bytes as they arrive, in chunks of any size, to a `StreamDecoder`, which decodes every complete unit into its
output buffer at once and keeps only a partial unit. `ErrorFeedback` keeps the fp32 residual of a lossy codec.

Byte layouts (all little-endian; `n` = numel, `B` = block_size, `nb` = ceil(n / B), `k` = topk_count):

- ``fp32``: n x float32. Unit: 4 bytes.
- ``bf16``: n x bfloat16 (the upper 16 bits of the float32, rounded to nearest even). Unit: 2 bytes.
- ``int8``: nb x float32 scales, then n x int8 values. Block j covers elements [j*B, (j+1)*B); its scale is
  amax(|x|)/127 and value i decodes to q_i * scale. Values are round(x * 127/amax) in [-127, 127]; an all-zero
  block has scale 0. The last block may be short: only its n - (nb-1)*B values are sent. Size: 4*nb + n.
- ``int4``: nb x float32 scales, then ceil(n/2) bytes of packed values. Blocks and scales as for int8 with 7
  in place of 127; each value is stored as the nibble q + 8 (1..15); element 2i is the low nibble of byte i
  and element 2i+1 the high nibble. If n is odd the last high nibble is padding (8). Size: 4*nb + ceil(n/2).
- ``topk``: k records of (uint32 index, float32 value), 8 bytes each, indices strictly increasing; all other
  elements decode to 0. k = max(1, round(fraction * n)). Size: 8*k.
- ``sparse`` (chunked top-k with 2-bit values, SparseLoCo-class): the vector is cut into nb chunks of B elements
  (B = block_size, default 4096; the last may be short, n_l = n - (nb-1)*B elements). Of each chunk the k
  largest-magnitude entries are kept (k = topk_count, entries per chunk, 1 <= k <= B; the last chunk keeps
  k_l = min(k, n_l)). One record per chunk, in chunk order:
  float32 low, float32 step, k x uint16 offsets within the chunk (strictly increasing, < the chunk's length),
  then ceil(2k/8) bytes of 2-bit codes (code i in bits 2*(i mod 4) .. of byte i div 4; padding bits 0). A code
  is m + 2*s: s the sign bit, m in {0, 1} the magnitude level, and it decodes to (-1)^s * (m*step + low) (two
  float32 roundings, a multiply then an add). low is the smallest kept magnitude of the chunk, step the largest
  minus it; m = round((|x| - low) / step) (0 when step is 0). Other elements decode to 0.
  Size: (nb-1) * R(k) + R(k_l), R(j) = 8 + 2*j + ceil(2*j/8) (R(64) = 152 bytes per 4096 elements: 108x
  below fp32).

Scales come first so that, once they are in, every following byte decodes into its final place. The value
section is decoded in whole blocks (B bytes for int8, B/2 for int4); fp32, bf16 and topk in whole elements or
records; sparse in whole chunk records (its scales travel inside each record). `crc32` is `zlib.crc32` of the
whole payload.

int8, int4, topk and sparse reject non-finite input (a NaN or inf would poison the scales or the error feedback);
fp32 and bf16 carry values as they are. A block whose abs-max is below qmax/FLT_MAX (about 4e-37 for int8)
is sent as zeros.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, NoReturn, Protocol, runtime_checkable

import numpy as np
import torch

from diloco.core import parallel
from diloco.core.checksum import MASK, checksum, moved
from diloco.errors import InvalidArgument

if sys.byteorder != "little":  # the byte layouts are little-endian and we decode through native views
    raise ImportError("diloco.core.codecs supports little-endian hosts only")

__all__ = [
    "ALLOWED_BLOCK_SIZES",
    "CODEC_NAMES",
    "AddingSink",
    "BF16Codec",
    "Codec",
    "CodecError",
    "EncodedMeta",
    "ErrorFeedback",
    "FP32Codec",
    "Int4Codec",
    "Int8Codec",
    "SlabStore",
    "SparseCodec",
    "StreamDecoder",
    "TopKCodec",
    "WindowSink",
    "codec_class",
    "encoded_size",
    "get_codec",
    "iter_chunks",
    "payload_decoder",
    "warm_up",
]

ALLOWED_BLOCK_SIZES: tuple[int, ...] = tuple(1 << p for p in range(4, 13))  # 16 .. 4096
MAX_TOPK_NUMEL = 1 << 32  # indices are uint32

# elements per step of the encode loops: large enough for few Python steps, small enough to stay in cache
_SLAB = 1 << 20
# elements per step of `encode_toward` (a kernel call each)
_FUSED_SLAB = 1 << 17
_TOPK_SAMPLED_MIN_NUMEL = 1 << 18  # below this, plain torch.topk is fast enough
_TOPK_SAMPLE = 1 << 18
_TOPK_RECORD = np.dtype([("index", "<u4"), ("value", "<f4")])


class CodecError(InvalidArgument):
    """A payload or its meta is malformed, truncated, oversized or inconsistent; or a bad codec setting."""


def encoded_size(codec: str, numel: int, block_size: int = 0, topk_count: int = 0) -> int:
    """Bytes that `codec` produces for `numel` elements (see the module docstring for the layouts)."""
    return codec_class(codec).payload_bytes(numel, block_size, topk_count)


def codec_class(name: str) -> type[Codec]:
    """The codec called `name`, from the one registry (`CODEC_NAMES` lists it)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; use one of {', '.join(CODEC_NAMES)}") from None


@dataclass(frozen=True)
class EncodedMeta:
    """Everything a receiver needs besides the bytes; maps 1:1 onto the proto `PayloadSpec` fields."""

    codec: str
    numel: int
    encoded_bytes: int
    crc32: int
    block_size: int = 0
    topk_count: int = 0

    def validate(self, *, expected_numel: int, max_bytes: int | None = None) -> None:
        """Raise `CodecError` unless this meta describes a payload this side can decode into `expected_numel`
        elements, no larger than `max_bytes`."""
        kind = codec_class(self.codec)
        if self.numel != expected_numel:
            raise CodecError(
                f"payload has numel {self.numel} but the receiver expects {expected_numel}; "
                "sender and receiver disagree on the model layout"
            )
        if self.numel < 1:
            raise CodecError(f"numel must be >= 1, got {self.numel}")
        if not 0 <= self.crc32 < 1 << 32:
            raise CodecError(f"crc32 must be a uint32, got {self.crc32}")
        if kind.blockwise:
            if self.block_size not in ALLOWED_BLOCK_SIZES:
                raise CodecError(
                    f"{self.codec} block_size {self.block_size} is not allowed; use a power of two "
                    f"from {ALLOWED_BLOCK_SIZES[0]} to {ALLOWED_BLOCK_SIZES[-1]}"
                )
        elif self.block_size != 0:
            raise CodecError(f"block_size must be 0 for codec {self.codec}, got {self.block_size}")
        if kind.sparse:
            limit = self.block_size if kind.blockwise else self.numel  # chunked top-k counts entries per chunk
            if not 1 <= self.topk_count <= limit:
                where = f"block_size={limit}" if kind.blockwise else f"numel={limit}"
                raise CodecError(f"{self.codec} topk_count {self.topk_count} is outside [1, {where}]")
            if self.numel > MAX_TOPK_NUMEL:
                raise CodecError(f"topk supports at most {MAX_TOPK_NUMEL} elements, got {self.numel}")
        elif self.topk_count != 0:
            raise CodecError(f"topk_count must be 0 for codec {self.codec}, got {self.topk_count}")
        expected = encoded_size(self.codec, self.numel, self.block_size, self.topk_count)
        if self.encoded_bytes != expected:
            raise CodecError(
                f"encoded_bytes {self.encoded_bytes} does not match codec {self.codec} with numel "
                f"{self.numel}, block_size {self.block_size}, topk_count {self.topk_count} "
                f"(that is {expected} bytes)"
            )
        if max_bytes is not None and self.encoded_bytes > max_bytes:
            raise CodecError(
                f"payload of {self.encoded_bytes} bytes exceeds the limit of {max_bytes} bytes; "
                "send it with a more compact codec or raise the limit"
            )


def payload_decoder(
    meta: EncodedMeta, out: torch.Tensor | None = None, *, sink: WindowSink | None = None
) -> StreamDecoder:
    """The decoder of a payload described by `meta` (its codec, with the meta's block size), into `out` or `sink`
    (`Codec.decoder`)."""
    return get_codec(meta.codec, block_size=meta.block_size or 128).decoder(meta, out, sink=sink)


def iter_chunks(data: bytes | bytearray | memoryview, chunk_bytes: int = 1 << 20) -> Iterator[memoryview]:
    """Zero-copy slices of `data` of `chunk_bytes` each (the last may be shorter)."""
    if chunk_bytes < 1:
        raise CodecError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    view = _byte_view(data)
    for start in range(0, len(view), chunk_bytes):
        yield view[start : start + chunk_bytes]


class ChunkSource(Protocol):
    """Payload bytes kept outside this process's memory (e.g. `diloco.rpc.payload.SpillFile`), read back in order
    from `offset`, `chunk_bytes` at a time (the last may be shorter)."""

    def chunks(self, chunk_bytes: int, offset: int = 0) -> Iterator[bytes]: ...


Payload = bytes | bytearray | memoryview | ChunkSource  # a payload's bytes, in memory or not


def payload_chunks(data: Payload, chunk_bytes: int = 1 << 20, offset: int = 0) -> Iterator[bytes | memoryview]:
    """`data`'s bytes from `offset` in chunks of `chunk_bytes`: zero-copy slices when it is in memory."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return iter_chunks(_byte_view(data)[offset:], chunk_bytes)
    return data.chunks(chunk_bytes, offset)


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _tensor_view(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `data` without copying. We only read it, so torch's read-only warning does not apply."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)


def _check_input(flat: torch.Tensor) -> torch.Tensor:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.float32:
        got = f"{flat.dtype} of shape {tuple(flat.shape)}" if isinstance(flat, torch.Tensor) else type(flat)
        raise CodecError(f"codecs take a 1-D float32 tensor, got {got}; flatten and cast first")
    if flat.numel() < 1:
        raise CodecError("cannot encode an empty vector")
    return flat.detach().to("cpu").contiguous()


def _check_finite(ok: bool, codec: str) -> None:
    if not ok:
        raise CodecError(f"{codec} cannot encode NaN or inf; check the pseudo-gradient for divergence")


@dataclass
class _Section:
    """A run of `length` bytes decoded `unit` bytes at a time by `handler(piece, byte_offset_in_section)`.
    Pieces hold whole units, except that the last piece of the section may end with a short unit."""

    length: int
    unit: int
    handler: Callable[[memoryview, int], None]
    on_complete: Callable[[], None] | None = None


class WindowSink(Protocol):
    """Takes a decoded payload window by window instead of a model-sized output buffer (`Codec.decoder(meta,
    sink=...)`). The tensors are valid only during the call, and only read: one may be a view of the payload's own
    bytes (an fp32 payload's)."""

    def dense(self, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len(values)) are `values` (every element of the vector comes once)."""

    def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Elements `index` (int64, increasing) are `values`; elements never named are 0 (topk payloads)."""


@runtime_checkable
class AddingSink(WindowSink, Protocol):
    """A sink that adds the decoded values to a vector it holds (a learner's `Θ̂`, brought to the next version in
    place: `diloco.core.broadcast`). A block codec's decoder adds them there itself, fused with the decode
    (`kernels.dequantize_add`: one pass over the window, no scratch), where others hand windows to `dense`."""

    def add_target(self, start: int, count: int) -> torch.Tensor:
        """The contiguous fp32 CPU tensor that elements [start, start + count) are added into."""

    whole: bool  # the payload covers the whole vector added into (its terms before are not needed)

    def element(self, start: int) -> int:
        """The absolute index, in the vector added into, of element `start` of the payload."""

    def added(self, start: int, window: torch.Tensor, old: int, new: int) -> None:
        """`window`, from `add_target`, holds its new values; `old` and `new`: its state-checksum terms
        (`diloco.core.checksum`) before (0 when `whole`) and after."""


class SlabStore(Protocol):
    """A flat fp32 vector of `numel` values held outside this process's memory (e.g.
    `diloco.rpc.payload.SpilledVector`, a learner's error-feedback residual with `--spill-dir`), read and written
    a slab at a time."""

    numel: int

    def read(self, start: int, out: torch.Tensor) -> None:
        """`out` (contiguous fp32) ← the values [start, start + len(out))."""

    def write(self, start: int, values: torch.Tensor) -> None:
        """The values [start, start + len(values)) ← `values` (contiguous fp32)."""

    def zero(self) -> None:
        """Every value ← 0."""


Load = Callable[[int, int], torch.Tensor]  # load(start, end): the values [start, end), a contiguous fp32 tensor
Store = Callable[[int, torch.Tensor], None]  # store(start, values): write back what `load` gave, changed


_WINDOW_ELEMENTS = 1 << 20  # with a sink, about how many elements one window holds


class StreamDecoder:
    """Decodes one payload fed in chunks of any size into `out`, keeping only a partial unit between feeds; or,
    with a `sink` instead of `out`, hands it over in windows of about `_WINDOW_ELEMENTS` elements (the payload is
    decoded in pieces of the matching number of bytes; a window's scratch is reused: no model-sized buffer).

    `feed` raises `CodecError` as soon as it sees more bytes than announced or malformed content (a topk
    index out of range or not increasing, a NaN, inf or negative scale); `verify` (and `finish`, which returns
    `out`) raises when bytes are missing or the crc32 does not match. `out` is written as bytes arrive, so after
    an error its content is garbage: decode into a scratch buffer when that matters.
    """

    def __init__(
        self, meta: EncodedMeta, out: torch.Tensor | None, sections: Sequence[_Section], sink: WindowSink | None = None
    ) -> None:
        if (out is None) == (sink is None):
            raise CodecError("a decoder writes either into an output buffer or into a sink")
        self.meta = meta
        self._out = out
        self._sink = sink
        # a sink that adds in place (checked once: an isinstance on a runtime protocol costs ~12 us, per window)
        self._adding = sink if isinstance(sink, AddingSink) else None
        self._scratch = torch.empty(0, dtype=torch.float32)
        # a sink gets windows of about _WINDOW_ELEMENTS elements: decode that many elements' bytes at a time
        # (times the threads: each decodes a part of about that many at once, `diloco.core.parallel`)
        # cut where a section's pieces start, in whole units of every section: no window is cut short by where the
        # section before ended (one is, where a fed chunk ends)
        window = _WINDOW_ELEMENTS * parallel.threads()
        unit = math.lcm(*(s.unit for s in sections))
        self._piece_bytes = max(1, window * meta.encoded_bytes // max(1, meta.numel) // unit) * unit
        self._sections = [s for s in sections if s.length > 0]
        self._section = 0
        self._section_pos = 0
        self._remainder = bytearray()
        self._received = 0
        self._crc = 0
        self._failed: CodecError | None = None

    @property
    def bytes_received(self) -> int:
        """Payload bytes fed so far."""
        return self._received

    @property
    def out(self) -> torch.Tensor:
        if self._out is None:
            raise CodecError("this decoder hands its values to a sink: it has no output buffer")
        return self._out

    def _window(self, start: int, count: int) -> torch.Tensor:
        """Where elements [start, start + count) are decoded: `out`'s slice, or scratch that `_emit` hands over."""
        if self._out is not None:
            return self._out[start : start + count]
        if self._scratch.numel() < count:
            self._scratch = torch.empty(count, dtype=torch.float32)
        return self._scratch[:count]

    def _emit(self, start: int, window: torch.Tensor) -> None:
        """A window from `_window` holds its final values."""
        if self._sink is not None:
            self._sink.dense(start, window)

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Decode every complete unit of `chunk` (with the partial one kept from earlier feeds) into `out`."""
        self._raise_if_failed()
        view = _byte_view(chunk)
        if not view:
            return
        if self._received + len(view) > self.meta.encoded_bytes:
            self._fail(
                f"received {self._received + len(view)} bytes but the payload has {self.meta.encoded_bytes}; "
                "the stream carries extra data or belongs to another payload: restart the transfer"
            )
        self._crc = parallel.parallel_crc32(view, self._crc)
        self._received += len(view)
        rest = view
        try:
            while rest:
                section = self._sections[self._section]
                room = section.length - self._section_pos
                if self._sink is not None:  # to the end of this piece of the section
                    room = min(room, self._piece_bytes - self._section_pos % self._piece_bytes)
                piece = rest[:room]
                rest = rest[len(piece) :]
                self._feed_section(section, piece)
        except CodecError as err:
            self._failed = err
            self._sections = []
            raise

    def finish(self) -> torch.Tensor:
        """`verify`, then return `out`."""
        self.verify()
        return self.out

    def verify(self) -> None:
        """Check that the payload is complete and intact."""
        self._raise_if_failed()
        if self._received < self.meta.encoded_bytes:
            self._fail(
                f"payload truncated: got {self._received} of {self.meta.encoded_bytes} bytes; "
                "resume the transfer from the bytes held or send it again"
            )
        if self._crc != self.meta.crc32:
            self._fail(
                f"crc32 mismatch: payload has {self._crc:#010x}, header says {self.meta.crc32:#010x}; "
                "the bytes were corrupted in transit: send them again"
            )
        self._sections = []  # the section handlers are bound methods: drop them so no cycle keeps `out` alive

    def _feed_section(self, section: _Section, piece: memoryview) -> None:
        pos = 0
        if self._remainder:
            take = piece[: section.unit - len(self._remainder)]
            self._remainder += take
            pos = len(take)
            self._section_pos += pos
            if len(self._remainder) == section.unit or self._section_pos == section.length:
                unit = memoryview(bytes(self._remainder))
                self._remainder = bytearray()
                section.handler(unit, self._section_pos - len(unit))
        whole = (len(piece) - pos) // section.unit * section.unit
        if whole:
            section.handler(piece[pos : pos + whole], self._section_pos)
            self._section_pos += whole
            pos += whole
        tail = piece[pos:]
        if tail:
            self._section_pos += len(tail)
            if self._section_pos == section.length:
                section.handler(tail, self._section_pos - len(tail))
            else:
                self._remainder = bytearray(tail)
        if self._section_pos == section.length:
            if section.on_complete is not None:
                section.on_complete()
            self._section += 1
            self._section_pos = 0

    def _fail(self, message: str) -> NoReturn:
        self._failed = CodecError(message)
        self._sections = []
        raise self._failed

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise CodecError(f"decoder already failed ({self._failed}); start a new one")


class Codec(ABC):
    """Encodes a flat float32 vector to bytes; decodes bytes (whole or streamed) back."""

    name: ClassVar[str]
    lossy: ClassVar[bool]
    residual_decay: ClassVar[float] = 1.0  # the error feedback's default β (see `ErrorFeedback`)
    blockwise: ClassVar[bool] = False  # its payloads have a block_size (one scale per block)
    sparse: ClassVar[bool] = False  # its payloads hold topk_count entries; error feedback holds back the rest

    @classmethod
    def create(cls, *, block_size: int | None = None, topk_fraction: float | None = None) -> Codec:
        """An instance with the settings that apply to this codec (`get_codec`); None: the codec's default."""
        return cls()

    @classmethod
    @abstractmethod
    def payload_bytes(cls, numel: int, block_size: int, topk_count: int) -> int:
        """Bytes of a payload of `numel` elements (`block_size` and `topk_count` as in its meta)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @abstractmethod
    def encode(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        """Encode a 1-D float32 tensor (any device). `meta.crc32` is `zlib.crc32` of the bytes."""

    def encode_owned(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        """`encode` of a tensor its caller gives up: the payload may be `flat`'s own memory (fp32's is: no copy),
        so the caller must not write to it afterwards."""
        return self.encode(flat)

    @abstractmethod
    def _decoder(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None) -> StreamDecoder: ...

    def decoder(
        self, meta: EncodedMeta, out: torch.Tensor | None = None, *, sink: WindowSink | None = None
    ) -> StreamDecoder:
        """A streaming decoder for a payload described by `meta`, writing into `out` (a float32 CPU buffer of
        `meta.numel` elements, allocated when None; every element is overwritten), or handing the values to
        `sink` window by window (then `out` must be None)."""
        if meta.codec != self.name:
            raise CodecError(f"payload codec {meta.codec!r} cannot be decoded by the {self.name} codec")
        meta.validate(expected_numel=meta.numel)
        if sink is not None:
            if out is not None:
                raise CodecError("a decoder writes either into an output buffer or into a sink")
        elif out is None:
            out = torch.empty(meta.numel, dtype=torch.float32)
        elif (
            out.dtype != torch.float32
            or out.shape != (meta.numel,)
            or out.device.type != "cpu"
            or not out.is_contiguous()
        ):
            raise CodecError(
                f"decode buffer must be a contiguous 1-D float32 CPU tensor of {meta.numel} elements, "
                f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
            )
        return self._decoder(meta, out, sink)

    def decode(self, data: bytes | bytearray | memoryview, meta: EncodedMeta) -> torch.Tensor:
        """Decode a whole payload into a new tensor."""
        stream = self.decoder(meta)
        stream.feed(data)
        return stream.finish()

    def encode_and_subtract(self, target: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        """Encode `target` (a contiguous 1-D float32 CPU tensor) and subtract what the receiver will decode
        from it in place, leaving the compression error. Used by `ErrorFeedback`."""
        _check_input(target)
        if target.device.type != "cpu" or not target.is_contiguous() or target.requires_grad:
            raise CodecError("encode_and_subtract works in place: pass a contiguous float32 CPU tensor")
        return self._encode_and_subtract(target)

    def _encode_and_subtract(self, target: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        data, meta = self.encode(target)
        target.sub_(self.decode(data, meta))
        return data, meta

    def encode_and_subtract_slabs(
        self, numel: int, load: Load, store: Store
    ) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        """`encode_and_subtract` of a vector of `numel` values that is not in memory as a whole: `load(start, end)`
        gives a slab, `store(start, slab)` takes it back with the decoded values subtracted. The same bits as
        `encode_and_subtract` of the whole vector. Blockwise codecs work a slab at a time; the others load the
        whole vector once."""
        whole = load(0, numel)
        data, meta = self.encode_and_subtract(whole)
        store(0, whole)
        return data, meta

    def encode_toward(
        self,
        params: torch.Tensor,
        shadow: torch.Tensor,
        out: torch.Tensor,
        scratch: torch.Tensor | None = None,
        element: int = 0,
        base: int | None = None,
    ) -> tuple[bytes | bytearray | memoryview, EncodedMeta, int]:
        """Encode `params − shadow` and write `shadow + D(q)` into `out` (`shadow` itself or another buffer; D is
        this codec's decoder, fed the very bytes), bit for bit what a receiver holding `shadow` gets when it
        decodes the payload and adds it with one fp32 add. Returns the payload, its meta and the state checksum
        (`diloco.core.checksum`) of the vector once `out` is written: `out` itself when `base` is None, else the
        vector whose range from absolute index `element` `shadow` is, whose checksum was `base` (moved by the
        range's terms before and after). All three are contiguous 1-D float32 CPU tensors of one size; on a
        `CodecError` `out` holds garbage. This plain version works in `scratch` (model-sized, else allocated);
        blockwise codecs fuse it."""
        self._check_toward(params, shadow, out)
        if scratch is None or scratch.shape != params.shape or scratch.device.type != "cpu":
            scratch = torch.empty_like(params)
        old = 0 if base is None else checksum(shadow, element)
        work = torch.sub(params, shadow, out=scratch)
        data, meta = self.encode(work)
        decoder = self.decoder(meta, work)
        for chunk in iter_chunks(data):  # a chunk at a time, as receivers get it: no payload-sized temporaries
            decoder.feed(chunk)
        decoder.finish()
        torch.add(shadow, work, out=out)
        return data, meta, _moved(base, old, checksum(out, element))

    @staticmethod
    def _check_toward(params: torch.Tensor, shadow: torch.Tensor, out: torch.Tensor) -> None:
        for t in (params, shadow, out):
            if t.dtype != torch.float32 or t.dim() != 1 or t.device.type != "cpu" or not t.is_contiguous():
                raise CodecError("encode_toward takes contiguous 1-D float32 CPU tensors")
        if not params.numel() == shadow.numel() == out.numel() >= 1:
            raise CodecError(
                f"encode_toward needs vectors of one size, got {params.numel()}, {shadow.numel()}, {out.numel()}"
            )

    def _finish(
        self, payload: np.ndarray, numel: int, block_size: int = 0, topk_count: int = 0
    ) -> tuple[memoryview, EncodedMeta]:
        """`payload` (a uint8 array this encode wrote, or memory its caller gave up: `encode_owned`) as the payload,
        not copied, and its meta."""
        data = payload.data
        return data, EncodedMeta(self.name, numel, len(data), parallel.parallel_crc32(data), block_size, topk_count)


class FP32Codec(Codec):
    """Raw little-endian float32: lossless."""

    name = "fp32"
    lossy = False

    @classmethod
    def payload_bytes(cls, numel: int, block_size: int, topk_count: int) -> int:
        return 4 * numel

    def encode(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        x = _check_input(flat)
        payload = np.empty(4 * x.numel(), dtype=np.uint8)  # a copy: the caller's tensor may change after
        payload.view(np.float32)[:] = x.numpy()
        return self._finish(payload, x.numel())

    def encode_owned(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        x = _check_input(flat)
        return self._finish(x.numpy().view(np.uint8), x.numel())  # its own bytes are the payload

    def _encode_and_subtract(self, target: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        data, meta = self.encode(target)
        target.zero_()
        return data, meta

    def _decoder(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None) -> StreamDecoder:
        return _RawDecoder(meta, out, sink, torch.float32, 4)


class BF16Codec(Codec):
    """bfloat16, rounded to nearest even: relative error at most 2**-8."""

    name = "bf16"
    lossy = True

    @classmethod
    def payload_bytes(cls, numel: int, block_size: int, topk_count: int) -> int:
        return 2 * numel

    def encode(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        return self._encode(_check_input(flat), subtract=False)

    def _encode_and_subtract(self, target: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        return self._encode(target, subtract=True)

    def _encode(self, x: torch.Tensor, *, subtract: bool) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        payload = np.empty(2 * x.numel(), dtype=np.uint8)
        halves = torch.from_numpy(payload.view(np.int16))  # written a slab at a time: no payload-sized temporary
        for start in range(0, x.numel(), _SLAB):
            slab = x[start : start + _SLAB]
            half = slab.to(torch.bfloat16)
            halves[start : start + slab.numel()].copy_(half.view(torch.int16))
            if subtract:
                slab.sub_(half.to(torch.float32))
        return self._finish(payload, x.numel())

    def _decoder(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None) -> StreamDecoder:
        return _RawDecoder(meta, out, sink, torch.bfloat16, 2)


class _RawDecoder(StreamDecoder):
    def __init__(
        self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None, dtype: torch.dtype, itemsize: int
    ) -> None:
        viewable = out is None and dtype == torch.float32  # fp32 bytes are the values: a sink may read them as they are

        def handle(piece: memoryview, offset: int) -> None:
            start = offset // itemsize
            values = _tensor_view(piece, dtype)
            if viewable and values.data_ptr() % itemsize == 0:
                self._emit(start, values)  # a view of the fed bytes, no copy
            else:
                self._emit(start, self._window(start, values.numel()).copy_(values))

        super().__init__(meta, out, [_Section(meta.encoded_bytes, itemsize, handle)], sink)


def _moved(base: int | None, old: int, new: int) -> int:
    """The checksum of a vector a range of which was rewritten, from the range's terms: `new` alone when the range
    is the whole vector (`base` None), else `base` moved by them."""
    return new & MASK if base is None else moved(base, old, new)


def _viewing(x: torch.Tensor) -> Load:
    """`load` for a vector in memory: views of it (a slab changed in place needs no `store`)."""
    return lambda start, end: x[start:end]


def _in_place(start: int, values: torch.Tensor) -> None:
    """`store` for `_viewing`: the values were changed where they are."""


class _BlockCodec(Codec):
    """Blockwise abs-max quantization to [-qmax, qmax] with one float32 scale per block; the loops are
    `diloco.core.kernels`' (imported at first use: numba's start-up stays out of processes that never quantize)."""

    qmax: ClassVar[int]
    blockwise = True

    @classmethod
    def create(cls, *, block_size: int | None = None, topk_fraction: float | None = None) -> Codec:
        return cls(128 if block_size is None else block_size)

    @classmethod
    def payload_bytes(cls, numel: int, block_size: int, topk_count: int) -> int:
        if block_size <= 0:
            raise CodecError(f"{cls.name} needs a block_size > 0, got {block_size}")
        return 4 * -(-numel // block_size) + cls._packed_bytes(numel)

    def __init__(self, block_size: int = 128) -> None:
        if block_size not in ALLOWED_BLOCK_SIZES:
            raise CodecError(
                f"{self.name} block_size {block_size} is not allowed; use a power of two from "
                f"{ALLOWED_BLOCK_SIZES[0]} to {ALLOWED_BLOCK_SIZES[-1]}"
            )
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"

    @staticmethod
    @abstractmethod
    def _packed_bytes(count: int) -> int:
        """Bytes that `count` values take."""

    def _decoder(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None) -> StreamDecoder:
        return _BlockDecoder(meta, out, sink, self.qmax)

    def encode(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        x = _check_input(flat)
        return self._encode(x.numel(), _viewing(x), _in_place, subtract=False)

    def _encode_and_subtract(self, target: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        return self._encode(target.numel(), _viewing(target), _in_place, subtract=True)

    def encode_and_subtract_slabs(
        self, numel: int, load: Load, store: Store
    ) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        if numel < 1:
            raise CodecError("cannot encode an empty vector")
        return self._encode(numel, load, store, subtract=True)

    def _payload(self, numel: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A fresh payload for `numel` values and its two sections: scales (float32) and packed values (uint8).
        It is neither zeroed nor touched first (a bytearray would be zeroed holding the GIL). Fresh memory each time:
        keeping the last payload's for the next (saving its page faults, 5-10 ms at 100M parameters) would keep a
        payload-sized buffer alive on a learner between rounds, against its peak-memory budget."""
        blocks = -(-numel // self.block_size)
        payload = np.empty(4 * blocks + self._packed_bytes(numel), dtype=np.uint8)
        return payload, payload[: 4 * blocks].view(np.float32), payload[4 * blocks :]

    def _slab(self, scales: np.ndarray, values: np.ndarray, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The scales and packed bytes of elements [start, end), a whole number of blocks from a block's start."""
        first, blocks = start // self.block_size, (end - start) // self.block_size
        at = self._packed_bytes(start)  # whole blocks: whole bytes
        return scales[first : first + blocks], values[at : at + self._packed_bytes(end - start)]

    def _encode(self, numel: int, load: Load, store: Store, *, subtract: bool) -> tuple[memoryview, EncodedMeta]:
        """Quantize slab by slab straight into the payload (`kernels.quantize`): scales and packed values are
        written in place."""
        from diloco.core import kernels

        bs = self.block_size
        full = numel // bs * bs
        payload, scales, values = self._payload(numel)

        def part(lo: int, hi: int) -> int:  # the largest |x| bit pattern of [lo, hi)
            worst = 0
            for start in range(lo, hi, _SLAB):
                end = min(start + _SLAB, hi)
                loaded = load(start, end)
                block_scales, block_values = self._slab(scales, values, start, end)
                worst = max(
                    worst, kernels.quantize(loaded.numpy(), bs, self.qmax, block_scales, block_values, subtract)
                )
                if subtract:
                    store(start, loaded)
            return worst

        # a vector in memory is encoded in parts at once; slabs loaded from elsewhere (a file) one after another
        worst = max(parallel.map_parts(part, 0, full, bs) if store is _in_place else [part(0, full)], default=0)
        if full < numel:  # the short last block, padded with zeros (they do not change its abs-max)
            tail = load(full, numel)
            padded = np.zeros(bs, dtype=np.float32)
            padded[: tail.numel()] = tail.numpy()
            packed = np.empty(self._packed_bytes(bs), dtype=np.uint8)
            worst = max(worst, kernels.quantize(padded, bs, self.qmax, scales[-1:], packed, subtract))
            values[self._packed_bytes(full) :] = packed[: self._packed_bytes(tail.numel())]
            if subtract:
                tail.copy_(torch.from_numpy(padded[: tail.numel()]))
                store(full, tail)
        _check_finite(worst < kernels.NON_FINITE, self.name)
        return self._finish(payload, numel, block_size=bs)

    def encode_toward(
        self,
        params: torch.Tensor,
        shadow: torch.Tensor,
        out: torch.Tensor,
        scratch: torch.Tensor | None = None,
        element: int = 0,
        base: int | None = None,
    ) -> tuple[bytes | bytearray | memoryview, EncodedMeta, int]:
        """Fused block by block (`kernels.quantize_toward`): the plain path's bits and checksum without its
        model-sized passes, out = shadow + q * scale as the decoder computes it, the terms taken while each block
        is in cache (the old ones only for a range, `base` given). No model-sized scratch is needed: `scratch` is
        not used."""
        from diloco.core import kernels

        numel = params.numel()
        self._check_toward(params, shadow, out)
        bs = self.block_size
        full = numel // bs * bs
        payload, scales, values = self._payload(numel)
        p, s, o = params.numpy(), shadow.numpy(), out.numpy()

        def part(lo: int, hi: int) -> tuple[int, int, int]:  # (worst, old term, new term) of [lo, hi)
            worst, old, new = 0, 0, 0
            for start in range(lo, hi, _FUSED_SLAB):
                end = min(start + _FUSED_SLAB, hi)
                block_scales, block_values = self._slab(scales, values, start, end)
                view = slice(start, end)
                w, o_term, n_term = kernels.quantize_toward(
                    p[view], s[view], o[view], bs, self.qmax, block_scales, block_values, at + start, ranged
                )
                worst, old, new = max(worst, w), old + int(o_term), new + int(n_term)
            return worst, old, new

        at, ranged = element, base is not None
        parts = parallel.map_parts(part, 0, full, bs)
        worst = max((w for w, _, _ in parts), default=0)
        old, new = sum(t for _, t, _ in parts), sum(t for _, _, t in parts)
        if full < numel:  # the short last block, padded with zeros as `_encode` does (zeros add nothing to a term)
            padded = np.zeros((3, bs), dtype=np.float32)  # params, shadow, out
            padded[0, : numel - full], padded[1, : numel - full] = p[full:], s[full:]
            packed = np.empty(self._packed_bytes(bs), dtype=np.uint8)
            w, o_term, n_term = kernels.quantize_toward(
                padded[0], padded[1], padded[2], bs, self.qmax, scales[-1:], packed, at + full, ranged
            )
            worst, old, new = max(worst, w), old + int(o_term), new + int(n_term)
            values[self._packed_bytes(full) :] = packed[: self._packed_bytes(numel - full)]
            o[full:] = padded[2, : numel - full]
        _check_finite(worst < kernels.NON_FINITE, self.name)
        return (*self._finish(payload, numel, block_size=bs), _moved(base, old, new))


class Int8Codec(_BlockCodec):
    """Blockwise abs-max int8: error at most scale/2 per element."""

    name = "int8"
    lossy = True
    qmax = 127

    @staticmethod
    def _packed_bytes(count: int) -> int:
        return count


class Int4Codec(_BlockCodec):
    """Blockwise abs-max 4-bit (values -7..7, two per byte): error at most scale/2 per element."""

    name = "int4"
    lossy = True
    qmax = 7

    @staticmethod
    def _packed_bytes(count: int) -> int:
        return (count + 1) // 2


class _BlockDecoder(StreamDecoder):
    """Scales first (kept and checked), then values decoded a whole number of blocks at a time
    (`kernels.dequantize`, or `kernels.dequantize_add` into an `AddingSink`'s vector), in parts on `--threads`
    threads."""

    def __init__(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None, qmax: int) -> None:
        bs = meta.block_size
        blocks = -(-meta.numel // bs)
        self._qmax = qmax
        self._block_bytes = bs if qmax > 7 else bs // 2
        self._scales = np.empty(blocks, dtype=np.float32)
        super().__init__(
            meta,
            out,
            [
                _Section(4 * blocks, 1, self._scale_piece, self._check_scales),
                _Section(meta.encoded_bytes - 4 * blocks, self._block_bytes, self._values),
            ],
            sink,
        )

    def _scale_piece(self, piece: memoryview, offset: int) -> None:
        self._scales.view(np.uint8)[offset : offset + len(piece)] = np.frombuffer(piece, dtype=np.uint8)

    def _check_scales(self) -> None:
        if not (self._scales.min() >= 0.0 and math.isfinite(self._scales.max())):  # NaN fails both
            block = int(np.flatnonzero(~np.isfinite(self._scales) | (self._scales < 0))[0])
            raise CodecError(
                f"{self.meta.codec} scale of block {block} is {self._scales[block]} "
                "(must be finite and >= 0); the payload is corrupt: send it again"
            )

    def _values(self, piece: memoryview, offset: int) -> None:
        from diloco.core import kernels

        bs, per_block = self.meta.block_size, self._block_bytes
        first = offset // per_block
        packed = np.frombuffer(piece, dtype=np.uint8)
        # the short last block can take whole bytes too (int4: block_size - 1 values), so count whole blocks by values
        whole = min(len(packed) // per_block, (self.meta.numel - first * bs) // bs)
        if whole:
            scales = self._scales[first : first + whole]
            adding = self._adding
            window = adding.add_target(first * bs, whole * bs) if adding else self._window(first * bs, whole * bs)
            values = window.numpy()

            at = adding.element(first * bs) if adding else 0  # where the window sits in the vector added into

            def part(lo: int, hi: int) -> tuple[int, int]:  # elements [lo, hi) of the window: whole blocks
                b0, b1 = lo // bs, hi // bs
                args = (packed[b0 * per_block : b1 * per_block], scales[b0:b1], bs, self._qmax, values[lo:hi])
                if not adding:
                    kernels.dequantize(*args)
                    return 0, 0
                old, new = kernels.dequantize_add(*args, at + lo, not adding.whole)
                return int(old), int(new)

            terms = parallel.map_parts(part, 0, whole * bs, bs)
            if adding:
                adding.added(first * bs, window, sum(o for o, _ in terms) & MASK, sum(n for _, n in terms) & MASK)
            else:
                self._emit(first * bs, window)
        if len(packed) > whole * per_block:  # the short last block, decoded padded; int4's odd last nibble is padding
            start = (first + whole) * bs
            padded = np.zeros(per_block, dtype=np.uint8)
            padded[: len(packed) - whole * per_block] = packed[whole * per_block :]
            values = np.empty(bs, dtype=np.float32)
            kernels.dequantize(padded, self._scales[first + whole :], bs, self._qmax, values)
            window = self._window(start, self.meta.numel - start)
            self._emit(start, window.copy_(torch.from_numpy(values[: window.numel()])))


class TopKCodec(Codec):
    """The k largest-magnitude entries as (index, value) records; the rest decode to zero."""

    name = "topk"
    lossy = True
    residual_decay = 0.5  # exact feedback diverges at low density (see `ErrorFeedback`)
    sparse = True

    @classmethod
    def create(cls, *, block_size: int | None = None, topk_fraction: float | None = None) -> Codec:
        return cls(0.01 if topk_fraction is None else topk_fraction)

    @classmethod
    def payload_bytes(cls, numel: int, block_size: int, topk_count: int) -> int:
        return 8 * topk_count

    def __init__(self, fraction: float = 0.01) -> None:
        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
            raise CodecError(f"topk fraction must be in (0, 1], got {fraction!r}")
        self.fraction = float(fraction)

    def __repr__(self) -> str:
        return f"TopKCodec(fraction={self.fraction})"

    def count(self, numel: int) -> int:
        """How many entries are kept out of `numel`."""
        return min(numel, max(1, round(self.fraction * numel)))

    def encode(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        data, meta, _ = self._encode(_check_input(flat))
        return data, meta

    def _encode_and_subtract(self, target: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        data, meta, index = self._encode(target)
        target[index] = 0.0
        return data, meta

    def _encode(self, x: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta, torch.Tensor]:
        numel = x.numel()
        if numel > MAX_TOPK_NUMEL:
            raise CodecError(f"topk supports at most {MAX_TOPK_NUMEL} elements, got {numel}; use int8")
        k = self.count(numel)
        index = _top_indices(x, k)
        records = np.empty(k, dtype=_TOPK_RECORD)
        records["index"] = index.numpy()
        records["value"] = x[index].numpy()
        data, meta = self._finish(records.view(np.uint8), numel, topk_count=k)
        return data, meta, index

    def _decoder(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None) -> StreamDecoder:
        return _TopKDecoder(meta, out, sink)


def _top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of k largest-magnitude entries of x (ties broken by lower index on the sampled path).

    For large inputs, a threshold taken from a random sample keeps a candidate set that surely holds the top
    k (checked by counting; otherwise fall back), and the exact k-th magnitude is found among the candidates
    only: much faster than `torch.topk` over everything, and the candidates stay in index order.
    """
    numel = x.numel()
    if numel < _TOPK_SAMPLED_MIN_NUMEL or 4 * k > numel:
        magnitude = x.abs()
        _check_finite(bool(torch.isfinite(magnitude.max())), "topk")
        return torch.topk(magnitude, k, sorted=False).indices.sort().values
    threshold = _sample_threshold(x, k)
    values = x.numpy()
    scratch = np.empty(min(_SLAB, numel), dtype=np.float32)
    hits = np.empty(min(_SLAB, numel), dtype=np.bool_)
    found, finite = [], True
    for start in range(0, numel, _SLAB):  # numpy here: its nonzero is far faster than torch's
        size = min(_SLAB, numel - start)
        magnitude = np.abs(values[start : start + size], out=scratch[:size])
        finite = finite and math.isfinite(float(magnitude.max()))  # max propagates NaN
        found.append(np.flatnonzero(np.greater_equal(magnitude, threshold, out=hits[:size])) + start)
    _check_finite(finite, "topk")
    candidates = torch.from_numpy(np.concatenate(found))
    if candidates.numel() < k:  # an unlucky sample: the exact way
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values
    magnitude = x[candidates].abs_()
    kth = torch.kthvalue(magnitude, candidates.numel() - k + 1).values
    above = magnitude > kth
    ties = magnitude == kth
    keep = above | (ties & (torch.cumsum(ties, 0) <= k - int(above.sum())))
    return candidates[keep]


def _sample_threshold(x: torch.Tensor, k: int) -> float:
    """A magnitude that, with overwhelming probability, at least k (and not many more) entries reach."""
    numel = x.numel()
    gen = torch.Generator().manual_seed(numel)  # deterministic: the same input always gives the same bytes
    sample = x[torch.randint(numel, (_TOPK_SAMPLE,), generator=gen)].abs_()
    expected = _TOPK_SAMPLE * k / numel
    rank = min(_TOPK_SAMPLE, int(1.1 * expected + 4.0 * math.sqrt(expected) + 16))
    return float(torch.topk(sample, rank, sorted=False).values.min())


class _TopKDecoder(StreamDecoder):
    def __init__(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None) -> None:
        if out is not None:
            out.zero_()
        self._last_index = -1
        super().__init__(meta, out, [_Section(meta.encoded_bytes, _TOPK_RECORD.itemsize, self._records)], sink)

    def _records(self, piece: memoryview, offset: int) -> None:
        records = np.frombuffer(piece, dtype=_TOPK_RECORD)
        index = records["index"].astype(np.int64)
        first = offset // _TOPK_RECORD.itemsize
        steps = np.diff(index, prepend=self._last_index)
        if not bool((steps > 0).all()):
            at = int(np.argmax(steps <= 0))
            raise CodecError(
                f"topk record {first + at}: index {index[at]} does not increase "
                f"(previous {index[at] - steps[at]}); the payload is corrupt: send it again"
            )
        if index[-1] >= self.meta.numel:
            at = int(np.argmax(index >= self.meta.numel))
            raise CodecError(
                f"topk record {first + at}: index {index[at]} is out of range for numel {self.meta.numel}; "
                "the payload is corrupt or meant for another model layout"
            )
        self._last_index = int(index[-1])
        values = torch.from_numpy(records["value"].astype(np.float32))
        if self._sink is not None:
            self._sink.sparse(torch.from_numpy(index), values)
        else:
            self.out[torch.from_numpy(index)] = values


class SparseCodec(Codec):
    """Chunked top-k with 2-bit values (SparseLoCo-class): per chunk of `block_size` elements, the k
    largest-magnitude entries as uint16 offsets, a sign and one of two magnitude levels (low and low + step, one
    pair of float32 per chunk). About 2.4 bytes per kept entry where `topk` takes 8; error feedback holds back the
    rest (and the quantisation error of what was kept)."""

    name = "sparse"
    lossy = True
    residual_decay = 0.5  # measured best of 1, 0.9 and 0.5 (see `ErrorFeedback`)
    blockwise = True
    sparse = True
    BITS: ClassVar[int] = 2
    DEFAULT_CHUNK: ClassVar[int] = 4096
    DEFAULT_FRACTION: ClassVar[float] = 1 / 64  # 64 entries per 4096-element chunk

    @classmethod
    def create(cls, *, block_size: int | None = None, topk_fraction: float | None = None) -> Codec:
        return cls(
            cls.DEFAULT_CHUNK if block_size is None else block_size,
            cls.DEFAULT_FRACTION if topk_fraction is None else topk_fraction,
        )

    @classmethod
    def record_bytes(cls, kept: int) -> int:
        """Bytes of one chunk's record holding `kept` entries."""
        return 8 + 2 * kept + -(-kept * cls.BITS // 8)

    @classmethod
    def payload_bytes(cls, numel: int, block_size: int, topk_count: int) -> int:
        if block_size <= 0 or topk_count <= 0:
            raise CodecError(f"{cls.name} needs block_size > 0 and topk_count > 0, got {block_size}, {topk_count}")
        chunks = -(-numel // block_size)
        last = numel - (chunks - 1) * block_size
        return (chunks - 1) * cls.record_bytes(topk_count) + cls.record_bytes(min(topk_count, last))

    def __init__(self, block_size: int = DEFAULT_CHUNK, fraction: float = DEFAULT_FRACTION) -> None:
        if block_size not in ALLOWED_BLOCK_SIZES:
            raise CodecError(
                f"{self.name} chunk (block_size) {block_size} is not allowed; use a power of two from "
                f"{ALLOWED_BLOCK_SIZES[0]} to {ALLOWED_BLOCK_SIZES[-1]}"
            )
        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
            raise CodecError(f"{self.name} fraction must be in (0, 1], got {fraction!r}")
        self.block_size = block_size
        self.fraction = float(fraction)
        self.per_chunk = min(block_size, max(1, round(fraction * block_size)))

    def __repr__(self) -> str:
        return f"SparseCodec(block_size={self.block_size}, fraction={self.fraction})"

    def encode(self, flat: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        return self._encode(_check_input(flat), subtract=False)

    def _encode_and_subtract(self, target: torch.Tensor) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        return self._encode(target, subtract=True)

    def _encode(self, x: torch.Tensor, *, subtract: bool) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        bs, k, numel = self.block_size, self.per_chunk, x.numel()
        full = numel // bs * bs
        payload = np.empty(self.payload_bytes(numel, bs, k), dtype=np.uint8)
        at = 0

        def put(records: np.ndarray) -> None:  # a slab's records, written into the payload in order
            nonlocal at
            payload[at : at + records.nbytes] = records.reshape(-1)
            at += records.nbytes

        step_rows = max(1, _SLAB // bs)
        for start in range(0, full, step_rows * bs):
            put(self._encode_rows(x[start : min(start + step_rows * bs, full)].view(-1, bs), k, subtract))
        if full < numel:  # the short last chunk
            rows = x[full:].view(1, -1)
            put(self._encode_rows(rows, min(k, rows.shape[1]), subtract))
        assert at == payload.nbytes, "the records fill exactly the payload that payload_bytes sized"
        return self._finish(payload, numel, block_size=bs, topk_count=k)

    def _encode_rows(self, rows: torch.Tensor, k: int, subtract: bool) -> np.ndarray:
        """The records of the chunks `rows` (each keeping k entries); with `subtract`, rows -= what they decode to."""
        magnitude = rows.abs()
        _check_finite(bool(torch.isfinite(magnitude.amax(dim=1)).all()), self.name)  # amax propagates NaN
        offsets = torch.topk(magnitude, k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = rows.gather(1, offsets)
        kept_mag = magnitude.gather(1, offsets)
        levels = (1 << (self.BITS - 1)) - 1  # highest magnitude level (1 with 2-bit values)
        low = kept_mag.amin(dim=1)
        step = kept_mag.amax(dim=1).sub_(low).div_(levels)
        m = kept_mag.sub_(low[:, None]).div_(step[:, None]).nan_to_num_(nan=0.0).round_().clamp_(0, levels)
        codes = m.to(torch.uint8).add_((kept < 0).to(torch.uint8) << (self.BITS - 1))
        if subtract:
            rows.scatter_(1, offsets, kept.sub_(_sparse_values(codes, low, step, self.BITS)))
        return _sparse_records(low, step, offsets, codes, self.BITS)

    def _decoder(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None) -> StreamDecoder:
        return _SparseDecoder(meta, out, sink, self.BITS)


def _sparse_values(codes: torch.Tensor, low: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """What the codes (uint8, one row per chunk) decode to: (-1)^s * (m*step + low), a multiply then an add (no fused
    multiply-add, so encoder and decoder round alike)."""
    sign_bit = 1 << (bits - 1)
    values = (codes & (sign_bit - 1)).to(torch.float32).mul_(step[:, None]).add_(low[:, None])
    return torch.where(codes >= sign_bit, values.neg(), values)


def _sparse_records(
    low: torch.Tensor, step: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor, bits: int
) -> np.ndarray:
    """The chunk records (one row of bytes per chunk) as the module docstring lays them out."""
    rows, k = codes.shape
    per_byte = 8 // bits
    padded = np.zeros((rows, -(-k // per_byte) * per_byte), dtype=np.uint8)
    padded[:, :k] = codes.numpy()
    lanes = padded.reshape(rows, -1, per_byte)
    packed = np.zeros(lanes.shape[:2], dtype=np.uint8)
    for lane in range(per_byte):
        packed |= lanes[:, :, lane] << np.uint8(bits * lane)
    scales = torch.stack([low, step], dim=1).numpy().view(np.uint8)
    index = offsets.to(torch.int32).numpy().astype("<u2").view(np.uint8)
    return np.concatenate([scales, index, packed], axis=1)


class _SparseDecoder(StreamDecoder):
    """Whole chunk records (the full chunks', then the short last one's), each checked before it is written."""

    def __init__(self, meta: EncodedMeta, out: torch.Tensor | None, sink: WindowSink | None, bits: int) -> None:
        bs, k = meta.block_size, meta.topk_count
        self._bits = bits
        chunks = -(-meta.numel // bs)
        last = meta.numel - (chunks - 1) * bs
        full_bytes = (chunks - 1) * SparseCodec.record_bytes(k)
        super().__init__(
            meta,
            out,
            [
                _Section(full_bytes, SparseCodec.record_bytes(k), lambda p, o: self._records(p, o, k, bs, 0)),
                _Section(
                    meta.encoded_bytes - full_bytes,
                    meta.encoded_bytes - full_bytes,
                    lambda p, o: self._records(p, o, min(k, last), last, chunks - 1),
                ),
            ],
            sink,
        )

    def _records(self, piece: memoryview, offset: int, k: int, length: int, first_chunk: int) -> None:
        size = SparseCodec.record_bytes(k)
        rows = np.frombuffer(piece, dtype=np.uint8).reshape(-1, size)
        first = first_chunk + offset // size
        scales = torch.from_numpy(rows[:, :8].copy().view(np.float32))
        low, step = scales[:, 0], scales[:, 1]
        low_min, step_min = float(low.min()), float(step.min())
        if not (low_min >= 0.0 and step_min >= 0.0 and math.isfinite(float(low.max()) + float(step.max()))):
            bad = int((~torch.isfinite(scales) | (scales < 0)).any(dim=1).nonzero()[0, 0])
            raise CodecError(
                f"{self.meta.codec} chunk {first + bad} has low {low[bad].item()} and step {step[bad].item()} "
                "(both must be finite and >= 0); the payload is corrupt: send it again"
            )
        index = rows[:, 8 : 8 + 2 * k].copy().view("<u2").astype(np.int64)
        steps = np.diff(index, axis=1)
        if steps.size and not bool((steps > 0).all()):
            row, at = (int(v[0]) for v in np.nonzero(steps <= 0))
            raise CodecError(
                f"{self.meta.codec} chunk {first + row}: offset {index[row, at + 1]} does not increase (previous "
                f"{index[row, at]}); the payload is corrupt: send it again"
            )
        if int(index[:, -1].max()) >= length:
            row = int(np.argmax(index[:, -1] >= length))
            raise CodecError(
                f"{self.meta.codec} chunk {first + row}: offset {int(index[row, -1])} is out of range for a chunk of "
                f"{length} elements; the payload is corrupt or meant for another model layout"
            )
        packed = rows[:, 8 + 2 * k :]
        per_byte = 8 // self._bits
        mask = np.uint8((1 << self._bits) - 1)
        lanes = np.stack([(packed >> np.uint8(self._bits * j)) & mask for j in range(per_byte)], axis=2)
        codes = torch.from_numpy(lanes.reshape(len(rows), -1)[:, :k].copy())
        values = _sparse_values(codes, low, step, self._bits)
        start = first * self.meta.block_size
        target = self._window(start, (len(rows) - 1) * self.meta.block_size + length)
        target.zero_()
        if length == self.meta.block_size:
            target.view(len(rows), length).scatter_(1, torch.from_numpy(index), values)
        else:  # the short last chunk
            target.scatter_(0, torch.from_numpy(index[0]), values[0])
        self._emit(start, target)


_REGISTRY: dict[str, type[Codec]] = {
    c.name: c for c in (FP32Codec, BF16Codec, Int8Codec, Int4Codec, TopKCodec, SparseCodec)
}
CODEC_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_codec(name: str, *, block_size: int | None = None, topk_fraction: float | None = None) -> Codec:
    """The codec called `name`; `block_size` applies to the blockwise ones (int8/int4: 128 by default; sparse: its
    chunk, 4096), `topk_fraction` to topk (0.01) and sparse (`SparseCodec.DEFAULT_FRACTION`); None: the default."""
    return codec_class(name).create(block_size=block_size, topk_fraction=topk_fraction)


def warm_up(*names: str) -> threading.Thread | None:
    """Compile the kernels of the blockwise codecs among `names` on a daemon thread (None: none is blockwise), so
    that a process's first encode or decode does not wait for numba (about 2 s cold, 0.5 s from its cache): a
    standby's first round as leader, a learner's first upload. A caller that needs a kernel meanwhile waits for the
    compile, as it would have anyway."""
    blockwise = sorted({n for n in names if issubclass(codec_class(n), _BlockCodec)})
    if not blockwise:
        return None

    def run() -> None:
        x = torch.linspace(-1.0, 1.0, 300)
        for name in blockwise:
            codec = get_codec(name, block_size=16)
            data, meta = codec.encode(x)
            codec.decode(bytes(data), meta)  # read-only bytes, as a received chunk
            codec.decode(bytearray(data), meta)
            codec.encode_and_subtract(x.clone())
            codec.encode_toward(x, torch.zeros_like(x), torch.empty_like(x))

    thread = threading.Thread(target=run, name="codec-warm-up", daemon=True)
    thread.start()
    return thread


def check_ef_decay(decay: float) -> float:
    """`decay` if it is a valid error-feedback β (0 < β <= 1), else `CodecError` saying what to do."""
    if not (isinstance(decay, (int, float)) and 0.0 < decay <= 1.0):
        raise CodecError(
            f"error feedback decay (beta) must be in (0, 1] (1: exact feedback; lower forgets the residual "
            f"faster), got {decay!r}; to send without error feedback, turn it off instead"
        )
    return float(decay)


class ErrorFeedback:
    """Error feedback (ALGORITHM.md section 2): send q = Q(delta + β·e), keep e <- (delta + β·e) - D(q).

    `residual` is the fp32 e, zero at start. Enabled by default for lossy codecs; when disabled, deltas are
    encoded as they are and `residual` is empty: nothing is kept between rounds (an fp32 payload is then the very
    buffer the delta was built in, not a copy of it).

    β (`decay`) is 1, ALGORITHM.md's exact feedback, for every codec but `topk`, whose default is 0.5. A learner
    restarts each round from Θ, which lacks what it has not sent yet, so it pushes the unsent entries the same way
    again and their residual grows round after round. At 1% density few of them are ever sent, and when one is,
    it carries many rounds of change at once, which the outer Nesterov momentum amplifies. Measured in the
    simulator (`diloco simulate --mode sync --speeds 1,1,1,1 -H 100 --tokens 1500000 --codec topk --d-model 32
    --layers 1 --heads 4 --seq-len 32 --batch-size 8 --max-bytes 4000000 --shards 16`, seeds 0-2): with β = 1 the
    loss diverges (11.6, 23.3, 14.2; the untrained model's is 5.4), with β = 0.5 it does not (3.3, 4.4, 3.4),
    against 3.9, 3.5 and 4.1 with no feedback at all. The compression benchmark reports it.

    `sparse` (1.56% of the entries, 2-bit values) defaults to 0.5 as well, for the same reason. Measured on a
    1M-parameter model (`diloco/bench/bench_sparse.py`'s settings: 2 learners, sync, H = 6, 40 outer steps, seed 0):
    final loss 3.14 with β = 1, 2.63 with β = 0.9 and 2.33 with β = 0.5, against 2.72 for fp32, all with DiLoCo's
    outer step (Nesterov 0.7 / 0.9). With less outer momentum, which suits both codecs there, β = 0.9 does better
    than 0.5 (lr 0.7, momentum 0.5: 2.25 against 2.37), so the benchmark runs it at 0.9
    (`diloco.bench.bench_sparse`). β is bounded to (0, 1] (`check_ef_decay`); β = 0 would drop the residual every
    round, which is feedback turned off.
    """

    def __init__(
        self,
        codec: Codec,
        numel: int,
        enabled: bool | None = None,
        decay: float | None = None,
        store: SlabStore | None = None,
    ) -> None:
        if numel < 1:
            raise CodecError(f"numel must be >= 1, got {numel}")
        decay = codec.residual_decay if decay is None else decay
        check_ef_decay(decay)
        self.codec = codec
        self.numel = numel
        self.enabled = codec.lossy if enabled is None else enabled
        self.decay = float(decay)
        # the residual: in memory, or (`store`, with feedback on) held outside it and worked a slab at a time
        # (`compress_slabs`); then `residual` is an empty tensor
        if store is not None and (store.numel != numel or not self.enabled):
            raise CodecError(f"a residual store needs error feedback on and {numel} values, got {store.numel}")
        self.store = store
        self.residual = torch.zeros(numel if store is None and self.enabled else 0, dtype=torch.float32)

    def compress(
        self, delta: torch.Tensor, *, owned: bool = False
    ) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        """Encode `delta` plus the carried residual and keep the new residual. `owned`: the caller gives `delta` up
        (with feedback off, its memory may become the payload: `Codec.encode_owned`).

        If encoding fails (e.g. a NaN in `delta`), the residual is reset to zero so that one bad step cannot
        poison the following ones, and the error is raised."""
        if delta.numel() != self.numel:
            raise CodecError(f"delta has {delta.numel()} elements, error feedback is set up for {self.numel}")
        if not self.enabled:
            flat = delta.reshape(-1)
            return self.codec.encode_owned(flat) if owned else self.codec.encode(flat)
        flat = _check_input(delta.reshape(-1))
        if self.decay != 1.0:
            self.residual.mul_(self.decay)
        self.residual.add_(flat)
        try:
            return self.codec.encode_and_subtract(self.residual)
        except Exception:
            self.reset()
            raise

    def compress_added(
        self, add: Callable[[torch.Tensor], object]
    ) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        """`compress`, with the delta added into the residual by `add(residual)` (a flat fp32 CPU vector; e.g.
        `InnerTrainer.submit_into`) instead of passed whole, so no model-sized copy of the delta is made. The same
        fp32 operations as `compress` in the same order: the payload and the new residual are bit for bit the
        same. Without feedback the delta is built in a zeroed buffer of its own, given up to the encode."""
        if not self.enabled:
            built = torch.zeros(self.numel, dtype=torch.float32)
            add(built)
            return self.codec.encode_owned(built)
        if self.decay != 1.0:
            self.residual.mul_(self.decay)
        add(self.residual)
        try:
            return self.codec.encode_and_subtract(self.residual)
        except Exception:
            self.reset()
            raise

    def compress_slabs(
        self, add: Callable[[int, torch.Tensor], object]
    ) -> tuple[bytes | bytearray | memoryview, EncodedMeta]:
        """`compress_added` with the residual in `store`: each slab is read, decayed, given the delta by `add(start,
        slab)` (e.g. `InnerTrainer.add_pseudo_gradient`), encoded, the decoded values subtracted, and written back.
        The same fp32 operations per element as `compress_added`: the same payload and residual, bit for bit. Memory:
        a slab (a whole vector for codecs that are not blockwise), not the residual."""
        store = self.store
        if store is None:
            raise CodecError("compress_slabs needs a residual store; use compress_added")
        scratch = torch.empty(min(_SLAB, self.numel), dtype=torch.float32)

        def load(start: int, end: int) -> torch.Tensor:
            slab = scratch[: end - start] if end - start <= scratch.numel() else torch.empty(end - start)
            store.read(start, slab)
            if self.decay != 1.0:
                slab.mul_(self.decay)
            add(start, slab)
            return slab

        try:
            return self.codec.encode_and_subtract_slabs(self.numel, load, store.write)
        except Exception:
            self.reset()
            raise

    def reset(self) -> None:
        """Forget the residual (e.g. after a resync to fresh global parameters)."""
        if self.store is not None:
            self.store.zero()
        self.residual.zero_()
