"""Shared fixtures: a tiny task that trains in milliseconds, one torch thread per test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from diloco.task.data import DataConfig
from diloco.task.factory import TaskConfig
from diloco.task.inner import InnerConfig
from diloco.task.model import ModelConfig


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Two torch threads on a 2-core machine contend badly with anything else running."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_task(num_shards: int = 8) -> TaskConfig:
    return TaskConfig(
        model=ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2),
        data=DataConfig(num_shards=num_shards, max_bytes=400_000),
        inner=InnerConfig(batch_size=4, warmup_steps=5, total_steps=400, lr=3e-3),
    )
