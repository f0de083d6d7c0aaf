"""`shoal bench kernels`: each Triton kernel against the torch path on a CUDA device, with the
memory bandwidth it achieves against the device's peak.

Shapes are SmolLM2-135M's (9 query heads, 3 K/V heads, head dim 64) in bfloat16 with 16-token
blocks, at the sizes of W64: 64 decodes with contexts of 32-320 tokens, and prefill of 8 prompts
of 256 tokens. Bytes are what a kernel must move at least (each K/V element it attends to read
once, its inputs read and outputs written once); bandwidth = bytes / median time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def peak_bandwidth_bytes_per_s(device: torch.device) -> float | None:
    """The device's DRAM bandwidth from its memory clock and bus width (double data rate), or None
    where torch does not report them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8


def _cases(device: torch.device, dtype: torch.dtype):
    """(name, triton callable, torch callable, bytes moved) for each kernel."""
    from worker.attention import TorchAttention, build_metadata
    from worker.kernels import TritonAttention
    from worker.ops import rope_cos_sin

    g = torch.Generator(device="cpu").manual_seed(0)
    el = torch.empty((), dtype=dtype).element_size()
    tri, ref = TritonAttention(), TorchAttention(cpu_kernels=False)
    lens = torch.randint(32, 321, (64,), generator=g).tolist()
    prompts = [256] * 8
    blocks = sum(-(-n // BLOCK_SIZE) for n in lens + prompts)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables = []
    for n in lens + prompts:
        tables.append(perm[: -(-n // BLOCK_SIZE)])
        perm = perm[len(tables[-1]):]
    k_pool = torch.randn(HKV, blocks, HEAD_DIM, BLOCK_SIZE, generator=g).to(device, dtype)
    v_pool = torch.randn(HKV, blocks, BLOCK_SIZE, HEAD_DIM, generator=g).to(device, dtype)
    scale = HEAD_DIM**-0.5

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    decode_meta = build_metadata(tables[:64], lens, [], BLOCK_SIZE, device)
    q = rand(64, HQ, HEAD_DIM)
    out = torch.empty(64, HQ * HEAD_DIM, device=device, dtype=dtype)
    kv_bytes = 2 * sum(lens) * HKV * HEAD_DIM * el
    yield ("decode attention (64 requests, 32-320 tokens)",
           lambda: tri.decode(q, k_pool, v_pool, decode_meta, scale, out),
           lambda: ref.decode(q, k_pool, v_pool, decode_meta, scale, out),
           kv_bytes + 2 * q.numel() * el)

    n = sum(prompts)
    prefill_meta = build_metadata([], [], [(t, 0, 256) for t in tables[64:]], BLOCK_SIZE, device)
    qp, kp, vp = rand(n, HQ, HEAD_DIM), rand(n, HKV, HEAD_DIM), rand(n, HKV, HEAD_DIM)
    outp = torch.empty(n, HQ * HEAD_DIM, device=device, dtype=dtype)
    yield ("prefill attention (8 prompts of 256 tokens)",
           lambda: tri.prefill(qp, kp, vp, k_pool, v_pool, prefill_meta, scale, outp),
           lambda: ref.prefill(qp, kp, vp, k_pool, v_pool, prefill_meta, scale, outp),
           (2 * qp.numel() + kp.numel() + vp.numel()) * el)

    slots = prefill_meta.slot_mapping
    yield ("write K/V (2,048 tokens)",
           lambda: tri.write_kv(kp, vp, k_pool, v_pool, slots),
           lambda: ref.write_kv(kp, vp, k_pool, v_pool, slots),
           2 * (kp.numel() + vp.numel()) * el)

    qkv = rand(n, (HQ + 2 * HKV) * HEAD_DIM)
    positions = torch.arange(n, device=device) % 256
    cos_sin = rope_cos_sin(10000.0, HEAD_DIM, 2048).to(device)
    yield ("RoPE on Q and K (2,048 tokens)",
           lambda: tri.rope_(qkv, positions, cos_sin, HQ + HKV, HEAD_DIM),
           lambda: ref.rope_(qkv, positions, cos_sin, HQ + HKV, HEAD_DIM),
           2 * n * (HQ + HKV) * HEAD_DIM * el)


def run_kernel_bench(output: str, dtype: torch.dtype = torch.bfloat16) -> dict | None:
    """Time every kernel and its torch path; print a table and write JSON to `output`.

    Returns None (after saying so) where there is no CUDA device: the kernels' speed means
    nothing under the interpreter.
    """
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not torch.cuda.is_available():
        console.print("shoal bench kernels: no CUDA device here; the Triton kernels are timed on "
                      "GPUs only (tests/test_kernels.py checks them on the CPU)")
        return None
    from triton.testing import do_bench

    device = torch.device("cuda")
    peak = peak_bandwidth_bytes_per_s(device)
    rows = []
    for name, tri, ref, nbytes in _cases(device, dtype):
        t_tri, t_ref = do_bench(tri) * 1e-3, do_bench(ref) * 1e-3  # ms -> s, medians
        rows.append({"kernel": name, "triton_s": t_tri, "torch_s": t_ref, "bytes": nbytes,
                     "triton_bytes_per_s": nbytes / t_tri,
                     "fraction_of_peak": nbytes / t_tri / peak if peak else None})
    table = Table(title=f"shoal bench kernels ({torch.cuda.get_device_name(device)}, "
                        f"{str(dtype).removeprefix('torch.')})")
    for col in ("kernel", "triton µs", "torch µs", "speed-up", "GB/s", "of peak"):
        table.add_column(col, justify="right" if col != "kernel" else "left")
    for r in rows:
        table.add_row(r["kernel"], f"{r['triton_s'] * 1e6:.1f}", f"{r['torch_s'] * 1e6:.1f}",
                      f"{r['torch_s'] / r['triton_s']:.2f}x", f"{r['triton_bytes_per_s'] / 1e9:.0f}",
                      f"{r['fraction_of_peak']:.0%}" if r["fraction_of_peak"] else "?")
    console.print(table)
    result = {"device": torch.cuda.get_device_name(device), "dtype": str(dtype),
              "peak_bytes_per_s": peak, "kernels": rows}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(result, indent=2))
    return result
