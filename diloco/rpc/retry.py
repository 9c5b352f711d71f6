"""The retry policies, in one place. `call_with_retry` (tenacity): retryable status codes only, exponential
backoff with jitter, bounded in attempts and in total time, one log line per retry. `retry_while`: for a learner,
which never gives up on its own: the caller decides on every error (from its status table, see
`diloco.core.learner.REACTIONS`), the delays are capped and jittered (`Backoff`). Retried writes must be
idempotent (submission ids)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from diloco.errors import ConfigError
from diloco.rpc.admission import RETRY_AFTER_METADATA

MAX_RETRY_HINT_S = 60.0  # a server's hint is obeyed up to this; a larger (or malformed) one is capped (ignored)
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})
T = TypeVar("T")
log = structlog.get_logger()


class StatusError(grpc.RpcError):
    """An error shaped like a `grpc.RpcError` raised on this side of the wire (a reply this build cannot read, a
    failed bulk upload): `code()` is the status, `details()` the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self._message = message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 8
    max_total_s: float = 30.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_total_s <= 0 or self.initial_backoff_s <= 0:
            raise ConfigError("retry: max_attempts >= 1, max_total_s > 0 and initial_backoff_s > 0 are required")


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE


def _log_retry(what: str, logger: Any) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        code = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
        logger.warning(
            "rpc.retry", call=what, attempt=state.attempt_number, code=code, sleep_s=round(state.upcoming_sleep, 3)
        )

    return before_sleep


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    cfg: RetryConfig = RetryConfig(),
    codes: frozenset[grpc.StatusCode] = RETRYABLE,
    logger: Any = None,
) -> T:
    """Call `fn` until it succeeds, an error with a status outside `codes` is raised, or the attempts or time run
    out (the last error is raised). `codes` may only narrow `RETRYABLE` (e.g. to UNAVAILABLE alone, for an operator's
    command that must not run twice); `logger` takes the retry lines (None: this module's)."""
    if not codes <= RETRYABLE:
        raise ConfigError(f"retry: only {sorted(c.name for c in RETRYABLE)} may be retried")

    def retryable(exc: BaseException) -> bool:
        return isinstance(exc, grpc.RpcError) and exc.code() in codes

    retrying = Retrying(
        retry=retry_if_exception(retryable),
        stop=stop_after_attempt(cfg.max_attempts) | stop_after_delay(cfg.max_total_s),
        wait=wait_exponential_jitter(
            multiplier=cfg.initial_backoff_s, max=cfg.max_backoff_s, jitter=cfg.initial_backoff_s
        ),
        before_sleep=_log_retry(what, logger if logger is not None else log),
        reraise=True,
    )
    return retrying(fn)


@dataclass(frozen=True)
class BackoffConfig:
    """Capped exponential backoff with jitter, for calls retried until the caller says stop (a learner's)."""

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5  # each delay is drawn uniformly from [(1 - jitter) x d, d]

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s) or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ConfigError("backoff: 0 < initial_s <= max_s, multiplier >= 1 and 0 <= jitter <= 1 are required")


def retry_hint_s(error: BaseException | None) -> float:
    """The wait a refusing server asked for (its `RETRY_AFTER_METADATA` trailer, in ms), capped at
    `MAX_RETRY_HINT_S`; 0.0 when the error carries none or a malformed one."""
    trailers = getattr(error, "trailing_metadata", None)
    if not callable(trailers):
        return 0.0
    try:
        for key, value in trailers() or ():
            if key == RETRY_AFTER_METADATA:
                ms = int(value)
                return min(ms / 1000, MAX_RETRY_HINT_S) if ms > 0 else 0.0
    except (TypeError, ValueError):
        pass
    return 0.0


class Backoff:
    """The delays of one retry sequence: `next_s()` for the next sleep, `reset()` after a success."""

    def __init__(self, cfg: BackoffConfig = BackoffConfig(), rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.rng = rng or random.Random()
        self._d = 0.0

    def next_s(self, error: BaseException | None = None) -> float:
        """The next delay; at least the retry hint `error` carries (`retry_hint_s`), stretched by up to the jitter
        fraction so that the many clients one overload refused do not all come back at the same instant."""
        c = self.cfg
        self._d = c.initial_s if self._d == 0 else min(c.max_s, self._d * c.multiplier)
        delay = self._d * (1 - c.jitter * self.rng.random())
        hint = retry_hint_s(error)
        return max(delay, hint * (1 + c.jitter * self.rng.random())) if hint else delay

    def reset(self) -> None:
        self._d = 0.0


def retry_while(
    fn: Callable[[], T],
    what: str,
    *,
    retry: Callable[[grpc.RpcError], bool],
    wait: Callable[[float], bool],
    backoff: Backoff | None = None,
) -> T:
    """Call `fn` until it succeeds; after each `grpc.RpcError` ask `retry(error)` (False: raise it), log the retry
    and sleep with `wait(seconds)`, which returns True when the caller is stopping (then the error is raised).
    Unlike `call_with_retry`, the decision is taken on every attempt, so a code that means "register again"
    ends the retries whenever it comes, first attempt or tenth."""
    backoff = backoff or Backoff()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except grpc.RpcError as e:
            if not retry(e):
                raise
            sleep_s = backoff.next_s(e)
            log.warning("rpc.retry", call=what, attempt=attempt, code=e.code().name, sleep_s=round(sleep_s, 3))
            if wait(sleep_s):
                raise
