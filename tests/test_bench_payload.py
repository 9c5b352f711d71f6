"""The 1B-payload benchmark (`diloco.bench.bench_payload`) at a tiny size through a real coordinator process: every
round's figures, with and without a watcher (without, the uploads held in files), the process reaped; and its
memory check refusing a size that cannot fit before anything starts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from diloco.bench.bench_payload import LEARNERS, PHASES, QUICK, markdown, run
from diloco.errors import ConfigError


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("watch", "spill"), [(True, False), (False, True)])
def test_tiny_payload_measures_every_round(watch: bool, spill: bool) -> None:
    s = replace(QUICK, numel=400_000, baseline_numel=100_000, rounds=2, watch=watch, spill=spill)
    lines: list[str] = []
    result = run(s, lines.append)
    big, base = result["large"], result["baseline"]
    assert big["numel"] > base["numel"] > 0 and len(lines) == 2
    for r in (big, base):
        assert r["exit_code"] == 0, r
        assert [x["version"] for x in r["rounds"]] == [1, 2]
        for x in r["rounds"]:
            assert x["submissions"] == LEARNERS
            assert len(x["upload_s"]) == LEARNERS and all(u > 0 for u in x["upload_s"])
            assert all(x[f"{p}_s"] is not None and x[f"{p}_s"] >= 0 for p in PHASES), x
            if watch:
                assert x["receive_s"] > 0 and x["deliver_s"] > 0 and x["broadcast_bytes"] > 0, x
            else:
                assert x["receive_s"] is None and x["deliver_s"] is None, x
    assert big["peak"] >= big["rss_started"] > 0 and base["peak"] > 0
    assert result["model_bytes"] == 4 * big["numel"]
    (check,) = result["checks"]
    assert check["pass"] is None and "fp32 model sizes" in check["name"]  # too small to judge
    text = markdown(result)
    assert "| 2 |" in text and "| mean (after the first) |" in text
    assert ("--no-watch" in text) is not watch
    assert ("--spill-above 0" in check["name"]) is spill and (" --spill`" in text) is spill


def test_a_size_that_cannot_fit_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="need about"):
        run(replace(QUICK, numel=10**13), lambda line: None)
