"""Energy-, carbon- and cost-aware placement in the coordinator service (issue #15), in-process on port 0 through
real channels: the power, zone, price and capacity learners send (bad values refused with INVALID_ARGUMENT and
nothing changed), the placement policy pausing a learner, the accounting counters, the carbon provider's
fallbacks, what GetStatus / ListWorkers / `diloco ctl` show, and the fleet's totals across a restart."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import structlog

from diloco.cli.local import summary as local_summary
from diloco.cli.main import main as cli_main
from diloco.core.energy import PowerSource
from diloco.errors import ConfigError
from diloco.v1 import common_pb2
from services.coordinator import checkpoint
from services.coordinator.__main__ import main as coordinator_main
from services.coordinator.config import parse as parse_coordinator
from services.coordinator.energy import SNAPSHOT_KEY, Totals
from services.worker.config import parse as parse_worker
from services.worker.control import register_request
from services.worker.power import open_meter
from tests.support import CARBON, Clock, Env, T, code_of, make_upload, pb, register, submit, wait_for

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
    assert not env.server.state.placement.book.learners


def test_registration_carries_power_zone_price_and_capacity(env: Env) -> None:
    reg = join(env, "w", power(420.0, NVML), zone="FR", price_per_hour=3.5, spot=True)
    rec = env.server.state.placement.book.learners[reg.worker_id]
    assert (rec.watts, rec.source, rec.zone, rec.price_per_hour, rec.spot) == (420.0, PowerSource.NVML, "FR", 3.5, True)
    plain = register(env, "v")  # an older learner: no power, zone or price
    rec = env.server.state.placement.book.learners[plain.worker_id]
    assert (rec.watts, rec.source, rec.zone, rec.price_per_hour, rec.spot) == (0.0, None, "", 0.0, False)


def report(env: Env, worker_id: str = "", tp: common_pb2.Throughput | None = None, **batch: Any) -> None:
    env.stub.ReportThroughput(pb.ReportThroughputRequest(worker_id=worker_id, throughput=tp, **batch), timeout=T)


def test_reported_power_updates_and_bad_reports_change_nothing(env: Env) -> None:
    a = join(env, "a", power(100.0)).worker_id
    b = join(env, "b", power(200.0)).worker_id
    report(env, a, power(150.0, NVML, tokens_per_s=10.0))
    learners = env.server.state.placement.book.learners
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
    rec = env.server.state.placement.book.learners[worker_id]
    assert (rec.watts, rec.source, rec.zone, rec.price_per_hour, rec.spot) == (
        350.0,
        PowerSource.DECLARED,
        "DE",
        2.25,
        True,
    )


# --- configuration ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--placement", "greedy"], "placement"),
        (["--placement", "carbon"], "--carbon-trace"),  # carbon needs a signal
        (["--carbon-provider", "not a function"], "--carbon-provider"),
        (["--deadline-s", "-1"], "deadline_s"),
        (["--carbon-threshold", "nan"], "carbon_threshold"),
        (["--carbon-provider-timeout-s", "0"], "carbon_provider_timeout_s"),
        (["--carbon-refresh-s", "inf"], "carbon_refresh_s"),
    ],
)
def test_bad_placement_flags_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_coordinator(["--insecure", *argv], {})


def test_placement_flags_and_env(tmp_path: Path) -> None:
    cfg = parse_coordinator(
        ["--insecure", "--placement", "cost", "--deadline-s", "3600"], {"DILOCO_CARBON_THRESHOLD": "250"}
    )
    assert (cfg.placement, cfg.deadline_s, cfg.carbon_threshold) == ("cost", 3600.0, 250.0)
    policy = cfg.policy_config(started_unix_s=1000.0)
    assert policy.deadline_s == 4600.0 and policy.min_active == cfg.min_quorum and policy.carbon_threshold == 250.0
    assert policy.started_s == 1000.0  # the energy policy's whole-job allowance counts from the start
    assert math.isinf(parse_coordinator(["--insecure"], {}).policy_config(1000.0).deadline_s)


def test_coordinator_exits_2_on_a_bad_trace_or_provider(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert coordinator_main(["--insecure", "--carbon-trace", str(tmp_path / "missing.csv")], {}) == 2
    assert "carbon trace" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    for rows, says in (
        ("DE,0,-5\n", "line 2"),
        ("DE,0,5000\n", "line 2: time_s must be finite and >= 0 and gco2_per_kwh from 0 to 2000"),  # absurd
        ("DE,0,100\nDE,3600,100\nDE,1800,100\n", "line 4: time 1800.0 of zone 'DE' is not after"),  # not monotonic
        ("DE,0,100\nDE,3600,100\nDE,7200,100\nDE,36000,100\n", "line 5: a gap in zone 'DE'"),
    ):
        bad.write_text("zone,time_s,gco2_per_kwh\n" + rows)
        assert coordinator_main(["--insecure", "--carbon-trace", str(bad)], {}) == 2
        assert says in capsys.readouterr().err
    assert coordinator_main(["--insecure", "--carbon-provider", "tests.nowhere:intensity"], {}) == 2
    assert "--carbon-provider tests.nowhere:intensity" in capsys.readouterr().err


def test_coordinator_exits_2_on_a_provider_module_that_raises_or_hangs_as_it_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "grid_raises.py").write_text("raise RuntimeError('no API key')\n")
    (tmp_path / "grid_hangs.py").write_text("from tests.support import CARBON\nCARBON.release.wait(30)\n")
    CARBON.release = type(CARBON.release)()
    flags = ["--insecure", "--carbon-provider-timeout-s", "0.3", "--carbon-provider"]
    try:
        assert coordinator_main([*flags, "grid_raises:intensity"], {}) == 2
        assert "cannot import grid_raises (RuntimeError('no API key'))" in capsys.readouterr().err
        started = time.monotonic()
        assert coordinator_main([*flags, "grid_hangs:intensity"], {}) == 2
        assert time.monotonic() - started < 10.0
        assert "importing grid_hangs took more than 0.3 s" in capsys.readouterr().err
    finally:
        CARBON.release.set()  # the import left behind ends


# --- placement --------------------------------------------------------------------------------------------------
APPLIED = pb.SUBMISSION_OUTCOME_APPLIED


def upload(env: Env, reg: pb.RegisterResponse, sid: str) -> pb.SubmissionHeader:
    header, data, _ = make_upload(env, reg, sid)
    assert submit(env, header, data).outcome == APPLIED  # async: every submission is a round
    return header


def shards_of(env: Env, reg: pb.RegisterResponse) -> list[int]:
    plan = env.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=reg.worker_id), timeout=T).plan
    return [s.shard_id for s in plan.shards]


def sample(env: Env, name: str, **labels: str) -> float:
    value = env.server.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def fast_and_slow(env: Env, clock: Clock, a: pb.RegisterResponse, b: pb.RegisterResponse) -> pb.SubmissionHeader:
    """`a` delivers 128 tokens in 0.1 s (1,280 tokens/s measured), `b` 128 in 9.9 s (about 12.9 tokens/s): `b` is
    about 1% of the fleet's speed, so pausing it costs the fleet about 1% (within every policy's allowance)."""
    clock.t = 1000.1
    upload(env, a, "a1")  # a hands half its shards over to b with this submission
    assert shards_of(env, b)
    clock.t = 1010.0
    return upload(env, b, "b1")


def test_energy_placement_pauses_the_inefficient_learner(
    start: Callable[..., Env], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        env = start(clock=clock, placement="energy", mode="async", min_quorum=1)
        a = join(env, "a", power(300.0, NVML))
        b = join(env, "b", power(1000.0))  # 77 J/token against a's 0.23
        hb = fast_and_slow(env, clock, a, b)
    (changed,) = [r for r in logs if r["event"] == "placement.changed"]
    assert changed["policy"] == "energy" and changed["paused"] == [b.worker_id]
    assert changed["reason"].startswith(f"energy: paused {b.worker_id} (") and "J/token" in changed["reason"]
    # b is paused: still registered and active, no shards; every shard is a's, b's applied range stays committed
    assert shards_of(env, b) == [] and len(shards_of(env, a)) == 8
    workers = {w.worker_id: w for w in env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers}
    assert workers[b.worker_id].state == common_pb2.WORKER_STATE_ACTIVE
    ledger = env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    assert {s.owner for s in ledger.shards} == {a.worker_id}
    held = ledger.shards[hb.ranges[0].shard_id]
    assert held.committed == hb.ranges[0].end and held.epoch > hb.ranges[0].epoch  # moved under a new epoch
    # b's next submission under its old lease is refused (exactly-once), and changes nothing
    hb.submission_id, hb.ranges[0].start, hb.ranges[0].end = "b2", hb.ranges[0].end, hb.ranges[0].end + 128
    code, _ = code_of(lambda: submit(env, hb, make_upload(env, a, "unused")[1]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert env.stub.GetLedger(pb.GetLedgerRequest(), timeout=T) == ledger
    # what each learner's accepted work drew: watts x work seconds
    joules = {a.worker_id: 300.0 * 0.1, b.worker_id: 1000.0 * 9.9}
    for w, j in joules.items():
        assert sample(env, "diloco_energy_joules_total", worker=w) == pytest.approx(j, rel=1e-6)
    assert sample(env, "diloco_fleet_energy_joules_total") == pytest.approx(sum(joules.values()), rel=1e-6)
    assert sample(env, "diloco_coordinator_paused_workers") == 1.0
    assert sample(env, "diloco_coordinator_placement_weight", worker=b.worker_id) == 0.0
    assert sample(env, "diloco_coordinator_placement_changes_total") == 1.0
    # what operators see
    wa, wb = workers[a.worker_id], workers[b.worker_id]
    assert (wb.placement_weight, wa.placement_weight) == (0.0, 1.0)
    assert (wa.throughput.watts, wa.throughput.power_source) == (300.0, NVML)
    assert (wb.throughput.watts, wb.throughput.power_source) == (1000.0, DECLARED)
    assert wb.energy_kwh == pytest.approx(9900.0 / 3.6e6, rel=1e-6) and wb.carbon_g == 0.0 and wb.cost == 0.0
    status = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    assert (status.placement, status.paused_workers, status.watts) == ("energy", 1, 1300.0)
    assert status.placement_reason == changed["reason"]
    assert status.energy_kwh == pytest.approx(9930.0 / 3.6e6, rel=1e-6)
    # `diloco ctl status` and `ctl workers` print them; the `diloco local` summary carries them
    ctl = ["ctl", "--coordinator", env.server.address, "--insecure"]
    monkeypatch.setenv("COLUMNS", "400")  # a wide terminal: rich would squeeze the columns into 80 characters
    assert cli_main([*ctl, "status"]) == 0
    out = capsys.readouterr().out
    assert "energy" in out and "placement reason" in out and "1,300 W" in out and "kWh" in out and "gCO2" in out
    assert cli_main([*ctl, "workers"]) == 0
    out = capsys.readouterr().out
    assert "paused" in out and "1,000 W (declared)" in out and "300 W (nvml)" in out
    cluster = SimpleNamespace(
        status=lambda: env.stub.GetStatus(pb.GetStatusRequest(), timeout=T),
        workers=lambda: env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T),
        run_dir=Path("unused"),
    )
    result = local_summary(cluster, time.monotonic())  # type: ignore[arg-type]
    assert result["energy_kwh"] == pytest.approx(9930.0 / 3.6e6, abs=1e-6) and result["placement"] == "energy"
    assert result["carbon_g"] == 0.0 and result["cost"] == 0.0
    assert result["workers"][b.worker_id]["watts"] == 1000.0  # type: ignore[index]


def test_cost_placement_pauses_the_learner_that_costs_more_per_token(start: Callable[..., Env]) -> None:
    clock = Clock()
    env = start(clock=clock, placement="cost", mode="async", min_quorum=1)
    a = join(env, "a", price_per_hour=2.0)
    # cheaper per hour but it says it is ~100x slower (a claim: its prior until measured): dearer per token
    b = join(env, "b", common_pb2.Throughput(tokens_per_s=13.0), price_per_hour=1.0, spot=True)
    clock.t = 1000.1
    upload(env, a, "a1")  # a measured at 1,280 tokens/s; the round's close weighs the learners
    assert shards_of(env, b) == [] and len(shards_of(env, a)) == 8
    status = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    assert status.paused_workers == 1 and status.placement_reason.startswith("cost: 1 learner(s), 2/h")
    clock.t += 3600.0  # an hour later: a paid for it, b (paused, taken as released) did not
    costs = {w.worker_id: w.cost for w in env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers}
    assert costs[b.worker_id] == pytest.approx(1.0 * 0.1 / 3600, rel=1e-6)
    assert costs[a.worker_id] == pytest.approx(2.0 * 3600.1 / 3600, rel=1e-6)


def trace(tmp_path: Path) -> Path:
    """FR is clean all along; DE is dirty (400 gCO2/kWh) for the first hour, then 100."""
    path = tmp_path / "carbon.csv"
    path.write_text("zone,time_s,gco2_per_kwh\nFR,0,50\nFR,3600,50\nDE,0,400\nDE,3600,100\n")
    return path


def test_carbon_placement_follows_the_zones_intensity_over_time(start: Callable[..., Env], tmp_path: Path) -> None:
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        env = start(
            clock=clock,
            placement="carbon",
            carbon_trace=str(trace(tmp_path)),
            carbon_threshold=200.0,
            mode="async",
            min_quorum=1,
        )
        a = join(env, "a", power(300.0), zone="FR", price_per_hour=3.6)
        b = join(env, "b", power(300.0), zone="DE", price_per_hour=7.2)
        fast_and_slow(env, clock, a, b)
        assert shards_of(env, b) == []  # DE is above 200 gCO2/kWh: b is paused
        clock.t = 1000.0 + 3700.0  # DE is at 100 now; the next round weighs the zones again
        upload(env, a, "a2")
        assert env.server.state.placement.book.learners[b.worker_id].weight == 1.0
        clock.t += 1.0
        upload(env, a, "a3")  # a's submission under the new plan hands shards back to b
        assert shards_of(env, b)
    reasons = [r["reason"] for r in logs if r["event"] == "placement.changed"]
    assert reasons == [f"carbon: paused {b.worker_id} (400 g/kWh)", "carbon: no dirty learner can pause"]
    # carbon: each learner's work at its zone's intensity over that work
    grams = {a.worker_id: 300.0 * 0.1 / 3.6e6 * 50.0, b.worker_id: 300.0 * 9.9 / 3.6e6 * 400.0}
    assert sample(env, "diloco_carbon_grams_total", worker=b.worker_id) == pytest.approx(grams[b.worker_id], rel=1e-6)
    assert sample(env, "diloco_carbon_grams_total", worker=a.worker_id) > grams[a.worker_id]  # and its later work
    # cost: price x hours registered and not paused; b's price stopped while it was paused
    status = env.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    b_cost = 7.2 * 10.0 / 3600 + 7.2 * (clock.t - 4700.0) / 3600
    assert sample(env, "diloco_cost_total", worker=b.worker_id) == pytest.approx(b_cost, rel=1e-6)
    a_cost = 3.6 * (clock.t - 1000.0) / 3600
    assert sample(env, "diloco_cost_total", worker=a.worker_id) == pytest.approx(a_cost, rel=1e-6)
    assert status.cost == pytest.approx(a_cost + b_cost, rel=1e-6)
    assert status.carbon_g == pytest.approx(sample(env, "diloco_fleet_carbon_grams_total"), rel=1e-9)
    assert status.energy_kwh == pytest.approx(sample(env, "diloco_fleet_energy_joules_total") / 3.6e6, rel=1e-9)
    assert (status.placement, status.placement_reason) == ("carbon", "carbon: no dirty learner can pause")
    assert status.paused_workers == 0 and status.watts == 600.0


def test_a_zone_the_trace_does_not_name_is_refused(start: Callable[..., Env], tmp_path: Path) -> None:
    env = start(carbon_trace=str(trace(tmp_path)))
    for zone in ("MARS", ""):
        code, details = code_of(lambda zone=zone: join(env, "w", power(100.0), zone=zone))  # type: ignore[misc]
        assert code == INVALID and "--zone" in details and "DE, FR" in details, details
    assert (
        not env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers
        and not env.server.state.placement.book.learners
    )
    assert join(env, "w", power(100.0), zone="DE").worker_id


# --- the carbon provider ------------------------------------------------------------------------------------------
def failures(env: Env, reason: str) -> float:
    return sample(env, "diloco_coordinator_carbon_provider_failures_total", reason=reason)


def fallbacks(env: Env, zone: str, to: str) -> float:
    return sample(env, "diloco_coordinator_carbon_fallbacks_total", zone=zone, to=to)


def test_a_carbon_provider_that_fails_or_hangs_keeps_the_last_good_value(start: Callable[..., Env]) -> None:
    CARBON.mode, CARBON.values, CARBON.release = "answer", {"FR": 42.0}, type(CARBON.release)()
    env = start(
        placement="carbon",
        carbon_provider="tests.support:carbon_provider",
        carbon_refresh_s=3600.0,  # the feed asks once per new zone; the test asks with refresh()
        carbon_provider_timeout_s=0.3,
    )
    feed = env.server.carbon
    assert feed is not None
    live = env.server.state.placement.book.signal.live
    try:
        with structlog.testing.capture_logs() as logs:
            a = join(env, "a", power(100.0), zone="FR")  # a new zone wakes the feed
            wait_for("the provider's first value", lambda: live.get("FR") == 42.0)
            for mode, bad, reason in (
                ("raise", None, "error"),
                ("bad", math.nan, "bad_value"),
                ("bad", -5.0, "bad_value"),
                ("bad", "40", "bad_value"),
                ("bad", 2500.0, "bad_value"),  # absurd: no grid emits that much (a unit mistake, say)
            ):
                CARBON.mode, CARBON.bad = mode, bad
                before = failures(env, reason)
                feed.refresh()
                assert live["FR"] == 42.0 and failures(env, reason) == before + 1
            assert failures(env, "error") == 1.0 and failures(env, "bad_value") == 4.0
            CARBON.mode = "hang"
            started = time.monotonic()
            feed.refresh()  # abandoned after 0.3 s
            assert time.monotonic() - started < 2.0 and failures(env, "timeout") == 1.0
            # the coordinator answers meanwhile, and its placement uses the last good value
            b = join(env, "b", power(100.0), zone="FR")
            assert env.server.state.placement.book.learners[b.worker_id].intensity == 42.0
            assert env.stub.GetStatus(pb.GetStatusRequest(), timeout=T).live_workers == 2
            feed.refresh()  # the hung call still runs: not asked again
            assert failures(env, "still_running") == 1.0
            CARBON.values["FR"] = 60.0
            CARBON.release.set()
            wait_for("the hung call to return", lambda: CARBON.calls > 0 and not feed.busy())
            assert live["FR"] == 42.0  # what the abandoned call returned is never used
            CARBON.mode = "answer"
            feed.refresh()
            assert live["FR"] == 60.0
        warned = [r for r in logs if r["event"] == "carbon.provider_failed"]  # each change once
        assert [r["reason"] for r in warned] == ["error", "bad_value", "timeout", "still_running"]
        assert all(r["log_level"] == "warning" and r["gco2_per_kwh"] == 42.0 for r in warned)
        assert all(r["fallback"] == "last_good" for r in warned)
        assert [r["zone"] for r in logs if r["event"] == "carbon.provider_recovered"] == ["FR"]
        assert fallbacks(env, "FR", "last_good") == 7.0  # every failed call
        assert a.worker_id
    finally:
        CARBON.release.set()


def test_a_zone_the_provider_leaves_out_keeps_its_last_value_or_counts_as_the_dirtiest(
    start: Callable[..., Env],
) -> None:
    """The provider answers a grid's mapping that leaves a zone out: that zone, never answered, is unknown, weighed
    and charged as the dirtiest known zone and at least 1000 gCO2/kWh (never 0); a zone answered before keeps its
    last good value through a mapping without it, None, NaN or an absurd value. Each change is logged once, every
    fallback counted by zone."""
    CARBON.mode, CARBON.values, CARBON.release = "grid", {"FR": 50.0}, type(CARBON.release)()
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        env = start(
            clock=clock,
            placement="carbon",
            carbon_provider="tests.support:carbon_provider",
            carbon_refresh_s=3600.0,  # the feed asks once per new zone; the test asks with refresh()
            mode="async",
            min_quorum=1,
        )
        feed, live = env.server.carbon, env.server.state.placement.book.signal.live
        assert feed is not None
        a = join(env, "a", power(300.0), zone="FR")
        b = join(env, "b", power(300.0), zone="PL")  # the provider's grid has no PL
        wait_for("FR's value and PL's miss", lambda: live.get("FR") == 50.0 and fallbacks(env, "PL", "unknown") >= 1)
        fast_and_slow(env, clock, a, b)  # b measured slow: pausing it costs the fleet ~1%
        assert shards_of(env, b) == []  # PL counts as the dirtiest zone: b is paused, its shards go to FR
        workers = {w.worker_id: w for w in env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers}
        assert (workers[b.worker_id].carbon_intensity, workers[a.worker_id].carbon_intensity) == (1000.0, 50.0)
        grams = 300.0 * 9.9 / 3.6e6 * 1000.0  # b's work, charged at the unknown zone's value
        assert sample(env, "diloco_carbon_grams_total", worker=b.worker_id) == pytest.approx(grams, rel=1e-6)
        for values in ({}, {"FR": None}, {"FR": math.nan}, {"FR": 1e6}):  # FR: no value, then no valid one
            CARBON.values = values  # type: ignore[assignment]
            feed.refresh()
            assert live["FR"] == 50.0 and "PL" not in live
        assert fallbacks(env, "FR", "last_good") >= 4.0 and failures(env, "missing") >= 3.0
        CARBON.values = {"FR": 60.0, "PL": 700.0}
        feed.refresh()
        assert live == {"FR": 60.0, "PL": 700.0}
    warned = [(r["zone"], r["reason"], r["fallback"]) for r in logs if r["event"] == "carbon.provider_failed"]
    assert warned == [("PL", "missing", "unknown"), ("FR", "missing", "last_good"), ("FR", "bad_value", "last_good")]
    recovered = sorted(r["zone"] for r in logs if r["event"] == "carbon.provider_recovered")
    assert recovered == ["FR", "PL"]


# --- across a restart -------------------------------------------------------------------------------------------
def fleet(env: Env) -> Totals:
    """The fleet's counters."""
    return Totals(
        sample(env, "diloco_fleet_energy_joules_total"),
        sample(env, "diloco_fleet_carbon_grams_total"),
        sample(env, "diloco_fleet_cost_total"),
    )


