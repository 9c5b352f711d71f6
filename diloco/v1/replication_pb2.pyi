from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateDigest(_message.Message):
    __slots__ = ("params_crc32", "outer_crc32")
    PARAMS_CRC32_FIELD_NUMBER: _ClassVar[int]
    OUTER_CRC32_FIELD_NUMBER: _ClassVar[int]
    params_crc32: int
    outer_crc32: int
    def __init__(self, params_crc32: _Optional[int] = ..., outer_crc32: _Optional[int] = ...) -> None: ...

class FollowLogRequest(_message.Message):
    __slots__ = ("replica_id", "held_version", "fingerprint", "epoch", "held_digest")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HELD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    held_version: int
    fingerprint: str
    epoch: int
    held_digest: StateDigest
    def __init__(self, replica_id: _Optional[str] = ..., held_version: _Optional[int] = ..., fingerprint: _Optional[str] = ..., epoch: _Optional[int] = ..., held_digest: _Optional[_Union[StateDigest, _Mapping]] = ...) -> None: ...

class SnapshotHeader(_message.Message):
    __slots__ = ("version", "epoch", "numel", "outer_tensors", "bookkeeping_bytes", "payload_crc32", "digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    OUTER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    BOOKKEEPING_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CRC32_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    numel: int
    outer_tensors: _containers.RepeatedScalarFieldContainer[str]
    bookkeeping_bytes: int
    payload_crc32: int
    digest: StateDigest
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ..., numel: _Optional[int] = ..., outer_tensors: _Optional[_Iterable[str]] = ..., bookkeeping_bytes: _Optional[int] = ..., payload_crc32: _Optional[int] = ..., digest: _Optional[_Union[StateDigest, _Mapping]] = ...) -> None: ...

class EntryHeader(_message.Message):
    __slots__ = ("version", "epoch", "learners", "numel", "bookkeeping_bytes", "payload_crc32", "digest", "fragments")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BOOKKEEPING_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CRC32_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    learners: int
    numel: int
    bookkeeping_bytes: int
    payload_crc32: int
    digest: StateDigest
    fragments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ..., learners: _Optional[int] = ..., numel: _Optional[int] = ..., bookkeeping_bytes: _Optional[int] = ..., payload_crc32: _Optional[int] = ..., digest: _Optional[_Union[StateDigest, _Mapping]] = ..., fragments: _Optional[_Iterable[int]] = ...) -> None: ...

class LogMessage(_message.Message):
    __slots__ = ("snapshot", "entry", "data")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    snapshot: SnapshotHeader
    entry: EntryHeader
    data: bytes
    def __init__(self, snapshot: _Optional[_Union[SnapshotHeader, _Mapping]] = ..., entry: _Optional[_Union[EntryHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class AckLogRequest(_message.Message):
    __slots__ = ("replica_id", "version", "epoch", "digest")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    version: int
    epoch: int
    digest: StateDigest
    def __init__(self, replica_id: _Optional[str] = ..., version: _Optional[int] = ..., epoch: _Optional[int] = ..., digest: _Optional[_Union[StateDigest, _Mapping]] = ...) -> None: ...

class AckLogResponse(_message.Message):
    __slots__ = ("leader_version",)
    LEADER_VERSION_FIELD_NUMBER: _ClassVar[int]
    leader_version: int
    def __init__(self, leader_version: _Optional[int] = ...) -> None: ...
