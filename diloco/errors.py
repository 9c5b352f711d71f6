"""Domain errors. The core raises these; the gRPC layer maps each to one status code in one place
(`diloco.rpc.status`), so the core never imports grpc."""

from __future__ import annotations


class DilocoError(Exception):
    """Base class. `code` names the gRPC status the RPC layer answers with."""

    code = "INTERNAL"


class InvalidArgument(DilocoError, ValueError):
    """Malformed input: wrong shape, dtype, codec, non-finite values, bad ranges."""

    code = "INVALID_ARGUMENT"


class ConfigError(InvalidArgument):
    """Invalid configuration, raised at start. The message names the field and the allowed values."""


class FailedPrecondition(DilocoError):
    """Stale version, epoch or fencing token; the caller must resync before retrying."""

    code = "FAILED_PRECONDITION"


class NotFound(DilocoError, KeyError):
    """Unknown worker, shard or submission."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class AlreadyExists(DilocoError):
    """Duplicate: the thing was already done."""

    code = "ALREADY_EXISTS"


class ResourceExhausted(DilocoError):
    """Too large or too many."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(DilocoError):
    """Draining, paused or not ready: retry later."""

    code = "UNAVAILABLE"


class NotLeader(Unavailable):
    """This coordinator replica does not lead (a standby, or a leader past its fence time): the message names the
    leader when it is known ("not the leader; leader is at HOST:PORT"), which learners move to."""


def not_leader(hint: str) -> NotLeader:
    """The refusal of a replica that does not lead; `hint` is the leader's HOST:PORT ("" when unknown)."""
    where = f"leader is at {hint}" if hint else "the leader is not known yet"
    return NotLeader(f"not the leader; {where}")


class Unauthenticated(DilocoError):
    """No valid credentials (a missing or unknown token)."""

    code = "UNAUTHENTICATED"


class PermissionDenied(DilocoError):
    """Valid credentials without the role the call needs."""

    code = "PERMISSION_DENIED"
