"""A node that floods healthd with heartbeats is cut off with RESOURCE_EXHAUSTED; a node at the configured
pace is not. The flood leaves the node table bounded (one entry) and healthd serving."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from diloco.core.ratelimit import TokenBucket
from diloco.errors import ConfigError
from diloco.v1 import healthd_pb2
from services.healthd.server import HealthdServer
from tests.support import INTERVAL_S, Beater, healthd_config, node_states

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[HealthdServer]:
    srv = HealthdServer(healthd_config(heartbeat_burst=5))  # no coordinator: track only
    srv.start()
    yield srv
    srv.stop(0)


def test_token_bucket_golden() -> None:
    b = TokenBucket(rate_per_s=2.0, burst=3)
    assert [b.allow(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.allow(0.5) and not b.allow(0.5)  # one token back after 0.5 s at 2/s
    assert [b.allow(10.0) for _ in range(4)] == [True, True, True, False]  # refills to the burst, no more
    with pytest.raises(ConfigError):
        TokenBucket(rate_per_s=0.0, burst=1)


def test_heartbeat_flood_ends_the_stream_with_resource_exhausted(server: HealthdServer) -> None:
    flood = Beater(server.address, "flooder", interval_s=None)
    calm = Beater(server.address, "calm")  # the configured pace
    try:
        for _ in range(200):
            flood.send()
        err = flood.wait_done()
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "heartbeats/s" in (err.details() or "")
        assert len(flood.acks) < 200  # the excess was never applied
        calm.wait_acks(3, timeout_s=10 * INTERVAL_S + 5)
        assert calm.error is None and not calm.done
        assert node_states(server)["calm"] == healthd_pb2.NODE_STATE_ALIVE
    finally:
        flood.kill()
        calm.kill()


def test_heartbeat_rate_flags_are_validated() -> None:
    with pytest.raises(ConfigError, match="heartbeat_rate_factor"):
        healthd_config(heartbeat_rate_factor=0.0)
    with pytest.raises(ConfigError, match="heartbeat_burst"):
        healthd_config(heartbeat_burst=0)
