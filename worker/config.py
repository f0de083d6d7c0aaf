"""Configuration of the model and of the engine that runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_BACKENDS = ("auto", "torch", "triton")
QUANTIZATIONS = ("none", "int8", "int4", "w8a8")  # see worker.linear


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from GGUF metadata or a Hugging Face `config.json`.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_layers: number of decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than `num_heads`).
        head_dim: width of one head.
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon of RMSNorm.
        max_position_embeddings: the model's context window in tokens.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        eos_token_id: end-of-sequence token id (None if the model has none).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup: draft tokens from the request's own context,
    checked by the model in one pass (vLLM's `--speculative-config`, method "ngram"; Saxena 2023,
    "Prompt Lookup Decoding"; Leviathan et al. 2023, "Fast Inference from Transformers via
    Speculative Decoding").

    Attributes:
        method: "ngram".
        num_speculative_tokens: most draft tokens per request per iteration.
        prompt_lookup_max: longest suffix (tokens) looked up in the context.
        prompt_lookup_min: shortest suffix (tokens) that may propose drafts.
        disable_by_batch_size: iterations with more decodes than this draft nothing: a decode
            of a few rows reads every weight once whatever its rows (memory-bound), one of many
            rows pays for each (compute-bound), and rejected drafts would cost real time.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "disable_by_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config`: a JSON object of the attributes above, e.g.
        `{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}`.

        Raises:
            ValueError: not a JSON object, an unknown key, a value of the wrong type or range.
        """
        import json

        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        for name, value in fields.items():
            want = str if name == "method" else int
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"--speculative-config: {name} must be {want.__name__}, "
                                 f"got {value!r}")
        if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
            fields["prompt_lookup_min"] = min(cls.prompt_lookup_min, fields["prompt_lookup_max"])
        return cls(**fields)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one worker's engine.

    Attributes:
        dtype: dtype of weights, activations and the K/V cache (the CLI's default, `--dtype auto`,
            chooses per machine: `resolve_dtype`).
        block_size: tokens per K/V-cache block.
        kv_cache_bytes: memory for the K/V cache in bytes; None uses `kv_cache_memory_fraction`.
        kv_cache_memory_fraction: share of the machine's available memory for the K/V cache when
            `kv_cache_bytes` is None.
        max_num_seqs: most requests in one iteration.
        max_num_batched_tokens: most tokens (prefill plus decode) in one iteration; longer
            prompts are prefilled in chunks over several iterations.
        max_model_len: the context window served, at most the model's own; None means the model's.
        quantization: "none"; "int8" / "int4" for weight-only quantized matmuls in iterations
            of a few rows, the bfloat16 weights serving larger ones (int4 on AVX2-only and
            AVX-512 VNNI CPUs: every size, int8 activations per block of 32); "w8a8" for int8
            weight-only in small iterations and int8 activations in large ones (worker.linear).
            CPU only.
        fast_paths: use the C++ kernels (worker/ops.py) and oneDNN-prepacked weights
            (worker/linear.py) where available; False runs the plain torch reference everywhere.
        device: "cpu", "cuda" or "cuda:N"; None is CUDA where torch sees one, else the CPU.
        attention_backend: "auto" (Triton on CUDA, the torch path on the CPU), "torch" or
            "triton" (worker.attention.make_backend).
        enable_prefix_caching: requests whose prompts begin with the same full blocks of tokens
            (and carry the same `cache_salt`) share those blocks' K/V instead of computing them
            again; blocks no request owns stay cached until evicted (worker.kv_cache).
        speculative: speculative decoding (SpeculativeConfig), None for none.
        lora_modules: LoRA adapters served beside the model, as (name, PEFT directory) pairs
            (worker.lora); requests name one in `SamplingParams.lora_name`.
        enforce_eager: run every iteration op by op; False (the default) replays CUDA graphs
            for decode iterations on a GPU (worker.cuda_graphs; no effect on the CPU).
    """

    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    quantization: str = "none"
    fast_paths: bool = True
    device: str | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    enforce_eager: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.quantization != "none" and self.dtype == torch.float16:
            raise ValueError(f"--quantization {self.quantization} needs bfloat16 or float32")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(f"unknown device {self.device!r}: {e}") from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: torch sees no CUDA device here")
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.quantization != "none" and (self.device or default_device()) != "cpu":
            raise ValueError(f"--quantization {self.quantization} runs on the CPU only (its "
                             "kernels are CPU ones)")
        if not 0.0 < self.kv_cache_memory_fraction < 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1)")


def default_device() -> str:
    """CUDA where torch sees a GPU, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", "bfloat16", "float32")  # what --dtype takes


def resolve_dtype(name: str, device: str | None = None) -> torch.dtype:
    """The serving dtype `--dtype name` means on `device` (None: `default_device()`).

    "auto" is bfloat16 on CUDA and on CPUs that multiply bfloat16 faster than float32 (AMX, Arm
    BF16, AMD's AVX512_BF16: `cpu_ops.cpu_prefers_bfloat16`), float32 on other CPUs. Without
    bfloat16 instructions a bfloat16 matmul is emulated through float32 and W64 ran at 44.6
    tokens/s against float32's 155.2 (a 2-core Xeon without exposed AMX or AVX512_BF16); with
    AVX512_BF16 but no AMX an Intel core gains nothing from it, and W64 ran at 147.6 against
    178.0 (docs/benchmarks.md, sessions 7 and 43). A CPU whose flags cannot be read gets
    bfloat16.

    Raises:
        ValueError: a name other than "auto" or a key of DTYPES.
    """
    if name == "auto":
        if (device or default_device()).startswith("cuda"):
            return torch.bfloat16
        from worker.cpu_ops import cpu_prefers_bfloat16

        return torch.float32 if cpu_prefers_bfloat16() is False else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
