"""Entry point of the `diloco` console script."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from diloco.cli import bench, certs, ctl, local, simulate
from diloco.errors import ConfigError

SERVICES = {
    "coordinator": "run the coordinator service (what docker-compose runs)",
    "worker": "run one worker (learner)",
    "healthd": "run the health daemon",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo: train across far-apart, unreliable islands of mixed hardware.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    local.add_parser(sub)
    simulate.add_parser(sub)
    ctl.add_parser(sub)
    bench.add_parser(sub)
    certs.add_parser(sub)
    for name, text in SERVICES.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:  # the service parses its own flags
        service = importlib.import_module(f"services.{argv[0]}.__main__")
        return int(service.main(argv[1:]))
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
