"""`diloco bench`: the benchmark suite (simulator and real-cluster sections) with a Markdown report and plots.

The suite lives in the repository's `bench/` folder (it is not part of the installed package), so this command
runs from a source checkout. `python bench/run_all.py` is the same command as a script.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from diloco.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("time-to-target", "scale", "compression", "cluster", "outer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="tiny budgets, for CI (about 2 minutes); default out: a temp dir"
    )
    p.add_argument(
        "--only",
        default="",
        metavar="NAME[,NAME]",
        help=f"run only these sections ({', '.join(SECTIONS)}); the others are kept from OUT/results.json",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default: docs/benchmarks; --quick: a temp dir)"
    )
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite README.md and the plots from OUT/results.json"
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suite; writes a Markdown report and plots",
        description="Run the benchmark suite (time to target, scale, compression, real cluster, outer optimizer) "
        "and write README.md, PNG plots and results.json into --out.",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def load_suite() -> ModuleType:
    """`bench.suite` from the source checkout this package was loaded from."""
    if not (REPO / "bench" / "suite.py").is_file():
        raise ConfigError(f"diloco bench runs from a source checkout: {REPO / 'bench' / 'suite.py'} is missing")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module("bench.suite")


def run(a: argparse.Namespace) -> int:
    suite = load_suite()
    only = suite.parse_only(a.only)
    out = a.out
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="diloco-bench-quick-")) if a.quick else REPO / "docs" / "benchmarks"
    started = time.monotonic()
    if a.report_only:
        suite.render(out, log=lambda line: print(line, flush=True))
        return 0
    suite.run_suite(out, quick=a.quick, only=only, log=lambda line: print(line, flush=True))
    print(f"report: {out / 'README.md'} ({time.monotonic() - started:.0f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python bench/run_all.py [--quick] [--only NAME] [--out DIR]`."""
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(prog="bench/run_all.py", description="Run the benchmark suite (= diloco bench).")
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        return run(a)
    except ConfigError as e:
        print(f"bench: configuration error: {e}", file=sys.stderr)
        return 2
