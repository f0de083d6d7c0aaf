"""The selective-batching engine: one `step` is one iteration over every request it runs.

`Engine.step(plan)` applies the plan's releases and admissions, chooses the tokens of this
iteration (every decode, then prefill chunks FCFS within `max_num_batched_tokens`: chunked
prefill), grows block tables, runs the model once over the flat batch, samples, and retires
finished requests, freeing their K/V blocks at once (Orca, OSDI'22, §4.1: iteration-level
scheduling; §4.2: selective batching). With prefix caching, a request that has not started takes
the cached blocks of the longest prefix of full blocks it shares with earlier requests and
prefills only the rest; the blocks each iteration fills are registered for later ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shoal.messages import IterationPlan, IterationResult, NewRequest, TokenOutput
from shoal.prefix_hash import block_hashes, lookup_hashes, prefix_salt
from shoal.sampling_params import SamplingParams
from worker.attention import build_metadata
from worker.config import EngineConfig, ModelConfig, SpeculativeConfig, default_device
from worker.kv_cache import KVCache, KVCacheFullError
from worker.loader import load_model
from worker.lora import LoRAAdapter, LoRABatch, LoRAError, load_adapter
from worker.model import LlamaModel
from worker.sampler import Sampler, skip_draws
from worker.speculative import propose_ngram
from worker.structured_output import (
    GrammarMasks,
    InvalidStructuredOutput,
    PendingMasks,
    advance,
    constrained_from,
)

__all__ = ["Engine", "InvalidRequestError", "KVCacheFullError", "Sequence"]


class InvalidRequestError(ValueError):
    """A request the engine cannot run (empty or over-long prompt, unknown token id, duplicate id)."""


@dataclass
class Sequence:
    """One request's state inside the engine.

    Attributes:
        request_id: the request.
        token_ids: prompt followed by every generated token.
        num_prompt_tokens: length of the prompt.
        params: sampling parameters.
        generator: the request's own random stream (None when greedy).
        block_table: K/V blocks owned by the request, in position order.
        num_computed_tokens: tokens of the context whose K/V are in the cache.
        num_discarded: tokens dropped from the context after the first `params.n_keep` when
            it overflowed the window (`params.context_overflow`); the context is
            `token_ids[:n_keep] + token_ids[n_keep + num_discarded:]`, positions renumbered.
        caches_prefix: the request reads and fills the prefix cache (the engine's
            `enable_prefix_caching`, and a request that never drops tokens from its context:
            the shifts of `context_overflow` rewrite blocks in place).
        block_hashes: prefix-cache keys of the first full blocks of `token_ids`
            (`shoal.prefix_hash.block_hashes`), as far as computed; None before its first
            lookup.
        num_registered_blocks: leading blocks of `block_table` taken from or entered into the
            prefix cache.
        num_cached_tokens: tokens it found in the prefix cache when it started.
        draft_token_ids: speculative tokens proposed for it in this iteration (checked by the
            forward pass after its last token; empty between iterations).
        matcher: with a `structured_output`, its llguidance matcher after the tokens generated
            so far (worker.structured_output); else None, and None while the constraint has
            not started (`structured_output_after`).
        bad_words: its `bad_words_token_ids` by the token before their last (None for words of
            one token), so that a step looks only at the words the last token may be part of
            (`_bad_word_ends`); None without bad words.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_discarded: int = 0
    caches_prefix: bool = False
    block_hashes: list[bytes] | None = None
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    matcher: Any = None
    bad_words: dict[int | None, list[tuple[int, ...]]] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def context_len(self) -> int:
        """Tokens the model attends over: all of them, less those discarded."""
        return len(self.token_ids) - self.num_discarded

    def context_ids(self) -> list[int]:
        if not self.num_discarded:
            return self.token_ids
        keep = self.params.n_keep
        return self.token_ids[:keep] + self.token_ids[keep + self.num_discarded:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.context_len - self.num_computed_tokens


class Engine:
    """One worker's model, K/V cache, sampler and running requests.

    Args:
        model_cfg: the model's shape.
        weights: its tensors (worker.loader), already in `cfg.dtype`.
        cfg: engine knobs.
        keep_logits: keep each iteration's logits in `last_logits` (tests compare them).
        tp: rank 0 of a tensor-parallel group (worker.parallel), whose followers run every
            forward pass with it; `model_cfg` and `weights` are then rank 0's shard, and
            `--kv-cache-bytes` is each rank's budget for its K/V heads.
        model_path: the model file or directory, whose tokenizer structured outputs are
            compiled against; None refuses requests with a `structured_output`.
    """

    def __init__(
        self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor], cfg: EngineConfig,
        keep_logits: bool = False, tp=None, model_path: Path | None = None,
    ) -> None:
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.max_model_len, self.model, self.kv_cache = self.build_parts(model_cfg, weights, cfg,
                                                                         tp)
        if tp is not None and tp.world_size > 1:
            from worker.parallel import TensorParallelLeader

            self.model = TensorParallelLeader(self.model)
        self.device = self.model.device
        # Decode iterations replay CUDA graphs (worker.cuda_graphs) on a GPU unless told not to.
        self.decode_graphs = None
        if (self.device.type == "cuda" and not cfg.enforce_eager and tp is None
                and self.model.attention.name == "triton"):
            from worker.cuda_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, cfg.max_num_seqs,
                                              self.max_model_len)
        # LoRA adapters by name (worker.lora), served beside the base model.
        self.loras: dict[str, LoRAAdapter] = {}
        self._tensor_parallel = tp is not None
        for name, path in cfg.lora_modules:
            self.add_lora(name, path)
        self.sampler = Sampler(kernels=self.model.kernels)
        self.grammars = GrammarMasks(model_path, model_cfg.vocab_size, model_cfg.eos_token_id,
                                     self.model.kernels)
        self.running: dict[str, Sequence] = {}
        self.keep_logits = keep_logits
        self.last_logits: dict[str, torch.Tensor] = {}
        # Tokens of starting requests looked up in the prefix cache, and those found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Speculative decoding: draft tokens checked, and those the model kept.
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        # Iterations that computed tokens, and their wall time in seconds (`step_seconds`): what
        # the worker's `shoal_engine_step_seconds` histogram counts; and the same of the
        # decode-only ones (its "decode" series): in a fleet, the iterations that run while the
        # gateway streams out the tokens of the one before.
        self.iterations = 0
        self.iteration_seconds = 0.0
        self.decode_iterations = 0
        self.decode_iteration_seconds = 0.0

    @staticmethod
    def build_parts(model_cfg: ModelConfig, weights: dict[str, torch.Tensor], cfg: EngineConfig,
                    tp=None) -> tuple[int, LlamaModel, KVCache]:
        """The context window (tokens), the model and the K/V cache an engine runs; a
        tensor-parallel follower builds its own the same way.

        Raises:
            ValueError: a device, attention backend or block size that cannot serve.
        """
        max_model_len = min(cfg.max_model_len or model_cfg.max_position_embeddings,
                            model_cfg.max_position_embeddings)
        model = LlamaModel(model_cfg, weights, max_model_len, cfg.quantization, cfg.fast_paths,
                           cfg.device or default_device(), cfg.attention_backend, tp)
        model.attention.check(cfg.block_size, model_cfg.head_dim)
        num_blocks = KVCache.num_blocks_for(model_cfg, cfg.block_size, cfg.dtype,
                                            cfg.kv_cache_bytes, cfg.kv_cache_memory_fraction,
                                            model.device)
        if tp is not None:
            num_blocks = tp.agree_min(num_blocks)  # every rank's pools hold the same blocks
        return max_model_len, model, KVCache(model_cfg, num_blocks, cfg.block_size, cfg.dtype,
                                             model.device)

    @classmethod
    def from_path(cls, path: Path, cfg: EngineConfig, **kw) -> Engine:
        """Load a model (GGUF file or Hugging Face directory) and build an engine around it."""
        model_cfg, weights = load_model(path, cfg.dtype)
        return cls(model_cfg, weights, cfg, model_path=path, **kw)

    @property
    def structured_output_rows(self) -> int:
        """Sampling rows masked by structured outputs so far."""
        return self.grammars.rows

    @property
    def structured_output_mask_seconds(self) -> float:
        """Seconds iterations spent waiting for structured outputs' masks and applying them."""
        return self.grammars.seconds

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_cache.num_total_blocks

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.cfg.block_size)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, req: NewRequest) -> Sequence:
        """Admit a request; it runs from the next `step`.

        Raises:
            InvalidRequestError: empty prompt, a token id outside the vocabulary, a prompt that
                leaves no room in the context window, a request id already running, or a
                structured output that does not compile or that its output so far breaks.
        """
        tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
        if not req.prompt_token_ids:
            raise InvalidRequestError(f"request {req.request_id}: the prompt is empty")
        if req.request_id in self.running:
            raise InvalidRequestError(f"request {req.request_id} is already running")
        vocab = self.model_cfg.vocab_size
        named = [t for t, _ in req.params.logit_bias] + list(req.params.allowed_token_ids) + [
            t for word in req.params.bad_words_token_ids for t in word]
        if any(t < 0 or t >= vocab for t in tokens) or any(t >= vocab for t in named):
            raise InvalidRequestError(
                f"request {req.request_id}: token ids (of the prompt, the output, logit_bias, "
                f"allowed_token_ids and bad words) must be in [0, {vocab})"
            )
        p = req.params
        overflow = p.context_overflow != "error"
        if len(req.prompt_token_ids) >= self.max_model_len or (len(tokens) >= self.max_model_len
                                                               and not overflow):
            raise InvalidRequestError(
                f"request {req.request_id}: {len(tokens)} tokens leave no room in the context "
                f"window of {self.max_model_len} tokens"
            )
        if overflow and p.n_keep + self.n_discard(p) > self.max_model_len - 2:
            raise InvalidRequestError(
                f"request {req.request_id}: n_keep {p.n_keep} + n_discard {self.n_discard(p)} "
                f"must leave room in the window of {self.max_model_len} tokens")
        gen = None
        if not req.params.greedy:
            gen = torch.Generator()
            if req.params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(req.params.seed)
                # Resumed (preempted or moved): go on from where its tokens left the stream.
                skip_draws(gen, len(req.output_token_ids))
        # Prompt logprobs need every prompt token computed here: no prefix-cache hits.
        seq = Sequence(req.request_id, tokens, len(req.prompt_token_ids), req.params, gen,
                       caches_prefix=(self.cfg.enable_prefix_caching and not overflow
                                      and p.prompt_logprobs is None))
        if p.bad_words_token_ids:
            seq.bad_words = _bad_word_index(p.bad_words_token_ids)
        while overflow and seq.context_len >= self.max_model_len:  # a migrated long request
            seq.num_discarded += self.n_discard(p)
        if p.lora_name is not None and p.lora_name not in self.loras:
            raise InvalidRequestError(
                f"request {req.request_id}: LoRA adapter {p.lora_name!r} is not loaded here "
                f"({', '.join(self.loras) or 'none is'}; --lora-modules)")
        start = constrained_from(req.output_token_ids, p.structured_output_after)
        if p.structured_output is not None and start is not None:
            try:
                seq.matcher = self.grammars.matcher(p.structured_output,
                                                    req.output_token_ids[start:])
            except InvalidStructuredOutput as e:
                raise InvalidRequestError(f"request {req.request_id}: {e}") from e
        self.running[req.request_id] = seq
        return seq

    def n_discard(self, params: SamplingParams) -> int:
        """Tokens dropped per overflow: `params.n_discard`, else half the window after the kept
        tokens."""
        return params.n_discard or max(1, (self.max_model_len - params.n_keep) // 2)

    @torch.inference_mode()  # the pools may be inference tensors (made under inference mode)
    def _overflow(self, s: Sequence) -> None:
        """The context filled the window: drop `n_discard` tokens after the first `n_keep`.

        `reevaluate` frees the request's blocks; the kept context is prefilled again with its
        positions renumbered. `shift` moves the cached K/V down in place, keys rotated back by
        `n_discard` positions (shift-RoPE-K), and frees the blocks left over.
        """
        keep, drop = s.params.n_keep, self.n_discard(s.params)
        if s.params.context_overflow == "reevaluate":
            self.kv_cache.release(s.block_table)
            s.num_computed_tokens = 0
        else:
            length = s.num_computed_tokens  # the newest token is not cached yet
            self.model.shift_request_kv(self.kv_cache, s.block_table, keep, drop, length)
            s.num_computed_tokens = length - drop
            self.kv_cache.truncate(s.block_table, s.num_computed_tokens)
        s.num_discarded += drop

    def _reuse_cached_prefix(self, s: Sequence) -> None:
        """Give a request that has computed nothing itself yet the cached blocks of its longest
        prefix of full blocks (at most all but its last token: that one's logits are needed),
        beyond those it already took, which it then owns with the requests that share them; it
        prefills from there."""
        bs = self.cfg.block_size
        if s.block_hashes is None:
            s.block_hashes = lookup_hashes(s.token_ids, bs, s.params)
            self.prefix_cache_queries += len(s.token_ids)
        hits = self.kv_cache.allocator.lookup(s.block_hashes[len(s.block_table):])
        if hits:
            self.kv_cache.allocator.share(hits)
            s.block_table += hits
            s.num_registered_blocks = len(s.block_table)
            s.num_computed_tokens = s.num_cached_tokens = len(s.block_table) * bs
            self.prefix_cache_hits += len(hits) * bs

    def _register_full_blocks(self, s: Sequence) -> None:
        """Enter the blocks `s` has filled since the last call into the prefix cache."""
        bs = self.cfg.block_size
        full = s.num_computed_tokens // bs
        if full <= s.num_registered_blocks:
            return
        if s.block_hashes is None or len(s.block_hashes) < full:
            s.block_hashes = block_hashes(s.token_ids[: full * bs], bs, prefix_salt(s.params),
                                          s.block_hashes or [])
        for j in range(s.num_registered_blocks, full):
            self.kv_cache.allocator.register(s.block_table[j], s.block_hashes[j])
        s.num_registered_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks: repeated requests then compute again)."""
        self.kv_cache.allocator.reset_prefix_cache()

    def release(self, request_id: str) -> bool:
        """Drop a request and free its blocks. Returns False if it was not running."""
        seq = self.running.pop(request_id, None)
        if seq is None:
            return False
        self.kv_cache.release(seq.block_table)
        return True

    # -- one iteration --------------------------------------------------------------------------

    def step(self, plan: IterationPlan | None = None) -> IterationResult:
        """Run one iteration.

        Releases (all running requests when `plan.reset`) and admissions in `plan` take effect
        first; an admission the engine cannot run is reported as finished with
        `finish_reason="error"`.

        Returns:
            One `TokenOutput` per request that sampled a token or finished, one with no token
            per request whose prompt logprobs this iteration computed (`prompt_logprobs`), and
            the free blocks.

        Raises:
            KVCacheFullError: the requests chosen need more blocks than are free. The plan's
                releases and admissions have taken effect, requests that had not started may
                have taken cached prefix blocks, no token was computed and no block allocated;
                the caller preempts (releases) something and steps again.
        """
        t0 = time.perf_counter()
        plan = plan or IterationPlan()
        outputs: list[TokenOutput] = []
        for rid in list(self.running) if plan.reset else plan.release:
            self.release(rid)
        admitted = []
        for req in plan.admit:
            try:
                admitted.append(self.add_request(req).request_id)
            except InvalidRequestError as e:
                outputs.append(TokenOutput(req.request_id, None, len(req.output_token_ids),
                                           finish_reason="error", error=str(e)))
        if plan.run is None:
            seqs = list(self.running.values())
        else:
            ids = list(dict.fromkeys([*plan.run, *admitted]))
            seqs = [self.running[r] for r in ids if r in self.running]
        for s in seqs:
            if s.params.context_overflow != "error" and s.context_len >= self.max_model_len:
                self._overflow(s)
            elif (s.caches_prefix and s.num_computed_tokens == s.num_cached_tokens
                  and s.num_uncomputed_tokens > 1):
                self._reuse_cached_prefix(s)  # not started, or only from the cache so far
        decodes, prefills = self._schedule(seqs[: self.cfg.max_num_seqs])
        num_decode = len(decodes) + sum(len(s.draft_token_ids) for s in decodes)
        num_prefill = sum(c for _, c in prefills)
        if decodes or prefills:
            outputs += self._run(decodes, prefills)
        seconds = time.perf_counter() - t0
        if decodes or prefills:
            self.iterations += 1
            self.iteration_seconds += seconds
            if not num_prefill:
                self.decode_iterations += 1
                self.decode_iteration_seconds += seconds
        return IterationResult(
            worker_id="", iteration=plan.iteration, outputs=outputs,
            num_free_blocks=self.num_free_blocks, num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode, step_seconds=seconds,
            num_requests=len(decodes) + len(prefills),
            num_pending_prefill_tokens=sum(s.num_uncomputed_tokens for s in self.running.values()
                                           if s.num_uncomputed_tokens > 1),
        )

    def _schedule(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Decodes first (one token each), then prefill chunks FCFS within the token budget.
        Grows every chosen request's block table, all or nothing.

        A request that has computed nothing itself yet and would now compute at least half of
        what it lacks as an earlier one in this iteration does (the same next blocks) waits one
        iteration and then finds those blocks in the prefix cache: the n choices of one prompt,
        a burst of requests behind one long system prompt, chunk by chunk behind a prompt longer
        than the budget. Sharing less, it goes ahead: a whole iteration of latency for a little
        compute is a poor trade.

        With speculative decoding, an iteration of few decodes then gives each its drafts
        (`_propose_drafts`), as far as free blocks allow."""
        bs = self.cfg.block_size
        decodes = [s for s in seqs if s.num_uncomputed_tokens == 1]
        budget = self.cfg.max_num_batched_tokens - len(decodes)
        prefills: list[tuple[Sequence, int]] = []
        # The block each prefill of this iteration computes first -> the rest of its blocks.
        computing: dict[bytes, list[bytes]] = {}
        for s in seqs:
            if budget <= 0:
                break
            if s.num_uncomputed_tokens > 1:
                j = s.num_computed_tokens // bs
                if s.block_hashes and j < len(s.block_hashes):
                    ahead = s.block_hashes[j:]
                    earlier = computing.setdefault(ahead[0], ahead)
                    if (earlier is not ahead and s.num_computed_tokens == s.num_cached_tokens
                            and 2 * bs * _common_prefix(earlier, ahead) >= s.num_uncomputed_tokens):
                        continue
                chunk = min(s.num_uncomputed_tokens, budget)
                prefills.append((s, chunk))
                budget -= chunk
        need = sum(self.kv_cache.blocks_needed(s.block_table, s.num_computed_tokens + 1)
                   for s in decodes)
        need += sum(self.kv_cache.blocks_needed(s.block_table, s.num_computed_tokens + c)
                    for s, c in prefills)
        if need > self.num_free_blocks:
            raise KVCacheFullError(f"iteration needs {need} K/V blocks, {self.num_free_blocks} free")
        for s in decodes:
            self.kv_cache.grow(s.block_table, s.num_computed_tokens + 1)
        for s, c in prefills:
            self.kv_cache.grow(s.block_table, s.num_computed_tokens + c)
        spec = self.cfg.speculative
        if spec is not None and len(decodes) <= spec.disable_by_batch_size:
            for s in decodes:
                self._propose_drafts(s, spec)
        return decodes, prefills

    def _propose_drafts(self, s: Sequence, spec: SpeculativeConfig) -> None:
        """Set `s.draft_token_ids` (worker.speculative) and grow its table for them, as far as
        free blocks allow: drafts are an option, never a reason to preempt. None past
        `max_tokens` or the window (the tokens a pass yields are drafts kept plus one), and none
        for requests that overflow the window (their blocks shift in place) or have a structured
        output (a draft is checked against the model, not against the constraint)."""
        if s.params.context_overflow != "error" or s.params.structured_output is not None:
            return
        room = min(spec.num_speculative_tokens, s.params.max_tokens - s.num_output_tokens - 1,
                   self.max_model_len - s.context_len - 1)
        drafts = propose_ngram(s.token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
        end = s.num_computed_tokens + 1 + len(drafts)
        if drafts and self.kv_cache.blocks_needed(s.block_table, end) <= self.num_free_blocks:
            self.kv_cache.grow(s.block_table, end)
            s.draft_token_ids = drafts

    def _run(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> list[TokenOutput]:
        # Rows: plain decodes, then chunks (a drafting decode's last token and its drafts, then
        # prefill chunks). `samplers` pairs each request that samples with its first logits
        # row; a drafting request's other rows follow its first.
        plain = [s for s in decodes if not s.draft_token_ids]
        chunks = [(s, 1 + len(s.draft_token_ids)) for s in decodes if s.draft_token_ids]
        chunks += prefills
        ids: list[int] = [s.token_ids[-1] for s in plain]
        positions: list[int] = [s.num_computed_tokens for s in plain]
        sample_rows: list[int] = list(range(len(plain)))
        samplers: list[tuple[Sequence, int]] = list(zip(plain, sample_rows))
        # Rows whose next token is one of the prompt's, of requests that asked for the prompt's
        # logprobs: (request, its first such position, how many), rows in that order.
        scored: list[tuple[Sequence, int, int]] = []
        score_rows: list[int] = []
        for s, c in chunks:
            start = s.num_computed_tokens
            if s.draft_token_ids:
                ids += [s.token_ids[-1], *s.draft_token_ids]
                samplers.append((s, len(sample_rows)))
                sample_rows += range(len(ids) - c, len(ids))
            else:
                first = len(ids)
                ids += s.context_ids()[start : start + c]
                if start + c == s.context_len:  # the prompt is done: this chunk samples
                    samplers.append((s, len(sample_rows)))
                    sample_rows.append(len(ids) - 1)
                n = min(start + c, s.num_prompt_tokens - 1) - start
                if s.params.prompt_logprobs is not None and n > 0:
                    scored.append((s, start, n))
                    score_rows += range(first, first + n)
            positions += range(start, start + c)
        # The structured outputs' masks of this iteration's first sampling round are computed
        # while the model runs.
        masks = self.grammars.prepare([s.matcher for s, _ in samplers])
        tables, lens = [s.block_table for s in plain], [s.num_computed_tokens + 1 for s in plain]
        graphs = self.decode_graphs
        lora = self._lora_batch(plain, chunks)
        if (graphs is not None and not chunks and lora is None
                and graphs.fits(len(plain), max((len(t) for t in tables), default=0))):
            hidden = graphs.run(ids, tables, lens)
        else:
            meta = build_metadata(
                tables, lens, [(s.block_table, s.num_computed_tokens, c) for s, c in chunks],
                self.cfg.block_size, self.device,
            )
            # Only the sampling rows' final hidden states are read (all of them in a decode-only
            # iteration): the last layer's O and MLP skip the other rows.
            out_rows = (None if len(sample_rows) == len(ids)
                        else torch.tensor(sample_rows + score_rows, dtype=torch.long,
                                          device=self.device))
            hidden = self.model.forward(torch.tensor(ids, device=self.device),
                                        torch.tensor(positions, device=self.device), meta,
                                        self.kv_cache, out_rows, lora)
        for s in plain:
            s.num_computed_tokens += 1
        for s, c in prefills:
            s.num_computed_tokens += c
        for s in plain + [s for s, _ in prefills]:
            if s.caches_prefix:
                self._register_full_blocks(s)
        outputs: list[TokenOutput] = []
        if scored:
            outputs += self._prompt_logprobs(hidden[len(sample_rows):], scored)
            hidden = hidden[: len(sample_rows)]
        if not samplers:
            return outputs
        # The matchers are the mask thread's until it is done (`_banned_tokens` reads them).
        self.grammars.wait(masks)
        # Greedy rows that want no logprobs, ban no token, adjust no logit (bias, penalty) and
        # have no structured output nor allowed tokens need only the argmax. (Bad words may ban
        # a token in a later round, after a draft completes one's prefix.)
        seqs = [s for s, _ in samplers]
        full = (self.keep_logits or self.sampler.needs_logits([s.params for s in seqs])
                or any(self._banned_tokens(s) or s.matcher is not None
                       or s.params.allowed_token_ids or s.params.bad_words_token_ids
                       for s in seqs))
        logits, argmax = self.model.compute_logits(hidden, full)  # the sampling rows only
        # Sampling runs on the CPU: each request's seeded generator is a CPU generator, and the
        # rows that sample are few. (On the CPU these are no-ops.)
        argmax = argmax.cpu()
        if full:
            logits = logits.cpu()
            if self.keep_logits:
                self.last_logits = {s.request_id: logits[r].clone() for s, r in samplers}
        else:
            logits = None
        # Round j samples each request's row j. A drafting request goes on to its next row while
        # the token sampled equals its draft there: its tokens are those plain decoding would
        # have sampled, draw for draw (Leviathan et al. 2023, §2.3, with the draft's
        # distribution a point mass: a draft is kept with probability p(draft)).
        kept = {s.request_id: 0 for s, _ in samplers}
        while samplers:
            tokens, logprobs, tops = self._sample([s for s, _ in samplers],
                                                  [r for _, r in samplers], logits, argmax, masks)
            masks = None  # later rounds are drafting requests', which have no constraint
            going_on = []
            for (s, r), tok, lp, top in zip(samplers, tokens, logprobs, tops):
                index = s.num_output_tokens
                s.token_ids.append(tok)
                reason, error = self._finish_reason(s, tok), None
                if reason is None and s.matcher is not None:
                    try:
                        reason = "stop" if advance(s.matcher, tok) else None
                    except InvalidStructuredOutput as e:
                        reason, error = "error", str(e)
                elif reason is None and self._constraint_starts(s):
                    try:  # the thinking is over: the constraint holds from the next token
                        s.matcher = self.grammars.matcher(s.params.structured_output, [])
                    except InvalidStructuredOutput as e:
                        reason, error = "error", str(e)
                outputs.append(TokenOutput(s.request_id, tok, index, lp, reason, error=error,
                                           num_cached_tokens=0 if index else s.num_cached_tokens,
                                           top_logprobs=top))
                if reason is not None:
                    self.release(s.request_id)
                    continue
                j = kept[s.request_id]
                if j < len(s.draft_token_ids) and tok == s.draft_token_ids[j]:
                    kept[s.request_id] = j + 1
                    going_on.append((s, r + 1))
            samplers = going_on
        for s, _ in chunks:
            if s.draft_token_ids:
                self._settle_drafts(s, kept[s.request_id])
        return outputs

    # Rows of prompt logprobs made at once: their float32 logits take 192 KB a row (SmolLM2).
    PROMPT_LOGPROBS_ROWS = 256

    def _prompt_logprobs(self, hidden: torch.Tensor, scored: list[tuple[Sequence, int, int]]
                         ) -> list[TokenOutput]:
        """The prompt logprobs of this iteration's scored rows (`hidden` `[rows, hidden]`
        float32, in `scored`'s order: request, first position p, count n): for each position p,
        log P(prompt[p + 1] | prompt[:p + 1]) under the model's raw distribution and, with
        `prompt_logprobs` k > 0, the k most likely tokens there, and each prompt token's rank.
        One output per request, with no token."""
        nxt = torch.tensor([s.token_ids[p + 1] for s, start, n in scored
                            for p in range(start, start + n)])
        k = max(s.params.prompt_logprobs for s, _, _ in scored)
        lps: list[float] = []
        ranks: list[int] = []
        tops: list[list[list]] = []
        for i in range(0, hidden.shape[0], self.PROMPT_LOGPROBS_ROWS):
            logits, _ = self.model.compute_logits(hidden[i : i + self.PROMPT_LOGPROBS_ROWS])
            rows = logits.float().cpu().log_softmax(dim=-1)
            actual = rows.gather(1, nxt[i : i + rows.shape[0], None])
            lps += actual[:, 0].tolist()
            ranks += ((rows > actual).sum(dim=1) + 1).tolist()
            if k:
                values, top = rows.topk(k, dim=-1)
                tops += [[[t, v] for t, v in zip(ts, vs)]
                         for ts, vs in zip(top.tolist(), values.tolist())]
        outputs, at = [], 0
        for s, start, n in scored:
            kk = s.params.prompt_logprobs
            outputs.append(TokenOutput(
                s.request_id, None, s.num_output_tokens, prompt_logprobs=lps[at : at + n],
                prompt_top_logprobs=[t[:kk] for t in tops[at : at + n]] if kk else None,
                prompt_position=start + 1, prompt_ranks=ranks[at : at + n]))
            at += n
        return outputs

    def _settle_drafts(self, s: Sequence, kept: int) -> None:
        """After a drafting request sampled: its last token and the `kept` drafts before the
        first rejected one are computed; the rejected drafts' K/V lie past
        `num_computed_tokens` (overwritten later) and the blocks only they used are freed."""
        self.spec_draft_tokens += len(s.draft_token_ids)
        self.spec_accepted_tokens += kept
        s.draft_token_ids = []
        if s.request_id not in self.running:
            return  # finished: released with its blocks
        s.num_computed_tokens += 1 + kept
        self.kv_cache.truncate(s.block_table, s.num_computed_tokens)
        if s.caches_prefix:
            self._register_full_blocks(s)

    def _sample(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor | None,
                argmax: torch.Tensor, masks: PendingMasks | None = None
                ) -> tuple[list[int], list[float | None], list[list | None]]:
        """One token for each of `seqs` from its logits row in `rows` (of `logits` `[rows,
        vocab]` float32, None when only the argmax `[rows]` int64 is needed): within its allowed
        tokens and without its banned ones (`_restrict`), within its structured output (`masks`, for `seqs` in order),
        and with its history as it stands."""
        if rows != list(range(len(argmax))):  # a round of drafting requests: their rows only
            argmax = argmax[rows]
            logits = None if logits is None else logits[rows]
        if logits is not None and (self._restrict(logits, seqs)
                                   | self.grammars.apply(logits, masks)):
            argmax = None  # masks changed the rows: the sampler takes its own argmax
        return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs], argmax,
                            [(s.token_ids, s.num_prompt_tokens) for s in seqs])

    def _banned_tokens(self, s: Sequence) -> list[int]:
        """The token ids `s` may not sample now: the last token of each of its bad words whose
        other tokens end its output (vLLM's `bad_words`); and before `min_tokens` is reached,
        EOS (unless ignored) and the stop tokens (as in vLLM). A structured output that is
        complete may end before `min_tokens`. Nothing is banned where `allowed_token_ids` hold
        nothing else: the request could not go on."""
        p = s.params
        banned = _bad_word_ends(s.bad_words, s.token_ids, s.num_output_tokens) \
            if s.bad_words else []
        if s.num_output_tokens < p.min_tokens and not (s.matcher is not None
                                                       and s.matcher.is_accepting()):
            eos = self.model_cfg.eos_token_id
            banned += list(p.stop_token_ids) + (
                [eos] if eos is not None and not p.ignore_eos else [])
        if banned and p.allowed_token_ids and not set(p.allowed_token_ids) - set(banned):
            return []
        return banned

    @torch.inference_mode()  # the logits are an inference tensor: written in place only here
    def _restrict(self, logits: torch.Tensor, samplers: list[Sequence]) -> bool:
        """Set to -inf the logits of each row's tokens outside its `allowed_token_ids`, then of
        its banned tokens (`_banned_tokens`). Returns True when a logit was changed."""
        changed = False
        for i, s in enumerate(samplers):
            if allowed := s.params.allowed_token_ids:
                keep = torch.tensor(allowed)
                kept = logits[i, keep]
                logits[i].fill_(float("-inf"))
                logits[i, keep] = kept
                changed = True
            if banned := self._banned_tokens(s):
                logits[i, banned] = float("-inf")
                changed = True
        return changed

    def add_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load the PEFT adapter at `path` and serve it as `name` from the next iteration on
        (replacing one of that name).

        Raises:
            LoRAError: it cannot be read or does not fit the model (`worker.lora.load_adapter`),
                or the engine is tensor-parallel.
        """
        if self._tensor_parallel:
            raise LoRAError("LoRA adapters are not served with tensor parallelism")
        adapter = load_adapter(name, Path(path), self.model_cfg, self.cfg.dtype, self.device)
        self.loras[name] = adapter
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Stop serving the adapter `name`, unless a running request still uses it (it is then
        kept: call again once they finish). Returns whether it is gone (True for a name not
        loaded)."""
        if any(s.params.lora_name == name for s in self.running.values()):
            return False
        self.loras.pop(name, None)
        return True

    def _lora_batch(self, plain: list[Sequence], chunks: list[tuple[Sequence, int]]
                    ) -> LoRABatch | None:
        """The iteration's rows' adapters, in `_run`'s row order (plain decodes, then each
        chunk's rows); None when no row has one."""
        if not self.loras:  # no adapter loaded: admission refused any request naming one
            return None
        names = [s.params.lora_name for s in plain] + [s.params.lora_name for s, _ in chunks]
        used = list(dict.fromkeys(n for n in names if n is not None))
        if not used:
            return None
        index = {name: k for k, name in enumerate(used)}
        rows = [index.get(s.params.lora_name, -1) for s in plain]
        for s, c in chunks:
            rows += [index.get(s.params.lora_name, -1)] * c
        return LoRABatch([self.loras[n] for n in used],
                         torch.tensor(rows, dtype=torch.long, device=self.device))

    @staticmethod
    def _constraint_starts(s: Sequence) -> bool:
        """Whether the token just sampled ends the free stretch before a request's constraint
        (`SamplingParams.structured_output_after`)."""
        after = s.params.structured_output_after
        return (s.params.structured_output is not None and s.matcher is None and bool(after)
                and s.num_output_tokens >= len(after) and tuple(s.token_ids[-len(after):]) == after)

    def _finish_reason(self, s: Sequence, tok: int) -> str | None:
        p = s.params
        if tok == self.model_cfg.eos_token_id and not p.ignore_eos:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if s.num_output_tokens >= p.max_tokens:
            return "length"
        if s.context_len >= self.max_model_len and p.context_overflow == "error":
            return "length"
        return None


def _bad_word_index(words: tuple[tuple[int, ...], ...]) -> dict[int | None, list[tuple[int, ...]]]:
    """`words` (token id sequences) by the token before their last, None for one-token words."""
    index: dict[int | None, list[tuple[int, ...]]] = {}
    for word in words:
        index.setdefault(word[-2] if len(word) > 1 else None, []).append(word)
    return index


def _bad_word_ends(words: dict[int | None, list[tuple[int, ...]]], token_ids: list[int],
                   num_output_tokens: int) -> list[int]:
    """The last token of each bad word (`Sequence.bad_words`) whose other tokens are the last
    of the output, the final `num_output_tokens` of `token_ids`: sampling it would complete the
    word. A one-token word is always banned."""
    banned = [w[-1] for w in words.get(None, ())]
    if num_output_tokens:
        banned += [w[-1] for w in words.get(token_ids[-1], ()) if len(w) - 1 <= num_output_tokens
                   and token_ids[len(token_ids) - len(w) + 1:] == list(w[:-1])]
    return banned


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    """How many leading entries `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
