"""Domain errors to gRPC status codes, in one place, and the boundary every request passes: servicers (async,
`grpc.aio`) raise `diloco.errors` types; the wrappers here check each request message against its documented
bounds (`diloco.rpc.limits`) and turn a domain error into `context.abort(code, details)`, with the details
capped so no reply echoes a caller's input at length."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from diloco.errors import DilocoError, InvalidArgument
from diloco.rpc.admission import around, wrap_handler
from diloco.rpc.limits import check_request, clip_details

CODES: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}
F = TypeVar("F", bound=Callable[..., Any])


def status_of(err: DilocoError) -> grpc.StatusCode:
    return CODES.get(err.code, grpc.StatusCode.INTERNAL)


def details_of(err: DilocoError) -> str:
    return clip_details(str(err))


async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream with every message checked (`diloco.rpc.limits.check_request`) as it arrives."""
    async for msg in requests:
        check_request(msg)
        yield msg


def _is_message(request: Any) -> bool:
    return hasattr(request, "DESCRIPTOR")


def unary(fn: F) -> F:
    """Wrap an async unary (or client-streaming) servicer method: the request (each message of a stream) is
    checked, domain errors become status codes."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            if _is_message(request):
                check_request(request)
            else:
                request = checked(request)
            return await fn(self, request, context)
        except DilocoError as e:
            await context.abort(status_of(e), details_of(e))

    return wrapper  # type: ignore[return-value]


def streaming(fn: F) -> F:
    """Wrap an async server-streaming (or bidirectional) servicer method, an async generator, as `unary` does."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            if _is_message(request):
                check_request(request)
            else:
                request = checked(request)
            async for item in fn(self, request, context):
                yield item
        except DilocoError as e:
            await context.abort(status_of(e), details_of(e))

    return wrapper  # type: ignore[return-value]


class ParseRequests(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Request bodies that are not the method's protobuf message get INVALID_ARGUMENT with a message saying so
    (gRPC's own deserializer would answer UNKNOWN with the parser's exception): the behavior receives raw bytes
    and parses them here, each message of a stream as it arrives."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        streaming_requests = handler.request_streaming
        method = handler_call_details.method

        def one(raw: bytes) -> Any:
            try:
                return parse(raw)
            except (DecodeError, ValueError, TypeError):
                raise InvalidArgument(
                    f"the request body is not a valid message for {method}; build it from protos/diloco/v1"
                ) from None

        async def many(raws: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            async for raw in raws:
                yield one(raw)

        async def parsed(raw: Any, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[Any, None]:
            if streaming_requests:
                return many(raw), None
            try:
                return one(raw), None
            except InvalidArgument as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return wrap_handler(handler, lambda behavior: around(behavior, parsed), request_deserializer=None)
