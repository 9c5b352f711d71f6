"""Outer optimizers against torch and against hand-computed cases (ALGORITHM.md section 3)."""

from __future__ import annotations

import pytest
import torch

from diloco.core.outer import DelayedNesterov, FedAvg, Nesterov, OuterConfig, build_outer
from diloco.errors import ConfigError, InvalidArgument


@pytest.mark.parametrize("scratch_delta", [False, True])
@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (1.0, 0.0), (0.1, 0.5)])
def test_nesterov_is_bit_for_bit_torch_sgd(lr: float, momentum: float, scratch_delta: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=gen)
    ours = start.clone()
    ref = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=lr, momentum=momentum, nesterov=momentum > 0, dampening=0)
    opt = Nesterov(lr, momentum)
    for _ in range(6):
        delta = torch.randn(1000, generator=gen)
        ref.grad = delta.clone()
        opt.step(ours, delta, scratch_delta=scratch_delta)
        sgd.step()
        assert torch.equal(ours, ref.detach()), "outer step differs from torch.optim.SGD(nesterov=True)"


def test_nesterov_hand_computed() -> None:
    p = torch.tensor([1.0])
    opt = Nesterov(lr=0.5, momentum=0.5)
    opt.step(p, torch.tensor([1.0]))  # m = 1; p = 1 - 0.5 * (1 + 0.5 * 1) = 0.25
    assert p.item() == pytest.approx(0.25)
    opt.step(p, torch.tensor([2.0]))  # m = 0.5 + 2 = 2.5; p = 0.25 - 0.5 * (2 + 1.25) = -1.375
    assert p.item() == pytest.approx(-1.375)


def test_fedavg_adopts_the_mean() -> None:
    p = torch.tensor([3.0, -1.0])
    FedAvg().step(p, torch.tensor([1.0, -2.0]))
    assert p.tolist() == [2.0, 1.0]


def test_delayed_nesterov_hand_computed() -> None:
    p = torch.tensor([0.0])
    opt = DelayedNesterov(lr=1.0, momentum=0.5, num_learners=2)
    opt.step(p, torch.tensor([2.0]))  # p = -2/2 = -1; buf = 2
    assert p.item() == pytest.approx(-1.0)
    opt.step(p, torch.tensor([4.0]))  # p = -1 - 2 = -3; buf = 6; m = 3; p = -3 - 0.5 * 3 = -4.5
    assert p.item() == pytest.approx(-4.5)
    opt.step(p, torch.tensor([2.0]))  # p = -5.5; buf = 2 (momentum waits for N arrivals)
    assert p.item() == pytest.approx(-5.5)
    opt.step(p, torch.tensor([0.0]))  # buf = 2; m = 0.5 * 3 + 1 = 2.5; p = -5.5 - 1.25 = -6.75
    assert p.item() == pytest.approx(-6.75)


def test_state_round_trip_continues_identically() -> None:
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(10, generator=gen) for _ in range(4)]
    a, b = torch.zeros(10), torch.zeros(10)
    opt_a = Nesterov()
    for d in deltas[:2]:
        opt_a.step(a, d)
    opt_b = Nesterov()
    opt_b.load_state_dict(opt_a.state_dict())
    b.copy_(a)
    for d in deltas[2:]:
        opt_a.step(a, d)
        opt_b.step(b, d)
    assert torch.equal(a, b)


def test_bad_config_and_shapes() -> None:
    with pytest.raises(ConfigError, match="allowed: nesterov, fedavg, delayed_nesterov"):
        OuterConfig(name="adam")
    with pytest.raises(ConfigError, match=r"outer\.lr"):
        OuterConfig(lr=0)
    with pytest.raises(InvalidArgument, match="shape"):
        build_outer(OuterConfig()).step(torch.zeros(3), torch.zeros(4))
