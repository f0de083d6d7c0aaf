"""Perplexity of a text under the engine's model, on the two paths quantization changes.

`decode_perplexity` feeds the text one token per iteration (teacher forcing): every projection
runs on a single row, the path of single-stream decode and of weight-only `--quantization`
(worker/linear.py). `prefill_perplexity` feeds it as one prompt: projections run on many rows, the
path of prefill and of `--quantization w8a8`'s int8 activations. Perplexity is
`exp(-mean log p(x_i | x_<i))` over the tokens after the first (Jelinek et al. 1977).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from shoal.messages import IterationPlan, NewRequest
from shoal.sampling_params import SamplingParams
from worker.attention import build_metadata
from worker.engine import Engine

# Long English prose that ships with Debian and Ubuntu (package base-files).
REFERENCE_TEXT = Path("/usr/share/common-licenses/GPL-3")


def reference_text() -> str:
    """The text perplexity is reported on (`REFERENCE_TEXT`).

    Raises:
        FileNotFoundError: the file is not on this machine.
    """
    return REFERENCE_TEXT.read_text(encoding="utf-8")


@torch.inference_mode()
def decode_perplexity(engine: Engine, token_ids: list[int]) -> float:
    """Perplexity of `token_ids` (at least 2, at most the engine's window), one token per iteration.

    Uses the engine's model and K/V cache directly (its blocks are returned at the end); the
    engine must have no running requests.

    Raises:
        ValueError: fewer than 2 tokens, more than the window, or requests are running.
    """
    if len(token_ids) < 2 or len(token_ids) > engine.max_model_len:
        raise ValueError(f"need 2 to {engine.max_model_len} tokens, got {len(token_ids)}")
    if engine.running:
        raise ValueError("decode_perplexity needs an idle engine")
    model, cache = engine.model, engine.kv_cache
    table: list[int] = []
    nll = 0.0
    try:
        for i in range(len(token_ids) - 1):
            cache.grow(table, i + 1)
            meta = build_metadata([table], [i + 1], [], cache.block_size, model.device)
            hidden = model.forward(torch.tensor([token_ids[i]], device=model.device),
                                   torch.tensor([i], device=model.device), meta, cache)
            logits, _ = model.compute_logits(hidden)
            nll -= torch.log_softmax(logits[0], dim=-1)[token_ids[i + 1]].item()
    finally:
        cache.release(table)
    return math.exp(nll / (len(token_ids) - 1))


@torch.inference_mode()
def prefill_perplexity(engine: Engine, token_ids: list[int]) -> float:
    """Perplexity of `token_ids` (at least 2, at most the engine's window and
    `max_num_batched_tokens`) fed as one prompt in one iteration, logits at every position.

    Uses the engine's model and K/V cache directly (its blocks are returned at the end); the
    engine must have no running requests.

    Raises:
        ValueError: a length outside those bounds, or requests are running.
    """
    n = len(token_ids)
    if n < 2 or n > min(engine.max_model_len, engine.cfg.max_num_batched_tokens):
        raise ValueError(f"need 2 to {min(engine.max_model_len, engine.cfg.max_num_batched_tokens)}"
                         f" tokens, got {n}")
    if engine.running:
        raise ValueError("prefill_perplexity needs an idle engine")
    model, cache = engine.model, engine.kv_cache
    table: list[int] = []
    try:
        cache.grow(table, n)
        meta = build_metadata([], [], [(table, 0, n)], cache.block_size, model.device)
        hidden = model.forward(torch.tensor(token_ids, device=model.device),
                               torch.arange(n, device=model.device), meta, cache)
        logits, _ = model.compute_logits(hidden[:-1])
    finally:
        cache.release(table)
    targets = torch.tensor(token_ids[1:], device=logits.device)
    return math.exp(torch.nn.functional.cross_entropy(logits.float(), targets).item())


def teacher_force(engine: Engine, params: dict[str, SamplingParams], token_ids: list[int],
                  on_step: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
    """Run requests through the engine over a fixed token sequence (teacher forcing).

    Every request starts from `token_ids[0]` and, after each iteration, its sampled token is
    replaced by the sequence's next one, so all of them see the same text while the engine does
    everything else as usual (chunked prefill, context overflow, K/V accounting).
    `on_step(i, logits)` receives, for each i >= 1, each request's float32 logits `[vocab]`
    that predicted `token_ids[i]`.

    Args:
        params: request id -> its sampling parameters (max_tokens, temperature and ignore_eos
            are overridden).
    """
    engine.keep_logits = True
    n = len(token_ids)
    admit = [NewRequest(rid, token_ids[:1], replace(p, max_tokens=n - 1, temperature=0.0,
                                                    ignore_eos=True, min_tokens=0))
             for rid, p in params.items()]
    engine.step(IterationPlan(admit=admit))
    try:
        for i in range(1, n):
            on_step(i, {rid: engine.last_logits[rid] for rid in params})
            if i == n - 1:
                break
            for rid in params:
                engine.running[rid].token_ids[-1] = token_ids[i]
            engine.step()
    finally:
        for rid in params:
            engine.release(rid)
