"""The committed generated code must be exactly what scripts/gen_protos.py produces from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "diloco" / "v1").glob("*_pb2*.py*")}
    committed = {p.name: p.read_bytes() for p in (ROOT / "diloco" / "v1").glob("*_pb2*.py*")}
    assert fresh, "the generator produced nothing"
    assert sorted(fresh) == sorted(committed), "generated files differ from the committed set"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `python scripts/gen_protos.py` and commit: {stale} are out of date"


def test_proto_package_is_versioned_and_enums_have_unspecified_zero() -> None:
    for proto in (ROOT / "protos" / "diloco" / "v1").glob("*.proto"):
        text = proto.read_text()
        assert "package diloco.v1;" in text, proto
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("enum "):
                assert "_UNSPECIFIED = 0;" in lines[i + 1], f"{proto.name}: {line} needs an *_UNSPECIFIED zero value"
