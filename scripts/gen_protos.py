"""Regenerate the Python code for protos/diloco/v1/*.proto into diloco/v1/.

Usage: python scripts/gen_protos.py [--out DIR]

The generated modules (_pb2.py, _pb2.pyi, _pb2_grpc.py) are committed; tests/test_protos.py runs this
script into a temporary folder and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.glob("diloco/v1/*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}/diloco/v1")
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    package = out / "diloco" / "v1"
    return sorted(package.glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="folder that receives diloco/v1/ (default: repo root)")
    files = generate(parser.parse_args().out)
    for f in files:
        print(f)


if __name__ == "__main__":
    sys.exit(main())
