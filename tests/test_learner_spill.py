"""A learner's error-feedback residual and θ_at_submit in files (`--spill-dir` on the worker): the flag, checked at
start; the same uploads, bit for bit, as a learner holding them in memory; the files unlinked from the start;
codecs it cannot serve keep the residual in memory; with streaming fragments, one residual per fragment and none
for the whole model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog
import torch

from diloco.core import learner as core
from diloco.core.broadcast import BroadcastShadow, HeldParams, PendingDelta
from diloco.core.fragments import FragmentLayout
from diloco.rpc.payload import NEVER, SPILL_ABOVE
from diloco.task.data import DataConfig
from diloco.task.factory import TaskConfig, build_task
from diloco.task.model import ModelConfig
from services.worker.__main__ import main
from services.worker.config import WorkerConfig, parse
from services.worker.metrics import Metrics
from services.worker.replica import Replica
from tests.support import Events, assert_finished_and_learned, cluster_config, resident_kb, running, wait_for


def _task(tmp_path: Path) -> TaskConfig:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog " * 2000)
    return TaskConfig(
        model=ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32),
        data=DataConfig(source=str(corpus), num_shards=2),
    )


CPU = torch.device("cpu")


def _replica(task: TaskConfig, codec: str, spill_dir: str, above: int | None = None) -> Replica:
    """A learner's replica at version 0. `above` (`--spill-above`) defaults to 0 when a directory is named (every
    vector there), else to the default size, which this small model's vectors are below."""
    above = above if above is not None else 0 if spill_dir else SPILL_ABOVE
    replica = Replica(WorkerConfig(coordinator="127.0.0.1:1", spill_dir=spill_dir, spill_above=above), CPU, Metrics())
    replica.start_session(task.to_json(), build_task(task).fingerprint)
    replica.use_layout(None, codec)
    assert replica.version0 is not None
    replica.params = (0, HeldParams(0, replica.version0))
    replica.adopt(core.Load(0, 0, reset_codec=False), structlog.get_logger(), "test")
    return replica


def _submit(replica: Replica, n: int) -> core.Submit:
    draft = core.SubmissionDraft("w", 1, f"s{n}", 0, (), 2, 128, 0)
    return core.Submit(draft, drain=False)


def test_the_flag_is_checked_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--coordinator", "127.0.0.1:1", "--insecure", "--spill-dir", str(tmp_path)], {}).spill_dir
    flags = ["--coordinator", "127.0.0.1:1", "--insecure", "--spill-above"]
    assert parse([*flags, "1G"], {}).spill_above == 1 << 30
    assert parse([*flags, "never"], {}).spill_above == NEVER
    assert parse(flags[:-1], {"DILOCO_SPILL_ABOVE": "0"}).spill_above == 0
    assert parse(flags[:-1], {}).spill_above == SPILL_ABOVE
    assert main([*flags, "lots"]) == 2
    assert "--spill-above" in (err := capsys.readouterr().err) and "2G" in err, err
    argv = ["--coordinator", "127.0.0.1:1", "--insecure", "--spill-dir", str(tmp_path / "nowhere")]
    assert main(argv) == 2
    assert "--spill-dir" in (err := capsys.readouterr().err) and "create it" in err, err


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_learner_with_its_residual_in_a_file_sends_the_same_uploads(tmp_path: Path, codec: str) -> None:
    task = _task(tmp_path)
    spill = tmp_path / "spill"
    spill.mkdir()
    filed, memory = _replica(task, codec, str(spill)), _replica(task, codec, "")
    [ef] = filed.efs
    assert ef.store is not None and ef.residual.numel() == 0
    # unlinked at once: an open file of this process, gone from the directory
    assert not list(spill.iterdir())
    assert any(
        "(deleted)" in os.readlink(f"/proc/self/fd/{fd}")
        for fd in os.listdir("/proc/self/fd")
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(spill))
    )
    cursor = 0
    for n in range(3):
        for _ in range(2):
            nxt = filed.step_at(0, cursor)
            assert memory.step_at(0, cursor) == nxt
            cursor = nxt
        assert filed.trainer is not None and filed.trainer._base_spilled == (n > 0)  # θ_at_submit in its file
        a, b = filed.upload_job(_submit(filed, n), 0), memory.upload_job(_submit(memory, n), 0)
        assert bytes(a.payload) == bytes(b.payload) and a.header.payload.crc32 == b.header.payload.crc32
    assert memory.trainer is not None and filed.trainer is not None
    assert torch.equal(filed.trainer.params_flat(), memory.trainer.params_flat())


@pytest.mark.parametrize("margin", [-1, 0])
def test_the_residual_goes_to_a_file_only_when_bigger_than_spill_above(tmp_path: Path, margin: int) -> None:
    task = _task(tmp_path)
    numel = sum(p.numel() for p in build_task(task).model_fn(0).parameters())
    replica = _replica(task, "int8", str(tmp_path), above=4 * numel + margin)  # fp32 bytes of the model, ±
    [ef] = replica.efs
    assert (ef.store is not None) is (margin < 0)
    assert ef.residual.numel() == (0 if margin < 0 else numel)


