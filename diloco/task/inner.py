"""The inner loop of a learner (ALGORITHM.md sections 1 and 5).

`InnerTrainer` owns one model replica and an AdamW optimizer whose state persists across rounds. It adopts
global parameters (`load_global`), runs `H` steps over its shards (`train`), and hands back the
pseudo-gradient `Δ = Θ_base - θ` with the tokens, steps and per-shard token ranges it consumed. For the
decoupled flow it keeps training after a submission and later `rebase`s onto the new global parameters,
keeping the steps made meanwhile.

Every flat vector crossing this API is a contiguous fp32 CPU tensor in `param_specs` order. Inside, the trainer
reads and writes its parameters through a `ParamIO`: by default `LocalParams` (the flat vectors live on the model's
device, so the pseudo-gradient is computed there and crosses to the host a slice at a time, and new parameters
cross to the device through a reusable pinned buffer on CUDA); a sharded island passes its own, whose reads and
writes are collectives of the island.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from diloco.core.codecs import SlabStore
from diloco.errors import ConfigError, InvalidArgument
from diloco.task._validate import check_float, check_int
from diloco.task.data import Corpus, model_loss
from diloco.task.model import pick_device
from diloco.task.params import HostBuffer, flatten_params, load_flat_, num_params, view_flat_

_SLICE = 1 << 22  # elements per slice of `InnerTrainer.submit_into` (16 MiB of fp32)


@dataclass(frozen=True)
class InnerConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio·lr` at `total_steps` (flat afterwards).

    `grad_clip=0` disables clipping. Weight decay applies to matrices and embeddings, not to biases and gains.
    """

    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    total_steps: int = 2000
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 8

    def __post_init__(self) -> None:
        check_float("inner", "lr", self.lr, lo=0.0, lo_open=True)
        check_float("inner", "weight_decay", self.weight_decay, lo=0.0)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ConfigError(f"inner.betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        for b in self.betas:
            check_float("inner", "betas", b, lo=0.0, hi=1.0, hi_open=True)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        check_int("inner", "warmup_steps", self.warmup_steps, minimum=0)
        check_int("inner", "total_steps", self.total_steps, minimum=1)
        check_float("inner", "min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)
        check_float("inner", "grad_clip", self.grad_clip, lo=0.0)
        check_int("inner", "batch_size", self.batch_size, minimum=1)


def lr_at(cfg: InnerConfig, step: int) -> float:
    """Learning rate for the step with 0-based index `step` (counted over the trainer's lifetime)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    lr_min = cfg.lr * cfg.min_lr_ratio
    return lr_min + (cfg.lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ShardWork(NamedTuple):
    """A shard to read this round: the owner's epoch (fencing token) and the cursor to start at."""

    shard_id: int
    epoch: int
    cursor: int


class ShardRangeT(NamedTuple):
    """Tokens `[start, end)` (absolute cursors) read from a shard under `epoch`."""

    shard_id: int
    epoch: int
    start: int
    end: int


@dataclass(frozen=True)
class RoundResult:
    """What one call to `InnerTrainer.train` did. `pseudo_grad` is `Θ_base - θ` (flat fp32, CPU)."""

    pseudo_grad: Tensor
    tokens: int
    steps: int
    ranges: list[ShardRangeT]
    loss: float
    seconds: float


@dataclass(frozen=True)
class Throughput:
    """Measured speed (EMA over steps, including any emulated slowdown)."""

    tokens_per_s: float
    step_time_s: float
    device_kind: str


class ParamIO(Protocol):
    """How a trainer reads and writes its model's parameters as one flat fp32 vector (`param_specs` order)."""

    @property
    def device(self) -> torch.device:
        """Where the vectors `read` returns and `write` takes live (the base is kept there)."""
        ...

    @property
    def flat_view(self) -> Tensor | None:
        """θ itself as one flat vector whose slices *are* the parameters (written in place), or None."""
        ...

    def read(self) -> Tensor:
        """θ, a new vector."""
        ...

    def write(self, flat: Tensor) -> None:
        """θ ← `flat`, in place (the optimizer keeps its references to the parameters)."""
        ...

    def read_range(self, lo: int, hi: int) -> Tensor:
        """θ[lo:hi], a new vector: values of whole parameters (a streaming fragment)."""
        ...

    def write_range(self, lo: int, hi: int, values: Tensor) -> None:
        """θ[lo:hi] ← `values`, in place, for a range of whole parameters."""
        ...


class LocalParams:
    """The parameters of a model held whole by this process, read and written on the model's device.

    With `flat=True` (and fp32 parameters on one device) the parameters are moved into one flat vector, `flat_view`,
    each parameter a view of its slice: a trainer then computes pseudo-gradients and rebases in place, without a
    model-sized copy of θ. Only before anything keeps references to the parameters' old storage (not under
    DistributedDataParallel, which the islands use: they pass `flat=False`)."""

    def __init__(self, model: nn.Module, device: torch.device, flat: bool = False) -> None:
        self.model, self._device = model, device
        self._flat: Tensor | None = None
        params = list(model.parameters())
        if flat and params and all(p.dtype == torch.float32 and p.device == device for p in params):
            live = flatten_params(model)
            view_flat_(model, live)
            self._flat = live

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def flat_view(self) -> Tensor | None:
        return self._flat

    def read(self) -> Tensor:
        return flatten_params(self.model)

    def write(self, flat: Tensor) -> None:
        if self._flat is not None:
            self._flat.copy_(flat)
        else:
            load_flat_(self.model, flat)

    def read_range(self, lo: int, hi: int) -> Tensor:
        if self._flat is not None:
            return self._flat[lo:hi].clone()
        return flatten_params(self.model, lo, hi)

    @torch.no_grad()
    def write_range(self, lo: int, hi: int, values: Tensor) -> None:
        if self._flat is not None:
            self._flat[lo:hi].copy_(values)
        else:
            load_flat_(self.model, values, lo, hi)


def _add_difference(out: Tensor, base: Tensor, theta: Tensor, scale: float) -> None:
    """out += (base − θ)·`scale` (no multiply when `scale` is 1), computed where the parameters are."""
    part = base - theta
    if scale != 1.0:
        part.mul_(scale)
    out.add_(part.cpu())


def _adamw(cfg: InnerConfig, params: list[Tensor]) -> torch.optim.AdamW:
    """AdamW over `params`: weight decay on the matrices and embeddings, none on biases and gains (an empty group
    is left out, unless both are)."""
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]] or groups,
        lr=cfg.lr,
        betas=cfg.betas,
        # one fused kernel per step: no model-sized temporaries, and on CPU about 2.4x faster than foreach
        fused=all(p.device.type in ("cpu", "cuda") for p in params),
    )


