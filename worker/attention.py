"""Per-request attention over the flat batch of one iteration.

Selective batching (Orca, OSDI'22, §4.2) runs every non-attention op once over the flat
`[num_tokens, hidden]` batch; attention is the one op that must split by request, because each
request attends to its own K/V. The flat batch is ordered decodes first, then prefill chunks.

The paged K/V cache (worker/kv_cache.py) keeps, per layer, `k_pool [Hkv, num_blocks, D,
block_size]` (keys transposed within a block) and `v_pool [Hkv, num_blocks, block_size, D]`.

One call per layer of the C++ kernel `shoal::paged_attention` serves the whole iteration. It reads
every request's blocks where they lie (no gather) and scores a block's 16 tokens with FMAs across
the block, the reason keys are transposed. A request brings consecutive query rows, and its last
row attends `seq_len` tokens, each earlier row one fewer:

- a **decode** is one row over its context;
- a **prefill** chunk's i-th token attends `num_cached + i + 1` tokens (the chunk's K/V are
  written first), so causal masking costs nothing and a chunk continuing a cached prefix (chunked
  prefill) reads the prefix in place. Rows go in tiles of 4, whose 4 x G queries share every key
  and value loaded.

Measured here (bfloat16, 2 threads, one layer): 64 decodes with contexts 33-320 0.8-1.0 ms, where
gathering the blocks with `index_select` and running batched matmul + softmax (the torch path,
kept as the fallback and the test oracle) cost 3.1 ms in the engine and 6-8 ms in a cold
microbenchmark. Prefill of 8 prompts against `scaled_dot_product_attention` per prompt (its CPU
flash kernel; the torch path, which gathers a cached prefix first): 64-token prompts 1.70 -> 0.75
ms, 144 tokens 5.8 -> 1.85 ms, 256 tokens 11.2 -> 5.3 ms (rows one at a time: 6.5 ms; 4-row tiles
as portable loops: 6.2 ms, GCC spilled the accumulators, hence AVX-512 written out). A 2,048-token
prefill iteration 1.46 -> 1.28 s; W64 222 -> 238 tokens/s.

The metadata is built once per iteration by `build_metadata` and shared by all layers.

Backends. How attention runs (RoPE, writing K/V, decode, prefill, the key rotation of shift-RoPE-K)
is an `AttentionBackend`; the model is written once against it. `TorchAttention` is the CPU path
above (C++ kernels where built, plain torch otherwise); `worker.kernels.TritonAttention` runs Triton
kernels and is the default on CUDA. `make_backend` picks one (`--attention-backend`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from worker import ops
from worker.config import ATTENTION_BACKENDS


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

    @cached_property
    def mask(self) -> torch.Tensor:
        """`[chunk, num_cached + chunk]` bool, True where query i (at position num_cached + i)
        may attend: every cached token and the chunk's tokens up to itself. On the block
        table's device (the K/V cache's)."""
        chunk, device = self.end - self.start, self.block_table.device
        pos = torch.arange(chunk, device=device) + self.num_cached
        return torch.arange(self.num_cached + chunk, device=device)[None, :] <= pos[:, None]


@dataclass
class AttentionMetadata:
    """What attention needs about one iteration's flat batch, built once and used by every layer.

    Attributes:
        slot_mapping: `[num_tokens]` int64, flat slot `block * block_size + offset` where each new
            token's K and V are written.
        num_decodes: rows `[0, num_decodes)` are decode tokens, one per request.
        decode_block_tables: `[num_decodes, max_blocks]` int64, each decode request's block table
            padded to `max_blocks` (padding points at block 0 and is never read as a position).
        decode_lens: `[num_decodes]` int64, each decode request's length including its new token.
        block_size: tokens per block.
        prefills: the prefill chunks, in row order after the decodes.
        device: where the tensors live (the K/V cache's device).
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_lens: torch.Tensor
    block_size: int
    prefills: list[PrefillSpan] = field(default_factory=list)
    device: torch.device = torch.device("cpu")

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """`[num_decodes, 1, max_blocks * block_size]` bool, True past each request's length
        (the torch path's mask)."""
        width = self.decode_block_tables.shape[1] * self.block_size
        return (torch.arange(width, device=self.device)[None, :]
                >= self.decode_lens[:, None]).unsqueeze(1)

    @cached_property
    def seq_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every request of the iteration (decodes, then prefill chunks) for the paged attention
        kernel: block tables `[num_seqs, max_blocks]` (zero-padded), `query_start_loc`
        `[num_seqs + 1]` (request i's query rows are `[loc[i], loc[i + 1])`) and `seq_lens`
        `[num_seqs]` (tokens attended by each request's last row), all int64."""
        width = max([self.decode_block_tables.shape[1], *(len(s.block_table) for s in self.prefills)])
        tables = torch.cat([F.pad(self.decode_block_tables,
                                  (0, width - self.decode_block_tables.shape[1])),
                            *(F.pad(s.block_table, (0, width - len(s.block_table)))[None]
                              for s in self.prefills)])
        ends = [s.end for s in self.prefills]
        starts = torch.tensor([0, *range(1, self.num_decodes + 1), *ends], dtype=torch.long)
        lens = torch.tensor([s.num_cached + s.end - s.start for s in self.prefills],
                            dtype=torch.long)
        return tables, starts.to(self.device), torch.cat([self.decode_lens, lens.to(self.device)])

    @cached_property
    def prefill_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The prefill chunks as arrays for a kernel over all of them: block tables
        `[num_prefills, max_blocks]` (zero-padded), first rows, chunk lengths and cached lengths
        `[num_prefills]` (int64), and the longest chunk in tokens."""
        spans = self.prefills
        # The spans' tables already live on the device: pad them there (no host round trip).
        tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in spans], batch_first=True)

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device)

        return (tables, column([s.start for s in spans]), column([s.end - s.start for s in spans]),
                column([s.num_cached for s in spans]),
                max((s.end - s.start for s in spans), default=0))


def build_metadata(
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefill_chunks: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build one iteration's metadata.

    Args:
        decode_tables: block table of each decode request.
        decode_lens: each decode request's length in tokens including the new token.
        prefill_chunks: per prefill request `(block_table, num_cached, chunk_len)`.
        block_size: tokens per block.
        device: the K/V cache's device.
    """
    device = torch.device(device)
    slots: list[int] = []
    for table, n in zip(decode_tables, decode_lens):
        pos = n - 1
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    prefills = []
    row = len(decode_tables)
    for table, num_cached, chunk in prefill_chunks:
        for pos in range(num_cached, num_cached + chunk):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        prefills.append(PrefillSpan(row, row + chunk, num_cached,
                                    torch.tensor(table, dtype=torch.long, device=device)))
        row += chunk
    max_blocks = max((len(t) for t in decode_tables), default=0)
    # One tensor from padded lists: a tensor per table cost ~8 us each (0.5 ms at 64 requests).
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables],
                          dtype=torch.long).view(len(decode_tables), max_blocks)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
        num_decodes=len(decode_tables),
        decode_block_tables=padded.to(device),
        decode_lens=torch.tensor(decode_lens, dtype=torch.long).to(device),
        block_size=block_size,
        prefills=prefills,
        device=device,
    )


