"""The engine's CPU kernels (`worker/csrc/`, one file a family of kernels), built on first use.

The extension is compiled by `torch.utils.cpp_extension.load` against the torch that is installed,
so its ABI always matches: a wheel built ahead of time (or in pip's isolated build environment)
would pin one torch. The build takes about half a minute once per machine and is cached under
`$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`); the cache name carries a hash of the
CPU's feature flags, because the code is built with `-march=native`, and of torch's version.

Processes starting together (a node's workers, tensor-parallel ranks) take turns through an
`flock` on a file beside the build: the kernel drops it when its holder dies. torch's own lock
(`FileBaton`, a file that exists while held) is held for every load, about 1.5 s even when nothing
is built, and stays behind when a process is killed inside that window; every later load then
waits on it forever. Holding the flock, a process removes such a stale file before loading.

`load()` returns False (and the engine uses its torch path) when no C++ compiler is present or the
build fails; `SHOAL_CPU_OPS=0` turns the kernels off.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Every kernel file; the build itself tracks the headers they include (common.h, ops.h).
SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpuinfo_line(*keys: str) -> str | None:
    """The first line of `/proc/cpuinfo` that starts with one of `keys`, or None."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(keys))
    except (OSError, StopIteration):
        return None


def cpu_flags() -> str | None:
    """The first CPU's feature flags as Linux lists them (`flags` on x86, `Features` on Arm),
    or None where there is no `/proc/cpuinfo`."""
    return _cpuinfo_line("flags", "Features")


def cpu_flag_words() -> frozenset[str] | None:
    """`cpu_flags` as a set of flag names ("avx512_bf16", "amx_bf16", "bf16", ...)."""
    flags = cpu_flags()
    return None if flags is None else frozenset(flags.split(":", 1)[-1].split())


def cpu_vendor() -> str | None:
    """x86's `vendor_id` ("GenuineIntel", "AuthenticAMD"); None on Arm or without `/proc/cpuinfo`."""
    line = _cpuinfo_line("vendor_id")
    return None if line is None else line.split(":", 1)[-1].strip()


def cpu_computes_bfloat16() -> bool | None:
    """Whether this CPU has bfloat16 arithmetic instructions: AMX or AVX512_BF16 on x86, BF16 on
    Arm. Without them oneDNN converts to float32 around every multiply-add, and a bfloat16
    matmul runs several times slower than a float32 one (docs/benchmarks.md, session 7). None
    where the flags cannot be read."""
    words = cpu_flag_words()
    return None if words is None else bool(words & {"amx_bf16", "avx512_bf16", "bf16"})


def cpu_prefers_bfloat16() -> bool | None:
    """Whether this CPU multiplies bfloat16 faster than float32, so that serving bfloat16 pays:
    AMX, Arm BF16, or AVX512_BF16 on an AMD core. None where the flags cannot be read.

    An Intel core without AMX (a Cooper Lake, or a Sapphire or Emerald Rapids whose hypervisor
    hides AMX) issues `vdpbf16ps` on one port: its 32 multiply-adds a cycle are what two float32
    FMA ports do, and oneDNN's bfloat16 matmul adds its conversions. On 2 cores of such an
    Emerald Rapids a `[2048, 576] x [576, 1536]` matmul ran at 203 GFLOP/s in bfloat16 against
    352 in float32, and W64 at 147.6 against 178.0 tokens/s (docs/benchmarks.md, session 43).
    An AMD Zen 4 runs 512-bit FMAs at half rate and `vdpbf16ps` at full, and serves bfloat16
    faster."""
    words = cpu_flag_words()
    if words is None:
        return None
    if words & {"amx_bf16", "bf16"}:
        return True
    return "avx512_bf16" in words and cpu_vendor() != "GenuineIntel"


def _cpu_tag() -> str:
    """A short hash of what the build depends on besides its source: the CPU (`-march=native`)
    and torch (its ABI)."""
    flags = cpu_flags() or platform.processor()
    return hashlib.sha1(f"{platform.machine()} {flags} {torch.__version__}".encode()).hexdigest()[:10]


def build_directory() -> Path:
    """Where the kernels for this CPU and torch are built: `$TORCH_EXTENSIONS_DIR/shoal_cpu_ops_<tag>`
    (`TORCH_EXTENSIONS_DIR` unset: torch's default root, `~/.cache/torch_extensions`)."""
    from torch.utils import cpp_extension

    # torch's `load` reads TORCH_EXTENSIONS_DIR only where it picks the directory itself;
    # `get_default_build_root` never does (torch 2.13), and a read-only home (the Kubernetes
    # pods) leaves the variable's emptyDir as the only place a build can go.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"shoal_cpu_ops_{_cpu_tag()}"


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

    build_dir = build_directory()
    name = build_dir.name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir.parent / f"{name}.flock", "a") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)  # dropped on close, or by the kernel if we die
            # torch's baton: while we hold the flock no live shoal process holds it.
            (build_dir / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=name,
                build_directory=str(build_dir),
                sources=[str(p) for p in SOURCES],
                # -fno-trapping-math lets GCC vectorise std::floor (fast_exp); nothing here reads
                # FP flags.
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
