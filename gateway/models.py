"""The models one gateway serves, each with what the gateway needs of it to turn text into a
request and tokens back into text: its names in the API, its tokenizer and chat template, and
its context window (learned from the workers serving it).

A fleet may serve several models: each worker serves one and advertises its name, the
scheduler places a request only on workers of the model it names (scheduler/core.py), and the
gateway tokenizes it with that model's tokenizer (`ServedModel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from gateway.schemas import APIError, ChatMessage
from shoal.model_files import load_tokenizer, model_id, resolve_model_path

DEFAULT_MAX_MODEL_LEN = 8192  # until a worker of the model has been seen


@dataclass
class ServedModel:
    """One model served through this gateway.

    Attributes:
        names: its names in the API: requests may give any, responses carry the first (the
            name its workers advertise).
        path: its GGUF file or Hugging Face directory, for the tokenizer.
        chat_template: a Jinja template used instead of the model's own; None keeps it.
        tokenizer: the transformers tokenizer, once `load` has run.
        max_model_len: its context window in tokens, from its workers' heartbeats.
        loras: the LoRA adapters its workers serve (`--lora-modules`), as (name, directory)
            pairs: each is a model of the API too (`LoRAModel`).
    """

    names: tuple[str, ...]
    path: Path
    chat_template: str | None = None
    tokenizer: Any = None
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    loras: tuple[tuple[str, str], ...] = ()
    lora = None  # the adapter a request for it runs with: none (`LoRAModel` has one)

    @classmethod
    def at(cls, model: str | None, names: tuple[str, ...] = (),
           chat_template: str | None = None) -> ServedModel:
        """The model at path `model` (None: the default model), named `names` (default: its
        file's name, `model_id`).

        Raises:
            ModelNotFoundError: no model there.
        """
        path = resolve_model_path(model)
        return cls(tuple(names) or (model_id(path),), path, chat_template)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def fleet_name(self) -> str:
        """The name its workers advertise, which its requests are queued under."""
        return self.name

    def load(self) -> None:
        """Load the tokenizer (blocking: seconds for a GGUF file not yet cached)."""
        tokenizer = load_tokenizer(self.path)
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """One prompt's token ids.

        Raises:
            APIError: it is empty or names a token id outside the vocabulary.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
            self.check_token_ids(ids, "prompt")
        if not ids:
            raise APIError("the prompt is empty", param="prompt")
        return ids

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Raises APIError (400, naming `param`) unless every id is in the vocabulary."""
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(f"token ids must be in [0, {vocab})", param=param)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as logprobs name tokens (a piece of a multi-byte
        character shows as U+FFFD)."""
        return self.tokenizer.decode([token_id])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                 continue_final_message: bool = False,
                 template_kwargs: dict[str, Any] | None = None,
                 tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids a chat request's prompt is: the chat template over the messages, with
        the assistant's turn opened (`add_generation_prompt`), or the last message left open
        for the model to go on with (`continue_final_message`, as vLLM's); `template_kwargs`
        are more variables for the template, and `tools` the functions it may show the model
        (templates without tool support leave them out).

        Raises:
            APIError: both options at once, a template variable that is one of
                `apply_chat_template`'s own arguments, or a template that fails on the
                messages.
        """
        if add_generation_prompt and continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                           param="continue_final_message")
        kwargs = dict(template_kwargs or {})
        if reserved := sorted(kwargs.keys() & _TEMPLATE_ARGUMENTS):
            raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        try:
            return list(self.tokenizer.apply_chat_template(
                [m.for_template() for m in messages], add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, tokenize=True,
                return_dict=True, **kwargs)["input_ids"])
        except (ValueError, TemplateError) as e:  # jinja's, or transformers' own checks
            raise APIError(f"the chat template cannot render these messages: {e}",
                           param="messages") from e


class LoRAModel:
    """A LoRA adapter of a served model, as the API names it: a model of its own to clients,
    which has the base model's tokenizer, template and window, and whose requests run on the
    base model's workers with the adapter (`SamplingParams.lora_name`), as vLLM serves
    `--lora-modules`.

    Args:
        base: the model the adapter was trained on.
        name: its name in the API (and the workers').
        path: its PEFT directory (what `/v1/models` lists as its `root`).
    """

    def __init__(self, base: ServedModel, name: str, path: str) -> None:
        self.base, self.names, self.lora, self.adapter_path = base, (name,), name, Path(path)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def fleet_name(self) -> str:
        return self.base.name

    def __getattr__(self, attr: str) -> Any:  # the rest is the base model's
        return getattr(self.base, attr)


class ModelCatalog:
    """The models a gateway serves, by every name; the first is the default of a request that
    names none.

    Raises:
        ValueError: no models, or two models sharing a name.
    """

    def __init__(self, models: list[ServedModel]) -> None:
        if not models:
            raise ValueError("a gateway serves at least one model")
        self.models = list(models)
        self._by_name: dict[str, ServedModel | LoRAModel] = {}
        for m in [*models, *(LoRAModel(m, name, path) for m in models for name, path in m.loras)]:
            for name in m.names:
                if name in self._by_name:
                    raise ValueError(f"two models are named {name!r}; give them distinct "
                                     "names (--served-model-name, --lora-modules, or their "
                                     "files' names)")
                self._by_name[name] = m
        self._static = set(self._by_name)
        # Adapters loaded at run time (`Keys.loras`), by base model: name -> directory.
        self._runtime: dict[str, dict[str, str]] = {m.name: {} for m in models}

    def is_static(self, name: str) -> bool:
        """Whether `name` is a model or adapter given on the command line (which the API may
        not unload)."""
        return name in self._static

    def set_runtime_loras(self, base: ServedModel, adapters: dict[str, str]) -> None:
        """Serve exactly `adapters` (name -> directory) as `base`'s run-time LoRA adapters,
        as the fleet lists them; a name taken by a model or a `--lora-modules` adapter is
        left to it."""
        old = self._runtime[base.name]
        if old == adapters:
            return
        for name in old.keys() - adapters.keys():
            self._by_name.pop(name, None)
        for name, path in adapters.items():
            if name not in self._static and old.get(name) != path:
                self._by_name[name] = LoRAModel(base, name, path)
        self._runtime[base.name] = {n: p for n, p in adapters.items() if n not in self._static}

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def names(self) -> list[str]:
        """Every name, each model's in order, then the LoRA adapters' (`--lora-modules`',
        then those loaded at run time)."""
        return list(self._by_name)

    def get(self, name: str | None) -> ServedModel | LoRAModel:
        """The model a request names (None: the default).

        Raises:
            APIError: 404 for a name no model here has.
        """
        if name is None:
            return self.default
        model = self._by_name.get(name)
        if model is None:
            raise APIError(f"model {name!r} is not served here; try "
                           f"{', '.join(repr(n) for n in self.names)}",
                           status=404, param="model", kind="not_found_error")
        return model

    def served_by(self, worker_model: str) -> ServedModel | None:
        """The model a worker advertising `worker_model` (a model's first name) serves."""
        model = self._by_name.get(worker_model)
        return model if model is not None and model.name == worker_model else None


# `apply_chat_template`'s own arguments, which `chat_template_kwargs` may not pass as template
# variables.
_TEMPLATE_ARGUMENTS = {"conversation", "tools", "documents", "chat_template",
                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs"}
