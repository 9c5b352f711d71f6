"""Generic protobuf fuzzing for the gRPC services: hypothesis strategies built from message descriptors, one-field
mutations of valid messages, and a call helper that drives any RPC (unary or streaming, typed or raw bytes) from
its method descriptor and reports how it ended. Nothing here knows a particular service."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor as _d
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

FD = _d.FieldDescriptor
# Descriptors come from the C (upb) or the Python implementation, with different static types: take either.
Descriptor = Any
Field = Any
INT_RANGES: dict[int, tuple[int, int]] = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
ENUM_RANGE = INT_RANGES[FD.TYPE_INT32]  # proto3 enums are open: any int32 goes on the wire
# Strings a validator should think about: empty, control characters, non-ASCII, path tricks, huge.
ODD_STRINGS = ["", " ", "\x00", "\n", "\t\r", "é", "💥", "../../etc/passwd", "%s%n", "-1", "a" * 257, "x" * 100_000]
ODD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 1e308, -1e308, 5e-324]
MAX_DEPTH = 3


def message_class(desc: Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(desc)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted(e for e in {lo, hi, 0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**53 + 1, 2**63 - 1} if lo <= e <= hi)
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, -300), min(hi, 300)))


def scalar_values(field: Field) -> st.SearchStrategy[Any]:
    """Any value of a non-message field's type, biased towards edges (extremes, NaN/inf, odd text)."""
    t = field.type
    if t in INT_RANGES:
        return _ints(*INT_RANGES[t])
    if t == FD.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints(*ENUM_RANGE))
    if t == FD.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(ODD_FLOATS), st.floats())
    if t == FD.TYPE_FLOAT:
        return st.one_of(st.sampled_from(ODD_FLOATS[:6]), st.floats(width=32))
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=24), st.text(max_size=400))
    if t == FD.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.binary(max_size=4096), st.sampled_from([b"", b"\0" * 70_000]))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def field_values(field: Field, depth: int) -> st.SearchStrategy[Any]:
    """One element of `field` (a message or a scalar)."""
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    return scalar_values(field)


def _is_repeated(field: Field) -> bool:
    return bool(field.is_repeated)


@st.composite
def _message(draw: st.DrawFn, desc: Descriptor, depth: int) -> Message:
    msg = message_class(desc)()
    if depth > MAX_DEPTH:
        return msg
    for field in desc.fields:
        if not draw(st.booleans()):
            continue
        if _is_repeated(field):
            values = draw(st.lists(field_values(field, depth), max_size=4 if depth < 2 else 2))
            _extend(msg, field, values)
        else:
            _assign(msg, field, draw(field_values(field, depth)))
    return msg


_CACHE: dict[tuple[str, int], st.SearchStrategy[Message]] = {}


