"""Compressed broadcasts with downlink error feedback (ALGORITHM.md section 10). Pure: no gRPC, no clock.

The coordinator holds a shadow `Θ̂` of what it has sent. Publishing version v encodes `q_v = Q(Θ_v − Θ̂)` with the
broadcast codec and sets `Θ̂ ← Θ̂ + D(q_v)`, where `D(q_v)` is what every learner's decoder makes of the very bytes sent,
added with one fp32 `add` in the same order: a learner that held `Θ̂_{v−1}` and applies `q_v` holds exactly `Θ̂_v`,
bit for bit. Both sides work slab by slab in cache (`Codec.encode_toward`, `HeldParams`): the difference, the
decoded values and the checksum never take a pass over model-sized memory of their own. The checksum of `Θ̂`
(`diloco.core.checksum`) is a sum of per-window terms: a delta moves it by the terms of the range it rewrites, so
a delta over one fragment costs a pass over that fragment only, on both sides. The residual `Θ − Θ̂` is
carried into the next broadcast.

`BroadcastShadow` (coordinator side) keeps the last `history` encoded deltas, at most `history_bytes_ratio`
(default `HISTORY_BYTES_RATIO`) of a full snapshot's bytes in all (the newest always: a learner further behind is
better served by a snapshot, and the coordinator's memory stays bounded), none that every live learner is past
(`forget_through`), and the checksum of `Θ̂_v`. A
learner holding version u is answered (`updates_since`) with nothing (u is current), the chain of deltas u+1..v
(all still held), or `None`: it needs a full fp32 snapshot of `Θ̂_v` (`snapshot`: a view of `Θ̂` itself; `hold`: the
same view, kept as it is until released: an `advance` meanwhile writes the next `Θ̂` into a new tensor instead of in
place, so no copy is made unless a round closes while a snapshot is being sent). A learner may name the checksum of
the version it holds (a fresh learner holds the version 0 it built itself from the task and seed): the chain is sent
only when that is the checksum of this shadow's `Θ̂_u` (`checksum_of`: the version recorded last, or the base of a
delta kept), else a snapshot, so a learner whose own version differs (another seed, torch build or device) is never
sent deltas onto the wrong base. With the `fp32` codec there is no shadow: `Θ̂ = Θ` and every broadcast is a full
snapshot, encoded when the version is published (the behaviour before compressed broadcasts). Unless the versions
step ranges (`ranged`: streaming fragments, where a version changes only the fragments its round stepped): then fp32
keeps a shadow too and sends `fl(Θ − Θ̂)` over the range stepped, which `Θ̂` adds exactly wherever the two values
are within a factor of two of each other (Sterbenz), as after an outer step they almost always are (elsewhere
within two roundings, carried forward like any codec's residual).

`BroadcastFollower` (learner side, the watch thread) knows the newest version accepted; it takes snapshots and
queues, still encoded, the deltas whose base it holds; anything else is refused (`Refusal`) and the learner
re-watches from scratch (`after_version` 0: a full snapshot). A refused delta changes nothing, so nothing is
applied twice. The learner's `Θ̂` is one tensor (`HeldParams`), brought forward in place where a version is adopted,
its checksum checked after each delta: no second model-sized vector.

Threads: the coordinator calls `advance` under its tensor lock, then `record` (which makes the new version visible)
and `updates_since` under its bookkeeping lock; `snapshot` and `hold` under the tensor lock when there is a shadow
(`shadowed`: they view `Θ̂`), else under the bookkeeping lock (fp32: the snapshot `record` installed). A hold's
release may come from any thread (`diloco.core.holds`).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.core.checksum import checksum as params_checksum
from diloco.core.checksum import moved
from diloco.core.codecs import (
    CODEC_NAMES,
    Codec,
    CodecError,
    EncodedMeta,
    Payload,
    get_codec,
    payload_chunks,
    payload_decoder,
)
from diloco.core.holds import Holds
from diloco.core.parallel import parallel_crc32

__all__ = [
    "BROADCAST_CODECS",
    "DEFAULT_BROADCAST_CODEC",
    "DEFAULT_HISTORY",
    "BroadcastFollower",
    "BroadcastShadow",
    "Delta",
    "HeldParams",
    "PendingDelta",
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


def _fp32_snapshot(version: int, flat: torch.Tensor) -> Snapshot:
    """A snapshot of a private copy of `flat`, laid out as the fp32 codec does. The copy (torch), the crc32 and the
    checksum release the GIL, where joining bytes would hold it for the whole copy."""
    x = flat.detach().to("cpu", torch.float32).contiguous().clone()
    if x.dim() != 1:
        raise CodecError(f"parameters must be a flat vector, got shape {tuple(x.shape)}")
    data = x.numpy().data.cast("B")
    return Snapshot(version, data, EncodedMeta("fp32", x.numel(), len(data), parallel_crc32(data)), params_checksum(x))


@dataclass(frozen=True)
class Delta:
    """`q_version`: applied to `Θ̂_base` (base = version − 1, checksum `base_checksum`) it gives `Θ̂_version`, whose
    checksum is `checksum`. It covers `meta.numel` values of the flat `Θ̂` from `start` (the whole vector, or the
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
    """`Θ̂_version` in full (fp32 bytes, `meta.crc32` their crc32); `checksum`: the state checksum of `Θ̂_version`."""

    version: int
    data: memoryview
    meta: EncodedMeta
    checksum: int


class BroadcastShadow:
    """The coordinator's `Θ̂` and the deltas that built it (see the module docstring).

    `codec`: one of `BROADCAST_CODECS`; `history`: how many of the newest deltas are kept at most (>= 1), and
    `history_bytes_ratio` how many bytes, as a fraction of a full fp32 snapshot's. `params` at
    `version` is where broadcasting starts (`Θ̂ = Θ`: a new coordinator, or a restart, sends snapshots first).
    `ranged`: versions step ranges of `Θ` (`advance(span=)`, streaming fragments), so fp32 sends deltas over them
    too, through a shadow, instead of a full snapshot per version."""

    def __init__(
        self,
        params: torch.Tensor,
        version: int,
        codec: str = "fp32",
        *,
        history: int = DEFAULT_HISTORY,
        history_bytes_ratio: float = HISTORY_BYTES_RATIO,
        ranged: bool = False,
    ) -> None:
        if codec not in BROADCAST_CODECS:
            raise CodecError(f"unknown broadcast codec {codec!r}; use one of {', '.join(BROADCAST_CODECS)}")
        if history < 1:
            raise CodecError(f"broadcast history must be >= 1, got {history}")
        self.codec_name = codec
        self.codec: Codec | None = None if codec == "fp32" and not ranged else get_codec(codec)
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
    def shadowed(self) -> bool:
        """Whether `Θ̂` is a shadow of its own (every codec but fp32 without `ranged`), viewed by `snapshot`."""
        return self.codec is not None

    def _reset(self, params: torch.Tensor, version: int) -> None:
        """`Θ̂ ← Θ`: learners need a snapshot of `version` next. The deltas kept stay until `record(None)`: they still
        lead to the version published until then, and `updates_since` reads them under the caller's lock, which
        `advance` does not hold."""
        self.version = version
        if self.codec is None:
            self._pending = _fp32_snapshot(version, params)
            self.checksum = self._pending.checksum
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
        delta to `record` (None for fp32 without `ranged`, whose snapshot is encoded here, or when the delta could
        not be encoded, e.g. non-finite parameters: then `Θ̂ ← Θ` and learners get a snapshot). `scratch`: a
        model-sized fp32 CPU buffer free for this call (the coordinator lends its merge buffer), else one is kept
        here. `span`: only `Θ̂[start:end]` moves (streaming fragments: the range a round stepped; the residual
        `Θ − Θ̂` elsewhere waits for its own fragment's next step, as with one shadow per fragment), the delta
        covering that range."""
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
            # q = Q(Θ − Θ̂) over the span, Θ̂ + D(q) decoded from the very bytes sent, and the span's checksum terms
            # before and after (the rest of Θ̂, and its terms, unchanged): one fused pass where the codec has one
            # (blockwise codecs), else with a model-sized scratch
            part = scratch[start:end] if scratch is not None else None
            span_of = slice(start, end)
            ranged = (start, end) != (0, shadow.numel())
            data, meta, checksum = self.codec.encode_toward(
                theta[span_of], shadow[span_of], target[span_of], part, start, self.checksum if ranged else None
            )
        except CodecError:
            self._reset(params, version)
            return None
        base_checksum = self.checksum
        self._shadow = target
        self.version, self._snapshot = version, None
        self.checksum = checksum
        return Delta(version, version - 1, data, meta, self.checksum, base_checksum, start)

    def make_room(self, span: tuple[int, int] | None = None) -> None:
        """Before `advance` (`span` as there), under the lock `updates_since` is called under: drop the oldest deltas
        kept until they and the delta `advance` is about to encode fit the history's byte budget together, so the
        budget bounds the deltas held while the next one is encoded, not only once it is recorded. A learner that
        would have needed a dropped one gets a snapshot, as it would once the next delta is recorded."""
        if self.codec is None:
            return
        start, end = _check_span(span, self.shadow.numel())
        self._trim(self.codec.payload_bytes(end - start, getattr(self.codec, "block_size", 0), 0), keep=0)

    def forget_through(self, version: int | None) -> None:
        """Drop the deltas kept up to `version` (None: none): every learner that may still ask holds that version or a
        newer one, so none of them needs those deltas (the coordinator passes its live learners' oldest submission
        base, `CoordinatorCore.held_floor`). A learner that comes back from further behind gets a snapshot, as one
        behind the budget does."""
        while version is not None and self._deltas and self._deltas[0].version <= version:
            self._deltas.popleft()

    def _trim(self, incoming: int, keep: int) -> None:
        """Drop the oldest deltas kept, all but the newest `keep` at most, until they and `incoming` more bytes fit
        the budget: a fraction of a full snapshot's bytes, whatever the deltas cover."""
        budget = self.history_bytes_ratio * 4 * self.shadow.numel()
        while len(self._deltas) > keep and sum(d.meta.encoded_bytes for d in self._deltas) + incoming > budget:
            self._deltas.popleft()

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
        self._trim(0, keep=1)  # the newest always

    def updates_since(self, held: int | None, current: int, held_checksum: int | None = None) -> list[Delta] | None:
        """What a learner holding version `held` (None: none) needs to reach `current` (the published version): []
        when it holds it, the deltas held+1..current when all are kept, else None (a full snapshot). With
        `held_checksum` (the checksum the learner computed of what it holds), also None unless that is the checksum
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
        """The checksum of `Θ̂_version` when a learner holding it can still be served from here: the version `record`ed
        last, or the base of a delta kept; None otherwise (gone from the window, never held, or not yet recorded)."""
        if version == self._recorded[0]:
            return self._recorded[1]
        return next((d.base_checksum for d in self._deltas if d.base == version), None)

    @property
    def oldest_delta(self) -> int | None:
        """The version of the oldest delta kept (None: none)."""
        return self._deltas[0].version if self._deltas else None

    def snapshot(self) -> Snapshot:
        """`Θ̂` in full: for fp32 snapshots the newest `record`ed (a private copy); with a shadow the newest version
        `advance` reached, as a view of `Θ̂`'s own bytes (no model-sized copy; its checksum is the one `advance`
        computed, the crc32 of its bytes taken here, once per version): valid until the next `advance`, unless
        `hold` keeps it (or a copy is made under the lock that orders the two)."""
        if self._snapshot is None:
            assert self._shadow is not None
            data = self._shadow.numpy().data.cast("B")
            meta = EncodedMeta("fp32", self._shadow.numel(), len(data), parallel_crc32(data))
            self._snapshot = Snapshot(self.version, data, meta, self.checksum)
        return self._snapshot

    def hold(self) -> tuple[Snapshot, Callable[[], None]]:
        """`snapshot()`, and a function to call (once, from any thread) when it has been sent: until then `advance`
        and a reset leave its bytes as they are (a shadow: the next `Θ̂` goes into a new tensor, the held one
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
    """Why a learner drops a broadcast: the watcher re-watches from version 0 (a full snapshot); a delta that fails
    where it is applied (`HeldParams.at`) has written `Θ̂`, so the learner registers again."""

    NO_BASE = "no_base"  # a delta for a version other than the one after the held one (behind, ahead, or a repeat)
    CHECKSUM = "checksum"  # after applying, Θ̂'s checksum differs from the coordinator's
    SPAN = "span"  # the delta's range does not lie within the parameters held
    UNREADABLE = "unreadable"  # the delta's content cannot be decoded (its bytes passed their crc32)


# A queued delta is fed to its decoder this many bytes at a time: many of the decoder's pieces (a window's bytes, a
# part per thread), as a piece cut by a chunk's end is decoded as two windows, each too short to split across threads
_APPLY_CHUNK_BYTES = 8 << 20

OnWindow = Callable[[int, int, torch.Tensor, torch.Tensor], None]
"""`on_window(lo, hi, old, new)`: `Θ̂[lo:hi]` just went from `old` (scratch, valid during the call) to `new`."""


@dataclass(frozen=True)
class PendingDelta:
    """A delta received and queued, still encoded (its payload's crc32 checked): `Θ̂_version` = `Θ̂_{version−1}` +
    the decoded values over `meta.numel` values from `start`; `checksum` is the checksum of `Θ̂_version`."""

    version: int
    start: int
    meta: EncodedMeta
    data: Payload
    checksum: int


class HeldParams:
    """`Θ̂` as a learner holds it: one tensor, brought from version `applied` to a later one in place, by the thread
    that adopts it (`at`), with the deltas queued meanwhile (`queue`, from the watch thread: encoded, a fraction of
    the model each). No second model-sized vector: `Θ̂_{v−1}` becomes `Θ̂_v`, window by window as the delta is
    decoded, its checksum moved by each window's terms, taken while the window is in cache.

    Whoever keeps `params` (a trainer's base) sees it change at the next `at`: the trainer passes `on_window` to
    rebase its parameters on each window as it changes, or holds a copy of its own first. A delta that fails
    there (its checksum, or content its crc32 let through) has already written the tensor: it is `broken` from
    then on and every `at` refuses. Thread-safe between one watch thread queueing and one thread calling `at`.
    `checksum`: that of `params` as given (computed here when None)."""

    def __init__(self, version: int, params: torch.Tensor, checksum: int | None = None) -> None:
        self.params = params
        self.checksum = params_checksum(params) if checksum is None else checksum  # of `applied`
        self.applied = version  # the version `params` holds now
        self.latest = version  # the version the queued deltas lead to
        self.broken: Refusal | None = None
        self._pending: deque[PendingDelta] = deque()
        self._lock = threading.Lock()

    def queue(self, delta: PendingDelta) -> None:
        with self._lock:
            if delta.version != self.latest + 1:
                raise ValueError(f"delta {delta.version} queued after version {self.latest}")
            self._pending.append(delta)
            self.latest = delta.version

    def at(self, version: int, on_window: OnWindow | None = None) -> torch.Tensor | Refusal:
        """`Θ̂_version`: the queued deltas up to it applied, in order, in place. Refused: a version this tensor has
        left behind or has not been told of (`NO_BASE`), or a failed delta (`broken`)."""
        while True:
            with self._lock:
                if self.broken is not None:
                    return self.broken
                if not self.applied <= version <= self.latest:
                    return Refusal.NO_BASE
                if self.applied == version:
                    return self.params
                delta = self._pending.popleft()
            failed = _apply_in_place(self.params, self.checksum, delta, on_window)
            with self._lock:
                self.broken = failed
                if failed is None:
                    self.applied, self.checksum = delta.version, delta.checksum


def _apply_in_place(params: torch.Tensor, base: int, delta: PendingDelta, on_window: OnWindow | None) -> Refusal | None:
    """`params` (checksum `base`) += the decoded delta (the same fp32 add per element as the coordinator's `Θ̂`
    update); None, or why it failed (then `params` is partly written)."""
    try:
        sink = _InPlaceDelta(params, delta.start, delta.meta.numel, on_window, base)
        decoder = payload_decoder(delta.meta, sink=sink)
        for chunk in payload_chunks(delta.data, _APPLY_CHUNK_BYTES):
            decoder.feed(chunk)
        decoder.verify()
    except CodecError:
        return Refusal.UNREADABLE
    return None if sink.checksum() == delta.checksum else Refusal.CHECKSUM


class _InPlaceDelta:
    """A window sink (`diloco.core.codecs.AddingSink`) adding a delta's decoded windows into `params` in place, in
    any order, and the checksum of `params` after: the sum of the windows' new terms when the delta covers the
    whole vector, else `base` (the checksum before; None: computed here) moved by each window's terms before and
    after (a block codec's decoder takes them in its loop, `dense` here)."""

    def __init__(
        self, params: torch.Tensor, offset: int, numel: int, on_window: OnWindow | None, base: int | None = None
    ) -> None:
        if not (offset >= 0 and numel >= 1 and offset + numel <= params.numel()):
            raise CodecError(f"a delta of {numel} values from {offset} does not fit {params.numel()} parameters")
        self._params, self._offset, self._end = params, offset, offset + numel
        self._on_window = on_window
        self._old = torch.empty(0, dtype=params.dtype)  # a window's values before it changes (`on_window` only)
        self.whole = offset == 0 and numel == params.numel()
        self._checksum = 0 if self.whole else params_checksum(params) if base is None else base

    def dense(self, start: int, values: torch.Tensor) -> None:
        window = self.add_target(start, values.numel())
        lo = self.element(start)
        old = 0 if self.whole else params_checksum(window, lo)
        window.add_(values)
        self.added(start, window, old, params_checksum(window, lo))

    def element(self, start: int) -> int:
        return start + self._offset

    def add_target(self, start: int, count: int) -> torch.Tensor:
        """`params`' window for elements [start, start + count) of the delta (`diloco.core.codecs.AddingSink`: a
        block codec's decoder adds the values there itself); its values before the add are kept for `on_window`."""
        lo = self.element(start)
        if lo + count > self._end:
            raise CodecError(f"a delta window ends at {lo + count}, past the delta's range (to {self._end})")
        window = self._params[lo : lo + count]
        if self._on_window is not None:
            if self._old.numel() < count:
                self._old = torch.empty(count, dtype=window.dtype)
            self._old[:count].copy_(window)
        return window

    def added(self, start: int, window: torch.Tensor, old: int, new: int) -> None:
        """`window` (from `add_target`) holds its new values; `old`, `new`: its checksum terms before and after."""
        lo = self.element(start)
        if self._on_window is not None:
            self._on_window(lo, lo + window.numel(), self._old[: window.numel()], window)
        self._checksum = moved(self._checksum, old, new)

    def sparse(self, index: torch.Tensor, values: torch.Tensor) -> None:
        raise CodecError("a broadcast delta is dense (fp32, bf16, int8 or int4)")

    def checksum(self) -> int:
        return self._checksum


class BroadcastFollower:
    """What the watch thread knows of a learner's `Θ̂`: the newest version accepted (None: none yet) and the
    `HeldParams` that leads to it. A snapshot starts a new `HeldParams` (an earlier one is left to whoever still
    holds it); a delta is checked (for the version held, within the parameters) and queued there, applied where
    the version is adopted."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.held: HeldParams | None = None

    def reset(self) -> None:
        self.version, self.held = None, None

    def snapshot(self, version: int, flat: torch.Tensor, checksum: int | None = None) -> HeldParams:
        """A full snapshot (its payload crc already checked by the decoder; `checksum`: its state checksum, as the
        coordinator names it, else computed here) replaces what is held."""
        self.version, self.held = version, HeldParams(version, flat, checksum)
        return self.held

    def check_delta(self, version: int, base: int, start: int, numel: int) -> Refusal | None:
        """Whether a delta from `base` to `version` over `numel` values from `start` can be queued: None, or why
        not (it is then received only to keep the stream in step, and dropped)."""
        if self.held is None or self.version is None or base != self.version or version != base + 1:
            return Refusal.NO_BASE
        if not (start >= 0 and numel >= 1 and start + numel <= self.held.params.numel()):
            return Refusal.SPAN
        return None

    def delta(
        self, version: int, base: int, meta: EncodedMeta, data: Payload, checksum: int, start: int = 0
    ) -> HeldParams | Refusal:
        """Queue a received delta (`check_delta` first); a refusal leaves everything as it was."""
        refused = self.check_delta(version, base, start, meta.numel)
        if refused is not None:
            return refused
        assert self.held is not None
        self.held.queue(PendingDelta(version, start, meta, data, checksum))
        self.version = version
        return self.held
