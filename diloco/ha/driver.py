"""The leadership driver: one thread that feeds the pure `Leadership` machine with etcd's answers and the
monotonic clock (ALGORITHM.md section 11).

Each turn of the loop applies what time has earned (`tick`), asks the machine what is due (`due`), does that one
call against etcd (`EtcdElection`, bounded by its `call_timeout_s`) and reports the outcome; when nothing is due
it sleeps until `next_deadline()` or until woken (step-down, stop). The machine is guarded by one lock that is
never held during a call to etcd, so `may_accept()` answers at once from any thread, and it turns false at the
fence time by the clock alone, even while the driver thread is stuck in a call.

The driver keeps what the machine does not: the lease id and epoch of the key it created, so that it can renew
and resign. When leadership is lost without a resignation (deposed, lease gone) it revokes that lease, best
effort.

The newest holder wins: `hold(version)` (this standby's state is at `version`: applied from the leader, or resumed from
its checkpoint) is fed to the machine and published to etcd under a lease of this replica's own (granted on the first
publish, kept alive every `renew_interval_s` while it follows, left to expire once it leads); a follower's read of the
leader key also reads the other standbys' entries (`EtcdElection.observe_all`) and feeds them to the machine (`peers`).
These calls are upkeep between the machine's actions: a failure is retried at the next turn and changes no role.

Lifecycle: `start()` then `stop()`, each safe to call twice. `stop(resign=True)` steps down at once (may_accept
turns false before it returns), joins the thread and gives the key back, so another replica takes over without
waiting for the lease to expire. `stop(resign=False)` only stops the thread, as a hung or killed process would:
nothing more reaches etcd, `may_accept()` turns false at the fence time, and etcd expires the lease.
"""

from __future__ import annotations

import math
import threading
import time

import structlog

from diloco import log
from diloco.core.leadership import (
    Action,
    EpochCheck,
    LeaderInfo,
    Leadership,
    LeadershipConfig,
    LeadershipView,
    Role,
    Transition,
)
from diloco.errors import ConfigError
from diloco.ha.etcd import EtcdElection, EtcdUnavailable, Lost

_HOLDING = (Role.LEADER, Role.FENCED, Role.STEPPING_DOWN)
MAX_IDLE_WAIT_S = 1.0  # with nothing due the loop still wakes this often (stop is noticed through `_wake`)


