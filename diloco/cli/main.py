"""Entry point of the `diloco` console script.

Every command lives in its own module, imported only when that command runs: `diloco healthd` and `diloco ctl`
never import torch (or the simulator, or the benchmarks), so they start in a fraction of a second. The table below
holds each command's one-line help for `diloco --help`; the module's `add_parser` builds its full parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from diloco.errors import ConfigError

# name -> (module with add_parser(sub), one-line help); the same help as the module's own parser
COMMANDS: dict[str, tuple[str, str]] = {
    "local": ("diloco.cli.local", "run a local cluster (healthd, coordinator, N workers) on loopback"),
    "simulate": ("diloco.cli.simulate", "simulate M learners on a virtual clock (deterministic)"),
    "ctl": ("diloco.cli.ctl", "operate a running coordinator"),
    "bench": ("diloco.cli.bench", "run the benchmark suite; writes a Markdown report and plots"),
    "certs": ("diloco.cli.certs", "write a CA, certificates and tokens for mutual TLS"),
    "data": ("diloco.cli.data", "prepare training data (train a tokenizer, write token files)"),
}
SERVICES = {
    "coordinator": "run the coordinator service (what docker-compose runs)",
    "worker": "run one worker (learner)",
    "healthd": "run the health daemon",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. With `command`, only that command's module is imported (the others get a stub that
    carries their help line); without, every command is built in full."""
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo: train across far-apart, unreliable islands of mixed hardware.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=summary)
    for name, text in SERVICES.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:  # the service parses its own flags
        service = importlib.import_module(f"services.{argv[0]}.__main__")
        return int(service.main(argv[1:]))
    # `diloco`, `diloco --help` or a typo import no command: argparse prints the usage from the stubs
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else "")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"diloco {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