def test_the_fleets_totals_survive_a_restart_from_a_checkpoint(start: Callable[..., Env], tmp_path: Path) -> None:
    clock, ckpt = Clock(), tmp_path / "ckpt"
    flags = dict(clock=clock, checkpoint_dir=str(ckpt), checkpoint_every=1000, mode="async", min_quorum=1)
    env = start(carbon_trace=str(trace(tmp_path)), **flags)
    a = join(env, "a", power(300.0), zone="DE", price_per_hour=3.6)
    clock.t = 1000.1
    upload(env, a, "a1")  # 300 W x 0.1 s at 400 gCO2/kWh
    clock.t = 1100.0
    saved = env.stub.Checkpoint(pb.CheckpointRequest(), timeout=T)
    expected = Totals(30.0, 30.0 / 3.6e6 * 400.0, 3.6 * 100.0 / 3600)  # costs charged up to the checkpoint
    assert astuple(Totals.from_snapshot(checkpoint.load(saved.path))) == pytest.approx(astuple(expected))
    env.server.stop(1.0)
    with structlog.testing.capture_logs() as logs:
        again = start(carbon_trace=str(trace(tmp_path)), **flags)
    assert again.server.resumed_from == Path(saved.path)
    (restored,) = [r for r in logs if r["event"] == "checkpoint.restored"]
    assert (restored["energy_kwh"], restored["carbon_g"], restored["cost"]) == pytest.approx(
        (expected.joules / 3.6e6, expected.grams, expected.cost)
    )
    status = again.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    assert (status.energy_kwh, status.carbon_g, status.cost) == pytest.approx(
        (expected.joules / 3.6e6, expected.grams, expected.cost)
    )
    assert astuple(fleet(again)) == pytest.approx(astuple(expected))  # the counters resume from the checkpoint's totals
    # and go on from there; the learner registers again as a new incarnation, whose own figures start at zero
    b = join(again, "a", power(300.0), zone="DE", price_per_hour=3.6)
    assert b.worker_id != a.worker_id
    clock.t = 1100.2
    upload(again, b, "b1")
    assert sample(again, "diloco_energy_joules_total", worker=b.worker_id) == pytest.approx(300.0 * 0.2)
    assert fleet(again).joules == pytest.approx(expected.joules + 300.0 * 0.2)
    assert again.stub.GetStatus(pb.GetStatusRequest(), timeout=T).energy_kwh == pytest.approx(90.0 / 3.6e6)


