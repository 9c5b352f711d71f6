"""Coordinator leadership (ALGORITHM.md section 11) as a state machine driven by the caller's clock.

Who leads is decided in etcd: a key held under a lease. Creating the key wins; the key's creation revision is the
leadership *epoch*. This module holds none of that I/O: it never reads a clock (`now` is a parameter of every
call) and never talks to etcd. A driver (`diloco.ha.driver`) asks `due(now)` what to do, does it against etcd,
and feeds the outcome back; `next_deadline()` says when something becomes due if nothing else happens.

States and transitions (each reported once, as a `Transition`):

    FOLLOWER  --campaign_started-->              CANDIDATE
    CANDIDATE --won(epoch > known)-->            LEADER         "won epoch E"
    CANDIDATE --won(epoch <= known)-->           FENCED         (etcd's revisions went backwards: never lead)
    CANDIDATE --lost(leader) / campaign_failed--> FOLLOWER
    LEADER    --now >= fence_at-->               FENCED         "lease not renewed for X s"
    LEADER    --renew_failed(lease_lost)-->      FOLLOWER       "the lease expired at etcd"
    LEADER    --observed(another or no holder)--> FOLLOWER      "deposed"
    LEADER    --step_down-->                     STEPPING_DOWN
    FENCED, STEPPING_DOWN --resigned-->          FOLLOWER       (campaigns again after `rejoin_after_s`)
    FENCED, STEPPING_DOWN --observed(another or no holder)--> FOLLOWER
    any       --close-->                         STOPPED        (terminal)

What is due in each state (`due(now)`):

    FOLLOWER       CAMPAIGN when no leader is known (once any hold-off has passed), else OBSERVE the key every
                   `observe_interval_s`; a failed call is retried after `retry_interval_s`
    CANDIDATE      nothing: the campaign is in flight
    LEADER         RENEW the lease every `renew_interval_s` (after a failure: every `retry_interval_s`), and
                   OBSERVE the key every `renew_interval_s` (someone may have deleted it)
    FENCED         RESIGN (delete the key if we still own it, revoke the lease), retried until it succeeds
    STEPPING_DOWN  RESIGN, likewise
    STOPPED        nothing

Fencing. A renewal sent at `t` keeps the lease alive at etcd until at least `t + lease_ttl_s` (etcd receives it
after `t`). The leader therefore accepts work and broadcasts only while `now < fence_at = t_last + lease_ttl_s -
safety_margin_s`, `t_last` being the send time of the last renewal etcd confirmed (at first: when the lease was
granted). `may_accept(now)` compares with `now` itself, so it turns false at `fence_at` even if nobody called
`tick` (a driver stuck in a call); the margin covers clock-rate differences and the time between a check and the
work it allows. A fenced leader never resumes: it resigns and, if it wins again, leads under a new, higher epoch.

Epochs never go backwards: `epoch` is the highest epoch this replica has seen (its own or an observed leader's); an
observation older than it is ignored and a win at or below it is not taken. A message stamped with an older epoch
is refused (`check_epoch` / `require_epoch`: FAILED_PRECONDITION naming the current epoch). A message stamped with
a newer epoch is reported as AHEAD and changes nothing: only etcd says who leads, so a message can never raise the
epoch (a corrupt one would otherwise lock out every real leader).

Who may take over. A replica reads the key and the standbys' entries before its first campaign (`observed`), so
it never campaigns knowing nothing. A replica that sees another one lead before it has led or been vouched for joins
a running job: its state (a checkpoint, perhaps written when it led before dying) may be older than a standby's, so
it is *behind* until a leader vouches for its state (`caught_up`: the leader accepted its acknowledgement of a
version it applied). While behind it campaigns only `orphan_after_s` after the key went, so an up-to-date standby
takes over first; if none does, it leads with what it has. (Seen twice in the soak of `diloco bench --only ha`: a
leader killed and restarted at once campaigned as its old key expired, won against the standby and served from its
checkpoint, a version behind what learners held. First the restart read the key while its old lease still held
it; later, on a quiet machine, the restart came up just after the lease expired and, campaigning before any read,
won in the moment before the standby did: hence the read first, where the standby's entry makes it defer.)

The newest holder wins. Each replica that follows publishes the version its state is at (`hold`: the newest it
applied from a leader, or the one it resumed from its own checkpoint) under a key bound to a lease of its own, so
the entry goes with it; followers read the others' entries with the leader key (`peers`). A replica that knows a
live one holding a newer version than its own (`ahead`) campaigns only `2 x orphan_after_s` after the key went;
one that holds the newest version campaigns at once when a leader vouched for it, else (behind) after
`orphan_after_s`. So the replica holding the newest version takes the key first, vouched for or not, and an
election still happens, bounded, when that one does not campaign after all (it died, or cannot reach etcd). Equal
versions do not defer: the one a leader vouched for goes first, else etcd picks one. (Seen in the soak at 852ca20:
the standby restarted after a kill had applied the leader's newest version, 10 ms before the leader, which had
published it with no standby in step, took its acknowledgement; the leader was killed, and both that standby and
the leader's restart, holding its older checkpoint, were behind and waited the same `orphan_after_s`. The restart
won, and the learners' version went back by one. Until then an entry held only a version a leader had vouched for.)

Time never runs backwards inside the machine: a `now` older than the latest one seen is taken as the latest.
The machine is not thread-safe; the caller serializes calls.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from diloco.errors import ConfigError, FailedPrecondition, InvalidArgument

MAX_ADDRESS_CHARS = 256
MAX_REPLICA_ID_CHARS = 128


class Role(StrEnum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    LEADER = "leader"
    FENCED = "fenced"
    STEPPING_DOWN = "stepping_down"
    STOPPED = "stopped"


class Action(StrEnum):
    """What the driver should do now."""

    NONE = "none"  # wait until next_deadline() (or an outside event)
    CAMPAIGN = "campaign"
    RENEW = "renew"
    OBSERVE = "observe"
    RESIGN = "resign"


class EpochCheck(StrEnum):
    CURRENT = "current"  # the epoch this replica knows
    STALE = "stale"  # older: refuse (FAILED_PRECONDITION) and tell the sender the current epoch
    AHEAD = "ahead"  # newer than any this replica has seen: it has not observed that leader yet


@dataclass(frozen=True)
class LeadershipConfig:
    lease_ttl_s: float = 2.0
    renew_interval_s: float = 0.5
    # The leader stops accepting this long before its lease could expire at etcd.
    safety_margin_s: float = 0.5
    # After a failed call (campaign, renew, observe, resign): try again this soon.
    retry_interval_s: float = 0.1
    # A follower reads the leader key this often (it campaigns as soon as the key is gone).
    observe_interval_s: float = 0.1
    # A replica that stepped down or was fenced campaigns again only after this, so another one takes over.
    rejoin_after_s: float = 2.0
    # A replica that joined while another led, and has not been in step with a leader since (`caught_up`),
    # campaigns only once the leader key has been gone this long (twice this long when it knows a live replica
    # holding a newer version: `ahead`): an up-to-date standby takes over first.
    orphan_after_s: float = 4.0

    def __post_init__(self) -> None:
        for name in (
            "lease_ttl_s",
            "renew_interval_s",
            "safety_margin_s",
            "retry_interval_s",
            "observe_interval_s",
            "orphan_after_s",
        ):
            _positive_finite(name, getattr(self, name))
        r = _seconds(self.rejoin_after_s)
        if r is None or r < 0:
            raise ConfigError(f"rejoin_after_s must be a finite number >= 0 (seconds), got {self.rejoin_after_s!r}")
        if not self.safety_margin_s < self.lease_ttl_s:
            raise ConfigError(
                f"safety_margin_s ({self.safety_margin_s}) must be less than lease_ttl_s ({self.lease_ttl_s})"
            )
        if not self.renew_interval_s < self.fence_after_s:
            raise ConfigError(
                f"renew_interval_s ({self.renew_interval_s}) must be less than lease_ttl_s - safety_margin_s "
                f"({self.fence_after_s}), or the leader fences itself between two renewals"
            )
        if not self.retry_interval_s <= self.renew_interval_s:
            raise ConfigError(
                f"retry_interval_s ({self.retry_interval_s}) must be <= renew_interval_s ({self.renew_interval_s})"
            )

    @property
    def fence_after_s(self) -> float:
        """How long after the last confirmed renewal (its send time) the leader is fenced."""
        return self.lease_ttl_s - self.safety_margin_s


def _seconds(value: object) -> float | None:
    """`value` as a finite number of seconds, or None when it is not one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _positive_finite(name: str, value: object) -> None:
    s = _seconds(value)
    if s is None or s <= 0:
        raise ConfigError(f"{name} must be a finite number > 0 (seconds), got {value!r}")


