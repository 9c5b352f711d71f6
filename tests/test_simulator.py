"""The virtual-clock simulator: sync equivalence, mixed hardware, failures, determinism, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.cli.main import main
from diloco.errors import ConfigError
from diloco.sim.config import FailureEvent, SimConfig, parse_failures, parse_speeds
from diloco.sim.engine import Simulator, simulate
from tests.conftest import tiny_task


def cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = {
        "task": tiny_task(8),
        "num_shards": 8,
        "local_steps": 8,
        "min_local_steps": 2,
        "outer_steps": 6,
        "codec": "fp32",
        "latency_s": 0.2,
        "bandwidth_bytes_per_s": 1e8,
        "eval_batches": 2,
    }
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_decoupled_with_full_quorum_equals_sync_on_uniform_hardware() -> None:
    common = {"speeds": (1.0, 1.0, 1.0), "min_quorum": 3, "latency_s": 0.0, "bandwidth_bytes_per_s": 1e18}
    sync = Simulator(cfg(mode="sync", **common))
    dec = Simulator(cfg(mode="decoupled", **common))
    rs, rd = sync.run(), dec.run()
    assert torch.equal(sync.core.params, dec.core.params)
    assert [p["val_loss"] for p in rs.history] == [p["val_loss"] for p in rd.history]
    assert rs.time_s == pytest.approx(rd.time_s)


def test_decoupled_reaches_the_target_sooner_on_mixed_hardware() -> None:
    speeds = (1.0, 1.0, 0.5, 0.25)
    sync = simulate(cfg(mode="sync", speeds=speeds, outer_steps=8))
    target = sync.final_loss + 0.05
    dec = simulate(cfg(mode="decoupled", speeds=speeds, outer_steps=40, target_loss=target))
    assert sync.history[-1]["val_loss"] < sync.initial_loss - 0.5
    assert dec.time_to_target_s is not None, "decoupled never reached the loss sync reached"
    sync_time = next(p["time_s"] for p in sync.history if p["val_loss"] <= target)
    assert dec.time_to_target_s < sync_time
    assert dec.goodput > sync.goodput


def test_deterministic_for_a_seed() -> None:
    a = simulate(cfg(mtbf_s=30.0, repair_s=10.0, outer_steps=5))
    b = simulate(cfg(mtbf_s=30.0, repair_s=10.0, outer_steps=5))
    assert a.to_dict() == b.to_dict()


def test_killed_learner_is_reassigned_and_data_counted_once() -> None:
    c = cfg(
        speeds=(1.0, 1.0, 1.0),
        min_quorum=2,
        outer_steps=10,
        failures=parse_failures("kill:2@20,revive:2@60"),
        dead_after_s=2.0,
    )
    sim = Simulator(c)
    result = sim.run()
    assert result.reassign_latency_s == [pytest.approx(2.0)]
    assert result.final_loss < result.initial_loss - 0.5
    for shard in sim.core.ledger.states():
        cursor = 0
        for r in shard.committed_ranges:
            assert r.start == cursor, f"shard {shard.shard_id}: gap or overlap at {r}"
            cursor = r.end
        assert cursor == shard.committed
    assert sim.core.ledger.committed_tokens() == result.tokens


def test_timing_only_sweep_runs_many_learners() -> None:
    r = simulate(
        cfg(
            speeds=(1.0,) * 16,
            num_shards=32,
            min_quorum=8,
            train=False,
            model_numel=10_000_000,
            mtbf_s=200.0,
            repair_s=20.0,
            outer_steps=10,
        )
    )
    assert r.rounds == 10 and 0 < r.goodput <= 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"min_quorum": 5, "speeds": (1.0,) * 4}, "min_quorum"),
        ({"local_steps": -1}, "local_steps"),
        ({"codec": "int3"}, "codec"),
        ({"mode": "eager"}, "mode"),
        ({"num_shards": 2, "speeds": (1.0,) * 4}, "num_shards"),
        ({"failures": (FailureEvent(1.0, 9, "kill"),)}, "failures"),
        ({"outer_steps": 0}, "stopping rule"),
    ],
)
def test_bad_config_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        cfg(**change)


def test_parsers_reject_garbage() -> None:
    assert parse_speeds("1, 0.5") == (1.0, 0.5)
    with pytest.raises(ConfigError, match="speeds"):
        parse_speeds("fast,slow")
    with pytest.raises(ConfigError, match="kill:1@30"):
        parse_failures("kill-1")


def test_cli_reports_config_errors_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--speeds", "1,1", "-K", "3", "--outer-steps", "1"]) == 2
    assert "min_quorum" in capsys.readouterr().err
    assert main(["simulate", "--no-train", "--speeds", "1,1", "--outer-steps", "2", "--json"]) == 0
    assert '"rounds": 2' in capsys.readouterr().out


def test_empty_corpus_fails_at_start(tmp_path: object) -> None:
    import pathlib

    empty = pathlib.Path(str(tmp_path)) / "empty.txt"
    empty.write_text("")
    task = tiny_task(8)
    bad = dataclasses.replace(task, data=dataclasses.replace(task.data, source=str(empty)))
    with pytest.raises(ConfigError, match="empty"):
        Simulator(cfg(task=bad))
