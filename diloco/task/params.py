"""Parameters as one flat fp32 vector, in `named_parameters()` order (shared/tied tensors appear once).

This is the layout of `Θ` and of every pseudo-gradient on the wire: `param_specs` describes it (name, shape,
offset), `flatten_params` reads it and `load_flat_` writes it back into a model. For a model sharded across a
process group with FSDP2 (`fully_shard`), `gather_flat` and `scatter_flat_` do the same collectively, through
torch's state-dict helpers (`torch.distributed.checkpoint.state_dict`). `HostBuffer` carries flat vectors from
the host to an accelerator through reusable pinned memory.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple

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


@torch.no_grad()
def gather_flat(model: nn.Module) -> Tensor:
    """The full parameters of a model sharded with `fully_shard`, as one flat fp32 vector on the CPU (the layout of
    `flatten_params`), on rank 0; an empty vector on the other ranks. A collective: every rank of the model's
    process group calls it together. The shards are gathered one tensor at a time into host memory, so no device
    ever holds the whole model."""
    # imported here, as in scatter_flat_: a second or more of start-up that only a sharded island needs
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if not state:  # not rank 0
        return torch.zeros(0, dtype=torch.float32)
    parts = []
    for s in param_specs(model):
        value = state[s.name]
        assert isinstance(value, Tensor), (s.name, type(value))  # a full state dict holds plain tensors
        parts.append(value.reshape(-1).to(torch.float32))
    return torch.cat(parts)


@torch.no_grad()
def scatter_flat_(model: nn.Module, flat: Tensor) -> None:
    """Load rank 0's `flat` (the layout of `flatten_params`, on the CPU) into every rank's shards of a model sharded
    with `fully_shard` (broadcast from rank 0, each rank keeping its own shards). A collective: every rank calls
    it together; the other ranks' `flat` is ignored (pass an empty vector). Buffers are left as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state: dict[str, Any] = {}
    if torch.distributed.get_rank() == 0:
        total = num_params(model)
        if flat.ndim != 1 or flat.numel() != total:
            raise InvalidArgument(f"flat parameter vector has shape {tuple(flat.shape)}, expected ({total},)")
        flat = flat.to("cpu", torch.float32)
        by_param = {}
        for s, p in zip(param_specs(model), model.parameters(), strict=True):
            by_param[id(p)] = flat[s.offset : s.offset + shape_numel(s.shape)].view(s.shape).to(p.dtype)
        # every name of a parameter, tied ones (an output head sharing the embedding) included
        for name, p in model.named_parameters(remove_duplicate=False):
            state[name] = by_param[id(p)]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)  # buffers: not ours
    result = set_model_state_dict(model, state, options=options)
    missing = set(result.missing_keys) & set(state)
    if missing:  # a name the state-dict helpers spell differently: never load only part of the parameters
        raise InvalidArgument(f"the sharded model did not take the parameters {sorted(missing)}")


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
