"""Energy-, carbon- and cost-aware placement in the coordinator service (issue #15), in-process on port 0 through
real channels: the power, zone, price and capacity learners send (bad values refused with INVALID_ARGUMENT and
nothing changed), the placement policy pausing a learner, the accounting counters, the carbon provider's
fallbacks, and what GetStatus / ListWorkers / `diloco ctl` show."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from diloco.core.energy import PowerSource
from diloco.v1 import common_pb2
from services.worker.config import parse as parse_worker
from services.worker.control import register_request
from services.worker.power import open_meter
from tests.support import Env, T, code_of, pb, register

pytestmark = pytest.mark.timeout(60)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NVML, DECLARED = common_pb2.POWER_SOURCE_NVML, common_pb2.POWER_SOURCE_DECLARED


def power(watts: float, source: int = DECLARED, tokens_per_s: float = 0.0) -> common_pb2.Throughput:
    return common_pb2.Throughput(tokens_per_s=tokens_per_s, watts=watts, power_source=source)  # type: ignore[arg-type]


def join(env: Env, name: str, tp: common_pb2.Throughput | None = None, **fields: Any) -> pb.RegisterResponse:
    req = pb.RegisterRequest(worker_name=name, model_fingerprint=env.server.task.fingerprint, throughput=tp, **fields)
    resp: pb.RegisterResponse = env.stub.Register(req, timeout=T)
    return resp


# --- the wire -----------------------------------------------------------------------------------------------------
BAD_REGISTRATIONS: dict[str, tuple[dict[str, Any], str]] = {
    "nan-watts": ({"tp": power(math.nan)}, "watts"),
    "negative-watts": ({"tp": power(-1.0)}, "watts"),
    "over-100-kW": ({"tp": power(100_001.0)}, "watts"),
    "watts-without-source": ({"tp": power(300.0, common_pb2.POWER_SOURCE_UNSPECIFIED)}, "power_source is required"),
    "unknown-source": ({"tp": power(300.0, 77)}, "unknown power source enum value 77"),
    "negative-price": ({"price_per_hour": -0.5}, "price_per_hour"),
    "nan-price": ({"price_per_hour": math.nan}, "price_per_hour"),
    "absurd-price": ({"price_per_hour": 1e7}, "price_per_hour"),
    "zone-too-long": ({"zone": "Z" * 65}, "zone"),
    "zone-not-printable": ({"zone": "DE\n"}, "zone"),
}


@pytest.mark.parametrize("case", BAD_REGISTRATIONS)
def test_bad_power_price_or_zone_at_registration_is_refused_and_changes_nothing(env: Env, case: str) -> None:
    fields, message = BAD_REGISTRATIONS[case]
    code, details = code_of(lambda: join(env, "w", **fields))
    assert code == INVALID and message in details, details
    assert any(w in details for w in ("send", "register", "use one of"))  # it says what to send
    assert not env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers
    assert not env.server.state.energy.learners


def test_registration_carries_power_zone_price_and_capacity(env: Env) -> None:
    reg = join(env, "w", power(420.0, NVML), zone="FR", price_per_hour=3.5, spot=True)
    rec = env.server.state.energy.learners[reg.worker_id]
    assert (rec.watts, rec.source, rec.zone, rec.price_per_hour, rec.spot) == (420.0, PowerSource.NVML, "FR", 3.5, True)
    plain = register(env, "v")  # an older learner: no power, zone or price
    rec = env.server.state.energy.learners[plain.worker_id]
    assert (rec.watts, rec.source, rec.zone, rec.price_per_hour, rec.spot) == (0.0, None, "", 0.0, False)


def report(env: Env, worker_id: str = "", tp: common_pb2.Throughput | None = None, **batch: Any) -> None:
    env.stub.ReportThroughput(pb.ReportThroughputRequest(worker_id=worker_id, throughput=tp, **batch), timeout=T)


def test_reported_power_updates_and_bad_reports_change_nothing(env: Env) -> None:
    a = join(env, "a", power(100.0)).worker_id
    b = join(env, "b", power(200.0)).worker_id
    report(env, a, power(150.0, NVML, tokens_per_s=10.0))
    learners = env.server.state.energy.learners
    assert (learners[a].watts, learners[a].source) == (150.0, PowerSource.NVML)
    report(env, a, common_pb2.Throughput(tokens_per_s=11.0))  # no power figure: the last one stays
    assert (learners[a].watts, learners[a].source) == (150.0, PowerSource.NVML)
    bad: list[Callable[[], None]] = [
        lambda: report(env, a, power(math.inf)),
        lambda: report(env, a, power(5.0, 99)),
        lambda: report(env, a, power(5.0, common_pb2.POWER_SOURCE_UNSPECIFIED)),
        lambda: report(  # healthd's batch: one bad report refuses the call, and none of it applies
            env,
            reports=[
                pb.ThroughputReport(worker_id=b, throughput=power(999.0)),
                pb.ThroughputReport(worker_id=a, throughput=power(-3.0)),
            ],
        ),
    ]
    for call in bad:
        code, details = code_of(call)
        assert code == INVALID and ("watts" in details or "power source" in details), details
    assert (learners[a].watts, learners[b].watts) == (150.0, 200.0)
    report(env, reports=[pb.ThroughputReport(worker_id=b, throughput=power(250.0, common_pb2.POWER_SOURCE_RAPL))])
    assert (learners[b].watts, learners[b].source) == (250.0, PowerSource.RAPL)


def test_a_learner_registers_with_what_its_flags_say(env: Env) -> None:
    argv = ["--insecure", "--coordinator", env.server.address, "--power-w", "350", "--zone", "DE"]
    cfg = parse_worker([*argv, "--price-per-hour", "2.25", "--spot", "--power-meter", "declared"], {})
    meter = open_meter(cfg.power_meter, cfg.power_w, [])
    req = register_request(cfg, "w", None, "cpu", meter.reading())
    req.model_fingerprint = env.server.task.fingerprint
    worker_id = env.stub.Register(req, timeout=T).worker_id
    rec = env.server.state.energy.learners[worker_id]
    assert (rec.watts, rec.source, rec.zone, rec.price_per_hour, rec.spot) == (
        350.0,
        PowerSource.DECLARED,
        "DE",
        2.25,
        True,
    )
