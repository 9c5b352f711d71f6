"""Parameters as one flat fp32 vector, in `named_parameters()` order (shared/tied tensors appear once).

This is the layout of `Θ` and of every pseudo-gradient on the wire: `param_specs` describes it (name, shape,
offset), `flatten_params` reads it and `load_flat_` writes it back into a model. For a model sharded across a
process group with FSDP2 (`fully_shard`), `gather_flat` and `scatter_flat_` do the same collectively, a parameter at
a time, for the whole vector or a range of whole parameters (a streaming fragment). `HostBuffer` carries flat vectors
from the host to an accelerator through reusable pinned memory.
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
def flatten_params(model: nn.Module, lo: int = 0, hi: int | None = None) -> Tensor:
    """A new contiguous fp32 vector of the parameters, on the model's device: all of them, or values [lo, hi) of the
    flat vector (whole parameters: `whole_params`)."""
    params = list(model.parameters()) if hi is None else [p for _, p in whole_params(model, lo, hi)]
    if not params:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])


@torch.no_grad()
def load_flat_(model: nn.Module, flat: Tensor, lo: int = 0, hi: int | None = None) -> None:
    """Copy `flat` (any device, any float dtype) into the model's parameters in place: all of them, or those making
    up values [lo, hi) of the flat vector (whole parameters: `whole_params`).

    In place, so optimizers holding references to the parameters keep working.
    """
    whole, hi = hi is None, num_params(model) if hi is None else hi
    if flat.ndim != 1 or flat.numel() != hi - lo:
        raise InvalidArgument(f"flat parameter vector has shape {tuple(flat.shape)}, expected ({hi - lo},)")
    if whole and hi == 0:
        return  # a model without parameters
    for offset, p in whole_params(model, lo, hi):
        p.copy_(flat[offset - lo : offset - lo + p.numel()].view(p.shape))


@torch.no_grad()
def view_flat_(model: nn.Module, flat: Tensor) -> bool:
    """Make the model's parameters views of `flat` (the layout of `flatten_params`) instead of tensors of their own:
    no copy, the model reads what `flat` holds. Only where every parameter has `flat`'s dtype and device (then True);
    otherwise nothing changes and False is returned (`load_flat_` copies instead)."""
    total = num_params(model)
    if flat.ndim != 1 or flat.numel() != total:
        raise InvalidArgument(f"flat parameter vector has shape {tuple(flat.shape)}, expected ({total},)")
    params = list(model.parameters())
    if not flat.is_contiguous() or any(p.dtype != flat.dtype or p.device != flat.device for p in params):
        return False
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view(p.shape)
        offset += n
    return True


def whole_params(model: nn.Module, lo: int, hi: int) -> list[tuple[int, nn.Parameter]]:
    """The parameters that make up values [lo, hi) of the flat vector, each with its offset, for a range that starts
    and ends on parameter boundaries (a streaming fragment; the whole vector); `InvalidArgument` otherwise."""
    chosen, ends, offset = [], {0}, 0
    for p in model.parameters():
        if lo <= offset and offset + p.numel() <= hi:
            chosen.append((offset, p))
        offset += p.numel()
        ends.add(offset)
    if not (0 <= lo < hi <= offset and lo in ends and hi in ends):
        raise InvalidArgument(f"[{lo}, {hi}) is not a range of whole parameters of the {offset}-value flat vector")
    return chosen


@torch.no_grad()
def gather_flat(model: nn.Module, lo: int = 0, hi: int | None = None) -> Tensor:
    """Values [lo, hi) (whole parameters; default all) of the flat vector of a model sharded with `fully_shard`, as
    one fp32 vector on the CPU, on rank 0; an empty vector on the other ranks. A collective: every rank of the
    model's process group calls it together, with the same range. The parameters are gathered one at a time
    (`DTensor.full_tensor`), so no device ever holds more than the largest of them in full."""
    from torch.distributed.tensor import DTensor  # imported here: only a sharded island needs it

    hi = num_params(model) if hi is None else hi
    chosen = whole_params(model, lo, hi)
    leader = torch.distributed.get_rank() == 0
    out = torch.empty(hi - lo if leader else 0, dtype=torch.float32)
    for offset, p in chosen:
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if leader:
            out[offset - lo : offset - lo + p.numel()].copy_(full.detach().reshape(-1))
    return out


@torch.no_grad()
def scatter_flat_(model: nn.Module, flat: Tensor, lo: int = 0, hi: int | None = None) -> None:
    """Load rank 0's `flat` (values [lo, hi) of the flat vector, whole parameters, default all; on the CPU) into
    every rank's shards of a model sharded with `fully_shard`, in place: each parameter's shards are scattered from
    rank 0 (`distribute_tensor`), one parameter at a time. A collective: every rank calls it together, with the same
    range; the other ranks' `flat` is ignored (pass an empty vector). Buffers are left as they are. A `flat` of the
    wrong size is refused on every rank (rank 0 sends its verdict first), before anything is written, so no rank is
    left waiting in a scatter the others never join."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    hi = num_params(model) if hi is None else hi
    chosen = whole_params(model, lo, hi)
    leader = torch.distributed.get_rank() == 0
    shape = torch.tensor([flat.ndim, flat.numel()] if leader else [0, 0], dtype=torch.int64)
    torch.distributed.broadcast(shape, src=0)
    if shape.tolist() != [1, hi - lo]:
        dims, count = shape.tolist()
        got = tuple(flat.shape) if leader else f"a {dims}-d tensor of {count} values on rank 0"
        raise InvalidArgument(f"flat parameter vector has shape {got}, expected ({hi - lo},)")
    for offset, p in chosen:
        if leader:
            full = flat[offset - lo : offset - lo + p.numel()].view(p.shape).to(p.device, p.dtype)
        else:
            full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        if isinstance(p, DTensor):  # this rank's shards of rank 0's full values
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
        else:
            torch.distributed.broadcast(full, src=0)
            p.copy_(full)


