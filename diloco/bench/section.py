"""What the suite knows about a section: `Section` (name, title, how to run it and render it) and the `Context`
a run gets. The registry itself is `diloco.bench.suite.SECTIONS`.

Adding a benchmark module to the suite: give it `section(ctx: Context) -> dict` (JSON-able results; a `checks`
list of `{name, target, measured, pass}` feeds the Targets table) and `markdown(result: dict) -> str` (and, with
figures, `plots(result: dict, out: Path) -> list[str]` returning the file names), then add one `Section(...)` line
to `SECTIONS`. Its settings for the full and the `--quick` run belong in the module (or `settings.py`) and in its
result's `settings`, so the report can state them. Its `main()`, the module run on its own
(`python -m diloco.bench.NAME`), is one call to `standalone`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.bench.settings import Profile
    from diloco.bench.sim_bench import SimRunner

Log = Callable[[str], None]
Result = dict[str, Any]
Flags = Callable[[argparse.ArgumentParser], None]
TORCH_THREADS = 1  # every measurement, in the suite or on its own, runs torch on this many threads per process


def pin_threads() -> None:
    """Torch on `TORCH_THREADS` threads, as every section is measured."""
    import torch  # only once a run starts: building a parser stays cheap

    torch.set_num_threads(TORCH_THREADS)


def no_plots(result: Result, out: Path) -> list[str]:
    return []


def save_figure(fig: Any, path: Path) -> str:
    """Lay out `fig`, write it to `path` at the report's resolution and close it; the file's name."""
    import matplotlib.pyplot as plt  # only once a section plots: building a parser stays cheap

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def console_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], caption: str = "", width: int = 160
) -> str:
    """A table for the terminal (rich; the first column left-aligned, the others right); `width` columns wide
    when stdout is not a terminal."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, caption=caption or None)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    console = Console(width=None if sys.stdout.isatty() else width)
    with console.capture() as out:
        console.print(t)
    return out.get().rstrip("\n")


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "**pass**" if ok else "**FAIL**"


def checks_md(result: Result) -> str:
    """A result's checks, one line each (the report shows them under the section); empty without checks."""
    return "\n".join(
        f"- {c['name']}: {c['measured']} (target: {c['target']}) → {verdict(c['pass'])}"
        for c in result.get("checks", [])
    )


def quick_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the small settings of `diloco bench --quick` (CI)")


def parser(doc: str | None, flags: Flags) -> argparse.ArgumentParser:
    """A section module's own command line: its `flags` and `--json`; the description is its docstring's first
    paragraph."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    flags(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON document instead of text")
    return p


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def standalone(
    doc: str | None,
    flags: Flags,
    run: Callable[[argparse.Namespace, Log], Result],
    render: Callable[[Result], str],
    argv: Sequence[str] | None = None,
) -> int:
    """A section module's `main()`: parse `flags` (and `--json`), pin torch's threads as the suite does, `run`
    (progress to stderr), then print the result to stdout: as JSON, or `render`ed followed by its checks as the
    report shows them. A `ConfigError` from the run is a usage error (exit 2); exit 1 when a check failed."""
    p = parser(doc, flags)
    a = p.parse_args(argv)
    pin_threads()
    try:
        result = run(a, stderr)
    except ConfigError as e:
        p.error(str(e))
    checks = checks_md(result)
    print(json.dumps(result, indent=1, default=str) if a.json else render(result) + (f"\n\n{checks}" if checks else ""))
    return 1 if any(c["pass"] is False for c in result.get("checks", [])) else 0


@dataclass
class Context:
    """What a section's run gets: the profile (full or quick), a log, and the shared simulation cache."""

    quick: bool
    profile: Profile
    log: Log
    sim: SimRunner


@dataclass(frozen=True)
class Section:
    name: str  # what `--only` takes
    title: str  # the report's heading, after its number
    run: Callable[[Context], Result]
    markdown: Callable[[Result], str]
    plots: Callable[[Result, Path], list[str]] = field(default=no_plots)
    # the excerpt the repository README shows between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, if any
    readme: Callable[[Result], str] | None = None
