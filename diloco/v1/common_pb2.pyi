from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_SPARSE: _ClassVar[Codec]

class PowerSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POWER_SOURCE_UNSPECIFIED: _ClassVar[PowerSource]
    POWER_SOURCE_NVML: _ClassVar[PowerSource]
    POWER_SOURCE_RAPL: _ClassVar[PowerSource]
    POWER_SOURCE_DECLARED: _ClassVar[PowerSource]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_ACTIVE: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DEAD: _ClassVar[WorkerState]
    WORKER_STATE_EVICTED: _ClassVar[WorkerState]
    WORKER_STATE_LEFT: _ClassVar[WorkerState]
    WORKER_STATE_QUARANTINED: _ClassVar[WorkerState]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_TOPK: Codec
CODEC_SPARSE: Codec
POWER_SOURCE_UNSPECIFIED: PowerSource
POWER_SOURCE_NVML: PowerSource
POWER_SOURCE_RAPL: PowerSource
POWER_SOURCE_DECLARED: PowerSource
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_ACTIVE: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_DEAD: WorkerState
WORKER_STATE_EVICTED: WorkerState
WORKER_STATE_LEFT: WorkerState
WORKER_STATE_QUARANTINED: WorkerState

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class PayloadSpec(_message.Message):
    __slots__ = ("tensors", "codec", "numel", "encoded_bytes", "crc32", "block_size", "topk_count")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOPK_COUNT_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    codec: Codec
    numel: int
    encoded_bytes: int
    crc32: int
    block_size: int
    topk_count: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., codec: _Optional[_Union[Codec, str]] = ..., numel: _Optional[int] = ..., encoded_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., block_size: _Optional[int] = ..., topk_count: _Optional[int] = ...) -> None: ...

class ShardRange(_message.Message):
    __slots__ = ("shard_id", "epoch", "start", "end")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    epoch: int
    start: int
    end: int
    def __init__(self, shard_id: _Optional[int] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ShardAssignment(_message.Message):
    __slots__ = ("shard_id", "epoch", "cursor")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    epoch: int
    cursor: int
    def __init__(self, shard_id: _Optional[int] = ..., epoch: _Optional[int] = ..., cursor: _Optional[int] = ...) -> None: ...

class WorkPlan(_message.Message):
    __slots__ = ("shards", "local_steps", "assigned_at_version", "plan_seq")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_SEQ_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardAssignment]
    local_steps: int
    assigned_at_version: int
    plan_seq: int
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardAssignment, _Mapping]]] = ..., local_steps: _Optional[int] = ..., assigned_at_version: _Optional[int] = ..., plan_seq: _Optional[int] = ...) -> None: ...

class Throughput(_message.Message):
    __slots__ = ("tokens_per_s", "step_time_s", "device_kind", "watts", "power_source")
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    WATTS_FIELD_NUMBER: _ClassVar[int]
    POWER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    tokens_per_s: float
    step_time_s: float
    device_kind: str
    watts: float
    power_source: PowerSource
    def __init__(self, tokens_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., device_kind: _Optional[str] = ..., watts: _Optional[float] = ..., power_source: _Optional[_Union[PowerSource, str]] = ...) -> None: ...
