"""Streaming fragments in the coordinator service (`--fragments P`, docs/fragments.md), in process on port 0 through a
real gRPC channel: the layout at registration, one fragment per submission, per-fragment versions in the broadcast,
bad fragment input refused with INVALID_ARGUMENT and nothing changed, checkpoints, and the flags refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from diloco.core.checksum import checksum
from diloco.core.codecs import get_codec
from diloco.core.fragments import FragmentLayout
from diloco.errors import ConfigError
from diloco.rpc.payload import PayloadReceiver, meta_from_proto, meta_to_proto
from services.coordinator.config import parse
from tests.support import Env, T, code_of, frozen, make_upload, pb, register, requests, submit

pytestmark = pytest.mark.timeout(60)
P = 2


def fragment_upload(
    env: Env, reg: pb.RegisterResponse, sid: str, fragment: int, seed: int = 0
) -> tuple[pb.SubmissionHeader, bytes, torch.Tensor]:
    """A valid submission of `fragment` (its slice of the flat vector only) against the learner's current plan."""
    layout = FragmentLayout(tuple(reg.fragment_bounds))
    delta = torch.randn(layout.size(fragment), generator=torch.Generator().manual_seed(seed)) * 1e-3
    h, _, _ = make_upload(env, reg, sid)
    data, meta = get_codec("fp32").encode(delta)
    h.payload.CopyFrom(meta_to_proto(meta, env.specs))  # the whole model's tensors; numel the fragment's
    h.fragment, h.fragment_layout = fragment, reg.fragment_layout
    return h, bytes(data), delta


def watch_header(env: Env) -> pb.ParametersHeader:
    msgs = list(env.stub.WatchParameters(pb.WatchParametersRequest(), timeout=T))
    return msgs[0].header


@pytest.fixture
def fenv(start: Callable[..., Env]) -> Env:
    return start(fragments=P, min_quorum=1)


def test_register_tells_the_layout_and_a_round_steps_only_its_fragment(fenv: Env) -> None:
    reg = register(fenv)
    layout = FragmentLayout(tuple(reg.fragment_bounds))
    assert reg.fragments == P and layout.fragments == P and layout.numel == fenv.numel
    assert reg.fragment_layout == layout.fingerprint == fenv.server.state.frag.layout.fingerprint  # type: ignore[union-attr]
    assert list(watch_header(fenv).fragment_versions) == [0, 0]
    before = fenv.server.core.params.clone()
    h, data, _ = fragment_upload(fenv, reg, "s1", fragment=1)
    resp = submit(fenv, h, data)
    assert resp.outcome == pb.SUBMISSION_OUTCOME_APPLIED and resp.version == 1
    after = fenv.server.core.params
    lo, hi = layout.range(1)
    assert torch.equal(after[:lo], before[:lo]) and not torch.equal(after[lo:hi], before[lo:hi])
    header = watch_header(fenv)
    assert header.version == 1 and list(header.fragment_versions) == [0, 1]
    h, data, _ = fragment_upload(fenv, reg, "s2", fragment=0, seed=1)
    assert submit(fenv, h, data).version == 2
    assert list(watch_header(fenv).fragment_versions) == [2, 1]
    ledger = fenv.stub.GetLedger(pb.GetLedgerRequest(), timeout=T)
    status = fenv.stub.GetStatus(pb.GetStatusRequest(), timeout=T)
    assert sum(s.committed for s in ledger.shards) == status.tokens_applied == 2 * 128  # each token once


def test_a_delta_chain_carries_each_versions_fragment_versions(start: Callable[..., Env]) -> None:
    env = start(fragments=P, min_quorum=1, broadcast_codec="int8")
    reg = register(env)
    for i, p in enumerate((1, 0, 1)):
        h, data, _ = fragment_upload(env, reg, f"s{i}", fragment=p, seed=i)
        submit(env, h, data)
    msgs = list(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=1, held_checksum=0), timeout=T))
    headers = [m.header for m in msgs if m.HasField("header")]
    # the checksum named is not the shadow's: a full snapshot of version 3, with its fragment versions
    assert [(h.version, list(h.fragment_versions)) for h in headers] == [(3, [2, 3])]
    receiver = PayloadReceiver(meta_from_proto(headers[0].payload), env.numel)
    for m in msgs[1:]:
        receiver.feed(m.data)
    held = int(headers[0].params_checksum)
    assert receiver.finish().numel() == env.numel
    chain = list(env.stub.WatchParameters(pb.WatchParametersRequest(after_version=3, held_checksum=held), timeout=T))
    assert chain[0].header.held and list(chain[0].header.fragment_versions) == [2, 3]


