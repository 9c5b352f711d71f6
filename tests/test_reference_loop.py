"""The distributed loop against a plain DiLoCo loop written here with torch alone (ALGORITHM.md sections 1, 3, 4).

The simulator (mode `sync`, fp32 uploads and broadcasts, no failures, equal learners) drives the real coordinator
core, ledger, codecs and learner trainers. The reference below shares only the model, the data batches and the
learning-rate schedule with it: M replicas, each with its own `torch.optim.AdamW` (decay on matrices and
embeddings, not on biases and gains; grad-clip; the task's warmup + cosine schedule, counted over the replica's
lifetime and kept with its optimizer state across rounds), adopt Θ, run H steps on their shard, and the outer
`torch.optim.SGD(nesterov=True)` steps Θ with the token-weighted mean of the pseudo-gradients Θ − θ_m. If a
change to any part of the system alters the training, the two part ways.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from diloco.core.outer import OuterConfig
from diloco.sim.config import SimConfig
from diloco.sim.engine import Simulator
from diloco.task.data import evaluate
from diloco.task.factory import build_task
from diloco.task.inner import lr_at
from tests.support import tiny_task

LEARNERS, H, ROUNDS, SEED = 2, 4, 3, 5
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sim_config() -> SimConfig:
    return SimConfig(
        mode="sync",
        speeds=(1.0,) * LEARNERS,
        codec="fp32",
        broadcast_codec="fp32",  # learners adopt Θ exactly, as the reference's replicas do
        outer=OuterConfig("nesterov", OUTER_LR, OUTER_MOMENTUM),
        merge="mean",
        num_shards=LEARNERS,  # one shard per learner
        local_steps=H,
        min_local_steps=1,
        outer_steps=ROUNDS,
        latency_s=0.0,
        bandwidth_bytes_per_s=1e18,
        eval_tokens=2048,
        seed=SEED,
        task=tiny_task(LEARNERS),
    )


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model: nn.Module, vector: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def reference_run(cfg: SimConfig) -> tuple[torch.Tensor, list[float]]:
    """Plain single-process DiLoCo on the task the simulator trains; returns Θ and the validation losses."""
    task = build_task(cfg.task_config())
    inner, seq = cfg.task.inner, cfg.task.model.seq_len
    global_model = task.model_fn(cfg.seed)
    outer = torch.optim.SGD(global_model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    replicas = [task.model_fn(cfg.seed) for _ in range(LEARNERS)]
    optimizers = [
        torch.optim.AdamW(
            [
                {"params": [p for p in r.parameters() if p.ndim >= 2], "weight_decay": inner.weight_decay},
                {"params": [p for p in r.parameters() if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=inner.lr,
            betas=inner.betas,
            fused=True,  # as the learners' (InnerTrainer)
        )
        for r in replicas
    ]
    cursors = [0] * LEARNERS
    steps_done = [0] * LEARNERS
    losses = [evaluate(global_model, task.corpus, seq, cfg.eval_tokens, CPU).loss]
    for _ in range(ROUNDS):
        theta = flat(global_model)
        deltas, weights = [], []
        for m, (replica, opt) in enumerate(zip(replicas, optimizers, strict=True)):
            load(replica, theta)
            tokens = 0
            for _ in range(H):
                x, y, nxt = task.corpus.batch(m, cursors[m], inner.batch_size, seq)
                tokens += nxt - cursors[m]
                cursors[m] = nxt
                for group in opt.param_groups:
                    group["lr"] = lr_at(inner, steps_done[m])
                opt.zero_grad(set_to_none=True)
                replica.loss(x, y).backward()  # type: ignore[operator]
                torch.nn.utils.clip_grad_norm_(replica.parameters(), inner.grad_clip)
                opt.step()
                steps_done[m] += 1
            deltas.append(theta - flat(replica))
            weights.append(tokens)
        merged = sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
        assert isinstance(merged, torch.Tensor)
        offset = 0
        for p in global_model.parameters():
            p.grad = merged[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        outer.step()
        losses.append(evaluate(global_model, task.corpus, seq, cfg.eval_tokens, CPU).loss)
    return flat(global_model), losses


def test_sync_fp32_simulator_equals_a_plain_diloco_loop() -> None:
    cfg = sim_config()
    sim = Simulator(cfg)
    result = sim.run()
    theta, losses = reference_run(cfg)
    assert result.rounds == ROUNDS and result.tokens == ROUNDS * LEARNERS * H * 4 * 32
    assert [p["version"] for p in result.history] == list(range(ROUNDS + 1))
    assert torch.allclose(sim.core.params, theta, rtol=1e-5, atol=1e-6), (sim.core.params - theta).abs().max()
    assert [p["val_loss"] for p in result.history] == pytest.approx(losses, abs=1e-5)
    assert losses[-1] < losses[0] - 0.5 and all(math.isfinite(v) for v in losses)  # the runs did train
