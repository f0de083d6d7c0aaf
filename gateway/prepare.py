"""From API requests to the fleet's: token ids, sampling parameters and what the gateway does to
the text (stop strings, special tokens, tool calls), checked so that a bad request gets a 400
naming its parameter before anything is queued.

`RequestPreparation` is a part of `gateway.app.Gateway`, which gives it the models it serves
(`catalog`: each one's tokenizer, names and context window), `max_overflow_windows`,
`tool_call_parser` and `reasoning_parser`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from gateway.models import ModelCatalog, ServedModel
from gateway.reasoning import END, Reasoning
from gateway.schemas import (
    MAX_REQUESTS,
    APIError,
    BatchChatRequest,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
)
from gateway.tools import ToolCalls
from shoal.sampling_params import InvalidSamplingParams, SamplingParams
from shoal.structured_output import InvalidStructuredOutput, StructuredOutput


@dataclass
class Prepared:
    """One request ready for the fleet, for `model`, with what the gateway itself does to its
    text: cut it at `stops` (keeping the stop string with `include_stop_str`), and leave
    special tokens out unless `skip_special_tokens` is False; with `tools`, its text is tool
    calls; with `reasoning`, its text is the model's thinking, then its answer."""

    model: ServedModel
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    priority: int = 0
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    tools: ToolCalls | None = None
    reasoning: Reasoning | None = None


class PromptTooLong(APIError):
    """A prompt that leaves no room in the context window for a token (400)."""


