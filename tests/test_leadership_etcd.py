"""Leadership against a real etcd (Debian's etcd-server as a child process, fixture `etcd_server`): drivers in
this process campaign, renew, fence and hand over; etcd is crashed, restarted and frozen underneath them.

Every wait is a condition polled with a deadline. While waiting, each poll also checks the safety rule: at most
one replica may accept at any instant."""

from __future__ import annotations

import base64
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import etcd3gw
import pytest
import requests
from structlog.testing import capture_logs

from diloco.core.leadership import LeaderInfo, LeadershipConfig, LeadershipView, Role
from diloco.errors import ConfigError
from diloco.ha import etcd as etcd_module
from diloco.ha.driver import LeadershipDriver
from diloco.ha.etcd import (
    FORGET_FAILURE_S,
    MAX_HANGING,
    EtcdAuth,
    EtcdAuthRefused,
    EtcdConfig,
    EtcdElection,
    EtcdRefused,
    EtcdTls,
    EtcdTlsRefused,
    EtcdUnavailable,
    EtcdUnreachable,
    Won,
    next_endpoint,
)
from diloco.ha.etcd_server import EtcdCluster, EtcdServer
from diloco.rpc.tls import write_bundle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CFG = LeadershipConfig()  # ttl 2 s, renew every 0.5 s, fenced 1.5 s after the last confirmed renewal
KEY = "/diloco/coordinator/leader"
# etcd 3.4 revokes expired leases from a loop that runs every 500 ms, so a lease is gone up to this long after
# its TTL ran out.
ETCD_EXPIRY_CHECK_S = 0.5
SLACK_S = 0.5  # scheduling on a shared 2-core machine


@dataclass
class Cluster:
    etcd: EtcdServer
    drivers: dict[str, LeadershipDriver] = field(default_factory=dict)
    tls: EtcdTls | None = None  # how the replicas reach an etcd serving over https
    auth: EtcdAuth | None = None  # and one with authentication enabled

    def config(self, **changes: Any) -> EtcdConfig:
        return EtcdConfig(**{"host": self.etcd.host, "port": self.etcd.port, "key": KEY, "tls": self.tls, **changes})

    def add(self, replica_id: str, start: bool = True, **changes: Any) -> LeadershipDriver:
        election = EtcdElection(self.config(**{"auth": self.auth, **changes}))
        d = LeadershipDriver(replica_id, f"{replica_id}.test:7000", election, CFG)
        self.drivers[replica_id] = d
        if start:
            d.start()
        return d

    def accepting(self) -> list[str]:
        """The replicas that may accept now; fails the test when more than one does."""
        now_accepting = [r for r, d in self.drivers.items() if d.may_accept()]
        assert len(now_accepting) <= 1, f"two leaders accept at once: {now_accepting}"
        return now_accepting

    def leaders(self) -> list[str]:
        self.accepting()
        return [r for r, d in self.drivers.items() if d.view().role is Role.LEADER]

    def holder(self) -> LeaderInfo | None:
        """The leader key as etcd has it now (a separate client)."""
        probe = EtcdElection(self.config(auth=self.auth))
        try:
            return probe.observe()
        finally:
            probe.close()


@pytest.fixture
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    c = Cluster(etcd_server)
    yield c
    for d in c.drivers.values():
        d.stop(resign=False)


