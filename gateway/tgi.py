"""Hugging Face TGI's own API (`POST /generate`, `POST /generate_stream`, `POST /` and
`GET /info`), on top of completions, for the clients written against text-generation-inference
(`huggingface_hub.InferenceClient.text_generation`, LangChain's and LlamaIndex's TGI classes).

- `inputs` is the prompt, sent as it is (no chat template), and `parameters` become a completions
  request's: `max_new_tokens` (100 when not given), `temperature`, `top_k`, `top_p`, `seed`,
  `repetition_penalty`, `frequency_penalty`, `stop` (kept at the end of the text, as TGI keeps
  it), `truncate` (the prompt's last tokens), `grammar` (a JSON Schema or a regular expression
  the text matches).
- Sampling is TGI's: greedy unless `do_sample` is true or `temperature` (other than 1),
  `top_k` or `top_p` (below 1) is given. A sampled request without a `seed` gets one, which
  `details` reports.
- `details` adds why the text ended (`length`, `eos_token` or `stop_sequence`), each token with
  its logprob and whether it is special, `top_n_tokens` most likely tokens at each step and,
  with `decoder_input_details`, the prompt's tokens with their logprobs (not when streaming).
- A stream is TGI's: a `data:` line per token (`index` from 1, `token`, `top_tokens`), the last
  one also carrying `generated_text` and, with `details`, `details`; no `[DONE]`. A token whose
  text the detokenizer holds back (a piece of a multi-byte character) has an empty `text`; the
  next carries it. Where the fleet sends several tokens at once (speculative decoding), the text
  they add goes with the last of them.
- `POST /` is TGI's compatibility route: `stream` in the body picks the stream or a list of one
  answer.
- `return_full_text` puts `inputs` before the generated text. `best_of` above 1, `typical_p`,
  `watermark` and `adapter_id` are refused.
- Errors on these paths have TGI's body, `{"error": message, "error_type": kind}`; a request
  that is not valid gets 422, as TGI answers it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.models import ServedModel
from gateway.schemas import (
    INT32_MAX,
    MAX_TOP_LOGPROBS,
    SSE_DATA,
    CompletionRequest,
    StructuredOutputs,
    refusals_named,
    unsupported,
)
from gateway.sse import ChunkGroup
from shoal.messages import TokenEvent

PATHS = ("/generate", "/generate_stream", "/")  # their errors take TGI's body
DEFAULT_MAX_NEW_TOKENS = 100  # TGI's when `max_new_tokens` is not given

# TGI's error kinds by HTTP status; a request that is not valid is 422 there, not 400.
_ERROR_TYPES = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                422: "validation", 424: "generation", 429: "overloaded", 503: "unavailable"}


def owns(path: str) -> bool:
    """Whether a request path is TGI's API (`/` only serves TGI's POST: its GET is the
    playground page, which cannot fail)."""
    return path in PATHS


def status_of(status: int) -> int:
    """The HTTP status TGI answers where shoal's API answers `status` (400 -> 422)."""
    return 422 if status == 400 else status


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An error as TGI answers it, by the HTTP status it goes with (after `status_of`). TGI's
    body has no field for the parameter at fault: the message names it."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    kind = _ERROR_TYPES.get(status, "internal" if status >= 500 else "request")
    return {"error": message, "error_type": kind}


class ErrorBody(BaseModel):
    """TGI's error body."""

    error: str
    error_type: str


class Grammar(BaseModel):
    """TGI's `grammar`: the text is JSON matching a JSON Schema, or matches a regular
    expression."""

    model_config = ConfigDict(strict=True)

    type: Literal["json", "regex"]
    value: dict[str, Any] | str


