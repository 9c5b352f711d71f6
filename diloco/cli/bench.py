"""`diloco bench`: the benchmark suite (`diloco.bench`) with a Markdown report and plots; the same command as
`python -m diloco.bench.run_all`. The suite is imported only when the command runs."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from diloco.bench.run_all import add_arguments, run  # cheap: the suite itself loads inside `run`

    p = sub.add_parser(
        "bench",
        help="run the benchmark suite; writes a Markdown report and plots",
        description="Run the benchmark suite (the sections of diloco.bench.suite.SECTIONS; `--only` with an unknown "
        "name lists them) and write README.md, PNG plots and results.json into --out.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
