"""The enum tables: every proto enum value (but UNSPECIFIED) has exactly one name, and unknown values are errors."""

from __future__ import annotations

import pytest

from diloco.core.codecs import CODEC_NAMES
from diloco.core.failure import NodeState
from diloco.core.rounds import MODES as ROUND_MODES
from diloco.core.states import WorkerState
from diloco.errors import InvalidArgument
from diloco.rpc.vocab import CODECS, MODES, NODE_STATES, WORKER_STATES, Vocabulary
from diloco.v1 import common_pb2, coordinator_pb2, healthd_pb2


@pytest.mark.parametrize(
    ("vocab", "enum", "names"),
    [
        (MODES, coordinator_pb2.RoundMode, ROUND_MODES),
        (CODECS, common_pb2.Codec, CODEC_NAMES),
        (NODE_STATES, healthd_pb2.NodeState, tuple(NodeState)),
        (WORKER_STATES, common_pb2.WorkerState, tuple(WorkerState)),
    ],
)
def test_every_enum_value_has_one_name_and_back(vocab: Vocabulary[object], enum: object, names: tuple[object]) -> None:
    values = [v for k, v in enum.items() if not k.endswith("_UNSPECIFIED")]  # type: ignore[attr-defined]
    assert sorted(vocab.to_proto(n) for n in names) == sorted(values)
    for n in names:
        assert vocab.from_proto(vocab.to_proto(n)) == n


@pytest.mark.parametrize("vocab", [MODES, CODECS, NODE_STATES, WORKER_STATES])
def test_unknown_values_are_errors_not_defaults(vocab: Vocabulary[object]) -> None:
    with pytest.raises(InvalidArgument, match="enum value 0"):
        vocab.from_proto(0)
    with pytest.raises(InvalidArgument, match="enum value 99"):
        vocab.from_proto(99)
    with pytest.raises(InvalidArgument, match="unknown"):
        vocab.to_proto("no-such-name")
