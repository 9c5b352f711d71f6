"""Entry point of the `diloco` console script."""

from __future__ import annotations

import argparse
import sys

import torch

from diloco.cli import simulate
from diloco.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo: train across far-apart, unreliable islands of mixed hardware.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    simulate.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)  # one learner or service per core; 2 threads contend on these machines
    parser = build_parser()
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