def until(what: str, probe: Callable[[], object], cluster: Cluster, timeout_s: float, one_leader: bool = True) -> float:
    """Poll `probe` (checking the one-leader rule on every poll, unless told not to) until it is truthy; returns
    when that was (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while True:
        if one_leader:
            cluster.accepting()
        if probe():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        tick.wait(0.01)


def one_leader(cluster: Cluster, timeout_s: float = 10.0) -> LeadershipDriver:
    until("one leader", lambda: len(cluster.leaders()) == 1, cluster, timeout_s)
    [rid] = cluster.leaders()
    return cluster.drivers[rid]


def elect_two(cluster: Cluster) -> tuple[LeadershipDriver, LeadershipDriver, LeadershipView]:
    """Replicas a and b campaign: the one that leads, the other once it knows that leader, and the leader's view
    (etcd holds its record)."""
    a, b = cluster.add("a"), cluster.add("b")
    leader = one_leader(cluster)
    follower = b if leader is a else a
    lv = leader.view()
    assert lv.epoch >= 1 and cluster.holder() == lv.leader
    until("the follower knows the leader", lambda: follower.view().leader == lv.leader, cluster, 5.0)
    return leader, follower, lv


def raw_client(etcd: EtcdServer) -> etcd3gw.Etcd3Client:
    session = requests.Session()
    session.trust_env = False
    return etcd3gw.client(host=etcd.host, port=etcd.port, timeout=2.0, api_path="/v3/", session=session)


def test_two_contenders_elect_exactly_one_leader_that_keeps_its_lease(cluster: Cluster) -> None:
    a, b = cluster.add("a"), cluster.add("b")
    leader = one_leader(cluster)
    follower = b if leader is a else a
    lv = leader.view()
    assert lv.epoch >= 1 and lv.leader == LeaderInfo(lv.replica_id, f"{lv.replica_id}.test:7000", lv.epoch)
    assert cluster.holder() == lv.leader  # etcd holds the record; its create_revision is the epoch
    until("the follower knows the leader", lambda: follower.view().leader == lv.leader, cluster, 5.0)
    assert follower.view().role is Role.FOLLOWER and follower.view().epoch == lv.epoch
    # Well past the TTL: without renewals the lease would be gone; the same leader keeps the same epoch.
    end = time.monotonic() + CFG.lease_ttl_s + 1.0
    until("two TTLs of steady leadership", lambda: time.monotonic() > end, cluster, 10.0)
    assert leader.may_accept() and leader.view().epoch == lv.epoch and cluster.holder() == lv.leader
    assert not follower.may_accept()


def test_a_dead_leader_is_fenced_before_its_lease_expires_and_the_other_takes_over(cluster: Cluster) -> None:
    a = cluster.add("a")
    assert one_leader(cluster) is a
    b = cluster.add("b")
    until("b follows a", lambda: b.view().leader is not None, cluster, 5.0)
    b.caught_up()  # a standby in step with a (else, having joined while a led, it would wait orphan_after_s)
    old = a.view()
    a.stop(resign=False)  # the driver dies: no more renewals, no resignation
    killed = time.monotonic()
    last_renewed = a.view().last_renewed_at
    assert last_renewed is not None
    fence_at = last_renewed + CFG.fence_after_s

    fenced = until("a fenced", lambda: a.view().role is Role.FENCED, cluster, 5.0)
    assert not a.may_accept()
    gone = until("a's key gone at etcd", lambda: (h := cluster.holder()) is None or h.replica_id != "a", cluster, 5.0)
    took_over = until("b leads", lambda: b.view().role is Role.LEADER, cluster, 5.0)

    assert fenced <= fence_at + SLACK_S  # by time alone: nothing was feeding a's machine
    assert fenced < last_renewed + CFG.lease_ttl_s < gone  # fenced before etcd could expire the lease
    assert b.view().epoch > old.epoch and cluster.holder() == LeaderInfo("b", "b.test:7000", b.view().epoch)
    # etcd expires the lease at most a TTL after the last renewal (+ its 500 ms check), b sees it at its next read
    bound = CFG.lease_ttl_s + CFG.renew_interval_s + ETCD_EXPIRY_CHECK_S + CFG.observe_interval_s + SLACK_S
    assert took_over - killed <= bound
    print(
        f"\nfenced {fenced - killed:.3f} s after the kill ({fence_at - killed:.3f} s planned); key gone after "
        f"{gone - killed:.3f} s; b leads after {took_over - killed:.3f} s (bound {bound:.1f} s)"
    )
    assert not a.may_accept()


def test_resign_hands_over_at_once(cluster: Cluster) -> None:
    a = cluster.add("a")
    assert one_leader(cluster) is a
    b = cluster.add("b")
    until("b follows a", lambda: b.view().leader is not None, cluster, 5.0)
    b.caught_up()  # a standby in step with a (else, having joined while a led, it would wait orphan_after_s)
    old_epoch = a.view().epoch
    started = time.monotonic()
    a.step_down()
    assert not a.may_accept()  # at once, before anything reached etcd
    took_over = until("b leads", lambda: b.may_accept(), cluster, CFG.lease_ttl_s)
    handover = took_over - started
    assert handover < CFG.lease_ttl_s / 2  # b did not wait for a's lease to expire: the key was deleted
    assert b.view().epoch > old_epoch
    # a stays out for rejoin_after_s and then follows b; it does not take leadership back
    until("a follows b", lambda: a.view().leader == b.view().leader, cluster, 5.0)
    end = time.monotonic() + CFG.rejoin_after_s + 0.5
    until("a's hold-off is over", lambda: time.monotonic() > end, cluster, 10.0)
    assert a.view().role is Role.FOLLOWER and b.may_accept()
    print(f"\nhandover after a resignation: {handover * 1000:.0f} ms")


def test_stop_with_resign_gives_the_key_back(cluster: Cluster) -> None:
    a = cluster.add("a")
    assert one_leader(cluster) is a
    a.stop()
    assert not a.may_accept() and a.view().role is Role.STOPPED
    assert cluster.holder() is None
    a.stop()  # twice is fine


def test_etcd_crash_fences_the_leader_and_someone_leads_after_the_restart(cluster: Cluster) -> None:
    a, b = cluster.add("a"), cluster.add("b")
    leader = one_leader(cluster)
    old = leader.view()
    cluster.etcd.kill()
    killed = time.monotonic()
    fenced = until("the leader fenced", lambda: leader.view().role is Role.FENCED, cluster, 5.0)
    assert fenced - killed < CFG.fence_after_s + SLACK_S < CFG.lease_ttl_s + SLACK_S
    assert not a.may_accept() and not b.may_accept()
    cluster.etcd.start()  # same ports, same data: revisions survive
    restarted = time.monotonic()
    new_leader = one_leader(cluster, timeout_s=15.0)
    led = time.monotonic()
    nv = new_leader.view()
    assert nv.epoch > old.epoch
    assert cluster.holder() == nv.leader
    print(f"\nfenced {fenced - killed:.3f} s after the crash; a leader {led - restarted:.3f} s after the restart")


def test_a_frozen_etcd_cannot_stall_fencing(cluster: Cluster) -> None:
    """SIGSTOP: calls hang instead of being refused. Every call is bounded, and fencing needs no call at all."""
    leader = cluster.add("a")
    assert one_leader(cluster) is leader
    old = leader.view()
    cluster.etcd.pause()
    try:
        paused = time.monotonic()
        last = leader.view().last_renewed_at
        assert last is not None
        until("the leader stops accepting", lambda: not leader.may_accept(), cluster, 5.0)
        stopped = time.monotonic()
        assert stopped <= last + CFG.fence_after_s + SLACK_S
        until("the leader fenced", lambda: leader.view().role is Role.FENCED, cluster, 2.0)
    finally:
        cluster.etcd.resume()
    until("a leader again", lambda: len(cluster.leaders()) == 1, cluster, 15.0)
    assert leader.view().epoch > old.epoch
    print(f"\nfrozen etcd: stopped accepting {stopped - paused:.3f} s after the freeze")


def test_a_lease_revoked_by_hand_ends_leadership_within_a_renew_interval(cluster: Cluster) -> None:
    """Revoking the lease (or deleting the key) by hand is a forced takeover outside the protocol: the key goes at
    once, so b may lead before a's next renewal or read tells it. a stops within one renew interval; until then
    only the epoch tells the two apart (documented in docs/ha.md)."""
    a = cluster.add("a")
    assert one_leader(cluster) is a
    b = cluster.add("b")
    until("b follows a", lambda: b.view().leader is not None, cluster, 5.0)
    b.caught_up()  # a standby in step with a (else, having joined while a led, it would wait orphan_after_s)
    old_epoch = a.view().epoch
    client = raw_client(cluster.etcd)
    [(_, meta)] = client.get(KEY, metadata=True)
    client.post(client.get_url("/kv/lease/revoke"), json={"ID": int(meta["lease"])})
    revoked = time.monotonic()
    left = until("a leaves leadership", lambda: not a.may_accept(), cluster, 5.0, one_leader=False)
    assert left - revoked <= CFG.renew_interval_s + SLACK_S
    assert a.view().role is Role.FOLLOWER
    until("b leads", lambda: b.may_accept(), cluster, 5.0)
    assert b.view().epoch > old_epoch
    print(f"\nlease revoked by hand: the old leader stopped after {left - revoked:.3f} s")


def test_a_key_that_is_not_a_leader_record_is_never_overwritten(cluster: Cluster) -> None:
    client = raw_client(cluster.etcd)
    client.put(KEY, "not json")
    with pytest.raises(EtcdUnavailable, match="does not hold a leader record"):
        cluster.holder()
    a = cluster.add("a")
    end = time.monotonic() + 1.0
    until("a second of trying", lambda: time.monotonic() > end, cluster, 5.0)
    assert a.view().role in (Role.FOLLOWER, Role.CANDIDATE) and client.get(KEY) == [b"not json"]
    client.delete(KEY)
    one_leader(cluster, timeout_s=5.0)


class Trickle:
    """An HTTP endpoint that answers one byte every `every_s` and never finishes: each read arrives well within a
    client's read timeout, so only a bound on the whole call ends it (the cut-off replica's DNS lookup blocks the
    same way, in a call the HTTP client's timeout does not cover)."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.every_s = every_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while not self.stopped.is_set():
                conn, _ = self.sock.accept()
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not self.stopped.wait(self.every_s):
                conn.sendall(b"X")

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()


