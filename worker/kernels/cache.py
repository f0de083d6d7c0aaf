"""Triton kernels that write the paged K/V cache and apply rotary position embeddings (RoPE).

- `write_kv`: store each new token's K and V at its slot `block * BS + offset` (pool layouts as in
  worker/kv_cache.py: keys transposed inside a block); a negative slot is a padding row (a CUDA
  graph's batch padded to its captured size, worker/cuda_graphs.py) and writes nothing.
- `rope_`: rotate, in place, the first heads of each row by a per-row position in the "rotate
  half" layout (Su et al. 2021; transformers' Llama): `x1' = x1 cos - x2 sin`,
  `x2' = x2 cos + x1 sin`. With `sign=-1` it rotates backwards, which is the in-place key rotation
  of shift-RoPE-K: keys cached at position p come to carry position p - n (Neural Speed's
  infinite inference) with `positions = n`, because R(-a) has cos a and -sin a.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slots_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ph, stride_pb, stride_pd,
    stride_qh, stride_qb, stride_qt,
    HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
):
    # One program per token, all its K/V heads at once.
    n = tl.program_id(0)
    h = tl.arange(0, HKV_PAD)[:, None]
    d = tl.arange(0, D)[None, :]
    slot = tl.load(slots_ptr + n)
    ok = (h < HKV) & (h * 0 + slot >= 0)  # broadcast: the interpreter refuses a scalar mask term
    block = slot // BS
    offset = slot % BS
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + d, mask=ok)
    tl.store(k_pool_ptr + h * stride_ph + block * stride_pb + d * stride_pd + offset, k, mask=ok)
    tl.store(v_pool_ptr + h * stride_qh + block * stride_qb + offset * stride_qt + d, v, mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr, positions_ptr, cos_sin_ptr,
    stride_xn, stride_xh, stride_cs,
    sign,
    H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr,
):
    # One program per row, all its rotated heads at once.
    n = tl.program_id(0)
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF)[None, :]
    ok = h < H
    pos = tl.load(positions_ptr + n)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i) * sign
    base = x_ptr + n * stride_xn + h * stride_xh
    x1 = tl.load(base + i, mask=ok).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=ok).to(tl.float32)
    tl.store(base + i, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(base + HALF + i, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys and values at their slots.

    Args:
        k, v: `[num_tokens, Hkv, D]` (unit stride along D), the pools' dtype.
        k_pool: `[Hkv, num_blocks, D, BS]`; v_pool: `[Hkv, num_blocks, BS, D]` (unit stride along
            the last dimension).
        slot_mapping: `[num_tokens]` int, `block * BS + offset` of each token; distinct, or
            negative for a row that writes nothing.
    """
    n, hkv, d = k.shape
    if n == 0:
        return
    _write_kv_kernel[(n,)](
        k, v, k_pool, v_pool, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        HKV=hkv, HKV_PAD=triton.next_power_of_2(hkv), D=d, BS=k_pool.shape[3],
    )


def rope_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
          head_dim: int, sign: float = 1.0) -> None:
    """Rotate, in place, heads `[0, num_heads)` of every row of `x` by the row's position.

    Args:
        x: `[n, >= num_heads * head_dim]` with unit stride along the last dimension: rows of
            consecutive heads (the fused QKV output, where query and key heads come first), or any
            `[n, H, head_dim]` view whose last dimension is contiguous.
        positions: `[n]` int, rows of `cos_sin`.
        cos_sin: `[max_positions, head_dim]` float32 (`worker.ops.rope_cos_sin`).
        sign: 1 rotates forwards; -1 rotates backwards by the same angle.
    """
    n = x.shape[0]
    if n == 0:
        return
    stride_h = x.stride(1) if x.dim() == 3 else head_dim
    _rope_kernel[(n,)](
        x, positions, cos_sin, x.stride(0), stride_h, cos_sin.stride(0), sign,
        H=num_heads, H_PAD=triton.next_power_of_2(num_heads), HALF=head_dim // 2,
    )
