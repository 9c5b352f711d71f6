"""One table per vocabulary: the domain's names and the proto enum values that carry them.

Every translation between a mode, codec, node state or worker state and its enum goes through a `Vocabulary`
here, in both directions. An unknown value is an error (`InvalidArgument`), never a silent default: a peer that
sends an enum value this build does not know must be told, not misread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import Enum
from typing import Generic, TypeVar

from diloco.core.energy import PowerSource
from diloco.core.failure import NodeState, Throughput
from diloco.core.states import WorkerState
from diloco.errors import InvalidArgument
from diloco.rpc.limits import MAX_WATTS
from diloco.v1 import common_pb2, coordinator_pb2, healthd_pb2

K = TypeVar("K")
V = TypeVar("V", bound=int)  # the proto enum's type (`coordinator_pb2.RoundMode`, ...)


class Vocabulary(Generic[K, V]):
    """A one-to-one table between domain values `K` and proto enum values `V`."""

    def __init__(self, what: str, table: Mapping[K, V]) -> None:
        if len(set(table.values())) != len(table):
            raise ValueError(f"{what}: two names share one enum value")
        self.what = what
        self._to_proto = dict(table)
        self._from_proto: dict[int, K] = {v: k for k, v in table.items()}

    @property
    def names(self) -> tuple[K, ...]:
        return tuple(self._to_proto)

    def to_proto(self, name: K) -> V:
        try:
            return self._to_proto[name]
        except KeyError:
            raise InvalidArgument(f"unknown {self.what} {name!r}; use one of {self._choices()}") from None

    def from_proto(self, value: int) -> K:
        try:
            return self._from_proto[value]
        except KeyError:
            raise InvalidArgument(
                f"unknown {self.what} enum value {value}; use one of {self._choices()} (is the peer newer?)"
            ) from None

    def _choices(self) -> str:
        return ", ".join(str(k.value if isinstance(k, Enum) else k) for k in self._to_proto)


MODES: Vocabulary[str, coordinator_pb2.RoundMode] = Vocabulary(
    "round mode",
    {
        "sync": coordinator_pb2.ROUND_MODE_SYNC,
        "decoupled": coordinator_pb2.ROUND_MODE_DECOUPLED,
        "async": coordinator_pb2.ROUND_MODE_ASYNC,
    },
)

CODECS: Vocabulary[str, common_pb2.Codec] = Vocabulary(
    "codec",
    {
        "fp32": common_pb2.CODEC_FP32,
        "bf16": common_pb2.CODEC_BF16,
        "int8": common_pb2.CODEC_INT8,
        "int4": common_pb2.CODEC_INT4,
        "topk": common_pb2.CODEC_TOPK,
        "sparse": common_pb2.CODEC_SPARSE,
    },
)

NODE_STATES: Vocabulary[NodeState, healthd_pb2.NodeState] = Vocabulary(
    "node state",
    {
        NodeState.ALIVE: healthd_pb2.NODE_STATE_ALIVE,
        NodeState.SUSPECT: healthd_pb2.NODE_STATE_SUSPECT,
        NodeState.DEAD: healthd_pb2.NODE_STATE_DEAD,
        NodeState.LEFT: healthd_pb2.NODE_STATE_LEFT,
    },
)

WORKER_STATES: Vocabulary[WorkerState, common_pb2.WorkerState] = Vocabulary(
    "worker state",
    {
        WorkerState.ACTIVE: common_pb2.WORKER_STATE_ACTIVE,
        WorkerState.DRAINING: common_pb2.WORKER_STATE_DRAINING,
        WorkerState.DEAD: common_pb2.WORKER_STATE_DEAD,
        WorkerState.EVICTED: common_pb2.WORKER_STATE_EVICTED,
        WorkerState.LEFT: common_pb2.WORKER_STATE_LEFT,
        WorkerState.QUARANTINED: common_pb2.WORKER_STATE_QUARANTINED,
    },
)

POWER_SOURCES: Vocabulary[PowerSource, common_pb2.PowerSource] = Vocabulary(
    "power source",
    {
        PowerSource.NVML: common_pb2.POWER_SOURCE_NVML,
        PowerSource.RAPL: common_pb2.POWER_SOURCE_RAPL,
        PowerSource.DECLARED: common_pb2.POWER_SOURCE_DECLARED,
    },
)


def power_from_proto(tp: common_pb2.Throughput) -> tuple[float, PowerSource | None]:
    """A Throughput's power as (watts, source); (0.0, None) when it reports none (watts 0). Watts above 0 need a
    source; an unknown source is refused like any unknown enum value, and so are watts outside [0, MAX_WATTS]
    (the limits table refuses them at the boundary too)."""
    source = (
        None if tp.power_source == common_pb2.POWER_SOURCE_UNSPECIFIED else POWER_SOURCES.from_proto(tp.power_source)
    )
    watts = tp.watts
    if not (math.isfinite(watts) and 0 <= watts <= MAX_WATTS):
        raise InvalidArgument(
            f"throughput.watts is {watts}; it must be a finite number from 0 up to {MAX_WATTS:g}: send the measured "
            "or declared watts, or 0 when there is none"
        )
    if watts == 0:
        return 0.0, None
    if source is None:
        raise InvalidArgument(
            "throughput.power_source is required when throughput.watts is above 0: send POWER_SOURCE_NVML, "
            "POWER_SOURCE_RAPL or POWER_SOURCE_DECLARED"
        )
    return watts, source


def power_to_proto(source: PowerSource | None) -> common_pb2.PowerSource:
    return common_pb2.POWER_SOURCE_UNSPECIFIED if source is None else POWER_SOURCES.to_proto(source)


def throughput_to_proto(tp: Throughput) -> common_pb2.Throughput:
    return common_pb2.Throughput(
        tokens_per_s=tp.tokens_per_s,
        step_time_s=tp.step_time_s,
        device_kind=tp.device_kind,
        watts=tp.watts,
        power_source=power_to_proto(tp.power_source),
    )
