"""Multi-process robust merge: one of four learners sends pseudo-gradients scaled x100 (worker fault injection,
`--fault-scale-updates`). The coordinator refuses them, quarantines that learner, moves its shards to healthy
learners after its strikes run out, and the run still learns as the other fault tests require, with every
committed token range exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.cluster import ClusterConfig
from tests.support import assert_finished_and_learned, cluster_config, running, wait_for, worker_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
FAULTY = "worker3"


# how much worse than the clean run the run with the faulty learner may end (the chaos suite's margin)
LOSS_MARGIN = 0.3


def config(tmp_path: Path, faulty: bool) -> ClusterConfig:
    """The faulty run: four learners, the fourth faulty. The clean run it is held to: the three healthy ones alone,
    the best a run can do once the fourth's work is all refused (with four, the clean run applies a third more
    tokens by the same version, and 12 versions in that alone is worth more than the margin)."""
    workers = 4 if faulty else 3
    return cluster_config(
        tmp_path / ("faulty" if faulty else "clean"),
        workers=workers,
        # as fast as the others: its first submission may be the run's first, before the median has a reference,
        # and the ceiling (what AdamW can produce) refuses it all the same
        slowdowns=(2.0,) * workers,
        outer_steps=12,
        checkpoint_every=4,
        worker_args={3: ("--fault-scale-updates", "100")} if faulty else {},
    )


def test_x100_learner_is_quarantined_and_the_run_stays_within_the_margin_of_a_clean_run(tmp_path: Path) -> None:
    with running(config(tmp_path, faulty=False)) as clean:  # the three healthy learners alone
        assert_finished_and_learned(clean)
        clean_status = clean.status()
        assert "worker.quarantined" not in (clean.run_dir / "coordinator.log").read_text()  # no false alarm
    with running(config(tmp_path, faulty=True)) as cluster:
        wait_for(f"{FAULTY} quarantined", lambda: worker_state(cluster, FAULTY) == "quarantined", timeout_s=90)
        assert cluster.status().rejected_submissions >= 1
        assert_finished_and_learned(cluster)
        status = cluster.status()
        # never released (every submission was refused) and none of its work counted; at the end it drained
        faulty = next(w for w in cluster.workers().workers if w.worker_name == FAULTY)
        assert faulty.submissions == 0 and faulty.tokens == 0, faulty
        log = (cluster.run_dir / "coordinator.log").read_text()
        assert "worker.quarantined" in log and "submission.rejected" in log
        assert '"reason": "norm_ceiling"' in log  # the ceiling refused it, not only the median
        loss, clean_loss = status.validation_loss, clean_status.validation_loss
        assert loss <= clean_loss + LOSS_MARGIN, (
            f"loss {loss:.3f} at version {status.version} ({status.tokens_applied} tokens, "
            f"{status.rejected_submissions} refused) vs {clean_loss:.3f} without the faulty learner at version "
            f"{clean_status.version} ({clean_status.tokens_applied} tokens)"
        )
