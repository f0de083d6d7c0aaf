"""A Llama decoder built for selective batching.

The input of an iteration is one flat batch: token ids `[num_tokens]` and positions `[num_tokens]`
holding the new tokens of every request, decodes and prefill chunks mixed, with no padding and no
batch dimension. Embedding, RMSNorm, the fused QKV / gate-up / down / output projections, RoPE and
SiLU run once over `[num_tokens, hidden]`; only attention splits by request
(`worker.attention.AttentionBackend.forward`). The LM head runs on the rows that sample.

Numerics in bfloat16. Matmuls take bfloat16 inputs, but the residual stream, RMSNorm and the SwiGLU
product stay in float32: with SwiGLU computed in bfloat16 the SmolLM2 logits were 4% off float32
(relative L2) and greedy answers changed; with these in float32 the error fell to 0.5%. The
residual add + RMSNorm, RoPE and SiLU-times-up are fused ops (worker/ops.py: C++ kernels that read
bfloat16, compute in float32 and round once), so keeping float32 costs no extra passes.

Weights are plain tensors, not `nn.Module`s: the engine never trains, and a flat list of tensors
keeps the per-op dispatch (about 1.7 µs an op here) as the only overhead. Q, K and V are fused into
one `[q + 2 kv, hidden]` projection and gate and up into one `[2 * intermediate, hidden]`, so a layer
runs four matmuls instead of seven.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker import ops
from worker.attention import AttentionMetadata, make_backend
from worker.config import ModelConfig
from worker.hugepages import on_huge_pages
from worker.kv_cache import KVCache
from worker.linear import (
    LM_HEAD_DP_MAX_ROWS,
    Linear,
    pack_int4_quads,
    pack_int8_quads,
    quantize_int8,
    vnni_matmul,
)
from worker.loader import Q4_LEVELS, Q4_SCALE_MIN, Weights
from worker.lora import LoRABatch

log = logging.getLogger(__name__)

# The most rows of an iteration `shoal::decode_stack` runs (where its kernels serve them). What
# it saves, the loop's ~240 op calls a step, is a share of the step that shrinks as rows add
# work. Decode tokens/s, stack against loop in turns, SmolLM2 without its levels, bfloat16,
# 2-core Zen 4: batch 1 +16%, 16 +8.7%, 64 +3.4% (docs/benchmarks.md, session 23).
STACK_MAX_ROWS = 64


@dataclass(frozen=True)
class _Screen:
    """A low-precision copy of the LM head that picks each greedy row's candidates."""

    # `[rows, hidden]` in the serving dtype -> low-precision logits `[rows, vocab]`
    logits: Callable[[torch.Tensor], torch.Tensor]
    candidates: int  # per row, recomputed exactly
    max_rows: int  # the most rows of an iteration it serves


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden] float32
    qkv: Linear  # [q_size + 2 * kv_size, hidden]
    o: Linear  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden] float32
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


