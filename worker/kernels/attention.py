"""Triton attention kernels over the paged K/V cache: decode (one query token per request) and
variable-length prefill over the flat batch.

Both read the pools where they lie, through each request's block table, in the layout of
worker/kv_cache.py: `k_pool [Hkv, num_blocks, D, BS]` (keys transposed inside a block, so a loaded
block is already the `[D, BS]` right operand of `q @ K^T`) and `v_pool [Hkv, num_blocks, BS, D]`.
Scores and the softmax are float32 with the online (streaming) softmax of FlashAttention (Dao et
al. 2022, Alg. 1): one pass over the blocks keeps a running max `m`, normaliser `l` and output
accumulator, rescaled by `exp(m_old - m_new)` whenever the max grows.

`tl.dot` needs every dimension >= 16 on a GPU: blocks are at least 16 tokens, head dims at least
16, and a decode program pads its query-head group to 16 rows (masked). float32 inputs multiply in
IEEE float32 (`input_precision="ieee"`), never TF32, so the kernels match the torch path to 1e-5.
Triton 3.9's interpreter multiplies bfloat16 tiles as raw 16-bit integers, so under
`TRITON_INTERPRET=1` bfloat16 operands are widened to float32 first (the same IEEE branch); on a
GPU they go to the tensor cores as they are.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _attend_block(q, kt, v, visible, scale, m, l_sum, acc, IEEE: tl.constexpr):
    """One block of the online softmax: scores `q @ kt` where `visible`, the running max `m` and
    sum `l_sum` updated, the output accumulator `acc` rescaled and added `p @ v` to."""
    s = tl.where(visible, _dot(q, kt, IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_sum, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
    stride_qn, stride_qh,
    stride_kh, stride_kb, stride_kd,
    stride_vh, stride_vb, stride_vt,
    stride_tn, stride_on,
    scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program per (request, K/V head): the GROUP query heads that share the K/V head are the
    # rows of one tile, so each K/V block is loaded once for all of them (grouped-query attention).
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    row_ok = g < GROUP
    q = tl.load(q_ptr + r * stride_qn + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    length = tl.load(lens_ptr + r)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for j in range(0, tl.cdiv(length, BS)):
        block = tl.load(tables_ptr + r * stride_tn + j)
        kt = tl.load(k_ptr + h * stride_kh + block * stride_kb + d[:, None] * stride_kd + t[None, :])
        v = tl.load(v_ptr + h * stride_vh + block * stride_vb + t[:, None] * stride_vt + d[None, :])
        m, l_sum, acc = _attend_block(q, kt, v, (j * BS + t)[None, :] < length, scale, m, l_sum,
                                      acc, IEEE)
    out = acc / l_sum[:, None]
    tl.store(out_ptr + r * stride_on + (h * GROUP + g)[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, chunks_ptr, cached_ptr, out_ptr,
    stride_qn, stride_qh,
    stride_kh, stride_kb, stride_kd,
    stride_vh, stride_vb, stride_vt,
    stride_tn, stride_on,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program per (prefill chunk, query head, tile of BLOCK_M query rows). Query i of a chunk
    # sits at position num_cached + i of its request and sees every key at a position <= its own:
    # the cached prefix (chunked prefill) and the chunk up to itself. The chunk's own K/V were
    # written to the pools before this kernel runs, so all keys come from the pools.
    i = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    start = tl.load(starts_ptr + i)
    chunk = tl.load(chunks_ptr + i)
    cached = tl.load(cached_ptr + i)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < chunk
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    kv_head = h // GROUP
    q = tl.load(q_ptr + (start + rows)[:, None] * stride_qn + h * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = cached + rows
    # Keys up to the tile's last query; an empty tile (past its chunk) runs no iteration.
    kv_end = tl.where(tile * BLOCK_M < chunk, cached + tl.minimum(chunk, (tile + 1) * BLOCK_M), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for j in range(0, tl.cdiv(kv_end, BS)):
        block = tl.load(tables_ptr + i * stride_tn + j)
        kt = tl.load(k_ptr + kv_head * stride_kh + block * stride_kb + d[:, None] * stride_kd
                     + t[None, :])
        v = tl.load(v_ptr + kv_head * stride_vh + block * stride_vb + t[:, None] * stride_vt
                    + d[None, :])
        # Position 0 is visible to every query, so each row's max is finite after block 0.
        m, l_sum, acc = _attend_block(q, kt, v, (j * BS + t)[None, :] <= q_pos[:, None], scale,
                                      m, l_sum, acc, IEEE)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # an empty tile has l = 0 and no store
    tl.store(out_ptr + (start + rows)[:, None] * stride_on + h * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, lens: torch.Tensor, scale: float,
                     out: torch.Tensor) -> None:
    """Paged decode attention: each request's one query token against its cached tokens.

    Args:
        q: `[num_decodes, Hq, D]` (unit stride along D), float32, float16 or bfloat16.
        k_pool: `[Hkv, num_blocks, D, BS]`, v_pool: `[Hkv, num_blocks, BS, D]`, q's dtype, unit
            stride along their last dimension. Hq must be a multiple of Hkv.
        block_tables: `[num_decodes, max_blocks]` int32/int64; row r's first
            `ceil(lens[r] / BS)` entries are read.
        lens: `[num_decodes]` int32/int64, tokens each request attends to (>= 1).
        out: `[num_decodes, Hq * D]`, written (rows contiguous along Hq * D).
    """
    nd, hq, d = q.shape
    hkv, _, _, bs = k_pool.shape
    group = hq // hkv
    if nd == 0:
        return
    _decode_kernel[(nd, hkv)](
        q, k_pool, v_pool, block_tables, lens, out,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0), out.stride(0),
        scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BS=bs,
        IEEE=_ieee(q.dtype),
    )


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      block_tables: torch.Tensor, starts: torch.Tensor, chunks: torch.Tensor,
                      cached: torch.Tensor, max_chunk: int, scale: float, out: torch.Tensor,
                      block_m: int = 16) -> None:
    """Causal attention of every prefill chunk of the flat batch, each over its request's cached
    prefix and itself, read from the pools (the chunk's K/V must already be written).

    Args:
        q: `[num_tokens, Hq, D]`, the whole flat batch's queries (unit stride along D).
        k_pool, v_pool: as in `decode_attention`.
        block_tables: `[num_prefills, max_blocks]` int, each chunk's request's blocks.
        starts: `[num_prefills]` int, the chunk's first row in the flat batch.
        chunks: `[num_prefills]` int, its length in tokens.
        cached: `[num_prefills]` int, tokens of its request cached before the chunk.
        max_chunk: the largest chunk (sizes the grid).
        out: `[num_tokens, Hq * D]`; the chunks' rows are written, others left alone.
        block_m: query rows per program (>= 16, a power of two).
    """
    n_prefills = starts.shape[0]
    _, hq, d = q.shape
    hkv, _, _, bs = k_pool.shape
    if n_prefills == 0:
        return
    _prefill_kernel[(n_prefills, hq, triton.cdiv(max_chunk, block_m))](
        q, k_pool, v_pool, block_tables, starts, chunks, cached, out,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0), out.stride(0),
        scale,
        GROUP=hq // hkv, D=d, BS=bs, BLOCK_M=block_m, IEEE=_ieee(q.dtype),
    )


def _ieee(dtype: torch.dtype) -> bool:
    """Multiply in IEEE float32: float32 inputs, and bfloat16 under the interpreter."""
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
