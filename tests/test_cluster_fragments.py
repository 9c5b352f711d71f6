"""Streaming fragments end to end (docs/fragments.md): a real cluster of processes (healthd, a coordinator with
`--fragments 2`, two learners) trains to its target; every fragment was synchronised, by both learners, the ledger
is exactly once and the loss fell."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import Events, T, assert_finished_and_learned, cluster_config, pb, running

P = 2


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["decoupled", "sync"])
def test_cluster_with_two_fragments_trains_to_its_target_exactly_once(tmp_path: Path, mode: str) -> None:
    cfg = cluster_config(tmp_path, workers=2, mode=mode, outer_steps=12, coordinator_args=("--fragments", str(P)))
    with running(cfg) as c:
        assert_finished_and_learned(c)  # finished, loss well below an untrained model's, the ledger exactly once
        header = next(iter(c.stub.WatchParameters(pb.WatchParametersRequest(), timeout=T))).header
        assert header.finished and len(header.fragment_versions) == P
        assert all(v > 0 for v in header.fragment_versions), list(header.fragment_versions)  # each was stepped
        assert max(header.fragment_versions) == header.version
        coordinator = Events(tmp_path / "coordinator.log")
        accepted = coordinator.all("submission.accepted")
        # every learner submitted every fragment, one fragment per submission (worker ids are NAME-INCARNATION)
        submitted = {(str(e["worker_id"]).rsplit("-", 1)[0], e["fragment"]) for e in accepted}
        assert submitted == {(f"worker{i}", p) for i in range(2) for p in range(P)}, submitted
        refused = [e for e in coordinator.all("submission.rejected") if e.get("reason") != "finished"]
        assert not refused, refused  # no fragment looked like an outlier to the guard, none was stale
        stepped = [e["fragments"] for e in coordinator.all("round.closed")]
        assert len(stepped) == header.version and all(isinstance(f, list) and f for f in stepped)
        losses = {e["version"]: e["val_loss"] for e in coordinator.all("eval.done")}
        assert losses[max(losses)] < losses[0], losses  # the final loss is below the initial one
        for name in ("worker0", "worker1"):
            text = (tmp_path / f"{name}.log").read_text()
            assert '"fragments": 2' in text and "worker.task_refused" not in text
            assert "worker.broadcast_refused" not in text
            # a round's delta covers the fragments it stepped: one stepping a single fragment sends only its range
            received = Events(tmp_path / f"{name}.log").all("worker.broadcast_received")
            spans = {(int(str(e["start"])), int(str(e["numel"]))) for e in received if e["delta_from"] is not None}
            whole = max(start + numel for start, numel in spans)
            assert any(start > 0 for start, _ in spans) and any(numel < whole for start, numel in spans), spans