class LlamaModel:
    """Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or separate LM
    head) over a flat batch.

    Args:
        cfg: model shape.
        weights: tensors keyed by Hugging Face names (see `worker.loader`), in the serving dtype.
        max_positions: size of the RoPE table in positions (the served context window).
        quantization: "none", "int8" or "int4" (weight-only, for small iterations), or "w8a8"
            (int8 activations for the QKV and gate/up projections of large iterations; small
            ones read the file's 4-bit levels where it ships them, as unquantized, else int8
            weights); see worker.linear. The LM head takes int8 under int8 and int4
            (few-row iterations through `shoal::int8_gemv`, int8 activations).
        fast_paths: C++ kernels and prepacked weights where available (else the torch reference).
        device: where the weights live and the model runs.
        attention_backend: "auto", "torch" or "triton" (worker.attention.make_backend).
        tp: this rank's place in a tensor-parallel group (worker.parallel), or None. `cfg` and
            `weights` are then the rank's shard; the row-parallel O and down projections are
            summed over the group.

    Raises:
        ValueError: an attention backend that cannot run here.
    """

    REFINE_TOP_K = 8  # logits recomputed in float32 per sampling row (see compute_logits)
    # Candidates recomputed per row when they come from the int8 LM head (unquantized greedy
    # iterations): where the exact argmax ranked among the int8 logits, over 2,048 positions of
    # random-token contexts, at most 12th (bfloat16) and 15th (float32), 8th or worse at 0.3%;
    # over 1,024 positions of a real text at most 5th. 64 keeps a wide margin: its top-k took
    # 25 µs against 9 for 8 (one row).
    INT8_REFINE_TOP_K = 64
    # The same from the int4 copy (AVX2-only CPUs), float32: at most 18th over 2,048 random-token
    # positions (int8 there: 12th), 9th over 2,048 of a real text (int8: 4th); twice int8's
    # candidates keep its margin for about 0.05 ms more.
    INT4_REFINE_TOP_K = 128
    # The most rows whose candidates int8_gemv finds (unquantized greedy iterations).
    # SmolLM2's head, 2-core Zen 4, ms for 1 / 2 / 4 / 5 / 6 / 8 / 12 rows: bfloat16 (dp_linear)
    # 1.36 / 1.40 / 1.47 / 1.59 / 1.45 / 1.53 / 2.20, int8_gemv 0.36 / 0.49 / 0.89 / 1.25 / 1.29
    # / 1.53 / 2.39. Six covers a single stream checking up to 5 speculative drafts.
    LM_HEAD_SCREEN_MAX_ROWS = 6
    # The same for the int4 screen (AVX2-only CPUs, float32): greedy compute_logits against the
    # float32 head (f32_linear), ms for 1 / 6 / 8 / 16 / 32 / 64 / 128 rows, the AVX2 build run
    # on a 2-core Zen 4: 0.46 / 1.86 / 5.36 / 8.17 / 13.9 / 24.3 / 46.4 against 0.48 / 1.78 /
    # 2.17 / 6.99 / 9.07 / 17.3 / 47.3: past 64 rows recomputing 128 candidates a row costs what
    # the screen saves.
    INT4_SCREEN_MAX_ROWS = 64
    # The same where vnni_linear's int8 screen serves the larger iterations (AVX512_BF16 and
    # VNNI): int4_q8_linear against vnni_linear over SmolLM2's head, 2-core Zen 4, ms for 1 / 2
    # / 3 / 4 / 6 rows, in a loop (the copy partly in L3): 0.33 / 0.42 / 0.60 / 0.71 / 1.24
    # against 0.63 / 0.68 / 0.68 / 0.74 / 0.85; decode tokens/s, int4 up to 4 rows against int8
    # only, in turns (8 rounds, medians), batch 1 / 3 / 4 / 6: 167.8 / 356.2 / 444.1 against
    # 161.4 / 348.4 / 429.3; int4 at 6 rows: 535.5 against 581.7.
    INT4_SCREEN_VNNI_MAX_ROWS = 4
    # Where AMX tiles serve the bfloat16 LM head, past this many rows they give the exact logits
    # faster than vnni_linear's int8 screen, which is bound by its dot products: greedy
    # compute_logits, screen against amx_linear, 2-core Xeon with AMX, ms (medians of 22, two
    # rounds): 8 rows 1.18-1.22 / 1.51-1.52, 16 rows 1.69-2.05 / 1.73-1.75, 32 rows 3.16-3.85 /
    # 2.07-2.24, 64 rows 6.11-6.19 / 3.46-3.60 (session 25).
    INT8_SCREEN_AMX_MAX_ROWS = 16

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 quantization: str = "none", fast_paths: bool = True,
                 device: torch.device | str = "cpu", attention_backend: str = "auto",
                 tp=None) -> None:
        self.cfg = cfg
        self.tp = tp
        self.device = torch.device(device)
        if self.device.type != "cpu":  # (the 4-bit levels serve CPU kernels only)
            weights = {name: w.to(self.device) for name, w in weights.items()
                       if not name.endswith((Q4_LEVELS, Q4_SCALE_MIN))}
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.kernels = fast_paths and self.device.type == "cpu" and ops.kernels_enabled(self.dtype)
        self.attention = make_backend(attention_backend, self.device, self.kernels)
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"].float()
        # The plain LM head weight serves the exact recomputation of each row's best logits
        # (compute_logits); the projection itself may run on a packed or quantized copy. That
        # recomputation reads candidates' rows anywhere in it (56 MB for SmolLM2), a TLB miss
        # each on 4 KiB pages, so it lies on 2 MiB pages: 64 rows' 64 candidates 0.40 -> 0.27 ms
        # (2-core Zen 5). A tied head is the embedding: the one copy serves both.
        self.lm_head = on_huge_pages(self.embed if cfg.tie_word_embeddings
                                     else weights["lm_head.weight"])
        if cfg.tie_word_embeddings:
            self.embed = self.lm_head
        # Under int8 and int4 the LM head takes int8: SmolLM2 ships its tied embedding as Q8_0,
        # and a 4-bit LM head cost 1% of perplexity (docs/engine.md). Its int8 activations in
        # small iterations (shoal::int8_gemv) cost no greedy token: the refinement below
        # recomputes the best ones. w8a8 quantizes only large iterations' activations: its LM
        # head is the unquantized one, greedy rows screened as below.
        unquantized_head = quantization in ("none", "w8a8")
        self.lm_head_proj = Linear(self.lm_head, "none" if unquantized_head else "int8",
                                   pack=fast_paths, int8_gemv=True, kernels=self.kernels,
                                   dp_max_rows=LM_HEAD_DP_MAX_ROWS)
        # Greedy iterations screen the vocabulary with a low-precision copy of the LM head and
        # recompute the best candidates exactly (compute_logits); logits anyone reads come from
        # `lm_head_proj`. Under int8 and int4 too: there a greedy row's token was the exact
        # argmax of the int8 head's best REFINE_TOP_K, and the screens keep more candidates. On a
        # 2-core Zen 3 under int4, 64 greedy rows took 30-35 ms in the head's float32 oneDNN copy
        # (past int8_linear's 32 rows), 20-23 through the int4 screen (session 51). The screen,
        # by what the kernels were built with:
        # - int8 x int8 through `shoal::vnni_linear` (W8A8's kernel; AVX512_BF16 and VNNI), for
        #   iterations of every size: at 1-2 rows as fast as int8_gemv below, from 4 rows 1.7-3x
        #   faster; compute_logits of greedy rows at 4 / 8 / 64 rows 1.37 / 2.21 / 10.0 -> 0.79
        #   / 1.33 / 7.6 ms (2-core Zen 4, docs/benchmarks.md session 23); where AMX tiles serve
        #   the LM head, up to INT8_SCREEN_AMX_MAX_ROWS rows;
        # - int4 through `shoal::int4_q8_linear` on AVX2-only CPUs, where reading the int8 copy
        #   is the bound: 1.38 -> 0.55 ms a row, 1.99 -> 1.24 at 4 (2-core Zen 3, session 22),
        #   iterations of up to INT4_SCREEN_MAX_ROWS;
        # - elsewhere int8 through `shoal::int8_gemv` (unquantized heads): half the bytes of
        #   bfloat16 (a quarter of float32's), 1.36 -> 0.36 ms a row, single-stream decode
        #   +6-10% in bfloat16 and +20% in float32 (2-core Zen 4, session 20).
        # The int8 screens quantize activations per row and weights per channel alike. Where
        # vnni_linear serves, iterations of up to INT4_SCREEN_VNNI_MAX_ROWS rows take the int4
        # screen first: a few rows are bound by reading the copy, and int4's is half int8's.
        # `lm_head_screens`: the screens in ascending `max_rows`; an iteration takes the first
        # that serves its rows.
        self.lm_head_screens: list[_Screen] = []
        if (self.kernels and cfg.hidden_size % 64 == 0
                and (tp is None or tp.rank == 0)):  # rank 0 samples
            vnni = ops.vnni_linear_available()

            def int8_head() -> tuple[torch.Tensor, torch.Tensor]:
                # int8 weights and per-channel scales: under int8 and int4 the head holds them
                held = self.lm_head_proj.quantized
                return (held[0], held[1]) if held is not None else quantize_int8(self.lm_head)

            if ops.int4_q8_available():
                quads = pack_int4_quads(self.lm_head.float())
                self.lm_head_screens.append(_Screen(
                    lambda x: torch.ops.shoal.int4_q8_linear(x, *quads), self.INT4_REFINE_TOP_K,
                    self.INT4_SCREEN_VNNI_MAX_ROWS if vnni else self.INT4_SCREEN_MAX_ROWS))
            if vnni:
                q, scale = int8_head()
                packed = pack_int8_quads(q, scale.float(), swiglu=False)
                self.lm_head_screens.append(_Screen(
                    lambda x: vnni_matmul(x, packed), self.INT8_REFINE_TOP_K,
                    self.INT8_SCREEN_AMX_MAX_ROWS if self.lm_head_proj.amx else sys.maxsize))
            elif not self.lm_head_screens and unquantized_head and ops.int8_gemv_available():
                # (under int8 and int4 `lm_head_proj` reads this same copy at these rows)
                q, scale = int8_head()
                gemv = (q, scale.float(), q.sum(dim=1, dtype=torch.int32))
                self.lm_head_screens.append(_Screen(
                    lambda x: torch.ops.shoal.int8_gemv(x, *gemv), self.INT8_REFINE_TOP_K,
                    self.LM_HEAD_SCREEN_MAX_ROWS))

        def linear(*names: str, quantize_activations: bool = False, swiglu: bool = False) -> Linear:
            # GGUF's 4-bit levels where every part has them (worker.loader, worker.linear).
            prefixes = [n.removesuffix(".weight") for n in names]
            q4 = None
            if all(p + Q4_LEVELS in weights for p in prefixes):
                q4 = tuple(torch.cat([weights[p + suffix] for p in prefixes])
                           for suffix in (Q4_LEVELS, Q4_SCALE_MIN))
            return Linear(torch.cat([weights[n] for n in names]), quantization, pack=fast_paths,
                          quantize_activations=quantize_activations, kernels=self.kernels,
                          swiglu=swiglu, q4=q4)

        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=weights[p + "input_layernorm.weight"].float(),
                    qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"),
                               quantize_activations=quantization == "w8a8"),
                    o=linear(p + "self_attn.o_proj.weight"),
                    mlp_norm=weights[p + "post_attention_layernorm.weight"].float(),
                    gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                                   quantize_activations=quantization == "w8a8", swiglu=True),
                    down=linear(p + "mlp.down_proj.weight"),
                )
            )
        if quantization == "w8a8" and self.kernels and not ops.int8_matmul_fast():
            log.warning("--quantization w8a8: this CPU has no int8 dot-product instructions "
                        "(AVX-512 VNNI or AMX); activations stay in %s (iterations of a few "
                        "rows read the file's 4-bit levels where it ships them, else int8 "
                        "weights, as under int8)", str(self.dtype).removeprefix("torch."))
        self.cos_sin = ops.rope_cos_sin(cfg.rope_theta, cfg.head_dim, max_positions).to(self.device)
        self.scale = cfg.head_dim**-0.5
        # Iterations of up to `stack_max_rows` rows run every layer in one call
        # (`shoal::decode_stack`) where every projection serves them with a kernel the stack
        # runs (`Linear.stack_operand`): the kernels of the loop in `forward`, in its order (the
        # same bits), without the ~240 op calls a step makes from Python otherwise. `stacks`:
        # (most rows, weights) in ascending rows, the weights per layer the attention norm,
        # QKV, O, MLP norm, gate/up and down (under int4 each projection's levels and scales:
        # int4_q8_linear's operands); a new entry where some projection's operand changes
        # (SmolLM2 in bfloat16: the 4-bit levels up to 8 rows, then bfloat16 pairs; on AMX CPUs
        # the levels at every row count, and under int4, one entry).
        self.stacks: list[tuple[int, list[torch.Tensor]]] = []
        self.stack_pairs = self.dtype == torch.bfloat16  # bfloat16 kernels, else float32 lanes
        if (self.kernels and tp is None and hasattr(torch.ops.shoal, "decode_stack")
                and getattr(self.attention, "cpu_kernels", False)):
            self.stacks = self._stack_tiers()

    def _stack_tiers(self) -> list[tuple[int, list[torch.Tensor]]]:
        """`stacks` (above): for each row count up to STACK_MAX_ROWS, the operands every
        projection's `stack_operand` gives, until one has none (or they mix the stack's forms:
        one tensor a projection, or int4's two)."""
        tiers: list[tuple[int, list[torch.Tensor]]] = []
        for rows in range(1, STACK_MAX_ROWS + 1):
            operands = [[lin.stack_operand(rows)
                         for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
                        for layer in self.layers]
            flat = [op for layer_ops in operands for op in layer_ops]
            if any(op is None for op in flat) or len({len(op) for op in flat}) > 1:
                return tiers
            weights = []
            for layer, (qkv, o, gate_up, down) in zip(self.layers, operands):
                weights += [layer.attn_norm, *qkv, *o, layer.mlp_norm, *gate_up, *down]
            if tiers and all(a is b for a, b in zip(tiers[-1][1], weights)):
                tiers[-1] = (rows, tiers[-1][1])
            else:
                tiers.append((rows, weights))
        return tiers

    @property
    def stack_max_rows(self) -> int:
        """The most rows an iteration run by `shoal::decode_stack` has (0: it does not serve)."""
        return self.stacks[-1][0] if self.stacks else 0

    def projections(self) -> list[Linear]:
        """Every layer's QKV, O, gate/up and down projections, layer by layer."""
        return [lin for layer in self.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def levels_served(self) -> tuple[int, int, int]:
        """Projections whose few-row iterations read the GGUF file's 4-bit levels
        (worker.linear), all projections, and the most rows those iterations have (0: none)."""
        linears = self.projections()
        return (sum(lin.q4 is not None for lin in linears), len(linears),
                max(lin.q4_max_rows for lin in linears))

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_cache: KVCache, output_rows: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Run all layers over one iteration's flat batch.

        Args:
            input_ids: `[num_tokens]` int64, on the model's device.
            positions: `[num_tokens]` int64, each token's position within its own request.
            meta: per-request attention metadata (worker.attention.build_metadata).
            kv_cache: the paged pools; this iteration's K/V are written into them.
            output_rows: `[num_out]` int64 row indices whose hidden states the caller needs
                (the rows that sample), or None for all. Every row's K/V is still written in
                every layer; the last layer's output projection and MLP run only on these rows
                (nothing reads the other rows' last-layer outputs): a prefill iteration of 2,048
                rows saves 1/30 of SmolLM2's O and MLP work.
            lora: the LoRA adapters of the rows (worker.lora), None when no row has one; an
                iteration with them runs layer by layer, each projection's deltas added to its
                adapters' rows (SwiGLU then unfused).

        Returns:
            Final hidden states `[num_tokens, hidden]` (or `[num_out, hidden]`) float32, before
            the last RMSNorm.
        """
        cfg = self.cfg
        eps, dt, kern = cfg.rms_norm_eps, self.dtype, self.kernels
        x = F.embedding(input_ids, self.embed).float()  # the residual stream, float32
        for max_rows, weights in self.stacks if lora is None else ():
            if x.shape[0] <= max_rows:
                return torch.ops.shoal.decode_stack(
                    x, weights, kv_cache.k, kv_cache.v, positions, self.cos_sin,
                    meta.slot_mapping, *meta.seq_arrays, output_rows, cfg.num_heads,
                    cfg.num_kv_heads, cfg.head_dim, eps, self.scale, self.stack_pairs)
        delta = None  # the last sublayer's output, added to x by the next fused add + norm
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = ops.add_rms_norm(x, delta, layer.attn_norm, eps, dt, kern)
            qkv = layer.qkv(h)
            if lora is not None:
                lora.add(qkv, h, i, "qkv")
            a = self.attention.attend(qkv, positions, self.cos_sin, kv_cache.k[i],
                                      kv_cache.v[i], meta, self.scale, cfg.num_heads,
                                      cfg.num_kv_heads, cfg.head_dim)
            if i == last and output_rows is not None:
                a, x = a[output_rows], x[output_rows]
                if a.shape[0] == 0:
                    return x
                lora = lora.rows(output_rows) if lora is not None else None
            o = layer.o(a)
            if lora is not None:
                lora.add(o, a, i, "o")
            if self.tp is not None:
                self.tp.all_reduce(o)  # row-parallel: the ranks' partial sums
            h = ops.add_rms_norm(x, o, layer.mlp_norm, eps, dt, kern)
            if lora is None:
                delta = layer.down(layer.gate_up.silu_and_mul(h))
            else:
                gate_up = layer.gate_up(h)
                lora.add(gate_up, h, i, "gate_up")
                m = ops.silu_and_mul(gate_up, kern)
                delta = layer.down(m)
                lora.add(delta, m, i, "down")
            if self.tp is not None:
                self.tp.all_reduce(delta)
        if delta is not None:
            x += delta
        return x

    @torch.inference_mode()
    def shift_request_kv(self, kv_cache: KVCache, block_table: list[int], keep: int,
                         discard: int, length: int) -> None:
        """Drop cached positions `[keep, keep + discard)` of one request in every layer, moving
        the later ones down with their keys rotated (`AttentionBackend.shift_request_kv`)."""
        for i in range(self.cfg.num_layers):
            self.attention.shift_request_kv(kv_cache.k[i], kv_cache.v[i], block_table, keep,
                                            discard, length, self.cos_sin)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, full: bool = True
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Final RMSNorm and LM head on the rows that sample.

        Args:
            hidden: `[num_sampling_rows, hidden]` float32 rows of `forward`'s output.
            full: return the float32 logits; without them (greedy rows that want no logprobs)
                only the argmax is made, and iterations a screen serves (`lm_head_screens`:
                int4 up to INT4_SCREEN_VNNI_MAX_ROWS rows then int8 at every size, int4 up to
                INT4_SCREEN_MAX_ROWS, or int8 up to LM_HEAD_SCREEN_MAX_ROWS, by what the kernels
                were built with) take their candidates from a low-precision copy of the LM
                head. Widening 64 rows of bfloat16 logits to float32 writes 12 MB, which cost
                about 1 ms an iteration (62 ms of a W64 run, page faults of the fresh buffer
                included).

        Returns:
            `[num_sampling_rows, vocab_size]` float32 logits (None unless `full`), and
            `[num_sampling_rows]` int64 the argmax of each row (what greedy sampling picks).
        """
        h = F.rms_norm(hidden, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        screen = None if full else next(
            (s for s in self.lm_head_screens if h.shape[0] <= s.max_rows), None)
        if screen is not None:
            logits = screen.logits(h.to(self.dtype))
        else:
            logits = self.lm_head_proj(h.to(self.dtype))
        if self.dtype == torch.float32 and self.lm_head_proj.quantized is None and screen is None:
            return (logits if full else None), ops.topk_rows(logits, 1, self.kernels)[1][:, 0]
        # A bfloat16 matmul rounds its output to bfloat16: at a logit of 25 the step is 0.125,
        # enough to tie or swap the two best tokens (int8 weights and activations err more).
        # Recompute each row's best candidates exactly (float32 activations against the
        # unquantized weights) so greedy picks the argmax float32 arithmetic would pick. Cost: a
        # top-k and `rows * REFINE_TOP_K` dot products.
        k = screen.candidates if screen is not None else self.REFINE_TOP_K
        idx = ops.topk_rows(logits, k, self.kernels)[1]  # [rows, k]
        exact = ops.candidate_logits(h, self.lm_head, idx, self.kernels)
        argmax = idx.gather(1, exact.argmax(dim=1, keepdim=True))[:, 0]
        return (logits.float().scatter_(1, idx, exact) if full else None), argmax
