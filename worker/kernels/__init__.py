"""Triton kernels for GPU workers: the attention backend `TritonAttention`.

On a GPU, the per-request attention of selective batching must not be a Python loop over requests:
decode runs one kernel over every decode request of the iteration, prefill one kernel over every
prefill chunk, each reading the paged K/V cache through block tables (worker/kernels/attention.py);
K/V writes and RoPE are kernels too (worker/kernels/cache.py).

The kernels run on CUDA. With `TRITON_INTERPRET=1` set before Triton is imported, Triton's
interpreter runs them on CPU tensors (slowly, with numpy): that is how CI proves them against the
torch path on a machine without a GPU.

Importing this package imports Triton; `worker.attention.make_backend` imports it only when the
triton backend is chosen.
"""

from __future__ import annotations

import torch

from worker.attention import AttentionBackend, AttentionMetadata
from worker.kernels import attention, cache

MIN_BLOCK_SIZE = 16  # tl.dot needs every dimension >= 16 on a GPU


class TritonAttention(AttentionBackend):
    """Attention as Triton kernels (the default on CUDA).

    The pools must have a block size and head dim that are powers of two and >= 16 (`check`).
    """

    name = "triton"

    def check(self, block_size, head_dim):
        for what, x in (("--block-size", block_size), ("the head dim", head_dim)):
            if x < MIN_BLOCK_SIZE or x & (x - 1):
                raise ValueError(f"the triton attention backend needs {what} to be a power of "
                                 f"two >= {MIN_BLOCK_SIZE}, got {x}")

    def rope_(self, qkv, positions, cos_sin, num_heads, head_dim):
        cache.rope_(qkv, positions, cos_sin, num_heads, head_dim)

    def rotate_keys(self, keys, delta, cos_sin):
        n = keys.shape[0]
        positions = torch.full((n,), abs(delta), dtype=torch.long, device=keys.device)
        cache.rope_(keys, positions, cos_sin, keys.shape[1], keys.shape[2],
                    sign=1.0 if delta >= 0 else -1.0)
        return keys

    def write_kv(self, k, v, k_pool, v_pool, slot_mapping):
        cache.write_kv(k, v, k_pool, v_pool, slot_mapping)

    def decode(self, q, k_pool, v_pool, meta: AttentionMetadata, scale, out):
        attention.decode_attention(q, k_pool, v_pool, meta.decode_block_tables, meta.decode_lens,
                                   scale, out)

    def prefill(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, scale, out):
        tables, starts, chunks, cached, max_chunk = meta.prefill_arrays
        attention.prefill_attention(q, k_pool, v_pool, tables, starts, chunks, cached, max_chunk,
                                    scale, out)

