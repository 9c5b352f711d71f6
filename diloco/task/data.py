"""Training data: a byte-level tokenizer and a `Corpus` of training shards plus a held-out validation split.

Sources (`DataConfig.source`):
- `"stdlib"` (default, embedded): the `.py` files of the running interpreter's standard library, without test
  suites and site-packages; one document per file.
- a path to a folder of text files (read recursively, hidden and binary files skipped): one document per file.
- a path to one text file: its bytes, cut into blocks (pseudo-documents, see below).
- a path ending in `.bin`: little-endian uint16 token ids, cut into blocks (read into memory).
- a path ending in `.npy`: a 1-D numpy array of uint16 or uint32 token ids (vocabularies over 65536), in blocks.
- a path ending in `.jsonl`/`.json` or `.parquet`: local text records read through `datasets` (the `hf` extra,
  offline), one document per record, from the column named by `DataConfig.text_field` (default `"text"`).
Tokenizer (`DataConfig.tokenizer`): empty for bytes (ids 0..255); or a local `tokenizers` JSON file
(`diloco.task.tokenizer`), which encodes every text source after it is read and cut to `max_bytes` (so the cap
still counts bytes). Token files (`.bin`, `.npy`) are already tokenized and read as they are.
A token array given to `Corpus(tokens, cfg)` directly (a user factory) is cut into blocks too: block `i` of a
stream of `n` tokens covers tokens `[i·b, (i+1)·b)` with `b = min(4096, max(64, n // 256))`.

Selection (`max_bytes`): documents are taken in a fixed pseudo-random order (a hash of their id, the path
relative to the source) until `max_bytes` bytes are read; the last one is cut. For `.bin` sources the cap keeps
the first `max_bytes // 2` tokens (`.npy`: `max_bytes // itemsize`). Every document ends with a blank line.

Split (by document, independent of the seed): documents are held out for validation in the order of a stable
hash of their id until they hold at least `val_fraction` of the tokens, so no document sits on both sides and
the held-out set is a fixed pseudo-random pick. The validation documents are concatenated in id order. The
training documents are concatenated in an order shuffled by `DataConfig.seed` (so the seed changes the data
order, never the split) and the result is cut into `num_shards` contiguous shards of (almost) equal length.
Only files (stdlib, folders) are real documents: a single text file, a `.bin` file or a bare token array is split
by block, so there a document can be cut across blocks.

Batches (ALGORITHM.md section 7): the `B` rows of a batch are spread across the shard. With a shard of `L` tokens,
row `j` reads from `j·R`, `R = ⌊L/B⌋`, and every row advances one sequence of `T = seq_len` tokens per step, so a
pass over the shard has `P = min(⌊R/T⌋, ⌊(L - 1 - (B-1)·R)/T⌋)` steps. The cursor stays one monotone offset per
shard, counted in tokens read in this layout: step `s` of a shard is the range `[s·B·T, (s+1)·B·T)`, it reads
position `p = s mod P` of every row (inputs `[j·R + p·T, j·R + (p+1)·T)`, targets shifted by one), so a cursor
range `[c0, c1)` is `B` disjoint token ranges of the shard and holds `c1 - c0` training tokens: the ledger's
exactly-once accounting and its token counts need no change. `cursor // (P·B·T)` counts passes over the shard.
`DataConfig.layout = "contiguous"` keeps the layout used before (issue #17), for the benchmark that compares the
two only: a batch is `B` consecutive sequences starting at `cursor mod L` (wrapping), so a run reads only the
start of each shard.

Evaluation (`evaluate`): the validation split holds `n = ⌊(V - 1)/T⌋` non-overlapping sequences. With a budget
of `eval_tokens` it scores `k = min(n, ⌊eval_tokens/T⌋)` of them (all of them when `eval_tokens` is 0), evenly
spread: sequence `⌊i·n/k⌋` for `i < k`. The sample depends only on the split, `T` and the budget: it is the same
for every run, mode and seed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from diloco.errors import ConfigError, InvalidArgument, NotFound
from diloco.task._validate import check_float, check_int, hf_extra

Tokens = npt.NDArray[np.unsignedinteger[Any]]  # uint16, or uint32 for vocabularies over 65536
Document = tuple[str, Tokens]  # (stable id, tokens)

STDLIB = "stdlib"
_SOURCES = (
    '"stdlib", a text file, a folder of text files, a .bin file of little-endian uint16 tokens, a .npy token '
    "array, or a .jsonl/.parquet file of text records"
)
_RECORD_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"})
_DOC_SEPARATOR = b"\n\n"
_BLOCK_MIN, _BLOCK_MAX, _BLOCKS = 64, 4096, 256
LAYOUTS = ("spread", "contiguous")  # batch layouts; "contiguous" only for the benchmark comparing the two
_EVAL_ROWS = 32  # sequences per forward pass of the evaluator (the result does not depend on the caller)


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
    the training documents (not the split). `layout` is the batch layout (module docstring): `"spread"`, or
    `"contiguous"` (the layout before issue #17, kept for the benchmark that compares the two). `tokenizer` is
    empty (bytes) or a local `tokenizers` JSON file; `text_field` the column read from JSONL/Parquet records.
    """

    source: str = STDLIB
    num_shards: int = 16
    val_fraction: float = 0.02
    max_bytes: int = 8_000_000
    seed: int = 0
    layout: str = "spread"
    tokenizer: str = ""
    text_field: str = "text"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"data.layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"data.source must be {_SOURCES}, got {self.source!r}")
        check_int("data", "num_shards", self.num_shards, minimum=1)
        check_float("data", "val_fraction", self.val_fraction, lo=0.0, hi=0.5, lo_open=True)
        check_int("data", "max_bytes", self.max_bytes, minimum=0)
        check_int("data", "seed", self.seed, minimum=0)
        if not isinstance(self.tokenizer, str):
            raise ConfigError(f"data.tokenizer must be '' (bytes) or a tokenizers JSON file, got {self.tokenizer!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(
                f"data.text_field must name the text column of JSONL/Parquet records, got {self.text_field!r}"
            )


