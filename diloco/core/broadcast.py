"""Compressed broadcasts with downlink error feedback (ALGORITHM.md section 10). Pure: no gRPC, no clock.

The coordinator holds a shadow `Θ̂` of what it has sent. Publishing version v encodes `q_v = Q(Θ_v − Θ̂)` with the
broadcast codec and sets `Θ̂ ← Θ̂ + D(q_v)`, where `D(q_v)` is what every learner's decoder makes of the very bytes sent,
added with one fp32 `add` in the same order: a learner that held `Θ̂_{v−1}` and applies `q_v` holds exactly `Θ̂_v`,
bit for bit. Both sides work slab by slab in cache (`Codec.encode_toward`, `ApplyingDelta`): the difference, the
decoded values and the checksum never take a pass over model-sized memory of their own. The residual `Θ − Θ̂` is
carried into the next broadcast.

`BroadcastShadow` (coordinator side) keeps the last `history` encoded deltas, at most `history_bytes_ratio`
(default `HISTORY_BYTES_RATIO`) of a full snapshot's bytes in all (the newest always: a learner further behind is
better served by a snapshot, and the coordinator's memory stays bounded), and the crc32 of `Θ̂_v`'s fp32 bytes. A
learner holding version u is answered (`updates_since`) with nothing (u is current), the chain of deltas u+1..v
(all still held), or `None`: it needs a full fp32 snapshot of `Θ̂_v` (`snapshot`: a view of `Θ̂` itself; `hold`: the
same view, kept as it is until released: an `advance` meanwhile writes the next `Θ̂` into a new tensor instead of in
place, so no copy is made unless a round closes while a snapshot is being sent). A learner may name the checksum of
the version it holds (a fresh learner holds the version 0 it built itself from the task and seed): the chain is sent
only when that is the checksum of this shadow's `Θ̂_u` (`checksum_of`: the version recorded last, or the base of a
delta kept), else a snapshot, so a learner whose own version differs (another seed, torch build or device) is never
sent deltas onto the wrong base. With the `fp32` codec there is no shadow: `Θ̂ = Θ` and every broadcast is a full
snapshot, encoded when the version is published (the behaviour before compressed broadcasts).

`BroadcastFollower` (learner side) holds `Θ̂` and its version; it takes snapshots, applies deltas whose base it
holds and checks the checksum after each; anything else is refused (`Refusal`) and the learner re-watches from
scratch (`after_version` 0: a full snapshot). A refused delta changes nothing, so nothing is applied twice.

Threads: the coordinator calls `advance` under its tensor lock, then `record` (which makes the new version visible)
and `updates_since` under its bookkeeping lock; `snapshot` and `hold` under the tensor lock when the codec is lossy
(they view `Θ̂`), else under the bookkeeping lock (fp32: the snapshot `record` installed). A hold's release may come
from any thread (`diloco.core.holds`).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from zlib_ng.zlib_ng import crc32

from diloco.core.codecs import CODEC_NAMES, Codec, CodecError, EncodedMeta, Payload, get_codec
from diloco.core.holds import Holds

__all__ = [
    "BROADCAST_CODECS",
    "DEFAULT_BROADCAST_CODEC",
    "DEFAULT_HISTORY",
    "ApplyingDelta",
    "BroadcastFollower",
    "BroadcastShadow",
    "Delta",
    "Refusal",
    "Snapshot",
    "params_checksum",
]

BROADCAST_CODECS: tuple[str, ...] = tuple(c for c in ("fp32", "bf16", "int8", "int4") if c in CODEC_NAMES)
DEFAULT_HISTORY = 8
# The cheapest codec whose loss stayed within 1% of fp32 broadcasts: `diloco simulate --codec int8 --outer-steps 30`
# (the default model, decoupled, 4 learners), seeds 0 and 1, final loss against fp32 broadcasts: bf16 +0.22%/-0.47%,
# int8 -0.26%/-0.40%, int4 -0.35%/-0.06%; bytes down 57.9 MB (fp32), 29.9 (bf16), 16.4 (int8), 9.4 (int4).
DEFAULT_BROADCAST_CODEC = "int4"
# deltas kept: at most this fraction of a full fp32 snapshot's bytes (int4: 3 deltas, int8: 1; the newest always)
HISTORY_BYTES_RATIO = 0.5


def params_checksum(flat: torch.Tensor) -> int:
    """crc32 (zlib's, computed by zlib-ng: the same values, several times faster) of the fp32 little-endian bytes of
    a contiguous 1-D float32 CPU tensor."""
    return crc32(flat.numpy().data.cast("B"))


def _fp32_bytes(flat: torch.Tensor) -> tuple[memoryview, EncodedMeta]:
    """A private copy of `flat` laid out as the fp32 codec does, and its meta (crc32 = `params_checksum`). The copy
    (torch) and the checksum release the GIL, where joining bytes would hold it for the whole copy."""
    x = flat.detach().to("cpu", torch.float32).contiguous().clone()
    if x.dim() != 1:
        raise CodecError(f"parameters must be a flat vector, got shape {tuple(x.shape)}")
    data = x.numpy().data.cast("B")
    return data, EncodedMeta("fp32", x.numel(), len(data), crc32(data))


@dataclass(frozen=True)
class Delta:
    """`q_version`: applied to `Θ̂_base` (base = version − 1, crc32 `base_checksum`) it gives `Θ̂_version`, whose
    crc32 is `checksum`. It covers `meta.numel` values of the flat `Θ̂` from `start` (the whole vector, or the
    fragments a round stepped); the rest of `Θ̂` is unchanged."""

    version: int
    base: int
    data: Payload  # in memory, or kept elsewhere (a spill file, `--spill-dir`)
    meta: EncodedMeta
    checksum: int
    base_checksum: int
    start: int = 0


@dataclass(frozen=True)
class Snapshot:
    """`Θ̂_version` in full (fp32); `checksum` equals `meta.crc32`."""

    version: int
    data: memoryview
    meta: EncodedMeta
    checksum: int


class BroadcastShadow:
    """The coordinator's `Θ̂` and the deltas that built it (see the module docstring).

    `codec`: one of `BROADCAST_CODECS`; `history`: how many of the newest deltas are kept at most (>= 1), and
    `history_bytes_ratio` how many bytes, as a fraction of a full fp32 snapshot's. `params` at
    `version` is where broadcasting starts (`Θ̂ = Θ`: a new coordinator, or a restart, sends snapshots first)."""

    def __init__(
        self,
        params: torch.Tensor,
        version: int,
        codec: str = "fp32",
        *,
        history: int = DEFAULT_HISTORY,
        history_bytes_ratio: float = HISTORY_BYTES_RATIO,
    ) -> None:
        if codec not in BROADCAST_CODECS:
            raise CodecError(f"unknown broadcast codec {codec!r}; use one of {', '.join(BROADCAST_CODECS)}")
        if history < 1:
            raise CodecError(f"broadcast history must be >= 1, got {history}")
        self.codec_name = codec
        self.codec: Codec | None = None if codec == "fp32" else get_codec(codec)
        self.history = history
        self.history_bytes_ratio = history_bytes_ratio
        self._deltas: deque[Delta] = deque(maxlen=history)
        self._snapshot: Snapshot | None = None
        self._pending: Snapshot | None = None  # fp32: the snapshot `advance` made, installed by `record`
        self._shadow: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._recorded = (version, 0)  # the version `record` made visible last, and its checksum
        self._holds = Holds()  # senders of a snapshot of `_shadow` (`hold`)
        self._reset(params, version)
        self.record(None)

    @property
    def lossy(self) -> bool:
        return self.codec is not None

    def _reset(self, params: torch.Tensor, version: int) -> None:
        """`Θ̂ ← Θ`: learners need a snapshot of `version` next."""
        self._deltas.clear()
        self.version = version
        if self.codec is None:
            data, meta = _fp32_bytes(params)
            self._pending = Snapshot(version, data, meta, meta.crc32)
            self.checksum = meta.crc32
            return
        self._holds.let_go()  # holders keep the tensor they hold
        self._shadow = params.detach().to("cpu", torch.float32).contiguous().clone()
        self._snapshot = None
        self.checksum = params_checksum(self._shadow)

    def advance(
        self,
        params: torch.Tensor,
        version: int,
        scratch: torch.Tensor | None = None,
        span: tuple[int, int] | None = None,
    ) -> Delta | None:
        """Version `version` (the next one) has parameters `params` (`Θ`): move `Θ̂` towards them. Returns the
        delta to `record` (None for fp32, whose snapshot is encoded here, or when the delta could not be encoded,
        e.g. non-finite parameters: then `Θ̂ ← Θ` and learners get a snapshot). `scratch`: a model-sized fp32
        CPU buffer free for this call (the coordinator lends its merge buffer), else one is kept here. `span`:
        only `Θ̂[start:end]` moves (streaming fragments: the range a round stepped; the residual `Θ − Θ̂` elsewhere
        waits for its own fragment's next step, as with one shadow per fragment), the delta covering that range."""
        if self.codec is None or version != self.version + 1:
            self._reset(params, version)
            return None
        assert self._shadow is not None
        if scratch is None or scratch.shape != self._shadow.shape or scratch.device.type != "cpu":
            if self._scratch is None and not self.codec.blockwise:  # blockwise codecs need no model-sized scratch
                self._scratch = torch.empty_like(self._shadow)
            scratch = self._scratch
        theta = params.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        shadow = self._shadow
        start, end = _check_span(span, shadow.numel())
        held = self._holds.let_go()  # a snapshot of Θ̂ is being sent: the next Θ̂ goes into a new tensor (the same adds)
        target = torch.empty_like(shadow) if held else shadow
        if held:
            target[:start].copy_(shadow[:start])
            target[end:].copy_(shadow[end:])
        try:
            # q = Q(Θ − Θ̂) over the span, Θ̂ + D(q) decoded from the very bytes sent, and the crc32 of the whole new
            # Θ̂ (chained across the span): one fused pass where the codec has one (blockwise codecs), else with a
            # model-sized scratch
            crc = crc32(target[:start].numpy().data.cast("B"))
            part = scratch[start:end] if scratch is not None else None
            span_of = slice(start, end)
            data, meta, crc = self.codec.encode_toward(theta[span_of], shadow[span_of], target[span_of], part, crc)
            checksum = crc32(target[end:].numpy().data.cast("B"), crc)
        except CodecError:
            self._reset(params, version)
            return None
        base_checksum = self.checksum
        self._shadow = target
        self.version, self._snapshot = version, None
        self.checksum = checksum
        return Delta(version, version - 1, data, meta, self.checksum, base_checksum, start)

    def record(self, delta: Delta | None) -> None:
        """Make `advance`'s result visible to `updates_since` and, for fp32, `snapshot` (None: the history restarts
        at this version)."""
        if self._pending is not None:
            self._snapshot, self._pending = self._pending, None
        self._recorded = (self.version, self.checksum)
        if delta is None:
            self._deltas.clear()
            return
        self._deltas.append(delta)
        budget = self.history_bytes_ratio * 4 * self.shadow.numel()  # of a full snapshot, whatever the deltas cover
        while len(self._deltas) > 1 and sum(d.meta.encoded_bytes for d in self._deltas) > budget:
            self._deltas.popleft()

    def updates_since(self, held: int | None, current: int, held_checksum: int | None = None) -> list[Delta] | None:
        """What a learner holding version `held` (None: none) needs to reach `current` (the published version): []
        when it holds it, the deltas held+1..current when all are kept, else None (a full snapshot). With
        `held_checksum` (the crc32 the learner computed of what it holds), also None unless that is the checksum
        of this shadow's `Θ̂_held` (`checksum_of`)."""
        if held is not None and held_checksum is not None and self.checksum_of(held) != held_checksum:
            return None
        if held == current:
            return []
        if held is None or held > current:
            return None
        chain = [d for d in self._deltas if held < d.version <= current]
        if len(chain) != current - held or chain[0].base != held:
            return None
        return chain

    def checksum_of(self, version: int) -> int | None:
        """The crc32 of `Θ̂_version` when a learner holding it can still be served from here: the version `record`ed
        last, or the base of a delta kept; None otherwise (gone from the window, never held, or not yet recorded)."""
        if version == self._recorded[0]:
            return self._recorded[1]
        return next((d.base_checksum for d in self._deltas if d.base == version), None)

    @property
    def oldest_delta(self) -> int | None:
        """The version of the oldest delta kept (None: none)."""
        return self._deltas[0].version if self._deltas else None

    def snapshot(self) -> Snapshot:
        """`Θ̂` in full: for fp32 the newest `record`ed (a private copy); for lossy codecs the newest version
        `advance` reached, as a view of `Θ̂`'s own bytes (no model-sized copy; its checksum is the one `advance`
        computed): valid until the next `advance`, unless `hold` keeps it (or a copy is made under the lock that
        orders the two)."""
        if self._snapshot is None:
            assert self._shadow is not None
            data = self._shadow.numpy().data.cast("B")
            meta = EncodedMeta("fp32", self._shadow.numel(), len(data), self.checksum)
            self._snapshot = Snapshot(self.version, data, meta, self.checksum)
        return self._snapshot

    def hold(self) -> tuple[Snapshot, Callable[[], None]]:
        """`snapshot()`, and a function to call (once, from any thread) when it has been sent: until then `advance`
        and a reset leave its bytes as they are (lossy codecs: the next `Θ̂` goes into a new tensor, the held one
        lives on in the holders' views, freed with the last). fp32 snapshots are private copies: nothing to hold."""
        snap = self.snapshot()
        if self.codec is None:
            return snap, _nothing
        return snap, self._holds.hold()

    @property
    def shadow(self) -> torch.Tensor:
        """`Θ̂` now (read-only by convention; for fp32 a view of the snapshot's bytes)."""
        if self._shadow is not None:
            return self._shadow
        assert self._snapshot is not None
        return torch.frombuffer(self._snapshot.data, dtype=torch.float32)


def _check_span(span: tuple[int, int] | None, numel: int) -> tuple[int, int]:
    if span is None:
        return 0, numel
    start, end = span
    if not 0 <= start < end <= numel:
        raise CodecError(f"a broadcast span must lie within the {numel} parameters and be non-empty, got {span}")
    return start, end


def _nothing() -> None:
    """Releases a hold on bytes nobody writes again."""


class Refusal(enum.Enum):
    """Why a learner drops a broadcast and re-watches from version 0."""

    NO_BASE = "no_base"  # a delta for a version other than the one after the held one (behind, ahead, or a repeat)
    CHECKSUM = "checksum"  # after applying, Θ̂ differs from the coordinator's
    SPAN = "span"  # the delta's range does not lie within the parameters held


class BroadcastFollower:
    """A learner's `Θ̂`: the newest version it holds exactly (None: none yet). Every accepted version is a new
    tensor; an earlier one is never written again, so whoever holds it may keep it."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.params: torch.Tensor | None = None

    def reset(self) -> None:
        self.version, self.params = None, None

    def snapshot(self, version: int, flat: torch.Tensor) -> torch.Tensor:
        """A full snapshot (its payload crc already checked by the decoder) replaces what is held."""
        self.version, self.params = version, flat
        return flat

    def delta(
        self, version: int, base: int, decoded: torch.Tensor, checksum: int, start: int = 0
    ) -> torch.Tensor | Refusal:
        """Apply a decoded delta `D(q)` from `base` to `version`, covering `Θ̂[start:start + decoded.numel()]`; a
        refusal leaves everything as it was."""
        applying = self.begin_delta(version, base, start, decoded.numel())
        if isinstance(applying, Refusal):
            return applying
        applying.dense(0, decoded)
        return self.finish_delta(applying, checksum)

    def begin_delta(self, version: int, base: int, start: int = 0, numel: int | None = None) -> ApplyingDelta | Refusal:
        """Start applying the delta from `base` to `version` as it is decoded: hand the returned window sink to
        the decoder (`Codec.decoder(meta, sink=...)`), then `finish_delta`. The delta covers `numel` values (None:
        all) of `Θ̂` from `start` (`Delta.start`); the decoder's windows count from there. No decoded copy of the
        delta is made: each window is added to the held `Θ̂` into a new tensor (the same fp32 adds as `delta`);
        the held one is left as it is until the checksum passes. A range outside `Θ̂` is refused (`SPAN`)."""
        if self.params is None or self.version is None or base != self.version or version != base + 1:
            return Refusal.NO_BASE
        total = self.params.numel()
        if numel is None:
            numel = total - start
        if not (start >= 0 and numel >= 1 and start + numel <= total):
            return Refusal.SPAN
        return ApplyingDelta(version, base, self.params, start, numel)

    def finish_delta(self, applying: ApplyingDelta, checksum: int) -> torch.Tensor | Refusal:
        """The delta is complete (its payload verified): adopt `Θ̂_version` if its checksum matches. Either way
        `applying` lets go of both versions (`ApplyingDelta.release`)."""
        try:
            if self.version != applying.base:
                return Refusal.NO_BASE
            new = applying.result()
            if applying.checksum() != checksum:
                return Refusal.CHECKSUM
            self.version, self.params = applying.version, new
            return new
        finally:
            applying.release()


_RELEASED = torch.empty(0)  # what a released `ApplyingDelta` holds instead of model-sized vectors


class ApplyingDelta:
    """A window sink (`diloco.core.codecs.WindowSink`) building `Θ̂_version` = `Θ̂_base` + the delta's decoded
    windows in a new tensor, without touching `Θ̂_base` (`base_params`). The delta covers `numel` values from
    `offset`; its windows count from there. Windows that come in order, each right after the last (as the dense
    decoders hand them over), are added into place straight from the base, and the crc32 of the new bytes is
    chained while they are in cache (the base's values before and after the range too, copied as they are): no
    copy of the base first, no checksum pass after. Anything else (a window out of order, sparse entries) copies
    the rest of the base first and adds in place."""

    def __init__(
        self, version: int, base: int, base_params: torch.Tensor, offset: int = 0, numel: int | None = None
    ) -> None:
        self.version = version
        self.base = base
        self._base_params = base_params
        self._new = torch.empty_like(base_params)
        self._offset = offset
        self._end = base_params.numel() if numel is None else offset + numel
        self._filled: int | None = 0  # new[:filled] is final and chained into _crc; None: new is whole
        self._crc = 0
        if offset:
            self._copy_final(offset)

    def _copy_final(self, end: int) -> None:
        """new[filled:end] = the base's values there, chained into the crc."""
        assert self._filled is not None
        window = self._new[self._filled : end]
        window.copy_(self._base_params[self._filled : end])
        self._crc = crc32(window.numpy().data.cast("B"), self._crc)
        self._filled = end

    def dense(self, start: int, values: torch.Tensor) -> None:
        start += self._offset
        end = start + values.numel()
        if end > self._end:
            raise CodecError(f"a delta window ends at {end}, past the delta's range (to {self._end})")
        if start != self._filled:
            self._copy_rest()
        if self._filled is None:
            self._new[start:end].add_(values)
            return
        window = torch.add(self._base_params[start:end], values, out=self._new[start:end])
        self._crc = crc32(window.numpy().data.cast("B"), self._crc)
        self._filled = end

    def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
        self._copy_rest()
        self._new.index_add_(0, index + self._offset if self._offset else index, values)

    def _copy_rest(self) -> None:
        """Make `new` whole: the base's values where no window has come yet."""
        if self._filled is not None:
            self._new[self._filled :].copy_(self._base_params[self._filled :])
            self._filled = None

    def result(self) -> torch.Tensor:
        """`Θ̂_version`, once every window has come."""
        if self._filled == self._end:
            self._copy_final(self._new.numel())  # the values after the delta's range, as the base has them
        if self._filled != self._new.numel():
            self._copy_rest()
        return self._new

    def checksum(self) -> int:
        """`params_checksum(self.result())`, from the chain when the windows came in order."""
        if self._filled == self._new.numel():
            return self._crc
        return params_checksum(self.result())

    def release(self) -> None:
        """Drop the references to `Θ̂_base` and the new tensor (finished: not used again). Whoever still holds this
        object (a watch loop's variable until the next header) then keeps no model-sized vector alive: an older
        `Θ̂` lives only as long as the follower or the trainer holds it."""
        self._base_params = self._new = _RELEASED
        self._filled = None
