"""`diloco.heap`: with the mmap threshold fixed, tensors a process frees leave its resident set (a learner's
gradients after each step); without it glibc keeps them in the heap. Each case runs in a process of its own."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_SCRIPT = """
import sys
from pathlib import Path

import torch

from diloco.heap import return_freed_memory


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


if sys.argv[1] == "fixed":
    assert return_freed_memory()
torch.ones(1 << 22).sum()  # 16 MiB mapped, then freed: glibc's own threshold rises above 4 MiB
grads = [torch.ones(1 << 20) for _ in range(64)]  # 64 blocks of 4 MiB, like a step's gradients
kept = torch.ones(1 << 20)  # allocated after them: the heap cannot shrink below it
before = rss()
del grads
print(before - rss())
"""


def _freed_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_tensors_leave_the_resident_set_only_with_the_threshold_fixed() -> None:
    assert _freed_bytes("fixed") >= 240 << 20  # the 256 MiB came back
    assert _freed_bytes("default") <= 64 << 20  # glibc's own policy kept them: the test sees the difference