@dataclass(frozen=True)
class EvalResult:
    """A validation loss (mean cross-entropy per scored token) and the number of tokens it scored."""

    loss: float
    tokens: int


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


def _unit_hash(salt: str, doc_id: str) -> float:
    """A stable number in [0, 1) for a document id (the same on every machine and Python version)."""
    digest = hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _read_documents(root: Path, files: list[Path], max_bytes: int, *, skip_binary: bool) -> list[Document]:
    """Files as documents (id: the path relative to `root`), each ending with a blank line, taken in a fixed
    pseudo-random order until `max_bytes` bytes are read (the last one cut); returned in id order."""
    named = sorted(((f.relative_to(root).as_posix(), f) for f in files), key=lambda d: _unit_hash("take", d[0]))
    docs: list[Document] = []
    total = 0
    for doc_id, path in named:
        if max_bytes and total >= max_bytes:
            break
        blob = path.read_bytes()
        if not blob or (skip_binary and b"\x00" in blob[:8192]):
            continue
        blob += _DOC_SEPARATOR
        if max_bytes:
            blob = blob[: max_bytes - total]
        docs.append((doc_id, np.frombuffer(blob, dtype=np.uint8).astype(np.uint16)))
        total += len(blob)
    return sorted(docs, key=lambda d: d[0])