class Parameters(BaseModel):
    """TGI's `parameters` (null is the same as absent, as TGI's clients send them)."""

    model_config = ConfigDict(strict=True)

    max_new_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    do_sample: bool = False
    temperature: float | None = Field(default=None, gt=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=1, le=INT32_MAX)
    top_p: float | None = Field(default=None, gt=0.0, lt=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stop: list[str] | None = Field(default=None, max_length=64)
    truncate: int | None = Field(default=None, ge=1, le=INT32_MAX)
    return_full_text: bool | None = None
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    grammar: Grammar | None = None
    best_of: Annotated[int | None, unsupported((None, 1), "best_of above 1")] = None
    typical_p: Annotated[float | None, unsupported((None,), "typical_p")] = None
    watermark: Annotated[bool, unsupported((False,), "watermark")] = False
    adapter_id: Annotated[str | None, unsupported((None,), "adapter_id")] = None

    @property
    def sampling(self) -> bool:
        """TGI's rule: sample when asked to or when any warper is set."""
        return (self.do_sample or self.temperature not in (None, 1.0) or self.top_k is not None
                or self.top_p is not None)


class GenerateRequest(BaseModel):
    """`POST /generate` and `/generate_stream`; `stream` picks the form on `POST /`."""

    model_config = ConfigDict(strict=True)

    inputs: str = Field(min_length=1)
    parameters: Parameters = Field(default_factory=Parameters)
    stream: bool = False

    def to_completion(self, stream: bool) -> CompletionRequest:
        """The completions request this generation is (`stream`: whether it streams)."""
        p = self.parameters
        # Per-token logprobs are in every streamed token and in `details`.
        logprobs = (p.top_n_tokens or 0) if stream or p.details else None
        return CompletionRequest(
            prompt=self.inputs, max_tokens=p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            temperature=(p.temperature or 1.0) if p.sampling else 0.0,
            top_k=p.top_k or -1, top_p=p.top_p or 1.0,
            seed=(p.seed if p.seed is not None else random.getrandbits(63))
            if p.sampling else None,
            repetition_penalty=p.repetition_penalty or 1.0,
            frequency_penalty=p.frequency_penalty or 0.0,
            stop=p.stop or None, include_stop_str_in_output=bool(p.stop),
            truncate_prompt_tokens=p.truncate, logprobs=logprobs,
            prompt_logprobs=0 if p.decoder_input_details else None, stream=stream,
            structured_outputs=None if p.grammar is None else StructuredOutputs.model_validate(
                {"json" if p.grammar.type == "json" else "regex": p.grammar.value}))


# A completions request's parameters that a refusal may name, by TGI's names.
_PARAMS = {"prompt": "inputs", "max_tokens": "parameters.max_new_tokens",
           "stop": "parameters.stop", "seed": "parameters.seed",
           "truncate_prompt_tokens": "parameters.truncate",
           "prompt_logprobs": "parameters.decoder_input_details",
           "logprobs": "parameters.top_n_tokens", "structured_outputs": "parameters.grammar",
           "structured_outputs.json": "parameters.grammar.value",
           "structured_outputs.regex": "parameters.grammar.value"}


def refusals() -> contextlib.AbstractContextManager[None]:
    """Refusals of the completions request a TGI request amounts to, naming its parameters."""
    return refusals_named(_PARAMS)


_WHY = {401: "missing or invalid API key", 422: "invalid request",
        424: "the fleet failed the request", 429: "overloaded or rate limited (see Retry-After)",
        503: "the queue is unavailable"}
_ERRORS = {code: {"model": ErrorBody, "description": why} for code, why in _WHY.items()}
# For the OpenAPI schema.
GENERATE_RESPONSES = {200: {"description": "the generated text"}, **_ERRORS}
STREAM_RESPONSES = {200: {"description": "a `data:` line per token",
                          "content": {"text/event-stream": {"schema": SSE_DATA}}},
                    **_ERRORS}


class GenerationShape:
    """One generation's answer and stream events.

    Args:
        req: the request.
        model: the model it runs on (its tokenizer names tokens and tells special ones).
        prompt_ids: the prompt's token ids (after `truncate`).
        seed: the seed it samples with (None: greedy).
    """

    def __init__(self, req: GenerateRequest, model: ServedModel, prompt_ids: list[int],
                 seed: int | None) -> None:
        self.req, self.params, self.model = req, req.parameters, model
        self.prompt_ids, self.seed = prompt_ids, seed
        self.special = set(model.tokenizer.all_special_ids)

    def token(self, token_id: int, text: str, logprob: float | None) -> dict[str, Any]:
        return {"id": token_id, "text": text, "logprob": logprob,
                "special": token_id in self.special}

    def tops(self, top: list[list] | None) -> list[dict[str, Any]]:
        """A step's most likely tokens, from `TokenEvent.top_logprobs`' [id, logprob] pairs."""
        return [self.token(t, self.model.token_text(t), lp) for t, lp in top or ()]

    def generated_text(self, text: str) -> str:
        return self.req.inputs + text if self.params.return_full_text else text

    def finish_reason(self, text: str, last: TokenEvent) -> str:
        """TGI's: `length`, `stop_sequence` (the text ends with a stop string, which it keeps)
        or `eos_token` (any other stop: an end-of-sequence or stop token)."""
        if last.finish_reason == "length":
            return "length"
        if any(s and text.endswith(s) for s in self.params.stop or ()):
            return "stop_sequence"
        return "eos_token"

    def details(self, text: str, last: TokenEvent, ids: list[int], logprobs: list,
                tops: list, prefill: list[dict[str, Any]]) -> dict[str, Any]:
        """`details` of a whole answer: its tokens (each one's text on its own) and each
        step's most likely tokens."""
        return {"finish_reason": self.finish_reason(text, last),
                "generated_tokens": last.completion_tokens, "seed": self.seed,
                "prefill": prefill,
                "tokens": [self.token(t, self.model.token_text(t), lp)
                           for t, lp in zip(ids, logprobs)],
                "top_tokens": [self.tops(top) for top in tops] if self.params.top_n_tokens
                else []}

    def prefill(self, logprob_of: Callable[[int], float | None]) -> list[dict[str, Any]]:
        """The prompt's tokens for `decoder_input_details` (`logprob_of(position)`; the first
        has none), else []."""
        if not self.params.decoder_input_details:
            return []
        return [{"id": t, "text": self.model.token_text(t),
                 "logprob": None if i == 0 else logprob_of(i)}
                for i, t in enumerate(self.prompt_ids)]

    async def events(self, run: AsyncIterator[tuple[str, TokenEvent]]
                     ) -> AsyncIterator[ChunkGroup]:
        """The stream's events, grouped by fleet event as `gateway.sse.EventStream` writes
        them, from `gateway.app.Gateway.run`'s (text, event) pairs; a failure ends the stream
        with TGI's error event."""
        text, index, last_id = "", 0, None
        async with contextlib.aclosing(run) as stream:  # leaving early cancels the request
            async for piece, ev in stream:
                if ev.finish_reason == "error":
                    # A request the fleet cannot serve is TGI's validation error; the fleet
                    # failing it, its generation error.
                    status = status_of(ev.error_status or 424)
                    yield [error_body(status if status < 500 else 424,
                                      ev.error or "generation failed")], True
                    return
                text += piece
                tops = ev.top_logprobs or [None] * len(ev.token_ids)
                group = []
                for k, (t, lp, top) in enumerate(zip(ev.token_ids, ev.logprobs, tops)):
                    index, last_id = index + 1, t
                    group.append({"index": index,
                                  "token": self.token(t, piece if k == len(ev.token_ids) - 1
                                                      else "", lp),
                                  "top_tokens": self.tops(top) if self.params.top_n_tokens
                                  else None,
                                  "generated_text": None, "details": None})
                if ev.finish_reason is None:
                    if group:
                        yield group, False
                    continue
                if not group:  # an end that brought no token: closed by an empty one
                    group.append({"index": index, "token": self.token(
                        last_id if last_id is not None else 0, "", None) | {"special": True},
                        "top_tokens": None, "generated_text": None, "details": None})
                group[-1]["generated_text"] = self.generated_text(text)
                if self.params.details:
                    group[-1]["details"] = {"finish_reason": self.finish_reason(text, ev),
                                            "generated_tokens": ev.completion_tokens,
                                            "seed": self.seed, "input_length":
                                            len(self.prompt_ids)}
                yield group, True
                return


def info(model: ServedModel, version: str) -> dict[str, Any]:
    """TGI's `GET /info`, for the default model."""
    return {"model_id": model.name, "model_sha": None, "model_dtype": None,
            "model_device_type": None, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": None, "max_best_of": 1, "max_stop_sequences": 64,
            "max_input_tokens": model.max_model_len - 1, "max_total_tokens": model.max_model_len,
            "validation_workers": 1, "max_client_batch_size": 1,
            "router": "shoal", "version": version, "sha": None, "docker_label": None}
