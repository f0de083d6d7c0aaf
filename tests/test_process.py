"""Process-wide settings of shoal/process.py, each checked in a fresh interpreter (they are
process-wide: applied here they would leak into the rest of the suite)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Where a 24 MiB block comes from, and whether freeing it hands the heap top back to the kernel.
_PROBE = """
import ctypes, ctypes.util, sys
if sys.argv[1] == "keep":
    from shoal.process import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = line.split()[0].split("-")
            return int(lo, 16), int(hi, 16)
    return 0, 0

n = 24 << 20
p = libc.malloc(n)
lo, hi = heap()
from_heap = lo <= p and p + n <= hi
libc.free(p)
print(from_heap, heap()[1] >= p + n)
"""


def _probe(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc/self/maps")
def test_keep_freed_memory_serves_large_blocks_from_the_heap_and_keeps_them():
    # glibc's defaults: a fresh process mmaps a 24 MiB block and unmaps it on free, so the next
    # iteration's activations fault their pages in again.
    assert _probe("default") == ["False", "False"]
    assert _probe("keep") == ["True", "True"]