class AttentionBackend:
    """How attention runs: RoPE, K/V writes, decode and prefill attention, key rotation.

    Subclasses implement the five primitives; `attend`, `forward` and `shift_request_kv` are
    written once on top of them (a subclass may fuse them). Pool layouts:
    `k_pool [Hkv, num_blocks, D, BS]` (keys transposed within a block),
    `v_pool [Hkv, num_blocks, BS, D]`.
    """

    name = "abstract"

    def check(self, block_size: int, head_dim: int) -> None:
        """Raise ValueError where this backend cannot serve pools of these sizes (tokens)."""

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              num_heads: int, head_dim: int) -> None:
        """Rotate the first `num_heads` heads of each row of `qkv` `[n, >= num_heads * D]` in
        place by its position (`[n]` int64); see `worker.ops.rope_`."""
        raise NotImplementedError

    def rotate_keys(self, keys: torch.Tensor, delta: int, cos_sin: torch.Tensor) -> torch.Tensor:
        """Keys `[n, Hkv, D]` that carry RoPE at positions p, made to carry it at p + delta
        (`worker.ops.rope_rotate`); may work in place and returns the result."""
        raise NotImplementedError

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store `k`, `v` `[n, Hkv, D]` at their slots (`[n]` int64, `block * BS + offset`)."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Decode attention of `q` `[num_decodes, Hq, D]` into `out` `[num_decodes, Hq * D]`."""
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor) -> None:
        """Causal attention of every prefill chunk (rows of the flat `q`, `k`, `v`) over its
        cached prefix and itself, into the chunk's rows of `out` `[num_tokens, Hq * D]`."""
        raise NotImplementedError

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
               scale: float, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """A layer's attention from its fused QKV projection `qkv` `[num_tokens, (Hq + 2 Hkv) D]`
        (contiguous): RoPE on the query and key heads in place (`rope_`), then `forward`.
        Returns `[num_tokens, Hq * D]`."""
        self.rope_(qkv, positions, cos_sin, num_heads + num_kv_heads, head_dim)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        n = qkv.shape[0]
        return self.forward(q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim),
                            v.view(n, num_kv_heads, head_dim), k_pool, v_pool, meta, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write this iteration's K/V into one layer's pools, then attend per request.

        Args:
            q: `[num_tokens, Hq, D]` queries (RoPE applied); unit stride along D.
            k, v: `[num_tokens, Hkv, D]` new keys (RoPE applied) and values.
            k_pool, v_pool: the layer's pools.
            meta: the iteration's metadata.
            scale: softmax scale, usually `D ** -0.5`.

        Returns:
            `[num_tokens, Hq * D]` in q's dtype, each row attending only to its own request's
            tokens up to and including itself.
        """
        n, hq, d = q.shape
        self.write_kv(k, v, k_pool, v_pool, meta.slot_mapping)
        out = torch.empty((n, hq * d), dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            self.decode(q[:nd], k_pool, v_pool, meta, scale, out[:nd])
        if meta.prefills:
            self.prefill(q, k, v, k_pool, v_pool, meta, scale, out)
        return out

    def shift_request_kv(self, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_table: list[int], keep: int, discard: int, length: int,
                         cos_sin: torch.Tensor) -> None:
        """Drop positions `[keep, keep + discard)` of one request's cached K/V in one layer: the
        entries at `[keep + discard, length)` move down by `discard` positions, their keys rotated
        back by `discard` (shift-RoPE-K); values are position-free and only move. No
        recomputation.

        Args:
            k_pool, v_pool: the layer's pools.
            block_table: the request's blocks, covering `length` tokens.
            keep, discard, length: tokens kept at the start, dropped after them, cached in all.
            cos_sin: the model's RoPE table (`worker.ops.rope_cos_sin`).
        """
        bs = v_pool.shape[2]
        table = torch.tensor(block_table, dtype=torch.long, device=k_pool.device)
        # Copies: the source and destination ranges overlap, so read everything first.
        keys, values = gather_request_kv(k_pool, v_pool, table, length)
        keys = keys[:, keep + discard:].transpose(0, 1).contiguous()  # [moved, Hkv, D]
        values = values[:, keep + discard:].transpose(0, 1).contiguous()
        pos = torch.arange(keep, length - discard, device=k_pool.device)
        self.write_kv(self.rotate_keys(keys, -discard, cos_sin), values, k_pool, v_pool,
                      table[pos // bs] * bs + pos % bs)


class TorchAttention(AttentionBackend):
    """The CPU path: the C++ kernels of worker/csrc where built for the dtype, plain torch
    otherwise (and on any device).

    Args:
        cpu_kernels: use the C++ kernels (`worker.ops.kernels_enabled`).
    """

    name = "torch"

    def __init__(self, cpu_kernels: bool) -> None:
        self.cpu_kernels = cpu_kernels

    def rope_(self, qkv, positions, cos_sin, num_heads, head_dim):
        ops.rope_(qkv, positions, cos_sin, num_heads, head_dim, self.cpu_kernels)

    def attend(self, qkv, positions, cos_sin, k_pool, v_pool, meta, scale, num_heads,
               num_kv_heads, head_dim):
        if not self.cpu_kernels:
            return super().attend(qkv, positions, cos_sin, k_pool, v_pool, meta, scale,
                                  num_heads, num_kv_heads, head_dim)
        # RoPE, the K/V writes and attention in one call (`shoal::attend_qkv`).
        tables, starts, lens = meta.seq_arrays
        return torch.ops.shoal.attend_qkv(qkv, positions, cos_sin, k_pool, v_pool,
                                          meta.slot_mapping, tables, starts, lens, num_heads,
                                          num_kv_heads, head_dim, scale)

    def forward(self, q, k, v, k_pool, v_pool, meta, scale):
        if not self.cpu_kernels:
            return super().forward(q, k, v, k_pool, v_pool, meta, scale)
        # Decodes and prefill chunks in one kernel call (`AttentionMetadata.seq_arrays`).
        self.write_kv(k, v, k_pool, v_pool, meta.slot_mapping)
        tables, starts, lens = meta.seq_arrays
        return torch.ops.shoal.paged_attention(q, k_pool, v_pool, tables, starts, lens, scale)

    def rotate_keys(self, keys, delta, cos_sin):
        return ops.rope_rotate(keys, delta, cos_sin)

    def write_kv(self, k, v, k_pool, v_pool, slot_mapping):
        write_kv(k, v, k_pool, v_pool, slot_mapping, self.cpu_kernels)

    def decode(self, q, k_pool, v_pool, meta, scale, out):
        if self.cpu_kernels:
            starts = torch.arange(q.shape[0] + 1)  # one query row per decode
            out.copy_(torch.ops.shoal.paged_attention(q, k_pool, v_pool, meta.decode_block_tables,
                                                      starts, meta.decode_lens, scale))
        else:
            out.copy_(decode_attention_reference(q, k_pool, v_pool, meta, scale))

    def prefill(self, q, k, v, k_pool, v_pool, meta, scale, out):
        for span in meta.prefills:
            out[span.start : span.end] = _prefill_attention(q, k, v, k_pool, v_pool, span, scale)


def make_backend(name: str, device: torch.device, cpu_kernels: bool) -> AttentionBackend:
    """The attention backend `name` ("auto", "torch" or "triton") for a model on `device`.

    "auto" is Triton on CUDA (when Triton is installed) and the torch path elsewhere.

    Raises:
        ValueError: an unknown name, or "triton" where it cannot run: Triton is not installed, or
            the device is not CUDA and `TRITON_INTERPRET=1` (Triton's interpreter, which runs the
            kernels on CPU tensors for tests) is not set.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_installed() else "torch"
    if name == "torch":
        return TorchAttention(cpu_kernels and device.type == "cpu")
    if not _triton_installed():
        raise ValueError("--attention-backend triton needs Triton (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton needs a CUDA device (or TRITON_INTERPRET=1, "
                         "set before start, to run its kernels interpreted on the CPU)")
    from worker.kernels import TritonAttention

    return TritonAttention()


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor, kernels: bool) -> None:
    """Store new keys and values `[n, Hkv, D]` at their slots (the torch path; layouts as in
    `AttentionBackend`); `kernels` runs the C++ op."""
    if kernels:
        torch.ops.shoal.write_kv(k, v, k_pool, v_pool, slot_mapping)
        return
    block_size = v_pool.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_pool.transpose(2, 3)[:, blocks, offsets] = k.transpose(0, 1)
    v_pool[:, blocks, offsets] = v.transpose(0, 1)


def decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch path of decode attention: gather every decode request's blocks, then one batched
    matmul + float32 softmax over `[num_kv_heads * num_decodes, ...]`.

    Args:
        q: `[num_decodes, num_heads, head_dim]`.

    Returns:
        `[num_decodes, num_heads * head_dim]` in q's dtype.
    """
    nd, hq, d = q.shape
    hkv, _, _, bs = k_pool.shape
    group = hq // hkv
    tables = meta.decode_block_tables
    width = tables.shape[1] * bs
    # [Hkv, nd * max_blocks, D, bs] -> [Hkv * nd, D, T]: keys transposed, one matrix per (head, request).
    kt = (k_pool.index_select(1, tables.flatten()).view(hkv, nd, -1, d, bs)
          .permute(0, 1, 3, 2, 4).reshape(hkv * nd, d, width))
    vd = v_pool.index_select(1, tables.flatten()).view(hkv * nd, width, d)
    qd = q.reshape(nd, hkv, group, d).transpose(0, 1).reshape(hkv * nd, group, d)
    scores = torch.bmm(qd, kt).float().mul_(scale)
    scores.view(hkv, nd, group, width).masked_fill_(meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vd.dtype)
    od = torch.bmm(probs, vd)  # [Hkv * nd, G, D]
    return od.view(hkv, nd, group * d).transpose(0, 1).reshape(nd, hq * d)


def gather_request_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first `num_tokens` keys and values as `[num_kv_heads, num_tokens, head_dim]`
    each (copies out of the pools)."""
    hkv, _, d, bs = k_pool.shape
    keys = k_pool.index_select(1, block_table).transpose(2, 3).reshape(hkv, -1, d)[:, :num_tokens]
    values = v_pool.index_select(1, block_table).view(hkv, -1, d)[:, :num_tokens]
    return keys, values


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    """Causal attention of one request's chunk (rows `span.start:span.end` of q, k, v) over its
    cached prefix and itself; returns `[chunk, num_heads * head_dim]` in q's dtype."""
    qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    if span.num_cached == 0:  # the whole prompt is in this chunk: its K/V are the new ones
        ks = k[span.start : span.end].transpose(0, 1)
        vs = v[span.start : span.end].transpose(0, 1)
        mask, causal = None, True
    else:
        ks, vs = gather_request_kv(k_pool, v_pool, span.block_table,
                                   span.num_cached + span.end - span.start)
        mask, causal = span.mask, False
    o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask,
                                       is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(span.end - span.start, -1)
