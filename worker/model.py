"""A Llama decoder built for selective batching.

The input of an iteration is one flat batch: token ids `[num_tokens]` and positions `[num_tokens]`
holding the new tokens of every request, decodes and prefill chunks mixed, with no padding and no
batch dimension. Embedding, RMSNorm, the fused QKV / gate-up / down / output projections, RoPE and
SiLU run once over `[num_tokens, hidden]`; only attention splits by request
(`worker.attention.paged_attention`). The LM head runs on the rows that sample.

Numerics in bfloat16. Matmuls take bfloat16 inputs, but the residual stream, RMSNorm and the SwiGLU
product stay in float32: with SwiGLU computed in bfloat16 the SmolLM2 logits were 4% off float32
(relative L2) and greedy answers changed; with these in float32 the error fell to 0.5%, at the
cost of a few elementwise passes over `[num_tokens, intermediate]`.

Weights are plain tensors, not `nn.Module`s: the engine never trains, and a flat list of tensors
keeps the per-op dispatch (about 1.7 µs an op here) as the only overhead. Q, K and V are fused into
one `[q + 2 kv, hidden]` projection and gate and up into one `[2 * intermediate, hidden]`, so a layer
runs four matmuls instead of seven.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention import AttentionMetadata, paged_attention
from worker.config import ModelConfig
from worker.kv_cache import KVCache
from worker.loader import Weights


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden] float32
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    o: torch.Tensor  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden] float32
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class LlamaModel:
    """Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or separate LM
    head) over a flat batch.

    Args:
        cfg: model shape.
        weights: tensors keyed by Hugging Face names (see `worker.loader`), in the serving dtype.
        max_positions: size of the RoPE table in positions (the served context window).
    """

    REFINE_TOP_K = 8  # logits recomputed in float32 per sampling row (see compute_logits)

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int) -> None:
        self.cfg = cfg
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"].float()
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=weights[p + "input_layernorm.weight"].float(),
                    qkv=torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                    o=weights[p + "self_attn.o_proj.weight"],
                    mlp_norm=weights[p + "post_attention_layernorm.weight"].float(),
                    gate_up=torch.cat(
                        [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
                    ),
                    down=weights[p + "mlp.down_proj.weight"],
                )
            )
        # RoPE table as transformers builds it: inverse frequencies in float32, angles for every
        # position, the halves repeated ("rotate_half" layout), cast to the model dtype.
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
        )
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)
        self.scale = cfg.head_dim**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[num_tokens, heads, head_dim]` by its positions' angles (Su et al. 2021)."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Run all layers over one iteration's flat batch.

        Args:
            input_ids: `[num_tokens]` int64.
            positions: `[num_tokens]` int64, each token's position within its own request.
            meta: per-request attention metadata (worker.attention.build_metadata).
            kv_cache: the paged pools; this iteration's K/V are written into them.

        Returns:
            Final hidden states `[num_tokens, hidden]` float32, before the last RMSNorm.
        """
        cfg = self.cfg
        n = input_ids.shape[0]
        eps = cfg.rms_norm_eps
        hidden = (cfg.hidden_size,)
        cos = self.cos[positions].unsqueeze(1)  # [n, 1, head_dim], broadcast over heads
        sin = self.sin[positions].unsqueeze(1)
        dt = self.dtype
        x = F.embedding(input_ids, self.embed).float()  # the residual stream, float32
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, hidden, layer.attn_norm, eps).to(dt)
            qkv = F.linear(h, layer.qkv)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = self._rope(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
            k = self._rope(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
            a = paged_attention(q, k, v, kv_cache.k[i], kv_cache.v[i], meta, self.scale)
            x = x + F.linear(a, layer.o)
            h = F.rms_norm(x, hidden, layer.mlp_norm, eps).to(dt)
            gate, up = F.linear(h, layer.gate_up).float().chunk(2, dim=-1)
            x = x + F.linear((F.silu(gate) * up).to(dt), layer.down)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head on the rows that sample.

        Args:
            hidden: `[num_sampling_rows, hidden]` float32 rows of `forward`'s output.

        Returns:
            `[num_sampling_rows, vocab_size]` float32 logits.
        """
        h = F.rms_norm(hidden, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        logits = F.linear(h.to(self.dtype), self.lm_head).float()
        if self.dtype != torch.float32:
            # A bfloat16 matmul rounds its output to bfloat16: at a logit of 25 the step is 0.125,
            # enough to tie or swap the two best tokens. Recompute each row's best candidates
            # exactly (float32 activations against the same weights) so greedy picks the argmax
            # float32 arithmetic would pick. Cost: a topk and `rows * REFINE_TOP_K` dot products.
            idx = logits.topk(self.REFINE_TOP_K, dim=-1).indices  # [rows, k]
            exact = torch.einsum("rd,rkd->rk", h, self.lm_head[idx].float())
            logits.scatter_(1, idx, exact)
        return logits
