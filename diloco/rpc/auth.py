"""Bearer tokens: which token each RPC needs (one table), the server interceptor that enforces it, and the client
interceptor that sends it (`authorization: Bearer <token>`).

Two tokens: the **join** token, which workers present for everything they call, and the **admin** token, for the
operator's mutating commands and the service-to-service calls a worker must not make (healthd reporting a dead
node). The admin token is accepted wherever the join token is. Read-only operator RPCs accept either. Health
checking and reflection stay open (healthchecks use them).

Missing or unknown token: UNAUTHENTICATED; a valid token of the wrong role: PERMISSION_DENIED.

Identity: with mutual TLS, a learner's certificate also says *which* learner it may act as (`act_as`). A
certificate issued for one name (`diloco certs --workers N` or `--names`) registers, uploads, heartbeats and
leaves only as that name, so one compromised learner cannot upload, drain or fake the heartbeats of another. The
shared `worker` certificate (the default of `diloco certs`, used by `docker compose --scale`) may act as any
learner; the services' and the operator's certificates act as none. Plaintext on loopback has no identity to
check.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import grpc

from diloco.errors import PermissionDenied
from diloco.rpc.admission import wrap_handler
from diloco.rpc.tls import RESERVED_NAMES

COORDINATOR_SERVICE = "diloco.v1.Coordinator"
HEALTHD_SERVICE = "diloco.v1.HealthDaemon"
REPLICATION_SERVICE = "diloco.v1.Replication"
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
METADATA_KEY = "authorization"
SHARED_WORKER_IDENTITY = "worker"  # the certificate every learner may share; it may act as any learner


class Role(enum.Enum):
    WORKER = "worker"  # the join token (or the admin token)
    ADMIN = "admin"  # the admin token only
    READ = "read"  # either token


# Every RPC of every diloco service; a test walks the service descriptors and fails on one missing here.
METHOD_ROLES: Mapping[str, Mapping[str, Role]] = {
    COORDINATOR_SERVICE: {
        "Register": Role.WORKER,
        "WatchParameters": Role.WORKER,
        "SubmitPseudoGradient": Role.WORKER,
        "GetUploadStatus": Role.WORKER,
        "GetWorkPlan": Role.WORKER,
        "Deregister": Role.WORKER,
        "ReportThroughput": Role.WORKER,
        "ReportNodeFailure": Role.ADMIN,
        "GetStatus": Role.READ,
        "ListWorkers": Role.READ,
        "GetLedger": Role.READ,
        "Checkpoint": Role.ADMIN,
        "DrainWorker": Role.ADMIN,
        "EvictWorker": Role.ADMIN,
        "ReleaseWorker": Role.ADMIN,
        "Pause": Role.ADMIN,
        "Resume": Role.ADMIN,
        "StepDown": Role.ADMIN,
    },
    HEALTHD_SERVICE: {
        "Heartbeat": Role.WORKER,
        "ListNodes": Role.READ,
        "WatchNodeEvents": Role.READ,
        "AnnounceLeader": Role.ADMIN,  # a coordinator replica that has come to lead
    },
    REPLICATION_SERVICE: {  # a standby coordinator: it receives the whole state, and its acks gate publishing
        "FollowLog": Role.ADMIN,
        "AckLog": Role.ADMIN,
    },
}


class Tokens(NamedTuple):
    """The tokens a server accepts. Never logged: the repr hides them."""

    join: str
    admin: str

    def __repr__(self) -> str:
        return "Tokens(join=***, admin=***)"


class Denied(NamedTuple):
    code: grpc.StatusCode
    message: str


def required_role(method: str) -> Role | None:
    """The role `/package.Service/Method` needs; None for the open services (health, reflection). Raises KeyError
    for an RPC that is in no table (denied by the interceptor)."""
    service, _, name = method.lstrip("/").partition("/")
    if service in OPEN_SERVICES:
        return None
    return METHOD_ROLES[service][name]


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The common name of the client certificate the TLS handshake verified ('' when it has none); None on a
    plaintext channel."""
    props: Mapping[str, Any] = context.auth_context()
    if b"ssl" not in list(props.get("transport_security_type") or ()):
        return None
    names = list(props.get("x509_common_name") or ())
    return bytes(names[0]).decode("utf-8", "replace") if names else ""


