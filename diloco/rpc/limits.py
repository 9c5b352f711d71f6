"""Bounds on every request field, checked at the boundary, and short, escaped echoes of caller input.

`LIMITS` is the one table: for every string, bytes and repeated field, every floating-point field and every signed
integer field of every request message of the `diloco.v1` services (the input type of each method of `Coordinator`,
`HealthDaemon` and `Replication`, and every message nested in one), keyed by the field's full protobuf name
(`diloco.v1.Throughput.device_kind`), the bound and the one-line reason for it. The table is the documentation:
`limits_markdown()` renders it for the README, and a test walks the service descriptors so that a new field
without a bound, or an entry naming a field that does not exist, fails CI.

`check_request(msg)` applies the table to one request message (a unary request or each message of a stream), walking
nested and repeated messages through their descriptors; there is no per-message code. It is cheap enough for every
upload chunk: a `bytes` payload field is exempt (gRPC's message size limit bounds it) and never read, and the
walk is compiled once per message type into the few fields that carry a check. A refusal is `InvalidArgument`
naming the field path, the size or value, the limit and what to do; it never echoes a string's content beyond
one escaped character.

`quote(value)` is the short, escaped prefix to put in any error message or log line that mentions caller input;
`clip_details(message)` caps a status detail string whatever produced it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from math import isfinite
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from diloco.errors import InvalidArgument

MAX_ID_CHARS = 256  # worker, node and submission ids (the coordinator's `_MAX_ID`, healthd's MAX_NODE_ID_CHARS)
MAX_WORKER_NAME_CHARS = 128  # the worker id is "<name>-<incarnation>" and must stay within MAX_ID_CHARS
MAX_DEVICE_KIND_CHARS = 128
MAX_FINGERPRINT_CHARS = 64  # a task fingerprint 'm=<12 hex>.t=<12 hex>.d=<12 hex>' is 44 characters
MAX_REASON_CHARS = 1024
MAX_TENSOR_NAME_CHARS = 512
MAX_DTYPE_CHARS = 32
MAX_TENSORS = 10_000  # Llama-2-70B has 723 parameter tensors
MAX_DIMS = 64  # torch's own limit on tensor dimensions
MAX_RANGES = 100_000
MAX_REPORTS = 10_000  # throughput reports in one ReportThroughput call (healthd batches; see its reporter)
MAX_TOKENS_PER_S = 1e9  # per learner
MAX_STEP_TIME_S = 86_400.0
MAX_UNIX_S = 1e10  # the year 2286
MAX_WATTS = 100_000.0  # per learner: a rack of 8 GPUs draws ~10 kW; 100 kW is not one learner
MAX_PRICE_PER_HOUR = 10_000.0  # per learner: an 8-GPU node rents for ~100 per hour on demand
MAX_ZONE_CHARS = 64  # a grid zone name such as 'DE' or 'US-CAL-CISO'
MAX_ADDRESS_CHARS = 260  # HOST:PORT: a DNS name is at most 253 characters

QUOTE_CHARS = 48
DETAILS_CHARS = 512


@dataclass(frozen=True)
class Bound:
    """The bound on one field. For a repeated field, `max_items` bounds its length and the other limits apply to
    each element. `max_len` counts characters of a string or bytes of a bytes value; `printable` refuses control
    and other non-printable characters (`str.isprintable`); `lo`/`hi` bound a number (inclusive; NaN and infinities
    are always refused). `exempt` fields are not checked here, for the stated reason."""

    reason: str
    advice: str = ""
    max_len: int | None = None
    max_items: int | None = None
    printable: bool = True
    lo: float | None = None
    hi: float | None = None
    exempt: bool = False

    def __post_init__(self) -> None:
        # proto3 cannot tell an unset number from 0, nor an unset string from "": the default must pass
        if (self.lo is not None and self.lo > 0) or (self.hi is not None and self.hi < 0):
            raise ValueError("a bound must admit the field's default (0); check presence where the value is used")

    def describe(self) -> str:
        """The bound in a few words, for the README table."""
        if self.exempt:
            return "not checked here"
        parts = []
        if self.max_items is not None:
            parts.append(f"≤ {self.max_items:,} entries")
        if self.max_len is not None:
            parts.append(f"≤ {self.max_len:,} {'printable ' if self.printable else ''}characters")
        if self.lo is not None or self.hi is not None:
            lo = "" if self.lo is None else f"{_num(self.lo)} ≤ "
            hi = "" if self.hi is None else f" ≤ {_num(self.hi)}"
            parts.append(f"{lo}x{hi}" if self.hi is None else f"finite, {lo}x{hi}")
        return "; ".join(parts)


def _text(max_len: int, reason: str, advice: str) -> Bound:
    return Bound(reason, advice, max_len=max_len)


def _count(lo: float, reason: str, advice: str = "send a count >= 0") -> Bound:
    return Bound(reason, advice, lo=lo)


_P = "diloco.v1."
_ID_ADVICE = "send the id the coordinator assigned"
_REASON = Bound(
    "free text kept in logs and listings; a sentence or two", "send a shorter reason", max_len=MAX_REASON_CHARS
)
_WORKER_ID = _text(MAX_ID_CHARS, "the coordinator assigns '<worker_name>-<n>', well within 256", _ID_ADVICE)
_REPLICA_ID = _text(
    MAX_ID_CHARS,
    "a standby coordinator's name (--replica-id), kept per follower and logged",
    "use a shorter --replica-id",
)
_UNIX_S = Bound(
    "a time in unix seconds (0 when unknown); above 1e10 (year 2286) it is not a clock reading",
    "send a unix time in seconds, or 0",
    lo=0.0,
    hi=MAX_UNIX_S,
)

LIMITS: Mapping[str, Bound] = {
    # --- Coordinator: learners ------------------------------------------------------------------------------------
    _P + "RegisterRequest.worker_name": _text(
        MAX_WORKER_NAME_CHARS,
        "a hostname or container name; the worker id '<name>-<n>' must fit in 256",
        "use a short name (--name)",
    ),
    _P + "RegisterRequest.model_fingerprint": _text(
        MAX_FINGERPRINT_CHARS,
        "the task fingerprint 'm=<hex>.t=<hex>.d=<hex>' (44 characters, diloco/task/factory.py)",
        "send the task's fingerprint, or leave it empty",
    ),
    _P + "Throughput.device_kind": _text(
        MAX_DEVICE_KIND_CHARS,
        "a device name such as 'cuda:NVIDIA H100 80GB HBM3'; kept per learner and listed by ListWorkers",
        "send a short device name",
    ),
    _P + "Throughput.tokens_per_s": Bound(
        "a claim, used for placement; 1e9 tokens/s is far above any one learner today (an H100 trains ~1e5 tokens/s "
        "on a 1B model)",
        "send the measured tokens per second, or 0 when not measured yet",
        lo=0.0,
        hi=MAX_TOKENS_PER_S,
    ),
    _P + "Throughput.step_time_s": Bound(
        "a claim; an inner step longer than a day is not training",
        "send the measured seconds per inner step, or 0 when not measured yet",
        lo=0.0,
        hi=MAX_STEP_TIME_S,
    ),
    _P + "Throughput.watts": Bound(
        "power drawn while training, for energy-aware placement and accounting; 100 kW is no one learner (an "
        "8-GPU node draws about 10 kW)",
        "send the measured or declared watts (with power_source), or 0 when there is none",
        lo=0.0,
        hi=MAX_WATTS,
    ),
    _P + "RegisterRequest.zone": _text(
        MAX_ZONE_CHARS,
        "a grid zone name such as 'DE' or 'US-CAL-CISO', looked up in the coordinator's carbon trace",
        "send the zone as the coordinator's --carbon-trace names it (--zone), or leave it empty",
    ),
    _P + "RegisterRequest.price_per_hour": Bound(
        "a learner's price per hour, for cost-aware placement and accounting; an 8-GPU node rents for about 100",
        "send the learner's price per hour (--price-per-hour), or 0",
        lo=0.0,
        hi=MAX_PRICE_PER_HOUR,
    ),
    _P + "WatchParametersRequest.worker_id": _text(
        MAX_ID_CHARS, "a worker id (see RegisterResponse.worker_id), or empty for an observer", _ID_ADVICE
    ),
    _P + "SubmitPseudoGradientRequest.data": Bound(
        "payload bytes, never scanned; gRPC's message size limit (diloco.rpc.server.MAX_MESSAGE_BYTES) and the "
        "coordinator's upload size limit bound them",
        exempt=True,
    ),
    _P + "SubmissionHeader.worker_id": _WORKER_ID,
    _P + "SubmissionHeader.submission_id": _text(
        MAX_ID_CHARS, "chosen by the learner, unique per pseudo-gradient; kept in the ledger", "send a shorter id"
    ),
    _P + "SubmissionHeader.ranges": Bound(
        "token ranges trained this round, one or a few per shard held; far fewer than 100,000",
        "submit fewer ranges (merge adjacent ones)",
        max_items=MAX_RANGES,
    ),
    _P + "SubmissionHeader.resume_offset": _count(0, "a byte offset", "send the offset GetUploadStatus reported"),
    _P + "SubmissionHeader.fragment_layout": _text(
        MAX_FINGERPRINT_CHARS,
        "the fragment layout's fingerprint (16 hex characters, FragmentLayout.fingerprint; empty without fragments)",
        "send the layout fingerprint Register returned, or leave it empty",
    ),
    _P + "PayloadSpec.tensors": Bound(
        "one entry per parameter tensor; Llama-2-70B has 723, so 10,000 is ample",
        "describe the parameters as the coordinator does (ParametersHeader.payload)",
        max_items=MAX_TENSORS,
    ),
    _P + "PayloadSpec.numel": _count(0, "an element count"),
    _P + "PayloadSpec.encoded_bytes": _count(0, "a byte count"),
    _P + "PayloadSpec.topk_count": _count(0, "a record count"),
    _P + "TensorSpec.name": _text(
        MAX_TENSOR_NAME_CHARS, "a dotted module path such as 'blocks.0.attn.qkv.weight'", "send the parameter's name"
    ),
    _P + "TensorSpec.dtype": _text(MAX_DTYPE_CHARS, "a dtype name such as 'float32'", "send 'float32'"),
    _P + "TensorSpec.shape": Bound(
        "dimensions of one tensor; torch allows at most 64",
        "send the tensor's shape",
        max_items=MAX_DIMS,
        lo=0,
    ),
    _P + "TensorSpec.offset": _count(0, "an element offset"),
    _P + "GetUploadStatusRequest.worker_id": _WORKER_ID,
    _P + "GetUploadStatusRequest.submission_id": _text(
        MAX_ID_CHARS, "as SubmissionHeader.submission_id", "send the id of the upload to resume"
    ),
    _P + "GetWorkPlanRequest.worker_id": _WORKER_ID,
    _P + "DeregisterRequest.worker_id": _WORKER_ID,
    _P + "DeregisterRequest.reason": _REASON,
    # --- Coordinator: healthd -------------------------------------------------------------------------------------
    _P + "ReportNodeFailureRequest.worker_id": _WORKER_ID,
    _P + "ReportNodeFailureRequest.reason": _REASON,
    _P + "ReportNodeFailureRequest.last_seen_unix_s": _UNIX_S,
    _P + "ReportNodeFailureRequest.declared_dead_unix_s": _UNIX_S,
    _P + "ReportThroughputRequest.worker_id": _WORKER_ID,
    _P + "ReportThroughputRequest.reports": Bound(
        "healthd's batch: one report per learner it heard since its last call",
        "send at most 10,000 reports per call",
        max_items=MAX_REPORTS,
    ),
    _P + "ThroughputReport.worker_id": _WORKER_ID,
    # --- Coordinator: operators -----------------------------------------------------------------------------------
    _P + "DrainWorkerRequest.worker_id": _WORKER_ID,
    _P + "EvictWorkerRequest.worker_id": _WORKER_ID,
    _P + "EvictWorkerRequest.reason": _REASON,
    _P + "ReleaseWorkerRequest.worker_id": _WORKER_ID,
    _P + "StepDownRequest.reason": _REASON,
    # --- HealthDaemon ---------------------------------------------------------------------------------------------
    _P + "HeartbeatRequest.node_id": _text(
        MAX_ID_CHARS, "the worker id the coordinator assigned (healthd's MAX_NODE_ID_CHARS)", _ID_ADVICE
    ),
    _P + "AnnounceLeaderRequest.address": _text(
        MAX_ADDRESS_CHARS,
        "the new leader's HOST:PORT, passed on to every learner (a DNS name is at most 253 characters)",
        "send the address learners reach the replica at (its --host and --port)",
    ),
    # --- Replication (standby coordinators) -----------------------------------------------------------------------
    _P + "FollowLogRequest.replica_id": _REPLICA_ID,
    _P + "FollowLogRequest.fingerprint": _text(
        MAX_FINGERPRINT_CHARS,
        "the standby's task fingerprint 'm=<hex>.t=<hex>.d=<hex>' (44 characters, diloco/task/factory.py)",
        "send the fingerprint of the task the standby built",
    ),
    _P + "AckLogRequest.replica_id": _REPLICA_ID,
}


def _num(x: float) -> str:
    """1,024 or 0.25 or 1e9."""
    if isinstance(x, int) or (x.is_integer() and abs(x) < 1e6):
        return f"{int(x):,}"
    return f"{x:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


# --- the compiled walk ------------------------------------------------------------------------------------------

_TEXT, _BYTES, _INT, _FLOAT, _MESSAGE = range(5)
_SIGNED = frozenset(
    {
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64,
    }
)
_UNSIGNED = frozenset(
    {
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_FIXED32,
        FieldDescriptor.TYPE_FIXED64,
    }
)
_FLOATS = frozenset({FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT})


# One entry per checked field: (name, kind, repeated, nested plan, bound, max_items, max_len, printable, lo, hi),
# the bound's limits unpacked with "no limit" as maxsize or an infinity, so the walk does plain comparisons.
_Check = tuple[str, int, bool, "tuple[_Check, ...]", "Bound | None", int, int, bool, float, float]
_PLANS: dict[str, tuple[_Check, ...]] = {}


def _plan(desc: Descriptor) -> tuple[_Check, ...]:
    """The checks for a message type: only the fields with a bound or with checks inside. Compiled once per type."""
    plan = _PLANS.get(desc.full_name)
    if plan is None:
        plan = _compile(desc, frozenset())
        _PLANS[desc.full_name] = plan
    return plan


def _compile(desc: Descriptor, seen: frozenset[str]) -> tuple[_Check, ...]:
    checks: list[_Check] = []
    for f in desc.fields:
        b = LIMITS.get(f.full_name)
        if b is not None and b.exempt:
            continue
        nested: tuple[_Check, ...] = ()
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            kind = _MESSAGE
            sub = f.message_type
            assert sub is not None
            if sub.full_name not in seen:  # a recursive type is checked down to its first repetition
                nested = _compile(sub, seen | {desc.full_name})
        elif f.type == FieldDescriptor.TYPE_STRING:
            kind = _TEXT
        elif f.type == FieldDescriptor.TYPE_BYTES:
            kind = _BYTES
        elif f.type in _SIGNED or f.type in _UNSIGNED:
            kind = _INT
        elif f.type in _FLOATS:
            kind = _FLOAT
        else:  # bool and enum: nothing to bound here (enums are checked where they are translated, diloco.rpc.vocab)
            continue
        if b is None and not nested:
            continue
        checks.append(
            (
                f.name,
                kind,
                bool(f.is_repeated),
                nested,
                b,
                sys.maxsize if b is None or b.max_items is None else b.max_items,
                sys.maxsize if b is None or b.max_len is None else b.max_len,
                b is not None and b.printable and kind == _TEXT,
                -math.inf if b is None or b.lo is None else b.lo,
                math.inf if b is None or b.hi is None else b.hi,
            )
        )
    return tuple(checks)


class _Refusal(Exception):
    """Raised inside the walk; each level prefixes its field to `path` on the way out (no cost when all is well)."""

    def __init__(self, path: str, what: str, bound: Bound) -> None:
        self.path, self.what, self.bound = path, what, bound


def check_request(msg: Message) -> None:
    """Check every bounded field of a request message (recursively); raise `InvalidArgument` at the first field
    out of its bound. Bytes payloads are not read; a string is measured before it is scanned."""
    desc: Any = msg.DESCRIPTOR
    try:
        _walk(msg, _plan(desc))
    except _Refusal as r:
        what = f"{desc.name}.{r.path} {r.what}"
        raise InvalidArgument(f"{what}: {r.bound.advice}" if r.bound.advice else what) from None


def _walk(msg: Any, plan: tuple[_Check, ...]) -> None:
    for name, kind, repeated, nested, b, max_items, max_len, printable, lo, hi in plan:
        if repeated:
            values = getattr(msg, name)
            if not values:
                continue
            if b is not None:
                if len(values) > max_items:
                    raise _Refusal(name, f"has {len(values):,} entries; the limit is {max_items:,}", b)
                if kind != _MESSAGE and not _all_within(kind, values, b):
                    i, what = next((i, w) for i, v in enumerate(values) if (w := _problem(kind, v, b)))
                    raise _Refusal(f"{name}[{i}]", what, b)
            if nested:
                i = 0
                try:
                    for i, v in enumerate(values):  # noqa: B007 (i names the element on the way out)
                        _walk(v, nested)
                except _Refusal as r:
                    r.path = f"{name}[{i}].{r.path}"
                    raise
        elif kind == _MESSAGE:
            if msg.HasField(name):
                try:
                    _walk(getattr(msg, name), nested)
                except _Refusal as r:
                    r.path = f"{name}.{r.path}"
                    raise
        elif b is not None:
            v = getattr(msg, name)
            if not v:  # a default ("", b"", 0) is within every bound
                continue
            if kind in (_TEXT, _BYTES):
                if len(v) > max_len or (printable and not v.isprintable()):
                    raise _Refusal(name, _problem(kind, v, b), b)
            elif not lo <= v <= hi or (kind == _FLOAT and not isfinite(v)):  # NaN fails the comparison
                raise _Refusal(name, _problem(kind, v, b), b)


def _within(kind: int, v: Any, b: Bound) -> bool:
    if kind == _TEXT:
        return (b.max_len is None or len(v) <= b.max_len) and (not b.printable or v.isprintable())
    if kind == _BYTES:
        return b.max_len is None or len(v) <= b.max_len
    if kind == _FLOAT and not isfinite(v):
        return False
    return (b.lo is None or v >= b.lo) and (b.hi is None or v <= b.hi)


def _all_within(kind: int, values: Any, b: Bound) -> bool:
    if kind in (_INT, _FLOAT):  # min and max run in C; a NaN fails isfinite
        return (
            (kind == _INT or all(map(isfinite, values)))
            and (b.lo is None or min(values) >= b.lo)
            and (b.hi is None or max(values) <= b.hi)
        )
    return all(_within(kind, v, b) for v in values)


def _problem(kind: int, v: Any, b: Bound) -> str:
    """What is wrong with `v` (never its content beyond one escaped character); "" when nothing is."""
    if _within(kind, v, b):
        return ""
    if kind in (_INT, _FLOAT):
        shown = _num(v) if isfinite(v) else str(v)
        if b.hi is None:
            return f"is {shown}; it must be >= {_num(b.lo or 0)}"
        lo = "" if b.lo is None else f" from {_num(b.lo)}"
        return f"is {shown}; it must be a finite number{lo} up to {_num(b.hi)}"
    if b.max_len is not None and len(v) > b.max_len:
        return f"is {len(v):,} {'characters' if kind == _TEXT else 'bytes'}; the limit is {b.max_len:,}"
    i = next(i for i, ch in enumerate(v) if not ch.isprintable())
    return f"has a non-printable character {quote(v[i])} at index {i}; only printable text is allowed"


# --- echoes of caller input -------------------------------------------------------------------------------------


def quote(value: str | bytes, limit: int = QUOTE_CHARS) -> str:
    """A short, escaped, printable rendering of caller input for error messages and logs: at most `limit`
    characters of escaped content in quotes, then '…' and the full length when it was cut, e.g.
    `'abcabc…' (1048576 chars)`. Non-printable characters, quotes and backslashes are escaped."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        is_bytes, pieces = True, [_escape_byte(x) for x in bytes(value[: limit + 1])]
    else:
        if not isinstance(value, str):  # be forgiving in error paths
            value = str(value)
        is_bytes, pieces = False, [_escape_char(ch) for ch in value[: limit + 1]]
    out: list[str] = []
    used = 0
    for p in pieces:
        if used + len(p) > limit:
            break
        out.append(p)
        used += len(p)
    prefix = "b'" if is_bytes else "'"
    body = "".join(out)
    if len(out) == len(value):
        return f"{prefix}{body}'"
    return f"{prefix}{body}…' ({len(value)} {'bytes' if is_bytes else 'chars'})"


_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    if ch.isprintable():
        return ch
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def _escape_byte(x: int) -> str:
    ch = chr(x)
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    return ch if 0x20 <= x < 0x7F else f"\\x{x:02x}"


def clip_details(message: str, limit: int = DETAILS_CHARS) -> str:
    """Cap a status detail string at `limit` characters (a default gRPC client cannot read huge trailers); a
    clipped message ends with '…' and the length of the whole."""
    if len(message) <= limit:
        return message
    tail = f"… ({len(message):,} characters in all)"
    return message[: max(0, limit - len(tail))] + tail


def limits_markdown() -> str:
    """The table as Markdown, for the README: field, bound, reason."""
    rows = ["| field | bound | why |", "| --- | --- | --- |"]
    for name, b in LIMITS.items():
        short = name.removeprefix(_P)
        rows.append(f"| `{short}` | {b.describe()} | {b.reason} |")
    return "\n".join(rows) + "\n"
