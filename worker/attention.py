"""Per-request attention over the flat batch of one iteration (the torch backend).

Selective batching (Orca, OSDI'22, §4.2) runs every non-attention op once over the flat
`[num_tokens, hidden]` batch; attention is the one op that must split by request, because each
request attends to its own K/V. The flat batch is ordered decodes first, then prefill chunks:

- **Decode** requests (one new token each) are attended to together: their blocks are gathered
  from the paged pools with one block-granular `index_select` per layer and K/V, then one batched
  matmul + softmax runs over `[num_kv_heads * num_decodes, block_padded_len, head_dim]`, with
  positions past each request's length masked. Measured on this CPU (bfloat16, 64 decodes,
  contexts 32-320): gather 0.7 ms and attention 0.6-0.8 ms per layer, where a Python loop of SDPA
  calls costs 6-8 ms.
- **Prefill** chunks (several new tokens) each run batched matmul + softmax over their own K/V,
  causal among the new tokens and seeing the request's cached prefix (chunked prefill). There are
  few per iteration (`max_num_batched_tokens` bounds them), so the loop is cheap.

The metadata is built once per iteration by `build_metadata` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One request's prefill chunk in the flat batch.

    Attributes:
        start, end: rows `[start, end)` of the flat batch holding the chunk's tokens.
        num_cached: tokens of this request already in the K/V cache before this chunk.
        block_table: `[num_blocks]` int64, the request's blocks (covering num_cached + chunk).
    """

    start: int
    end: int
    num_cached: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """What attention needs about one iteration's flat batch, built once and used by every layer.

    Attributes:
        slot_mapping: `[num_tokens]` int64, flat slot `block * block_size + offset` where each new
            token's K and V are written.
        num_decodes: rows `[0, num_decodes)` are decode tokens, one per request.
        decode_block_tables: `[num_decodes * max_blocks]` int64, each decode request's block table
            padded to `max_blocks` (padding points at block 0 and is masked).
        decode_mask: `[num_kv_heads * num_decodes, 1, max_blocks * block_size]` bool, True where a
            position lies past the request's length (including its new token).
        prefills: the prefill chunks, in row order after the decodes.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_mask: torch.Tensor
    prefills: list[PrefillSpan]


def build_metadata(
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefill_chunks: list[tuple[list[int], int, int]],
    block_size: int,
    num_kv_heads: int,
) -> AttentionMetadata:
    """Build one iteration's metadata.

    Args:
        decode_tables: block table of each decode request.
        decode_lens: each decode request's length in tokens including the new token.
        prefill_chunks: per prefill request `(block_table, num_cached, chunk_len)`.
        block_size: tokens per block.
        num_kv_heads: K/V heads of the model.
    """
    slots: list[int] = []
    for table, n in zip(decode_tables, decode_lens):
        pos = n - 1
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    prefills = []
    row = len(decode_tables)
    for table, num_cached, chunk in prefill_chunks:
        for pos in range(num_cached, num_cached + chunk):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        prefills.append(PrefillSpan(row, row + chunk, num_cached, torch.tensor(table)))
        row += chunk

    nd = len(decode_tables)
    max_blocks = max((len(t) for t in decode_tables), default=0)
    padded = torch.zeros((nd, max_blocks), dtype=torch.long)
    for i, t in enumerate(decode_tables):
        padded[i, : len(t)] = torch.tensor(t)
    lens = torch.tensor(decode_lens, dtype=torch.long)
    mask = torch.arange(max_blocks * block_size)[None, :] >= lens[:, None]  # [nd, T]
    mask = mask.repeat(num_kv_heads, 1).unsqueeze(1)  # [Hkv * nd, 1, T], head-major like K
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decodes=nd,
        decode_block_tables=padded.flatten(),
        decode_mask=mask,
        prefills=prefills,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this iteration's K/V into the pools, then attend per request.

    Args:
        q: `[num_tokens, num_heads, head_dim]` queries (RoPE applied).
        k, v: `[num_tokens, num_kv_heads, head_dim]` new keys (RoPE applied) and values.
        k_pool, v_pool: one layer's pools, `[num_kv_heads, num_blocks, block_size, head_dim]`.
        meta: the iteration's metadata.
        scale: softmax scale, usually `head_dim ** -0.5`.

    Returns:
        `[num_tokens, num_heads * head_dim]`, each row attending only to its own request's tokens
        up to and including itself. Same dtype as `q`.
    """
    n, hq, d = q.shape
    hkv, num_blocks, block_size, _ = k_pool.shape
    group = hq // hkv
    k_slots = k_pool.view(hkv, num_blocks * block_size, d)
    v_slots = v_pool.view(hkv, num_blocks * block_size, d)
    k_slots[:, meta.slot_mapping] = k.transpose(0, 1)
    v_slots[:, meta.slot_mapping] = v.transpose(0, 1)

    out = torch.empty((n, hq * d), dtype=q.dtype)
    nd = meta.num_decodes
    if nd:
        # [Hkv, nd * max_blocks, block_size, D] -> [Hkv * nd, T, D]: one matrix per (head, request).
        kd = k_pool.index_select(1, meta.decode_block_tables).view(hkv * nd, -1, d)
        vd = v_pool.index_select(1, meta.decode_block_tables).view(hkv * nd, -1, d)
        qd = q[:nd].view(nd, hkv, group, d).transpose(0, 1).reshape(hkv * nd, group, d)
        scores = torch.bmm(qd, kd.transpose(1, 2)).float().mul_(scale)
        scores.masked_fill_(meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vd.dtype)
        od = torch.bmm(probs, vd)  # [Hkv * nd, G, D]
        out[:nd] = od.view(hkv, nd, group * d).transpose(0, 1).reshape(nd, hq * d)

    for span in meta.prefills:
        total = span.num_cached + (span.end - span.start)
        if span.num_cached == 0:  # whole prompt in this chunk: its K/V are the new ones
            ks = k[span.start : span.end].transpose(0, 1)
            vs = v[span.start : span.end].transpose(0, 1)
        else:
            ks = k_pool.index_select(1, span.block_table).view(hkv, -1, d)[:, :total]
            vs = v_pool.index_select(1, span.block_table).view(hkv, -1, d)[:, :total]
        out[span.start : span.end] = _prefill_attention(q[span.start : span.end], ks, vs,
                                                        span.num_cached, scale)
    return out


