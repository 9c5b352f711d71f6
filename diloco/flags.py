"""Flags with `DILOCO_<FLAG>` environment fallbacks, for every service's `config.py`: a flag on the command line
wins, then the environment, then the default. Bad values raise `ConfigError` naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from diloco.errors import ConfigError

# (flag, type, default, help)
Flag = tuple[str, Callable[[str], Any], Any, str]
C = TypeVar("C")


def env_name(flag: str) -> str:
    """`--checkpoint-dir` -> `DILOCO_CHECKPOINT_DIR`."""
    return "DILOCO_" + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


_SIZE = re.compile(r"([0-9]{1,16})\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def byte_size(text: str) -> int:
    """A byte count: digits, optionally with a binary suffix K, M, G or T (`2G` = 2 << 30; `KiB`, `KB` alike)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"expected a byte count like 1048576 or 2G, got {text!r}")
    return int(m[1]) << _SIZE_SHIFT[m[2].upper()]


NEVER = -1  # `spill_size("never")`


def spill_size(text: str) -> int:
    """`--spill-above`: a byte count (`64M`; `0`: every one) or `never` (`NEVER`: memory only)."""
    if text.strip().lower() == "never":
        return NEVER
    try:
        return byte_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count like 64M or 2G, 0 (everything in files) or never (all in memory), got {text!r}"
        ) from None


class FlagParser(argparse.ArgumentParser):
    """Argument errors become `ConfigError` (the caller prints them and exits 2)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def build_parser(
    prog: str, description: str, groups: Sequence[tuple[str, Sequence[Flag]]], env: Mapping[str, str]
) -> FlagParser:
    """A parser whose every flag defaults to its environment variable, else to its default."""
    p = FlagParser(prog=prog, description=f"{description} Every flag falls back to DILOCO_<FLAG> in the environment.")
    for group_name, flags in groups:
        group = p.add_argument_group(group_name)
        for flag, conv, default, text in flags:
            name = env_name(flag)
            raw = env.get(name)
            try:
                value = default if raw is None else conv(raw)
            except ValueError as e:
                raise ConfigError(f"environment {name}={raw!r} is not valid for {flag}: {e}") from e
            group.add_argument(flag, type=conv, default=value, help=f"{text} (env {name}; default {default!r})")
    return p


def config_from_flags(cls: type[C], a: argparse.Namespace, **fields: Any) -> C:
    """An instance of the config dataclass `cls` from parsed flags: flag `--x-y` fills field `x_y`; `fields` fill
    the rest (nested configs); fields no flag names keep their defaults. The dataclass validates."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(fields) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    return cls(**{k: v for k, v in vars(a).items() if k in names}, **fields)