class RequestPreparation:
    """Turns completions and chat requests into `Prepared` requests (see the module)."""

    catalog: ModelCatalog
    max_overflow_windows: int
    tool_call_parser: str | None  # reads tool_choice "auto" replies (None: "auto" is refused)
    reasoning_parser: str | None  # splits chat replies into reasoning and content (None: not)

    def _params(self, req: GenerationRequest, model: ServedModel, max_tokens: int | None,
                prompt_len: int, logprobs: bool, top_logprobs: int = 0,
                prompt_logprobs: int | None = None,
                constraint: StructuredOutput | None = None) -> SamplingParams:
        if req.prompt_logprobs is not None and req.stream:
            raise APIError("prompt_logprobs with stream is not supported", param="prompt_logprobs")
        window = model.max_model_len
        room = window - prompt_len
        if room < 1:
            raise PromptTooLong(f"the prompt has {prompt_len} tokens; the context window is "
                                f"{window}",
                                param="messages" if isinstance(req, ChatRequest) else "prompt")
        if req.context_overflow == "error":
            max_tokens = min(max_tokens or room, room)
        else:
            # Past the window only when asked for, and at most `max_overflow_windows` windows'
            # worth: an unbounded request would hold a worker's batch slot forever.
            limit = self.max_overflow_windows * window
            if max_tokens is not None and max_tokens > limit:
                raise APIError(f"with context_overflow, max_tokens is at most {limit} "
                               f"({self.max_overflow_windows} context windows)", param="max_tokens")
            max_tokens = max_tokens or room
        try:
            for name in ("stop_token_ids", "allowed_token_ids"):
                model.check_token_ids(getattr(req, name) or [], name)
            structured = constraint or self._structured_output(req)
            if structured is not None and req.allowed_token_ids:
                raise APIError("allowed_token_ids cannot be combined with a structured output",
                               param="allowed_token_ids")
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, min_p=req.min_p, top_k=max(req.top_k, 0),
                                  seed=req.seed,
                                  stop_token_ids=tuple(req.stop_token_ids or ()),
                                  allowed_token_ids=tuple(req.allowed_token_ids or ()),
                                  bad_words_token_ids=_bad_words(req.bad_words or (), model),
                                  ignore_eos=req.ignore_eos,
                                  min_tokens=min(req.min_tokens, max_tokens), logprobs=logprobs,
                                  top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                                  presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty,
                                  repetition_penalty=req.repetition_penalty,
                                  logit_bias=_logit_bias(req.logit_bias, model.vocab_size),
                                  context_overflow=req.context_overflow, n_keep=req.n_keep,
                                  n_discard=req.n_discard, cache_salt=req.cache_salt,
                                  structured_output=structured)
        except InvalidSamplingParams as e:
            raise APIError(str(e)) from e

    @staticmethod
    def _structured_output(req: GenerationRequest) -> StructuredOutput | None:
        """The request's constraint on its output (`response_format` or `structured_outputs`),
        compiled once here so that a bad one is refused before it is queued.

        Raises:
            APIError: both are given, or the constraint does not compile.
        """
        fmt = req.response_format.constraint() if req.response_format else None
        if fmt is not None and req.structured_outputs is not None:
            raise APIError("give response_format or structured_outputs, not both",
                           param="structured_outputs")
        param = "response_format" if fmt is not None else "structured_outputs"
        constraint = fmt or (req.structured_outputs.constraint() if req.structured_outputs
                             else None)
        if constraint is not None:
            try:
                constraint.check()
            except InvalidStructuredOutput as e:
                raise APIError(f"{param}: {e}", param=param) from e
        return constraint

    def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[Prepared]]:
        """The response's id and one request per prompt (a string, token ids, or a list of
        either), in order: the id itself for one prompt, `<id>-<k>` for prompt k of several.

        Raises:
            APIError: an empty prompt, a token id outside the vocabulary, too many requests, a
                model not served here (404).
        """
        model = self.catalog.get(req.model)
        prompt = req.prompt
        batch = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) * req.n > MAX_REQUESTS:
            raise APIError(f"{len(batch)} prompts x n={req.n} choices is more than "
                           f"{MAX_REQUESTS} requests", param="n")
        # The engine scores a prompt once, with the larger of what echo and prompt_logprobs ask.
        scored = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs)
                  if k is not None]
        rid = f"cmpl-{uuid.uuid4().hex}"
        out = []
        for k, item in enumerate(batch):
            ids = _truncate(model.prompt_ids(item), req.truncate_prompt_tokens)
            params = self._params(req, model, req.max_tokens, len(ids), req.logprobs is not None,
                                  req.logprobs or 0, max(scored, default=None))
            out.append(_prepared(model, rid if len(batch) == 1 else f"{rid}-{k}", ids, params,
                                 req))
        return rid, out

    def chat_prompt(self, req: ChatRequest) -> tuple[ServedModel, list[int]]:
        """The model a chat request names and its prompt's token ids (the chat template over
        its messages and tools).

        Raises:
            APIError: anything `ModelCatalog.get` or `ServedModel.chat_ids` refuse.
        """
        model = self.catalog.get(req.model)
        return model, _truncate(model.chat_ids(
            req.messages, req.add_generation_prompt, req.continue_final_message,
            req.chat_template_kwargs,
            [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None),
            req.truncate_prompt_tokens)

    def prepare_chat(self, req: ChatRequest) -> Prepared:
        """The chat request ready for the fleet.

        Raises:
            APIError: anything `ModelCatalog.get`, `ServedModel.chat_ids`, `ToolCalls.of` or the
                sampling parameters refuse.
        """
        tools = ToolCalls.of(req, self.tool_call_parser)
        model, ids = self.chat_prompt(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        params = self._params(req, model, req.max_completion_tokens or req.max_tokens, len(ids),
                              req.logprobs, req.top_logprobs or 0, req.prompt_logprobs,
                              constraint=tools.constraint if tools else None)
        reasoning = Reasoning.of(self.reasoning_parser, req.chat_template_kwargs)
        if reasoning is not None and params.structured_output is not None:
            # The model thinks freely; its constraint (structured outputs, tool calls made by
            # them) holds from the end of its thinking, as vLLM applies it with a parser.
            params = replace(params, structured_output_after=tuple(
                model.tokenizer.encode(END, add_special_tokens=False)))
        return replace(_prepared(model, f"chatcmpl-{uuid.uuid4().hex}", ids, params, req),
                       tools=tools, reasoning=reasoning)

    def prepare_chat_batch(self, req: BatchChatRequest) -> tuple[str, list[Prepared]]:
        """The batch's id and one request per conversation, in order, with ids `<id>-<k>`.

        Raises:
            APIError: what `prepare_chat` refuses of any conversation.
        """
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return rid, [replace(self.prepare_chat(req.model_copy(update={"messages": messages})),
                             request_id=f"{rid}-{k}")
                     for k, messages in enumerate(req.messages)]

    @staticmethod
    def choices(prompts: list[Prepared], n: int) -> list[Prepared]:
        """The requests of `n` choices of each prompt, in OpenAI's order (choice index k * n + i
        is choice i of prompt k): the prompts themselves for n = 1; else ids `<id>-<i>` and,
        when seeded, seed + i (unseeded choices draw seeds of their own)."""
        if n == 1:
            return prompts
        return [replace(p, request_id=f"{p.request_id}-{i}",
                        params=replace(p.params,
                                       seed=None if p.params.seed is None else p.params.seed + i))
                for p in prompts for i in range(n)]


def _prepared(model: ServedModel, request_id: str, ids: list[int], params: SamplingParams,
              req: GenerationRequest) -> Prepared:
    if model.lora is not None:  # a LoRA adapter's request runs on its base model's workers
        params = replace(params, lora_name=model.lora)
    return Prepared(model, request_id, ids, params, _stops(req.stop), req.priority,
                    req.include_stop_str_in_output, req.skip_special_tokens)


def _bad_words(words, model: ServedModel) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token id sequences: each word as it would be written at the start
    of the text and after a space (the two tokenize differently), without its leading spaces;
    the second only where it differs from the first."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(model.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(model.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [w for w in dict.fromkeys((bare, spaced)) if w]
    return tuple(out)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as strings) as (token id, bias) pairs.

    Raises:
        APIError: a key is not a token id in the model's vocabulary of `vocab` tokens.
    """
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdecimal() or int(key) >= vocab:
            raise APIError(f"logit_bias: {key!r} is not a token id in [0, {vocab})",
                           param="logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


def _truncate(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (all when None)."""
    return ids if keep is None else ids[-keep:]


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
