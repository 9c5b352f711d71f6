"""What the suite knows about a section: `Section` (name, title, how to run it and render it) and the `Context`
a run gets. The registry itself is `diloco.bench.suite.SECTIONS`.

Adding a benchmark module to the suite: give it `section(ctx: Context) -> dict` (JSON-able results; a `checks`
list of `{name, target, measured, pass}` feeds the Targets table) and `markdown(result: dict) -> str` (and, with
figures, `plots(result: dict, out: Path) -> list[str]` returning the file names), then add one `Section(...)` line
to `SECTIONS`. Its settings for the full and the `--quick` run belong in the module (or `settings.py`) and in its
result's `settings`, so the report can state them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diloco.bench.settings import Profile
    from diloco.bench.sim_bench import SimRunner

Log = Callable[[str], None]
Result = dict[str, Any]


def no_plots(result: Result, out: Path) -> list[str]:
    return []


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


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
