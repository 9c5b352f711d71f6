"""Atomic, checksummed checkpoints of `CoordinatorCore.snapshot()` (ALGORITHM.md section 8).

File layout of `ckpt-{version:08d}.pt`: the 8-byte magic `DLCKPT01`, the 32-byte sha256 of the body, then the
body, which is `torch.save(snapshot)`. A checkpoint is written to a temporary file in the same folder, hashed
while it is written, fsynced, renamed into place and the folder fsynced, so a crash leaves either the old set
or the new one. `load_latest` verifies the checksum and falls back to the next older file when the newest is
corrupt (truncated, bit flips, not a checkpoint).

Memory: `save` serialises the tensors from their own storage (`torch.save` hands the writer views of it), and `load`
hashes the file a slab at a time, then reads each tensor from the file straight into its new storage: neither
makes a copy of the body, so resuming holds the tensors read and nothing more.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any

import torch

from diloco import log as logging
from diloco.errors import InvalidArgument

MAGIC = b"DLCKPT01"
_DIGEST_BYTES = 32
_HEADER_BYTES = len(MAGIC) + _DIGEST_BYTES
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TMP_PREFIX = ".ckpt-"
_HASH_SLAB_BYTES = 1 << 20  # `load` hashes the body this much at a time


class CorruptCheckpoint(InvalidArgument):
    """A checkpoint file that is not intact (bad magic, checksum mismatch, unreadable body)."""


class _HashingWriter:
    """File-like sink for `torch.save` that hashes what it writes."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def checkpoint_path(directory: str | Path, version: int) -> Path:
    return Path(directory) / f"ckpt-{version:08d}.pt"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(version, path) of every checkpoint file in `directory`, newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    directory: str | Path,
    snapshot: dict[str, Any] | Callable[[], dict[str, Any]],
    keep: int = 3,
    *,
    hold: AbstractContextManager[Any] | None = None,
) -> tuple[Path, int]:
    """Write `snapshot` atomically as `ckpt-{version:08d}.pt` in `directory` (created if needed), then delete
    all but the newest `keep` checkpoints. Returns the path and the version.

    `snapshot` may be a function, called holding `hold` (a lock), whose tensors are serialised while `hold` is
    held: live tensors need no copy (the coordinator's Θ and outer state, under its tensor lock); the fsync and
    the rename follow after `hold` is released."""
    if keep < 1:
        raise InvalidArgument(f"keep must be >= 1, got {keep}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".tmp", dir=root)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + bytes(_DIGEST_BYTES))
            writer = _HashingWriter(f)
            with hold if hold is not None else contextlib.nullcontext():
                snap = snapshot() if callable(snapshot) else snapshot
                version = int(snap["version"])
                torch.save(snap, writer)  # type: ignore[arg-type]
                del snap
            final = checkpoint_path(root, version)
            f.flush()
            f.seek(len(MAGIC))
            f.write(writer.sha.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    prune(root, keep)
    return final, version


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints and any leftover temporary files; returns what was deleted."""
    root = Path(directory)
    removed = [p for _, p in list_checkpoints(root)[keep:]]
    if root.is_dir():
        removed += [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX) and p.name.endswith(".tmp")]
    for p in removed:
        with contextlib.suppress(OSError):
            p.unlink()
    return removed


def discard_after(directory: str | Path, version: int) -> list[Path]:
    """Delete every checkpoint of a version later than `version`; returns their paths. For a standby taking over:
    files it did not write itself may come from an earlier life of the replica as leader, rounds the new leader
    never had (one published without a standby's ack), and the server resumes from the newest file."""
    stale = [p for v, p in list_checkpoints(directory) if v > version]
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return stale


def load(path: str | Path) -> dict[str, Any]:
    """Read and verify one checkpoint; raises `CorruptCheckpoint` when it is not intact. The body is hashed from the
    open file, then unpickled from that same file (each tensor read into its own storage): no copy of the body."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            header = f.read(_HEADER_BYTES)
            if len(header) < _HEADER_BYTES or not header.startswith(MAGIC):
                raise CorruptCheckpoint(f"{p} is not a coordinator checkpoint (bad header)")
            if _sha256_rest(f) != header[len(MAGIC) :]:
                raise CorruptCheckpoint(f"checkpoint {p} fails its sha256 check (truncated or corrupted)")
            f.seek(_HEADER_BYTES)  # torch.load reads the body as a file that starts here
            try:
                snap = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:  # a body that hashes right but does not unpickle: written by something else
                raise CorruptCheckpoint(f"checkpoint {p} cannot be read: {e}") from e
    except OSError as e:
        raise CorruptCheckpoint(f"cannot read checkpoint {p}: {e}") from e
    if not isinstance(snap, dict) or "version" not in snap or "params" not in snap:
        raise CorruptCheckpoint(f"checkpoint {p} does not hold a coordinator snapshot")
    return snap


def _sha256_rest(f: io.BufferedIOBase) -> bytes:
    """The sha256 of what `f` holds from where it stands to its end, read a slab at a time into one buffer."""
    sha = hashlib.sha256()
    slab = bytearray(_HASH_SLAB_BYTES)
    view = memoryview(slab)
    while n := f.readinto(view):
        sha.update(view[:n])
    return sha.digest()


def load_latest(directory: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The newest intact checkpoint in `directory` and its path; corrupt ones are logged
    (`checkpoint.corrupt`) and skipped. None when there is none."""
    for _, path in list_checkpoints(directory):
        try:
            return load(path), path
        except CorruptCheckpoint as e:
            logging.get("coordinator").warning("checkpoint.corrupt", path=str(path), error=str(e))
    return None
