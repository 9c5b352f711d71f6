"""The model side of a learner: the inner trainer, error feedback and the newest global parameters. It carries
out the learner core's torch actions (`Load`, `Rebase`, `Train`, `Submit`) and nothing else: what to do, and
when, is the core's."""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from diloco import log as logging
from diloco.core import learner as core
from diloco.core.broadcast import HeldParams, Refusal
from diloco.core.codecs import ErrorFeedback, get_codec
from diloco.core.fragments import FragmentLayout
from diloco.errors import ConfigError, ResourceExhausted
from diloco.rpc.payload import Spill, SpilledVector, mapped_vector, release_pages
from diloco.task.data import model_loss
from diloco.task.factory import TaskConfig, build_task, fingerprint_mismatch
from diloco.task.inner import InnerTrainer, Throughput
from diloco.task.model import enable_activation_checkpointing
from diloco.task.params import flatten_params, param_specs
from services.worker.config import WorkerConfig
from services.worker.island import Island, ShardedParams, shard_model
from services.worker.metrics import Metrics
from services.worker.session import header_of
from services.worker.uploader import UploadJob


class _Loss(nn.Module):
    """`model.loss` as a module's forward, for DistributedDataParallel (which syncs gradients through forward) and
    bf16 autocast."""

    def __init__(self, model: nn.Module, bf16: bool) -> None:
        super().__init__()
        self.model, self.bf16 = model, bf16
        self._loss = model_loss(model)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        if self.bf16:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self._loss(x, y).float()
        return self._loss(x, y)


class ParamsLost(Exception):
    """The learner's `Θ̂` failed to reach the version adopted (`Replica.adopt`): it must register again."""


