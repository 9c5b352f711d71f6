"""Islands (issue #12): a learner run as a torchrun group of ranks (gloo, CPU, 2 ranks), with real healthd,
coordinator and worker processes on loopback. Rank 0 alone talks to the coordinator; every rank trains its slice
of the island's global batch under DistributedDataParallel (or FSDP2 with `--shard-model`); rebase and resync are
broadcast from rank 0."""

from __future__ import annotations

import json
import os
import re
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diloco.cli.main import main as cli_main
from diloco.cluster import LocalCluster
from diloco.errors import InvalidArgument
from diloco.task.model import GPT, ModelConfig
from diloco.task.params import flatten_params, gather_flat, load_flat_, param_specs, scatter_flat_
from services.worker.__main__ import main as worker_main
from services.worker.island import Rank, shard_model
from tests.support import (
    Events,
    assert_exactly_once,
    assert_finished_and_learned,
    cluster_config,
    running,
    wait_for,
    worker_state,
)


def events(c: LocalCluster, name: str, event: str) -> list[dict[str, Any]]:
    """The JSON log records of child `name` (all its ranks and incarnations) with `event`. The ranks share one log
    file and a record's newline may land after another rank's record, so records are decoded where they start."""
    decoder = json.JSONDecoder()
    text = (c.run_dir / f"{name}.log").read_text(errors="replace")
    found = []
    for start in (m.start() for m in re.finditer(r'\{"service": ', text)):
        try:
            record, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if record.get("event") == event:
            found.append(record)
    return found


def params_by_rank(c: LocalCluster, name: str) -> dict[int, list[tuple[str, str, int]]]:
    """Per rank, the parameters' digest before and after each broadcast from rank 0, and the step count."""
    by_rank: dict[int, list[tuple[str, str, int]]] = defaultdict(list)
    for e in events(c, name, "island.params"):
        by_rank[e["rank"]].append((e["before"], e["after"], e["steps_done"]))
    return by_rank


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- without processes ------------------------------------------------------------------------------------------