class InnerTrainer:
    """One learner's model replica, AdamW state and base parameters.

    `slowdown > 1` sleeps `(slowdown - 1)·step_time` after each step, to emulate older hardware. `sleep` and
    `clock` are injectable for tests; `loss_fn` replaces `model.loss` (an island's DistributedDataParallel) and
    `params` how the parameters are read and written (default `LocalParams`, with the parameters in one flat
    vector when there is no `loss_fn`; a sharded island's gathers them). `step_in_backward` (where the gradients are
    this process's own, not synchronized by an island's wrapper): without clipping (`grad_clip=0`), each parameter
    takes its AdamW step in backward as soon as its gradient is complete, and the gradient is dropped there, with
    the same bits as one step over the whole model after backward; with clipping, which needs every gradient's
    norm first, the steps come after backward.

    Memory: besides the model, its gradients (freed after each step; stepping in backward, at most those not yet
    complete) and the AdamW state, a trainer keeps at most
    one model-sized vector, the base: Θ_base until a submission, then θ_at_submit (the parameters whose
    pseudo-gradient was sent), which is all a later rebase needs. Adopted with `share=True` (the learner's `Θ̂`,
    which changes only in place to the next version it adopts, after `base_moving`), Θ_base is the caller's tensor
    itself, not a copy. With flat
    parameters (`LocalParams.flat_view`) pseudo-gradients and rebases are computed in place, and θ_at_submit is
    copied only at the first step after the submission (a learner that adopts a new version first, as a `sync`
    one does, never copies it); `submit_into` adds the pseudo-gradient into the caller's buffer a slice at a
    time, with no model-sized temporary. With `spill_base` (flat CPU parameters, the worker's `--spill-dir`) that
    copy goes to a file, written and read a slice at a time: no model-sized vector at all besides θ.
    """

    _EMA = 0.2

    def __init__(
        self,
        model: nn.Module,
        corpus: Corpus,
        cfg: InnerConfig,
        *,
        seq_len: int,
        device: torch.device | None = None,
        slowdown: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        params: ParamIO | None = None,
        step_in_backward: bool = True,
    ) -> None:
        check_int("model", "seq_len", seq_len, minimum=1)
        check_float("trainer", "slowdown", slowdown, lo=1.0)
        self.cfg = cfg
        self.corpus = corpus
        self.seq_len = seq_len
        self.device = device if device is not None else pick_device()
        self.model = model.to(self.device)
        self.slowdown = float(slowdown)
        # `loss_fn` (a hook for the worker's islands): what computes the loss of a batch instead of `model.loss`,
        # e.g. a DistributedDataParallel wrapper of the model on its device; the parameters stay `model`'s
        self._loss: Callable[[Tensor, Tensor], Tensor] = loss_fn if loss_fn is not None else model_loss(self.model)
        self._sleep = sleep
        self._clock = clock
        # no global gradient norm to wait for: each parameter may take its AdamW step as soon as its gradient is
        # complete, and drop it (see `_step_one`)
        self.in_backward = step_in_backward and cfg.grad_clip == 0
        self.optimizer: torch.optim.AdamW | None = None  # the whole model's (None when stepping in backward)
        self._param_opt: dict[Tensor, torch.optim.AdamW] = {}  # each parameter's own (stepping in backward)
        if self.in_backward:
            for p in self.model.parameters():
                self._param_opt[p] = _adamw(cfg, [p])
                p.register_post_accumulate_grad_hook(self._step_one)  # type: ignore[no-untyped-call]
        else:
            self.optimizer = _adamw(cfg, list(self.model.parameters()))
        self._stepping = False  # inside `step`'s backward: the hooks step their parameter
        self.steps_done = 0
        self.numel = num_params(self.model)
        self.io: ParamIO = params if params is not None else LocalParams(self.model, self.device, flat=loss_fn is None)
        self._host = HostBuffer()  # device <-> host copies of flat vectors (pinned on CUDA)
        # Θ_base, or θ_at_submit after a submission (class docstring); None: θ itself, no step since the submission
        # (flat parameters only: see `_hold_base`)
        self._base: Tensor | None = self.io.read()
        self._base_shared = False  # the caller's tensor (`share=True`): never written here
        self._base_store: SlabStore | None = None  # where θ_at_submit is copied (`spill_base`)
        self._base_spilled = False  # the base is θ_at_submit in `_base_store` (then `_base` is None)
        self._step_time_s = 0.0

    # -- parameters ---------------------------------------------------------------------------------------

    def params_flat(self) -> Tensor:
        """Current parameters θ (flat fp32, CPU)."""
        return self.io.read().cpu()

    @property
    def base(self) -> Tensor:
        """What the next pseudo-gradient is measured against (flat fp32, CPU): Θ_base, the global parameters last
        adopted, or θ_at_submit once a pseudo-gradient was submitted since (the steps after it are the unsent
        ones)."""
        if self._base_spilled:
            assert self._base_store is not None
            full = torch.empty(self.numel, dtype=torch.float32)
            self._base_store.read(0, full)
            return full
        return self._base_or_theta().cpu()

    def spill_base(self, store: SlabStore) -> None:
        """Copy θ_at_submit into `store` (e.g. `diloco.rpc.payload.SpilledVector` in the worker's `--spill-dir`), a
        slice at a time, instead of a model-sized vector in memory; it is read back a slice at a time where it is
        used (the next pseudo-gradient, the rebase). The same bits everywhere. Flat CPU parameters only."""
        live = self.io.flat_view
        if live is None or live.device.type != "cpu" or store.numel != self.numel:
            raise InvalidArgument(f"the base is kept in a file only for flat CPU parameters of {self.numel} values")
        self._base_store = store

    def _base_slice(self, lo: int, hi: int, scratch: Tensor | None = None) -> Tensor:
        """The base's values on [lo, hi): a view where it is in memory, else read from its file into `scratch` (at
        least hi − lo values) or a new tensor."""
        if not self._base_spilled:
            return self._base_or_theta()[lo:hi]
        assert self._base_store is not None
        out = scratch[: hi - lo] if scratch is not None else torch.empty(hi - lo, dtype=torch.float32)
        self._base_store.read(lo, out)
        return out

    def _check_flat(self, flat: Tensor, what: str) -> Tensor:
        if flat.ndim != 1 or flat.numel() != self.numel or not flat.is_floating_point():
            raise InvalidArgument(
                f"{what} must be a flat float vector of {self.numel} values, got {flat.dtype} {tuple(flat.shape)}"
            )
        return self._host.to_device(flat, self.io.device)

    def load_global(self, flat: Tensor, share: bool = False) -> None:
        """Adopt global parameters Θ: θ ← Θ and base ← Θ (local progress is dropped). `share`: the caller writes
        `flat` again only to adopt its next version, after `base_moving`, so the base may be `flat` itself rather
        than a copy (see `_set_base`)."""
        flat = self._check_flat(flat, "global parameters")
        self.io.write(flat)
        self._set_base(flat, share)

    def _set_base(self, flat: Tensor, share: bool) -> None:
        """base ← `flat` (fp32 on the parameters' device, from `_check_flat` or `io.read`). Shared: kept as it is
        (the caller's tensor, or a new one made from it), when contiguous. Else copied into the base's own
        vector."""
        self._base_spilled = False
        if share and flat.is_contiguous():
            self._base, self._base_shared = flat, True
        elif self._base is None or self._base_shared:
            self._base, self._base_shared = flat.clone(), False
        else:
            self._base.copy_(flat)

    def _hold_base(self) -> None:
        """Before θ moves: copy θ_at_submit when the base is still θ itself (`mark_submitted` deferred it), into
        memory or into its file (`spill_base`)."""
        if self._base is not None or self._base_spilled:
            return
        if self._base_store is None:
            self._base, self._base_shared = self._theta().clone(), False
            return
        theta = self._theta()
        for start in range(0, self.numel, _SLICE):
            self._base_store.write(start, theta[start : start + _SLICE])
        self._base_spilled = True

    def _own_base(self) -> Tensor:
        """The base as a vector of the trainer's own, before part of it is written (fragments): θ_at_submit
        copied when it was deferred, the caller's shared tensor copied."""
        if self._base_spilled:
            self._base, self._base_shared, self._base_spilled = self.base, False, False
        elif self._base is None or self._base_shared:
            self._base, self._base_shared = self._base_or_theta().clone(), False
        return self._base

    def _base_or_theta(self) -> Tensor:
        assert not self._base_spilled, "a base in its file is read a slice at a time (`_base_slice`)"
        return self._base if self._base is not None else self._theta()

    def _theta(self) -> Tensor:
        live = self.io.flat_view
        return live if live is not None else self.io.read()

    def pseudo_gradient(self) -> Tensor:
        """Δ = base - θ (flat fp32, CPU): the steps not submitted yet."""
        if self._base_spilled:
            return self.base - self._theta()  # flat CPU parameters
        if self._base is None:
            return torch.zeros(self.numel, dtype=torch.float32)
        return (self._base - self._theta()).cpu()

    def submit_into(self, out: Tensor, scale: float = 1.0) -> None:
        """For a submission: out += Δ·`scale` (Δ = base - θ, computed where the parameters are; `out` a flat fp32
        vector on the host, e.g. the error-feedback residual) a slice at a time, with no model-sized temporary;
        then base ← θ (`mark_submitted`), reading θ once. Each element gets the same fp32 operations as
        `out.add_(pseudo_gradient() * scale)` (no multiply when `scale` is 1): the same bits."""
        if out.ndim != 1 or out.numel() != self.numel or out.dtype != torch.float32 or out.device.type != "cpu":
            raise InvalidArgument(f"the pseudo-gradient is added into a flat fp32 CPU vector of {self.numel} values")
        theta = self._theta()
        scratch = torch.empty(min(_SLICE, self.numel), dtype=torch.float32) if self._base_spilled else None
        for start in range(0, self.numel, _SLICE):
            end = min(start + _SLICE, self.numel)
            _add_difference(out[start:end], self._base_slice(start, end, scratch), theta[start:end], scale)
        self._mark(theta)

    def add_pseudo_gradient(self, start: int, out: Tensor, scale: float = 1.0) -> None:
        """`submit_into` for the values [start, start + len(out)) only (the same bits there), without the
        `mark_submitted` that ends a submission: for a residual held a slab at a time
        (`diloco.core.codecs.ErrorFeedback.compress_slabs`). Flat parameters only (θ is read in place)."""
        theta = self.io.flat_view
        if theta is None:
            raise InvalidArgument("the pseudo-gradient is added a slab at a time only with flat parameters")
        end = start + out.numel()
        if not (0 <= start < end <= self.numel) or out.dtype != torch.float32 or out.device.type != "cpu":
            raise InvalidArgument(f"a slab of the pseudo-gradient lies within its {self.numel} fp32 CPU values")
        _add_difference(out, self._base_slice(start, end), theta[start:end], scale)

    def _mark(self, theta: Tensor) -> None:
        """base ← θ (`theta`, as just read): with flat parameters deferred to the next step (`_hold_base`), so a
        version adopted before it costs no copy; else into the base's own vector."""
        if self.io.flat_view is not None:
            self._base, self._base_shared, self._base_spilled = None, False, False
        else:
            self._set_base(theta, share=True)  # a new vector from `io.read`

    def catch_up(self, step: int) -> None:
        """Start the learning-rate schedule no earlier than `step`: a learner that joins (or comes back) late
        resumes the schedule where it would be had it trained from the start, not at warmup and peak rate."""
        self.steps_done = max(self.steps_done, step)

    def mark_submitted(self) -> None:
        """base ← θ_at_submit, the parameters whose pseudo-gradient was just sent."""
        self._mark(self._theta())

    def rebase(self, new_global: Tensor, share: bool = False) -> None:
        """Adopt Θ_new, keeping the steps not yet submitted (`share`: as in `load_global`).

        θ ← Θ_new + (θ - base): after a submission base is θ_at_submit; without one since the last adoption (a
        second newer version arrived first) it is Θ_base, which moves the unsent progress onto the newer base.
        Either way base ← Θ_new, so those steps count, once, in the next pseudo-gradient.
        """
        new = self._check_flat(new_global, "global parameters")
        live = self.io.flat_view
        if live is not None and self._base_spilled:  # θ_at_submit read back from its file a slice at a time
            scratch = torch.empty(min(_SLICE, self.numel), dtype=torch.float32)
            for lo in range(0, self.numel, _SLICE):
                hi = min(lo + _SLICE, self.numel)
                live[lo:hi].sub_(self._base_slice(lo, hi, scratch)).add_(new[lo:hi])
        elif live is not None:
            live.sub_(self._base_or_theta()).add_(new)  # in place: no model-sized temporary
        else:
            self.io.write(new + (self.io.read() - self._base_or_theta()))
        self._set_base(new, share)

    def base_moving(self, flat: Tensor) -> Callable[[int, int, Tensor, Tensor], None] | None:
        """`flat`, adopted with `share=True`, is about to change in place to a newer version, window by window on
        this thread (`diloco.core.broadcast.HeldParams.at`), for a rebase onto it. When the base is `flat` itself:
        with flat parameters, returns `rebase_window`, which rebases θ on each window as it changes (afterwards θ is
        rebased and the base is `flat`, the newer version: no `rebase` to call); else the base is copied first and
        None returned. None as well when the base is not `flat`: then `rebase` onto it afterwards."""
        if self._base is not flat:
            return None
        if self.io.flat_view is not None:
            return self.rebase_window
        self._base, self._base_shared = flat.clone(), False
        return None

    def rebase_window(self, lo: int, hi: int, old: Tensor, new: Tensor) -> None:
        """The base, `flat` of `base_moving`, went from `old` to `new` on `[lo, hi)`: θ ← new + (θ − old) there, the
        same fp32 operations as `rebase`."""
        live = self.io.flat_view
        assert live is not None
        live[lo:hi].sub_(old).add_(new)

    def submit_range(self, lo: int, hi: int) -> Tensor:
        """One fragment's submission (Streaming DiLoCo, `diloco.core.fragments`): Δ = base − θ on `[lo, hi)` (a
        new flat fp32 CPU tensor) and base ← θ there only; the rest of base is left as it is."""
        live = self.io.flat_view
        theta = live[lo:hi] if live is not None else self.io.read_range(lo, hi)  # that fragment's tensors only
        base = self._own_base()
        delta = (base[lo:hi] - theta).cpu()
        base[lo:hi].copy_(theta)
        return delta

    def rebase_ranges(self, new_global: Tensor, ranges: Sequence[tuple[int, int]]) -> None:
        """`rebase` on the given ranges of the flat vector only (the fragments whose global version changed):
        θ ← Θ_new + (θ − base) and base ← Θ_new there; elsewhere θ and base are left as they are."""
        new = self._check_flat(new_global, "global parameters")
        base = self._own_base()
        live = self.io.flat_view
        for lo, hi in ranges:  # without a flat view, each range's tensors read and written back on their own
            theta = live[lo:hi] if live is not None else self.io.read_range(lo, hi)
            theta.sub_(base[lo:hi]).add_(new[lo:hi])
            base[lo:hi].copy_(new[lo:hi])
            if live is None:
                self.io.write_range(lo, hi, theta)

    # -- training -----------------------------------------------------------------------------------------

    def step(self, x: Tensor, y: Tensor) -> float:
        """One AdamW step on a batch (any device); returns the loss before the update."""
        t0 = self._clock()
        lr = lr_at(self.cfg, self.steps_done)
        for opt in self._optimizers():
            for group in opt.param_groups:
                group["lr"] = lr
        self._hold_base()
        self._drop_grads()  # a step that raised may have left some
        loss = self._loss(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
        if self.optimizer is None:
            self._stepping = True  # each parameter steps in its hook, as its gradient completes
            try:
                loss.backward()  # type: ignore[no-untyped-call]
            finally:
                self._stepping = False
        else:
            loss.backward()  # type: ignore[no-untyped-call]
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
        self._drop_grads()  # no model-sized gradients between steps
        self.steps_done += 1
        value = float(loss.detach())  # synchronizes with the device, so the timing below is real
        elapsed = self._clock() - t0
        if self.slowdown > 1.0:
            # scale the step's compute, not a stall inside it (a SIGSTOP, a swap-in): cap at twice the usual step
            compute = min(elapsed, 2 * self._step_time_s / self.slowdown) if self._step_time_s > 0 else elapsed
            pause = (self.slowdown - 1.0) * compute
            self._sleep(pause)
            elapsed += pause
        prev, ema = self._step_time_s, self._EMA
        self._step_time_s = elapsed if prev == 0.0 else (1 - ema) * prev + ema * elapsed
        return value

    def _optimizers(self) -> list[torch.optim.AdamW]:
        return [self.optimizer] if self.optimizer is not None else list(self._param_opt.values())

    def optimizer_state(self, p: Tensor) -> dict[str, Tensor]:
        """AdamW's state for parameter `p` (`step`, `exp_avg`, `exp_avg_sq`; empty before its first step)."""
        opt = self.optimizer if self.optimizer is not None else self._param_opt[p]
        return opt.state[p]

    def _drop_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def _step_one(self, p: Tensor) -> None:
        """`p`'s gradient is complete (a post-accumulate-grad hook): its AdamW step, then the gradient is dropped,
        so a backward holds at most the gradients not yet complete rather than the whole model's. The same fused
        kernel on the same values as one step over the whole model: the same bits, as there is no clipping."""
        if not self._stepping:  # a backward outside `step`: leave the gradient to its caller
            return
        self._param_opt[p].step()
        p.grad = None

    def train(self, shards: Sequence[tuple[int, int, int]], steps: int) -> RoundResult:
        """Run `steps` AdamW steps, drawing batches round-robin from `shards` = [(shard_id, epoch, cursor)].

        Returns the pseudo-gradient against the current base and, per shard read, the range it consumed.
        """
        check_int("train", "steps", steps, minimum=0)
        work = [ShardWork(*s) for s in shards]
        ids = [w.shard_id for w in work]
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"shards must be distinct, got {ids}")
        if steps and not work:
            raise InvalidArgument("train() needs at least one shard to read")
        for w in work:
            if w.cursor < 0:
                raise InvalidArgument(f"shard {w.shard_id}: cursor must be >= 0, got {w.cursor}")
        cursors = [w.cursor for w in work]
        start = self._clock()
        self.model.train()
        losses: list[float] = []
        bs, seq = self.cfg.batch_size, self.seq_len
        for i in range(steps):
            k = i % len(work)
            x, y, cursors[k] = self.corpus.batch(work[k].shard_id, cursors[k], bs, seq)
            losses.append(self.step(x, y))
        ranges = [
            ShardRangeT(w.shard_id, w.epoch, w.cursor, end)
            for w, end in zip(work, cursors, strict=True)
            if end > w.cursor
        ]
        return RoundResult(
            pseudo_grad=self.pseudo_gradient(),
            tokens=sum(r.end - r.start for r in ranges),
            steps=steps,
            ranges=ranges,
            loss=sum(losses) / len(losses) if losses else math.nan,
            seconds=self._clock() - start,
        )

    def throughput(self) -> Throughput:
        """Tokens/s and step time measured so far (zeros before the first step)."""
        st = self._step_time_s
        tokens = self.cfg.batch_size * self.seq_len
        return Throughput(tokens / st if st > 0 else 0.0, st, self.device.type)
