"""The coordinator addresses a client was given (`--coordinator A,B,...`: replicas under etcd leadership) and the
one way every client follows the leader among them: learners, healthd and `diloco ctl` (ALGORITHM.md section 11,
docs/ha.md).

One channel at a time, to the address in use. A coordinator call that ends with a FAILOVER code
(`diloco.core.leadership.FAILOVER_CODES`: UNAVAILABLE, the replica is down, draining or does not lead) moves it
(`failover(details, tried)`): to the leader the refusal names ("not the leader; leader is at HOST:PORT"; a hint
must meet the security rules of a configured address, else it is ignored), else to the next address round robin
(the pure `failover_target`). Without a hint, a move within `MIN_DWELL_S` of the previous one is taken as the same
outage seen by another thread (a learner's watcher, uploader and control calls) and not made again. Calls still
running on the old channel end CANCELLED when it is closed; a call started on it after that (another thread took
the stub's method just before the move) raises `ClosedChannel`, an UNAVAILABLE `grpc.RpcError`, where grpc raises
a ValueError: every retry loop then tries again at the address now followed. A retry loop whose next try goes to
another address than the one that failed starts its backoff afresh (`failover` says so).

`Coordinators` stands in for a `CoordinatorStub` (every RPC attribute is the current stub's), so a learner's
threads use it unchanged and call `failover` themselves on the FAILOVER reaction of their status table. A
one-shot caller (healthd's reports, `diloco ctl`) uses `call`: the call with the retry policy of
`diloco.rpc.retry`, each failed attempt moving it first.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import grpc
import structlog

from diloco.core.leadership import FAILOVER_CODES, failover_target, leader_hint
from diloco.errors import ConfigError, InvalidArgument
from diloco.rpc.retry import RETRYABLE, RetryConfig, call_with_retry
from diloco.rpc.security import SecurityConfig
from diloco.v1 import coordinator_pb2_grpc

# Without a leader hint, a move within this long of the previous one is taken as the same outage and not made again.
MIN_DWELL_S = 0.5
MOVES_ON = frozenset(getattr(grpc.StatusCode, code) for code in FAILOVER_CODES)
T = TypeVar("T")
Logger = Callable[[], structlog.stdlib.BoundLogger | None]


class ClosedChannel(grpc.RpcError):
    """A call started on a channel that a failover (or `close`) closed meanwhile, where grpc raises ValueError. It means
    what UNAVAILABLE means: try again, at the address followed now."""

    def __init__(self, address: str, error: ValueError) -> None:
        super().__init__(str(error))
        self._details = f"the channel to {address} was closed by a move to another coordinator meanwhile ({error})"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class Coordinators:
    """`addresses` (at least one; the client starts at the first), reached with `security` (`admin`: the admin token,
    else the join token). Log events are `<who>.coordinator_moved` and `<who>.leader_hint_refused`; `log` returns the
    logger to use now (None: say nothing). Thread-safe."""

    def __init__(
        self,
        addresses: Sequence[str],
        security: SecurityConfig,
        *,
        admin: bool = False,
        who: str,
        log: Logger = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not addresses:
            raise InvalidArgument("a coordinator client needs at least one address")
        self.addresses = tuple(addresses)
        self._security, self._admin, self._who, self._log, self._clock = security, admin, who, log, clock
        self._lock = threading.Lock()
        self._closed = False
        self.moves = 0
        self._switched_at = -MIN_DWELL_S
        self.address = self.addresses[0]
        self._channel = security.channel(self.address, admin=admin)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def __getattr__(self, name: str) -> Any:  # the RPCs: the current stub's, a ValueError of its closed channel read
        with self.__dict__["_lock"]:
            channel, address, method = self._channel, self.address, getattr(self.__dict__["_stub"], name)
        return functools.partial(self._invoke, channel, address, method)

    def _invoke(self, channel: grpc.Channel, address: str, method: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return method(*args, **kw)
        except ValueError as e:  # grpc's "Cannot invoke RPC ..." once `channel` is closed: any other is raised
            with self._lock:
                closed = self._closed or channel is not self._channel
            if not closed:
                raise
            raise ClosedChannel(address, e) from e

    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        """The stub of the address in use now."""
        with self._lock:
            return self._stub

    def failover(self, details: str = "", tried: str = "") -> bool:
        """A coordinator call to `tried` got a FAILOVER code: move to the leader `details` names, else to the next
        address. True when the address in use now is not `tried` (moved by this call or by another thread's): the
        caller's next try goes to another replica, so it starts its backoff afresh rather than wait out the delay
        grown against the one that failed (the new leader is then found within a dwell, not a capped backoff). An
        error from an address already left (`tried` is not the one in use: another thread moved meanwhile) moves
        nothing, hint or not: it tells nothing of the address in use. `tried` "": the address in use."""
        with self._lock:
            if self._closed:
                return False
            if tried and tried != self.address:
                return True
            now = self._clock()
            target = failover_target(self.addresses, self.address, details)
            hinted = bool(leader_hint(details))
            if hinted:
                try:
                    self._security.check_client(target)  # a hint meets the rules of a configured address
                except ConfigError as e:
                    self._say("leader_hint_refused", address=target, error=str(e))
                    target, hinted = failover_target(self.addresses, self.address, ""), False
            if target == self.address or (not hinted and now - self._switched_at < MIN_DWELL_S):
                return bool(tried) and self.address != tried
            old, previous = self._channel, self.address
            self._channel = self._security.channel(target, admin=self._admin)
            self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
            self.address, self._switched_at, self.moves = target, now, self.moves + 1
        self._say("coordinator_moved", previous=previous, address=target, hinted=hinted)
        old.close()
        return True

    def moved_by(self, error: grpc.RpcError) -> bool:
        """Move on `error` when its code is a FAILOVER code; True when it was one."""
        if error.code() not in MOVES_ON:
            return False
        self.failover(error.details() or "")
        return True

    def call(
        self,
        fn: Callable[[coordinator_pb2_grpc.CoordinatorStub], T],
        what: str,
        retry: RetryConfig,
        codes: frozenset[grpc.StatusCode] = RETRYABLE,
    ) -> T:
        """`fn(stub)` at the address in use, retried (`call_with_retry`: codes in `codes`, bounded by `retry`); an
        attempt that fails with a FAILOVER code moves first, so the next one goes to the leader it names or the
        next address. The last error is raised (after it moved, so the next call starts elsewhere)."""

        def attempt() -> T:
            try:
                return fn(cast(coordinator_pb2_grpc.CoordinatorStub, self))  # a channel closed meanwhile: UNAVAILABLE
            except grpc.RpcError as e:
                self.moved_by(e)
                raise

        return call_with_retry(attempt, what, retry, codes, logger=self._log())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel: grpc.Channel = self._channel
        channel.close()

    def _say(self, event: str, **fields: object) -> None:
        log = self._log()
        if log is not None:
            log.warning(f"{self._who}.{event}", **fields)
