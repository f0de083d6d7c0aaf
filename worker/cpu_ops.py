"""The engine's CPU kernels (`worker/csrc/cpu_ops.cpp`), built on first use.

The extension is compiled by `torch.utils.cpp_extension.load` against the torch that is installed,
so its ABI always matches: a wheel built ahead of time (or in pip's isolated build environment)
would pin one torch. The build takes about a minute once per machine and is cached under
`$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`); the cache name carries a hash of the
CPU's feature flags, because the code is built with `-march=native`.

`load()` returns False (and the engine uses its torch path) when no C++ compiler is present or the
build fails; `SHOAL_CPU_OPS=0` turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
_lock = threading.Lock()
_state: dict[str, bool] = {}


def cpu_flags() -> str | None:
    """The first CPU's feature flags as Linux lists them (`flags` on x86, `Features` on Arm),
    or None where there is no `/proc/cpuinfo`."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return None


def cpu_computes_bfloat16() -> bool | None:
    """Whether this CPU has bfloat16 arithmetic instructions: AMX or AVX512_BF16 on x86, BF16 on
    Arm. Without them oneDNN converts to float32 around every multiply-add, and a bfloat16
    matmul runs several times slower than a float32 one (docs/benchmarks.md, session 7). None
    where the flags cannot be read."""
    flags = cpu_flags()
    if flags is None:
        return None
    words = set(flags.split(":", 1)[-1].split())
    return bool(words & {"amx_bf16", "avx512_bf16", "bf16"})


def _cpu_tag() -> str:
    """A short hash of what the compiler's `-march=native` depends on."""
    flags = cpu_flags() or platform.processor()
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def load() -> bool:
    """Build (or load the cached build of) the kernels; True when `torch.ops.shoal` is usable."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
        return _state["ok"]


def _build() -> bool:
    if os.environ.get("SHOAL_CPU_OPS", "1") == "0":
        return False
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=f"shoal_cpu_ops_{_cpu_tag()}",
            sources=[str(SOURCE)],
            # -fno-trapping-math lets GCC vectorise std::floor (fast_exp); nothing here reads FP flags.
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp",
                          "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a compile error: serve on the torch path
        log.warning("shoal CPU kernels unavailable (%s); using the torch path", e)
        return False
    return hasattr(torch.ops.shoal, "paged_attention")