def test_fp32_broadcasts_send_only_the_stepped_fragment(start: Callable[..., Env]) -> None:
    # with fragments fp32 keeps a shadow too: version 2 (fragment 0 stepped) is a delta over fragment 0 alone
    env = start(fragments=P, min_quorum=1, broadcast_codec="fp32")
    reg = register(env)
    layout = FragmentLayout(tuple(reg.fragment_bounds))
    submit(env, *fragment_upload(env, reg, "s1", fragment=1)[:2])
    first = list(env.stub.WatchParameters(pb.WatchParametersRequest(), timeout=T))
    assert first[0].header.version == 1 and first[0].header.payload.numel == env.numel  # a snapshot first
    receiver = PayloadReceiver(meta_from_proto(first[0].header.payload), env.numel)
    for m in first[1:]:
        receiver.feed(m.data)
    held = receiver.finish()
    submit(env, *fragment_upload(env, reg, "s2", fragment=0, seed=1)[:2])
    request = pb.WatchParametersRequest(after_version=1, held_checksum=first[0].header.params_checksum)
    msgs = list(env.stub.WatchParameters(request, timeout=T))
    header = msgs[0].header
    lo, hi = layout.range(0)
    assert (header.version, header.delta_from, header.delta_start) == (2, 1, lo)
    assert meta_from_proto(header.payload).codec == "fp32" and header.payload.numel == hi - lo < env.numel
    receiver = PayloadReceiver(meta_from_proto(header.payload), hi - lo)
    for m in msgs[1:]:
        receiver.feed(m.data)
    held[lo:hi] += receiver.finish()
    assert torch.equal(held.view(torch.int32), env.server.state.shadow.shadow.view(torch.int32))
    assert checksum(held) == header.params_checksum


def _fragment(value: int) -> Callable[[pb.SubmissionHeader], None]:
    def mutate(h: pb.SubmissionHeader) -> None:
        h.fragment = value

    return mutate


def _layout(h: pb.SubmissionHeader) -> None:
    h.fragment_layout = "0" * 16


def _no_layout(h: pb.SubmissionHeader) -> None:
    h.fragment_layout = ""


def _whole_model_numel(h: pb.SubmissionHeader) -> None:
    h.payload.numel += 1


BAD: dict[str, Callable[[pb.SubmissionHeader], None]] = {
    "index-out-of-range": _fragment(P),
    "index-far-out": _fragment(2**31),
    "another-layout": _layout,
    "no-layout": _no_layout,
    "numel-not-the-fragments": _whole_model_numel,
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_fragment_input_is_invalid_argument_and_changes_nothing(fenv: Env, case: str) -> None:
    reg = register(fenv)
    h, data, _ = fragment_upload(fenv, reg, "s1", fragment=1)
    BAD[case](h)
    before = frozen(fenv)
    code, details = code_of(lambda: fenv.stub.SubmitPseudoGradient(iter(requests(h, data)), timeout=T))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details
    params, ledger, version = frozen(fenv)
    assert torch.equal(params, before[0]) and ledger == before[1] and version == before[2]
    assert all(acc.count == 0 for acc in fenv.server.state.frag.accs)  # type: ignore[union-attr]
    assert fenv.stub.GetStatus(pb.GetStatusRequest(), timeout=T).rejected_submissions == 1


def test_checkpoints_keep_the_fragment_state_and_another_p_is_refused(
    start: Callable[..., Env], tmp_path: Path
) -> None:
    env = start(fragments=P, min_quorum=1, checkpoint_dir=str(tmp_path), checkpoint_every=1000)
    reg = register(env)
    h, data, _ = fragment_upload(env, reg, "s1", fragment=1)
    submit(env, h, data)
    assert env.stub.Checkpoint(pb.CheckpointRequest(), timeout=T).version == 1
    frag = env.server.state.frag
    assert frag is not None
    params, momentum = env.server.core.params.clone(), frag.outers[1].state_dict()
    env.server.stop(1.0)
    again = start(fragments=P, min_quorum=1, checkpoint_dir=str(tmp_path))
    restored = again.server.state.frag
    assert restored is not None and restored.fragment_versions == [0, 1] and restored.fragment_steps == [0, 1]
    assert torch.equal(again.server.core.params, params)
    assert str(restored.outers[1].state_dict()) == str(momentum)
    assert list(watch_header(again).fragment_versions) == [0, 1]
    again.server.stop(1.0)
    with pytest.raises(ConfigError, match="fragments"):
        start(checkpoint_dir=str(tmp_path))  # written with fragments, read without
    with pytest.raises(ConfigError, match="fragment"):
        start(fragments=3, checkpoint_dir=str(tmp_path))  # another layout


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--fragments", "0"], "fragments must be an integer >= 1"),
        (["--fragments", "31"], "must be <= H"),  # local_steps 30
    ],
)
def test_bad_fragment_flags_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse(argv, {})


@pytest.mark.parametrize(
    "replica",
    [
        ["--replication-log", "4"],
        ["--follow", "127.0.0.1:1"],
        ["--etcd", "http://127.0.0.1:2379", "--replication-log", "4", "--checkpoint-dir", "x"],
    ],
)
def test_fragments_run_with_replicas(replica: list[str]) -> None:
    assert parse(["--insecure", "--fragments", "2", *replica], {}).fragments == 2


def test_more_fragments_than_tensors_is_refused(start: Callable[..., Env]) -> None:
    with pytest.raises(ConfigError, match="parameter tensors"):
        start(fragments=30, local_steps=30, min_local_steps=5)
