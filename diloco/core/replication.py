"""Round-log replication to hot standbys (ALGORITHM.md section 11): the leader's log, a standby's state, and the
rule for publishing a version only once enough standbys hold it.

Pure: no gRPC, no clock reads (`now` is an argument), no I/O.

**What an entry holds.** After every round the leader appends a `LogEntry`: the version, the leadership epoch, the
merged pseudo-gradient Δ exactly as the outer step took it (merged, scaled by the round's fraction: the bytes the
coordinator passed to `OuterOptimizer.step`), the number of live learners given to the optimizer
(`set_num_learners`, which Delayed Nesterov uses), the bookkeeping (the non-tensor part of
`CoordinatorCore.snapshot()` after the round: ledger, tokens applied, incarnation counter, guard norms; and the
outcomes of the round's applied submissions) and the `Digest` of Θ and of the outer optimizer's state after the
step. A standby
runs the same `outer.step(Θ, Δ)` on the same bits and must get the same digest: replay is bit-exact on the same
torch build and CPU kind (an elementwise step does not depend on the number of threads). A standby that got
different bits (another build, a corrupt message, a divergent history) is told to resync from a snapshot.

**Streaming fragments** (`--fragments P`, docs/fragments.md). The entry names the fragments its round stepped
(`fragments`, increasing) and Δ holds only theirs, one after another; the bookkeeping's `core.fragments` holds the
layout, versions, step counts and guard norms after the round. The standby (given the layout its own flags cut)
steps each with `step_fragment`, the leader's rule, on that fragment's own outer optimizer; the digest's outer part
chains every fragment's outer state in order (`state_digest`; the core's own optimizer is not stepped then).

**Validate, then mutate.** `Standby.apply` checks the epoch (not older than the newest it has seen), the version
(exactly one past the one it holds: a gap or a repeat is refused), the payload checksum, the bookkeeping, and then
computes the step on a spare copy of Θ and of the outer state and compares the digest; only when all of that holds
does it adopt the result (the spare becomes the held state, the old held state the next spare). Any refusal is
`ResyncRequired` naming the reason (`ResyncReason`) and leaves the held state exactly as it was. A standby holding
nothing, or refused, asks for a `Snapshot` (Θ, the outer optimizer's state, the bookkeeping, the outcomes of the
recent applied submissions) and then tails entries again. Memory and time: a standby keeps the spare (a second
copy of Θ and of the outer state) between entries; `prepare()`, called while idle, copies the held state into it,
so that an entry's critical path is its step and the digest, not two model-sized copies.

**Outcomes.** A standby keeps the outcomes of the last `APPLIED_KEPT` applied submissions (`Accepted`: whose, the
round, the staleness; ALGORITHM.md section 11, "Submission ids are in the log"), as the leader's core does, and
`core_snapshot()` hands them on: a coordinator resumed from it answers a learner resending a submission applied at
the old leader with that outcome, and never applies it again.

**What the leader keeps.** `RoundLog` keeps the newest entries, at most `max_entries` of them and at most
`max_bytes` of payload (Δ and bookkeeping, `LogEntry.payload_bytes`) in all, dropping the oldest first but never
the newest (which alone may be larger), and the digest of every version from the one just before the oldest entry
to the newest. `since(held, digest)` says what a standby holding `held` with `digest` needs: the entries after it,
or `None` (a snapshot) when it holds nothing, is ahead of the leader (it followed a deposed leader further), holds a
version the window no longer covers, or holds different bits. With `max_bytes` the size of a snapshot
(`snapshot_tensor_bytes`: Θ and the outer optimizer's tensors, the default of `--replication-log-bytes`), a
standby sent a snapshot for want of entries would have needed more entry bytes than the snapshot's tensors (the
kept ones and at least one more), so the cap bounds the log at about no cost in bytes sent (the two bookkeepings,
a few KB, aside). The newest entry is always
kept: a standby holding the version before it (the floor) can always acknowledge the newest version, which is what
the publish gate waits for, and one further behind gets a snapshot of the newest. Entries a stream is sending
when they are dropped are still sent (the stream holds them); it then asks `since` again.

**Synchronous replication.** `SyncGate` decides when version v may be published to learners: once `required`
standbys acknowledged v (or a newer version). Waiting is bounded: when fewer standbys are following than could
meet the requirement, or `timeout_s` passed since v was appended, v is published anyway (DEGRADED) and the
standbys that did not answer in time are marked lagging: they are not waited for again until they catch up (ack
the newest version appended at the time of the ack). So a stalled or slow standby costs one timeout, not one per
round. That is the default choice of availability (`WhenNoStandby.PUBLISH`); with `WhenNoStandby.WAIT` (durability)
the gate never publishes without the acknowledgements: where it would degrade it says HOLD, with no deadline, until
enough standbys acknowledged v (a standby that joins meanwhile counts once it holds v).

Byte layouts (little-endian; `n` = numel; crc32 = `zlib.crc32`):
- entry payload: Δ (n float32; with fragments, the named fragments' sizes summed) ‖ bookkeeping (UTF-8 JSON:
  {"core": ..., "applied": the round's outcomes, each `[submission_id, worker_id, round, staleness]` with round =
  the entry's version}); `payload_crc32` covers both.
- snapshot payload: Θ (n float32) ‖ one n-float32 tensor per name in `outer_tensors`, in that order ‖ bookkeeping
  (UTF-8 JSON, which also holds the outer optimizer's scalars); `payload_crc32` covers it all. With fragments, the
  names `fragments.<name>` hold each fragment's tensor `<name>` in its range (zeros where it has none), and the
  bookkeeping's `fragment_outer` each fragment's scalars and the names of the tensors it holds.
- digest: `params_crc32` = crc32 of Θ's bytes; `outer_crc32` = crc32 chained over the outer optimizer's
  `state_dict()`, key by key in sorted order: the key (UTF-8), then a tensor's float32 bytes, `b"\\x00"` for None,
  or the `repr` of any other value (UTF-8); with fragments, chained on over each fragment's optimizer in order.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from zlib_ng.zlib_ng import crc32  # zlib's crc32, vectorized: the same values

from diloco.core.coordinator import APPLIED_KEPT, Accepted, applied_from_json, applied_to_json, keep_applied
from diloco.core.fragments import FragmentLayout, step_fragment
from diloco.core.outer import OUTER_NAMES, OuterConfig, OuterOptimizer, build_outer
from diloco.core.parallel import parallel_crc32
from diloco.errors import ConfigError, FailedPrecondition, InvalidArgument

MAX_OUTER_TENSORS = 4  # tensors an outer optimizer's state holds (Nesterov: 1, Delayed Nesterov: 2)
MAX_BOOKKEEPING_BYTES = 64 << 20  # a bookkeeping JSON larger than this is refused as corrupt
_REUSE_SLACK = 2 << 20  # a reusing `Receiver` takes the last payload's memory for one up to this much smaller
# keys of a core snapshot that are not bookkeeping: its tensors, and the applied outcomes (an entry carries only its
# round's, a snapshot all it holds)
_NOT_BOOKKEEPING = ("params", "outer", "applied")
FRAGMENT_TENSOR_PREFIX = "fragments."  # a snapshot's outer tensors of the fragments' optimizers (`Snapshot.of_core`)


class ResyncReason(enum.Enum):
    NO_STATE = "no_state"  # the standby holds nothing yet
    STALE_EPOCH = "stale_epoch"  # the message comes from a leadership older than one already seen
    GAP = "gap"  # the entry is not exactly one version past the one held
    CORRUPT = "corrupt"  # payload checksum, sizes or bookkeeping do not check out
    CHECKSUM = "checksum"  # the replayed step did not give the leader's digest


class ResyncRequired(FailedPrecondition):
    """The standby refused a message and changed nothing; it must resync from a snapshot."""

    def __init__(self, reason: ResyncReason, message: str) -> None:
        super().__init__(f"{message}; resync from a snapshot")
        self.reason = reason


class LayoutMismatch(ResyncRequired):
    """A message (checksums verified) holds another fragment layout than this standby's own flags cut (another
    `--fragments`, or fragments on one side only): a snapshot would not help; the standby is not this leader's."""

    def __init__(self, message: str) -> None:
        super().__init__(ResyncReason.CORRUPT, message)


