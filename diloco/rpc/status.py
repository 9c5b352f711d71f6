"""Domain errors to gRPC status codes, in one place. Servicers raise `diloco.errors` types; the wrappers here
turn them into `context.abort(code, message)`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from diloco.errors import DilocoError

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


def unary(fn: F) -> F:
    """Wrap a unary (or client-streaming) servicer method: domain errors become status codes."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except DilocoError as e:
            context.abort(status_of(e), str(e))

    return wrapper  # type: ignore[return-value]


def streaming(fn: F) -> F:
    """Wrap a server-streaming servicer method (a generator)."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(self, request, context)
        except DilocoError as e:
            context.abort(status_of(e), str(e))

    return wrapper  # type: ignore[return-value]
