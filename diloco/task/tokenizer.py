"""Subword tokenizers from local `tokenizers` JSON files (the `hf` extra), beside the default byte tokenizer.

`DataConfig.tokenizer` names a `tokenizer.json` written by the `tokenizers` library (for instance by
`diloco data tokenize`, which trains a byte-level BPE on a local corpus with `train_bpe`). Text sources are then
encoded with it; pre-tokenized `.bin`/`.npy` sources are read as they are, the tokenizer only telling their
vocabulary size. Nothing is downloaded: only local files are read.

Token files: `.bin` holds little-endian uint16 ids (vocabularies up to 65536 entries); larger vocabularies are
written as a `.npy` array of uint32 (`write_tokens`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from diloco.errors import ConfigError
from diloco.task._validate import hf_extra

_UINT16_VOCAB = 1 << 16
MIN_BPE_VOCAB = 256  # the byte-level alphabet: every byte is a token, so any text encodes


def _library() -> Any:
    return hf_extra("tokenizers", "data.tokenizer")


def file_digest(path: str | Path) -> str:
    """Short sha256 of a file's bytes (part of the task fingerprint)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def _load(path: str, digest: str) -> Any:
    del digest  # part of the cache key only: a rewritten file is read again
    try:
        return _library().Tokenizer.from_file(path)
    except Exception as e:  # the library raises plain Exceptions for malformed files
        raise ConfigError(f"data.tokenizer {path!r} is not a tokenizers JSON file: {e}") from e


def load_tokenizer(path: str) -> Any:
    """The `tokenizers.Tokenizer` stored at `path` (a local JSON file)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"data.tokenizer {path!r} does not exist; give a tokenizers JSON file (tokenizer.json)")
    return _load(str(p), file_digest(p))


def vocab_size(path: str) -> int:
    """Entries in the tokenizer's vocabulary, added tokens included (ids run from 0 to this minus one)."""
    return int(load_tokenizer(path).get_vocab_size(with_added_tokens=True))


def token_dtype(vocab: int) -> type[np.unsignedinteger[Any]]:
    """uint16 when every id fits, else uint32."""
    return np.uint16 if vocab <= _UINT16_VOCAB else np.uint32


def encode_texts(path: str, texts: Sequence[str]) -> list[npt.NDArray[np.unsignedinteger[Any]]]:
    """Each text's token ids, in the narrowest dtype the vocabulary allows."""
    tok = load_tokenizer(path)
    dtype = token_dtype(vocab_size(path))
    return [np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def train_bpe(texts: Iterable[str], vocab: int) -> Any:
    """A byte-level BPE tokenizer trained on `texts` (offline, deterministic for the same texts and vocab)."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < MIN_BPE_VOCAB:
        raise ConfigError(f"--vocab-size must be an integer >= {MIN_BPE_VOCAB} (the byte alphabet), got {vocab!r}")
    lib = _library()
    tok = lib.Tokenizer(lib.models.BPE())
    tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokens(tokens: npt.NDArray[np.unsignedinteger[Any]], out_dir: Path, vocab: int) -> Path:
    """`out_dir/tokens.bin` (little-endian uint16) when the vocabulary fits 16 bits, else `tokens.npy` (uint32)."""
    if token_dtype(vocab) is np.uint16:
        path = out_dir / "tokens.bin"
        tokens.astype("<u2").tofile(path)
    else:
        path = out_dir / "tokens.npy"
        np.save(path, tokens.astype("<u4"))
    return path
