"""Loading Llama-family weights from a GGUF file or a Hugging Face model directory.

Both sources end in the same place: a `ModelConfig` and a dict of tensors named as in Hugging Face
transformers (`model.layers.0.self_attn.q_proj.weight`, ...), in `nn.Linear` layout (out, in).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shoal.model_files import ModelNotFoundError, cache_entry
from worker.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)
# Hugging Face `architectures` entries that are plain Llama decoders under another name.
HF_LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its tensors' quantization types is not supported."""


Weights = dict[str, torch.Tensor]
log = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


Shard = Callable[[str, torch.Tensor], torch.Tensor]

# Beside a projection `<prefix>.weight` stored in GGUF as Q4_0 or Q4_1: its 4-bit levels
# `[out, in]` uint8 and each group of 32 inputs' scale and minimum `[out, in / 32, 2]` float16,
# from which worker.linear serves few-row iterations bit for bit (`shoal::q4_linear`).
Q4_LEVELS, Q4_SCALE_MIN = ".q4_levels", ".q4_scale_min"
_Q4_SUFFIXES = (Q4_LEVELS, Q4_SCALE_MIN)


def read_model_config(path: Path) -> ModelConfig:
    """A model's configuration alone (errors as in `load_model`). A GGUF file's comes from its
    weights cache (see `load_model`), which this writes first if it is missing."""
    if path.is_dir():
        return _hf_config(path)
    return _gguf_cache(path)[0]


