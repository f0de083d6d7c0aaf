"""The paged K/V cache: preallocated pools of fixed-size blocks and the allocator that hands them out.

Layout. Each layer has a K pool `[num_kv_heads, num_blocks, head_dim, block_size]` and a V pool
`[num_kv_heads, num_blocks, block_size, head_dim]`. A block of one head is contiguous, and keys are
stored transposed within their block so the decode kernel scores a block's tokens with FMAs across
the block instead of one horizontal reduction per token (see worker/attention.py).

Accounting follows vLLM's PagedAttention (Kwon et al., SOSP'23, §4.2): a request owns the blocks
listed in its block table; `num_free_blocks` / `num_total_blocks` are what the worker advertises and
what the scheduler places requests by. With prefix caching, requests whose prompts begin alike
share the blocks of that beginning, and blocks no request owns keep their K/V until evicted
(`BlockAllocator`); they count as free.
"""

from __future__ import annotations

import heapq
import os
from collections import OrderedDict

import torch

from worker.config import ModelConfig


class KVCacheFullError(RuntimeError):
    """Not enough free K/V blocks for an allocation. Nothing was allocated; the caller decides
    whether to refuse the request or preempt another one."""


class BlockAllocator:
    """Hands out block ids `0 .. num_blocks - 1` and keeps the prefix cache's index over them.

    A block is free, or owned by one or more requests (a reference count: requests whose
    prompts begin alike share the blocks of that beginning, `lookup` / `share`), or cached: owned
    by none but still holding the K/V of a registered block hash, so that a later request with
    that prefix can take it back. Cached blocks count as free; an allocation takes plain free
    blocks first and then evicts the least recently freed cached ones (vLLM's automatic prefix
    caching: Kwon et al., SOSP'23, §4.4 "shared prefix"; vLLM v1 `BlockPool`).

    The lowest free ids go first (a min-heap), so the blocks a prefill takes together come out
    ascending and, where the free space allows, adjacent, and the blocks in use stay packed at the
    bottom of the pools. Reusing the last freed block first (LIFO) handed a new request the blocks
    of earlier ones in the order those had finished, scattered over everything used before: decode
    attention, which reads each request's blocks in turn, then ran 17% slower (batch 48, 180-token
    contexts, 2-core Xeon: 384 us a layer with each request's blocks adjacent, 448 scattered over
    the blocks in use, 635 over the whole pool), and W64 repeated on one engine (a worker's life)
    went from 730-742 to 801-813 tokens/s (medians of 7 runs after the first, A/B in turns).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a K/V cache needs at least one block, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a heap: sorted is one
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # block hash -> the block holding it
        self._hash_of: dict[int, bytes] = {}  # and back
        # Cached blocks no request owns, least recently freed first: evicted in that order.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: plain free ones and cached ones no request owns."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, owned or not."""
        return len(self._block_of)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, evicting cached ones once no plain free block is left.

        Raises:
            KVCacheFullError: fewer than `n` blocks are free (nothing is taken).
        """
        if n > self.num_free_blocks:
            raise KVCacheFullError(f"need {n} K/V blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = heapq.heappop(self._free)
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block no request owns any longer becomes cached
        (if registered) or free. Free a request's table last block first: its tail, the part
        least likely shared, is then evicted first.

        Raises:
            ValueError: a block no request owns (a double free would let two requests write it).
        """
        for b in blocks:
            if self._refs[b] == 0:
                raise ValueError(f"K/V block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    heapq.heappush(self._free, b)

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that `block` (owned) holds the K/V of the prefix `block_hash` names. A hash
        already held by another block (two requests computed the same prefix at once) keeps
        that block; this one stays private and is freed as usual."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of `block_hashes`, from the first, that the
        cache holds. Nothing is taken: `share` them."""
        blocks = []
        for h in block_hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add a reference to each of `blocks` (cached ones from `lookup`), taking those no
        request owned out of the eviction order."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def ref_count(self, block: int) -> int:
        """How many requests own `block`."""
        return self._refs[block]

    def reset_prefix_cache(self) -> None:
        """Forget every registered block: cached blocks become plain free ones, owned blocks stay
        with their requests and are freed as private ones."""
        for b in self._evictable:
            heapq.heappush(self._free, b)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * elem


def available_memory_bytes() -> int:
    """Memory the OS can give us now (MemAvailable), in bytes; total RAM where it is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class KVCache:
    """K and V pools for every layer plus their block allocator.

    Attributes:
        k: per layer, `[num_kv_heads, num_blocks, head_dim, block_size]` in the engine dtype.
        v: per layer, `[num_kv_heads, num_blocks, block_size, head_dim]`.
        allocator: the block allocator.
        block_size: tokens per block.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        k_shape = (cfg.num_kv_heads, num_blocks, cfg.head_dim, block_size)
        v_shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        # Zeroed, not empty: the torch path reads padded block-table entries (real, unused blocks)
        # and multiplies their masked-out scores by the values; garbage NaNs there would poison it.
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @staticmethod
    def num_blocks_for(
        cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_bytes: int | None,
        memory_fraction: float, device: torch.device | str = "cpu",
    ) -> int:
        """Blocks that fit in `kv_cache_bytes`, or in `memory_fraction` of the memory available
        on `device` (the OS's for the CPU, the driver's free memory for CUDA).

        Raises:
            ValueError: the budget holds not even one block.
        """
        if kv_cache_bytes is not None:
            budget = kv_cache_bytes
        elif torch.device(device).type == "cuda":
            budget = int(torch.cuda.mem_get_info(torch.device(device))[0] * memory_fraction)
        else:
            budget = int(available_memory_bytes() * memory_fraction)
        per_block = bytes_per_block(cfg, block_size, dtype)
        if budget < per_block:
            raise ValueError(f"a K/V cache of {budget} bytes holds no block; one block of "
                             f"{block_size} tokens takes {per_block} bytes")
        return budget // per_block

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to `block_table` so that it holds `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend `block_table` in place to hold `num_tokens` tokens.

        Raises:
            KVCacheFullError: not enough free blocks (the table is unchanged).
        """
        n = self.blocks_needed(block_table, num_tokens)
        if n:
            block_table.extend(self.allocator.allocate(n))

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Free the blocks of `block_table` past those holding `num_tokens` tokens."""
        keep = -(-num_tokens // self.block_size)
        if len(block_table) > keep:
            self.allocator.free(block_table[keep:])
            del block_table[keep:]

    def release(self, block_table: list[int]) -> None:
        """Free every block of `block_table` (the last first: `BlockAllocator.free`) and empty
        it."""
        self.allocator.free(block_table[::-1])
        block_table.clear()