def test_rank_comes_from_torchrun_environment() -> None:
    assert Rank.from_env({}) is None  # no torchrun: a one-process learner, as before islands
    assert Rank.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Rank(1, 2, 1)


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--device", "cpu", "--precision", "bf16"], "--precision"),
        (["--precision", "fp16"], "--precision"),
        (["--device", "tpu"], "--device"),
        (["--nproc-per-node", "0"], "--nproc-per-node"),
    ],
)
def test_bad_device_flags_exit_2_naming_the_flag(
    flags: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert worker_main(["--coordinator", "127.0.0.1:1", "--insecure", *flags]) == 2
    assert names in capsys.readouterr().err


def test_island_larger_than_the_gpus_or_without_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert worker_main(["--coordinator", "127.0.0.1:1", "--insecure", "--nproc-per-node", str(count + 1)]) == 2
        assert "--nproc-per-node" in capsys.readouterr().err
    else:
        assert (
            worker_main(["--coordinator", "127.0.0.1:1", "--insecure", "--nproc-per-node", "2", "--device", "cuda"])
            == 2
        )
        assert "CUDA is not available" in capsys.readouterr().err


# --- real clusters of islands -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_islands_of_two_ranks_train_exactly_once_with_identical_replicas(tmp_path: Path) -> None:
    checks = ("--island-checksums", "true")
    cfg = cluster_config(tmp_path, workers=2, outer_steps=8, nproc_per_worker=2, worker_args={0: checks, 1: checks})
    with running(cfg) as c:
        assert_finished_and_learned(c)
        kinds = {w.worker_name: w.throughput.device_kind for w in c.workers().workers}
        assert kinds == {"worker0": "cpu x2", "worker1": "cpu x2"}, kinds
        for name in ("worker0", "worker1"):
            proc = c.procs[name]
            wait_for(f"{name} to exit", lambda: not proc.alive, timeout_s=30)  # noqa: B023 - waited on here
            assert proc.popen.returncode == 0, c.tail(name)
            # every broadcast: rank 1's parameters equal rank 0's before it (DDP kept them equal) and after it
            by_rank = params_by_rank(c, name)
            assert set(by_rank) == {0, 1}, by_rank.keys()
            assert by_rank[0] == by_rank[1], f"{name}: the ranks' replicas differ"
            rebases = [p for p in by_rank[0] if p[2] > 0]
            assert len(rebases) >= 2, f"{name}: expected rebases after training, got {by_rank[0]}"
            assert all(before != after for before, after, _ in rebases)
            registered = events(c, name, "worker.registered")
            assert registered and all(e.get("rank", 0) == 0 for e in registered)
            assert {e["rank"] for e in events(c, name, "island.joined")} == {0, 1}


def _single_learner_run(tmp_path: Path, nproc: int) -> tuple[float, int]:
    """One learner (an island of `nproc` ranks) in sync mode: every round is exactly H steps of the same batches."""
    cfg = cluster_config(
        tmp_path / f"n{nproc}", workers=1, mode="sync", min_quorum=1, outer_steps=6, nproc_per_worker=nproc
    )
    with running(cfg) as c:
        assert_finished_and_learned(c)
        assert_exactly_once(c)
        s = c.final_status()
        return s.validation_loss, s.tokens_applied


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_rank_island_reaches_the_loss_of_one_rank_on_the_same_tokens(tmp_path: Path) -> None:
    loss1, tokens1 = _single_learner_run(tmp_path, 1)
    loss2, tokens2 = _single_learner_run(tmp_path, 2)
    print(f"island figures: 1 rank loss {loss1:.5f} tokens {tokens1}; 2 ranks loss {loss2:.5f} tokens {tokens2}")
    assert tokens1 == tokens2
    assert abs(loss2 - loss1) / loss1 < 0.02, (loss1, loss2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_one_rank_restarts_the_island_which_reregisters(tmp_path: Path) -> None:
    cfg = cluster_config(
        tmp_path,
        workers=2,
        outer_steps=16,
        slowdowns=(4.0, 4.0),
        nproc_per_worker=2,
        worker_args={0: ("--max-restarts", "3")},
    )
    with running(cfg) as c:
        wait_for("a first round", lambda: c.status().version >= 2, timeout_s=60)
        victim = next(e["pid"] for e in events(c, "worker0", "island.joined") if e["rank"] == 1)
        os.kill(victim, signal.SIGKILL)
        wait_for("the island to be started again", lambda: len(events(c, "worker0", "island.joined")) >= 4, 60)
        wait_for("worker0 to register again", lambda: len(events(c, "worker0", "worker.registered")) >= 2, 60)
        assert c.procs["worker0"].alive  # torchrun itself lives on
        # SIGKILL of worker1's torchrun ends its ranks too (they die with it), and worker1 is declared dead
        ranks = [e["pid"] for e in events(c, "worker1", "island.joined")]
        c.kill("worker1")
        wait_for("worker1's ranks to end", lambda: not any(alive(pid) for pid in ranks), timeout_s=10)
        wait_for("worker1 declared dead", lambda: worker_state(c, "worker1") == "dead", timeout_s=10)
        assert_finished_and_learned(c)
        ids = {w.worker_id for w in c.workers().workers if w.worker_name == "worker0"}
        assert len(ids) >= 2, "the restarted island is a new incarnation"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_island_whose_ranks_do_not_divide_the_batch_leaves_no_registration(tmp_path: Path) -> None:
    # the tiny task's global batch is 8 rows: 3 ranks cannot split it evenly
    cfg = cluster_config(tmp_path, workers=1, min_quorum=1, nproc_per_worker=3)
    with running(cfg) as c:
        proc = c.procs["worker0"]
        wait_for("the island to give up", lambda: not proc.alive, timeout_s=60)
        assert proc.popen.returncode != 0
        refused = events(c, "worker0", "worker.task_refused")
        assert refused and "--nproc-per-node" in refused[0]["detail"], c.tail("worker0")
        assert {e["rank"] for e in events(c, "worker0", "island.session_refused")} == {1, 2}
        assert worker_state(c, "worker0") == "left"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_drains_an_island_which_exits_0_and_leaves(tmp_path: Path) -> None:
    cfg = cluster_config(tmp_path, workers=2, outer_steps=10, slowdowns=(4.0, 4.0), nproc_per_worker=2)
    with running(cfg) as c:
        wait_for("a first round", lambda: c.status().version >= 2, timeout_s=60)
        ranks = [e["pid"] for e in events(c, "worker0", "island.joined")]
        c.signal("worker0", signal.SIGTERM)  # `diloco worker` passes it to the ranks; rank 0 drains
        assert c.procs["worker0"].popen.wait(timeout=30) == 0, c.tail("worker0")
        assert not any(alive(pid) for pid in ranks)
        wait_for("worker0 to have left", lambda: worker_state(c, "worker0") == "left", timeout_s=5)
        assert {e["rank"] for e in events(c, "worker0", "island.stopped")} == {1}
        assert_finished_and_learned(c)


# --- sharded islands (FSDP2, `--shard-model`) -------------------------------------------------------------------


def _gather_matches_an_unsharded_replica(rank: int, store: str) -> None:
    """One rank of a 2-rank group (gloo, a file store: no port): a sharded model loaded from a flat vector and
    stepped on its half of a batch holds, gathered onto rank 0, what an unsharded replica holds after the same
    load and a step on the whole batch."""
    torch.set_num_threads(1)  # a forked child: stay out of the parent's OpenMP thread pool
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2)
        ref, model = GPT(cfg, seed=0), GPT(cfg, seed=1)
        shard_model(model, torch.device("cpu"), 2)
        assert all(p.to_local().numel() < p.numel() for p in model.parameters() if p.ndim == 2)
        theta = flatten_params(GPT(cfg, seed=2))
        load_flat_(ref, theta)
        scatter_flat_(model, theta if rank == 0 else torch.zeros(0))
        gathered = gather_flat(model)
        assert torch.equal(gathered, theta) if rank == 0 else gathered.numel() == 0
        # a range of whole tensors (a streaming fragment) alone, read and written
        specs = param_specs(model)
        lo, hi = specs[2].offset, specs[5].offset
        part = gather_flat(model, lo, hi)
        assert torch.equal(part, theta[lo:hi]) if rank == 0 else part.numel() == 0
        other = -theta
        scatter_flat_(model, other[lo:hi] if rank == 0 else torch.zeros(0), lo, hi)
        gathered = gather_flat(model)
        if rank == 0:
            assert torch.equal(gathered, torch.cat([theta[:lo], other[lo:hi], theta[hi:]]))
        with pytest.raises(InvalidArgument, match="whole parameters"):
            gather_flat(model, lo + 1, hi)  # refused on every rank before any collective
        with pytest.raises(InvalidArgument, match=rf"expected \({hi - lo},\)"):
            scatter_flat_(model, theta[lo : hi - 1] if rank == 0 else torch.zeros(0), lo, hi)  # refused on every rank
        after = gather_flat(model)
        assert torch.equal(after, gathered) if rank == 0 else after.numel() == 0  # nothing was written
        scatter_flat_(model, theta if rank == 0 else torch.zeros(0))
        x, y = torch.randint(0, cfg.vocab_size, (2, 4, cfg.seq_len))
        for m, rows in ((ref, slice(0, 4)), (model, slice(2 * rank, 2 * rank + 2))):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            m.loss(x[rows], y[rows]).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
        gathered = gather_flat(model)
        if rank == 0:
            assert not torch.equal(gathered, theta)
            torch.testing.assert_close(gathered, flatten_params(ref), rtol=0, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_sharded_gather_gives_rank_0_the_parameters_of_an_unsharded_replica(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    mp.start_processes(_gather_matches_an_unsharded_replica, args=(store,), nprocs=2, start_method="fork")


def test_shard_model_without_an_island_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_main(["--coordinator", "127.0.0.1:1", "--insecure", "--shard-model", "true"]) == 2
    assert "--shard-model" in capsys.readouterr().err
    assert cli_main(["local", "--insecure", "--shard-model", "--nproc-per-worker", "1"]) == 2
    assert "--shard-model" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_island_trains_and_its_submissions_count_exactly_once(tmp_path: Path) -> None:
    # decoupled: the island trains on while its submission is merged, then rebases (a gather and a scatter)
    cfg = cluster_config(
        tmp_path,
        workers=1,
        min_quorum=1,
        outer_steps=4,
        nproc_per_worker=2,
        worker_args={0: ("--shard-model", "true", "--island-checksums", "true")},
    )
    with running(cfg) as c:
        assert_finished_and_learned(c)
        proc = c.procs["worker0"]
        wait_for("worker0 to exit", lambda: not proc.alive, timeout_s=30)
        assert proc.popen.returncode == 0, c.tail("worker0")
        joined = events(c, "worker0", "island.joined")
        assert {e["rank"] for e in joined} == {0, 1} and all(e["sharded"] for e in joined)
        # each rank holds its own shards: the ranks' digests differ, and every broadcast only carried the steps
        by_rank = params_by_rank(c, "worker0")
        assert set(by_rank) == {0, 1} and [p[2] for p in by_rank[0]] == [p[2] for p in by_rank[1]]
        assert by_rank[0][-1][1] != by_rank[1][-1][1]
        # every version is a round of this island's accepted submissions, each token of them counted once
        (island,) = [w for w in c.workers().workers if w.worker_name == "worker0"]
        status = c.final_status()
        assert status.version == 4 and island.submissions >= 4 and status.rejected_submissions == 0
        assert island.tokens == status.tokens_applied > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sharded_and_a_ddp_island_train_streaming_fragments_exactly_once(tmp_path: Path) -> None:
    # --fragments 2: each island submits one fragment at a time (rank 0 gathers θ, the others join) and rebases
    # only the fragments a version stepped (a gather and a scatter when sharded, a broadcast from rank 0 in DDP)
    checks = ("--island-checksums", "true")
    cfg = cluster_config(
        tmp_path,
        workers=2,
        outer_steps=8,
        nproc_per_worker=2,
        coordinator_args=("--fragments", "2"),
        worker_args={0: ("--shard-model", "true", *checks), 1: checks},
    )
    with running(cfg) as c:
        assert_finished_and_learned(c)  # finished, loss well below an untrained model's, the ledger exactly once
        for name in ("worker0", "worker1"):
            proc = c.procs[name]
            wait_for(f"{name} to exit", lambda: not proc.alive, timeout_s=30)  # noqa: B023 - waited on here
            assert proc.popen.returncode == 0, c.tail(name)
            assert not events(c, name, "worker.broadcast_refused"), c.tail(name)
        accepted = Events(tmp_path / "coordinator.log").all("submission.accepted")
        submitted = {(str(e["worker_id"]).rsplit("-", 1)[0], e["fragment"]) for e in accepted}
        assert submitted == {(f"worker{i}", p) for i in range(2) for p in range(2)}, submitted
        assert {e["rank"] for e in events(c, "worker0", "island.joined") if e["sharded"]} == {0, 1}
        sharded, ddp = params_by_rank(c, "worker0"), params_by_rank(c, "worker1")
        assert [p[2] for p in sharded[0]] == [p[2] for p in sharded[1]]  # each rank its own shards, in step
        assert ddp[0] == ddp[1] and len(ddp[0]) >= 3  # DDP: the ranks' replicas equal before and after each
