"""Section `fragments` (`diloco.bench.bench_fragments`): every P is judged at the same applied tokens."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diloco.bench.bench_fragments import FULL, QUICK, FragmentSettings, check_at_budget, plots, run, sim_config
from diloco.bench.sim_bench import SimRunner
from diloco.errors import ConfigError


def test_the_budget_is_a_whole_number_of_whole_model_outer_steps() -> None:
    assert FULL.whole_step_tokens == 4 * 40 * 8 * 32
    assert FULL.token_budget == 40 * FULL.whole_step_tokens  # 1,638,400: 40 outer steps
    assert QUICK.token_budget % QUICK.whole_step_tokens == 0
    # 600,000 (the budget before): P = 1 stopped at 614,400 applied tokens, P = 4 at 604,160
    with pytest.raises(ConfigError, match="multiple of the tokens of one whole-model outer step"):
        FragmentSettings(token_budget=600_000)
    with pytest.raises(ConfigError):
        replace(QUICK, token_budget=QUICK.whole_step_tokens // 2)
    with pytest.raises(ConfigError):
        FragmentSettings(token_budget=0)


def test_a_run_that_did_not_stop_at_the_budget_stops_the_section() -> None:
    at = {"tokens": 614_400, "history": [[0.0, 0, 5.4, 0], [600.0, 614_400, 2.14, 1e7]]}
    check_at_budget({"seeds": [0], "per_seed": [at]}, 614_400, 1)  # stopped and evaluated at the budget: fine
    short = {"tokens": 604_160, "history": [[0.0, 0, 5.4, 0], [590.0, 604_160, 2.18, 1e7]]}
    with pytest.raises(RuntimeError, match="P = 4, seed 1: the run stopped at 604,160 applied tokens"):
        check_at_budget({"seeds": [0, 1], "per_seed": [at, short]}, 614_400, 4)


def test_every_p_applies_exactly_the_budget_and_is_scored_there(tmp_path: Path) -> None:
    s = replace(QUICK, token_budget=3 * QUICK.whole_step_tokens)
    threads = torch.get_num_threads()
    result = run(s, SimRunner(lambda line: None))
    for row in result["rows"]:
        assert row["tokens"] == s.token_budget, row["fragments"]
        assert row["loss_at_budget"] == pytest.approx(row["final_loss"], abs=1e-12)  # the evaluation at the budget
        assert all(one["history"][-1][1] == s.token_budget for one in row["per_seed"])  # kept for the plot
    assert [r["fragments"] for r in result["rows"]] == [1, 2, 4]
    # the noise floor is P = 1 run again on other threads, not the cached P = 1 run; torch's threads are restored
    assert len(result["noise"]["changes"]) == len(s.seeds)
    assert result["noise"]["losses"][0] == pytest.approx(
        result["rows"][0]["loss_at_budget"] * (1 + result["noise"]["changes"][0])
    )
    assert torch.get_num_threads() == threads
    assert plots(result, tmp_path) == ["fragments.png"] and (tmp_path / "fragments.png").stat().st_size > 5000


def test_a_run_on_other_threads_is_not_taken_from_the_cache() -> None:
    lines: list[str] = []
    runner = SimRunner(lines.append)
    cfg = replace(QUICK, token_budget=QUICK.whole_step_tokens)
    one = sim_config(cfg, 1, 0)
    runner.run(one, "a", cfg.token_budget)
    runner.run(one, "b", cfg.token_budget)
    runner.run(one, "c", cfg.token_budget, threads=2)
    assert ["reused" in line for line in lines] == [False, True, False]
