"""The model side of a learner: the inner trainer, error feedback and the newest global parameters. It carries
out the learner core's torch actions (`Load`, `Rebase`, `Train`, `Submit`) and nothing else: what to do, and
when, is the core's."""

from __future__ import annotations

import structlog
import torch

from diloco.core import learner as core
from diloco.core.codecs import ErrorFeedback, get_codec
from diloco.task.factory import TaskConfig, build_task
from diloco.task.inner import InnerTrainer, Throughput
from diloco.task.params import param_specs
from services.worker.config import WorkerConfig
from services.worker.metrics import Metrics
from services.worker.session import header_of
from services.worker.uploader import UploadJob


class Replica:
    def __init__(self, cfg: WorkerConfig, device: torch.device, metrics: Metrics) -> None:
        self.cfg, self.device, self.metrics = cfg, device, metrics
        self.trainer: InnerTrainer | None = None
        self.ef: ErrorFeedback | None = None
        self.task_json = ""
        self.params: tuple[int, torch.Tensor] | None = None  # the newest version the core adopted, and its tensor

    def start_session(self, task_json: str, codec: str) -> None:
        """A new registration: (re)build the task when it changed, fresh error feedback, no parameters yet."""
        if task_json != self.task_json:
            cfg = TaskConfig.from_json(task_json)
            task = build_task(cfg)
            self.trainer = InnerTrainer(
                task.model_fn(self.cfg.seed),
                task.corpus,
                cfg.inner,
                seq_len=cfg.model.seq_len,
                device=self.device,
                slowdown=self.cfg.slowdown,
            )
            self.specs = param_specs(self.trainer.model)
            self.task_json = task_json
        assert self.trainer is not None
        self.ef = ErrorFeedback(get_codec(codec), self.trainer.numel)
        self.params = None

    @property
    def numel(self) -> int:
        assert self.trainer is not None
        return self.trainer.numel

    def throughput(self) -> Throughput | None:
        return self.trainer.throughput() if self.trainer else None

    def adopt(self, a: core.Load | core.Rebase, log: structlog.stdlib.BoundLogger, why: str) -> None:
        assert self.trainer is not None and self.params is not None and self.ef is not None
        version, flat = self.params
        assert version == a.version, (version, a)
        if isinstance(a, core.Rebase):
            self.trainer.rebase(flat)  # keeps the steps not yet submitted
            self.metrics.rebases.inc()
        else:
            self.trainer.load_global(flat)
            self.trainer.catch_up(a.catch_up_steps)  # joined late: resume the schedule, no re-warmup
            if a.reset_codec:
                log.info("worker.resync", reason=why, version=version)
                self.metrics.resyncs.inc()
                self.ef.reset()
        self.metrics.version.set(version)

    def train(self, a: core.Train) -> int:
        """One inner step on the batch at `a.cursor`; returns the cursor after it."""
        t = self.trainer
        assert t is not None
        x, y, nxt = t.corpus.batch(a.shard_id, a.cursor, t.cfg.batch_size, t.seq_len)
        t.step(x, y)
        self.metrics.steps.inc()
        self.metrics.tokens.inc(nxt - a.cursor)
        return nxt

    def upload_job(self, a: core.Submit, bulk_port: int) -> UploadJob:
        """Compress the pseudo-gradient of everything trained since the last submission."""
        assert self.trainer is not None and self.ef is not None
        delta = self.trainer.pseudo_gradient()
        if self.cfg.fault_scale_updates != 1.0:  # fault injection (tests, chaos runs): a learner gone wrong
            delta = delta * self.cfg.fault_scale_updates
        payload, meta = self.ef.compress(delta)
        self.trainer.mark_submitted()
        self.metrics.tokens_per_s.set(self.trainer.throughput().tokens_per_s)
        return UploadJob(header_of(a.draft, meta, self.specs), payload, bulk_port)
