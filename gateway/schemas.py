"""The gateway's API surface: OpenAI's request and error bodies as pydantic models, their
limits, and how a request that fails validation is reported (a 400 naming the parameter).

Pydantic checks every field strictly (no "5" for 5); OpenAI parameters shoal does not serve are
refused by name, never ignored.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from shoal.sampling_params import MAX_TOP_LOGPROBS
from shoal.structured_output import JSON_OBJECT, StructuredOutput


class APIError(Exception):
    """An error returned to the client as an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI documentation of the error statuses an endpoint may answer."""
    why = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model or job",
           413: "the request body is too large",
           429: "overloaded or rate limited (see Retry-After)", 503: "the queue is unavailable"}
    return {code: {"model": ErrorBody, "description": why[code]} for code in statuses}


# One event of a stream of `data:` lines, as schemathesis checks each event.
SSE_DATA = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
GENERATION_RESPONSES = {
    200: {"description": "a JSON response, or Server-Sent Events with `stream: true`",
          "content": {"text/event-stream": {"schema": SSE_DATA}}},
    **error_responses(400, 401, 404, 429, 503),
}
# The Responses API streams named events (`event:` and `data:` lines), each one checked so.
RESPONSES_RESPONSES = {
    **GENERATION_RESPONSES,
    200: {"description": "a response object, or with `stream: true` the API's typed events",
          "content": {"text/event-stream": {"schema": {
              "type": "object", "required": ["event", "data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}}},
}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        default=False, description="with include_usage, every chunk also carries its choice's "
        "usage so far (vLLM's)")


class JSONSchemaFormat(BaseModel):
    """`response_format.json_schema`: a named JSON Schema the output must satisfy."""

    model_config = ConfigDict(strict=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(default=None, description="accepted; the schema is always "
                                "enforced")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def constraint(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return JSON_OBJECT
        if self.type == "json_schema":
            return StructuredOutput("json", json.dumps(self.json_schema.json_schema))
        return None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint on the output text."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(
        default=None, alias="json", description="a JSON Schema (an object, or its JSON text)")
    regex: str | None = Field(default=None, description="a regular expression the whole output "
                              "matches (Rust's regex syntax: \\d is any Unicode digit)")
    choice: list[str] | None = Field(default=None, min_length=1,
                                     description="the output is one of these strings")
    grammar: str | None = Field(default=None, description="a context-free grammar in Lark's "
                                "syntax, as llguidance reads it")
    json_object: bool | None = Field(default=None, description="true: any JSON object")

    @model_validator(mode="after")
    def _one_given(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        return self

    def constraint(self) -> StructuredOutput:
        if self.json_object:
            return JSON_OBJECT
        if self.json_ is not None:
            spec = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput("json", spec)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        return StructuredOutput("grammar", self.grammar)


INT32_MAX = 2**31 - 1  # bounds that every part (msgpack, torch) can carry
MAX_CHOICES = 16  # most choices (`n`) of one request
MAX_PROMPTS = 64  # most prompts of one completions request
MAX_REQUESTS = 256  # most requests (prompts x choices) one API request becomes in the fleet
MAX_TOKEN_LIST = 4096  # most token ids in stop_token_ids or allowed_token_ids
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256  # bounds on bad_words, each checked every step
MAX_REQUEST_ID_CHARS = 256  # longest client request id (X-Request-Id or the body's request_id)


class GenerationRequest(BaseModel):
    """What completions and chat requests share: sampling, stopping, choices, and shoal's and
    vLLM's extensions."""

    model_config = ConfigDict(strict=True)  # no "5" for 5, no false for a token id

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0,
                         description="sample only tokens at least this share as likely as the "
                         "most likely one (vLLM's; 0 disables)")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES,
                   description="choices, each its own request in the fleet (sharing the "
                   "prompt's K/V through the prefix cache); with a seed, choice i samples with "
                   "seed + i")
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    logprobs: Any = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False,
                                      description="above 1 discourages tokens of the prompt and "
                                      "the output (as vLLM's); an extension")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, description="token id (a string) -> bias added to its logit")
    priority: int = Field(default=0, ge=-100, le=100,
                          description="lower is served first (batch jobs use 1); an extension")
    context_overflow: Literal["error", "reevaluate", "shift"] = Field(
        default="error", description="past the context window: stop (error, finish_reason "
        "length), or keep n_keep tokens and drop n_discard after them, recomputing "
        "(reevaluate) or rotating cached keys (shift); an extension")
    n_keep: int = Field(default=4, ge=0, le=INT32_MAX)
    n_discard: int | None = Field(default=None, ge=1, le=INT32_MAX)
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="requests share cached prompt K/V (prefix caching) only with requests of "
        "the same salt (as vLLM's)")
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema: the output is JSON "
        "(matching the schema), enforced token by token")
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's structured outputs: a JSON Schema, a regular "
        "expression, a choice of strings or a Lark grammar the output matches")
    # vLLM's extra sampling and output parameters.
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        default=None, max_length=MAX_TOKEN_LIST,
        description="token ids that end the request (kept in its tokens)")
    include_stop_str_in_output: bool = Field(
        default=False, description="keep the stop string that ended the text")
    skip_special_tokens: bool = Field(
        default=True, description="leave special tokens such as <|im_end|> out of the text")
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        default=None, min_length=1, max_length=MAX_TOKEN_LIST,
        description="sample only among these token ids")
    return_tokens_as_token_ids: bool = Field(
        default=False, description="with logprobs, name each token `token_id:<id>` rather than "
        "by its text, which may not be valid UTF-8 alone (vLLM's)")
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = (
        Field(default=None, max_length=MAX_BAD_WORDS,
              description="words the output may not hold (vLLM's): the token that would complete "
              "one, as it tokenizes at the text's start or after a space, is never sampled"))
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="keep only the prompt's last k tokens")
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="each prompt token's logprob and "
        "rank given the tokens before it, with this many most likely tokens at each position "
        "(vLLM's; not with stream)")
    request_id: str | None = Field(
        default=None, min_length=1, max_length=MAX_REQUEST_ID_CHARS,
        description="the reply's id is built from it (`cmpl-<request_id>`, "
        "`chatcmpl-<request_id>`); an `X-Request-Id` header wins over it (vLLM's)")


