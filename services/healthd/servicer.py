"""The HealthDaemon gRPC servicer: decode the request into domain types, call the monitor, encode the reply.
Domain errors become status codes in `diloco.rpc.status`.

Heartbeat floods: every heartbeat stream (one node each) has a token bucket allowing `rate_factor` times the
configured heartbeat rate with a burst of `burst`. The first heartbeat over it is not applied: the stream ends
with RESOURCE_EXHAUSTED (the node reconnects with backoff). Streams are coroutines on the server's event loop
(`grpc.aio`), bounded by the server's admission limits (`--max-calls`), so healthd's memory and CPU stay bounded
whatever the nodes send. The monitor's calls take only its short lock and queue their reports, so they run on the
loop."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from diloco import log as logging
from diloco.core.failure import NodeEvent, NodeRole, NodeState, NodeView, Throughput
from diloco.core.leadership import AnnouncedLeader, hintable
from diloco.core.ratelimit import TokenBucket
from diloco.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from diloco.rpc import auth
from diloco.rpc.status import streaming, unary
from diloco.rpc.vocab import NODE_STATES, power_from_proto, throughput_to_proto
from diloco.v1 import common_pb2, healthd_pb2, healthd_pb2_grpc
from services.healthd.hub import Subscription

SERVICE_NAME = "diloco.v1.HealthDaemon"

ROLE_FROM_PB = {healthd_pb2.NODE_ROLE_WORKER: NodeRole.WORKER, healthd_pb2.NODE_ROLE_COORDINATOR: NodeRole.COORDINATOR}
ROLE_TO_PB = {v: k for k, v in ROLE_FROM_PB.items()}


class MonitorLike(Protocol):
    """What the servicer needs from the service (`services.healthd.monitor.Monitor`)."""

    @property
    def dead_after_s(self) -> float: ...

    def heartbeat(
        self, node_id: str, role: NodeRole, throughput: Throughput | None = None, version: int = 0
    ) -> NodeState: ...

    def leave(self, node_id: str) -> NodeState: ...

    def nodes(self) -> list[NodeView]: ...

    def subscribe(self) -> Subscription: ...


def decode_role(role: int) -> NodeRole:
    try:
        return ROLE_FROM_PB[role]  # type: ignore[index]
    except KeyError:
        raise InvalidArgument(
            f"role must be NODE_ROLE_WORKER or NODE_ROLE_COORDINATOR, got {role}; set HeartbeatRequest.role"
        ) from None


def decode_throughput(req: healthd_pb2.HeartbeatRequest) -> Throughput | None:
    if not req.HasField("throughput"):
        return None
    tp = req.throughput
    watts, source = power_from_proto(tp)
    return Throughput(
        tokens_per_s=tp.tokens_per_s,
        step_time_s=tp.step_time_s,
        device_kind=tp.device_kind,
        watts=watts,
        power_source=source,
    )


def encode_throughput(tp: Throughput | None) -> common_pb2.Throughput | None:
    return None if tp is None else throughput_to_proto(tp)


def encode_node(view: NodeView) -> healthd_pb2.NodeInfo:
    return healthd_pb2.NodeInfo(
        node_id=view.node_id,
        role=ROLE_TO_PB[view.role],
        state=NODE_STATES.to_proto(view.state),
        last_seen_unix_s=view.last_seen,
        throughput=encode_throughput(view.throughput),
        version=view.version,
        heartbeats=view.heartbeats,
    )


def encode_event(ev: NodeEvent) -> healthd_pb2.NodeEvent:
    previous = (
        NODE_STATES.to_proto(ev.previous_state) if ev.previous_state is not None else healthd_pb2.NODE_STATE_UNSPECIFIED
    )
    return healthd_pb2.NodeEvent(
        node_id=ev.node_id,
        state=NODE_STATES.to_proto(ev.state),
        previous_state=previous,
        at_unix_s=ev.at,
        reason=ev.reason,
    )


MAX_EPOCH = (1 << 63) - 1


def decode_leader(req: healthd_pb2.AnnounceLeaderRequest) -> tuple[int, str]:
    """The (epoch, HOST:PORT) an announcement names; InvalidArgument saying what is wrong."""
    if not 1 <= req.epoch <= MAX_EPOCH:
        raise InvalidArgument(f"epoch must be the leadership epoch won (1 to {MAX_EPOCH}), got {req.epoch}")
    if not hintable(req.address):  # its length is bounded by diloco.rpc.limits
        raise InvalidArgument(f"address must be the leader's HOST:PORT, got {req.address[:80]!r}")
    return req.epoch, req.address


def _check_identity(identity: str | None, node_id: str, role: NodeRole) -> None:
    """With mutual TLS, a stream may carry only the heartbeats of the node its certificate names: the coordinator's
    for role coordinator, a learner's own (or any, with the shared `worker` certificate) for role worker. So no
    learner can keep another alive, or announce that it leaves."""
    if identity is None:
        return
    if role is NodeRole.COORDINATOR:
        if identity != "coordinator":
            raise PermissionDenied(
                f"heartbeats of role coordinator need the coordinator's certificate; this client's is {identity!r}"
            )
        return
    auth.act_as(identity, auth.worker_name_of(node_id))


class HealthDaemonServicer(healthd_pb2_grpc.HealthDaemonServicer):
    def __init__(
        self,
        monitor: MonitorLike,
        *,
        max_heartbeats_per_s: float = 200.0,
        burst: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
        on_leader: Callable[[str], None] = lambda address: None,
    ) -> None:
        self.monitor, self.on_leader = monitor, on_leader
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.burst = burst
        self.clock = clock
        # the coordinator leader announced, passed on in every heartbeat reply while it stands; only the event loop
        # touches it
        self.leader = AnnouncedLeader()
        self.log = logging.get("healthd")

    @streaming
    async def Heartbeat(
        self, request_iterator: AsyncIterator[healthd_pb2.HeartbeatRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[healthd_pb2.HeartbeatResponse]:
        node_id: str | None = None
        last_sequence: int | None = None
        bucket = TokenBucket(self.max_heartbeats_per_s, self.burst)
        async for req in request_iterator:
            if not bucket.allow(self.clock()):
                raise ResourceExhausted(
                    f"heartbeat flood from {req.node_id!r}: the limit is {self.max_heartbeats_per_s:g} heartbeats/s "
                    f"(burst {self.burst:g}); send one every heartbeat interval"
                )
            if node_id is not None and req.node_id != node_id:
                raise InvalidArgument(
                    f"this stream carries heartbeats of node {node_id!r}, got {req.node_id!r}; open one stream per node"
                )
            if last_sequence is not None and req.sequence <= last_sequence:
                raise InvalidArgument(
                    f"sequence must increase within a stream: got {req.sequence} after {last_sequence}"
                )
            role = decode_role(req.role)
            if node_id is None:
                _check_identity(auth.peer_identity(context), req.node_id, role)
            if req.leaving:
                state = self.monitor.leave(req.node_id)
            else:
                state = self.monitor.heartbeat(req.node_id, role, decode_throughput(req), req.version)
            node_id, last_sequence = req.node_id, req.sequence
            epoch, address = self.leader.current(self.clock())
            yield healthd_pb2.HeartbeatResponse(
                sequence=req.sequence,
                state=NODE_STATES.to_proto(state),
                dead_after_s=self.monitor.dead_after_s,
                leader_epoch=epoch,
                leader_address=address,
            )

    @unary
    async def AnnounceLeader(
        self, request: healthd_pb2.AnnounceLeaderRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> healthd_pb2.AnnounceLeaderResponse:
        identity = auth.peer_identity(context)
        if identity is not None and identity != "coordinator":
            raise PermissionDenied(
                f"only a coordinator announces a leader (its certificate); this client's is {identity!r}"
            )
        epoch, address = decode_leader(request)
        now = self.clock()
        previous = self.leader.current(now)
        if self.leader.announce(epoch, address, now):  # a deposed leader's late announcement changes nothing
            self.log.info("healthd.leader_announced", epoch=epoch, address=address, previous=previous[1] or None)
            self.on_leader(address)  # healthd's own reports go there too
        epoch, address = self.leader.current(now)
        return healthd_pb2.AnnounceLeaderResponse(epoch=epoch, address=address)

    @unary
    async def ListNodes(
        self, request: healthd_pb2.ListNodesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> healthd_pb2.ListNodesResponse:
        return healthd_pb2.ListNodesResponse(nodes=[encode_node(v) for v in self.monitor.nodes()])

    @streaming
    async def WatchNodeEvents(
        self, request: healthd_pb2.WatchNodeEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[healthd_pb2.NodeEvent]:
        sub = self.monitor.subscribe()
        try:
            # Headers go out once the subscription exists: a client that waits for them misses no later event.
            await context.send_initial_metadata(())
            async for ev in sub:
                yield encode_event(ev)
        finally:
            sub.close()  # the watcher cancelled or went away, or the server stops
