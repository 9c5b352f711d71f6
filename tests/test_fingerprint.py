"""The task fingerprint by part (model, tokenizer, data; issue #12 points 4 and 5): the pure format and comparison,
the coordinator's refusal naming the part, and a real learner process whose own data file differs from the
coordinator's: it exits 2 naming the data and leaves no registration behind."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from diloco.cli.ctl import state_name
from diloco.errors import ConfigError
from diloco.rpc.limits import MAX_FINGERPRINT_CHARS
from diloco.task.data import DataConfig
from diloco.task.factory import (
    FINGERPRINT_PARTS,
    PART_HEX,
    Fingerprint,
    TaskConfig,
    build_task,
    fingerprint_differences,
    fingerprint_mismatch,
)
from diloco.task.model import model_fingerprint
from services.worker.config import WorkerConfig
from services.worker.metrics import Metrics
from services.worker.replica import Replica
from tests.support import Env, T, code_of, pb, tiny_task

ROOT = Path(__file__).resolve().parents[1]
A, B, C = "0123456789ab", "ba9876543210", "ffffffffffff"

hex12 = st.text("0123456789abcdef", min_size=PART_HEX, max_size=PART_HEX)
fingerprints = st.builds(Fingerprint, model=hex12, tokenizer=hex12, data=hex12)


def text_task(source: Path) -> TaskConfig:
    """The tiny model on a small text file (2 shards)."""
    return dataclasses.replace(tiny_task(), data=DataConfig(source=str(source), num_shards=2, max_bytes=0))


def write_text(path: Path, word: str) -> Path:
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}  # {word}\n" for i in range(600)))
    return path


# --- the format and the comparison (pure) --------------------------------------------------------------------------


def test_the_rendered_form_names_its_parts_and_fits_the_register_bound() -> None:
    fp = Fingerprint(model=A, tokenizer=B, data=C)
    assert str(fp) == f"m={A}.t={B}.d={C}"
    assert len(str(fp)) == 44 <= MAX_FINGERPRINT_CHARS
    assert Fingerprint.parse(str(fp)) == fp


@given(fingerprints)
def test_parse_inverts_render(fp: Fingerprint) -> None:
    assert Fingerprint.parse(str(fp)) == fp
    assert fingerprint_differences(str(fp), str(fp)) == ()
    assert fingerprint_mismatch(str(fp), str(fp)) == ""


@given(fingerprints, fingerprints)
def test_differences_are_the_parts_whose_digests_differ(a: Fingerprint, b: Fingerprint) -> None:
    expected = tuple(n for n in FINGERPRINT_PARTS if getattr(a, n) != getattr(b, n))
    assert fingerprint_differences(str(a), str(b)) == expected == fingerprint_differences(str(b), str(a))


@pytest.mark.parametrize(
    "other",
    [
        "0123456789abcdef",  # an older build's one opaque hash
        "",
        f"m={A}.t={B}",
        f"m={A}.d={B}.t={C}",  # parts out of order
        f"m={A}.t={B}.d={C.upper()}",
        f"m={A}.t={B}.d={C}0",
        f"model={A}.t={B}.d={C}",
        f"m={A}.t={B}.d={C}.x={A}",
    ],
)
def test_a_fingerprint_of_another_form_differs_in_every_part(other: str) -> None:
    ours = f"m={A}.t={B}.d={C}"
    assert Fingerprint.parse(other) is None
    assert fingerprint_differences(ours, other) == FINGERPRINT_PARTS == fingerprint_differences(other, ours)
    message = fingerprint_mismatch(other, ours)
    assert "not of the form" in message and "task_json" in message


def test_the_message_names_each_part_that_differs_with_both_values_and_what_to_do() -> None:
    ours = f"m={A}.t={B}.d={C}"
    message = fingerprint_mismatch(f"m={A}.t={B}.d={A}", ours)
    assert message.startswith(f"the learner's data differs from the coordinator's (data {A} vs {C})")
    assert "--data" in message and "model" not in message and "tokenizer" not in message
    message = fingerprint_mismatch(f"m={B}.t={C}.d={C}", ours)
    assert message.startswith(f"the learner's model and tokenizer differ from the coordinator's (model {B} vs {A}")
    assert "--tokenizer" in message and "--model" in message and "--data" not in message
    everything = fingerprint_mismatch(f"m={C}.t={C}.d={A}", ours)
    assert "model, tokenizer and data differ" in everything and len(everything) < 512  # clip_details' bound


def test_malformed_parts_are_refused() -> None:
    with pytest.raises(ValueError, match="12 lowercase hex digits"):
        Fingerprint(model="xyz", tokenizer=B, data=C)


# --- built tasks: contents, not paths ------------------------------------------------------------------------------


def test_the_same_files_in_another_folder_give_the_same_fingerprint_and_other_data_differs_in_data(
    tmp_path: Path,
) -> None:
    here, there = tmp_path / "here", tmp_path / "there"
    for folder in (here, there):
        folder.mkdir()
    a = build_task(text_task(write_text(here / "corpus.txt", "a")))
    assert a.fingerprint == build_task(text_task(write_text(there / "corpus.txt", "a"))).fingerprint
    assert a.parts.model == model_fingerprint(tiny_task().model)[:PART_HEX]
    other = build_task(text_task(write_text(there / "corpus.txt", "b")))
    assert fingerprint_differences(a.fingerprint, other.fingerprint) == ("data",)
    wide = dataclasses.replace(tiny_task().model, d_model=64)
    wider = dataclasses.replace(text_task(here / "corpus.txt"), model=wide)
    assert fingerprint_differences(a.fingerprint, build_task(wider).fingerprint) == ("model",)


# --- the coordinator -----------------------------------------------------------------------------------------------


def test_register_refuses_a_learner_whose_data_differs_naming_the_data(env: Env) -> None:
    ours = Fingerprint.parse(env.server.task.fingerprint)
    assert ours is not None
    theirs = dataclasses.replace(ours, data="0" * PART_HEX if ours.data != "0" * PART_HEX else "1" * PART_HEX)
    request = pb.RegisterRequest(worker_name="w", model_fingerprint=str(theirs))
    code, details = code_of(lambda: env.stub.Register(request, timeout=T))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith(f"the learner's data differs from the coordinator's (data {theirs.data} vs {ours.data})")
    assert "--data" in details
    assert not env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers  # nothing registered
    # the same fingerprint, or none, registers; the reply carries the coordinator's fingerprint either way
    for sent in (env.server.task.fingerprint, ""):
        reply = env.stub.Register(pb.RegisterRequest(worker_name="w", model_fingerprint=sent), timeout=T)
        assert reply.task_fingerprint == env.server.task.fingerprint


# --- a real learner process ----------------------------------------------------------------------------------------


def run_learner(env: Env, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "services.worker", "--coordinator", env.server.address, "--insecure"]
    return subprocess.run(
        [*argv, "--name", "learner", "--device", "cpu", *flags],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def assert_left_naming_the_data(env: Env) -> None:
    workers = env.stub.ListWorkers(pb.ListWorkersRequest(), timeout=T).workers
    assert [(w.worker_name, state_name(w.state)) for w in workers] == [("learner", "left")]
    assert workers[0].state_reason.startswith("task refused: the learner's data differs"), workers[0].state_reason


@pytest.mark.timeout(120)
def test_a_learner_whose_own_data_file_differs_exits_2_naming_the_data_and_leaves(
    start: Callable[..., Env], tmp_path: Path
) -> None:
    corpus = write_text(tmp_path / "corpus.txt", "the coordinator's")
    env = start(task=text_task(corpus), min_quorum=1, expected_workers=1)
    # the learner's machine holds another file at the same path: the task JSON it adopts is the same
    write_text(corpus, "the learner's")
    proc = run_learner(env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "configuration error: the learner's data differs from the coordinator's" in proc.stderr, proc.stderr
    assert "worker.task_refused" in proc.stdout and "worker.deregistered" in proc.stdout, proc.stdout[-3000:]
    assert_left_naming_the_data(env)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_rank_of_an_island_checks_the_fingerprint(start: Callable[..., Env], tmp_path: Path) -> None:
    corpus = write_text(tmp_path / "corpus.txt", "the coordinator's")
    env = start(task=text_task(corpus), min_quorum=1, expected_workers=1)
    write_text(corpus, "the learner's")
    proc = run_learner(env, "--nproc-per-node", "2")
    assert proc.returncode != 0, proc.stdout[-3000:]  # torchrun reports a rank's failure as its own
    out = proc.stdout + proc.stderr
    assert "worker.task_refused" in out and "island.session_refused" in out, out[-3000:]
    assert out.count("the learner's data differs from the coordinator's") >= 3, out[-3000:]  # both ranks, stderr
    assert_left_naming_the_data(env)


def test_a_learner_checks_again_when_the_coordinator_comes_back_with_other_data(tmp_path: Path) -> None:
    # the same task JSON after a coordinator restart does not rebuild the task, but the fingerprint is compared anew
    task = text_task(write_text(tmp_path / "corpus.txt", "a"))
    ours = build_task(task).fingerprint
    replica = Replica(WorkerConfig(coordinator="127.0.0.1:1"), torch.device("cpu"), Metrics())
    replica.start_session(task.to_json(), ours)
    replica.start_session(task.to_json(), "")  # an older coordinator: not checked
    moved = str(dataclasses.replace(Fingerprint.parse(ours) or Fingerprint(A, B, C), data=C))
    with pytest.raises(ConfigError, match=r"^the learner's data differs from the coordinator's"):
        replica.start_session(task.to_json(), moved)
