"""Outer optimizers (ALGORITHM.md section 3). They update a flat fp32 parameter vector in place from a
merged pseudo-gradient `delta` (Δ = Θ_base − θ: subtracted like a gradient).

`Nesterov` performs exactly the arithmetic of `torch.optim.SGD(lr, momentum, nesterov=True, dampening=0)`
with `grad = delta`, op for op, so the two agree bit for bit. `FedAvg` is plain averaging (`Θ ← Θ − lr·Δ`).
`DelayedNesterov` (Async Local-SGD) applies each arrival at once and the momentum every N arrivals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diloco.errors import ConfigError, InvalidArgument

OUTER_NAMES = ("nesterov", "fedavg", "delayed_nesterov")


@dataclass(frozen=True)
class OuterConfig:
    name: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.name not in OUTER_NAMES:
            raise ConfigError(f"outer.name: unknown outer optimizer {self.name!r}; allowed: {', '.join(OUTER_NAMES)}")
        if not self.lr > 0:
            raise ConfigError(f"outer.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum must be in [0, 1), got {self.momentum}")


class OuterOptimizer(ABC):
    """Applies merged pseudo-gradients to the global parameters, in place."""

    name: ClassVar[str]

    @abstractmethod
    def step(self, params: torch.Tensor, delta: torch.Tensor, *, scratch_delta: bool = False) -> None:
        """Update `params` in place from the (merged) pseudo-gradient `delta`. `scratch_delta`: `delta` may be
        overwritten (the coordinator's merge buffer, emptied after the step), which saves a model-sized
        temporary; the result is the same, bit for bit."""

    def set_num_learners(self, n: int) -> None:  # noqa: B027 - only DelayedNesterov needs it
        """Tell the optimizer how many learners are live (used by DelayedNesterov)."""

    @property
    @abstractmethod
    def state_tensors(self) -> tuple[str, ...]:
        """The keys of `state_dict()` that hold a params-sized tensor once it has stepped (a snapshot carries them)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any], *, clone: bool = True) -> None:
        """Take `state` (as `state_dict()` lays it out); `clone=False` adopts its tensors as they are (the caller
        hands them over)."""

    @staticmethod
    def _check(params: torch.Tensor, delta: torch.Tensor) -> None:
        if delta.shape != params.shape or delta.dtype != params.dtype:
            raise InvalidArgument(
                f"pseudo-gradient has shape {tuple(delta.shape)} {delta.dtype}; "
                f"expected {tuple(params.shape)} {params.dtype}"
            )


class Nesterov(OuterOptimizer):
    """`m ← μ·m + Δ; Θ ← Θ − lr·(Δ + μ·m)` (torch SGD, nesterov=True, dampening=0)."""

    name = "nesterov"

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buf: torch.Tensor | None = None

    def step(self, params: torch.Tensor, delta: torch.Tensor, *, scratch_delta: bool = False) -> None:
        self._check(params, delta)
        d_p = delta
        if self.momentum != 0:
            if self.buf is None:
                self.buf = torch.clone(delta).detach()
            else:
                self.buf.mul_(self.momentum).add_(delta)
            if scratch_delta:
                d_p = delta.add_(self.buf, alpha=self.momentum)  # the same op as `add`, into delta's storage
            else:
                d_p = delta.add(self.buf, alpha=self.momentum)
        params.add_(d_p, alpha=-self.lr)

    @property
    def state_tensors(self) -> tuple[str, ...]:
        return ("buf",) if self.momentum != 0 else ()

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum, "buf": self.buf}

    def load_state_dict(self, state: dict[str, Any], *, clone: bool = True) -> None:
        self.lr, self.momentum, self.buf = float(state["lr"]), float(state["momentum"]), _clone(state["buf"], clone)


class FedAvg(Nesterov):
    """Plain averaging: `Θ ← Θ − lr·Δ` (lr = 1 adopts the mean of the learners' parameters)."""

    name = "fedavg"

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__(lr=lr, momentum=0.0)


class DelayedNesterov(OuterOptimizer):
    """Delayed Nesterov for `async` mode. On every arrival `Θ ← Θ − lr·Δ/N`, `buf ← buf + Δ`; every N arrivals
    `m ← μ·m + buf/N`, `Θ ← Θ − lr·μ·m`, `buf ← 0`. N is the number of live learners."""

    name = "delayed_nesterov"

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, num_learners: int = 1) -> None:
        self.lr = lr
        self.momentum = momentum
        self.n = max(1, num_learners)
        self.buf: torch.Tensor | None = None
        self.m: torch.Tensor | None = None
        self.count = 0

    def set_num_learners(self, n: int) -> None:
        self.n = max(1, n)

    def step(self, params: torch.Tensor, delta: torch.Tensor, *, scratch_delta: bool = False) -> None:
        self._check(params, delta)
        params.add_(delta, alpha=-self.lr / self.n)
        if self.buf is None:
            self.buf = torch.zeros_like(params)
            self.m = torch.zeros_like(params)
        self.buf.add_(delta)
        self.count += 1
        if self.count >= self.n:
            assert self.m is not None
            self.m.mul_(self.momentum).add_(self.buf, alpha=1.0 / self.n)
            params.add_(self.m, alpha=-self.lr * self.momentum)
            self.buf.zero_()
            self.count = 0

    @property
    def state_tensors(self) -> tuple[str, ...]:
        return ("buf", "m")

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "lr": self.lr,
            "momentum": self.momentum,
            "n": self.n,
            "buf": self.buf,
            "m": self.m,
            "count": self.count,
        }

    def load_state_dict(self, state: dict[str, Any], *, clone: bool = True) -> None:
        self.lr, self.momentum, self.n = float(state["lr"]), float(state["momentum"]), int(state["n"])
        self.buf, self.m = _clone(state["buf"], clone), _clone(state["m"], clone)
        self.count = int(state["count"])


def _clone(t: torch.Tensor | None, clone: bool = True) -> torch.Tensor | None:
    if t is None or not clone:
        return t
    return t.detach().clone()


def build_outer(cfg: OuterConfig, num_learners: int = 1) -> OuterOptimizer:
    if cfg.name == "nesterov":
        return Nesterov(cfg.lr, cfg.momentum)
    if cfg.name == "fedavg":
        return FedAvg(cfg.lr)
    return DelayedNesterov(cfg.lr, cfg.momentum, num_learners)