@dataclass(frozen=True)
class Digest:
    """crc32 of Θ's float32 bytes and of the outer optimizer's state (module docstring)."""

    params_crc32: int
    outer_crc32: int


def outer_checksum(outer: OuterOptimizer, crc: int = 0) -> int:
    for key, value in sorted(outer.state_dict().items()):
        crc = crc32(key.encode(), crc)
        if isinstance(value, torch.Tensor):
            crc = crc32(_fp32(value), crc)
        elif value is None:
            crc = crc32(b"\x00", crc)
        else:
            crc = crc32(repr(value).encode(), crc)
    return crc


def digest(params: torch.Tensor, *outers: OuterOptimizer) -> Digest:
    """Θ's crc32, and the outer states' chained in order (one optimizer: `outer_checksum` of it)."""
    crc = 0
    for outer in outers:
        crc = outer_checksum(outer, crc)
    return Digest(parallel_crc32(params.detach().contiguous().numpy().data.cast("B")), crc)


def state_digest(params: torch.Tensor, outer: OuterOptimizer, fragment_outers: Sequence[OuterOptimizer] = ()) -> Digest:
    """The digest of a coordinator's replicated state (the one rule, leader and standby): over the fragments' outer
    optimizers in fragment order when it runs fragments (the core's own `outer` is then never stepped), else over
    `outer`."""
    return digest(params, *(fragment_outers or (outer,)))


def _fp32(t: torch.Tensor) -> memoryview:
    if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
        raise ConfigError("replicated tensors are flat, contiguous float32 CPU vectors")
    return t.detach().numpy().data.cast("B")


def _crc(parts: Iterable[bytes | bytearray | memoryview]) -> int:
    crc = 0
    for p in parts:
        crc = crc32(p, crc)
    return crc


def _tensor(buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
    """A float32 vector over `buf` (no copy when it is writable; a private copy otherwise)."""
    view = memoryview(buf).cast("B")
    if len(view) != 4 * numel:
        raise ResyncRequired(ResyncReason.CORRUPT, f"a tensor of {len(view)} bytes where {4 * numel} were due")
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.float32) if numel else torch.zeros(0)


def _unfilled(size: int) -> memoryview:
    """A writable buffer of `size` bytes, not zeroed first (the payload overwrites every byte; zeroing would touch
    every page once more)."""
    return torch.empty(size, dtype=torch.uint8).numpy().data.cast("B")