@pytest.mark.parametrize("energy", [None, {"joules": "lots", "grams": 1.0, "cost": 1.0}], ids=["older", "malformed"])
def test_a_checkpoint_without_readable_totals_resumes_from_zero(
    start: Callable[..., Env], tmp_path: Path, energy: object
) -> None:
    env = start(checkpoint_dir=str(tmp_path / "first"), checkpoint_every=1000, mode="async", min_quorum=1)
    upload(env, join(env, "a", power(300.0)), "a1")
    snap = checkpoint.load(env.stub.Checkpoint(pb.CheckpointRequest(), timeout=T).path)
    assert Totals.from_snapshot(snap).joules > 0
    snap.pop(SNAPSHOT_KEY)  # as written before the totals were kept
    if energy is not None:
        snap[SNAPSHOT_KEY] = energy
    path, _ = checkpoint.save(tmp_path / "second", snap)
    with structlog.testing.capture_logs() as logs:
        again = start(checkpoint_dir=str(tmp_path / "second"))
    assert again.server.resumed_from == path and again.server.core.version == 1  # the run resumes all the same
    assert fleet(again) == Totals() and again.stub.GetStatus(pb.GetStatusRequest(), timeout=T).energy_kwh == 0.0
    dropped = [r for r in logs if r["event"] == "checkpoint.energy_totals_dropped"]
    assert len(dropped) == (energy is not None)
    assert all("joules must be a finite number" in r["error"] and r["log_level"] == "warning" for r in dropped)
