"""Parameters as one flat fp32 vector, in `named_parameters()` order (shared/tied tensors appear once).

This is the layout of `Θ` and of every pseudo-gradient on the wire: `param_specs` describes it (name, shape,
offset), `flatten_params` reads it and `load_flat_` writes it back into a model.
"""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from diloco.core.merge import Segment
from diloco.errors import InvalidArgument


class ParamSpec(NamedTuple):
    """One tensor in the flat vector: `flat[offset : offset + prod(shape)]`."""

    name: str
    shape: tuple[int, ...]
    offset: int


def param_specs(model: nn.Module) -> list[ParamSpec]:
    """Name, shape and offset of every parameter, in `named_parameters()` order."""
    specs: list[ParamSpec] = []
    offset = 0
    for name, p in model.named_parameters():
        specs.append(ParamSpec(name, tuple(p.shape), offset))
        offset += p.numel()
    return specs


def num_params(model: nn.Module) -> int:
    """Length of the flat vector."""
    return sum(p.numel() for p in model.parameters())


def specs_fingerprint(specs: list[ParamSpec]) -> str:
    """Short stable hash of the parameter layout (names and shapes)."""
    blob = ";".join(f"{s.name}:{'x'.join(map(str, s.shape))}" for s in specs)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def flatten_params(model: nn.Module) -> Tensor:
    """A new contiguous fp32 vector of all parameters, on the model's device."""
    params = list(model.parameters())
    if not params:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])


@torch.no_grad()
def load_flat_(model: nn.Module, flat: Tensor) -> None:
    """Copy `flat` (any device, any float dtype) into the model's parameters in place.

    In place, so optimizers holding references to the parameters keep working.
    """
    total = num_params(model)
    if flat.ndim != 1 or flat.numel() != total:
        raise InvalidArgument(f"flat parameter vector has shape {tuple(flat.shape)}, expected ({total},)")
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(flat[offset : offset + n].view(p.shape))
        offset += n


def shape_numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a tensor of this shape."""
    return math.prod(shape)


def merge_segments(model: nn.Module) -> list[Segment]:
    """One merge segment per tensor; embedding tables are flagged (RDA averages them plainly)."""
    embeddings = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    return [Segment(s.offset, shape_numel(s.shape), embedding=s.name in embeddings) for s in param_specs(model)]
