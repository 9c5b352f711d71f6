from diloco.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_MODE_UNSPECIFIED: _ClassVar[RoundMode]
    ROUND_MODE_SYNC: _ClassVar[RoundMode]
    ROUND_MODE_DECOUPLED: _ClassVar[RoundMode]
    ROUND_MODE_ASYNC: _ClassVar[RoundMode]

class SubmissionOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUBMISSION_OUTCOME_UNSPECIFIED: _ClassVar[SubmissionOutcome]
    SUBMISSION_OUTCOME_ACCEPTED: _ClassVar[SubmissionOutcome]
    SUBMISSION_OUTCOME_APPLIED: _ClassVar[SubmissionOutcome]
ROUND_MODE_UNSPECIFIED: RoundMode
ROUND_MODE_SYNC: RoundMode
ROUND_MODE_DECOUPLED: RoundMode
ROUND_MODE_ASYNC: RoundMode
SUBMISSION_OUTCOME_UNSPECIFIED: SubmissionOutcome
SUBMISSION_OUTCOME_ACCEPTED: SubmissionOutcome
SUBMISSION_OUTCOME_APPLIED: SubmissionOutcome

class RegisterRequest(_message.Message):
    __slots__ = ("worker_name", "throughput", "model_fingerprint", "zone", "price_per_hour", "spot")
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    SPOT_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    throughput: _common_pb2.Throughput
    model_fingerprint: str
    zone: str
    price_per_hour: float
    spot: bool
    def __init__(self, worker_name: _Optional[str] = ..., throughput: _Optional[_Union[_common_pb2.Throughput, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., zone: _Optional[str] = ..., price_per_hour: _Optional[float] = ..., spot: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "coordinator_epoch", "version", "plan", "mode", "codec", "healthd_address", "task_json", "bulk_port", "task_fingerprint", "init_seed", "fragments", "fragment_bounds", "fragment_layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    HEALTHD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    TASK_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INIT_SEED_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    coordinator_epoch: int
    version: int
    plan: _common_pb2.WorkPlan
    mode: RoundMode
    codec: _common_pb2.Codec
    healthd_address: str
    task_json: str
    bulk_port: int
    task_fingerprint: str
    init_seed: int
    fragments: int
    fragment_bounds: _containers.RepeatedScalarFieldContainer[int]
    fragment_layout: str
    def __init__(self, worker_id: _Optional[str] = ..., coordinator_epoch: _Optional[int] = ..., version: _Optional[int] = ..., plan: _Optional[_Union[_common_pb2.WorkPlan, _Mapping]] = ..., mode: _Optional[_Union[RoundMode, str]] = ..., codec: _Optional[_Union[_common_pb2.Codec, str]] = ..., healthd_address: _Optional[str] = ..., task_json: _Optional[str] = ..., bulk_port: _Optional[int] = ..., task_fingerprint: _Optional[str] = ..., init_seed: _Optional[int] = ..., fragments: _Optional[int] = ..., fragment_bounds: _Optional[_Iterable[int]] = ..., fragment_layout: _Optional[str] = ...) -> None: ...

class WatchParametersRequest(_message.Message):
    __slots__ = ("worker_id", "after_version", "follow", "held_checksum")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    HELD_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    after_version: int
    follow: bool
    held_checksum: int
    def __init__(self, worker_id: _Optional[str] = ..., after_version: _Optional[int] = ..., follow: _Optional[bool] = ..., held_checksum: _Optional[int] = ...) -> None: ...

class ParametersHeader(_message.Message):
    __slots__ = ("version", "coordinator_epoch", "payload", "plan", "applied_submission_ids", "finished", "delta_from", "params_checksum", "held", "bulk_port", "fragment_versions", "delta_start")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SUBMISSION_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FROM_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DELTA_START_FIELD_NUMBER: _ClassVar[int]
    version: int
    coordinator_epoch: int
    payload: _common_pb2.PayloadSpec
    plan: _common_pb2.WorkPlan
    applied_submission_ids: _containers.RepeatedScalarFieldContainer[str]
    finished: bool
    delta_from: int
    params_checksum: int
    held: bool
    bulk_port: int
    fragment_versions: _containers.RepeatedScalarFieldContainer[int]
    delta_start: int
    def __init__(self, version: _Optional[int] = ..., coordinator_epoch: _Optional[int] = ..., payload: _Optional[_Union[_common_pb2.PayloadSpec, _Mapping]] = ..., plan: _Optional[_Union[_common_pb2.WorkPlan, _Mapping]] = ..., applied_submission_ids: _Optional[_Iterable[str]] = ..., finished: _Optional[bool] = ..., delta_from: _Optional[int] = ..., params_checksum: _Optional[int] = ..., held: _Optional[bool] = ..., bulk_port: _Optional[int] = ..., fragment_versions: _Optional[_Iterable[int]] = ..., delta_start: _Optional[int] = ...) -> None: ...

class ParametersChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ParametersHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ParametersHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmissionHeader(_message.Message):
    __slots__ = ("worker_id", "coordinator_epoch", "submission_id", "base_version", "tokens", "steps", "ranges", "payload", "resume_offset", "plan_seq", "fragment", "fragment_layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PLAN_SEQ_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    coordinator_epoch: int
    submission_id: str
    base_version: int
    tokens: int
    steps: int
    ranges: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShardRange]
    payload: _common_pb2.PayloadSpec
    resume_offset: int
    plan_seq: int
    fragment: int
    fragment_layout: str
    def __init__(self, worker_id: _Optional[str] = ..., coordinator_epoch: _Optional[int] = ..., submission_id: _Optional[str] = ..., base_version: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[_common_pb2.ShardRange, _Mapping]]] = ..., payload: _Optional[_Union[_common_pb2.PayloadSpec, _Mapping]] = ..., resume_offset: _Optional[int] = ..., plan_seq: _Optional[int] = ..., fragment: _Optional[int] = ..., fragment_layout: _Optional[str] = ...) -> None: ...

class SubmitPseudoGradientRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SubmissionHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SubmissionHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmitPseudoGradientResponse(_message.Message):
    __slots__ = ("outcome", "version", "staleness", "round", "coordinator_epoch")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    outcome: SubmissionOutcome
    version: int
    staleness: int
    round: int
    coordinator_epoch: int
    def __init__(self, outcome: _Optional[_Union[SubmissionOutcome, str]] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., round: _Optional[int] = ..., coordinator_epoch: _Optional[int] = ...) -> None: ...

class GetUploadStatusRequest(_message.Message):
    __slots__ = ("worker_id", "submission_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    submission_id: str
    def __init__(self, worker_id: _Optional[str] = ..., submission_id: _Optional[str] = ...) -> None: ...

class GetUploadStatusResponse(_message.Message):
    __slots__ = ("received_bytes", "complete")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    complete: bool
    def __init__(self, received_bytes: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class GetWorkPlanRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class GetWorkPlanResponse(_message.Message):
    __slots__ = ("plan", "version")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.WorkPlan
    version: int
    def __init__(self, plan: _Optional[_Union[_common_pb2.WorkPlan, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportNodeFailureRequest(_message.Message):
    __slots__ = ("worker_id", "reason", "last_seen_unix_s", "declared_dead_unix_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    DECLARED_DEAD_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    last_seen_unix_s: float
    declared_dead_unix_s: float
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., last_seen_unix_s: _Optional[float] = ..., declared_dead_unix_s: _Optional[float] = ...) -> None: ...

class ReportNodeFailureResponse(_message.Message):
    __slots__ = ("reassigned_shards", "known")
    REASSIGNED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    reassigned_shards: _containers.RepeatedScalarFieldContainer[int]
    known: bool
    def __init__(self, reassigned_shards: _Optional[_Iterable[int]] = ..., known: _Optional[bool] = ...) -> None: ...

class ReportThroughputRequest(_message.Message):
    __slots__ = ("worker_id", "throughput", "reports")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    throughput: _common_pb2.Throughput
    reports: _containers.RepeatedCompositeFieldContainer[ThroughputReport]
    def __init__(self, worker_id: _Optional[str] = ..., throughput: _Optional[_Union[_common_pb2.Throughput, _Mapping]] = ..., reports: _Optional[_Iterable[_Union[ThroughputReport, _Mapping]]] = ...) -> None: ...

class ThroughputReport(_message.Message):
    __slots__ = ("worker_id", "throughput")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    throughput: _common_pb2.Throughput
    def __init__(self, worker_id: _Optional[str] = ..., throughput: _Optional[_Union[_common_pb2.Throughput, _Mapping]] = ...) -> None: ...

class ReportThroughputResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("mode", "version", "coordinator_epoch", "paused", "live_workers", "pending_submissions", "tokens_applied", "last_round_unix_s", "validation_loss", "bytes_received", "bytes_sent", "target_outer_steps", "finished", "codec", "min_quorum", "rejected_submissions", "started_unix_s", "validation_tokens", "placement", "placement_reason", "paused_workers", "watts", "energy_kwh", "carbon_g", "cost", "ha")
    MODE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_OUTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    MIN_QUORUM_FIELD_NUMBER: _ClassVar[int]
    REJECTED_SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_REASON_FIELD_NUMBER: _ClassVar[int]
    PAUSED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WATTS_FIELD_NUMBER: _ClassVar[int]
    ENERGY_KWH_FIELD_NUMBER: _ClassVar[int]
    CARBON_G_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    HA_FIELD_NUMBER: _ClassVar[int]
    mode: RoundMode
    version: int
    coordinator_epoch: int
    paused: bool
    live_workers: int
    pending_submissions: int
    tokens_applied: int
    last_round_unix_s: float
    validation_loss: float
    bytes_received: int
    bytes_sent: int
    target_outer_steps: int
    finished: bool
    codec: str
    min_quorum: int
    rejected_submissions: int
    started_unix_s: float
    validation_tokens: int
    placement: str
    placement_reason: str
    paused_workers: int
    watts: float
    energy_kwh: float
    carbon_g: float
    cost: float
    ha: HaStatus
    def __init__(self, mode: _Optional[_Union[RoundMode, str]] = ..., version: _Optional[int] = ..., coordinator_epoch: _Optional[int] = ..., paused: _Optional[bool] = ..., live_workers: _Optional[int] = ..., pending_submissions: _Optional[int] = ..., tokens_applied: _Optional[int] = ..., last_round_unix_s: _Optional[float] = ..., validation_loss: _Optional[float] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., target_outer_steps: _Optional[int] = ..., finished: _Optional[bool] = ..., codec: _Optional[str] = ..., min_quorum: _Optional[int] = ..., rejected_submissions: _Optional[int] = ..., started_unix_s: _Optional[float] = ..., validation_tokens: _Optional[int] = ..., placement: _Optional[str] = ..., placement_reason: _Optional[str] = ..., paused_workers: _Optional[int] = ..., watts: _Optional[float] = ..., energy_kwh: _Optional[float] = ..., carbon_g: _Optional[float] = ..., cost: _Optional[float] = ..., ha: _Optional[_Union[HaStatus, _Mapping]] = ...) -> None: ...

class HaStatus(_message.Message):
    __slots__ = ("replica_id", "leader_id", "leader_address", "leader_epoch", "is_leader", "sync_replicas", "log_version", "replicas", "log_oldest_version", "log_entries", "log_bytes", "log_max_bytes", "holding_version", "held_s")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    SYNC_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOG_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOG_OLDEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOG_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOLDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    leader_id: str
    leader_address: str
    leader_epoch: int
    is_leader: bool
    sync_replicas: int
    log_version: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    log_oldest_version: int
    log_entries: int
    log_bytes: int
    log_max_bytes: int
    holding_version: int
    held_s: float
    def __init__(self, replica_id: _Optional[str] = ..., leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ..., leader_epoch: _Optional[int] = ..., is_leader: _Optional[bool] = ..., sync_replicas: _Optional[int] = ..., log_version: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., log_oldest_version: _Optional[int] = ..., log_entries: _Optional[int] = ..., log_bytes: _Optional[int] = ..., log_max_bytes: _Optional[int] = ..., holding_version: _Optional[int] = ..., held_s: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "acked_version", "lag_versions", "lagging")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAG_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LAGGING_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    acked_version: int
    lag_versions: int
    lagging: bool
    def __init__(self, replica_id: _Optional[str] = ..., acked_version: _Optional[int] = ..., lag_versions: _Optional[int] = ..., lagging: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "worker_name", "state", "throughput", "local_steps", "shards", "submissions", "tokens", "last_base_version", "last_submit_unix_s", "registered_unix_s", "state_reason", "measured_tokens_per_s", "zone", "price_per_hour", "spot", "placement_weight", "carbon_intensity", "energy_kwh", "carbon_g", "cost")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SUBMIT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    SPOT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CARBON_INTENSITY_FIELD_NUMBER: _ClassVar[int]
    ENERGY_KWH_FIELD_NUMBER: _ClassVar[int]
    CARBON_G_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_name: str
    state: _common_pb2.WorkerState
    throughput: _common_pb2.Throughput
    local_steps: int
    shards: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShardAssignment]
    submissions: int
    tokens: int
    last_base_version: int
    last_submit_unix_s: float
    registered_unix_s: float
    state_reason: str
    measured_tokens_per_s: float
    zone: str
    price_per_hour: float
    spot: bool
    placement_weight: float
    carbon_intensity: float
    energy_kwh: float
    carbon_g: float
    cost: float
    def __init__(self, worker_id: _Optional[str] = ..., worker_name: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.WorkerState, str]] = ..., throughput: _Optional[_Union[_common_pb2.Throughput, _Mapping]] = ..., local_steps: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[_common_pb2.ShardAssignment, _Mapping]]] = ..., submissions: _Optional[int] = ..., tokens: _Optional[int] = ..., last_base_version: _Optional[int] = ..., last_submit_unix_s: _Optional[float] = ..., registered_unix_s: _Optional[float] = ..., state_reason: _Optional[str] = ..., measured_tokens_per_s: _Optional[float] = ..., zone: _Optional[str] = ..., price_per_hour: _Optional[float] = ..., spot: _Optional[bool] = ..., placement_weight: _Optional[float] = ..., carbon_intensity: _Optional[float] = ..., energy_kwh: _Optional[float] = ..., carbon_g: _Optional[float] = ..., cost: _Optional[float] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class ShardLedgerEntry(_message.Message):
    __slots__ = ("shard_id", "owner", "epoch", "committed", "accepted", "length", "committed_ranges")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_RANGES_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    owner: str
    epoch: int
    committed: int
    accepted: int
    length: int
    committed_ranges: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShardRange]
    def __init__(self, shard_id: _Optional[int] = ..., owner: _Optional[str] = ..., epoch: _Optional[int] = ..., committed: _Optional[int] = ..., accepted: _Optional[int] = ..., length: _Optional[int] = ..., committed_ranges: _Optional[_Iterable[_Union[_common_pb2.ShardRange, _Mapping]]] = ...) -> None: ...

class GetLedgerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLedgerResponse(_message.Message):
    __slots__ = ("shards", "version", "tokens_applied")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardLedgerEntry]
    version: int
    tokens_applied: int
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardLedgerEntry, _Mapping]]] = ..., version: _Optional[int] = ..., tokens_applied: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.WorkerState
    def __init__(self, state: _Optional[_Union[_common_pb2.WorkerState, str]] = ...) -> None: ...

class EvictWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EvictWorkerResponse(_message.Message):
    __slots__ = ("reassigned_shards",)
    REASSIGNED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    reassigned_shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reassigned_shards: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class ReleaseWorkerResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.WorkerState
    def __init__(self, state: _Optional[_Union[_common_pb2.WorkerState, str]] = ...) -> None: ...

class StepDownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StepDownResponse(_message.Message):
    __slots__ = ("version", "held_by", "leader_id", "leader_address", "leader_epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    held_by: _containers.RepeatedScalarFieldContainer[str]
    leader_id: str
    leader_address: str
    leader_epoch: int
    def __init__(self, version: _Optional[int] = ..., held_by: _Optional[_Iterable[str]] = ..., leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...
