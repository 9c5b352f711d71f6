"""A small GPT-style decoder-only transformer: the default model every learner trains.

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention through
`scaled_dot_product_attention`, GELU MLP), a final LayerNorm and an output head tied to the token embedding.
The defaults (about 0.45 M parameters over bytes) train visibly on a laptop CPU in seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from diloco.errors import ConfigError, InvalidArgument
from diloco.task._validate import check_float, check_int

_ARCH = "gpt-v1"  # bump when the module layout changes, so old and new learners refuse each other


def pick_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the default GPT. `vocab_size=256` is byte level."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            check_int("model", name, getattr(self, name), minimum=1)
        check_float("model", "dropout", self.dropout, lo=0.0, hi=1.0, hi_open=True)
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")


def enable_activation_checkpointing(model: nn.Module) -> None:
    """`--activation-checkpointing` on a task's model: its own `enable_activation_checkpointing()` (the built-in GPT,
    `hf:` models; a model of a factory of one's own may define it too). `ConfigError` when it has none. A
    per-learner memory setting: the gradients, hence the task and its fingerprint, are the same either way."""
    enable = getattr(model, "enable_activation_checkpointing", None)
    if not callable(enable):
        raise ConfigError(
            f"--activation-checkpointing: the task's model ({type(model).__name__}) has no "
            "enable_activation_checkpointing(); run this learner without it, or give the model that method"
        )
    enable()


def model_fingerprint(cfg: ModelConfig) -> str:
    """Short stable hash of the architecture; learners whose fingerprint differs are refused."""
    blob = json.dumps({"arch": _ARCH, **dataclasses.asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        out: Tensor = x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        return out


class GPT(nn.Module):
    """Decoder-only transformer. `forward(idx) -> logits`, `loss(idx, targets) -> mean cross-entropy`.

    Initialization is deterministic given `seed` (or an explicit CPU `generator`), whatever the global RNG.
    """

    def __init__(self, cfg: ModelConfig, *, seed: int = 0, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.checkpointed = False  # `enable_activation_checkpointing`
        self.reset_parameters(generator if generator is not None else torch.Generator().manual_seed(seed))

    def enable_activation_checkpointing(self) -> None:
        """Keep only each block's input for backward and compute the rest again there: activations of one block
        instead of all of them, for a second forward of each block per step. The gradients are the same."""
        self.checkpointed = True

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2·n_layers), zero biases."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:  # LayerNorm gains are 1, every bias is 0
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            std = resid_std if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape (B, T, vocab_size) for token ids `idx` of shape (B, T), T <= seq_len."""
        t = idx.shape[-1]
        if t > self.cfg.seq_len:
            raise InvalidArgument(f"sequence length {t} exceeds model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        checkpointed = self.checkpointed and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        logits: Tensor = F.linear(self.ln_f(x), self.wte.weight)  # tied output head
        return logits

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