class Replica:
    def __init__(self, cfg: WorkerConfig, device: torch.device, metrics: Metrics, island: Island | None = None) -> None:
        self.cfg, self.device, self.metrics, self.island = cfg, device, metrics, island
        self.spill = Spill.checked(cfg.spill_dir, cfg.spill_above)  # where model-sized vectors above its size go
        self.trainer: InnerTrainer | None = None
        self.task_json = ""
        self.fingerprint = ""  # of the task built from `task_json`, with this learner's own files
        self.params: tuple[int, HeldParams] | None = None  # the newest version the core took, and the Θ̂ leading to it
        # the registration's fragment layout (docs/fragments.md; None: the whole model at once) and the error-feedback
        # residuals that go with it: one per fragment, or one for the whole model; never both (`use_layout`)
        self.layout: FragmentLayout | None = None
        self.efs: list[ErrorFeedback] = []
        self.version0: torch.Tensor | None = None  # the initial parameters built here, until parameters are adopted

    def start_session(self, task_json: str, fingerprint: str = "", init_seed: int = 0) -> None:
        """A new registration: (re)build the task when it changed, no parameters yet (the learner that uploads then
        takes fresh residuals: `use_layout`; an island's followers hold none). Raises
        `ConfigError` naming the parts when the task built here differs from the coordinator's `fingerprint`
        ("": not checked), e.g. this learner's data files hold other data. A task built here also leaves its
        initial parameters in `version0` (the model from `--seed`, by default the coordinator's `init_seed`: its
        version 0 when this torch builds it the same), for the watchers to name until the first `adopt`."""
        if task_json != self.task_json:
            cfg = TaskConfig.from_json(task_json)
            if self.island is not None:
                self.island.check_batch(cfg.inner.batch_size)
            task = build_task(cfg)
            model = task.model_fn(self.cfg.seed if self.cfg.seed >= 0 else init_seed)
            if self.cfg.activation_checkpointing:
                enable_activation_checkpointing(model)
            if self.island is None or self.island.leader:
                self.version0 = self._own_version0(flatten_params(model).to("cpu"))  # before the model moves or shards
            loss_fn = self._loss_fn(model)  # a sharded island's model is sharded here
            sharded = ShardedParams(self.island, model) if self.island is not None and self.island.sharded else None
            self.trainer = InnerTrainer(
                model,
                task.corpus,
                cfg.inner,
                seq_len=cfg.model.seq_len,
                device=self.device,
                slowdown=self.cfg.slowdown,
                loss_fn=loss_fn,
                params=sharded,
                step_in_backward=self.island is None,  # an island's gradients are synchronized after backward
            )
            if sharded is not None:
                sharded.live = True  # every rank built its trainer: from now on the leader announces collectives
            if self._spills(self.trainer):
                self._spill_base(self.trainer)
            self.specs = param_specs(self.trainer.model)
            self.task_json, self.fingerprint = task_json, task.fingerprint
        assert self.trainer is not None
        mismatch = fingerprint_mismatch(self.fingerprint, fingerprint) if fingerprint else ""
        if mismatch:
            raise ConfigError(mismatch)
        self.efs, self.params = [], None

    def close(self) -> None:
        """Let go of the model and its optimizer (on an island, before the process group goes: `Island.close`)."""
        self.trainer = None

    def _spills(self, trainer: InnerTrainer) -> str | None:
        """The directory this trainer's model-sized fp32 vectors go to (`--spill-dir`, when they are bigger than
        `--spill-above`), or None: memory."""
        return self.spill.directory_for(4 * trainer.numel)

    def theta_hat_vector(self) -> Tensor | None:
        """Where a snapshot's `Θ̂` is decoded: a vector mapped from a file in the spill directory (`mapped_vector`:
        its pages leave resident memory between the uses of each round, `release_pages`) when the model's fp32 bytes
        are above --spill-above; None: a vector in memory (also when the file cannot be made: logged)."""
        return self._mapped(self.numel) if self.trainer is not None else None

    def _mapped(self, numel: int) -> Tensor | None:
        directory = self.spill.directory_for(4 * numel)
        if directory is None:
            return None
        try:
            return mapped_vector(directory, numel)
        except ResourceExhausted as e:
            logging.get("worker").warning("worker.spill_unused", reason=str(e))
            return None

    def _own_version0(self, flat: Tensor) -> Tensor:
        """The version 0 built here, as the learner's first `Θ̂` may be: in a mapped file by the spill rule."""
        mapped = self._mapped(flat.numel())
        if mapped is None:
            return flat
        mapped.copy_(flat)
        release_pages(mapped)
        return mapped

    def _spill_base(self, trainer: InnerTrainer) -> None:
        """θ_at_submit (what a learner that trains on after a submission rebases from) in a file in `_spills`'
        directory, read and written a slice at a time: flat parameters on the CPU. Elsewhere it stays in memory
        (logged)."""
        directory, live = self._spills(trainer), trainer.io.flat_view
        assert directory is not None
        if live is None or live.device.type != "cpu":
            logging.get("worker").info("worker.spill_unused", reason="the parameters are not flat on the CPU")
            return
        trainer.spill_base(SpilledVector(directory, trainer.numel))

    def _residual_store(self, codec: str) -> SpilledVector | None:
        """The residual's file in `_spills`' directory, where it can be worked a slab at a time: a blockwise lossy
        codec (int8, int4) and flat parameters (a one-process learner). Elsewhere the residual stays in memory
        (logged)."""
        trainer = self.trainer
        assert trainer is not None
        directory = self._spills(trainer)
        if directory is None:
            return None
        kind = get_codec(codec)
        if not (kind.blockwise and kind.lossy) or trainer.io.flat_view is None:
            why = "the upload codec is not int8 or int4" if not kind.blockwise else "the parameters are not flat"
            logging.get("worker").info("worker.spill_unused", reason=why, codec=codec)
            return None
        return SpilledVector(directory, trainer.numel)

    def use_layout(self, layout: FragmentLayout | None, codec: str) -> None:
        """The registration's fragment layout (None: no fragments) and fresh error-feedback residuals for it: one per
        fragment, or one for the whole model (in its file with --spill-dir)."""
        kind, decay = get_codec(codec), self.cfg.ef_decay or None
        self.layout = layout
        if layout is None:
            self.efs = [ErrorFeedback(kind, self.numel, decay=decay, store=self._residual_store(codec))]
        else:
            self.efs = [ErrorFeedback(kind, layout.size(p), decay=decay) for p in range(layout.fragments)]

    def _loss_fn(self, model: nn.Module) -> Callable[[Tensor, Tensor], Tensor] | None:
        """Puts `model` on the device. None (the model's own loss) for a one-process fp32 learner; else the loss
        through bf16 autocast and, in an island, DistributedDataParallel (whose constructor broadcasts rank 0's
        parameters to every rank) or, in a sharded island, FSDP2 (`shard_model`: only each rank's shards go to its
        device; every rank built the model from the same seed, and the coordinator's parameters, which rank 0
        writes into every rank's shards at the first `Load`, replace them anyway)."""
        bf16 = self.cfg.precision == "bf16" and self.device.type == "cuda"
        if self.island is not None and self.island.sharded:
            shard_model(model, self.device, self.island.world)
            return _Loss(model, bf16)
        model.to(self.device)
        if self.island is None and not bf16:
            return None
        module: nn.Module = _Loss(model, bf16)
        if self.island is not None:
            ids = [self.device.index] if self.device.type == "cuda" else None
            module = DistributedDataParallel(module, device_ids=ids)
        return module

    @property
    def numel(self) -> int:
        assert self.trainer is not None
        return self.trainer.numel

    def throughput(self) -> Throughput | None:
        return self.trainer.throughput() if self.trainer else None

    def adopt(self, a: core.Load | core.Rebase, log: structlog.stdlib.BoundLogger, why: str) -> None:
        """Adopt the version of `a`: the learner's `Θ̂` brought to it in place (the deltas queued since, applied
        here), then θ loaded or rebased onto it. Raises `ParamsLost` when a delta fails there (`Θ̂` is then partly
        written: the learner registers again and starts from a snapshot)."""
        assert self.trainer is not None and self.params is not None
        version, held = self.params
        assert version == a.version, (version, a)
        self.version0 = None  # trained from the coordinator's parameters from now on: no registration names it
        # Θ̂ is the trainer's base (shared, not copied) and changes in place: a rebase whose base it is rebases θ on
        # each window as it changes (`base_moving`)
        in_place = self.trainer.base_moving(held.params) if isinstance(a, core.Rebase) else None
        flat = held.at(version, in_place)
        if isinstance(flat, Refusal):
            raise ParamsLost(f"the broadcast of version {version} was refused where it was applied ({flat.value})")
        if isinstance(a, core.Rebase) and in_place is not None:
            self.metrics.rebases.inc()  # θ rebased window by window; the base is Θ̂ of this version
        elif isinstance(a, core.Rebase) and a.fragments is not None:
            assert self.layout is not None
            # streaming fragments: only those whose version changed; the others keep their local progress
            self.trainer.rebase_ranges(flat, [self.layout.range(p) for p in a.fragments])
            self.metrics.rebases.inc()
        elif isinstance(a, core.Rebase):
            self.trainer.rebase(flat, share=True)  # keeps the steps not yet submitted
            self.metrics.rebases.inc()
        else:
            self.trainer.load_global(flat, share=True)
            self.trainer.catch_up(a.catch_up_steps)  # joined late: resume the schedule, no re-warmup
            if a.reset_codec:
                log.info("worker.resync", reason=why, version=version)
                self.metrics.resyncs.inc()
                for ef in self.efs:
                    ef.reset()
        release_pages(held.params)  # Θ̂ (in a mapped file by the spill rule) is next read at the submission
        self.metrics.version.set(version)

    def train(self, a: core.Train) -> int:
        """One inner step on the batch at `a.cursor`; returns the cursor after it."""
        return self.step_at(a.shard_id, a.cursor)

    def step_at(self, shard_id: int, cursor: int) -> int:
        """One inner step on the batch at `cursor` of the shard (in an island: this rank's rows of it, every rank
        stepping together); returns the cursor after it."""
        t = self.trainer
        assert t is not None
        x, y, nxt = t.corpus.batch(shard_id, cursor, t.cfg.batch_size, t.seq_len)
        if self.island is not None:
            rows = self.island.rows(t.cfg.batch_size)
            x, y = x[rows], y[rows]
        t.step(x, y)
        self.metrics.steps.inc()
        self.metrics.tokens.inc(nxt - cursor)
        return nxt

    def upload_job(self, a: core.Submit, bulk_port: int) -> UploadJob:
        """Compress the pseudo-gradient of everything trained since the last submission."""
        assert self.trainer is not None and self.efs, "upload_job before use_layout"
        trainer = self.trainer
        # the pseudo-gradient goes straight into the residual, a slice at a time (in a sharded island: after the
        # leader's GATHER, on rank 0's host); `fault_scale_updates` is fault injection (tests, chaos runs)
        scale = self.cfg.fault_scale_updates
        self.metrics.tokens_per_s.set(self.trainer.throughput().tokens_per_s)
        if self.layout is not None:  # one fragment: its slice (base ← θ there only), its own residual
            p = a.draft.fragment
            delta = trainer.submit_range(*self.layout.range(p))
            if scale != 1.0:
                delta.mul_(scale)
            payload, meta = self.efs[p].compress(delta, owned=True)  # a fresh tensor: fp32 sends it as it is
            return UploadJob(header_of(a.draft, meta, self.specs, self.layout.fingerprint), payload, bulk_port)
        ef = self.efs[0]
        if ef.store is None:
            payload, meta = ef.compress_added(lambda residual: trainer.submit_into(residual, scale))
        else:  # the residual in its file (--spill-dir): a slab at a time, the same bits
            try:
                payload, meta = ef.compress_slabs(lambda start, slab: trainer.add_pseudo_gradient(start, slab, scale))
            finally:
                trainer.mark_submitted()  # as `submit_into` does before the encode, whatever it gives
        if self.params is not None:
            release_pages(self.params[1].params)  # Θ̂, the base just read, is next touched at the adopt
        return UploadJob(header_of(a.draft, meta, self.specs), payload, bulk_port)
