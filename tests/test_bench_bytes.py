"""Bytes against data-parallel at equal loss (`diloco.bench.bench_bytes`, `sim_bench.equal_loss`): the rule on
hand-made curves, and a tiny run of the section through its report and plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench.bench_bytes import CHOSEN, DEFAULT, GOAL, QUICK_GRID, config, markdown, plots, run
from diloco.bench.settings import FULL, SimSettings
from diloco.bench.sim_bench import SimRunner, at_first_reach, equal_loss, equal_loss_fmt, sim_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_first_reach_is_linear_between_the_evaluations_around_the_loss() -> None:
    h = [[0.0, 0.0, 5.0, 0.0], [10.0, 100.0, 3.0, 1000.0], [20.0, 200.0, 2.0, 3000.0], [30.0, 300.0, 2.5, 4000.0]]
    assert at_first_reach(h, 2.5, 3) == pytest.approx(2000.0)  # the first time, not the rise back at the end
    assert at_first_reach(h, 2.5, 1) == pytest.approx(150.0)
    assert at_first_reach(h, 3.0, 3) == 1000.0  # exactly at an evaluation
    assert at_first_reach(h, 6.0, 3) == 0.0  # as high as the start
    assert at_first_reach(h, 1.0, 3) is None


def test_equal_loss_charges_each_run_its_bytes_to_first_reach_the_diloco_loss() -> None:
    start = [0.0, 0.0, 5.0, 0.0]
    dp = {
        "per_seed": [
            {"history": [start, [1.0, 100.0, 3.0, 1000.0], [2.0, 200.0, 1.0, 3000.0]]},
            {"history": [start, [1.0, 100.0, 3.0, 1000.0], [2.0, 200.0, 2.5, 2000.0]]},  # never down to 2.0
        ]
    }
    diloco = {"loss_at_budget": 2.0, "history": [start, [1.0, 100.0, 3.5, 2.0], [2.0, 200.0, 2.0, 4.0]]}
    run_ = {"per_seed": [dict(diloco), dict(diloco)]}
    equal_loss(dp, run_)
    first, second = (one["equal_loss"] for one in run_["per_seed"])
    assert first == {
        "loss": 2.0,
        "bytes": 4.0,
        "dp_bytes": pytest.approx(2000.0),
        "dp_tokens": pytest.approx(150.0),
        "dp_reached": True,
        "ratio": pytest.approx(500.0),
    }
    # data-parallel's whole budget stands in: a lower bound, and the row says so
    assert second["dp_reached"] is False and second["dp_bytes"] == 2000.0 and second["dp_tokens"] == 200.0
    assert run_["equal_loss_ratios"] == pytest.approx([500.0, 500.0])
    assert equal_loss_fmt(run_) == "≥ 500x"


def test_the_default_row_is_section_1s_run_so_a_suite_run_shares_it() -> None:
    s = FULL.sim
    assert repr(config(s, DEFAULT, 1)) == repr(sim_config(s, mode="sync", seed=1))
    chosen = config(s, CHOSEN, 1)
    assert chosen.local_steps == round(CHOSEN.h_factor * s.local_steps) and chosen.codec == CHOSEN.upload
    assert chosen.broadcast_codec == CHOSEN.broadcast and chosen.token_budget == s.token_budget
    assert chosen.outer == CHOSEN.outer != DEFAULT.outer  # picked on seeds 3-5 (the module docstring)


@pytest.mark.timeout(300)
def test_the_section_runs_and_renders_its_table_target_and_plot(tmp_path: Path) -> None:
    s = SimSettings(token_budget=24_576, local_steps=4, min_local_steps=1, eval_tokens=1024, seeds=(0,))
    lines: list[str] = []
    result = run(s, QUICK_GRID, SimRunner(lines.append))
    assert len(lines) == 1 + len(QUICK_GRID), "data-parallel and each configuration, once per seed"
    text = markdown(result)
    assert f"| **{CHOSEN.label(s)}** |" in text and f"| {DEFAULT.label(s)} |" in text
    assert text.index("seed by seed") < text.index("| configuration |"), "the rule comes before the figures"
    (check,) = result["checks"]
    ratio = result["rows"][QUICK_GRID.index(CHOSEN)]["equal_loss_ratios"][0]
    assert check["pass"] is (ratio >= GOAL) and check["seeds"] == 1 and "1,000x" in check["target"]
    assert plots(result, tmp_path) == ["bytes_per_token.png"]
    assert (tmp_path / "bytes_per_token.png").read_bytes()[:8] == PNG_MAGIC