def test_every_etcd_call_is_bounded_as_a_whole_even_when_bytes_keep_trickling_in() -> None:
    trickle = Trickle()
    election = EtcdElection(EtcdConfig(host="127.0.0.1", port=trickle.port, key=KEY, call_timeout_s=0.3))
    try:
        for call in (election.observe, lambda: election.renew(1), lambda: election.resign(1, 1)):
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable, match=r"no answer within 0\.3 s"):
                call()
            assert time.monotonic() - started < 0.3 + SLACK_S
        for _ in range(MAX_HANGING):  # those given up on still hang: a new call fails at once, sending nothing
            with contextlib.suppress(EtcdUnavailable):
                election.observe()
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="still hang; not sending another"):
            election.observe()
        assert time.monotonic() - started < 0.1
    finally:
        trickle.close()
        election.close()


@pytest.mark.parametrize(("b_holds", "c_holds"), [(7, 5), (5, 7)])
def test_of_two_standbys_the_one_holding_the_newest_version_takes_over(
    cluster: Cluster, b_holds: int, c_holds: int
) -> None:
    """Issue #14 point 4, three replicas: a leads; b and c follow it, in step, and publish the versions they hold
    (under leases of their own). a dies: the one holding the newer version takes the key (both orders, so it is not
    who campaigns first)."""
    a = cluster.add("a")
    assert one_leader(cluster) is a
    b, c = cluster.add("b"), cluster.add("c")
    for d, held in ((b, b_holds), (c, c_holds)):
        until(f"{d.view().replica_id} follows a", lambda d=d: d.view().leader is not None, cluster, 5.0)  # type: ignore[misc]
        d.caught_up()
        d.hold(held)
    newest, other = (b, c) if b_holds > c_holds else (c, b)
    until("each knows the other's version", lambda: other.view().ahead == (newest.view().replica_id,), cluster, 5.0)
    a.stop(resign=False)
    until("b or c leads", lambda: Role.LEADER in (b.view().role, c.view().role), cluster, 15.0)
    assert newest.view().role is Role.LEADER and other.view().role is Role.FOLLOWER


