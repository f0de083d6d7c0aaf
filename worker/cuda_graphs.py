"""CUDA graphs for the decode iterations of a GPU worker.

A decode iteration of SmolLM2 launches about 300 kernels from Python (per layer: norm, QKV, RoPE,
K/V write, attention, O, norm, gate/up, SwiGLU, down). At batch 1 the GPU finishes each before
the host has launched the next: the lent H200 decoded one stream at 119.8 tokens/s, about what a
2-core CPU does (docs/benchmarks.md, session 25). A CUDA graph records a whole forward pass once
and replays it with one launch.

As in vLLM's CUDA graph runner, decode-only iterations are captured at a ladder of batch sizes
(1, 2, 4, then multiples of 8 up to `max_num_seqs`); an iteration of B requests replays the
smallest captured size >= B with rows B.. as padding. A graph replays fixed addresses and fixed
shapes, so every input lives in one static device buffer that each iteration overwrites:

    [4, max_batch] int64 header: input ids, positions, slots, lengths
    [max_batch, max_blocks] int64 block tables

Padding rows have input id 0, position 0, length 1 and slot -1, which the Triton K/V write skips
(worker/kernels/cache.py): they attend to one token of block 0 and write nothing. Prefill and
mixed iterations, drafts (speculative decoding) and tensor parallelism run eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from worker.attention import AttentionMetadata
from worker.kv_cache import KVCache
from worker.model import LlamaModel

log = logging.getLogger(__name__)

_ID, _POSITION, _SLOT, _LEN = range(4)  # rows of the header


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured for `max_num_seqs`: 1, 2, 4, multiples of 8 below it, and
    itself."""
    ladder = [1, 2, 4, *range(8, max_num_seqs, 8)]
    return sorted({s for s in ladder if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """One captured forward pass per decode batch size, replayed with padded static inputs.

    Args:
        model: the model (CUDA, the triton attention backend, no tensor parallelism).
        kv_cache: its K/V cache; graphs read and write the pools where they lie.
        max_num_seqs: the largest decode batch (requests).
        max_model_len: the longest request in tokens; block tables hold
            `ceil(max_model_len / block_size)` blocks.
        capture: record CUDA graphs (False runs the same padded forward eagerly on the static
            buffers: the CPU tests' way to check padding and staging without a GPU).

    Raises:
        ValueError: the attention backend is not triton (its K/V write skips padding slots).
    """

    def __init__(self, model: LlamaModel, kv_cache: KVCache, max_num_seqs: int,
                 max_model_len: int, capture: bool = True) -> None:
        if model.attention.name != "triton":
            raise ValueError("CUDA graphs need the triton attention backend, got "
                             f"{model.attention.name}")
        self.model, self.kv_cache, self.capture = model, kv_cache, capture
        self.sizes = batch_sizes(max_num_seqs)
        self.block_size = kv_cache.block_size
        n, width = self.sizes[-1], -(-max_model_len // self.block_size)
        self.max_blocks = width
        device = model.device
        # Staged on the host (pinned, so the copy is one DMA), then copied in one piece.
        self._host = torch.zeros(4 * n + n * width, dtype=torch.long,
                                 pin_memory=device.type == "cuda")
        self._static = torch.zeros_like(self._host, device=device)
        self._host_header = self._host[: 4 * n].numpy().reshape(4, n)
        self._host_tables = self._host[4 * n:].numpy().reshape(n, width)
        header = self._static[: 4 * n].view(4, n)
        self._tables = self._static[4 * n:].view(n, width)
        self._ids, self._positions, self._slots, self._lens = header
        self._pad(0, n)
        self._static.copy_(self._host)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # iterations served (tests read it)
        if capture:
            self._capture()

    def _pad(self, start: int, end: int) -> None:
        """Make header rows `[start, end)` padding (written nowhere, attending to one token)."""
        h = self._host_header
        h[_ID, start:end], h[_POSITION, start:end] = 0, 0
        h[_SLOT, start:end], h[_LEN, start:end] = -1, 1

    def _forward(self, size: int) -> torch.Tensor:
        """The model's forward over the first `size` static rows: `[size, hidden]` float32."""
        meta = AttentionMetadata(
            slot_mapping=self._slots[:size], num_decodes=size,
            decode_block_tables=self._tables[:size], decode_lens=self._lens[:size],
            block_size=self.block_size, device=self._static.device)
        return self.model.forward(self._ids[:size], self._positions[:size], meta, self.kv_cache)

    def _capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first, all in one memory pool: a smaller graph reuses the larger's blocks (only
        # one graph runs at a time, and its output is read before the next replay).
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the Triton kernels and warms the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs for decode batches of 1-%d in %.1f s",
                 len(self.sizes), self.sizes[-1], time.perf_counter() - start)

    def fits(self, num_decodes: int, max_table_len: int) -> bool:
        """Whether a decode-only iteration of `num_decodes` requests whose longest block table
        has `max_table_len` blocks can replay a graph."""
        return 0 < num_decodes <= self.sizes[-1] and max_table_len <= self.max_blocks

    def run(self, token_ids: list[int], tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """One decode iteration: request r feeds `token_ids[r]` at position `lens[r] - 1`.

        Args:
            token_ids: each request's newest token.
            tables: each request's block table (blocks), covering `lens[r]` tokens.
            lens: each request's length in tokens including its new token.

        Returns:
            `[len(token_ids), hidden]` float32 final hidden states (before the last RMSNorm), a
            view of the graph's output: read it before the next `run`.
        """
        b = len(token_ids)
        size = next(s for s in self.sizes if s >= b)
        h, bs = self._host_header, self.block_size
        pos = np.asarray(lens, dtype=np.int64) - 1
        h[_ID, :b], h[_POSITION, :b], h[_LEN, :b] = token_ids, pos, lens
        last_blocks = [t[p // bs] for t, p in zip(tables, pos.tolist())]
        h[_SLOT, :b] = np.asarray(last_blocks, dtype=np.int64) * bs + pos % bs
        self._pad(b, size)
        for r, t in enumerate(tables):
            self._host_tables[r, : len(t)] = t
        # Header and the first `size` table rows; the engine's previous iteration ended with a
        # host sync (its sampled tokens), so the graph is not still reading the buffer.
        n = 4 * self.sizes[-1] + size * self.max_blocks
        self._static[:n].copy_(self._host[:n], non_blocking=True)
        self.replays += 1
        if not self.capture:
            return self._forward(size)[:b]
        self._graphs[size].replay()
        return self._outputs[size][:b]
