"""Section `sparse` (`diloco.bench.bench_sparse`): fp32 and sparse are each judged at their own best outer setting."""

from __future__ import annotations

from diloco.bench.bench_sparse import QUICK, TUNED, markdown, run
from diloco.bench.sim_bench import SimRunner


def test_each_codec_is_judged_at_its_own_best_outer_setting() -> None:
    result = run(QUICK, SimRunner(lambda line: None))
    grid = {(c["codec"], tuple(c["outer"])): c["final_loss"] for c in result["grid"]}
    assert set(grid) == {(codec, outer) for codec in TUNED for outer in QUICK.outers}
    fp32, sparse, topk = result["rows"]
    for row in (fp32, sparse):
        lowest = min(loss for (codec, _), loss in grid.items() if codec == row["codec"])
        assert row["final_loss"] == lowest, row["codec"]
        assert grid[(row["codec"], tuple(row["outer"]))] == lowest
    assert topk["codec"] == "topk" and topk["outer"] == sparse["outer"]
    assert sparse["beta"] == QUICK.beta
    # the penalty is against the best fp32 cell, seed by seed
    assert sparse["penalties"] == [
        s / f - 1
        for s, f in zip(
            [r["final_loss"] for r in sparse["per_seed"]], [r["final_loss"] for r in fp32["per_seed"]], strict=True
        )
    ]
    text = markdown(result)
    assert "| outer step | `fp32` | `sparse` |" in text and "Nesterov 1 / 0" in text