@dataclass(frozen=True)
class LeaderInfo:
    """Who holds the leader key: the replica's id, the address it serves on, and the epoch (the key's creation
    revision)."""

    replica_id: str
    address: str
    epoch: int

    def __post_init__(self) -> None:
        _check_identity(self.replica_id, self.address)
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise InvalidArgument(f"epoch must be an integer >= 1 (an etcd revision), got {self.epoch!r}")


def _check_identity(replica_id: str, address: str) -> None:
    if not isinstance(replica_id, str) or not replica_id.strip() or not replica_id.isprintable():
        raise InvalidArgument(f"replica_id must be a non-empty printable string, got {replica_id!r}")
    if len(replica_id) > MAX_REPLICA_ID_CHARS:
        raise InvalidArgument(f"replica_id is {len(replica_id)} characters; at most {MAX_REPLICA_ID_CHARS}")
    if not isinstance(address, str) or not address.isprintable():
        raise InvalidArgument(f"address must be a printable string (host:port), got {address!r}")
    if len(address) > MAX_ADDRESS_CHARS:
        raise InvalidArgument(f"address is {len(address)} characters; at most {MAX_ADDRESS_CHARS}")


@dataclass(frozen=True)
class Transition:
    """One change of role. `epoch` is the known epoch after it."""

    previous: Role
    role: Role
    at: float
    epoch: int
    reason: str


