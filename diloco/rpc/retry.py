"""The one retry policy (tenacity): retryable status codes only, exponential backoff with jitter, bounded in
attempts and in total time, one log line per retry. Retried writes must be idempotent (submission ids)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})
T = TypeVar("T")
log = structlog.get_logger()


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


def _log_retry(what: str) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        code = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
        log.warning(
            "rpc.retry", call=what, attempt=state.attempt_number, code=code, sleep_s=round(state.upcoming_sleep, 3)
        )

    return before_sleep


def call_with_retry(fn: Callable[[], T], what: str, cfg: RetryConfig = RetryConfig()) -> T:
    """Call `fn` until it succeeds, a non-retryable error is raised, or the attempts or time run out (the last
    error is raised)."""
    retrying = Retrying(
        retry=retry_if_exception(is_retryable),
        stop=stop_after_attempt(cfg.max_attempts) | stop_after_delay(cfg.max_total_s),
        wait=wait_exponential_jitter(
            multiplier=cfg.initial_backoff_s, max=cfg.max_backoff_s, jitter=cfg.initial_backoff_s
        ),
        before_sleep=_log_retry(what),
        reraise=True,
    )
    return retrying(fn)
