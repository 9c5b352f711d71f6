"""The learner's side of streaming fragments (docs/fragments.md): the coordinator's layout is checked against the
model built here before anything is trained (`Registration.layout`), and a submission names its fragment and layout
(`header_of`)."""

from __future__ import annotations

import pytest
import torch

from diloco.core.codecs import get_codec
from diloco.core.fragments import FragmentLayout
from diloco.core.learner import SubmissionDraft
from diloco.errors import ConfigError
from diloco.task.factory import build_task
from diloco.task.params import ParamSpec, param_specs
from diloco.v1 import common_pb2
from diloco.v1 import coordinator_pb2 as pb
from services.worker.session import Registration, header_of
from tests.support import tiny_task


def specs() -> list[ParamSpec]:
    return param_specs(build_task(tiny_task()).model_fn(0))


def response(**fields: object) -> Registration:
    return Registration.from_proto(
        pb.RegisterResponse(worker_id="w-1", mode=pb.ROUND_MODE_DECOUPLED, codec=common_pb2.CODEC_INT8, **fields)
    )


def registration(bounds: tuple[int, ...], fingerprint: str | None = None, fragments: int | None = None) -> Registration:
    layout = FragmentLayout(bounds)
    return response(
        fragments=layout.fragments if fragments is None else fragments,
        fragment_bounds=bounds,
        fragment_layout=layout.fingerprint if fingerprint is None else fingerprint,
    )


def test_the_coordinators_layout_is_taken_when_it_cuts_this_model_at_tensor_boundaries() -> None:
    s = specs()
    numel = sum(int(torch.Size(p.shape).numel()) for p in s)
    cut = FragmentLayout.balanced([int(torch.Size(p.shape).numel()) for p in s], 2)
    assert registration(cut.bounds).layout(s, numel) == cut
    assert response().layout(s, numel) is None  # P = 1


@pytest.mark.parametrize(
    "case", ["inside-a-tensor", "another-model-size", "another-fingerprint", "p-disagrees", "not-increasing"]
)
def test_a_layout_that_does_not_fit_this_model_is_a_configuration_error(case: str) -> None:
    s = specs()
    numel = sum(int(torch.Size(p.shape).numel()) for p in s)
    mid = s[len(s) // 2].offset
    with pytest.raises(ConfigError, match="fragment"):
        if case == "inside-a-tensor":
            registration((0, mid + 1, numel)).layout(s, numel)
        elif case == "another-model-size":
            registration((0, mid, numel + 1)).layout(s, numel)
        elif case == "another-fingerprint":
            registration((0, mid, numel), fingerprint="0" * 16).layout(s, numel)
        elif case == "p-disagrees":
            registration((0, mid, numel), fragments=3).layout(s, numel)
        else:
            response(fragments=2, fragment_bounds=(0, numel, mid)).layout(s, numel)


def test_a_fragment_submission_names_its_fragment_and_layout() -> None:
    _, meta = get_codec("fp32").encode(torch.zeros(10))
    draft = SubmissionDraft("w-1", 7, "s1", 3, (), 5, 128, 1, fragment=1)
    h = header_of(draft, meta, [], "abc")
    assert (h.fragment, h.fragment_layout, h.payload.numel) == (1, "abc", 10)
    whole = header_of(draft, meta, [])  # without fragments neither is set, whatever the draft says
    assert (whole.fragment, whole.fragment_layout) == (0, "")