@dataclass(frozen=True)
class LeadershipView:
    """A read-only snapshot. `leader` is the holder this replica knows of (itself when leading); `fence_at` is
    when a leader stops accepting (None when not leading); `ahead`: the live standbys it knows to hold a newer
    version than its own (it defers to them)."""

    replica_id: str
    role: Role
    epoch: int
    leader: LeaderInfo | None
    fence_at: float | None
    last_renewed_at: float | None
    ahead: tuple[str, ...] = ()


class Duty(StrEnum):
    """What a coordinator replica's process does, given its leadership view (`duty`)."""

    SERVE = "serve"  # lead: serve learners under the view's epoch (a standby is promoted)
    FOLLOW = "follow"  # a hot standby of `view.leader`
    WAIT = "wait"  # nobody known to lead (a campaign is due or in flight): hold what it has
    RETIRE = "retire"  # it served and lost leadership (fenced, deposed, stepped down): stop serving and exit


def duty(view: LeadershipView, serving: bool) -> Duty:
    """The process's duty in `view`; `serving`: it serves as leader now. A replica that served and lost
    leadership retires: its state may be behind the new leader's, so it never turns back into a standby or a
    leader in the same process (a supervisor restarts it, and it comes back as a standby)."""
    if view.role is Role.LEADER:
        return Duty.SERVE
    if serving:
        return Duty.RETIRE
    if view.role is Role.STOPPED:
        return Duty.RETIRE
    leader = view.leader
    if leader is not None and leader.replica_id != view.replica_id:
        return Duty.FOLLOW
    return Duty.WAIT


