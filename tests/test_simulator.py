"""The virtual-clock simulator: sync equivalence, mixed hardware, failures, determinism, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from diloco.cli.main import main
from diloco.core.codecs import SparseCodec
from diloco.errors import ConfigError
from diloco.sim.config import FailureEvent, SimConfig, parse_failures, parse_speeds
from diloco.sim.engine import Simulator, simulate
from tests.support import tiny_task


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
        "eval_tokens": 1024,
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
        ({"ef_decay": 0.0}, r"ef_decay: error feedback decay \(beta\) must be in \(0, 1\]"),
        ({"ef_decay": 1.5}, "ef_decay"),
        ({"codec": "sparse", "topk_fraction": 1.5}, r"topk_fraction: sparse fraction must be in \(0, 1\]"),
        ({"mode": "eager"}, "mode"),
        ({"num_shards": 2, "speeds": (1.0,) * 4}, "num_shards"),
        ({"failures": (FailureEvent(1.0, 9, "kill"),)}, "failures"),
        ({"outer_steps": 0}, "stopping rule"),
        ({"eval_tokens": 31}, r"eval_tokens must be 0 .* >= model\.seq_len = 32"),
        ({"eval_every": 0}, "eval_every"),
    ],
)
def test_bad_config_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        cfg(**change)


def test_codec_settings_reach_the_learners() -> None:
    settings = {"codec": "sparse", "topk_fraction": 0.25, "ef_decay": 0.7}
    sim = Simulator(cfg(mode="sync", speeds=(1.0, 1.0), outer_steps=1, **settings))
    assert isinstance(sim.codec, SparseCodec) and sim.codec.per_chunk == 1024
    r = sim.run()
    assert r.rounds == 1 and all(learner.efs and all(ef.decay == 0.7 for ef in learner.efs) for learner in sim.learners)


@pytest.mark.parametrize("mode", ["sync", "dp"])
def test_history_counts_the_bytes_sent_by_each_evaluation(mode: str) -> None:
    r = simulate(cfg(mode=mode, speeds=(1.0, 1.0), outer_steps=3, codec="int8"))
    sent = [p["bytes"] for p in r.history]
    assert sent[0] == 0 and len(sent) == 4 and sent[-1] == r.bytes_up + r.bytes_down
    assert sent == sorted(set(sent)), sent  # every round sent something


def test_history_reports_the_tokens_scored_and_the_seed_orders_the_data() -> None:
    a, b = Simulator(cfg(mode="sync", speeds=(1.0, 1.0), outer_steps=2)), Simulator(cfg(outer_steps=2, seed=1))
    assert a.corpus is not None and b.corpus is not None
    assert np.array_equal(a.corpus.val, b.corpus.val)  # the seed never moves the split ...
    assert not np.array_equal(a.corpus.shard_tokens(0), b.corpus.shard_tokens(0))  # ... but orders the data
    r = a.run()
    assert [p["eval_tokens"] for p in r.history] == [1024] * 3
    whole = simulate(cfg(mode="sync", speeds=(1.0, 1.0), outer_steps=1, eval_tokens=0))
    assert whole.history[-1]["eval_tokens"] == (a.corpus.val.shape[0] - 1) // 32 * 32


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


# --- the data-parallel baseline (mode "dp") -------------------------------------------------------------------


def test_dp_with_one_learner_is_plain_training_on_the_same_batches() -> None:
    from diloco.sim.dp import DataParallelSimulator
    from diloco.task.factory import build_task
    from diloco.task.inner import InnerTrainer
    from diloco.task.params import flatten_params

    c = cfg(mode="dp", speeds=(1.0,), num_shards=4, local_steps=5, outer_steps=3, task=tiny_task(4))
    sim = DataParallelSimulator(c)
    result = sim.run()
    assert result.rounds == 15 and result.tokens == 15 * c.task.inner.batch_size * c.task.model.seq_len
    assert result.bytes_up == 0 and result.bytes_down == 4 * sim.numel  # only the initial download
    task = build_task(c.task)
    ref = InnerTrainer(task.model_fn(c.seed), task.corpus, c.task.inner, seq_len=c.task.model.seq_len)
    cursors = [0] * 4
    for step in range(15):
        shard = step % 4
        x, y, cursors[shard] = task.corpus.batch(shard, cursors[shard], c.task.inner.batch_size, c.task.model.seq_len)
        ref.step(x, y)
    assert sim.trainer is not None
    assert torch.equal(flatten_params(sim.trainer.model), flatten_params(ref.model))


def test_dp_time_and_bytes_follow_the_ring_allreduce_model() -> None:
    from diloco.sim.dp import allreduce_bytes_per_learner, allreduce_seconds

    numel, m, bw, lat = 1_000_000, 4, 50e6, 0.5
    c = cfg(
        mode="dp",
        speeds=(1.0, 1.0, 0.5, 1.0),
        train=False,
        model_numel=numel,
        bandwidth_bytes_per_s=bw,
        latency_s=lat,
        local_steps=10,
        outer_steps=2,
    )
    r = simulate(c)
    assert allreduce_bytes_per_learner(numel, m) == round(2 * 3 / 4 * 4 * numel)
    per_step = 2.0 + allreduce_seconds(numel, m, bw, lat)  # the slowest learner takes 2 s
    assert allreduce_seconds(numel, m, bw, lat) == pytest.approx(1.5 * 4 * numel / bw + 3.0)
    start = lat + 4 * numel / bw  # everyone downloads the initial parameters
    assert r.rounds == 20 and r.time_s == pytest.approx(start + 20 * per_step)
    assert r.bytes_up == 20 * m * allreduce_bytes_per_learner(numel, m)
    assert r.bytes_down == r.bytes_up + m * 4 * numel
    useful = 20 * (1 + 1 + 2 + 1)
    assert r.goodput == pytest.approx(useful / (m * r.time_s))


def test_dp_sends_over_100x_the_bytes_of_diloco_per_token() -> None:
    common = {"speeds": (1.0,) * 4, "train": False, "model_numel": 10_000_000, "local_steps": 100, "outer_steps": 5}
    dp = simulate(cfg(mode="dp", **common))
    sync = simulate(cfg(mode="sync", codec="int8", **common))
    assert dp.tokens == sync.tokens
    assert (dp.bytes_up + dp.bytes_down) >= 100 * (sync.bytes_up + sync.bytes_down)


def test_dp_loses_the_step_in_flight_and_stalls_on_a_failure() -> None:
    base = {"mode": "dp", "speeds": (1.0,) * 3, "train": False, "latency_s": 0.0, "bandwidth_bytes_per_s": 1e18}
    calm = simulate(cfg(**base, outer_steps=4))
    hit = simulate(cfg(**base, outer_steps=4, failures=parse_failures("kill:2@10.5,revive:2@20"), dead_after_s=2.0))
    assert calm.rounds == hit.rounds == 32 and calm.time_s == pytest.approx(32.0)
    assert hit.lost_steps == 1 and hit.reassign_latency_s == [2.0]
    # step 11 (10..11) is lost at 10.5; the survivors start again at 12.5; learner 2 is back for the step at 20.5
    assert hit.time_s == pytest.approx(12.5 + (32 - 10))
    assert hit.tokens == calm.tokens - 8 * c_tokens_per_step(cfg(**base, outer_steps=4))
    assert hit.goodput < calm.goodput


def c_tokens_per_step(c: SimConfig) -> int:
    return c.task.inner.batch_size * c.task.model.seq_len


def test_dp_mode_is_refused_by_the_diloco_engine() -> None:
    with pytest.raises(ConfigError, match="simulate"):
        Simulator(cfg(mode="dp"))


def test_sync_round_closes_after_a_learner_rejoins_mid_round() -> None:
    r = simulate(
        cfg(
            mode="sync",
            speeds=(1.0,) * 3,
            train=False,
            outer_steps=6,
            max_time_s=500.0,
            failures=parse_failures("kill:2@10,revive:2@13"),
        )
    )
    assert r.rounds == 6 and r.shardless_s < 20.0
    assert r.rejected == 0  # the rejoined learner submits against the version of the round it is in


def test_random_failures_hit_at_the_same_times_in_every_mode() -> None:
    from diloco.sim.dp import DataParallelSimulator

    def kill_times(sim: Simulator | DataParallelSimulator) -> list[tuple[float, int]]:
        seen: list[tuple[float, int]] = []
        peers = sim.learners if isinstance(sim, Simulator) else sim.peers
        original = sim.on_kill

        def on_kill(idx: int, inc: int | None = None) -> None:
            if peers[idx].alive and (inc is None or peers[idx].incarnation == inc):
                seen.append((sim.now, idx))
            original(idx, inc)

        sim.on_kill = on_kill  # type: ignore[method-assign]
        sim.run()
        return seen

    common = {"speeds": (1.0, 1.0, 0.5, 0.25), "train": False, "mtbf_s": 300.0, "repair_s": 50.0, "outer_steps": 0}
    runs = [
        kill_times(Simulator(cfg(mode="sync", max_time_s=2000.0, **common))),
        kill_times(Simulator(cfg(mode="decoupled", max_time_s=2000.0, **common))),
        kill_times(DataParallelSimulator(cfg(mode="dp", max_time_s=2000.0, **common))),
    ]
    assert len(runs[0]) > 5 and runs[0] == runs[1] == runs[2]