def load_model(path: Path, dtype: torch.dtype, shard: Shard | None = None
               ) -> tuple[ModelConfig, Weights]:
    """Read a model's configuration and weights.

    Args:
        path: a `.gguf` file or a Hugging Face model directory (`config.json`, `*.safetensors`).
        dtype: dtype of the returned weights (float32 or bfloat16; quantized GGUF tensors are
            dequantized to it).
        shard: `(name, full float32 tensor) -> the part to keep`, applied to each tensor as it is
            read, so that only one full tensor is in memory at a time (tensor parallelism:
            `worker.parallel.TensorParallel.shard`). The configuration stays the full model's.
            4-bit levels and scales (below) go through it under their weight's name.

    A GGUF file is read once: its configuration and its tensors, dequantized to float32 in Hugging
    Face names and layout, are written to a safetensors file in shoal's cache (`shoal.model_files.
    cache_entry`, kind "weights": 0.66 GB for SmolLM2 with its 4-bit levels), which later loads
    read instead. gguf's reader parses every metadata field one numpy view at a time, SmolLM2's
    98,000 vocabulary and merge strings included, and dequantizing takes as long again: 6.7 s a
    load on a 2-core AMD EPYC against about 0.5 s from the cache. The first load holds the whole
    float32 model at once.

    A GGUF projection stored as Q4_0 or Q4_1 also comes with its levels and scales,
    `<prefix>.q4_levels` `[out, in]` uint8 and `<prefix>.q4_scale_min` `[out, in / 32, 2]` float16
    (d and m of each group of 32 inputs; Q4_0's m is -8 d), rows in the weight's order: the weight
    is `float32(d) * q + float32(m)` rounded to `dtype`.

    Returns:
        The model configuration and its weights keyed by Hugging Face names.

    Raises:
        ModelNotFoundError: a missing file.
        UnsupportedModelError: an architecture other than Llama, or a GGUF quantization type the
            `gguf` library cannot dequantize.
    """
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    if path.is_dir():
        return _load_hf_dir(path, dtype, shard)
    return _load_gguf(path, dtype, shard)


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Q/K projections.

    llama.cpp's converter interleaves each head's two rotary halves so its RoPE can rotate
    adjacent pairs; transformers' RoPE rotates the first half against the second. Shape
    [out, ...] in and out (the rows move; a weight's levels and scales move with it).
    """
    shape = w.shape
    out = shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, -1).swapaxes(1, 2).reshape(shape)


def _q4_levels(t) -> tuple[np.ndarray, np.ndarray] | None:
    """A Q4_0 or Q4_1 GGUF matrix's levels `[out, in]` uint8 and scales and minimums
    `[out, in / 32, 2]` float16 (see `load_model`), or None for other types. A block is d
    (float16), m (Q4_1 only), then 16 bytes whose low nibbles are inputs 0-15 and high nibbles
    16-31 (ggml's layout, as gguf's `dequantize` reads it)."""
    import gguf

    kind = t.tensor_type
    if kind not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        return None
    inp, out = (int(d) for d in t.shape)
    block_bytes = 20 if kind == gguf.GGMLQuantizationType.Q4_1 else 18
    blocks = np.asarray(t.data).reshape(out, inp // 32, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)
    if kind == gguf.GGMLQuantizationType.Q4_1:
        m, qs = blocks[..., 2:4].copy().view(np.float16), blocks[..., 4:]
    else:  # d * (q - 8) = d * q + (-8 d), and -8 d is exact in float16
        m, qs = (d * np.float16(-8)).astype(np.float16), blocks[..., 2:]
    levels = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, inp)
    return levels, np.concatenate([d, m], axis=-1)


def _gguf_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))  # memory-maps the file: tensors are read on access
    except Exception as e:  # gguf raises ValueError/struct errors on a bad file
        raise ModelNotFoundError(f"not a readable GGUF file: {path} ({e})") from e


def _gguf_config(reader, path: Path) -> ModelConfig:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r} in {path.name}; supported: {SUPPORTED_ARCHITECTURES}"
        )
    n_head = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_head))
    hidden = int(field(f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = field("tokenizer.ggml.tokens")
    vocab = int(field(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=int(field(f"{arch}.attention.key_length", hidden // n_head)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        eos_token_id=_opt_int(field("tokenizer.ggml.eos_token_id")),
    )


# Bump when what the weights cache holds changes (names, layout, configuration fields): older
# entries then miss.
_WEIGHTS_CACHE_FORMAT = 2  # 2: Q4_0 / Q4_1 levels and scales
_CONFIG_KEY = "shoal.model_config"


def _gguf_cache(path: Path) -> tuple[ModelConfig, Path | None]:
    """The GGUF file's configuration and its weights cache file, written first if missing
    (None where it could not be written: the caller reads the GGUF file itself)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cached = cache_entry(path, "weights") / f"v{_WEIGHTS_CACHE_FORMAT}.safetensors"
    if cached.is_file():
        try:
            with safe_open(str(cached), framework="pt") as f:
                return ModelConfig(**json.loads(f.metadata()[_CONFIG_KEY])), cached
        except Exception as e:  # a corrupt or foreign entry is rewritten below
            log.warning("rewriting the unreadable weights cache %s (%s)", cached, e)
    cfg, weights = _read_gguf(path)
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(tmp), metadata={_CONFIG_KEY: json.dumps(dataclasses.asdict(cfg))})
        os.replace(tmp, cached)  # atomic: concurrent writers (tensor-parallel ranks) agree
        for stale in cached.parent.glob("v*.safetensors"):  # older formats' files, never read
            if stale != cached:
                with contextlib.suppress(OSError):
                    stale.unlink()
    except Exception as e:  # a read-only or full disk costs start-up time, nothing else
        log.warning("could not write the weights cache %s (%s)", cached, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return cfg, None
    return cfg, cached


def _load_gguf(path: Path, dtype: torch.dtype, shard: Shard | None) -> tuple[ModelConfig, Weights]:
    from safetensors import safe_open

    cfg, cached = _gguf_cache(path)
    weights: Weights = {}

    def add(name: str, w: torch.Tensor) -> None:
        if name.endswith(_Q4_SUFFIXES):  # split as their weight is (rows, or inputs by groups)
            weight = name.removesuffix(Q4_LEVELS).removesuffix(Q4_SCALE_MIN) + ".weight"
            weights[name] = shard(weight, w) if shard else w
        else:
            weights[name] = (shard(name, w) if shard else w).to(dtype)

    if cached is None:
        for name, w in _read_gguf(path)[1].items():
            add(name, w)
        return cfg, weights
    with safe_open(str(cached), framework="pt") as f:  # one full tensor in memory at a time
        for name in f.keys():
            add(name, f.get_tensor(name))
    _check_complete(cfg, weights, path)
    return cfg, weights


def _read_gguf(path: Path) -> tuple[ModelConfig, Weights]:
    """The GGUF file's configuration and its tensors in float32, Hugging Face names and layout."""
    import gguf

    reader = _gguf_reader(path)
    cfg = _gguf_config(reader, path)
    weights: Weights = {}
    for t in reader.tensors:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"tensor {t.name} has quantization type {t.tensor_type.name}, which cannot be "
                "dequantized"
            ) from e
        # GGUF lists dimensions innermost first; dequantize already gives (out, in) for matrices.
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        name = _hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs, which plain Llama does not use
        tensors = {name: arr}
        q4 = _q4_levels(t) if name.endswith("_proj.weight") else None
        if q4 is not None:
            # Q4_0's d (q - 8) is -0.0 at q = 8 where d < 0; as d q + m (the levels' kernel) it
            # is +0.0. Adding zero makes the weight's zeros positive, so the two agree bit for
            # bit (worker.linear checks) and nothing else changes.
            tensors[name] = arr + np.float32(0)
            prefix = name.removesuffix(".weight")
            tensors[prefix + Q4_LEVELS], tensors[prefix + Q4_SCALE_MIN] = q4
        for key, a in tensors.items():
            if name.endswith("q_proj.weight"):
                a = _unpermute_rope(a, cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                a = _unpermute_rope(a, cfg.num_kv_heads)
            # The arrays are read-only views of a memory map: copy before handing them to torch.
            weights[key] = torch.from_numpy(np.array(a, copy=True))
    _check_complete(cfg, weights, path)
    return cfg, weights


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    return None


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def _hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"model directory has no config.json: {path}")
    c = json.loads(config_file.read_text())
    archs = c.get("architectures") or []
    if c.get("model_type") != "llama" and not set(archs) & set(HF_LLAMA_ARCHITECTURES):
        raise UnsupportedModelError(
            f"unsupported architecture {archs or c.get('model_type')!r} in {config_file}; "
            f"supported: {HF_LLAMA_ARCHITECTURES}"
        )
    rope = c.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or c.get("rope_scaling"):
        raise UnsupportedModelError(f"RoPE scaling is not supported ({path})")
    n_head = int(c["num_attention_heads"])
    eos = c.get("eos_token_id")
    return ModelConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=n_head,
        num_kv_heads=int(c.get("num_key_value_heads") or n_head),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // n_head),
        rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )


def _load_hf_dir(path: Path, dtype: torch.dtype, shard: Shard | None) -> tuple[ModelConfig, Weights]:
    from safetensors import safe_open

    cfg = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model directory has no *.safetensors files: {path}")
    weights: Weights = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:  # one tensor in memory at a time
            for name in st.keys():
                t = st.get_tensor(name)
                weights[name] = (shard(name, t) if shard else t).to(dtype)
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        raise ModelNotFoundError(f"lm_head.weight missing and embeddings not tied: {path}")
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_complete(cfg, weights, path)
    return cfg, weights


def _check_complete(cfg: ModelConfig, weights: Weights, path: Path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        needed += [f"model.layers.{i}.{n}" for n in _GGUF_LAYER_NAMES.values()]
    if not cfg.tie_word_embeddings:
        needed.append("lm_head.weight")
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ModelNotFoundError(f"{path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