def compare_epoch(message_epoch: int, known_epoch: int) -> EpochCheck:
    """How a message's leadership epoch relates to the one this replica knows."""
    if isinstance(message_epoch, bool) or not isinstance(message_epoch, int) or message_epoch < 0:
        raise InvalidArgument(f"epoch must be an integer >= 0, got {message_epoch!r}")
    if message_epoch < known_epoch:
        return EpochCheck.STALE
    return EpochCheck.AHEAD if message_epoch > known_epoch else EpochCheck.CURRENT


class Leadership:
    """One replica's view of coordinator leadership. Inputs are the outcomes of the driver's etcd calls."""

    def __init__(self, replica_id: str, address: str, cfg: LeadershipConfig = LeadershipConfig()) -> None:
        _check_identity(replica_id, address)
        self.cfg = cfg
        self.replica_id = replica_id
        self.address = address
        self.role = Role.FOLLOWER
        self.epoch = 0  # the highest epoch seen; 0: none yet
        self.leader: LeaderInfo | None = None
        self._now = -math.inf  # the latest `now` seen
        self._last_renewed: float | None = None  # send time of the last confirmed renewal (or of the grant)
        self._renew_at = math.inf
        self._observe_at = -math.inf  # due at once
        self._campaign_at = -math.inf
        self._resign_at = -math.inf
        # Behind: the first read of the key found a leader (this replica joins a running job, e.g. restarted after
        # it died leading: its state may be older than a standby's) and no leader has vouched for its state since
        # (`caught_up`). While behind it campaigns only `orphan_after_s` after the key went (`_leaderless_since`).
        self._first_read = True  # no read of the key yet: observe before any campaign
        self._trusted = False  # it led, or a leader vouched for it, in this process: never behind again
        self.behind = False
        self._leaderless_since: float | None = None
        # The newest holder wins: the version this replica's state is at (`hold`; None: none yet), the other
        # live standbys' (`peers`) and those of them holding a newer one (`ahead`: it defers to them).
        self.held: int | None = None
        self._peers: dict[str, int] = {}
        self.ahead: tuple[str, ...] = ()

    # --- queries --------------------------------------------------------------------------------------------
    def may_accept(self, now: float) -> bool:
        """True only while leading and before the fence time: accept work and broadcast only then."""
        fence = self.fence_at
        return self.role is Role.LEADER and fence is not None and now < fence

    @property
    def fence_at(self) -> float | None:
        if self.role is not Role.LEADER or self._last_renewed is None:
            return None
        return self._last_renewed + self.cfg.fence_after_s

    def check_epoch(self, message_epoch: int) -> EpochCheck:
        return compare_epoch(message_epoch, self.epoch)

    def require_epoch(self, message_epoch: int) -> EpochCheck:
        """`check_epoch`, raising FailedPrecondition (naming the current epoch and leader) for a stale one."""
        check = self.check_epoch(message_epoch)
        if check is EpochCheck.STALE:
            where = f" (leader {self.leader.replica_id} at {self.leader.address})" if self.leader else ""
            raise FailedPrecondition(
                f"leadership epoch {message_epoch} is older than the current epoch {self.epoch}{where}; "
                f"find the current leader and resend with epoch {self.epoch}"
            )
        return check

    def view(self) -> LeadershipView:
        return LeadershipView(
            self.replica_id, self.role, self.epoch, self.leader, self.fence_at, self._last_renewed, self.ahead
        )

    def due(self, now: float) -> Action:
        """What the driver should do at `now` (call `tick(now)` first so time-driven transitions are applied)."""
        now = max(now, self._now)
        if self.role is Role.FOLLOWER:
            if self.leader is None and not self._first_read and now >= self._may_campaign_at():
                return Action.CAMPAIGN
            if now >= self._observe_at:
                return Action.OBSERVE
        elif self.role is Role.LEADER:
            fence = self.fence_at
            if fence is not None and now >= fence:
                return Action.NONE  # a tick fences it; nothing is due for a leader past its fence time
            if now >= self._renew_at:
                return Action.RENEW
            if now >= self._observe_at:
                return Action.OBSERVE
        elif self.role in (Role.FENCED, Role.STEPPING_DOWN) and now >= self._resign_at:
            return Action.RESIGN
        return Action.NONE

    def next_deadline(self) -> float | None:
        """The earliest time at which something becomes due or a tick changes something (None: only an input
        can change anything)."""
        if self.role is Role.FOLLOWER:
            if self.leader is None and not self._first_read:
                return min(self._may_campaign_at(), self._observe_at)
            return self._observe_at
        if self.role is Role.LEADER:
            fence = self.fence_at
            return min(self._renew_at, self._observe_at, fence if fence is not None else math.inf)
        if self.role in (Role.FENCED, Role.STEPPING_DOWN):
            return self._resign_at
        return None

    def _may_campaign_at(self) -> float:
        """The newest holder first (module docstring): at once when vouched for, `orphan_after_s` after the key
        went when behind, `2 x orphan_after_s` when another live replica holds a newer version."""
        if not self.behind and not self.ahead:
            return self._campaign_at
        since = self._leaderless_since if self._leaderless_since is not None else self._now
        return max(self._campaign_at, since + self.cfg.orphan_after_s * (2 if self.ahead else 1))

    # --- inputs ---------------------------------------------------------------------------------------------
    def caught_up(self, now: float) -> None:
        """A leader vouched for this replica's state (it acknowledged a version the standby applied): no longer
        behind."""
        self._advance(now)
        self._trusted, self.behind = True, False

    def hold(self, version: int, now: float) -> None:
        """This replica's state is at `version` (applied from a leader, or resumed from its checkpoint): what it
        publishes to the other replicas."""
        self._advance(now)
        _check_version(version)
        self.held = version
        self._ahead_again()

    def peers(self, versions: Mapping[str, int], now: float) -> None:
        """The versions the other live standbys published (a read of their entries; this replica's own is left
        out). Replaces what was known before."""
        self._advance(now)
        for version in versions.values():
            _check_version(version)
        self._peers = {r: v for r, v in versions.items() if r != self.replica_id}
        self._ahead_again()

    def _ahead_again(self) -> None:
        mine = -1 if self.held is None else self.held
        self.ahead = tuple(sorted(r for r, v in self._peers.items() if v > mine))

    def tick(self, now: float) -> list[Transition]:
        """Apply what time alone earns: a leader past its fence time is FENCED."""
        now = self._advance(now)
        fence = self.fence_at
        if self.role is Role.LEADER and fence is not None and now >= fence:
            assert self._last_renewed is not None
            self._resign_at = now
            return [self._move(Role.FENCED, now, f"lease not renewed for {now - self._last_renewed:.3f} s")]
        return []

    def campaign_started(self, now: float) -> list[Transition]:
        out = self.tick(now)
        self._expect(Role.FOLLOWER, "campaign_started")
        out.append(self._move(Role.CANDIDATE, self._now, "campaigning"))
        return out

    def won(self, epoch: int, lease_granted_at: float, now: float) -> list[Transition]:
        """The campaign created the key under a lease granted by a request sent at `lease_granted_at`."""
        _check_epoch_value(epoch)
        out = self.tick(now)
        self._expect(Role.CANDIDATE, "won")
        now = self._now
        self._first_read, self._leaderless_since = False, None  # a campaign's outcome is a read of the key too
        if epoch <= self.epoch:
            # etcd's revisions went backwards (its data was lost): leading under this epoch would be refused
            # by everyone who saw the old one. Give the key back; the next wins come with higher revisions.
            self._resign_at = now
            out.append(self._move(Role.FENCED, now, f"won epoch {epoch}, not above the known epoch {self.epoch}"))
            return out
        self.epoch = epoch
        self.leader = LeaderInfo(self.replica_id, self.address, epoch)
        self._trusted, self.behind = True, False
        self._last_renewed = min(lease_granted_at, now)
        self._renew_at = self._last_renewed + self.cfg.renew_interval_s
        self._observe_at = now + self.cfg.renew_interval_s
        out.append(self._move(Role.LEADER, now, f"won epoch {epoch}"))
        out.extend(self.tick(now))  # a campaign slower than the fence time leaves nothing to lead with
        return out

    def lost(self, leader: LeaderInfo, now: float) -> list[Transition]:
        """The key exists: `leader` holds it."""
        out = self.tick(now)
        self._expect(Role.CANDIDATE, "lost")
        self._joins()
        self._first_read, self._leaderless_since = False, None
        self._learn(leader)
        self._observe_at = self._now + self.cfg.observe_interval_s
        out.append(self._move(Role.FOLLOWER, self._now, f"{leader.replica_id} leads epoch {leader.epoch}"))
        return out

    def campaign_failed(self, now: float, reason: str) -> list[Transition]:
        """The campaign's outcome is unknown (etcd unreachable, timeout); the driver gave back its lease."""
        out = self.tick(now)
        self._expect(Role.CANDIDATE, "campaign_failed")
        self._campaign_at = self._now + self.cfg.retry_interval_s
        out.append(self._move(Role.FOLLOWER, self._now, f"campaign failed: {reason}"))
        return out

    def renewed(self, sent_at: float, now: float) -> list[Transition]:
        """etcd confirmed a renewal sent at `sent_at`. Too late to help a leader already past its fence time:
        that one stays fenced (time is judged first)."""
        out = self.tick(now)
        if self.role is not Role.LEADER:
            return out
        assert self._last_renewed is not None
        self._last_renewed = max(self._last_renewed, min(sent_at, self._now))
        self._renew_at = max(sent_at + self.cfg.renew_interval_s, self._now)
        return out

    def renew_failed(self, now: float, lease_lost: bool, reason: str) -> list[Transition]:
        """A renewal failed: `lease_lost` when etcd answered that the lease no longer exists (the key went with
        it), else the outcome is unknown and the leader retries until its fence time."""
        out = self.tick(now)
        if self.role is not Role.LEADER:
            return out
        if lease_lost:
            self.leader = None
            self._campaign_at = self._now + self.cfg.rejoin_after_s
            self._observe_at = self._now  # learn who leads now
            out.append(self._move(Role.FOLLOWER, self._now, f"the lease expired at etcd: {reason}"))
        else:
            self._renew_at = self._now + self.cfg.retry_interval_s
        return out

    def observed(self, holder: LeaderInfo | None, now: float) -> list[Transition]:
        """A read of the leader key: `holder`, or None when the key does not exist."""
        out = self.tick(now)
        now = self._now
        leading = self.role is Role.LEADER
        self._observe_at = now + (self.cfg.renew_interval_s if leading else self.cfg.observe_interval_s)
        if holder is not None and holder.epoch < self.epoch:
            return out  # older than what this replica knows: ignored (epochs never go backwards)
        mine = holder is not None and holder.epoch == self.epoch and holder.replica_id == self.replica_id
        self._first_read = False
        if holder is not None and self.role is Role.FOLLOWER:
            self._joins()
        if holder is None:
            if self._leaderless_since is None:
                self._leaderless_since = now
        else:
            self._leaderless_since = None
        if self.role is Role.FOLLOWER:
            if holder is None:
                self.leader = None  # campaign (after any hold-off)
            else:
                self._learn(holder)
        elif self.role in (Role.LEADER, Role.FENCED, Role.STEPPING_DOWN) and not mine:
            previous = self.role
            if holder is not None:
                self._learn(holder)
            else:
                self.leader = None
            self._observe_at = now + self.cfg.observe_interval_s
            self._campaign_at = now if previous is Role.LEADER else now + self.cfg.rejoin_after_s
            what = f"{holder.replica_id} holds epoch {holder.epoch}" if holder else "the leader key is gone"
            out.append(self._move(Role.FOLLOWER, now, f"deposed: {what}"))
        return out

    def observe_failed(self, now: float) -> list[Transition]:
        """A read of the leader key failed; read again after `retry_interval_s`."""
        out = self.tick(now)
        if self.role in (Role.FOLLOWER, Role.LEADER):
            self._observe_at = self._now + self.cfg.retry_interval_s
        return out

    def step_down(self, now: float, reason: str = "stepping down") -> list[Transition]:
        """Stop leading at once (may_accept turns false) and give the key back. No-op unless leading."""
        out = self.tick(now)
        if self.role is Role.LEADER:
            self._resign_at = self._now
            out.append(self._move(Role.STEPPING_DOWN, self._now, reason))
        return out

    def resigned(self, now: float) -> list[Transition]:
        """The key is deleted (if it was still ours) and the lease revoked."""
        out = self.tick(now)
        if self.role not in (Role.FENCED, Role.STEPPING_DOWN):
            return out
        self.leader = None
        self._campaign_at = self._now + self.cfg.rejoin_after_s
        self._observe_at = self._now  # learn who takes over
        out.append(self._move(Role.FOLLOWER, self._now, "resigned"))
        return out

    def resign_failed(self, now: float) -> list[Transition]:
        out = self.tick(now)
        if self.role in (Role.FENCED, Role.STEPPING_DOWN):
            self._resign_at = self._now + self.cfg.retry_interval_s
        return out

    def close(self, now: float, reason: str = "closed") -> list[Transition]:
        """Terminal: nothing is due any more. A leader should step down and resign first."""
        out = self.tick(now)
        if self.role is not Role.STOPPED:
            out.append(self._move(Role.STOPPED, self._now, reason))
        return out

    # --- internals ------------------------------------------------------------------------------------------
    def _advance(self, now: float) -> float:
        t = _seconds(now)
        if t is None:
            raise InvalidArgument(f"now must be a finite number (seconds), got {now!r}")
        self._now = max(self._now, t)
        return self._now

    def _expect(self, role: Role, what: str) -> None:
        if self.role is not role:
            raise FailedPrecondition(f"{what} is an input for a {role.value}; this replica is {self.role.value}")

    def _joins(self) -> None:
        """A follower learned that the key is held (by another replica, or by this one's earlier incarnation: a
        restart whose old lease has not expired yet). Unless this replica led or was vouched for in this process,
        it joins a running job: behind."""
        if not self._trusted:
            self.behind = True

    def _learn(self, leader: LeaderInfo) -> None:
        if leader.epoch >= self.epoch:
            self.epoch = leader.epoch
            self.leader = leader

    def _move(self, role: Role, now: float, reason: str) -> Transition:
        previous, self.role = self.role, role
        return Transition(previous, role, now, self.epoch, reason)