def _json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _parse(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        value = json.loads(bytes(data))
    except (UnicodeDecodeError, ValueError) as e:
        raise ResyncRequired(ResyncReason.CORRUPT, f"the bookkeeping is not JSON ({e})") from None
    if not isinstance(value, dict) or not isinstance(value.get("core"), dict):
        raise ResyncRequired(ResyncReason.CORRUPT, "the bookkeeping has no 'core' object")
    return value


def core_bookkeeping(core_snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """The non-tensor part of `CoordinatorCore.snapshot()` (or of `FragmentedCoordinator.snapshot()`,
    `Standby.core_snapshot()`), less the applied outcomes: with fragments, their layout, versions, step counts and
    guard norms (not their outer states)."""
    book = {k: v for k, v in core_snapshot.items() if k not in _NOT_BOOKKEEPING}
    if isinstance(book.get("fragments"), Mapping):
        book["fragments"] = {k: v for k, v in book["fragments"].items() if k != "outer"}
    return book


def entry_numel(layout: FragmentLayout | None, fragments: Sequence[int], numel: int) -> int:
    """The values an entry's Δ must hold: the model's `numel` without fragments (and then it names none); with
    them, the sizes of the fragments it names, which must be valid, distinct and in increasing order, and at least
    one (a round steps at least one fragment). ResyncRequired (CORRUPT) otherwise."""
    if layout is None:
        if fragments:
            raise ResyncRequired(
                ResyncReason.CORRUPT,
                f"the entry steps fragments {list(fragments)}; this standby runs without fragments (--fragments 1)",
            )
        return numel
    if not fragments:
        raise ResyncRequired(
            ResyncReason.CORRUPT, f"the entry names no fragment; this standby runs {layout.fragments} fragments"
        )
    try:
        ps = [layout.check_index(p) for p in fragments]
    except InvalidArgument as e:
        raise ResyncRequired(ResyncReason.CORRUPT, str(e)) from None
    if any(a >= b for a, b in itertools.pairwise(ps)):
        raise ResyncRequired(ResyncReason.CORRUPT, f"the entry's fragments {ps} are not distinct and increasing")
    return sum(layout.size(p) for p in ps)


# --- the messages -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryMeta:
    """An entry's header: everything but the payload bytes."""

    version: int
    epoch: int
    learners: int
    numel: int
    bookkeeping_bytes: int
    payload_crc32: int
    digest: Digest
    fragments: tuple[int, ...] = ()  # the fragments the round stepped (none: no fragments; `entry_numel`)

    @property
    def payload_bytes(self) -> int:
        return 4 * self.numel + self.bookkeeping_bytes


@dataclass(frozen=True)
class LogEntry:
    """One applied round (module docstring). `delta`: the Δ the outer step took (read-only by convention); with
    fragments, the Δ[p] of each fragment in `fragments` (those the round stepped, in order), one after another."""

    version: int
    epoch: int
    learners: int
    delta: torch.Tensor
    bookkeeping: bytes  # UTF-8 JSON: {"core": ..., "applied": [...]}
    digest: Digest
    payload_crc32: int
    fragments: tuple[int, ...] = ()

    @classmethod
    def make(
        cls,
        version: int,
        epoch: int,
        learners: int,
        delta: torch.Tensor,
        core_snapshot: Mapping[str, Any],
        applied: Mapping[str, Accepted],
        after: Digest,
        fragments: Sequence[int] = (),
    ) -> LogEntry:
        """The leader's entry for `version`: `delta` (kept, not copied), the core's snapshot after the round (its
        tensors and outcomes are left out), the outcomes of the round's submissions and the digest after the step;
        with fragments, the ones stepped (`delta` holds their Δ[p] in that order)."""
        book = _json({"core": core_bookkeeping(core_snapshot), "applied": applied_to_json(applied)})
        crc = _crc((_fp32(delta), book))
        return cls(version, epoch, learners, delta, book, after, crc, tuple(fragments))

    @property
    def payload_bytes(self) -> int:
        """The bytes the entry holds and sends: Δ and the bookkeeping (what the log's byte cap counts)."""
        return 4 * self.delta.numel() + len(self.bookkeeping)

    @property
    def meta(self) -> EntryMeta:
        numel = self.delta.numel()
        return EntryMeta(
            self.version,
            self.epoch,
            self.learners,
            numel,
            len(self.bookkeeping),
            self.payload_crc32,
            self.digest,
            self.fragments,
        )

    def payload(self) -> tuple[memoryview, ...]:
        """The payload's parts, in order (views, no copy)."""
        return _fp32(self.delta), memoryview(self.bookkeeping)


@dataclass(frozen=True)
class SnapshotMeta:
    version: int
    epoch: int
    numel: int
    outer_tensors: tuple[str, ...]
    bookkeeping_bytes: int
    payload_crc32: int
    digest: Digest

    @property
    def payload_bytes(self) -> int:
        return 4 * self.numel * (1 + len(self.outer_tensors)) + self.bookkeeping_bytes


@dataclass(frozen=True)
class Snapshot:
    """The whole replicated state at `version`: Θ, the outer optimizer's tensors (by name) and the bookkeeping
    (JSON: {"core": ..., "outer": the optimizer's scalars, "applied": the outcomes of the recent applied
    submissions})."""

    version: int
    epoch: int
    params: torch.Tensor
    outer_tensors: tuple[tuple[str, torch.Tensor], ...]
    bookkeeping: bytes
    digest: Digest
    payload_crc32: int

    @classmethod
    def of_core(cls, core_snapshot: Mapping[str, Any], epoch: int) -> Snapshot:
        """A snapshot from `CoordinatorCore.snapshot()` (or `FragmentedCoordinator.snapshot()`,
        `Standby.core_snapshot()`), its tensors copied (call it where the core cannot step meanwhile: the
        coordinator's `work` lock). With fragments, each fragment's outer tensor of a name is laid in its range of
        one model-sized tensor named `fragments.<name>` (zeros where a fragment has none yet, e.g. before its first
        step), and the fragments' scalars and tensor names go in the bookkeeping (`fragment_outer`)."""
        outer_state = dict(core_snapshot["outer"])
        params = core_snapshot["params"].detach().clone()
        tensors = tuple((k, v.detach().clone()) for k, v in sorted(outer_state.items()) if isinstance(v, torch.Tensor))
        scalars = {k: v for k, v in outer_state.items() if not isinstance(v, torch.Tensor) and v is not None}
        applied = core_snapshot.get("applied", [])  # none in a checkpoint written before they were kept
        extra: dict[str, Any] = {}
        frag_outers: list[OuterOptimizer] = []
        frag = core_snapshot.get("fragments")
        if isinstance(frag, Mapping):
            layout = FragmentLayout(tuple(int(b) for b in frag["bounds"]))
            states = [dict(o) for o in frag["outer"]]
            names = sorted({k for o in states for k, v in o.items() if isinstance(v, torch.Tensor)})
            laid = []
            for name in names:
                whole = torch.zeros(params.numel(), dtype=torch.float32)
                for p, o in enumerate(states):
                    if isinstance(o.get(name), torch.Tensor):
                        layout.view(whole, p).copy_(o[name])
                laid.append((FRAGMENT_TENSOR_PREFIX + name, whole))
            tensors += tuple(laid)
            extra["fragment_outer"] = [_fragment_outer_book(o) for o in states]
            frag_outers = _fragment_outers_from(extra["fragment_outer"], dict(laid), layout)
        book = _json({"core": core_bookkeeping(core_snapshot), "outer": scalars, "applied": applied, **extra})
        outer = _outer_from(scalars, dict(tensors))
        crc = _crc((_fp32(params), *(_fp32(t) for _, t in tensors), book))
        after = state_digest(params, outer, frag_outers)
        return cls(int(core_snapshot["version"]), epoch, params, tensors, book, after, crc)

    @property
    def meta(self) -> SnapshotMeta:
        return SnapshotMeta(
            self.version,
            self.epoch,
            self.params.numel(),
            tuple(name for name, _ in self.outer_tensors),
            len(self.bookkeeping),
            self.payload_crc32,
            self.digest,
        )

    def payload(self) -> tuple[memoryview, ...]:
        return _fp32(self.params), *(_fp32(t) for _, t in self.outer_tensors), memoryview(self.bookkeeping)


def _fragment_outer_book(state: Mapping[str, Any]) -> dict[str, Any]:
    """A fragment outer state's bookkeeping in a snapshot: its scalars, and the names of the tensors it holds."""
    return {
        "scalars": {k: v for k, v in state.items() if not isinstance(v, torch.Tensor) and v is not None},
        "tensors": sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)),
    }


