"""The bounds table (`diloco.rpc.limits`) against the protos, and `check_request`, `quote`, `clip_details` as pure
functions.

Completeness: walking every request type of every `diloco.v1` service through the service descriptors, every
string, bytes, repeated, floating-point and signed integer field has an entry, and every entry names a field of a
request. Every entry is then exercised generically: a message holding the value at the bound is accepted, one just
past it is refused with `InvalidArgument`, a short message naming the field path, and no echo of the value."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.errors import InvalidArgument
from diloco.rpc.limits import (
    LIMITS,
    MAX_DEVICE_KIND_CHARS,
    MAX_TOKENS_PER_S,
    MAX_WORKER_NAME_CHARS,
    Bound,
    check_request,
    clip_details,
    limits_markdown,
    quote,
)
from diloco.v1 import common_pb2, coordinator_pb2, healthd_pb2, replication_pb2

pytestmark = pytest.mark.timeout(120)
pb = coordinator_pb2
MODULES: tuple[ModuleType, ...] = (common_pb2, coordinator_pb2, healthd_pb2, replication_pb2)
SHORT = 300  # every refusal's message is shorter than this
T = FieldDescriptor


def request_types() -> list[Descriptor]:
    """The input type of every method of every diloco.v1 service."""
    found = {}
    for mod in MODULES:
        for service in mod.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                found[method.input_type.full_name] = method.input_type
    return list(found.values())


def reachable(roots: list[Descriptor]) -> dict[str, Descriptor]:
    """Every message type a request can hold, the requests included."""
    seen: dict[str, Descriptor] = {}
    todo = list(roots)
    while todo:
        d = todo.pop()
        if d.full_name in seen:
            continue
        seen[d.full_name] = d
        todo.extend(f.message_type for f in d.fields if f.message_type is not None)
    return seen


REQUESTS = request_types()
MESSAGES = reachable(REQUESTS)
FIELDS = {f.full_name: f for d in MESSAGES.values() for f in d.fields}
SIGNED = {T.TYPE_INT32, T.TYPE_INT64, T.TYPE_SINT32, T.TYPE_SINT64, T.TYPE_SFIXED32, T.TYPE_SFIXED64}
FLOATS = {T.TYPE_FLOAT, T.TYPE_DOUBLE}


def needs_bound(f: FieldDescriptor) -> bool:
    return bool(f.is_repeated) or f.type in {T.TYPE_STRING, T.TYPE_BYTES} | FLOATS | SIGNED


# --- the table against the protos ---------------------------------------------------------------------------------


def test_the_services_are_found() -> None:
    names = {d.name for d in REQUESTS}
    assert {"RegisterRequest", "SubmitPseudoGradientRequest", "HeartbeatRequest", "EvictWorkerRequest"} <= names
    assert {"FollowLogRequest", "AckLogRequest"} <= names
    assert {"diloco.v1.SubmissionHeader", "diloco.v1.TensorSpec", "diloco.v1.Throughput"} <= set(MESSAGES)


def test_every_field_that_needs_a_bound_has_one() -> None:
    missing = sorted(name for name, f in FIELDS.items() if needs_bound(f) and name not in LIMITS)
    assert not missing, f"add a bound (and its reason) to diloco.rpc.limits.LIMITS for: {missing}"


def test_every_entry_names_a_request_field() -> None:
    unknown = sorted(set(LIMITS) - set(FIELDS))
    assert not unknown, f"LIMITS names fields no request holds: {unknown}"


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_each_entry_fits_its_field(name: str) -> None:
    """The bound's kind matches the field's type, and a checked entry says why and what to do."""
    f, b = FIELDS[name], LIMITS[name]
    assert b.reason
    if b.exempt:
        return
    assert b.advice
    if f.is_repeated:
        assert b.max_items is not None
    else:
        assert b.max_items is None
    if f.type in (T.TYPE_STRING, T.TYPE_BYTES):
        assert b.max_len is not None and b.lo is None and b.hi is None
    else:
        assert b.max_len is None
    if f.type in FLOATS:  # a claimed number: finite, from 0 to a stated physical bound
        assert b.lo is not None and b.hi is not None and math.isfinite(b.hi)
    if f.type in SIGNED and not f.is_repeated:
        assert b.lo is not None


def test_markdown_has_a_row_per_entry() -> None:
    md = limits_markdown()
    rows = md.splitlines()
    assert rows[0].startswith("| field | bound | why |") and len(rows) == 2 + len(LIMITS)
    assert "| `Throughput.device_kind` | ≤ 128 printable characters |" in md
    assert "| `Throughput.tokens_per_s` | finite, 0 ≤ x ≤ 1e9 |" in md
    assert "| `SubmitPseudoGradientRequest.data` | not checked here |" in md


def test_a_bound_that_refuses_the_default_is_refused() -> None:
    with pytest.raises(ValueError, match="default"):
        Bound("r", lo=1)


# --- every entry, at and past its bound --------------------------------------------------------------------------


def route(name: str) -> tuple[Descriptor, list[FieldDescriptor]]:
    """A request type and the chain of fields from it to field `name` (breadth first: the shortest)."""
    todo: list[tuple[Descriptor, Descriptor, list[FieldDescriptor]]] = [(d, d, []) for d in REQUESTS]
    while todo:
        root, d, chain = todo.pop(0)
        for f in d.fields:
            if f.full_name == name:
                return root, [*chain, f]
            if f.message_type is not None and len(chain) < 4:
                todo.append((root, f.message_type, [*chain, f]))
    raise AssertionError(f"no request reaches {name}")


def build(name: str, value: object) -> Message:
    """A request whose field `name` (reached through `route`) holds `value`; a list for a repeated field, or an int
    n for a repeated message field (n default elements)."""
    root, chain = route(name)
    msg = message_factory.GetMessageClass(root)()
    node: Message = msg
    for f in chain[:-1]:
        node = getattr(node, f.name).add() if f.is_repeated else getattr(node, f.name)
    last = chain[-1]
    if last.is_repeated and last.type == T.TYPE_MESSAGE:
        assert isinstance(value, int)
        field = getattr(node, last.name)
        for _ in range(value):
            field.add()
    elif last.is_repeated:
        getattr(node, last.name).extend(value)
    else:
        setattr(node, last.name, value)
    return msg


def path_of(name: str) -> str:
    root, chain = route(name)
    return ".".join([root.name] + [f"{f.name}[0]" if f.is_repeated else f.name for f in chain[:-1]] + [chain[-1].name])


def edge_cases(name: str) -> Iterator[tuple[object, object]]:
    """(accepted, refused) value pairs at the bound of entry `name`."""
    f, b = FIELDS[name], LIMITS[name]
    if b.max_items is not None:
        if f.type == T.TYPE_MESSAGE:
            yield b.max_items, b.max_items + 1
        else:
            yield [0] * b.max_items, [0] * (b.max_items + 1)
    if b.max_len is not None:
        if f.type == T.TYPE_STRING:
            yield "a" * b.max_len, "a" * (b.max_len + 1)
        else:
            yield b"a" * b.max_len, b"a" * (b.max_len + 1)
    if b.lo is not None or b.hi is not None:
        as_int = f.type not in FLOATS
        for edge, past in ((b.lo, -1), (b.hi, +1)):
            if edge is None:
                continue
            beyond = int(edge) + past if as_int else math.nextafter(edge, past * math.inf)
            inside = int(edge) if as_int else edge
            yield ([inside], [beyond]) if f.is_repeated else (inside, beyond)


CHECKED = sorted(n for n, b in LIMITS.items() if not b.exempt)


@pytest.mark.parametrize("name", CHECKED)
def test_each_bound_accepts_its_edge_and_refuses_past_it(name: str) -> None:
    cases = list(edge_cases(name))
    assert cases, f"{name} has no bound to test"
    for ok, bad in cases:
        check_request(build(name, ok))
        with pytest.raises(InvalidArgument) as e:
            check_request(build(name, bad))
        msg = str(e.value)
        assert msg.startswith(path_of(name)), msg
        assert len(msg) < SHORT and ("the limit is" in msg or "it must be" in msg)
        assert "aaaaaaaaaa" not in msg  # the oversized value is not echoed


@pytest.mark.parametrize("name", sorted(n for n, b in LIMITS.items() if b.max_len is not None and b.printable))
def test_each_text_bound_refuses_control_characters(name: str) -> None:
    with pytest.raises(InvalidArgument, match=r"non-printable character '\\x1b' at index 3") as e:
        check_request(build(name, "abc\x1b[2Jdef"))
    assert "[2J" not in str(e.value)


# --- check_request: the examples of the issue --------------------------------------------------------------------


def register(**throughput: Any) -> coordinator_pb2.RegisterRequest:
    return pb.RegisterRequest(
        worker_name="learner-a", model_fingerprint="0123456789abcdef", throughput=common_pb2.Throughput(**throughput)
    )


def test_a_typical_registration_and_upload_pass() -> None:
    check_request(register(tokens_per_s=12_345.6, step_time_s=0.25, device_kind="cuda:NVIDIA H100 80GB HBM3"))
    header = pb.SubmissionHeader(
        worker_id="learner-a-1",
        submission_id="learner-a-1-v3",
        ranges=[common_pb2.ShardRange(shard_id=i, epoch=1, start=0, end=100) for i in range(4)],
        payload=common_pb2.PayloadSpec(
            tensors=[common_pb2.TensorSpec(name=f"blocks.{i}.w", shape=[8, 8], dtype="float32") for i in range(4)],
            numel=256,
            encoded_bytes=1024,
        ),
    )
    check_request(pb.SubmitPseudoGradientRequest(header=header))
    check_request(pb.SubmitPseudoGradientRequest(data=b"\xff" * (1 << 20)))  # payload bytes are exempt
    check_request(healthd_pb2.HeartbeatRequest(node_id="learner-a-1", throughput=common_pb2.Throughput()))


def test_a_megabyte_device_kind_is_refused_without_an_echo() -> None:
    with pytest.raises(InvalidArgument) as e:
        check_request(register(device_kind="x" * (1 << 20)))
    assert str(e.value) == (
        "RegisterRequest.throughput.device_kind is 1,048,576 characters; the limit is 128: send a short device name"
    )


@pytest.mark.parametrize("claim", [math.nan, math.inf, -math.inf, 1e308, -1.0, MAX_TOKENS_PER_S * 2])
def test_impossible_throughput_claims_are_refused(claim: float) -> None:
    with pytest.raises(InvalidArgument, match=r"^RegisterRequest\.throughput\.tokens_per_s is .*up to 1e9") as e:
        check_request(register(tokens_per_s=claim))
    assert len(str(e.value)) < SHORT
    with pytest.raises(InvalidArgument, match=r"^HeartbeatRequest\.throughput\.step_time_s is "):
        check_request(healthd_pb2.HeartbeatRequest(node_id="n", throughput=common_pb2.Throughput(step_time_s=claim)))


def test_the_path_names_the_element_of_a_repeated_message() -> None:
    spec = common_pb2.PayloadSpec(tensors=[common_pb2.TensorSpec(name="a", shape=[2]) for _ in range(5)])
    spec.tensors[3].shape.append(-7)
    with pytest.raises(InvalidArgument) as e:
        check_request(pb.SubmitPseudoGradientRequest(header=pb.SubmissionHeader(payload=spec)))
    assert str(e.value) == (
        "SubmitPseudoGradientRequest.header.payload.tensors[3].shape[1] is -7; it must be >= 0: send the tensor's shape"
    )


def test_negative_counts_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"header\.resume_offset is -1; it must be >= 0"):
        check_request(pb.SubmitPseudoGradientRequest(header=pb.SubmissionHeader(resume_offset=-1)))
    with pytest.raises(InvalidArgument, match=r"header\.payload\.numel is -5; it must be >= 0"):
        check_request(pb.SubmitPseudoGradientRequest(header=pb.SubmissionHeader(payload={"numel": -5})))


def test_a_message_outside_the_services_passes_unchecked() -> None:
    check_request(pb.ListWorkersResponse(workers=[pb.WorkerInfo(worker_name="x" * 10_000)]))


@settings(max_examples=300, deadline=None)
@given(name=st.text(max_size=400))
def test_any_worker_name_is_accepted_exactly_when_within_its_bound(name: str) -> None:
    req = pb.RegisterRequest(worker_name=name)
    within = len(name) <= MAX_WORKER_NAME_CHARS and name.isprintable()
    try:
        check_request(req)
    except InvalidArgument as e:
        msg = str(e)
        assert not within
        assert msg.startswith("RegisterRequest.worker_name ") and len(msg) < SHORT and msg.isprintable()
        assert len(name) < 2 or name not in msg
    else:
        assert within


@settings(max_examples=300, deadline=None)
@given(claim=st.floats(), kind=st.text(max_size=2 * MAX_DEVICE_KIND_CHARS))
def test_any_throughput_is_accepted_exactly_when_within_its_bound(claim: float, kind: str) -> None:
    req = register(tokens_per_s=claim, device_kind=kind)
    within = 0 <= claim <= MAX_TOKENS_PER_S and len(kind) <= MAX_DEVICE_KIND_CHARS and kind.isprintable()
    try:
        check_request(req)
    except InvalidArgument as e:
        assert not within and len(str(e)) < SHORT and str(e).isprintable()
    else:
        assert within


# --- quote and clip_details --------------------------------------------------------------------------------------


def test_quote_examples() -> None:
    assert quote("abc") == "'abc'"
    assert quote("") == "''"
    assert quote("x" * (1 << 20)) == "'" + "x" * 48 + "…' (1048576 chars)"
    assert quote("a'b\\c\nd\x00e\u200bf\U0001f600é") == "'a\\'b\\\\c\\nd\\x00e\\u200bf\U0001f600é'"
    assert quote(b"\x00ab'") == "b'\\x00ab\\''"
    assert quote(b"\xff" * 100, limit=8) == "b'\\xff\\xff…' (100 bytes)"
    assert quote("abcdef", limit=3) == "'abc…' (6 chars)"


@settings(max_examples=500, deadline=None)
@given(value=st.one_of(st.text(), st.binary()), limit=st.integers(min_value=0, max_value=100))
def test_quote_is_short_and_printable(value: str | bytes, limit: int) -> None:
    q = quote(value, limit)
    assert q.isprintable()
    assert len(q) <= limit + len(f"b''… ({len(value)} chars)")


@settings(max_examples=200, deadline=None)
@given(value=st.text(min_size=1, max_size=40))
def test_quote_keeps_a_short_printable_value_as_it_is(value: str) -> None:
    if value.isprintable() and "'" not in value and "\\" not in value:
        assert quote(value) == f"'{value}'"


def test_clip_details() -> None:
    assert clip_details("short") == "short"
    assert clip_details("y" * 512) == "y" * 512
    clipped = clip_details("y" * 100_000)
    assert len(clipped) == 512 and clipped.endswith("… (100,000 characters in all)")
    assert len(clip_details("z" * 1000, limit=100)) == 100