PREFILL_QUERY_BLOCK = 256  # query rows per score matrix: bounds memory at [Hq, 256, T] floats


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                       scale: float) -> torch.Tensor:
    """Causal attention of one request's chunk.

    Batched matmul + float32 softmax, queries grouped by K/V head (`[Hkv, G * rows, D]` against
    `[Hkv, T, D]`), so no K/V head is repeated. Measured on a 2,048-token prefill here: SDPA's CPU
    flash kernel took 26% of the step (math fallback with GQA: 33%), this path about 5%.

    Args:
        q: `[L, Hq, D]` the chunk's queries; query i sits at position `num_cached + i`.
        k, v: `[Hkv, num_cached + L, D]` the request's keys and values up to the chunk's end.
        num_cached: tokens before the chunk.
        scale: softmax scale.

    Returns:
        `[L, Hq * D]` in q's dtype.
    """
    length, hq, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    out = torch.empty((length, hq * d), dtype=q.dtype)
    for i0 in range(0, length, PREFILL_QUERY_BLOCK):
        i1 = min(length, i0 + PREFILL_QUERY_BLOCK)
        rows, keys = i1 - i0, num_cached + i1  # later keys are masked for every row of the block
        qb = q[i0:i1].view(rows, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * rows, d)
        scores = torch.bmm(qb, k[:, :keys].transpose(1, 2)).float().mul_(scale)
        pos = torch.arange(i0, i1) + num_cached
        future = torch.arange(keys)[None, :] > pos[:, None]  # [rows, keys]
        scores.view(hkv, group, rows, keys).masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        ob = torch.bmm(probs, v[:, :keys])  # [Hkv, G * rows, D]
        out[i0:i1] = ob.view(hkv, group, rows, d).permute(2, 0, 1, 3).reshape(rows, hq * d)
    return out