def unsupported(allowed: tuple, what: str) -> AfterValidator:
    """Refuses any value but `allowed`: OpenAI's parameters that shoal does not serve get a 400
    naming them rather than being ignored."""
    def check(value):
        if value not in allowed:
            raise ValueError(f"{what} is not supported")
        return value
    return AfterValidator(check)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]


def _prompt_form(value: Any) -> str | None:
    """Which of the completions API's four forms of `prompt` a value has, told by its JSON type
    (a list by its first item; an empty list as token ids, which then reports it empty), so that
    a bad prompt is checked against its own form only: an untagged union reported one error per
    form, the first of them about the string form whatever was sent."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "texts" if isinstance(first, str) else \
        "token_id_lists" if isinstance(first, list) else "token_ids"


class CompletionRequest(GenerationRequest):
    prompt: Annotated[
        Annotated[str, Field(min_length=1), Tag("text")] |
        Annotated[TokenIds, Tag("token_ids")] |
        Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS), Tag("texts")] |
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS),
                  Tag("token_id_lists")],
        Discriminator(_prompt_form, custom_error_type="prompt_form",
                      custom_error_message="prompt must be a string, a list of token ids, a list "
                                           "of strings or a list of lists of token ids")]
    # OpenAI's completions API, and vLLM's, default to 16 tokens (chat: up to the window).
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX,
                                   description="tokens to generate; default 16, as OpenAI's")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="each token's logprob, and this many most likely "
                                 "tokens at each step (top_logprobs)")
    echo: bool = Field(default=False, description="the prompt before the completion, and with "
                       "logprobs the prompt tokens' logprobs (streamed: in each choice's first chunk)")
    best_of: Annotated[int | None, unsupported((None, 1), "best_of above 1")] = None
    suffix: Annotated[str | None, unsupported((None,), "suffix")] = None


class TextPart(BaseModel):
    """One part of a message's content in OpenAI's array form; text is the only kind served."""

    model_config = ConfigDict(strict=True)

    type: Annotated[str, unsupported(("text",), "content parts other than text")]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    arguments: str = Field(description="the arguments, as JSON text")


class ToolCall(BaseModel):
    """A call an earlier assistant message made (multi-turn tool use)."""

    model_config = ConfigDict(strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[TextPart], Tag("parts")],
        Discriminator(lambda v: "text" if isinstance(v, str) else "parts" if isinstance(v, list)
                      else None, custom_error_type="content_form",
                      custom_error_message="content must be a string or a list of text parts"),
    ] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, description="the call a tool message answers")
    name: str | None = None
    reasoning: str | None = Field(default=None, description="an assistant turn's thinking, as a "
                                  "reasoning parser returned it (`reasoning_content` also)")
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is needed (it may be left out only by an assistant "
                             "message with tool_calls)")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template takes it: the text parts joined by newlines (as
        vLLM joins them for templates that take a string); tool calls with their arguments
        parsed, as Hugging Face's templates read them."""
        text = self.content if isinstance(self.content, str) else \
            "\n".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:  # templates that show earlier thinking read it by this name
            out["reasoning_content"] = thought
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema of the "
                                              "arguments (any object when left out)")
    strict: bool | None = Field(default=None, description="accepted; the schema is always "
                                "enforced")


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: NamedFunction


