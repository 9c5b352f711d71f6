"""Calls from healthd to the coordinator, on a thread of their own so a slow or absent coordinator never blocks
heartbeats. Given several coordinator addresses (replicas under etcd leadership), healthd follows the leader like a
learner does (`diloco.rpc.coordinators.Coordinators`): a call refused by a standby with UNAVAILABLE naming the
leader is made again there, an unreachable address moves it to the next one.

- Dead workers (`ReportNodeFailure`): queued, retried (`diloco.rpc.retry`, deadline on every call) and, when a
  round of retries fails, put back and tried again after `retry_pause_s` until delivered or healthd stops. A
  non-retryable status drops the report with an error log. The call is idempotent: the coordinator answers
  `known=false` for a worker it already dropped.
- Throughput (`ReportThroughput`): at most once per `throughput_interval_s` per node, sent in batches (every node
  queued since the last call goes in the next one, so the fleet costs one call per interval, not one per node),
  one attempt, dropped when the coordinator does not answer (the next heartbeat brings a fresher value anyway).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from diloco.core.failure import Throughput
from diloco.errors import not_leader
from diloco.rpc.coordinators import Coordinators
from diloco.rpc.limits import MAX_REPORTS
from diloco.rpc.retry import RetryConfig, is_retryable
from diloco.rpc.security import SecurityConfig
from diloco.rpc.vocab import throughput_to_proto
from diloco.v1 import coordinator_pb2
from services.healthd.metrics import HealthdMetrics

# Reconnect quickly after the coordinator comes back (gRPC's default backoff grows to two minutes).


@dataclass(frozen=True)
class FailureReport:
    worker_id: str
    reason: str
    last_seen_unix_s: float
    declared_dead_unix_s: float


@dataclass
class _Pending:
    report: FailureReport
    not_before: float  # monotonic
    attempts: int = 0


class CoordinatorReporter:
    """Reports to the coordinator at `addresses` (one, or every replica's), with the admin identity of `security`."""

    def __init__(
        self,
        addresses: Sequence[str],
        security: SecurityConfig,
        timeout_s: float,
        metrics: HealthdMetrics,
        log: Any,
        clock: Callable[[], float] = time.time,
        retry: RetryConfig | None = None,
        retry_pause_s: float = 1.0,
        throughput_interval_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.addresses = tuple(addresses)
        self._security = security  # TLS identity and admin token
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.log = log
        self.clock = clock
        # Bounded so that stop() is never held up for long by a round of retries.
        self.retry = retry or RetryConfig(
            max_attempts=4, max_total_s=max(3.0, 2 * timeout_s), initial_backoff_s=0.05, max_backoff_s=0.5
        )
        self.retry_pause_s = retry_pause_s
        self.throughput_interval_s = throughput_interval_s
        self._monotonic = monotonic
        self._cond = threading.Condition()
        self._failures: deque[_Pending] = deque()
        self._throughput: dict[str, Throughput] = {}
        self._throughput_sent_at: dict[str, float] = {}
        self._stopping = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self._coordinators: Coordinators | None = None

    # --- producer side (any thread, never blocks on the network) ----------------------------------------------
    def report_failure(self, report: FailureReport) -> None:
        with self._cond:
            if self._stopping:
                return
            self._failures.append(_Pending(report, not_before=self._monotonic()))
            self._cond.notify_all()

    def offer_throughput(self, node_id: str, throughput: Throughput) -> bool:
        """Queue `throughput` for the coordinator unless this node's last one was queued less than
        `throughput_interval_s` ago. Returns whether it was queued."""
        now = self._monotonic()
        with self._cond:
            if self._stopping:
                return False
            last = self._throughput_sent_at.get(node_id)
            if last is not None and now - last < self.throughput_interval_s:
                return False
            self._throughput_sent_at[node_id] = now
            self._throughput[node_id] = throughput
            self._cond.notify_all()
            return True

    def forget(self, node_id: str) -> None:
        """The node is gone (dead or left): drop its throughput state."""
        with self._cond:
            self._throughput.pop(node_id, None)
            self._throughput_sent_at.pop(node_id, None)

    def leader_announced(self, address: str) -> None:
        """A replica announced that it leads (AnnounceLeader, checked by the servicer): report there from now on,
        as a refusal naming it would move this reporter (a call in flight to the old leader ends CANCELLED and is
        retried there)."""
        with self._cond:
            coordinators = self._coordinators
        if coordinators is not None and address in coordinators.addresses:
            coordinators.failover(str(not_leader(address)))

    def idle(self) -> bool:
        """Nothing queued and no call in flight (for tests and shutdown logs)."""
        with self._cond:
            return not self._failures and not self._throughput and not self._busy

    def pending_failures(self) -> int:
        with self._cond:
            return len(self._failures)

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._coordinators = Coordinators(
                self.addresses, self._security, admin=True, who="healthd", log=lambda: self.log
            )
            self._thread = threading.Thread(target=self._run, name="healthd-reporter", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; reports still queued are logged and dropped (a restarted healthd rebuilds its table
        from heartbeats). Safe to call more than once."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, coordinators = self._thread, self._coordinators
            self._coordinators = None
        if coordinators is not None:
            coordinators.close()  # cancels a call in flight
        if thread is not None:
            thread.join(timeout_s)
        with self._cond:
            dropped = [p.report.worker_id for p in self._failures]
            self._failures.clear()
        if dropped:
            self.log.warning("node.report_dropped", node_ids=dropped, reason="healthd stopping")

    # --- the reporter thread ----------------------------------------------------------------------------------
    def _next_job(self) -> _Pending | list[tuple[str, Throughput]] | None:
        """Wait for work: a due failure report first, else every queued throughput report (one batch, at most
        `MAX_REPORTS`). None: stopping."""
        with self._cond:
            while True:
                self._busy = False
                if self._stopping:
                    return None
                now = self._monotonic()
                due = [p for p in self._failures if p.not_before <= now]
                if due:
                    self._failures.remove(due[0])
                    self._busy = True
                    return due[0]
                if self._throughput:
                    batch = list(itertools.islice(self._throughput.items(), MAX_REPORTS))
                    for node_id, _ in batch:
                        del self._throughput[node_id]
                    self._busy = True
                    return batch
                wake = min((p.not_before for p in self._failures), default=None)
                self._cond.wait(None if wake is None else max(0.0, wake - now))

    def _run(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            try:
                if isinstance(job, _Pending):
                    self._send_failure(job)
                else:
                    self._send_throughput(job)
            except Exception as e:  # never let the thread die; a closed channel during stop lands here
                if not self._stopping:
                    self.log.error("reporter.error", error=repr(e))

    def _send_failure(self, pending: _Pending) -> None:
        r = pending.report
        coordinators = self._coordinators
        if coordinators is None:
            return
        req = coordinator_pb2.ReportNodeFailureRequest(
            worker_id=r.worker_id,
            reason=r.reason,
            last_seen_unix_s=r.last_seen_unix_s,
            declared_dead_unix_s=r.declared_dead_unix_s,
        )
        pending.attempts += 1
        try:
            resp = coordinators.call(
                lambda stub: stub.ReportNodeFailure(req, timeout=self.timeout_s), "ReportNodeFailure", self.retry
            )
        except grpc.RpcError as e:
            if self._stopping:
                return
            self.metrics.report_failures.inc()
            retry = is_retryable(e)
            self.log.warning(
                "node.report_failed",
                node_id=r.worker_id,
                code=e.code().name,
                detail=e.details(),
                attempts=pending.attempts,
                will_retry=retry,
                retry_in_s=self.retry_pause_s if retry else None,
            )
            if retry:
                pending.not_before = self._monotonic() + self.retry_pause_s
                with self._cond:
                    self._failures.append(pending)
            return
        self.metrics.reports.inc()
        self.log.info(
            "node.reported",
            node_id=r.worker_id,
            known=resp.known,
            reassigned_shards=list(resp.reassigned_shards),
            silence_s=round(r.declared_dead_unix_s - r.last_seen_unix_s, 3),
            report_latency_s=round(self.clock() - r.declared_dead_unix_s, 3),
            attempts=pending.attempts,
            coordinator=coordinators.address,
        )

    def _send_throughput(self, batch: list[tuple[str, Throughput]]) -> None:
        """One call for every learner heard since the last one (the coordinator skips those it no longer knows)."""
        coordinators = self._coordinators
        if coordinators is None:
            return
        req = coordinator_pb2.ReportThroughputRequest(
            reports=[
                coordinator_pb2.ThroughputReport(worker_id=node_id, throughput=throughput_to_proto(tp))
                for node_id, tp in batch
            ]
        )
        try:
            coordinators.stub.ReportThroughput(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            coordinators.moved_by(e)  # the next batch goes to the leader
            self.metrics.throughput_dropped.inc(len(batch))
            self.log.debug("throughput.dropped", nodes=len(batch), code=e.code().name)
            return
        self.metrics.throughput_forwarded.inc(len(batch))
