"""A replica that has come to lead tells healthd (`AnnounceLeader`: the epoch it won and its address), and healthd
passes the newest leader on in every heartbeat reply: a learner moves to the new leader at its next heartbeat
instead of when its own calls to the old one fail, which for a leader cut off the network (no reset, no answer)
takes a keepalive or TCP timeout, 5 to 15 s (docs/ha.md).

From a thread of its own, never blocking the replica: at the promotion, then every `ANNOUNCE_EVERY_S` (a healthd
that restarted knows no leader, and healthd names a leader only `ANNOUNCED_FOR_S` after its last word: the rule is
`diloco.core.leadership.AnnouncedLeader`), retried with backoff while healthd does not answer. It stops when healthd
already passes on a newer epoch (this replica was deposed), when healthd refuses it for good (`REFUSED`: logged
once as `replica.announce_refused`) or when the replica stops leading."""

from __future__ import annotations

import threading

import grpc
import structlog

from diloco.core.leadership import ANNOUNCE_EVERY_S
from diloco.errors import ConfigError
from diloco.rpc.retry import Backoff, BackoffConfig
from diloco.rpc.security import SecurityConfig
from diloco.v1 import healthd_pb2, healthd_pb2_grpc

CALL_TIMEOUT_S = 2.0
# answers that another try would get again: no admin token or not the coordinator's certificate, an address healthd
# refuses, a healthd too old to know the call (learners then find the leader by their own calls failing)
REFUSED = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class LeaderAnnouncer:
    """Announces (`epoch`, `address`) to the healthd at `healthd` with the replica's identity and admin token."""

    def __init__(
        self, healthd: str, security: SecurityConfig, epoch: int, address: str, log: structlog.stdlib.BoundLogger
    ) -> None:
        self.healthd, self.security, self.epoch, self.address, self.log = healthd, security, epoch, address, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announce-leader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CALL_TIMEOUT_S + 1.0)

    def _run(self) -> None:
        try:
            channel = self.security.channel(self.healthd, admin=True)
        except ConfigError as e:  # e.g. plaintext to a healthd that is not on loopback
            self.log.error("replica.announce_config", healthd=self.healthd, error=str(e))
            return
        backoff = Backoff(BackoffConfig(initial_s=0.2, max_s=2.0))
        request = healthd_pb2.AnnounceLeaderRequest(epoch=self.epoch, address=self.address)
        said = False
        try:
            while not self._stop.is_set():
                try:
                    reply = healthd_pb2_grpc.HealthDaemonStub(channel).AnnounceLeader(request, timeout=CALL_TIMEOUT_S)
                except grpc.RpcError as e:
                    if e.code() in REFUSED:  # asking again changes nothing: say why, once, and stop
                        self.log.warning(
                            "replica.announce_refused", healthd=self.healthd, code=e.code().name, details=e.details()
                        )
                        return
                    self.log.debug("replica.announce_retry", healthd=self.healthd, code=e.code().name)
                    self._stop.wait(backoff.next_s(e))
                    continue
                backoff.reset()
                if not said:
                    self.log.info("replica.announced", healthd=self.healthd, epoch=self.epoch, address=self.address)
                    said = True
                if reply.epoch > self.epoch:  # healthd knows a newer leader: this replica no longer leads
                    self.log.info("replica.announce_superseded", epoch=self.epoch, newer_epoch=reply.epoch)
                    return
                self._stop.wait(ANNOUNCE_EVERY_S)
        finally:
            channel.close()
