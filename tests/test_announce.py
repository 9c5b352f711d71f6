"""A leading replica's announcement to healthd (`services/coordinator/announce.py`), against a real healthd on
loopback: what it announces reaches every heartbeat reply; a healthd that refuses it for good is told once and
not asked again; a healthd that is not there yet is retried until it is."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from diloco.rpc.security import SecurityConfig
from services.coordinator.announce import LeaderAnnouncer
from services.coordinator.ha import free_port
from services.healthd.server import HealthdServer
from tests.support import Beater, healthd_config, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def healthd() -> Iterator[HealthdServer]:
    server = HealthdServer(healthd_config())
    server.start()
    yield server
    server.stop(0)


def reply_leader(address: str) -> tuple[int, str] | None:
    """The leader a heartbeat reply from the healthd at `address` names now (None: no reply, e.g. while the
    process's shared connection to that address is still in its reconnect backoff)."""
    b = Beater(address, "w1", interval_s=None)
    try:
        b.send()
        ack = b.wait_acks(1)[0]
        return ack.leader_epoch, ack.leader_address
    except AssertionError:
        return None
    finally:
        b.close()


def announcer(healthd: str, epoch: int, address: str) -> LeaderAnnouncer:
    return LeaderAnnouncer(healthd, SecurityConfig(), epoch, address, structlog.get_logger())


def test_the_announcement_reaches_the_heartbeat_replies_even_of_a_healthd_that_starts_later() -> None:
    port = free_port("127.0.0.1")
    a = announcer(f"127.0.0.1:{port}", 7, "127.0.0.1:50051")
    with capture_logs() as logs:
        a.start()  # healthd is not there yet: retried with backoff
        wait_for("a try while healthd is away", lambda: any(x["event"] == "replica.announce_retry" for x in logs), 10)
        server = HealthdServer(healthd_config(port=port))
        server.start()
        try:
            wait_for("the announcement", lambda: reply_leader(server.address) == (7, "127.0.0.1:50051"), 10)
        finally:
            a.stop()
            server.stop(0)
    events = [x["event"] for x in logs]
    assert events.count("replica.announced") == 1 and events.index("replica.announce_retry") < events.index(
        "replica.announced"
    ), events  # retried while healthd was away, said once when it arrived


def test_a_refused_announcement_is_logged_once_and_not_sent_again(healthd: HealthdServer) -> None:
    a = announcer(healthd.address, 7, "not an address")
    with capture_logs() as logs:
        a.start()
        a._thread.join(10)  # it ends by itself
        assert not a._thread.is_alive()
    refused = [x for x in logs if x["event"] == "replica.announce_refused"]
    assert len(refused) == 1 and refused[0]["code"] == "INVALID_ARGUMENT", logs
    assert reply_leader(healthd.address) == (0, "")


def test_a_deposed_leader_stops_announcing(healthd: HealthdServer) -> None:
    newer = announcer(healthd.address, 9, "127.0.0.1:50052")
    newer.start()
    wait_for("the newer leader", lambda: reply_leader(healthd.address) == (9, "127.0.0.1:50052"), 10)
    older = announcer(healthd.address, 8, "127.0.0.1:50051")
    with capture_logs() as logs:
        older.start()
        older._thread.join(10)
        assert not older._thread.is_alive()
    newer.stop()
    assert any(x["event"] == "replica.announce_superseded" for x in logs), logs
    assert reply_leader(healthd.address) == (9, "127.0.0.1:50052")