def _blocks(tokens: Tokens) -> list[Document]:
    """A stream without document boundaries as pseudo-documents: consecutive blocks (see the module docstring)."""
    n = int(tokens.shape[0])
    size = min(_BLOCK_MAX, max(_BLOCK_MIN, n // _BLOCKS))
    return [(f"block:{i}", tokens[start : start + size]) for i, start in enumerate(range(0, n, size))]


def load_documents(cfg: DataConfig) -> Tokens | list[Document]:
    """The documents named by `cfg.source`, or a token stream for sources without documents (see the module
    docstring), encoded with `cfg.tokenizer` when it names one; `Corpus` splits either."""
    if cfg.source == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        return _tokenize(cfg, _read_documents(root, stdlib_files(), cfg.max_bytes, skip_binary=False))
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
    if path.is_file() and path.suffix == ".npy":
        return _read_npy(cfg, path)
    if path.is_file() and path.suffix in _RECORD_FORMATS:
        return _tokenize(cfg, _read_records(cfg, path))
    if path.is_file():
        blob = path.read_bytes()
        stream = np.frombuffer(blob[: cfg.max_bytes] if cfg.max_bytes else blob, dtype=np.uint8).astype(np.uint16)
        return _tokenize(cfg, [("stream", stream)])[0][1] if cfg.tokenizer else stream
    return _tokenize(cfg, _read_documents(path, _walk(path), cfg.max_bytes, skip_binary=True))


def _read_npy(cfg: DataConfig, path: Path) -> Tokens:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data.source {cfg.source!r} is not a readable .npy array: {e}") from e
    if arr.ndim != 1 or arr.dtype.kind != "u" or arr.dtype.itemsize not in (2, 4):
        raise ConfigError(
            f"data.source {cfg.source!r} holds a {arr.dtype} array of shape {arr.shape}; expected a 1-D uint16 "
            "or uint32 array of token ids"
        )
    tokens: Tokens = arr.astype(arr.dtype.newbyteorder("="), copy=False)
    return tokens[: cfg.max_bytes // arr.dtype.itemsize] if cfg.max_bytes else tokens


def _read_records(cfg: DataConfig, path: Path) -> list[Document]:
    """JSONL/Parquet text records through `datasets` (offline), one document per record, as bytes."""
    datasets = hf_extra("datasets", f"data.source {cfg.source!r}")
    try:
        table = datasets.load_dataset(_RECORD_FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as e:  # datasets raises many kinds for a malformed file
        raise ConfigError(f"data.source {cfg.source!r} could not be read as {path.suffix} records: {e}") from e
    if cfg.text_field not in table.column_names:
        raise ConfigError(
            f"data.text_field {cfg.text_field!r} is not a column of {cfg.source!r}; columns: {table.column_names}"
        )
    docs: list[Document] = []
    total = 0
    for i, text in enumerate(table[cfg.text_field]):
        if cfg.max_bytes and total >= cfg.max_bytes:
            break
        blob = str(text).encode("utf-8") + _DOC_SEPARATOR
        if cfg.max_bytes:
            blob = blob[: cfg.max_bytes - total]
        docs.append((f"record:{i:09d}", np.frombuffer(blob, dtype=np.uint8).astype(np.uint16)))
        total += len(blob)
    return docs


def _tokenize(cfg: DataConfig, docs: list[Document]) -> list[Document]:
    """Byte documents re-encoded with `cfg.tokenizer` (unchanged when it is empty)."""
    if not cfg.tokenizer:
        return docs
    from diloco.task import tokenizer  # the optional `tokenizers` package, only when a tokenizer is named

    texts = [bytes(d.astype(np.uint8)).decode("utf-8", errors="replace") for _, d in docs]
    return list(zip((doc_id for doc_id, _ in docs), tokenizer.encode_texts(cfg.tokenizer, texts), strict=True))


def _concat(docs: Sequence[Document]) -> Tokens:
    if not docs:
        return np.zeros(0, dtype=np.uint16)
    dtype = np.result_type(np.uint16, *(d.dtype for _, d in docs))
    return np.ascontiguousarray(np.concatenate([d for _, d in docs]), dtype=dtype)


class Corpus:
    """Training shards and a validation split, cut from documents (or from a token stream, in blocks).

    `Corpus(tokens, cfg)` takes a 1-D uint16 token array (cut into blocks) or a list of `(id, tokens)`
    documents; see the module docstring for the split, the shard layout and the batch layout.
    """

    def __init__(self, tokens: Tokens | Sequence[Document], cfg: DataConfig, *, description: str = "") -> None:
        self.cfg = cfg
        self.description = description or cfg.source
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1:
                raise ConfigError(f"data.source must give a 1-D token stream, got shape {tokens.shape}")
            docs = _blocks(tokens)
        else:
            docs = [(doc_id, d) for doc_id, d in tokens if d.shape[0] > 0]
            if len({doc_id for doc_id, _ in docs}) != len(docs):
                raise ConfigError(f"data.source {self.description!r} has two documents with the same id")
        n = sum(int(d.shape[0]) for _, d in docs)
        if n == 0:
            raise ConfigError(f"data.source {self.description!r} is empty: no tokens to train on")
        held: set[str] = set()
        held_tokens = 0
        for doc_id, d in sorted(docs, key=lambda d: _unit_hash("val", d[0])):
            if held_tokens >= cfg.val_fraction * n:
                break
            held.add(doc_id)
            held_tokens += int(d.shape[0])
        val_docs = sorted((d for d in docs if d[0] in held), key=lambda d: d[0])
        train_docs = [d for d in docs if d[0] not in held]
        random.Random(cfg.seed).shuffle(train_docs)
        self.val = _concat(val_docs)
        self.train = _concat(train_docs)
        self.train_tokens = int(self.train.shape[0])
        self.val_documents = len(val_docs)
        self.train_documents = len(train_docs)
        if self.train_tokens < cfg.num_shards:
            raise ConfigError(
                f"data.source {self.description!r} holds {n} tokens in {len(docs)} documents, {self.train_tokens} "
                f"of them for training: too few for data.num_shards={cfg.num_shards} once the validation documents "
                f"(data.val_fraction={cfg.val_fraction}) are held out; use a larger corpus or fewer shards"
            )
        self._bounds = [
            (i * self.train_tokens // cfg.num_shards, (i + 1) * self.train_tokens // cfg.num_shards)
            for i in range(cfg.num_shards)
        ]
        self.max_token = max(int(self.train.max()), int(self.val.max()))

    @classmethod
    def load(cls, cfg: DataConfig) -> Corpus:
        """Read the source named by `cfg`."""
        return cls(load_documents(cfg), cfg)

    @property
    def num_shards(self) -> int:
        return self.cfg.num_shards

    @property
    def num_tokens(self) -> int:
        """Training plus validation tokens."""
        return self.train_tokens + int(self.val.shape[0])

    @functools.cached_property
    def fingerprint(self) -> str:
        """Short hash of the tokens and the split, to check that learners read the same data."""
        h = hashlib.sha256(f"{self.num_shards}:{self.train_tokens}:{self.num_tokens}".encode())
        for tokens in (self.train, self.val):  # hashed in place (a memory-mapped file is not copied)
            h.update(np.ascontiguousarray(tokens).data)
        return h.hexdigest()[:16]

    def shard_bounds(self, shard_id: int) -> tuple[int, int]:
        """`[start, end)` of the shard in the training stream."""
        if not 0 <= shard_id < self.num_shards:
            raise NotFound(f"shard {shard_id} does not exist; shards are 0..{self.num_shards - 1}")
        return self._bounds[shard_id]

    def shard_tokens(self, shard_id: int) -> Tokens:
        start, end = self.shard_bounds(shard_id)
        return self.train[start:end]

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

    def steps_per_pass(self, shard_id: int, batch_size: int, seq_len: int) -> int:
        """`P`: the steps of one pass over the shard in the spread layout (see the module docstring)."""
        length = self.shard_length(shard_id)
        row = length // batch_size
        steps = min(row // seq_len, (length - 1 - (batch_size - 1) * row) // seq_len)
        if steps < 1:
            raise ConfigError(
                f"shard {shard_id} holds {length} tokens, fewer than one batch (inner.batch_size={batch_size} x "
                f"model.seq_len={seq_len} + 1); lower data.num_shards or the batch, or add data"
            )
        return steps

    def batch(self, shard_id: int, cursor: int, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor, int]:
        """The batch at `cursor` of the shard: `batch_size` rows spread across it (see the module docstring).

        Cursors start at 0 and move by whole steps (`batch_size·seq_len` tokens); a cursor between two steps
        reads the step it falls in. Returns int64 `(x, y)` of shape (batch_size, seq_len), y the targets shifted
        by one, and the next cursor `cursor + batch_size·seq_len`.
        """
        if cursor < 0:
            raise InvalidArgument(f"cursor must be >= 0, got {cursor}")
        step_tokens = batch_size * seq_len
        shard = self.shard_tokens(shard_id)
        if self.cfg.layout == "contiguous":
            begin = cursor % shard.shape[0] + np.arange(batch_size, dtype=np.int64)[:, None] * seq_len
            idx = (begin + np.arange(seq_len + 1, dtype=np.int64)[None, :]) % shard.shape[0]
            seqs = torch.from_numpy(shard[idx].astype(np.int64))
            return seqs[:, :-1], seqs[:, 1:], cursor + step_tokens
        row = shard.shape[0] // batch_size
        position = (cursor // step_tokens) % self.steps_per_pass(shard_id, batch_size, seq_len)
        starts = (np.arange(batch_size, dtype=np.int64) * row + position * seq_len)[:, None]
        seqs = torch.from_numpy(shard[starts + np.arange(seq_len + 1, dtype=np.int64)[None, :]].astype(np.int64))
        return seqs[:, :-1], seqs[:, 1:], cursor + step_tokens

    def eval_starts(self, seq_len: int, eval_tokens: int) -> npt.NDArray[np.int64]:
        """Start offsets in the validation split of the sequences `evaluate` scores (see the module docstring)."""
        check_int("evaluation", "seq_len", seq_len, minimum=1)
        check_eval_tokens(eval_tokens, seq_len)
        n = (int(self.val.shape[0]) - 1) // seq_len
        if n < 1:
            raise ConfigError(
                f"validation split holds {self.val.shape[0]} tokens, fewer than model.seq_len + 1 = {seq_len + 1}; "
                "raise data.val_fraction or add data"
            )
        k = n if eval_tokens == 0 else min(n, eval_tokens // seq_len)
        return (np.arange(k, dtype=np.int64) * n // k) * seq_len

    def val_batches(self, seq_len: int, eval_tokens: int, rows: int = _EVAL_ROWS) -> Iterator[tuple[Tensor, Tensor]]:
        """The scored validation sequences as int64 `(x, y)` batches of at most `rows` sequences."""
        check_int("evaluation", "rows", rows, minimum=1)
        starts = self.eval_starts(seq_len, eval_tokens)
        offsets = np.arange(seq_len + 1, dtype=np.int64)[None, :]
        for b in range(0, starts.shape[0], rows):
            seqs = torch.from_numpy(self.val[starts[b : b + rows, None] + offsets].astype(np.int64))
            yield seqs[:, :-1], seqs[:, 1:]


def check_eval_tokens(eval_tokens: object, seq_len: int, *, name: str = "eval_tokens") -> None:
    """The evaluation budget: 0 (the whole validation split) or at least one sequence (`seq_len` tokens)."""
    if (
        isinstance(eval_tokens, bool)
        or not isinstance(eval_tokens, int)
        or not (eval_tokens == 0 or eval_tokens >= seq_len)
    ):
        raise ConfigError(
            f"{name} must be 0 (score the whole validation split) or an integer >= model.seq_len = {seq_len} "
            f"(at least one sequence), got {eval_tokens!r}"
        )


@torch.no_grad()
def evaluate(model: nn.Module, corpus: Corpus, seq_len: int, eval_tokens: int, device: torch.device) -> EvalResult:
    """Validation loss of `model`: the mean per-token loss over the fixed, evenly spread sample of at most
    `eval_tokens` validation tokens (0: all of them) described in the module docstring, and the tokens scored."""
    loss_fn = model_loss(model)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for x, y in corpus.val_batches(seq_len, eval_tokens):
            total += float(loss_fn(x.to(device), y.to(device))) * x.numel()
            tokens += x.numel()
    finally:
        model.train(was_training)
    return EvalResult(total / tokens, tokens)


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
