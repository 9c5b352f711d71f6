"""Domain errors to gRPC status codes, in one place, and the boundary every request passes: servicers (async,
`grpc.aio`) raise `diloco.errors` types; the wrappers here check each request message against its documented
bounds (`diloco.rpc.limits`) and turn a domain error into `context.abort(code, details)`, with the details
capped so no reply echoes a caller's input at length."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from diloco.errors import DilocoError
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