def messages(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Random messages of type `desc`: every field type, repeated and nested fields, out-of-range enums."""
    key = (desc.full_name, depth)
    if key not in _CACHE:
        _CACHE[key] = _message(desc, depth)
    return _CACHE[key]


def _assign(msg: Message, field: Field, value: Any) -> None:
    if field.type == FD.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _extend(msg: Message, field: Field, values: Sequence[Any]) -> None:
    target = getattr(msg, field.name)
    if field.type == FD.TYPE_MESSAGE:
        for v in values:
            target.add().CopyFrom(v)
    else:
        target.extend(values)


# --- mutations of valid messages ----------------------------------------------------------------------------------
def _near(field: Field, value: Any) -> st.SearchStrategy[Any]:
    """Values close to a valid one: off by one, negated, doubled, emptied, extended."""
    t = field.type
    if t in INT_RANGES or t == FD.TYPE_ENUM:
        lo, hi = INT_RANGES.get(t, ENUM_RANGE)
        near = [value + 1, value - 1, -value, 2 * value + 1, 0, lo, hi]
        return st.sampled_from([min(hi, max(lo, v)) for v in near])
    if t == FD.TYPE_STRING:
        return st.sampled_from(["", value + "x", value[:-1], value.upper(), value + "\x00", value * 30, " " + value])
    if t == FD.TYPE_BYTES:
        return st.sampled_from([b"", value[:-1], value + b"\0", value[1:], value * 2])
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.sampled_from([-value, value * 1e30, math.nan, math.inf, 0.0])
    return st.just(not value) if t == FD.TYPE_BOOL else st.nothing()


def _index() -> st.SearchStrategy[int]:
    """A position drawn independently of the length it indexes (taken modulo it), so the draws stay the same when
    a valid message's shape varies between runs (ids and versions differ; hypothesis replays the same draws)."""
    return st.integers(0, 2**16)


@dataclass(frozen=True)
class Slot:
    """A place in a message tree: a field of `parent`, or element `index` of a repeated field."""

    parent: Message
    field: Field
    index: int | None
    path: str


def slots(msg: Message, prefix: str = "") -> Iterator[Slot]:
    """Every field of `msg` and of its set sub-messages (set or not), and every element of its repeated fields."""
    for field in msg.DESCRIPTOR.fields:
        path = f"{prefix}{field.name}"
        yield Slot(msg, field, None, path)
        if _is_repeated(field):
            for i, item in enumerate(getattr(msg, field.name)):
                yield Slot(msg, field, i, f"{path}[{i}]")
                if field.type == FD.TYPE_MESSAGE:
                    yield from slots(item, f"{path}[{i}].")
        elif field.type == FD.TYPE_MESSAGE and msg.HasField(field.name):
            yield from slots(getattr(msg, field.name), f"{path}.")


@st.composite
def mutated(draw: st.DrawFn, valid: Message) -> tuple[Message, str]:
    """A copy of `valid` with exactly one field changed (cleared, nudged, randomised, an element added or removed);
    also returns a description of the change (for failure reports)."""
    msg = type(valid)()
    msg.CopyFrom(valid)
    places = list(slots(msg))
    if not places:
        return msg, "no fields to change"
    slot = places[draw(_index()) % len(places)]
    parent, field = slot.parent, slot.field
    if _is_repeated(field):
        seq = getattr(parent, field.name)
        if slot.index is None:
            action = draw(st.sampled_from(["clear", "append", "duplicate"]))
            action = action if len(seq) else "append"
            if action == "clear":
                parent.ClearField(field.name)
            elif action == "append":
                _extend(parent, field, [draw(field_values(field, 1))])
            else:
                _extend(parent, field, [seq[draw(_index()) % len(seq)]])
            return msg, f"{slot.path}: {action}"
        action = draw(st.sampled_from(["delete", "replace"]))
        if action == "delete":
            del seq[slot.index]
        elif field.type == FD.TYPE_MESSAGE:
            seq[slot.index].CopyFrom(draw(messages(field.message_type, 1)))
        else:
            old = seq[slot.index]
            seq[slot.index] = draw(st.one_of(_near(field, old), scalar_values(field)))
        return msg, f"{slot.path}: {action} -> {seq[slot.index] if action == 'replace' else ''}"
    if field.type == FD.TYPE_MESSAGE:
        if draw(st.booleans()):
            parent.ClearField(field.name)
            return msg, f"{slot.path}: clear"
        getattr(parent, field.name).CopyFrom(draw(messages(field.message_type, 1)))
        return msg, f"{slot.path}: random message"
    old = getattr(parent, field.name)
    new = draw(st.one_of(_near(field, old), scalar_values(field)))
    setattr(parent, field.name, new)
    return msg, f"{slot.path}: {old!r:.40} -> {new!r:.40}"


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """Wire bytes with one byte-level change: truncated, a bit flipped, garbage spliced in, duplicated."""
    if not data:
        return draw(st.binary(min_size=1, max_size=16))
    action = draw(st.sampled_from(["truncate", "flip", "splice", "double", "prefix"]))
    i = draw(_index()) % len(data)
    if action == "truncate":
        return data[:i]
    if action == "flip":
        return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :]
    if action == "splice":
        return data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]
    if action == "double":
        return data + data
    return draw(st.binary(min_size=1, max_size=8)) + data


