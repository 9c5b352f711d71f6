"""`--activation-checkpointing` (a learner's memory setting): the built-in GPT and `hf:` models keep only each
layer's input for backward, so far fewer bytes are saved for it, and the gradients are the same bits; a model without
`enable_activation_checkpointing()` is refused naming the flag; the worker flag reaches the model it trains."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from diloco.errors import ConfigError
from diloco.task.data import DataConfig
from diloco.task.factory import TaskConfig, build_task
from diloco.task.inner import InnerConfig
from diloco.task.model import GPT, ModelConfig, enable_activation_checkpointing
from services.worker.config import WorkerConfig, parse
from services.worker.metrics import Metrics
from services.worker.replica import Replica

SEQ = 64
BATCH = 16


def saved_bytes_and_grads(model: nn.Module, loss: Callable[[Tensor, Tensor], Tensor]) -> tuple[int, list[Tensor]]:
    """The bytes autograd saves for backward in one training step of `model` on a fixed batch (counted by
    `saved_tensors_hooks` as they are saved: deterministic, unlike a memory reading), and the gradients."""
    model.train()
    torch.manual_seed(0)  # dropout's masks: the same in both runs (checkpointing replays them in backward)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    y = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    saved = [0]

    def pack(t: Tensor) -> Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = loss(x, y)
    value.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return saved[0], grads


def check_same_grads_far_fewer_bytes(build: Callable[[], nn.Module]) -> None:
    plain = build()
    bytes_plain, grads_plain = saved_bytes_and_grads(plain, plain.loss)  # type: ignore[arg-type]
    ckpt = build()
    enable_activation_checkpointing(ckpt)
    bytes_ckpt, grads_ckpt = saved_bytes_and_grads(ckpt, ckpt.loss)  # type: ignore[arg-type]
    assert len(grads_ckpt) == len(grads_plain) > 0
    for a, b in zip(grads_plain, grads_ckpt, strict=True):
        assert torch.equal(b, a)  # the forward computed again on CPU: the same operations, the same bits
    assert bytes_ckpt < bytes_plain / 2, (bytes_ckpt, bytes_plain)


def test_the_built_in_gpt_saves_far_less_for_backward_with_the_same_gradients() -> None:
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=4, seq_len=SEQ, dropout=0.1)
    check_same_grads_far_fewer_bytes(lambda: GPT(cfg, seed=0))


def test_an_hf_model_saves_far_less_for_backward_with_the_same_gradients(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(400)))
    task = TaskConfig(
        model=ModelConfig(seq_len=SEQ),
        data=DataConfig(source=str(corpus), num_shards=2),
        inner=InnerConfig(batch_size=BATCH),
        model_name="hf:llama-tiny",
    )
    model_fn = build_task(task).model_fn
    check_same_grads_far_fewer_bytes(lambda: model_fn(0))


def test_evaluation_keeps_nothing_either_way() -> None:
    model = GPT(ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ), seed=0)
    enable_activation_checkpointing(model)
    model.eval()
    with torch.no_grad():
        logits = model(torch.zeros(2, SEQ, dtype=torch.long))
    assert logits.shape == (2, SEQ, 256)


def test_a_model_without_the_method_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--activation-checkpointing: the task's model \(Linear\) has no"):
        enable_activation_checkpointing(nn.Linear(4, 4))


def test_the_worker_flag_reaches_the_model_it_trains(tmp_path: Path) -> None:
    cfg = parse(["--coordinator", "127.0.0.1:1", "--insecure", "--activation-checkpointing", "true"], {})
    assert cfg.activation_checkpointing
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc " * 5000)
    task = TaskConfig(
        model=ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32),
        data=DataConfig(source=str(corpus), num_shards=2),
    )
    for on in (True, False):
        replica = Replica(
            WorkerConfig(coordinator="127.0.0.1:1", activation_checkpointing=on), torch.device("cpu"), Metrics()
        )
        replica.start_session(task.to_json(), build_task(task).fingerprint)
        assert replica.trainer is not None and isinstance(replica.trainer.model, GPT)
        assert replica.trainer.model.checkpointed is on
