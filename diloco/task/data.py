"""Training data: a byte-level tokenizer and a `Corpus` cut into shards plus a held-out validation split.

Sources (`DataConfig.source`):
- `"stdlib"` (default, embedded): the `.py` files of the running interpreter's standard library, without test
  suites and site-packages, sorted by path, then shuffled by `seed` (so every shard mixes modules), up to
  `max_bytes` bytes.
- a path to a text file or a folder of text files (read recursively, hidden and binary files skipped): bytes.
- a path ending in `.bin`: little-endian uint16 token ids, memory-mapped.

Layout: the token stream is split into a training part and a validation tail of `val_fraction` of the
tokens; the training part is cut into `num_shards` contiguous shards of (almost) equal length. A cursor is an
absolute token offset into one shard that only grows; reading wraps around the shard, so
`cursor // shard_length` counts passes over it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from diloco.errors import ConfigError, InvalidArgument, NotFound
from diloco.task._validate import check_float, check_int

Tokens = npt.NDArray[np.uint16]

STDLIB = "stdlib"
_SOURCES = '"stdlib", a text file, a folder of text files, or a .bin file of little-endian uint16 tokens'
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"})
_DOC_SEPARATOR = b"\n\n"


def encode(text: str) -> list[int]:
    """Byte-level tokens (0..255) of the UTF-8 encoding of `text`."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int] | npt.NDArray[np.integer] | Tensor) -> str:
    """Inverse of `encode`; invalid UTF-8 (e.g. a sequence cut mid-character) decodes as U+FFFD."""
    ids = tokens.tolist() if isinstance(tokens, (np.ndarray, Tensor)) else tokens
    return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are split.

    `max_bytes` caps every source (for a `.bin` file: `max_bytes // 2` tokens); 0 means no cap. `seed` orders
    the files of text sources.
    """

    source: str = STDLIB
    num_shards: int = 16
    val_fraction: float = 0.02
    max_bytes: int = 8_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"data.source must be {_SOURCES}, got {self.source!r}")
        check_int("data", "num_shards", self.num_shards, minimum=1)
        check_float("data", "val_fraction", self.val_fraction, lo=0.0, hi=0.5, lo_open=True)
        check_int("data", "max_bytes", self.max_bytes, minimum=0)
        check_int("data", "seed", self.seed, minimum=0)


def stdlib_files() -> list[Path]:
    """The standard library's `.py` files, sorted, excluding test suites and site-packages."""
    return list(_stdlib_files(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=4)
def _stdlib_files(root: str) -> tuple[Path, ...]:
    return tuple(f for f in _walk(Path(root)) if f.suffix == ".py" and not any(p in _SKIP_DIRS for p in f.parts))


def _walk(root: Path) -> list[Path]:
    """Regular files below `root`, sorted by path, skipping hidden entries and `_SKIP_DIRS`."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    return sorted(found)


def _read_documents(files: list[Path], seed: int, max_bytes: int, *, skip_binary: bool) -> Tokens:
    """Concatenate files (shuffled by `seed`) as bytes, separated by a blank line, up to `max_bytes`."""
    order = list(files)
    random.Random(seed).shuffle(order)
    parts: list[bytes] = []
    total = 0
    for path in order:
        if max_bytes and total >= max_bytes:
            break
        blob = path.read_bytes()
        if not blob or (skip_binary and b"\x00" in blob[:8192]):
            continue
        blob += _DOC_SEPARATOR
        parts.append(blob)
        total += len(blob)
    data = b"".join(parts)
    if max_bytes:
        data = data[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def load_tokens(cfg: DataConfig) -> Tokens:
    """The whole token stream named by `cfg.source` (see the module docstring)."""
    if cfg.source == STDLIB:
        return _read_documents(stdlib_files(), cfg.seed, cfg.max_bytes, skip_binary=False)
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise ConfigError(f"data.source {cfg.source!r} does not exist; expected {_SOURCES}")
    if path.is_file() and path.suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise ConfigError(f"data.source {cfg.source!r} has an odd size ({size} bytes); expected uint16")
        if size == 0:
            return np.zeros(0, dtype=np.uint16)
        tokens: Tokens = np.memmap(path, dtype="<u2", mode="r")
        return tokens[: cfg.max_bytes // 2] if cfg.max_bytes else tokens
    if path.is_file():
        return _read_documents([path], cfg.seed, cfg.max_bytes, skip_binary=False)
    return _read_documents(_walk(path), cfg.seed, cfg.max_bytes, skip_binary=True)


class Corpus:
    """A token stream split into `num_shards` training shards and a validation tail."""

    def __init__(self, tokens: Tokens, cfg: DataConfig, *, description: str = "") -> None:
        if tokens.ndim != 1:
            raise ConfigError(f"data.source must give a 1-D token stream, got shape {tokens.shape}")
        n = int(tokens.shape[0])
        self.cfg = cfg
        self.description = description or cfg.source
        self.tokens = tokens
        if n == 0:
            raise ConfigError(f"data.source {self.description!r} is empty: no tokens to train on")
        n_val = math.ceil(n * cfg.val_fraction)
        n_train = n - n_val
        if n_val == 0 or n_train < cfg.num_shards:
            raise ConfigError(
                f"data.source {self.description!r} holds {n} tokens: too few for data.num_shards="
                f"{cfg.num_shards} and a validation split (data.val_fraction={cfg.val_fraction}); "
                "use a larger corpus or fewer shards"
            )
        self._bounds = [
            (i * n_train // cfg.num_shards, (i + 1) * n_train // cfg.num_shards) for i in range(cfg.num_shards)
        ]
        self.train_tokens = n_train
        self.val = tokens[n_train:]
        self.max_token = int(tokens.max())

    @classmethod
    def load(cls, cfg: DataConfig) -> Corpus:
        """Read the source named by `cfg`."""
        return cls(load_tokens(cfg), cfg)

    @property
    def num_shards(self) -> int:
        return self.cfg.num_shards

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @functools.cached_property
    def fingerprint(self) -> str:
        """Short hash of the tokens and the split, to check that learners read the same data."""
        h = hashlib.sha256(f"{self.num_shards}:{self.train_tokens}:{self.num_tokens}".encode())
        h.update(np.ascontiguousarray(self.tokens).tobytes())
        return h.hexdigest()[:16]

    def shard_bounds(self, shard_id: int) -> tuple[int, int]:
        """`[start, end)` of the shard in the token stream."""
        if not 0 <= shard_id < self.num_shards:
            raise NotFound(f"shard {shard_id} does not exist; shards are 0..{self.num_shards - 1}")
        return self._bounds[shard_id]

    def shard_tokens(self, shard_id: int) -> Tokens:
        start, end = self.shard_bounds(shard_id)
        return self.tokens[start:end]

    def shard_length(self, shard_id: int) -> int:
        """Tokens in the shard."""
        start, end = self.shard_bounds(shard_id)
        return end - start

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id must be < the model's vocab size."""
        if self.max_token >= vocab_size:
            raise ConfigError(
                f"data.source {self.description!r} holds token id {self.max_token}, but model.vocab_size="
                f"{vocab_size}: raise model.vocab_size to at least {self.max_token + 1} or fix the data"
            )

    def check_batch(self, batch_size: int, seq_len: int) -> None:
        """Every shard must hold one batch without wrapping, and the validation split one sequence."""
        need = batch_size * seq_len + 1
        smallest = min(end - start for start, end in self._bounds)
        if smallest < need:
            raise ConfigError(
                f"data shards hold {smallest} tokens, fewer than one batch (inner.batch_size={batch_size} x "
                f"model.seq_len={seq_len} + 1 = {need}); lower data.num_shards or the batch, or add data"
            )
        if self.val.shape[0] < seq_len + 1:
            raise ConfigError(
                f"validation split holds {self.val.shape[0]} tokens, fewer than model.seq_len + 1 = "
                f"{seq_len + 1}; raise data.val_fraction or add data"
            )

    def batch(self, shard_id: int, cursor: int, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor, int]:
        """`batch_size` sequences of `seq_len + 1` tokens from the shard at absolute `cursor` (wrapping).

        Sequence j starts at `cursor + j·seq_len`; returns int64 `(x, y)` of shape (batch_size, seq_len), y
        the targets shifted by one, and the next cursor `cursor + batch_size·seq_len`.
        """
        if cursor < 0:
            raise InvalidArgument(f"cursor must be >= 0, got {cursor}")
        shard = self.shard_tokens(shard_id)
        length = shard.shape[0]
        starts = (cursor % length + np.arange(batch_size, dtype=np.int64) * seq_len)[:, None]
        idx = (starts + np.arange(seq_len + 1, dtype=np.int64)[None, :]) % length
        seqs = torch.from_numpy(shard[idx].astype(np.int64))
        return seqs[:, :-1], seqs[:, 1:], cursor + batch_size * seq_len

    def val_batches(self, batch_size: int, seq_len: int, max_batches: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Deterministic non-overlapping validation sequences from the start of the split, in batches
        (the last one may be smaller); at most `max_batches` batches."""
        n_seq = (self.val.shape[0] - 1) // seq_len
        for b in range(min(max_batches, math.ceil(n_seq / batch_size))):
            rows = np.arange(b * batch_size, min((b + 1) * batch_size, n_seq), dtype=np.int64)
            idx = rows[:, None] * seq_len + np.arange(seq_len + 1, dtype=np.int64)[None, :]
            seqs = torch.from_numpy(self.val[idx].astype(np.int64))
            yield seqs[:, :-1], seqs[:, 1:]


@torch.no_grad()
def evaluate(
    model: nn.Module, corpus: Corpus, batch_size: int, seq_len: int, max_batches: int, device: torch.device
) -> float:
    """Mean validation loss (per sequence) over the first `max_batches` validation batches."""
    loss_fn = model_loss(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in corpus.val_batches(batch_size, seq_len, max_batches):
            total += float(loss_fn(x.to(device), y.to(device))) * x.shape[0]
            count += x.shape[0]
    finally:
        model.train(was_training)
    if count == 0:
        raise ConfigError(f"validation split is too small for model.seq_len={seq_len} (or max_batches=0)")
    return total / count


class _LossFn:
    """Typed wrapper around a model's `.loss(x, y)`."""

    def __init__(self, fn: object) -> None:
        self._fn = fn

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        out = self._fn(x, y)  # type: ignore[operator]
        if not isinstance(out, Tensor):
            raise InvalidArgument(f"model.loss(x, y) must return a Tensor, got {type(out).__name__}")
        return out


def model_loss(model: nn.Module) -> _LossFn:
    """The model's `.loss(x, y) -> Tensor`; a model without one is a configuration error."""
    fn = getattr(model, "loss", None)
    if not callable(fn):
        raise ConfigError(f"the model ({type(model).__name__}) must define loss(x, y) -> Tensor")
    return _LossFn(fn)
