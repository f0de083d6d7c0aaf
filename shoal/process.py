"""Process-wide settings each part applies once it has started."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("shoal.process")

# glibc's mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30


def freeze_heap() -> None:
    """Exempt every object alive now from the cyclic garbage collector (`gc.freeze`).

    What a part builds at start-up (the gateway's tokenizer and FastAPI app, the worker's model,
    the imported libraries) lives as long as the process, yet every full collection walked all
    of it again: `perf` put 30% of the gateway's CPU in `gc_collect_main` and its traversals
    while it streamed W64, CPU the worker on the same cores then lacked. Objects made later are
    collected as usual.
    """
    gc.collect()
    gc.freeze()


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory an engine frees instead of handing it back to the
    kernel: allocations below `MMAP_THRESHOLD_BYTES` (32 MiB) come from the heap rather than
    mmap, and the heap is trimmed only once more than `TRIM_THRESHOLD_BYTES` (1 GiB) lie free at
    its top.

    Every iteration allocates and frees its activations (a 2,048-token prefill: tens of MB a
    layer). With glibc's defaults the heap top was trimmed back whenever those frees left more
    than twice the last mmap'd size free there, so the next iteration faulted the pages in
    again, zeroed: a fleet worker that had served for a while took 199,000 minor page faults
    per W64 run (0.8 GB), 5.6% of its CPU samples in the kernel against 2% in-process, where the
    heap happened to stay put; with these settings, 0-30 faults a run. The resident size then
    stays near its peak, which a serving process reaches anyway.

    Returns whether the settings took (False off glibc, e.g. musl or macOS).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        log.warning("mallopt refused the engine's malloc settings; freed memory may be trimmed")
    return ok