def act_as(identity: str | None, worker_name: str) -> None:
    """Raise PermissionDenied unless a client with certificate name `identity` (None: plaintext, no identity to
    check) may act as learner `worker_name`: its own name, or any with the shared certificate. The services' and
    the operator's certificates act as no learner."""
    if identity is None:
        return
    if identity in RESERVED_NAMES:
        raise PermissionDenied(
            f"this client's certificate is {identity!r}, a service's or the operator's: it cannot act as a learner; "
            "run learners with a worker certificate (`diloco certs` writes worker.pem)"
        )
    if identity not in (SHARED_WORKER_IDENTITY, worker_name):
        raise PermissionDenied(
            f"this client's certificate is for {identity!r}, which may act only as learner {identity!r}, not "
            f"{worker_name!r}: run the learner with --name {identity} or with its own certificate "
            f"(`diloco certs --names {worker_name}`)"
        )


def worker_name_of(worker_id: str) -> str:
    """The learner name in a learner id: the coordinator's Register makes ids `<name>-<incarnation>`."""
    name, sep, n = worker_id.rpartition("-")
    return name if sep and n.isdigit() else worker_id


def bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key.lower() == METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def check(tokens: Tokens, method: str, presented: str | None) -> Denied | None:
    """None when the call may go on, else the status and a message telling the caller what to do."""
    try:
        role = required_role(method)
    except KeyError:
        return Denied(grpc.StatusCode.PERMISSION_DENIED, f"{method} is not in the authorization table")
    if role is None:
        return None
    if not presented:
        return Denied(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing token: send `authorization: Bearer <token>` (workers: --join-token-file or DILOCO_JOIN_TOKEN; "
            "operators: --admin-token-file or DILOCO_ADMIN_TOKEN)",
        )
    given = presented.encode()
    is_admin = hmac.compare_digest(given, tokens.admin.encode())
    is_join = hmac.compare_digest(given, tokens.join.encode())
    if not (is_admin or is_join):
        return Denied(
            grpc.StatusCode.UNAUTHENTICATED,
            "unknown token: use the join.token/admin.token of this deployment (written by `diloco certs`)",
        )
    if role is Role.ADMIN and not is_admin:
        name = method.rsplit("/", 1)[-1]
        return Denied(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{name} needs the admin token; the join token only lets workers train "
            "(pass --admin-token-file or DILOCO_ADMIN_TOKEN)",
        )
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Checks the bearer token of every call against `METHOD_ROLES` before the servicer sees it (a `grpc.aio`
    server's interceptor)."""

    def __init__(self, tokens: Tokens) -> None:
        if not tokens.join or not tokens.admin:
            raise ValueError("both a join and an admin token are required")
        if hmac.compare_digest(tokens.join.encode(), tokens.admin.encode()):
            raise ValueError("the join and admin tokens must differ")
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        denied = check(self._tokens, handler_call_details.method, bearer(handler_call_details.invocation_metadata))
        handler = await continuation(handler_call_details)
        if denied is None or handler is None:
            return handler

        async def abort(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(denied.code, denied.message)

        return wrap_handler(handler, lambda _behavior: abort, only_async=False)


# --- client side ------------------------------------------------------------------------------------------------


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class BearerTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Adds `authorization: Bearer <token>` to every call on the channel."""

    def __init__(self, token: str) -> None:
        self._header = (METADATA_KEY, f"Bearer {token}")

    def __repr__(self) -> str:
        return "BearerTokenInterceptor(***)"

    def _details(self, d: Any) -> _CallDetails:
        metadata = [*(d.metadata or ()), self._header]
        return _CallDetails(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)
