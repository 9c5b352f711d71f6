"""Run the benchmark suite and write the report: `diloco bench` and `python -m diloco.bench.run_all` are the same
command (the CLI builds its parser with `add_arguments` and calls `run`).

python -m diloco.bench.run_all                      # full suite into docs/benchmarks (about 30 minutes on 2 cores)
python -m diloco.bench.run_all --quick              # CI variant into a temp dir (about 2 minutes)
python -m diloco.bench.run_all --only startup --out docs/benchmarks

The suite itself (`diloco.bench.suite`, which imports torch, the simulator and matplotlib) is imported only when a
run starts, so building this parser is cheap.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from diloco.errors import ConfigError

CHECKOUT_REPORT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="tiny budgets, for CI (about 2 minutes); default out: a temp dir"
    )
    p.add_argument(
        "--only",
        default="",
        metavar="NAME[,NAME]",
        help="run only these sections (e.g. startup,cluster; an unknown name lists them all); the others are kept "
        "from OUT/results.json",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: docs/benchmarks of the source checkout; --quick: a temp dir)",
    )
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite README.md and the plots from OUT/results.json"
    )


def default_out(quick: bool) -> Path:
    if quick:
        return Path(tempfile.mkdtemp(prefix="diloco-bench-quick-"))
    if not CHECKOUT_REPORT.is_dir():
        raise ConfigError(f"no source checkout around this package ({CHECKOUT_REPORT} is missing); pass --out DIR")
    return CHECKOUT_REPORT


def run(a: argparse.Namespace) -> int:
    from diloco.bench import suite  # torch, the simulator and matplotlib: only once a run starts

    only = suite.parse_only(a.only)
    out: Path = a.out if a.out is not None else default_out(a.quick)
    started = time.monotonic()
    if a.report_only:
        suite.render(out, log=lambda line: print(line, flush=True))
        return 0
    suite.run_suite(out, quick=a.quick, only=only, log=lambda line: print(line, flush=True))
    print(f"report: {out / 'README.md'} ({time.monotonic() - started:.0f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m diloco.bench.run_all", description="Run the benchmark suite (= diloco bench)."
    )
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        return run(a)
    except ConfigError as e:
        print(f"bench: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
