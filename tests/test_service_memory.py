"""`diloco.rpc.server.map_large_blocks`: freed layer-sized blocks leave a service's resident memory, where glibc's
moving threshold would keep them in its heap. Run in child processes (the setting is per process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A model-sized block freed (glibc's threshold moves up to it), then 96 MiB of layer-sized blocks, each followed by a
# small block that stays (so the freed ones are holes in the heap, not its top): resident memory kept, in MiB.
_PROGRAM = """
import sys
from pathlib import Path
from diloco.rpc.server import map_large_blocks

def rss():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

if sys.argv[1] == "map":
    assert map_large_blocks()
big = bytearray(30 << 20)
del big
before = rss()
layers, pins = [], []
for _ in range(24):
    layers.append(bytearray(4 << 20))
    pins.append(bytearray(100_000))
del layers
print(rss() - before)
"""


def kept_mib(mode: str) -> float:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode], cwd=root, capture_output=True, text=True, timeout=60, check=True
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_freed_layer_sized_blocks_leave_resident_memory() -> None:
    assert kept_mib("default") > 64  # the behaviour the setting is for: still there without it
    assert kept_mib("map") < 16
