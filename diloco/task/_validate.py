"""Small validators shared by the task configs. Each raises `ConfigError` naming `section.field` and what is
allowed, so a bad flag or JSON file is reported at start, not deep inside training."""

from __future__ import annotations

import importlib
import math
import os
from types import ModuleType

from diloco.errors import ConfigError

# Hugging Face libraries never reach the hub from here: models, tokenizers and data come from local files only.
_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")


def hf_extra(package: str, needed_by: str) -> ModuleType:
    """Import `package` of the `hf` extra (transformers, tokenizers, datasets) with the hub switched off; a
    `ConfigError` naming the setting `needed_by` when it is not installed."""
    for key in _OFFLINE:
        os.environ.setdefault(key, "1")
    try:
        return importlib.import_module(package)
    except ImportError as e:  # pragma: no cover - the extra is installed in the development environment
        raise ConfigError(
            f"{needed_by} needs the `{package}` package: install the hf extra (pip install 'decoupled-diloco[hf]')"
        ) from e


def check_int(section: str, name: str, value: object, *, minimum: int) -> None:
    """`value` must be an int (not a bool) and at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{section}.{name} must be an integer >= {minimum}, got {value!r}")


def check_float(
    section: str,
    name: str,
    value: object,
    *,
    lo: float,
    hi: float = math.inf,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """`value` must be a finite real number in the interval given by `lo`, `hi` and the open flags."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open or hi == math.inf else "]"
        raise ConfigError(f"{section}.{name} must be a number in {left}{lo}, {hi}{right}, got {value!r}")
