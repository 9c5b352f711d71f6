"""Admission: how many calls a server runs at once, in total, per client and per method. A call beyond a limit is
refused at once with RESOURCE_EXHAUSTED, a short message naming the limit and its flag, and a retry hint
(`retry after N s` in the message and the `RETRY_AFTER_METADATA` trailer, in milliseconds); nothing queues
silently and nothing the refused call carried is applied.

A *client* is one connection (the peer address gRPC reports, `ipv4:host:port`): a learner holds one channel, so
one learner cannot take every stream slot, and an island behind one address is not mistaken for one learner.

`Admission` is the pure rule (counters, no I/O, no clock); `AdmissionInterceptor` applies it to a `grpc.aio`
server. The health check (`grpc.health.v1.Health/Check`) is never refused, so a loaded server still reports
SERVING.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from diloco.errors import ConfigError

RETRY_AFTER_METADATA = "diloco-retry-after-ms"
NEVER_REFUSED = frozenset({"/grpc.health.v1.Health/Check"})


@dataclass(frozen=True)
class AdmissionLimits:
    """`max_calls`: calls running at once on the server, every kind together (open streams included);
    `max_calls_per_client`: the same for one connection; `per_method`: calls of one method at once (by its short
    name, e.g. "SubmitPseudoGradient"); `retry_after_s`: the hint a refused caller gets."""

    max_calls: int = 8192
    max_calls_per_client: int = 64
    per_method: Mapping[str, int] = field(default_factory=dict)
    retry_after_s: float = 1.0
    flag: str = "--max-calls"  # named in refusals of the total, so operators know what to raise

    def __post_init__(self) -> None:
        if self.max_calls < 1 or self.max_calls_per_client < 1:
            raise ConfigError("admission: max_calls and max_calls_per_client must be >= 1")
        if any(n < 1 for n in self.per_method.values()):
            raise ConfigError(f"admission: every per-method limit must be >= 1, got {dict(self.per_method)}")
        if not 0 < self.retry_after_s <= 60:
            raise ConfigError(f"admission: retry_after_s must be in (0, 60], got {self.retry_after_s}")


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after_ms: int


class Admission:
    """Counts the calls that run and decides each new one. Thread-safe (the bulk port and tests use it from
    threads; the gRPC interceptor from its event loop)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._total = 0
        self._by_client: dict[str, int] = {}
        self._by_method: dict[str, int] = {}
        self.refused = 0

    def admit(self, method: str, client: str) -> Refusal | None:
        """None: the call may run (the caller must `release` it when it ends); else why not."""
        name = method.rsplit("/", 1)[-1]
        lim = self.limits
        with self._lock:
            if self._total >= lim.max_calls:
                why = f"the server runs {lim.max_calls} calls at once ({lim.flag})"
            elif self._by_client.get(client, 0) >= lim.max_calls_per_client:
                why = f"one connection may run {lim.max_calls_per_client} calls at once ({lim.flag}-per-client)"
            elif name in lim.per_method and self._by_method.get(name, 0) >= lim.per_method[name]:
                why = f"the server runs {lim.per_method[name]} {name} calls at once"
            else:
                self._total += 1
                self._by_client[client] = self._by_client.get(client, 0) + 1
                self._by_method[name] = self._by_method.get(name, 0) + 1
                return None
            self.refused += 1
        return Refusal(f"overloaded: {why}; retry after {lim.retry_after_s:g} s", round(lim.retry_after_s * 1000))

    def release(self, method: str, client: str) -> None:
        name = method.rsplit("/", 1)[-1]
        with self._lock:
            self._total -= 1
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]
            self._by_method[name] -= 1

    def in_flight(self) -> tuple[int, int]:
        """(calls running, clients with calls running)."""
        with self._lock:
            return self._total, len(self._by_client)


class AdmissionInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Applies `Admission` to every call of a `grpc.aio` server whose handler is a coroutine (or async generator)
    function; handlers run in the server's thread pool (sync servicers) pass unchecked."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in NEVER_REFUSED:
            return handler
        return wrap_handler(handler, lambda behavior: self._guard(method, behavior))

    def _guard(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        admission = self.admission

        async def admitted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[Any, Leave]:
            client = context.peer()
            refusal = admission.admit(method, client)
            if refusal is not None:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    refusal.message,
                    trailing_metadata=((RETRY_AFTER_METADATA, str(refusal.retry_after_ms)),),
                )
            return request, lambda: admission.release(method, client)

        return around(behavior, admitted)


Leave = Callable[[], None] | None
Enter = Callable[[Any, "grpc.aio.ServicerContext[Any, Any]"], Awaitable[tuple[Any, Leave]]]


def around(behavior: Callable[..., Any], enter: Enter) -> Callable[..., Any]:
    """`behavior` (a coroutine or async generator function) run after `enter(request, context)`, which may abort
    and returns the request to pass on and what to call once the behavior has ended (or None)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            request, leave = await enter(request, context)
            try:
                async for item in behavior(request, context):
                    yield item
            finally:
                if leave is not None:
                    leave()

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        request, leave = await enter(request, context)
        try:
            return await behavior(request, context)
        finally:
            if leave is not None:
                leave()

    return call


_KEEP: Any = object()


def wrap_handler(
    handler: grpc.RpcMethodHandler[Any, Any],
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    only_async: bool = True,
    request_deserializer: Any = _KEEP,
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` with its behavior replaced by `wrap(behavior)` (which must return an async behavior) and, when
    given, its request deserializer replaced (None: the behavior gets the raw bytes). With `only_async`, a sync
    behavior (run by the server's thread pool) is returned unchanged."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    if request_deserializer is _KEEP:
        request_deserializer = handler.request_deserializer
    for attr, make in kinds:
        behavior = getattr(handler, attr)
        if behavior is None:
            continue
        if only_async and not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler
        return make(
            wrap(behavior),
            request_deserializer=handler.request_deserializer
            if request_deserializer is _KEEP
            else request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler
