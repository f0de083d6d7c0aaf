"""LoRA adapters served beside the base model, many in one batch.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", §4.1)
changes a projection `W` to `W + s * B A`, with `A` `[r, in]`, `B` `[out, r]` and `s` =
`lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). Served unmerged, as S-LoRA serves
thousands (Sheng et al. 2023, §4): the base projection runs once over the iteration's flat
`[num_tokens, in]` batch, whoever its rows belong to, and each adapter adds
`s * (x A^T) B^T` to the rows of its own requests only (`LoRABatch.add`), so requests of
several adapters and of the base model share every iteration.

Adapters are PEFT's directories (`adapter_config.json`, `adapter_model.safetensors`), trained
on the Hugging Face layout the loader gives the base weights (worker/loader.py undoes GGUF's
Q/K row permutation). Targets: the attention's `q_proj`, `k_proj`, `v_proj`, `o_proj` and
the MLP's `gate_proj`, `up_proj`, `down_proj`, any subset; the parts of a fused projection
(QKV, gate/up) become one `A` (the targeted parts' stacked) and one `B` (block-diagonal, `s`
folded in), so a fused projection's delta is two matmuls.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.config import ModelConfig

# shoal's fused projections and the Hugging Face modules each is made of, in output order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: missing files, other targets, or wrong shapes."""


# Rows up to which a delta is computed in float32: torch's bfloat16 matmuls of a few rows by a
# rank-r matrix cost 3x float32's (oneDNN's overhead), and float32's grow worse past them
# (2-core Zen 4, a [rows, 576] x [576, 24] x [24, 3072] delta: 1 row 14 against 47 us, 8 rows 81
# against 54).
FLOAT32_MAX_ROWS = 4


@dataclass
class LoRAProjection:
    """One fused projection's low-rank delta: `y += (x @ a_t) @ b_t`.

    Attributes:
        a_t: `[in_features, parts * r]`, the targeted parts' `A` stacked and transposed,
            serving dtype.
        b_t: `[parts * r, out_features]`, their `B` block-diagonal in the fused output's
            columns, times the scale, serving dtype.
        a_t32, b_t32: the same in float32, for iterations of a few rows (`FLOAT32_MAX_ROWS`).
    """

    a_t: torch.Tensor
    b_t: torch.Tensor
    a_t32: torch.Tensor
    b_t32: torch.Tensor

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """`[rows, in_features]` -> its delta `[rows, out_features]` (float32 for a few rows,
        else the serving dtype)."""
        if x.shape[0] <= FLOAT32_MAX_ROWS:
            return x.float() @ self.a_t32 @ self.b_t32
        return x @ self.a_t @ self.b_t


@dataclass
class LoRAAdapter:
    """A loaded adapter.

    Attributes:
        name: what requests call it (`SamplingParams.lora_name`).
        path: its directory.
        rank: `r`.
        layers: per decoder layer, its deltas by fused projection ("qkv", "o", "gate_up",
            "down"); a projection the adapter does not target has none.
    """

    name: str
    path: Path
    rank: int
    layers: list[dict[str, LoRAProjection]]


def _out_sizes(cfg: ModelConfig) -> dict[str, int]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": cfg.hidden_size,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size,
            "down_proj": cfg.hidden_size}


def _in_size(cfg: ModelConfig, module: str) -> int:
    return {"o_proj": cfg.num_heads * cfg.head_dim,
            "down_proj": cfg.intermediate_size}.get(module, cfg.hidden_size)


def load_adapter(name: str, path: Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> LoRAAdapter:
    """Read a PEFT LoRA adapter for a model of shape `cfg`.

    Args:
        name: the name requests give it.
        path: its directory: `adapter_config.json` (`r`, `lora_alpha`, optional `use_rslora`)
            and `adapter_model.safetensors` (or `adapter_model.bin`).
        cfg: the base model's shape.
        dtype: the serving dtype.
        device: where the model runs.

    Raises:
        LoRAError: a missing or unreadable file, a target other than the seven projections
            (embeddings, the LM head, biases, DoRA), or a tensor of the wrong shape.
    """
    path = Path(path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        weights_file = path / "adapter_model.safetensors"
        if weights_file.exists():
            from safetensors.torch import load_file

            tensors = load_file(weights_file)
        else:
            tensors = torch.load(path / "adapter_model.bin", map_location="cpu",
                                 weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"LoRA adapter {name!r} at {path}: cannot read it ({e})") from e
    if config.get("use_dora"):
        raise LoRAError(f"LoRA adapter {name!r}: DoRA adapters are not supported")
    r = int(config.get("r", 0))
    if r < 1:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json has no rank r")
    alpha = float(config.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: {key} is not a LoRA weight of the "
                            f"attention or MLP projections")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers or module not in _out_sizes(cfg):
            raise LoRAError(f"LoRA adapter {name!r}: {key} targets what this model lacks")
        parts.setdefault((layer, module), {})[which] = t.float()
    outs = _out_sizes(cfg)
    layers: list[dict[str, LoRAProjection]] = [{} for _ in range(cfg.num_layers)]
    for i in range(cfg.num_layers):
        for fused, modules in FUSED.items():
            targeted = [mod for mod in modules if (i, mod) in parts]
            if not targeted:
                continue
            b = torch.zeros(sum(outs[mod] for mod in modules), r * len(targeted))
            a_rows, row = [], 0
            for mod in modules:
                if mod in targeted:
                    ab = parts[(i, mod)]
                    a, bb = ab.get("A"), ab.get("B")
                    if a is None or bb is None or a.shape != (r, _in_size(cfg, mod)) \
                            or bb.shape != (outs[mod], r):
                        raise LoRAError(f"LoRA adapter {name!r}: layer {i} {mod}: expected A "
                                        f"{(r, _in_size(cfg, mod))} and B {(outs[mod], r)}")
                    k = len(a_rows)
                    b[row:row + outs[mod], k * r:(k + 1) * r] = bb * scale
                    a_rows.append(a)
                row += outs[mod]
            a_t, b_t = torch.cat(a_rows).T.contiguous().to(device), b.T.contiguous().to(device)
            layers[i][fused] = LoRAProjection(a_t.to(dtype), b_t.to(dtype), a_t, b_t)
    return LoRAAdapter(name, path, r, layers)


class LoRABatch:
    """The adapters of one iteration's rows: which adapter, if any, each row runs with.

    Args:
        adapters: the adapters the iteration uses.
        row_adapter: `[num_tokens]` int64, each row's index into `adapters`, -1 for the base
            model.
    """

    def __init__(self, adapters: list[LoRAAdapter], row_adapter: torch.Tensor) -> None:
        self.adapters, self.row_adapter = adapters, row_adapter
        # Each adapter's rows; None where it has them all (no gather, no scatter).
        self._groups = [(adapter, None if len(adapters) == 1 and bool((row_adapter == 0).all())
                         else (row_adapter == k).nonzero().squeeze(1))
                        for k, adapter in enumerate(adapters)]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """Add each adapter's delta of `projection` ("qkv", "o", "gate_up", "down") in decoder
        `layer` to its rows of `out` `[rows, out_features]`, in place, from the projection's
        input `x` `[rows, in_features]` (both the serving dtype)."""
        for adapter, rows in self._groups:
            delta = adapter.layers[layer].get(projection)
            if delta is None:
                continue
            if rows is None:
                out += delta.delta(x)
            elif rows.numel():
                out.index_add_(0, rows, delta.delta(x[rows]).to(out.dtype))

    def rows(self, keep: torch.Tensor) -> LoRABatch:
        """The same for the rows `keep` (`[n]` int64) only, in that order (the last layer's
        sampling rows)."""
        return LoRABatch(self.adapters, self.row_adapter[keep])