def _fragment_outers_from(
    books: object, tensors: Mapping[str, torch.Tensor], layout: FragmentLayout
) -> list[OuterOptimizer]:
    """The fragments' outer optimizers a snapshot holds (`Snapshot.of_core`): each one's scalars, and its range of
    the `fragments.<name>` tensors it names. ResyncRequired (CORRUPT) when they do not fit the layout."""
    if not isinstance(books, list) or len(books) != layout.fragments:
        raise ResyncRequired(ResyncReason.CORRUPT, f"the snapshot does not hold {layout.fragments} fragment optimizers")
    outers = []
    for p, book in enumerate(books):
        if not isinstance(book, Mapping) or not isinstance(book.get("tensors"), list):
            raise ResyncRequired(ResyncReason.CORRUPT, f"fragment {p}'s outer optimizer state is malformed")
        mine = {}
        for name in book["tensors"]:
            whole = tensors.get(FRAGMENT_TENSOR_PREFIX + str(name))
            if whole is None:
                raise ResyncRequired(ResyncReason.CORRUPT, f"fragment {p}'s outer tensor {name!r} is missing")
            mine[str(name)] = layout.view(whole, p)
        outers.append(_outer_from(book.get("scalars") or {}, mine))
    return outers


def _outer_from(scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> OuterOptimizer:
    """An outer optimizer holding `scalars` and (copies of) `tensors`, as its `state_dict()` lays them out
    (tensors named `fragments.<name>` are the fragments': not this optimizer's)."""
    tensors = {k: v for k, v in tensors.items() if not k.startswith(FRAGMENT_TENSOR_PREFIX)}
    name = scalars.get("name")
    if name not in OUTER_NAMES:
        raise ResyncRequired(ResyncReason.CORRUPT, f"unknown outer optimizer {name!r}")
    try:
        lr, momentum = float(scalars["lr"]), float(scalars["momentum"])
        outer = build_outer(OuterConfig(str(name), lr, momentum))
        state = {**outer.state_dict(), **scalars, **tensors}
        outer.load_state_dict(state)
    except (KeyError, TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise ResyncRequired(ResyncReason.CORRUPT, f"the outer optimizer's state is malformed ({e})") from None
    unknown = set(state) - set(outer.state_dict())
    if unknown:
        raise ResyncRequired(ResyncReason.CORRUPT, f"the outer optimizer's state has unknown keys {sorted(unknown)}")
    return outer


def _copy_outer(outer: OuterOptimizer, into: OuterOptimizer | None = None) -> OuterOptimizer:
    """A copy of `outer`'s state: into `into`'s own tensors where they fit (same kind, shapes), else fresh ones."""
    state = outer.state_dict()
    if into is None or into.name != outer.name:
        into = build_outer(OuterConfig(state["name"], float(state["lr"]), float(state["momentum"])))
    mine = into.state_dict()
    into.load_state_dict({k: _copy_tensor(v, mine.get(k)) for k, v in state.items()}, clone=False)
    return into


def _copy_tensor(value: Any, into: Any) -> Any:
    """`value` copied (a tensor: into `into` when it has the same shape and dtype), or as it is (anything else)."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(into, torch.Tensor) and into.shape == value.shape and into.dtype == value.dtype:
        return into.copy_(value)
    return value.detach().clone()


# --- the receiving end of the wire ------------------------------------------------------------------------------


class Receiver:
    """Reassembles one snapshot or entry at a time from its header and data chunks (a standby's stream), checking
    sizes as it goes and the payload checksum at the end. Anything out of order or oversized is `ResyncRequired`
    (CORRUPT); the receiver is then empty again.

    `reuse`: the next payload of about the same size is received into the last one's memory (a fresh model-sized
    buffer costs its page faults, about as long as receiving into it): a message returned is then valid only until
    the next `start`, which the caller must have applied (and so copied what it keeps) before."""

    def __init__(
        self,
        numel: int,
        max_bookkeeping_bytes: int = MAX_BOOKKEEPING_BYTES,
        *,
        reuse: bool = False,
        layout: FragmentLayout | None = None,
    ) -> None:
        self.numel = numel
        self.layout = layout  # the standby's fragments (None: none): what an entry's fragments and Δ must fit
        self.max_bookkeeping_bytes = max_bookkeeping_bytes
        self.reuse = reuse
        self._store: memoryview | None = None  # reuse: the memory of the last payload
        self._meta: EntryMeta | SnapshotMeta | None = None
        self._buf = memoryview(bytearray())
        self._at = 0
        self._crc = 0  # of the payload bytes received so far

    @property
    def busy(self) -> bool:
        return self._meta is not None

    def start(self, meta: EntryMeta | SnapshotMeta) -> LogEntry | Snapshot | None:
        """A header: the payload follows (returned at once when it is empty, which only a zero-size model has)."""
        if self._meta is not None:
            self.reset()
            raise ResyncRequired(ResyncReason.CORRUPT, "a header arrived before the previous payload was complete")
        due = entry_numel(self.layout, meta.fragments, self.numel) if isinstance(meta, EntryMeta) else self.numel
        if meta.numel != due:
            raise ResyncRequired(
                ResyncReason.CORRUPT,
                f"the leader's message holds {meta.numel} parameters; this standby's model has {self.numel}"
                + (f" ({due} in the fragments the entry names)" if due != self.numel else ""),
            )
        if not 0 <= meta.bookkeeping_bytes <= self.max_bookkeeping_bytes:
            raise ResyncRequired(
                ResyncReason.CORRUPT,
                f"bookkeeping of {meta.bookkeeping_bytes} bytes (limit {self.max_bookkeeping_bytes})",
            )
        if isinstance(meta, SnapshotMeta) and len(meta.outer_tensors) > MAX_OUTER_TENSORS:
            raise ResyncRequired(ResyncReason.CORRUPT, f"{len(meta.outer_tensors)} outer tensors (at most 4)")
        self._meta, self._buf, self._at, self._crc = meta, self._space(meta.payload_bytes), 0, 0
        return self._finish() if meta.payload_bytes == 0 else None

    def _space(self, size: int) -> memoryview:
        """Where a payload of `size` bytes is received: the last payload's memory when it fits without wasting much
        (an entry's bookkeeping changes size a little from round to round), else a new buffer."""
        if not self.reuse:
            return _unfilled(size)
        store = self._store
        if store is None or not size <= len(store) <= size + _REUSE_SLACK:
            self._store = store = None  # the old memory goes before the new is taken
            store = self._store = _unfilled(size + _REUSE_SLACK // 2)
        return store[:size]

    def feed(self, data: bytes | memoryview) -> LogEntry | Snapshot | None:
        """A data chunk; returns the message once its payload is complete."""
        if self._meta is None:
            raise ResyncRequired(ResyncReason.CORRUPT, "payload bytes arrived without a header")
        end = self._at + len(data)
        if end > len(self._buf):
            self.reset()
            raise ResyncRequired(ResyncReason.CORRUPT, "more payload bytes than the header announced")
        self._buf[self._at : end] = data
        self._crc = crc32(data, self._crc)  # as it comes: no pass over the whole payload at the end
        self._at = end
        return self._finish() if end == len(self._buf) else None

    def reset(self) -> None:
        """Forget a message half received (a stream was cut); the memory kept for reuse stays."""
        self._meta, self._buf, self._at, self._crc = None, memoryview(bytearray()), 0, 0

    def _finish(self) -> LogEntry | Snapshot:
        meta, buf, crc = self._meta, self._buf, self._crc
        self.reset()
        assert meta is not None
        if crc != meta.payload_crc32:
            raise ResyncRequired(ResyncReason.CORRUPT, f"version {meta.version}: the payload checksum does not match")
        view, n = memoryview(buf), 4 * meta.numel
        if isinstance(meta, EntryMeta):
            book = bytes(view[n:])
            return LogEntry(
                meta.version,
                meta.epoch,
                meta.learners,
                _tensor(view[:n], meta.numel),
                book,
                meta.digest,
                meta.payload_crc32,
                meta.fragments,
            )
        tensors = tuple(
            (name, _tensor(view[n * (i + 1) : n * (i + 2)], meta.numel)) for i, name in enumerate(meta.outer_tensors)
        )
        book = bytes(view[n * (1 + len(tensors)) :])
        params = _tensor(view[:n], meta.numel)
        return Snapshot(meta.version, meta.epoch, params, tensors, book, meta.digest, meta.payload_crc32)


# --- the standby ------------------------------------------------------------------------------------------------


@dataclass
class _Held:
    version: int
    params: torch.Tensor
    outer: OuterOptimizer
    core: dict[str, Any]
    digest: Digest
    applied: OrderedDict[str, Accepted] = field(default_factory=OrderedDict)  # the recent ones, oldest first
    fragment_outers: list[OuterOptimizer] = field(default_factory=list)  # with fragments: each one's, in order


# the state an entry's step is taken on: Θ, the core's outer optimizer, the fragments' (none without fragments)
_Work = tuple[torch.Tensor, OuterOptimizer, list[OuterOptimizer]]


class Standby:
    """A hot standby's copy of the leader's state, moved only by `load` (a snapshot) and `apply` (the next entry).

    States: EMPTY (holds nothing) --load--> HOLDING(v) --apply(v+1)--> HOLDING(v+1); a refused `apply` or `load`
    leaves it where it was. `epoch` is the newest leadership epoch seen; it never goes backwards.

    `layout`: the fragments this standby runs (its own configuration, as `numel` is; None: none). With fragments it
    holds each fragment's outer optimizer, an entry names the fragments its round stepped and holds their Δ[p], and
    `apply` steps each with `step_fragment` (the leader's rule); a snapshot or entry of another layout, or one
    with/without fragments where this standby runs without/with them, is refused (CORRUPT)."""

    def __init__(self, numel: int, layout: FragmentLayout | None = None) -> None:
        if layout is not None and layout.numel != numel:
            raise ConfigError(f"fragment layout covers {layout.numel} values; the model has {numel}")
        self.numel = numel
        self.layout = layout
        self.epoch = 0
        self._held: _Held | None = None
        # the spare state an entry's step is taken on (adopted when the digest matches); ready: it holds the same
        # bits as `_held`
        self._spare: _Work | None = None
        self._spare_ready = False

    @property
    def version(self) -> int | None:
        return None if self._held is None else self._held.version

    @property
    def digest(self) -> Digest | None:
        return None if self._held is None else self._held.digest

    @property
    def params(self) -> torch.Tensor:
        return self._require().params

    @property
    def outer(self) -> OuterOptimizer:
        return self._require().outer

    @property
    def fragment_outers(self) -> tuple[OuterOptimizer, ...]:
        """With fragments, each fragment's outer optimizer (() without)."""
        return tuple(self._require().fragment_outers)

    @property
    def applied(self) -> Mapping[str, Accepted]:
        """The outcomes of the recent applied submissions (at most `APPLIED_KEPT`), by submission id, oldest first."""
        return MappingProxyType(self._require().applied)

    def _require(self) -> _Held:
        if self._held is None:
            raise ResyncRequired(ResyncReason.NO_STATE, "this standby holds no state yet")
        return self._held

    def _check_epoch(self, epoch: int, what: str) -> None:
        if epoch < self.epoch:
            raise ResyncRequired(
                ResyncReason.STALE_EPOCH,
                f"{what} comes from leadership epoch {epoch}, older than epoch {self.epoch} already seen",
            )

    def _fragments_book(self, core: Mapping[str, Any], what: str) -> dict[str, Any] | None:
        """The fragment bookkeeping of a message (None without fragments), checked against this standby's layout
        (LayoutMismatch: bounds, fingerprint, or fragments on one side only) and for one version, step count and guard
        window per fragment (CORRUPT)."""
        frag = core.get("fragments")
        layout = self.layout
        if layout is None:
            if frag is not None:
                raise LayoutMismatch(
                    f"{what} holds fragments; this standby runs without (--fragments 1): start it with the "
                    "leader's --fragments"
                )
            return None
        if not isinstance(frag, dict):
            raise LayoutMismatch(
                f"{what} holds no fragments; this standby runs {layout.fragments} (--fragments): start it with the "
                "leader's --fragments"
            )
        if frag.get("bounds") != list(layout.bounds) or frag.get("fingerprint") != layout.fingerprint:
            raise LayoutMismatch(
                f"{what} has fragment layout {frag.get('fingerprint')!r}, this standby {layout.fingerprint}: "
                "start it with the leader's --fragments"
            )
        for key in ("versions", "steps", "guard_norms"):
            value = frag.get(key)
            if not isinstance(value, list) or len(value) != layout.fragments:
                raise ResyncRequired(ResyncReason.CORRUPT, f"{what}: fragment {key} do not hold {layout.fragments}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in frag["versions"] + frag["steps"]):
            raise ResyncRequired(ResyncReason.CORRUPT, f"{what}: fragment versions and steps must be integers")
        return frag

    def load(self, snap: Snapshot) -> None:
        """Adopt a snapshot whole (any version: a standby ahead of a new leader goes back to it)."""
        self._check_epoch(snap.epoch, f"snapshot of version {snap.version}")
        if snap.params.numel() != self.numel or any(t.numel() != self.numel for _, t in snap.outer_tensors):
            raise ResyncRequired(ResyncReason.CORRUPT, f"snapshot tensors do not hold {self.numel} parameters")
        if _crc(snap.payload()) != snap.payload_crc32:
            raise ResyncRequired(ResyncReason.CORRUPT, f"snapshot of version {snap.version}: payload checksum differs")
        book = _parse(snap.bookkeeping)
        core = book["core"]
        if core.get("version") != snap.version:
            raise ResyncRequired(
                ResyncReason.CORRUPT, f"snapshot of version {snap.version} holds bookkeeping of another"
            )
        frag = self._fragments_book(core, f"snapshot of version {snap.version}")
        outer = _outer_from(book.get("outer") or {}, dict(snap.outer_tensors))
        fragment_outers = []
        if frag is not None and self.layout is not None:
            fragment_outers = _fragment_outers_from(book.get("fragment_outer"), dict(snap.outer_tensors), self.layout)
        params = snap.params.detach().clone()
        got = state_digest(params, outer, fragment_outers)
        if got != snap.digest:
            raise ResyncRequired(ResyncReason.CHECKSUM, f"snapshot of version {snap.version}: its digest differs")
        held = _Held(snap.version, params, outer, core, got, fragment_outers=fragment_outers)
        keep_applied(held.applied, _applied(book, None))
        self._held, self.epoch = held, max(self.epoch, snap.epoch)
        self._spare_ready = False

    def apply(self, entry: LogEntry, *, scratch_delta: bool = False) -> None:
        """Apply the next round (module docstring: checks first, then the step on the spare, then the digest).
        `scratch_delta`: the entry's Δ may be overwritten (one that came off the wire: it is not used again)."""
        held = self._require()
        self._check_epoch(entry.epoch, f"entry {entry.version}")
        if entry.version != held.version + 1:
            raise ResyncRequired(
                ResyncReason.GAP, f"entry {entry.version} does not follow the version held ({held.version})"
            )
        numel = entry_numel(self.layout, entry.fragments, self.numel)
        if entry.delta.numel() != numel:
            raise ResyncRequired(ResyncReason.CORRUPT, f"entry {entry.version}: Δ does not hold {numel} values")
        if _crc((_fp32(entry.delta), entry.bookkeeping)) != entry.payload_crc32:
            raise ResyncRequired(ResyncReason.CORRUPT, f"entry {entry.version}: payload checksum differs")
        book = _parse(entry.bookkeeping)
        if book["core"].get("version") != entry.version:
            raise ResyncRequired(ResyncReason.CORRUPT, f"entry {entry.version} holds bookkeeping of another version")
        if entry.learners < 1:
            raise ResyncRequired(ResyncReason.CORRUPT, f"entry {entry.version}: learners must be >= 1")
        self._check_fragment_steps(held, book["core"], entry)
        applied = _applied(book, entry.version)
        params, outer, fragment_outers = self._workspace()
        self._spare_ready = False  # stepped below: no longer a copy of the held state
        if self.layout is None:
            outer.set_num_learners(entry.learners)
            outer.step(params, entry.delta, scratch_delta=scratch_delta)  # the same bits either way
        else:
            at = 0
            for p in entry.fragments:
                size = self.layout.size(p)
                delta = entry.delta[at : at + size]
                step_fragment(
                    self.layout, params, fragment_outers[p], p, delta, entry.learners, scratch_delta=scratch_delta
                )
                at += size
        got = state_digest(params, outer, fragment_outers)
        if got != entry.digest:
            raise ResyncRequired(
                ResyncReason.CHECKSUM,
                f"entry {entry.version}: the replayed step gives crc32 {got.params_crc32:#010x}/{got.outer_crc32:#010x}"
                f", the leader had {entry.digest.params_crc32:#010x}/{entry.digest.outer_crc32:#010x}",
            )
        keep_applied(held.applied, applied)  # nothing above raised: adopt it all, and keep the old as the spare
        self._spare = (held.params, held.outer, held.fragment_outers)
        held.version, held.params, held.outer, held.core, held.digest = entry.version, params, outer, book["core"], got
        held.fragment_outers = fragment_outers
        self.epoch = max(self.epoch, entry.epoch)

    def _check_fragment_steps(self, held: _Held, core: Mapping[str, Any], entry: LogEntry) -> None:
        """With fragments: the bookkeeping's fragment versions and step counts must be the held ones moved by
        exactly the fragments the entry steps (version ← the entry's, steps + 1), the others unchanged."""
        after = self._fragments_book(core, f"entry {entry.version}")
        if after is None:
            return
        before = held.core["fragments"]
        stepped = set(entry.fragments)
        for p in range(len(after["versions"])):
            want = (
                (entry.version, before["steps"][p] + 1) if p in stepped else (before["versions"][p], before["steps"][p])
            )
            if (after["versions"][p], after["steps"][p]) != want:
                raise ResyncRequired(
                    ResyncReason.CORRUPT,
                    f"entry {entry.version}: fragment {p}'s version and step count "
                    f"({after['versions'][p]}, {after['steps'][p]}) should be {want}",
                )

    def prepare(self) -> None:
        """Make the spare a copy of the held state, so that the next `apply` steps it without copying first: call
        it while idle (after acknowledging a version). A no-op when it already is one, or nothing is held."""
        if self._held is not None and not self._spare_ready:
            self._workspace()

    def _workspace(self) -> _Work:
        """The spare, a copy of the held state (copied now unless `prepare` did it), to step on."""
        held = self._require()
        if not self._spare_ready:
            params, outer, fragment_outers = self._spare if self._spare is not None else (None, None, [])
            if params is None or params.shape != held.params.shape:
                params = held.params.clone()
            else:
                params.copy_(held.params)
            if len(fragment_outers) != len(held.fragment_outers):
                fragment_outers = [None] * len(held.fragment_outers)  # type: ignore[list-item]
            copies = [_copy_outer(o, into=i) for o, i in zip(held.fragment_outers, fragment_outers, strict=True)]
            self._spare = (params, _copy_outer(held.outer, into=outer), copies)
            self._spare_ready = True
        assert self._spare is not None
        return self._spare

    def core_snapshot(self) -> dict[str, Any]:
        """What `CoordinatorCore.restore` (with fragments, `FragmentedCoordinator.restore`) takes (and
        `services.coordinator.checkpoint.save` writes), the outcomes of the recent applied submissions included. The
        tensors are the standby's own: serialise them before the next `apply`, `load` or `prepare` (which may write
        into them)."""
        held = self._require()
        snap = {
            **held.core,
            "params": held.params,
            "outer": held.outer.state_dict(),
            "applied": applied_to_json(held.applied),
        }
        if held.fragment_outers:
            snap["fragments"] = {**held.core["fragments"], "outer": [o.state_dict() for o in held.fragment_outers]}
        return snap


def _applied(book: Mapping[str, Any], version: int | None) -> dict[str, Accepted]:
    """The applied outcomes a message's bookkeeping holds; an entry's (`version` given) must all be of its round."""
    try:
        applied = applied_from_json(book.get("applied", []))
    except InvalidArgument as e:
        raise ResyncRequired(ResyncReason.CORRUPT, f"the bookkeeping's outcomes are malformed ({e})") from None
    if len(applied) > APPLIED_KEPT:
        raise ResyncRequired(ResyncReason.CORRUPT, f"{len(applied)} applied outcomes (at most {APPLIED_KEPT})")
    if version is not None and any(a.round != version for a in applied.values()):
        raise ResyncRequired(ResyncReason.CORRUPT, f"entry {version} holds outcomes of another round")
    return applied


# --- the leader's log -------------------------------------------------------------------------------------------


def snapshot_tensor_bytes(numel: int, outer: OuterOptimizer) -> int:
    """The bytes of a snapshot's tensors once `outer` has stepped: Θ and each of its state tensors, `numel` float32
    values each (with fragments, each name laid model-sized too). A snapshot holds these and its bookkeeping: the
    default byte cap of the round log (`--replication-log-bytes`)."""
    return 4 * numel * (1 + len(outer.state_tensors))


@dataclass(frozen=True)
class LogUsage:
    """What the round log holds: versions `oldest` + 1 to `newest` (a standby holding `oldest` or newer catches up
    from entries), `entries` of them, `bytes` of payload in all, under the cap `max_bytes`."""

    oldest: int
    newest: int
    entries: int
    bytes: int
    max_entries: int
    max_bytes: int | None


class RoundLog:
    """The leader's recent entries (at most `max_entries`, and at most `max_bytes` of payload save the newest
    entry; None: no byte cap) and the digest of every version they span."""

    def __init__(self, version: int, at: Digest, max_entries: int, max_bytes: int | None = None) -> None:
        if max_entries < 1:
            raise ConfigError(f"replication log entries must be >= 1, got {max_entries}")
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError(f"replication log bytes must be >= 1, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0  # the entries' payload bytes, summed
        self._entries: deque[LogEntry] = deque()
        self._floor = (version, at)  # the version just before the oldest entry, and its digest

    def usage(self) -> LogUsage:
        return LogUsage(self.oldest, self.newest, len(self._entries), self.bytes, self.max_entries, self.max_bytes)

    @property
    def newest(self) -> int:
        return self._entries[-1].version if self._entries else self._floor[0]

    @property
    def oldest(self) -> int:
        """The oldest version a standby may hold and still catch up from entries."""
        return self._floor[0]

    def digest_of(self, version: int) -> Digest | None:
        """The digest the log knows for `version` (None: outside the window)."""
        if version == self._floor[0]:
            return self._floor[1]
        i = version - self._floor[0] - 1
        return self._entries[i].digest if 0 <= i < len(self._entries) else None

    def append(self, entry: LogEntry) -> None:
        if entry.version != self.newest + 1:
            raise FailedPrecondition(f"log entry {entry.version} does not follow version {self.newest}")
        self._entries.append(entry)
        self.bytes += entry.payload_bytes
        while len(self._entries) > self.max_entries or (
            self.max_bytes is not None and self.bytes > self.max_bytes and len(self._entries) > 1
        ):
            old = self._entries.popleft()
            self.bytes -= old.payload_bytes
            self._floor = (old.version, old.digest)

    def since(self, held: int | None, held_digest: Digest | None) -> list[LogEntry] | None:
        """The entries a standby holding `held` (None: nothing) with `held_digest` needs, oldest first ([] when it is
        up to date), or None: it needs a snapshot."""
        if held is None or held_digest is None:
            return None
        if self.digest_of(held) != held_digest:  # ahead, too far behind, or other bits
            return None
        return list(self._entries)[held - self._floor[0] :]


# --- publishing after the standbys ------------------------------------------------------------------------------


class Gate(enum.Enum):
    PUBLISH = "publish"  # enough standbys hold the version
    WAIT = "wait"  # wait for acks until `deadline`
    DEGRADED = "degraded"  # publish without them (too few following, or the timeout passed)
    HOLD = "hold"  # do not publish without them, however long it takes (WhenNoStandby.WAIT)


class WhenNoStandby(enum.Enum):
    """What a leader does with a version when too few standbys can acknowledge it (`--when-no-standby`)."""

    PUBLISH = "publish"  # availability: publish it degraded after the bounded wait
    WAIT = "wait"  # durability: hold it back from learners until enough standbys acknowledged it


WHEN_NO_STANDBY = tuple(w.value for w in WhenNoStandby)


@dataclass(frozen=True)
class GateDecision:
    gate: Gate
    acked: tuple[str, ...]  # standbys holding the version
    missing: tuple[str, ...]  # followers that did not ack it in time (marked lagging) or still may
    deadline: float = math.inf  # WAIT: when to decide again at the latest


@dataclass(frozen=True)
class ReplicaLag:
    """One standby as the leader sees it: the newest version it acknowledged (None: none yet), how many versions it
    is behind the newest appended (`newest + 1` while it acknowledged none), and whether it missed a deadline."""

    replica_id: str
    acked: int | None
    lag: int
    lagging: bool


@dataclass
class _Replica:
    acked: int = -1
    following: int = 0  # streams open
    lagging: bool = False  # missed a deadline: not waited for until it acks the newest version


class SyncGate:
    """Which standbys hold which version, and whether version v may be published (module docstring)."""

    def __init__(self, required: int, timeout_s: float, when_no_standby: WhenNoStandby = WhenNoStandby.PUBLISH) -> None:
        if required < 0:
            raise ConfigError(f"sync replicas must be >= 0, got {required}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"replica ack timeout must be a finite number > 0, got {timeout_s}")
        self.required = required
        self.timeout_s = timeout_s
        self.when_no_standby = when_no_standby
        self.newest = 0  # the newest version appended (what a lagging standby must reach)
        self._replicas: dict[str, _Replica] = {}

    def appended(self, version: int) -> None:
        self.newest = max(self.newest, version)

    def follow(self, replica_id: str) -> None:
        self._replicas.setdefault(replica_id, _Replica()).following += 1

    def unfollow(self, replica_id: str) -> None:
        r = self._replicas.get(replica_id)
        if r is not None:
            r.following = max(0, r.following - 1)
            if not r.following:
                del self._replicas[replica_id]

    def ack(self, replica_id: str, version: int) -> None:
        """A standby holds `version` (acks of a standby with no open stream are ignored)."""
        r = self._replicas.get(replica_id)
        if r is None:
            return
        r.acked = max(r.acked, version)
        if r.acked >= self.newest:
            r.lagging = False

    def acked(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return -1 if r is None else r.acked

    def replicas(self) -> tuple[ReplicaLag, ...]:
        """The standbys following now, by id."""
        return tuple(
            ReplicaLag(w, r.acked if r.acked >= 0 else None, self.newest - r.acked, r.lagging)
            for w, r in sorted(self._replicas.items())
        )

    def holding(self, version: int) -> tuple[str, ...]:
        """The standbys following now that acknowledged `version` or a newer one (those a step-down may hand to)."""
        return tuple(sorted(w for w, r in self._replicas.items() if r.acked >= version))

    def decide(self, version: int, since: float, now: float) -> GateDecision:
        """May `version` (appended at `since`) be published at `now`? A DEGRADED or HOLD decision marks the
        followers that did not ack it in time as lagging (a transition: call it once per decision taken; a HOLD may be
        asked again, it only marks them again). HOLD names every follower not holding `version` yet."""
        acked = tuple(sorted(w for w, r in self._replicas.items() if r.acked >= version))
        if len(acked) >= self.required:
            return GateDecision(Gate.PUBLISH, acked, ())
        waiting = tuple(sorted(w for w, r in self._replicas.items() if r.acked < version and not r.lagging))
        if len(acked) + len(waiting) >= self.required and now < since + self.timeout_s:
            return GateDecision(Gate.WAIT, acked, waiting, since + self.timeout_s)
        for w in waiting:
            self._replicas[w].lagging = True
        if self.when_no_standby is WhenNoStandby.WAIT:
            behind = tuple(sorted(w for w, r in self._replicas.items() if r.acked < version))
            return GateDecision(Gate.HOLD, acked, behind)
        return GateDecision(Gate.DEGRADED, acked, waiting)