def local_shards(model: nn.Module) -> list[Tensor]:
    """This rank's part of each parameter: the local shard of a sharded (DTensor) parameter, else the whole."""
    from torch.distributed.tensor import DTensor

    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


class HostBuffer:
    """One reusable host buffer for copies of flat vectors from the host to a device.

    With CUDA available the buffer is page-locked (pinned), so the copies are DMA transfers that the host does not
    wait for (`non_blocking`); a CUDA event marks when the buffer may be written again. On the CPU nothing is
    copied: `to_device` returns its input, exactly as without the buffer.
    """

    def __init__(self) -> None:
        self._buf: Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def _buffer(self, numel: int) -> Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last copy through the buffer is done with it
        if self._buf is None or self._buf.numel() != numel:
            self._buf = torch.empty(numel, dtype=torch.float32, pin_memory=torch.cuda.is_available())
        return self._buf

    def _mark(self) -> None:
        if torch.cuda.is_available():
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()

    def to_device(self, x: Tensor, device: torch.device) -> Tensor:
        """`x` (flat) as fp32 on `device`: itself (as fp32) when it is there already; from the host to CUDA a new
        device tensor, copied through this buffer without the host waiting (later work on the device is ordered
        after the copy)."""
        if device.type == "cpu" or x.device == device:
            return x.to(device, torch.float32)
        buf = self._buffer(x.numel())
        buf.copy_(x.reshape(-1))
        out = buf.to(device, non_blocking=True)
        self._mark()
        return out


def shape_numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a tensor of this shape."""
    return math.prod(shape)


def merge_segments(model: nn.Module) -> list[Segment]:
    """One merge segment per tensor; embedding tables are flagged (RDA averages them plainly)."""
    embeddings = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    return [Segment(s.offset, shape_numel(s.shape), embedding=s.name in embeddings) for s in param_specs(model)]