def test_a_codec_it_cannot_serve_keeps_the_residual_in_memory(tmp_path: Path) -> None:
    replica = _replica(_task(tmp_path), "topk", str(tmp_path))  # top-k picks over the whole vector
    [ef] = replica.efs
    assert ef.store is None and ef.residual.numel() > 0


def test_a_learner_with_fragments_holds_one_residual_per_fragment_and_none_for_the_whole(tmp_path: Path) -> None:
    replica = _replica(_task(tmp_path), "int8", "")
    whole = replica.numel
    assert [ef.residual.numel() for ef in replica.efs] == [whole]
    assert replica.trainer is not None
    layout = FragmentLayout.balanced([p.numel() for p in replica.trainer.model.parameters()], 3)
    replica.use_layout(layout, "int8")
    assert [ef.residual.numel() for ef in replica.efs] == [layout.size(p) for p in range(3)]
    assert sum(ef.residual.numel() for ef in replica.efs) == whole  # the model's worth of residual, not twice it
    replica.use_layout(None, "int8")  # registered again, without fragments
    assert [ef.residual.numel() for ef in replica.efs] == [whole]


@pytest.mark.parametrize("mode", ["load", "rebase"])
def test_a_learner_with_theta_hat_in_a_mapped_file_adopts_and_uploads_the_same_bits(tmp_path: Path, mode: str) -> None:
    """Θ̂ above --spill-above: version 0, and the deltas applied into it in place, live in a shared file mapping whose
    pages leave resident memory after each adopt and each submission; the parameters and uploads are the same bits
    as a learner holding Θ̂ in memory."""
    task = _task(tmp_path)
    filed, memory = _replica(task, "int8", str(tmp_path)), _replica(task, "int8", "")
    assert filed.params is not None and memory.params is not None
    held, theta0 = filed.params[1], memory.params[1].params
    assert resident_kb(held.params) == 0 and torch.equal(held.params, theta0)  # version 0 mapped, out of memory
    coordinator = BroadcastShadow(theta0.clone(), 0, "int4")
    cursor, gen = 0, torch.Generator().manual_seed(0)
    for v in range(1, 4):
        for _ in range(2):
            nxt = filed.step_at(0, cursor)
            assert memory.step_at(0, cursor) == nxt
            cursor = nxt
        a, b = filed.upload_job(_submit(filed, v), 0), memory.upload_job(_submit(memory, v), 0)
        assert bytes(a.payload) == bytes(b.payload)
        assert resident_kb(held.params) == 0  # read for the pseudo-gradient, released
        theta = coordinator.shadow + 1e-3 * torch.randn(theta0.numel(), generator=gen)
        d = coordinator.advance(theta, v)
        assert d is not None
        coordinator.record(d)
        for r in (filed, memory):
            assert r.params is not None
            r.params[1].queue(PendingDelta(v, d.start, d.meta, d.data, d.checksum))
            r.params = (v, r.params[1])
            adopt = core.Load(v, 0, reset_codec=False) if mode == "load" else core.Rebase(v)
            r.adopt(adopt, structlog.get_logger(), "test")
        assert resident_kb(held.params) == 0 and torch.equal(held.params, coordinator.shadow)  # Θ̂_v, bit for bit
        assert filed.trainer is not None and memory.trainer is not None
        assert torch.equal(filed.trainer.params_flat(), memory.trainer.params_flat())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_holding_everything_in_files_trains_to_its_target_exactly_once(tmp_path: Path) -> None:
    """`--spill-above 0` on every process: the coordinator's uploads and kept deltas in files, each learner's
    residual, θ_at_submit and Θ̂ (snapshots decoded into it, deltas applied into it) in files or mapped files; a
    real decoupled cluster trains to its target, every version received is applied, nothing counted twice."""
    spill = tmp_path / "spill"
    spill.mkdir()
    flags = ("--spill-dir", str(spill), "--spill-above", "0")
    cfg = cluster_config(
        tmp_path / "run",
        workers=2,
        mode="decoupled",
        outer_steps=8,
        coordinator_args=flags,
        worker_args={0: flags, 1: flags},
    )

    def mapped(name: str) -> bool:  # the learner maps a file of the spill directory (its Θ̂)
        try:
            return str(spill) in Path(f"/proc/{c.procs[name].popen.pid}/maps").read_text()
        except OSError:
            return False

    with running(cfg) as c:
        wait_for("both learners to map Θ̂", lambda: mapped("worker0") and mapped("worker1"), timeout_s=60)
        assert_finished_and_learned(c)
    for name in ("worker0", "worker1"):
        text = (tmp_path / "run" / f"{name}.log").read_text()
        assert "worker.broadcast_refused" not in text and "worker.spill_unused" not in text
        assert len(Events(tmp_path / "run" / f"{name}.log").all("worker.broadcast_received")) >= 2
    assert not list(spill.iterdir())  # every file unlinked from the start