def dead_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_after_a_failure_calls_go_to_a_member_that_answered_before_a_slow_one_and_to_a_dead_one_last() -> None:
    """A leader whose member died (refused) and whose next member is slow under load does not go back to the dead
    one while another may answer; failures older than FORGET_FAILURE_S no longer count."""
    assert next_endpoint(0, 3, {}, 10.0) == 1  # nothing known: round robin
    assert next_endpoint(2, 3, {}, 10.0) == 0
    refused_a, slow_b = {0: (True, 10.0), 1: (False, 20.0)}, {1: (False, 20.0)}
    assert next_endpoint(1, 3, refused_a, 21.0) == 2  # c has not failed
    assert next_endpoint(2, 3, {**refused_a, 2: (False, 22.0)}, 23.0) == 1  # b was only slow; a refused
    assert next_endpoint(2, 3, {**slow_b, 0: (False, 5.0), 2: (False, 22.0)}, 23.0) == 0  # both slow: in turn
    assert next_endpoint(2, 3, {**refused_a, 2: (False, 22.0)}, 10.0 + FORGET_FAILURE_S + 1) == 0  # a forgiven
    assert next_endpoint(0, 1, {0: (True, 1.0)}, 2.0) == 0  # the only one


def test_a_replica_given_several_endpoints_moves_past_a_dead_or_hung_one(cluster: Cluster) -> None:
    """`--etcd A,B,C`: calls go to one endpoint at a time; one that gives no answer (refused, or hanging past
    call_timeout_s) sends the next call to the next. A driver whose first two endpoints are a dead port and a hung
    server still wins, and keeps its lease through the live one for two TTLs."""
    live = (cluster.etcd.host, cluster.etcd.port)
    election = EtcdElection(EtcdConfig(host="127.0.0.1", port=dead_port(), key=KEY, others=(live,)))
    try:
        with pytest.raises(EtcdRefused, match="ConnectionFailedError"):
            election.observe()
        assert election.endpoint == f"{live[0]}:{live[1]}"
        assert election.observe() is None  # the live member answers
        election.revoke(12345)  # etcd's answer ("lease not found") is an answer: the endpoint stays
        assert election.endpoint == f"{live[0]}:{live[1]}"
    finally:
        election.close()

    trickle = Trickle()
    try:
        others = (("127.0.0.1", trickle.port), live)
        cfg = EtcdConfig(host="127.0.0.1", port=dead_port(), key=KEY, call_timeout_s=0.3, others=others)
        d = LeadershipDriver("a", "a.test:7000", EtcdElection(cfg), CFG)
        cluster.drivers["a"] = d
        d.start()
        until("a leads through the live endpoint", lambda: d.view().role is Role.LEADER, cluster, 10.0)
        epoch = d.view().epoch
        end = time.monotonic() + 2 * CFG.lease_ttl_s
        until("two TTLs of steady leadership", lambda: time.monotonic() > end, cluster, 10.0)
        assert d.may_accept() and d.view().epoch == epoch
        assert cluster.holder() == LeaderInfo("a", "a.test:7000", epoch)
    finally:
        trickle.close()