class LeadershipDriver:
    def __init__(
        self,
        replica_id: str,
        address: str,
        election: EtcdElection,
        cfg: LeadershipConfig = LeadershipConfig(),
    ) -> None:
        if not float(cfg.lease_ttl_s).is_integer():
            raise ConfigError(f"lease_ttl_s must be a whole number of seconds for etcd, got {cfg.lease_ttl_s}")
        timeout = election.cfg.call_timeout_s
        if not timeout < cfg.fence_after_s - cfg.renew_interval_s:
            raise ConfigError(
                f"etcd call_timeout_s ({timeout}) must be less than lease_ttl_s - safety_margin_s - renew_interval_s "
                f"({cfg.fence_after_s - cfg.renew_interval_s:g}), so a hung renewal leaves time for another"
            )
        self.cfg = cfg
        self._machine = Leadership(replica_id, address, cfg)
        self._election = election
        self._clock = time.monotonic
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._held: tuple[int, int] | None = None  # (lease id, epoch) of the key this replica created
        self._failures: dict[Action, int] = {}  # failed calls in a row, per action (only the first is a warning)
        # the standby entry (the newest holder wins): the version to publish, the one published, its lease and when
        # that lease is renewed next
        self._hold: int | None = None
        self._published: int | None = None
        self._entry_lease: int | None = None
        self._entry_renew_at = 0.0
        self._log: structlog.stdlib.BoundLogger = log.get("ha", replica_id=replica_id)

    # --- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stopped:
                return
            self._thread = threading.Thread(target=self._run, name="leadership", daemon=True)
        self._thread.start()

    def stop(self, resign: bool = True) -> None:
        """Stop the driver; with `resign`, step down at once and give the key back (one bounded call)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            if resign:  # not leading from here on, whatever the thread is doing
                self._emit(self._machine.step_down(self._clock(), "stopping"))
                self._emit(self._machine.close(self._clock(), "stopped"))
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if not resign:
            self._election.close()
            return
        if self._held is not None:
            lease_id, epoch = self._held
            try:
                self._election.resign(lease_id, epoch)
                self._held = None
            except EtcdUnavailable as e:
                self._log.warning("leadership.resign_failed", epoch=epoch, error=str(e))
        self._election.close()

    # --- what the rest of the process asks ------------------------------------------------------------------
    def may_accept(self) -> bool:
        """Accept work and broadcast only while this is True (leading, and before the fence time)."""
        with self._lock:
            return self._machine.may_accept(self._clock())

    def view(self) -> LeadershipView:
        with self._lock:
            self._emit(self._machine.tick(self._clock()))
            return self._machine.view()

    def require_epoch(self, message_epoch: int) -> EpochCheck:
        """Refuse (FailedPrecondition, naming the current epoch) a message stamped with an older epoch."""
        with self._lock:
            return self._machine.require_epoch(message_epoch)

    def caught_up(self) -> None:
        """A leader vouched for this replica's state (`Leadership.caught_up`): it may take over at once."""
        with self._lock:
            was = self._machine.behind
            self._machine.caught_up(self._clock())
        if was:
            self._log.info("leadership.caught_up")
            self._wake.set()

    def hold(self, version: int) -> None:
        """This standby's state is at `version` (applied, or resumed from its checkpoint): publish it to the others."""
        with self._lock:
            self._machine.hold(version, self._clock())
            self._hold = version
        self._wake.set()

    def step_down(self, reason: str = "asked to step down") -> None:
        """Stop leading at once and give the key back; this replica may campaign again after rejoin_after_s."""
        with self._lock:
            self._emit(self._machine.step_down(self._clock(), reason))
        self._wake.set()

    # --- the loop -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug: leadership lapses safely (may_accept turns false at the fence time)
            self._log.exception("leadership.driver_failed")

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                now = self._clock()
                self._emit(self._machine.tick(now))
                action = self._machine.due(now)
                deadline = self._machine.next_deadline()
                following = self._machine.role is Role.FOLLOWER
            if following:
                self._keep_entry()
            if action is Action.NONE:
                wait = MAX_IDLE_WAIT_S if deadline is None else deadline - self._clock()
                if self._entry_lease is not None and following:
                    wait = min(wait, self._entry_renew_at - self._clock())
                self._wake.wait(min(max(wait, 0.0), MAX_IDLE_WAIT_S))
                self._wake.clear()
                continue
            try:
                self._perform(action)
            except EtcdUnavailable as e:
                self._failed(action, e)
            else:
                self._failures.pop(action, None)
            self._drop_lost_lease()

    def _perform(self, action: Action) -> None:
        if action is Action.CAMPAIGN:
            self._campaign()
        elif action is Action.RENEW:
            assert self._held is not None, "a leader holds a lease"
            sent = self._clock()
            alive = self._election.renew(self._held[0])
            with self._lock:
                if alive:
                    self._emit(self._machine.renewed(sent, self._clock()))
                else:
                    self._emit(self._machine.renew_failed(self._clock(), True, "keepalive: no such lease"))
        elif action is Action.OBSERVE:
            with self._lock:
                following = self._machine.role is Role.FOLLOWER
            if following:  # with the other standbys' entries
                holder, peers = self._election.observe_all()
                with self._lock:
                    self._machine.peers(peers, self._clock())
                    self._emit(self._machine.observed(holder, self._clock()))
            else:
                holder = self._election.observe()
                with self._lock:
                    self._emit(self._machine.observed(holder, self._clock()))
        elif action is Action.RESIGN:
            if self._held is not None:
                self._election.resign(*self._held)
                self._held = None
            with self._lock:
                self._emit(self._machine.resigned(self._clock()))

    def _campaign(self) -> None:
        with self._lock:
            self._emit(self._machine.campaign_started(self._clock()))
        sent = self._clock()  # before the lease is granted: the lease lives at least until sent + TTL
        m = self._machine
        try:
            result = self._election.campaign(m.replica_id, m.address, int(self.cfg.lease_ttl_s))
        except EtcdUnavailable as e:
            with self._lock:
                if m.role is Role.CANDIDATE:
                    self._emit(m.campaign_failed(self._clock(), str(e)))
            raise
        with self._lock:
            if not isinstance(result, Lost):
                self._held = (result.lease_id, result.epoch)  # resigned later even if stopped meanwhile
            if m.role is not Role.CANDIDATE:
                return  # stopped (closed) during the campaign
            if isinstance(result, Lost):
                self._emit(m.lost(result.holder, self._clock()))
            else:
                self._emit(m.won(result.epoch, sent, self._clock()))

    def _keep_entry(self) -> None:
        """Upkeep of this standby's entry (module docstring); a failure is retried at the next turn."""
        version = self._hold
        if version is None:
            return
        try:
            if self._entry_lease is None:
                self._entry_lease, self._published = self._election.grant(int(self.cfg.lease_ttl_s)), None
                self._entry_renew_at = self._clock() + self.cfg.renew_interval_s
            if self._published != version:
                self._election.publish(self._machine.replica_id, version, self._entry_lease)
                self._published = version
            if self._clock() >= self._entry_renew_at:
                self._entry_renew_at = self._clock() + self.cfg.renew_interval_s
                if not self._election.renew(self._entry_lease):
                    self._entry_lease = None  # expired: granted and published again at the next turn
        except EtcdUnavailable as e:
            self._log.debug("leadership.entry_failed", version=version, error=str(e))

    def _failed(self, action: Action, err: EtcdUnavailable) -> None:
        with self._lock:
            now = self._clock()
            if action is Action.RENEW:
                self._emit(self._machine.renew_failed(now, False, str(err)))
            elif action is Action.OBSERVE:
                self._emit(self._machine.observe_failed(now))
            elif action is Action.RESIGN:
                self._emit(self._machine.resign_failed(now))
            # CAMPAIGN: reported by _campaign
        n = self._failures[action] = self._failures.get(action, 0) + 1
        fields = {"action": action.value, "failures_in_a_row": n, "error": str(err), "etcd": self._election.endpoint}
        if n == 1:
            self._log.warning("leadership.call_failed", **fields)
        else:
            self._log.debug("leadership.call_failed", **fields)

    def _drop_lost_lease(self) -> None:
        """Leadership ended without a resignation (deposed, lease gone): revoke the lease, best effort."""
        with self._lock:
            holding = self._machine.role in _HOLDING
        if self._held is None or holding:
            return
        lease_id, _ = self._held
        self._held = None
        try:
            self._election.revoke(lease_id)
        except EtcdUnavailable as e:
            self._log.info("leadership.revoke_failed", lease_id=lease_id, error=str(e))

    def _emit(self, transitions: list[Transition]) -> None:
        """Log each transition (called with the lock held): at info when leadership starts, ends or is given
        back; campaign attempts and a follower learning the holder at debug (they repeat while etcd is away). `etcd`:
        the endpoint calls go to now."""
        for t in transitions:
            leader: LeaderInfo | None = self._machine.leader
            notable = Role.CANDIDATE not in (t.previous, t.role) or t.role is Role.LEADER or t.role in _HOLDING
            emit = self._log.info if notable else self._log.debug
            emit(
                "leadership.changed",
                previous=t.previous.value,
                role=t.role.value,
                epoch=t.epoch,
                reason=t.reason,
                leader=leader.replica_id if leader else None,
                at=round(t.at, 6) if math.isfinite(t.at) else None,
                etcd=self._election.endpoint,
            )