def _check_version(version: int) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgument(f"a standby's version must be an integer >= 0, got {version!r}")


def _check_epoch_value(epoch: int) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise InvalidArgument(f"epoch must be an integer >= 1 (an etcd revision), got {epoch!r}")


# --- clients following the leader ---------------------------------------------------------------------------------
# Learners, healthd and `diloco ctl` are given every replica's address (`--coordinator A,B,...`) and move to the
# leader by these rules (`diloco.rpc.coordinators.Coordinators` carries them out).

MAX_COORDINATORS = 8  # coordinator addresses a client may be given (--coordinator A,B,...)
MAX_ADDRESS_LIST_CHARS = 2048
# The status codes of a coordinator call that move a client to another address: the replica is down, draining, or
# does not lead (a standby, a fenced leader). The learner's reaction table calls this FAILOVER.
FAILOVER_CODES = ("UNAVAILABLE",)
_HINT_ADDRESS = r"[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:]{2,45}\]:[0-9]{1,5}"
_LEADER_HINT = re.compile(rf"not the leader; leader is at ({_HINT_ADDRESS})")


def coordinator_addresses(text: str) -> tuple[str, ...]:
    """The addresses of a comma-separated list of HOST:PORT (the replicas a client may reach; it starts at the
    first). InvalidArgument says what is wrong."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_ADDRESS_LIST_CHARS:
        raise InvalidArgument(
            f"expected HOST:PORT, or up to {MAX_COORDINATORS} of them comma-separated (replicas under etcd "
            f"leadership), at most {MAX_ADDRESS_LIST_CHARS} characters"
        )
    addresses = tuple(a.strip() for a in text.split(","))
    if len(addresses) > MAX_COORDINATORS:
        raise InvalidArgument(f"{len(addresses)} addresses; give up to {MAX_COORDINATORS} (HOST:PORT, comma-separated)")
    for a in addresses:
        if ":" not in a or not a.isprintable() or any(c.isspace() for c in a) or len(a) > MAX_ADDRESS_CHARS:
            raise InvalidArgument(
                f"expected HOST:PORT, or up to {MAX_COORDINATORS} of them comma-separated; {a[:64]!r} is not one"
            )
    return addresses


def leader_hint(details: str) -> str:
    """The leader's HOST:PORT a refusal names ("not the leader; leader is at HOST:PORT", `diloco.errors.not_leader`),
    or ""."""
    m = _LEADER_HINT.search(details[:512])
    return m.group(1) if m else ""


def hintable(address: str) -> bool:
    """Whether `address` is a HOST:PORT a leader hint can name (what `leader_hint` reads back)."""
    return re.fullmatch(_HINT_ADDRESS, address[:300]) is not None


# --- the leader healthd names (docs/protocol-changes.md, "healthd names the new leader") ---------------------------
ANNOUNCE_EVERY_S = 5.0  # a leading replica announces itself to healthd this often (services/coordinator/announce.py)
ANNOUNCED_FOR_S = 3 * ANNOUNCE_EVERY_S  # healthd names a leader this long after its last announcement


@dataclass
class AnnouncedLeader:
    """The coordinator leader healthd names in its heartbeat replies, driven by `now`: the highest epoch announced,
    for `ANNOUNCED_FOR_S` after its last announcement (the leader repeats it every `ANNOUNCE_EVERY_S`). While it
    stands, a lower epoch (a deposed leader's late word) or another address at its epoch changes nothing. Once it has
    lapsed (its leader went quiet: dead, cut off, or deposed with no successor announcing yet) none is named and any
    epoch may announce, so a leadership store whose epochs started over is not held to a number it will never reach
    again (learners would move to the lapsed address at every heartbeat)."""

    epoch: int = 0
    address: str = ""
    at: float = -math.inf  # the `now` of its last announcement

    def current(self, now: float) -> tuple[int, str]:
        """(epoch, HOST:PORT) of the leader to name at `now`; (0, "") for none."""
        return (self.epoch, self.address) if now - self.at <= ANNOUNCED_FOR_S else (0, "")

    def announce(self, epoch: int, address: str, now: float) -> bool:
        """Take an announcement; True when it names another leader than the one named until now."""
        held = self.current(now)
        if epoch < held[0] or (epoch == held[0] and address != held[1]):
            return False
        self.epoch, self.address, self.at = epoch, address, now
        return (epoch, address) != held


def failover_target(addresses: Sequence[str], current: str, details: str) -> str:
    """Where a client goes after a FAILOVER code: the leader the refusal names, else the address after `current` in
    `addresses` (round robin; the first when `current` is not one of them)."""
    hint = leader_hint(details)
    if hint:
        return hint
    if not addresses:
        raise InvalidArgument("failover needs at least one coordinator address")
    if current in addresses:
        return addresses[(list(addresses).index(current) + 1) % len(addresses)]
    return addresses[0]


# --- step-down ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Handover:
    """What a leader's step-down achieved: the newest `version` it applied, the standbys holding it when the key was
    given back (`held_by`), and the leader that took over when it was seen before the step-down returned (None:
    not yet)."""

    version: int
    held_by: tuple[str, ...]
    successor: LeaderInfo | None
