"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as vLLM
serves it, on top of chat: a request's `system` and `messages` (text, earlier `tool_use` blocks
and their `tool_result`s) become a chat request's messages, its `tools` and `tool_choice` the
chat API's, `stop_sequences` its stop strings; the reply becomes a message of `text` and
`tool_use` content blocks or, streamed, the API's events (`message_start`,
`content_block_start`, `content_block_delta` ..., `content_block_stop`, `message_delta`,
`message_stop`).

- A last message from the assistant is a prefill: the reply goes on from its text (chat's
  `continue_final_message`) and holds only what the model added.
- Tool use is made as chat makes it (gateway/tools.py): `{"type": "tool"}` and `"any"` constrain
  the reply; `"auto"` (the default with tools) needs the gateway's tool-call parser. Streamed,
  each call's input comes piece by piece as it is generated; with `"auto"` the text before
  the calls streams first.
- `usage` counts as Anthropic does: `input_tokens` are the prompt tokens computed, and
  `cache_read_input_tokens` those found in the prefix cache (their sum is the prompt).
- Errors on these paths have Anthropic's body, `{"type": "error", "error": {"type",
  "message"}}` (`error_body`); an `x-api-key` header is accepted as the API key, as
  Anthropic's clients send it.
- A gateway with a reasoning parser (gateway/reasoning.py) returns the model's thinking as a
  `thinking` block before the answer's blocks (streamed: `thinking_delta`s; no signature).
  The request's `thinking` and `cache_control` are accepted and have no effect (whether the
  model thinks is its own; prefix caching is automatic); images and documents get a 400.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from gateway.reasoning import Reasoning
from gateway.schemas import (
    INT32_MAX,
    APIError,
    ChatMessage,
    ChatRequest,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    refusals_named,
)
from gateway.sse import ChunkGroup
from gateway.tools import ToolCalls
from shoal.messages import TokenEvent

PATH = "/v1/messages"  # the API's paths start so; their errors take Anthropic's body

# Anthropic's error types by HTTP status (anything else: api_error).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def owns(path: str) -> bool:
    """Whether a request path is the Messages API's."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error as Anthropic's API answers it, by the HTTP status it goes with."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""

    type: Literal["error"]
    error: ErrorDetail


_WHY = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model",
        429: "overloaded or rate limited (see Retry-After)", 503: "the queue is unavailable"}
_ERRORS = {code: {"model": ErrorBody, "description": why} for code, why in _WHY.items()}
# What the two endpoints answer, for the OpenAPI schema: the message, or its events named by
# `event:` lines; the token count.
MESSAGES_RESPONSES = {
    200: {"description": "a message, or with `stream: true` the API's events",
          "content": {"text/event-stream": {"schema": {
              "type": "object", "required": ["event", "data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}}},
    **_ERRORS}
COUNT_TOKENS_RESPONSES = {code: _ERRORS[code] for code in (400, 401, 404)}


class TextBlock(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(default=None, description="accepted; prefix "
                                                 "caching is automatic")


def _text_or(items: Any, tag: str, what: str) -> Any:
    """A string or a list of `items` (tagged "text" and `tag`, gateway.schemas.UNION_TAGS), told
    by its JSON type, so that a bad value is checked against its own form only."""
    return Annotated[
        Annotated[str, Tag("text")] | Annotated[list[items], Field(min_length=1), Tag(tag)],
        Discriminator(lambda v: "text" if isinstance(v, str) else tag if isinstance(v, list)
                      else None, custom_error_type="content_form",
                      custom_error_message=f"{what} must be a string or a list of blocks"),
    ]


TextOrBlocks = _text_or(TextBlock, "text_blocks", "the text")


class ToolUseBlock(BaseModel):
    """A tool call the assistant made in an earlier turn."""

    model_config = ConfigDict(strict=True)

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    """What a tool call returned, for the model to read."""

    model_config = ConfigDict(strict=True)

    type: Literal["tool_result"]
    tool_use_id: str
    content: TextOrBlocks = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else \
            "\n".join(p.text for p in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(BaseModel):
    """An earlier turn's reasoning, which a client sends back: left out of the prompt."""

    model_config = ConfigDict(strict=True)

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_kind(value: Any) -> str | None:
    """A content block's tag: its `type`, both kinds of thinking as one."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "thinking" if kind == "redacted_thinking" else kind if isinstance(kind, str) else None


# A content block, told by its `type`.
Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_block_kind, custom_error_type="content_block",
                  custom_error_message="content blocks are text, tool_use, tool_result or "
                                       "thinking (images and documents are not supported)"),
]


class Message(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["user", "assistant"]
    content: _text_or(Block, "blocks", "content")


class AnthropicTool(BaseModel):
    """A function the model may call (Anthropic's client tools; server tools such as web
    search are not served)."""

    model_config = ConfigDict(strict=True)

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema of the tool's input")
    cache_control: dict[str, Any] | None = None

    def for_chat(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.input_schema))


class ToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, description="the tool, with type tool")
    disable_parallel_tool_use: bool = False

    def for_chat(self) -> str | NamedToolChoice:
        if self.type == "tool":
            if self.name is None:
                raise APIError("tool_choice of type tool needs a name", param="tool_choice")
            return NamedToolChoice(type="function", function=NamedFunction(name=self.name))
        return {"any": "required"}.get(self.type, self.type)


class JSONOutputFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(strict=True)

    format: JSONOutputFormat | None = Field(default=None, description="the reply is JSON "
                                            "matching the schema (structured outputs)")
    effort: str | None = Field(default=None, description="accepted; no effect")


class Conversation(BaseModel):
    """What a Messages request and a token count share: the prompt."""

    model_config = ConfigDict(strict=True)

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: TextOrBlocks | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = Field(default=None, description="accepted; no effect")

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: the system prompt first; a user turn's tool
        results each a `tool` message, in place among its text; an assistant turn's text and
        tool_use blocks one message with those `tool_calls` (thinking blocks left out)."""
        out = []
        if self.system is not None:
            out.append(ChatMessage(role="system", content=self.system if isinstance(
                self.system, str) else "\n".join(b.text for b in self.system)))
        for m in self.messages:
            if isinstance(m.content, str):
                out.append(ChatMessage(role=m.role, content=m.content))
            elif m.role == "assistant":
                text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
                calls = [ToolCall(id=b.id, function=FunctionCall(
                    name=b.name, arguments=json.dumps(b.input, ensure_ascii=False)))
                    for b in m.content if isinstance(b, ToolUseBlock)]
                out.append(ChatMessage(role="assistant", content=text or (None if calls else ""),
                                       tool_calls=calls or None))
            else:
                texts: list[str] = []
                for b in [*m.content, None]:  # None flushes the last run of text
                    if isinstance(b, TextBlock):
                        texts.append(b.text)
                        continue
                    if texts:
                        out.append(ChatMessage(role="user", content="\n".join(texts)))
                        texts = []
                    if isinstance(b, ToolResultBlock):
                        out.append(ChatMessage(role="tool", content=b.text(),
                                               tool_call_id=b.tool_use_id))
                    elif isinstance(b, ToolUseBlock):
                        raise APIError("tool_use blocks belong to assistant messages",
                                       param="messages")
        return out

    def chat_request(self, **fields: Any) -> ChatRequest:
        """The chat request of this conversation, with more of its `fields`. A last message
        from the assistant is a prefill: the reply continues it."""
        prefilled = self.messages[-1].role == "assistant"
        return ChatRequest(model=self.model, messages=self.chat_messages(),
                           add_generation_prompt=not prefilled, continue_final_message=prefilled,
                           tools=[t.for_chat() for t in self.tools] if self.tools else None,
                           **fields)


class CountTokensRequest(Conversation):
    """`POST /v1/messages/count_tokens`."""


class MessagesRequest(Conversation):
    """`POST /v1/messages`: the fields shoal serves (others are ignored, as Anthropic's
    metadata-like fields are)."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = Field(default=None, max_length=64)
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = Field(default=None, description="accepted; no effect")

    def to_chat(self) -> ChatRequest:
        """The chat request this message is the reply to. Stop strings are kept in its text,
        so that the reply can say which one ended it (`MessageShape.split`)."""
        fmt = self.output_config.format if self.output_config else None
        choice = self.tool_choice
        return self.chat_request(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p or 1.0,
            top_k=self.top_k or -1, stop=self.stop_sequences,
            include_stop_str_in_output=bool(self.stop_sequences), stream=self.stream,
            response_format=ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
                name="output", schema=fmt.json_schema)) if fmt else None,
            tool_choice=choice.for_chat() if choice else None,
            parallel_tool_calls=not (choice and choice.disable_parallel_tool_use))


# A chat request's parameters that a refusal may name, by their Messages API names.
_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
           "response_format": "output_config.format", "continue_final_message": "messages"}


def refusals() -> contextlib.AbstractContextManager[None]:
    """Refusals of the chat request a Messages request amounts to, naming its parameters."""
    return refusals_named(_PARAMS)


class MessageShape:
    """One reply's message object and stream events.

    Args:
        req: the request.
        model: the name the reply is from.
        tools: how its text becomes tool_use blocks (None: it is text).
        prompt_tokens: the prompt's length, in tokens (the usage `message_start` reports).
    """

    def __init__(self, req: MessagesRequest, model: str, tools: ToolCalls | None,
                 prompt_tokens: int, reasoning: Reasoning | None = None) -> None:
        self.req, self.model, self.tools, self.reasoning = req, model, tools, reasoning
        self.prompt_tokens = prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"

    def split(self, text: str, last: TokenEvent) -> tuple[str, str | None]:
        """The reply's text without the stop sequence that ended it, and that sequence (None
        when none did). The text holds the sequence (`MessagesRequest.to_chat`), and the first
        of `stop_sequences` found is the one that ends it: the gateway cuts at it."""
        if last.finish_reason == "stop":
            for s in self.req.stop_sequences or ():
                if s and text.endswith(s):
                    return text[:-len(s)], s
        return text, None

    def content(self, text: str) -> list[dict[str, Any]]:
        """The reply's content blocks: with a reasoning parser, its thinking first (when the
        model thought); then its text, then its tool calls as tool_use blocks."""
        blocks = []
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
            text = text or ""
            if thought:  # no signature: there is nothing to verify it against
                blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
        calls, text = self.tools.message(0, text) if self.tools else (None, text)
        if text or not calls:
            blocks.append({"type": "text", "text": text or ""})
        for k, c in enumerate(calls or ()):
            try:
                arguments = json.loads(c["function"]["arguments"])
            except ValueError:  # a parsed call whose arguments are not JSON
                arguments = {"arguments": c["function"]["arguments"]}
            blocks.append(self.tool_use(k, c["function"]["name"], arguments))
        return blocks

    def tool_use(self, k: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Call `k`'s tool_use block (its id the same in the stream and the message)."""
        assert self.tools is not None
        return {"type": "tool_use", "id": "toolu_" + self.tools.call_id(0, k).removeprefix("call_"),
                "name": name, "input": arguments}

    @staticmethod
    def stop_reason(last: TokenEvent, stop_sequence: str | None,
                    content: list[dict[str, Any]]) -> str:
        if last.finish_reason == "length":  # a call cut short too
            return "max_tokens"
        if any(b["type"] == "tool_use" for b in content):
            return "tool_use"
        return "stop_sequence" if stop_sequence is not None else "end_turn"

    def usage(self, counts: dict[str, Any] | None) -> dict[str, int]:
        """Anthropic's usage from `gateway.app._usage`'s counts (None: before the first token,
        the prompt alone, its cached part not known yet)."""
        counts = counts or {"prompt_tokens": self.prompt_tokens, "completion_tokens": 0,
                            "prompt_tokens_details": {"cached_tokens": 0}}
        cached = counts["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": counts["prompt_tokens"] - cached,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                "output_tokens": counts["completion_tokens"]}

    def body(self, text: str, last: TokenEvent | None, counts: dict[str, Any] | None
             ) -> dict[str, Any]:
        """The message object: empty while the reply is coming (no `last` event yet), else
        the reply's content and why it stopped."""
        content, reason, stop = [], None, None
        if last is not None:
            text, stop = self.split(text, last)
            content = self.content(text)
            reason = self.stop_reason(last, stop, content)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop,
                "usage": self.usage(counts)}

    async def events(self, run: AsyncIterator[tuple[str, TokenEvent]],
                     count: Callable[[TokenEvent], dict[str, Any]]) -> AsyncIterator[ChunkGroup]:
        """The stream's events, grouped by token as `gateway.sse.EventStream` writes them, from
        `gateway.app.Gateway.run`'s (text, event) pairs; `count(last_event)` gives the usage.
        In order: message_start; then a block that streams as the reply comes (its start, a
        delta per piece, its stop): the text, or the call a `tool` tool_choice forces, its
        input as JSON text piece by piece. With `any` and `auto`, each call's block starts once
        its name is written, its input streams, and it stops when the input closes; with
        `auto`, the text before the calls streams first in a text block, stopped when the
        first call's starts (`ToolCalls.feed` holds back what could begin one). What cannot be
        read as it comes follows whole at the end: an `any` reply cut short before any call
        began, as a text block; `auto` calls in a form that is not JSON (pythonic).
        Then message_delta (stop reason, output tokens) and message_stop. A failure ends the
        stream with an `error` event."""
        group: list[dict[str, Any]] = [{"type": "message_start",
                                        "message": self.body("", None, None)}]
        if self.tools is None:
            block: dict[str, Any] | None = {"type": "text", "text": ""}
            field = ("text_delta", "text")
        elif self.tools.mode == "named":
            block = self.tool_use(0, self.tools.name, {})
            field = ("input_json_delta", "partial_json")
        else:
            block = None
        # With a reasoning parser the thinking streams first, as a thinking block at index 0,
        # and the answer's blocks follow it (`base` 1); the streamed block starts with the
        # answer.
        base = 0
        thought = None  # the thinking streamed so far, while its block is open
        waiting = block is not None and self.reasoning is not None  # to start with the answer
        if block is not None and not waiting:
            group.append({"type": "content_block_start", "index": 0, "content_block": block})

        def streamed(piece: str) -> list[dict[str, Any]]:
            return [{"type": "content_block_delta", "index": base,
                     "delta": {"type": field[0], field[1]: piece}}] if piece else []

        def thinking(more: str, ended: bool) -> list[dict[str, Any]]:
            """The thinking block's events for its next text `more`: it starts with its first
            text and stops when the answer begins (`ended`)."""
            nonlocal thought, base, waiting
            out = []
            if more:
                if thought is None:
                    thought = ""
                    out.append({"type": "content_block_start", "index": 0, "content_block": {
                        "type": "thinking", "thinking": "", "signature": ""}})
                thought += more
                out.append(_delta(0, {"type": "thinking", "thinking": more}))
            if ended:
                if thought is not None:
                    out.append({"type": "content_block_stop", "index": 0})
                    thought, base = None, 1
                if waiting:
                    out.append({"type": "content_block_start", "index": base,
                                "content_block": block})
                    waiting = False
            return out
        # "any" and "auto" replies are read as they come (`ToolCalls.feed`): "auto" text before
        # the calls streams in a text block, stopped when the first call's block starts; each
        # call's block starts once its name is written and stops when its input closes.
        reading = self.tools is not None and self.tools.mode in ("required", "auto")
        still_open: set[int] = set()  # the calls' blocks not yet stopped
        sent = ""  # with auto: the text streamed so far, in a text block opened by its start
        first = 0  # the block index of call 0: 1 after a streamed text block
        text = ""
        async with contextlib.aclosing(run) as stream:  # leaving early cancels the request
            async for piece, ev in stream:
                if ev.finish_reason == "error":
                    status = ev.error_status or 503
                    yield [*group, error_body(status, ev.error or "generation failed")], True
                    return
                last = ev.finish_reason is not None
                # The new text: the last piece without the stop sequence that ended it.
                fresh = self.split(text + piece, ev)[0][len(text):] if last else piece
                if self.reasoning is not None:  # the thinking, then the answer's `fresh`
                    more, fresh = self.reasoning.feed(0, fresh, last)
                    group += thinking(more, bool(fresh) or last)
                for kind, k, value in self.tools.feed(0, fresh) if reading else ():
                    if kind == "content":
                        if not sent:
                            group.append({"type": "content_block_start", "index": base,
                                          "content_block": {"type": "text", "text": ""}})
                        sent += value
                        group.append(_delta(base, {"type": "text", "text": value}))
                    elif kind == "open":
                        if sent and not first:  # the text ends where the calls begin
                            first = 1
                            group.append({"type": "content_block_stop", "index": base})
                        still_open.add(k)
                        group.append({"type": "content_block_start", "index": base + k + first,
                                      "content_block": self.tool_use(k, value, {})})
                    elif kind == "arguments":
                        group.append({"type": "content_block_delta", "index": base + k + first,
                                      "delta": {"type": "input_json_delta",
                                                "partial_json": value}})
                    else:
                        still_open.discard(k)
                        group.append({"type": "content_block_stop", "index": base + k + first})
                if not last:
                    text += piece
                    if block is not None:
                        group += streamed(fresh)
                    if group:
                        yield group, False
                        group = []
                    continue
                done = self.body(text + piece, ev, count(ev))
                if block is not None:
                    group += streamed(fresh)
                    group.append({"type": "content_block_stop", "index": base})
                elif self.tools.streamed(0):  # the calls still open (cut short) end
                    group += [{"type": "content_block_stop", "index": base + k + first}
                              for k in sorted(still_open)]
                else:
                    content = done["content"][base:]
                    if sent:  # the streamed text block: the rest of its text, and its end
                        rest = content[0]["text"][len(sent):]
                        if rest:
                            group.append(_delta(base, {"type": "text", "text": rest}))
                        group.append({"type": "content_block_stop", "index": base})
                    for k, whole in enumerate(content[1 if sent else 0:], 1 if sent else 0):
                        group += [{"type": "content_block_start", "index": base + k,
                                   "content_block": {**whole, "input": {}}
                                   if whole["type"] == "tool_use" else {**whole, "text": ""}},
                                  _delta(base + k, whole),
                                  {"type": "content_block_stop", "index": base + k}]
                yield [*group, {"type": "message_delta",
                                "delta": {"stop_reason": done["stop_reason"],
                                          "stop_sequence": done["stop_sequence"]},
                                "usage": done["usage"]},
                       {"type": "message_stop"}], True
                return


def _delta(index: int, block: dict[str, Any]) -> dict[str, Any]:
    """A content_block_delta carrying a whole block: its text or thinking, or its input as
    JSON text."""
    kind = block["type"]
    delta = {"type": "text_delta", "text": block["text"]} if kind == "text" else \
        {"type": "thinking_delta", "thinking": block["thinking"]} if kind == "thinking" else \
        {"type": "input_json_delta", "partial_json": json.dumps(block["input"],
                                                                ensure_ascii=False)}
    return {"type": "content_block_delta", "index": index, "delta": delta}
