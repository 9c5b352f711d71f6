"""`diloco data tokenize`: train a byte-level BPE tokenizer on a local corpus (offline) and write it with the
corpus's tokens, ready for `--data <out>/tokens.bin --tokenizer <out>/tokenizer.json`."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from diloco.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "data",
        help="prepare training data (train a tokenizer, write token files)",
        description="Prepare training data offline.",
    )
    commands = p.add_subparsers(dest="data_command", required=True)
    t = commands.add_parser(
        "tokenize",
        help="train a byte-level BPE on a local corpus and write tokenizer.json and the token file",
        description=(
            "Train a byte-level BPE tokenizer (the `tokenizers` library, offline) on a text file, a folder of text "
            "files or a .jsonl/.parquet file of records, and write OUT/tokenizer.json and the corpus's tokens: "
            "OUT/tokens.bin (little-endian uint16) when the vocabulary fits 16 bits, else OUT/tokens.npy (uint32). "
            "Train on them with --data OUT/tokens.bin --tokenizer OUT/tokenizer.json."
        ),
    )
    t.add_argument("--corpus", required=True, help="a text file, a folder of text files, or .jsonl/.parquet records")
    t.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary (>= 256)")
    t.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write (created if missing)")
    t.add_argument("--max-bytes", type=int, default=0, help="read at most this many bytes of the corpus (0: all)")
    t.add_argument("--text-field", default="text", help="the text column of .jsonl/.parquet records")
    t.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from diloco.task import tokenizer
    from diloco.task.data import DataConfig, load_documents

    if a.corpus == "stdlib" or not Path(a.corpus).expanduser().exists():
        raise ConfigError(f"--corpus {a.corpus!r} does not exist; give a text file, a folder or .jsonl/.parquet")
    if Path(a.corpus).suffix in (".bin", ".npy"):
        raise ConfigError(f"--corpus {a.corpus!r} is a token file already; give text")
    src = load_documents(DataConfig(source=a.corpus, max_bytes=a.max_bytes, text_field=a.text_field))
    docs = [d for _, d in src] if isinstance(src, list) else [src]
    texts = [bytes(d.astype(np.uint8)).decode("utf-8", errors="replace") for d in docs]
    if not any(texts):
        raise ConfigError(f"--corpus {a.corpus!r} holds no text")
    tok = tokenizer.train_bpe(texts, a.vocab_size)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    a.out.mkdir(parents=True, exist_ok=True)
    tok_path = a.out / "tokenizer.json"
    tok.save(str(tok_path))
    ids = tokenizer.encode_texts(str(tok_path), texts)
    tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=tokenizer.token_dtype(vocab))
    token_path = tokenizer.write_tokens(tokens, a.out, vocab)
    print(f"wrote {tok_path} ({vocab} tokens) and {token_path} ({tokens.shape[0]} tokens from {len(texts)} documents)")
    print(f"train with: --data {token_path} --tokenizer {tok_path}")
    return 0
