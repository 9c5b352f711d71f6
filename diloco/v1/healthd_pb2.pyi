from diloco.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_ROLE_UNSPECIFIED: _ClassVar[NodeRole]
    NODE_ROLE_WORKER: _ClassVar[NodeRole]
    NODE_ROLE_COORDINATOR: _ClassVar[NodeRole]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ALIVE: _ClassVar[NodeState]
    NODE_STATE_SUSPECT: _ClassVar[NodeState]
    NODE_STATE_DEAD: _ClassVar[NodeState]
    NODE_STATE_LEFT: _ClassVar[NodeState]
NODE_ROLE_UNSPECIFIED: NodeRole
NODE_ROLE_WORKER: NodeRole
NODE_ROLE_COORDINATOR: NodeRole
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ALIVE: NodeState
NODE_STATE_SUSPECT: NodeState
NODE_STATE_DEAD: NodeState
NODE_STATE_LEFT: NodeState

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "role", "sequence", "throughput", "version", "steps_done", "leaving")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: NodeRole
    sequence: int
    throughput: _common_pb2.Throughput
    version: int
    steps_done: int
    leaving: bool
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[NodeRole, str]] = ..., sequence: _Optional[int] = ..., throughput: _Optional[_Union[_common_pb2.Throughput, _Mapping]] = ..., version: _Optional[int] = ..., steps_done: _Optional[int] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("sequence", "state", "dead_after_s", "leader_epoch", "leader_address")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEAD_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    state: NodeState
    dead_after_s: float
    leader_epoch: int
    leader_address: str
    def __init__(self, sequence: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ..., dead_after_s: _Optional[float] = ..., leader_epoch: _Optional[int] = ..., leader_address: _Optional[str] = ...) -> None: ...

class AnnounceLeaderRequest(_message.Message):
    __slots__ = ("epoch", "address")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    address: str
    def __init__(self, epoch: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class AnnounceLeaderResponse(_message.Message):
    __slots__ = ("epoch", "address")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    address: str
    def __init__(self, epoch: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "state", "last_seen_unix_s", "throughput", "version", "heartbeats")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: NodeRole
    state: NodeState
    last_seen_unix_s: float
    throughput: _common_pb2.Throughput
    version: int
    heartbeats: int
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[NodeRole, str]] = ..., state: _Optional[_Union[NodeState, str]] = ..., last_seen_unix_s: _Optional[float] = ..., throughput: _Optional[_Union[_common_pb2.Throughput, _Mapping]] = ..., version: _Optional[int] = ..., heartbeats: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class WatchNodeEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeEvent(_message.Message):
    __slots__ = ("node_id", "state", "previous_state", "at_unix_s", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STATE_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: NodeState
    previous_state: NodeState
    at_unix_s: float
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., previous_state: _Optional[_Union[NodeState, str]] = ..., at_unix_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...