def garbage() -> st.SearchStrategy[bytes]:
    """Raw request bodies: random bytes, truncated varints, invalid wire types, field numbers out of range."""
    tricky = [
        b"\xff" * 10,  # a varint that never ends
        b"\x08",  # field 1 varint, value missing
        b"\x0a\xff\xff\xff\xff\x0f",  # length-delimited, length 4 GiB
        b"\x0a\x05ab",  # length says 5, 2 bytes follow
        b"\x0f",  # wire type 7 (invalid)
        b"\x00",  # field number 0
        b"\xf8\xff\xff\xff\x0f\x01",  # field number 2^29-1 (unknown, valid)
        b"\x0b\x0c",  # start group / end group (deprecated wire types)
        b"\x12\x02\xc3\x28",  # a string field with invalid UTF-8 (in most messages field 2 is a string or msg)
        b"\x0a\x02\xc3\x28",  # the same in field 1
    ]
    return st.one_of(st.sampled_from(tricky), st.binary(max_size=256))


def parses(cls: type[Message], data: bytes) -> bool:
    try:
        cls.FromString(data)
    except (DecodeError, RuntimeError, ValueError):
        return False
    return True


# --- calling any RPC from its descriptor --------------------------------------------------------------------------
@dataclass(frozen=True)
class Rpc:
    service: str
    name: str
    input: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    def __str__(self) -> str:
        return self.name


def rpcs(service: Any) -> list[Rpc]:
    """Every method of a service, from its descriptor (a new RPC is picked up without touching the tests)."""
    return [
        Rpc(service.full_name, m.name, message_class(m.input_type), m.client_streaming, m.server_streaming)
        for m in service.methods
    ]


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: int
    seconds: float
    cancelled_by_us: bool = False


def _ser(m: Message | bytes) -> bytes:
    return m if isinstance(m, bytes) else m.SerializeToString()


def call(
    chan: grpc.Channel,
    rpc: Rpc,
    requests: Sequence[Message | bytes],
    *,
    timeout_s: float,
    max_replies: int = 3,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> Outcome:
    """Send `requests` (one for a unary request, any number for a client stream; messages or raw bytes) and read
    at most `max_replies` replies of a server stream, then cancel it. Returns how the call ended."""
    started = time.monotonic()
    ident: Callable[[bytes], bytes] = bytes
    kw: dict[str, Any] = {"request_serializer": _ser, "response_deserializer": ident}
    md = list(metadata) if metadata is not None else None
    replies = 0
    mc: Any
    if not rpc.client_streaming:
        assert len(requests) == 1, f"{rpc} takes one request"
    try:
        if not rpc.server_streaming:
            if rpc.client_streaming:
                mc = chan.stream_unary(rpc.path, **kw)
                mc(iter(list(requests)), timeout=timeout_s, metadata=md)
            else:
                mc = chan.unary_unary(rpc.path, **kw)
                mc(requests[0], timeout=timeout_s, metadata=md)
            return Outcome(grpc.StatusCode.OK, "", 1, time.monotonic() - started)
        if rpc.client_streaming:
            mc = chan.stream_stream(rpc.path, **kw)
            stream = mc(iter(list(requests)), timeout=timeout_s, metadata=md)
        else:
            mc = chan.unary_stream(rpc.path, **kw)
            stream = mc(requests[0], timeout=timeout_s, metadata=md)
        for _ in stream:
            replies += 1
            if replies >= max_replies:
                stream.cancel()
                return Outcome(grpc.StatusCode.OK, "", replies, time.monotonic() - started, cancelled_by_us=True)
        return Outcome(stream.code(), stream.details() or "", replies, time.monotonic() - started)
    except grpc.RpcError as e:
        err: Any = e
        return Outcome(err.code(), err.details() or "", replies, time.monotonic() - started)
