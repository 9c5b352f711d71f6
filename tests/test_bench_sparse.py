"""Section `sparse` (`diloco.bench.bench_sparse`): fp32 and sparse are each judged at the outer setting that was
best for them on other seeds."""

from __future__ import annotations

import dataclasses

import pytest

from diloco.bench.bench_sparse import QUICK, TUNED, markdown, run
from diloco.bench.sim_bench import SimRunner
from diloco.errors import ConfigError


def test_each_codec_is_judged_on_other_seeds_at_the_setting_chosen_on_the_tuning_seeds() -> None:
    result = run(QUICK, SimRunner(lambda line: None))
    grid = {(c["codec"], tuple(c["outer"])): c for c in result["grid"]}
    assert set(grid) == {(codec, outer) for codec in TUNED for outer in QUICK.outers}
    assert all([r["seed"] for r in c["per_seed"]] == list(QUICK.tune_seeds) for c in grid.values())
    fp32, sparse, topk = result["rows"]
    for row in (fp32, sparse):
        cells = [c for (codec, _), c in grid.items() if codec == row["codec"]]
        assert tuple(row["outer"]) == tuple(min(cells, key=lambda c: c["final_loss"])["outer"]), row["codec"]
        assert [r["seed"] for r in row["per_seed"]] == list(QUICK.seeds)
    assert topk["codec"] == "topk" and topk["outer"] == sparse["outer"]
    assert sparse["beta"] == QUICK.beta
    # the penalty is against fp32 at its chosen setting, seed by seed
    fp32_losses = [r["final_loss"] for r in fp32["per_seed"]]
    assert sparse["penalties"] == [
        s / f - 1 for s, f in zip([r["final_loss"] for r in sparse["per_seed"]], fp32_losses, strict=True)
    ]
    # the noise floor is fp32 at that setting rerun on other torch threads, seed by seed
    noise = result["noise"]
    assert noise["changes"] == [a / b - 1 for a, b in zip(noise["losses"], fp32_losses, strict=True)]
    text = markdown(result)
    assert "| outer step | `fp32` | `sparse` |" in text and "Nesterov 1 / 0" in text
    assert f"on seeds {QUICK.tune_seeds[0]}, which the comparison below does not use" in text
    assert "Noise floor: fp32 at its setting run again with torch on 2 threads" in text


def test_tuning_seeds_must_not_be_judged_seeds() -> None:
    with pytest.raises(ConfigError, match="overlap"):
        dataclasses.replace(QUICK, tune_seeds=(0, 3))