# The fields whose forms are tagged unions, and their tags: pydantic puts the tag of the form a
# value was checked against into an error's location, after the field (after the index, for
# the items of a list of unions: `items` and `blocks` are the tags of such lists); the error
# handler leaves it out.
UNION_TAGS = {"prompt": ("text", "token_ids", "texts", "token_id_lists"),
              "content": ("text", "parts", "blocks", "text_blocks"), "input": ("text", "items"),
              "system": ("text", "text_blocks"),
              "items": ("message", "function_call", "function_call_output"),
              "blocks": ("text", "tool_use", "tool_result", "thinking")}


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="with logprobs: this many most likely tokens at "
                                     "each step")
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='"required" or a named function: the reply is tool calls, '
        'enforced as structured outputs; "auto" (the default with tools) is refused: shoal '
        "has no tool-call parser")
    parallel_tool_calls: bool = Field(default=True, description='with "required": more than '
                                      "one call allowed")
    add_generation_prompt: bool = Field(
        default=True, description="open the assistant's turn after the messages (vLLM's)")
    continue_final_message: bool = Field(
        default=False, description="leave the last message open for the model to go on with, "
        "as a prefix of its reply (vLLM's; needs add_generation_prompt false)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="more variables for the chat template (vLLM's)")


class BatchChatRequest(ChatRequest):
    """vLLM's `POST /v1/chat/completions/batch`: chat's fields, with `messages` a list of
    conversations, each answered by one choice (index k for conversation k). Not streamed, no
    tools, one choice per conversation."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(
        min_length=1, max_length=MAX_PROMPTS, description="the conversations")
    stream: Annotated[bool, unsupported((False,), "stream in a batch")] = False
    n: Annotated[int, unsupported((1,), "n above 1 in a batch")] = 1
    tools: Annotated[list[Tool] | None, unsupported((None,), "tools in a batch")] = None
    prompt_logprobs: Annotated[int | None, unsupported((None,), "prompt_logprobs in a batch")] \
        = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


class FleetWorker(BaseModel):
    """One worker in `GET /v1/fleet`: its last heartbeat (K/V blocks of `block_size` tokens)."""

    worker_id: str
    model: str
    alive: bool = Field(description="its heartbeat key has not expired")
    draining: bool
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_running: int = Field(description="requests in its engine")
    max_model_len: int
    heartbeat_age_s: float | None = Field(description="seconds since its last heartbeat")
    loras: dict[str, str] = Field(default_factory=dict,
                                  description="the LoRA adapters it serves, name -> directory")


class FleetStatus(BaseModel):
    """`GET /v1/fleet`: what the scheduler places requests by."""

    object: Literal["fleet"] = "fleet"
    model: str = Field(description="the default model (of requests that name none)")
    models: list[str] = Field(description="every model served, by the name its workers advertise")
    num_waiting: int = Field(description="requests waiting in the scheduler's queue")
    workers: list[FleetWorker]


@contextlib.contextmanager
def refusals_named(names: dict[str, str]) -> Iterator[None]:
    """Refusals of the chat request another API's request amounts to (APIError, or pydantic's
    ValidationError as `invalid_request` makes it a 400), naming that request's parameters
    instead of chat's (`names`: chat's name -> the other API's)."""
    try:
        yield
    except (APIError, ValidationError) as e:
        error = invalid_request(e.errors()) if isinstance(e, ValidationError) else e
        error.param = names.get(error.param or "", error.param)
        raise error from e


def invalid_request(errors: list[Any]) -> APIError:
    """The first of a request's validation errors (pydantic's, or FastAPI's for a body that is not
    JSON) as a 400 naming the parameter by its path, `messages.0.content`, without the tags of
    the unions on the way (`UNION_TAGS`)."""
    err = errors[0] if errors else {}
    if err.get("type") == "json_invalid":  # FastAPI's: loc is ("body", offset)
        offset = err.get("loc", ("body", "?"))[-1]
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(f"the request body is not valid JSON: {detail} (at character {offset})")
    path = [x for x in err.get("loc", ()) if x != "body"]
    # Each element's field: the nearest name before it, past list indexes.
    fields = [next((str(y) for y in reversed(path[:i]) if isinstance(y, str)), "")
              for i in range(len(path))]
    path = [x for x, f in zip(path, fields) if x not in UNION_TAGS.get(f, ())]
    loc = ".".join(map(str, path))
    return APIError(f"{loc}: {err.get('msg', 'invalid request')}", param=loc or None)
