"""Prefix-cache keys of a request's tokens, shared by the worker (which caches K/V blocks under
them) and the scheduler (which places a request where its prefix is likely cached). A leaf
module."""

from __future__ import annotations

import hashlib
from array import array

from shoal.sampling_params import SamplingParams


def block_hashes(token_ids: list[int], block_size: int, salt: str | None = None,
                 parents: list[bytes] = ()) -> list[bytes]:
    """The prefix cache's keys of every full block of `token_ids`: a chain, each block's hash
    covering its tokens and the hash before it, so equal hashes mean equal prefixes (position 0
    on). `parents` are hashes already computed for the first blocks (extended, not recomputed);
    `salt` (the request's `cache_salt`) enters the first block's, so only requests with the
    same salt share. SHA-256, not Python's hash: a crafted collision would hand one request
    another's K/V (as vLLM found, CVE-2025-25183).

    Returns:
        `len(token_ids) // block_size` hashes of 32 bytes.
    """
    out = list(parents)
    for j in range(len(out), len(token_ids) // block_size):
        # The first block's parent is the salt's own digest: every message is then 32 bytes of
        # digest and the tokens, so no salt can pose as the hash of a block before it.
        parent = out[-1] if out else hashlib.sha256(b"shoal cache salt\0" +
                                                    (salt or "").encode()).digest()
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids[j * block_size:(j + 1) * block_size]).tobytes())
        out.append(h.digest())
    return out


def prefix_salt(params: SamplingParams) -> str | None:
    """What keeps a request's cached blocks apart from others' (`block_hashes`' salt): its
    `cache_salt`, and its LoRA adapter, whose K/V differ from the base model's for the same
    tokens."""
    if params.lora_name is None:
        return params.cache_salt
    return f"{params.cache_salt or ''}\0lora\0{params.lora_name}"


def lookup_hashes(token_ids: list[int], block_size: int, params: SamplingParams) -> list[bytes]:
    """The keys a request is looked up by when it starts: its full blocks but the one holding
    its last token (whose logits it needs, so that token is always computed); none for a
    request that may run past the context window, whose blocks are never cached (its shifts
    rewrite them in place)."""
    if params.context_overflow != "error":
        return []
    full = (len(token_ids) - 1) // block_size * block_size
    return block_hashes(token_ids[:full], block_size, prefix_salt(params))