@pytest.mark.parametrize(
    ("others", "match"),
    [
        ((("127.0.0.1", 2379),), "given twice"),
        ((("", 1),), "host"),
        ((("127.0.0.1", 0),), "1..65535"),
        (tuple(("127.0.0.1", p) for p in range(1, 6)), "at most 5"),
    ],
)
def test_bad_endpoint_lists_are_config_errors(others: tuple[tuple[str, int], ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EtcdConfig(host="127.0.0.1", port=2379, others=others)


# --- over https -------------------------------------------------------------------------------------------------


def client_tls(etcd: EtcdServer) -> EtcdTls:
    """What a replica is given for the `etcd_tls` fixture's etcd: its CA and the coordinator's certificate."""
    assert etcd.tls is not None
    pki = etcd.tls.ca_file.parent
    return EtcdTls(str(pki / "ca.pem"), str(pki / "coordinator.pem"), str(pki / "coordinator.key"))


def test_leadership_is_acquired_and_kept_over_tls(etcd_tls: EtcdServer) -> None:
    """etcd serving https only with --client-cert-auth: replicas given its CA and a client certificate signed by it
    elect one leader, the other follows, and the leader keeps its lease past the TTL."""
    cluster = Cluster(etcd_tls, tls=client_tls(etcd_tls))
    try:
        leader, _, lv = elect_two(cluster)
        end = time.monotonic() + CFG.lease_ttl_s + 0.5
        until("past the TTL", lambda: time.monotonic() > end, cluster, 10.0)
        assert leader.may_accept() and leader.view().epoch == lv.epoch and cluster.holder() == lv.leader
    finally:
        for d in cluster.drivers.values():
            d.stop(resign=False)


@pytest.mark.parametrize(
    ("ca", "cert", "match"),
    [
        ("ca.pem", "", "etcd refused the handshake .* needs --etcd-cert-file and --etcd-key-file"),
        ("ca.pem", "other/coordinator", "etcd refused the handshake .* needs --etcd-cert-file and --etcd-key-file"),
        ("other/ca.pem", "coordinator", "etcd's certificate is not trusted .*--etcd-ca-file must be the CA"),
    ],
    ids=["no-client-certificate", "client-certificate-of-another-ca", "another-ca"],
)
def test_a_replica_with_the_wrong_tls_files_is_refused_at_once_saying_which(
    etcd_tls: EtcdServer, tmp_path: Path, ca: str, cert: str, match: str
) -> None:
    """A handshake that fails is an answer, not a hang: every call fails within milliseconds (not at
    call_timeout_s) with `EtcdTlsRefused` naming the flag to check, and a driver so configured never leads."""
    assert etcd_tls.tls is not None
    pki = etcd_tls.tls.ca_file.parent
    write_bundle(pki / "other", clients=[], hosts=("localhost", "127.0.0.1"), tokens=False)  # another CA
    files = EtcdTls(str(pki / ca), *((str(pki / f"{cert}.pem"), str(pki / f"{cert}.key")) if cert else ()))
    election = EtcdElection(EtcdConfig(host=etcd_tls.host, port=etcd_tls.port, key=KEY, tls=files))
    try:
        for call in (election.observe, lambda: election.campaign("a", "a.test:7000", 2)):
            started = time.monotonic()
            with pytest.raises(EtcdTlsRefused, match=match):
                call()
            assert time.monotonic() - started < election.cfg.call_timeout_s
    finally:
        election.close()
    cluster = Cluster(etcd_tls, tls=files)
    try:
        d = cluster.add("a")
        end = time.monotonic() + 1.0
        until("1 s of campaigns", lambda: time.monotonic() > end, cluster, 5.0)
        assert d.view().role is not Role.LEADER and not d.may_accept()
        cluster.tls = client_tls(etcd_tls)
        assert cluster.holder() is None  # nothing was written
    finally:
        d.stop(resign=False)


def test_plain_http_to_an_https_etcd_fails_at_once(etcd_tls: EtcdServer) -> None:
    election = EtcdElection(EtcdConfig(host=etcd_tls.host, port=etcd_tls.port, key=KEY))
    try:
        started = time.monotonic()
        with pytest.raises(EtcdUnreachable):
            election.observe()
        assert time.monotonic() - started < election.cfg.call_timeout_s
    finally:
        election.close()


def test_https_to_a_plain_http_etcd_fails_at_once(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """etcd closes a TLS handshake on its plain HTTP port as it does one without a client certificate: the message
    names both causes."""
    write_bundle(tmp_path / "pki", clients=[], hosts=("127.0.0.1",), tokens=False)
    files = EtcdTls(str(tmp_path / "pki" / "ca.pem"))
    election = EtcdElection(EtcdConfig(host=etcd_server.host, port=etcd_server.port, key=KEY, tls=files))
    try:
        started = time.monotonic()
        with pytest.raises(EtcdTlsRefused, match=r"etcd refused the handshake .*or etcd serves plain HTTP there"):
            election.observe()
        assert time.monotonic() - started < election.cfg.call_timeout_s
    finally:
        election.close()


class Resetter:
    """A TLS endpoint that resets every connection (RST, not FIN) in the handshake, as etcd's plain HTTP port
    sometimes answers a ClientHello."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn, contextlib.suppress(OSError):
                    conn.recv(65536)  # the ClientHello
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        self.sock.close()


def test_a_reset_in_the_handshake_is_a_refused_handshake(tmp_path: Path) -> None:
    """What `test_https_to_a_plain_http_etcd_fails_at_once` meets now and then (a reset, not a close), every time."""
    write_bundle(tmp_path / "pki", clients=[], hosts=("127.0.0.1",), tokens=False)
    server = Resetter()
    election = EtcdElection(
        EtcdConfig(host="127.0.0.1", port=server.port, key=KEY, tls=EtcdTls(str(tmp_path / "pki" / "ca.pem")))
    )
    try:
        with pytest.raises(EtcdTlsRefused, match=r"Connection reset by peer.*or etcd serves plain HTTP there"):
            election.observe()
    finally:
        server.close()
        election.close()


# --- with etcd's user/password authentication (`auth enable`) ---------------------------------------------------

USER, PASSWORD, ROOT_PASSWORD = "coordinator", "a pass phrase", "root-pass"


def etcd_call(etcd: EtcdServer, path: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
    """One call to `etcd`'s JSON gateway as an operator makes it (etcdctl's user, role and auth commands), with
    `token` as its Authorization header; etcd3gw's exception when etcd refuses it."""
    client = raw_client(etcd)
    try:
        reply: dict[str, Any] = client.post(
            client.get_url(path), json=body, headers={"Authorization": token} if token else None
        )
        return reply
    finally:
        client.session.close()


def token_of(etcd: EtcdServer, user: str, password: str) -> str:
    token: str = etcd_call(etcd, "/auth/authenticate", {"name": user, "password": password})["token"]
    return token


def as_root(etcd: EtcdServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return etcd_call(etcd, path, body, token_of(etcd, "root", ROOT_PASSWORD))


def enable_auth(etcd: EtcdServer) -> None:
    """What docs/ha.md has the operator run (etcdctl user add, role add, role grant-permission --prefix=true, user
    grant-role, auth enable): root, and USER whose role may read and write the keys with prefix KEY (the leader key
    and the standbys' entries)."""
    etcd_call(etcd, "/auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
    etcd_call(etcd, "/auth/user/grant", {"user": "root", "role": "root"})
    etcd_call(etcd, "/auth/user/add", {"name": USER, "password": PASSWORD})
    etcd_call(etcd, "/auth/role/add", {"name": "leadership"})
    end = KEY[:-1] + chr(ord(KEY[-1]) + 1)  # the prefix's range end
    perm = {"permType": "READWRITE", "key": b64(KEY), "range_end": b64(end)}
    etcd_call(etcd, "/auth/role/grant", {"name": "leadership", "perm": perm})
    etcd_call(etcd, "/auth/user/grant", {"user": USER, "role": "leadership"})
    etcd_call(etcd, "/auth/enable", {})


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def credentials(tmp_path: Path, password: str = PASSWORD, user: str = USER) -> EtcdAuth:
    """USER (or `user`) and a password file holding `password`, as an operator writes one (a trailing newline)."""
    path = tmp_path / f"{user}-{len(list(tmp_path.glob('*.password')))}.password"
    path.write_text(password + "\n")
    return EtcdAuth(user, str(path))


def refuses_token(etcd: EtcdServer, token: str) -> bool:
    """Whether etcd refuses `token` now (as "invalid auth token"): a token a replica held is dead."""
    try:
        etcd_call(etcd, "/kv/range", {"key": b64(KEY)}, token)
    except etcd3gw.exceptions.Etcd3Exception as e:
        return "invalid auth token" in (e.detail_text or "")
    return False


@pytest.fixture
def etcd_auth(etcd_server: EtcdServer) -> EtcdServer:
    """The `etcd_server` fixture's etcd with authentication enabled (`enable_auth`)."""
    enable_auth(etcd_server)
    return etcd_server


def test_leadership_works_as_an_etcd_user(etcd_auth: EtcdServer, tmp_path: Path) -> None:
    """etcd with `auth enable`: replicas given a user and its password file campaign, renew, observe, publish and
    resign: two elect one leader, the other follows and publishes the version it holds, the leader keeps its lease
    past the TTL, and its resignation hands the key over."""
    cluster = Cluster(etcd_auth, auth=credentials(tmp_path))
    try:
        leader, follower, lv = elect_two(cluster)
        follower.caught_up()
        follower.hold(3)
        probe = EtcdElection(cluster.config(auth=cluster.auth))
        try:
            expected = (lv.leader, {follower.view().replica_id: 3})
            until("the follower's entry published", lambda: probe.observe_all() == expected, cluster, 5.0)
        finally:
            probe.close()
        end = time.monotonic() + CFG.lease_ttl_s + 0.5
        until("past the TTL", lambda: time.monotonic() > end, cluster, 10.0)
        assert leader.may_accept() and leader.view().epoch == lv.epoch and cluster.holder() == lv.leader
        leader.stop()  # resigns: the key goes at once
        until("the follower leads", lambda: follower.may_accept(), cluster, CFG.lease_ttl_s)
        assert follower.view().epoch > lv.epoch and cluster.holder() == follower.view().leader
    finally:
        for d in cluster.drivers.values():
            d.stop(resign=False)


def test_a_token_etcd_invalidated_is_renewed_and_the_call_sent_again(etcd_auth: EtcdServer, tmp_path: Path) -> None:
    """etcd drops every token at `auth disable`, and a user's tokens when its password is set (here to the same one):
    each call after that is refused for its token, and the client authenticates again and sends it once more, so the
    call succeeds. While authentication is off, calls go without a token; once it is on again, etcd's "user name is
    empty" gets the client a token. All four calls are shown across these changes."""
    etcd = etcd_auth
    election = EtcdElection(Cluster(etcd).config(auth=credentials(tmp_path), call_timeout_s=2.0))
    try:
        won = election.campaign("a", "a.test:7000", 60)
        assert isinstance(won, Won) and election.observe() == LeaderInfo("a", "a.test:7000", won.epoch)
        held = token_of(etcd, USER, PASSWORD)  # a token issued as the election's was: dropped with it

        as_root(etcd, "/auth/disable", {})
        assert refuses_token(etcd, held)
        assert election.renew(won.lease_id)  # refused for its token; authentication is off: sent without one
        assert election.observe() == LeaderInfo("a", "a.test:7000", won.epoch)

        etcd_call(etcd, "/auth/enable", {})
        election.resign(won.lease_id, won.epoch)  # "user name is empty": authenticates, then the txn and revoke
        assert election.observe() is None

        won = election.campaign("a", "a.test:7000", 60)
        assert isinstance(won, Won)
        held = token_of(etcd, USER, PASSWORD)
        as_root(etcd, "/auth/user/changepw", {"name": USER, "password": PASSWORD})
        assert refuses_token(etcd, held)
        lost = election.campaign("b", "b.test:7000", 60)  # its lease grant refused, then sent again
        assert not isinstance(lost, Won) and lost.holder == LeaderInfo("a", "a.test:7000", won.epoch)
        assert election.renew(won.lease_id)
        assert election.observe() == LeaderInfo("a", "a.test:7000", won.epoch)
    finally:
        election.close()


def test_a_wrong_password_is_refused_naming_the_user_and_the_flag(
    etcd_auth: EtcdServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials etcd refuses fail each call with `EtcdAuthRefused` naming the user and the flags to check, and an
    `etcd.auth_refused` error line; the client does not ask etcd again for AUTH_RETRY_S (each try costs etcd a
    bcrypt check), failing calls at once meanwhile. A driver so configured never leads nor writes the key, and leads
    once etcd's side is fixed, without a restart."""
    cluster = Cluster(etcd_auth, auth=credentials(tmp_path))
    wrong = credentials(tmp_path, "not the password")
    election = EtcdElection(cluster.config(auth=wrong, call_timeout_s=2.0))
    refused = r"etcd refused user 'coordinator' .*check --etcd-user and the password in --etcd-password-file"
    try:
        with capture_logs() as logs:
            with pytest.raises(EtcdAuthRefused, match=refused):
                election.observe()
            for call in (election.observe, lambda: election.campaign("a", "a.test:7000", 2)):
                with pytest.raises(EtcdAuthRefused, match=f"{refused}.*not asked again for 5 s"):
                    call()
        assert [(e["event"], e["log_level"], e["user"]) for e in logs] == [("etcd.auth_refused", "error", USER)]
        assert "not the password" not in str(logs)
    finally:
        election.close()

    monkeypatch.setattr(etcd_module, "AUTH_RETRY_S", 0.2)
    d = cluster.add("a", auth=wrong)
    end = time.monotonic() + 1.0
    until("1 s of campaigns", lambda: time.monotonic() > end, cluster, 5.0)
    assert d.view().role is not Role.LEADER and not d.may_accept() and cluster.holder() is None
    as_root(etcd_auth, "/auth/user/changepw", {"name": USER, "password": "not the password"})
    until("a leads once etcd takes its password", lambda: d.may_accept(), cluster, 10.0)
    d.stop()


def test_without_a_user_or_without_permission_etcd_refuses_saying_what_to_give(
    etcd_auth: EtcdServer, tmp_path: Path
) -> None:
    """No --etcd-user for an etcd with authentication enabled: every call fails with `EtcdAuthRefused` naming the
    flags to give; a campaign (whose lease grant etcd allows anyone) leaves neither key nor lease. A user without a
    role on the key: `EtcdAuthRefused` saying which permission to grant."""
    cluster = Cluster(etcd_auth, auth=credentials(tmp_path))
    anonymous = EtcdElection(cluster.config(call_timeout_s=2.0))
    give = r"etcd has authentication enabled \(etcdserver: user name is empty\); give this replica an etcd user: "
    try:
        with pytest.raises(EtcdAuthRefused, match=give + "--etcd-user NAME and --etcd-password-file FILE"):
            anonymous.observe()
        with pytest.raises(EtcdAuthRefused, match=give):
            anonymous.campaign("a", "a.test:7000", 60)
    finally:
        anonymous.close()
    assert cluster.holder() is None
    assert as_root(etcd_auth, "/kv/lease/leases", {}).get("leases") is None  # the campaign's lease was revoked

    as_root(etcd_auth, "/auth/user/add", {"name": "nobody", "password": PASSWORD})
    stranger = EtcdElection(cluster.config(auth=credentials(tmp_path, user="nobody"), call_timeout_s=2.0))
    try:
        with pytest.raises(EtcdAuthRefused, match=f"etcd user 'nobody' may not read or write '{KEY}'; grant it a role"):
            stranger.observe()
    finally:
        stranger.close()


def test_one_token_serves_every_member(etcd_installed: str, tmp_path: Path) -> None:
    """Three members with authentication enabled: etcd replicates an authentication, so a token one member issued
    is good at the others. The replica's member killed (not the raft leader: the cluster goes on at once), its next
    call goes to another member and the calls after it succeed there."""
    members = EtcdCluster(etcd_installed, tmp_path / "etcd", size=3)
    try:
        members.start()
        second = members.lead_first()  # the raft leader, tried second
        first, third = members.members[1:]
        enable_auth(first)
        assert not refuses_token(second, token_of(first, USER, PASSWORD))
        others = ((second.host, second.port), (third.host, third.port))
        cfg = EtcdConfig(first.host, first.port, KEY, 2.0, others, auth=credentials(tmp_path))
        election = EtcdElection(cfg)
        try:
            assert election.observe() is None
            first.kill()
            with pytest.raises(EtcdUnreachable):
                election.observe()
            assert election.endpoint == f"{second.host}:{second.port}"
            won = election.campaign("a", "a.test:7000", 60)
            assert isinstance(won, Won) and election.renew(won.lease_id)
            assert election.observe() == LeaderInfo("a", "a.test:7000", won.epoch)
        finally:
            election.close()
    finally:
        members.stop()
