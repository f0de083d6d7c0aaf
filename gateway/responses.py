"""OpenAI's Responses API (`POST /v1/responses`) on top of chat: a request's `instructions` and
`input` become a chat request's messages (earlier function calls and their outputs included),
its `text.format` a structured output, its function `tools` the chat API's and its `include` of
`message.output_text.logprobs` (with `top_logprobs`) chat's logprobs; the reply
becomes a response object with an assistant message or function calls, or, streamed, the
API's typed events (`response.created` ... `response.output_text.delta` ...
`response.completed`).

Function calls are made as chat makes them (gateway/tools.py): `tool_choice` naming a function
or "required" constrains the reply; "auto" needs the gateway's tool-call parser.

A response with `store` (the default) is kept in Redis with the input items it answered
(`ResponseStore`, for the gateway's `--responses-ttl` seconds), so every gateway of the fleet can
return it (`GET /v1/responses/{id}`, its `input_items`), delete it, and continue its
conversation: a request's `previous_response_id` puts that response's input and output before
its own input (not its instructions, as OpenAI's API does).

A `background` response is stored at once, `queued`, and that is the reply; the gateway that took
it runs it on a task of its own (`gateway.app`), marks it `in_progress` at its first token and
stores it finished. Any gateway can return it meanwhile, and `POST /v1/responses/{id}/cancel`
on any gateway marks it `cancelled` and cancels its request in the fleet. Every change of
status is a compare-and-set (`ResponseStore.settle`): a finish never overwrites a cancel. A
background response whose gateway is gone (no subscriber on that gateway's token channel) is
reported `failed` the next time it is read, and its request is cancelled.

A background response may also be streamed (`stream` and `background`): its events are kept in
Redis as they are made (`ResponseStore.log_events`), and the reply streams them from there, as
does `GET /v1/responses/{id}?stream=true&starting_after=N` on any gateway, for a client that
lost its connection (`ResponseStore.replay`): the run goes on without its client.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

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
from gateway.tools import ToolCalls
from shoal.keys import Keys
from shoal.messages import TokenEvent
from shoal.sampling_params import MAX_TOP_LOGPROBS

log = logging.getLogger("shoal.gateway")


class InputText(BaseModel):
    """A text part of an input message (an earlier assistant turn's is `output_text`)."""

    model_config = ConfigDict(strict=True)

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """One message of `input` (other item types, such as function calls or images, are not
    served)."""

    model_config = ConfigDict(strict=True)

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def for_chat(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else \
            "\n".join(p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)


class FunctionCallItem(BaseModel):
    """A function call the model made in an earlier turn."""

    model_config = ConfigDict(strict=True)

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments, as JSON text")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """What a function call returned, for the model to read."""

    model_config = ConfigDict(strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(BaseModel):
    """An earlier turn's reasoning, as a client sends a response's output back: left out of
    the prompt (chat templates show a model its earlier answers, not its thinking)."""

    model_config = ConfigDict(strict=True)

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


# An input item, told by its `type` (a message may leave it out).
InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(lambda v: (v.get("type", "message") if isinstance(v, dict)
                             else getattr(v, "type", None)),
                  custom_error_type="input_item",
                  custom_error_message="input items are messages, function_call, "
                                       "function_call_output or reasoning"),
]


class FunctionTool(FunctionDefinition):
    """A function the model may call (the Responses API's flat form of chat's tools)."""

    type: Literal["function"]


class FunctionChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = Field(default=None, description="accepted; the schema is always "
                                "enforced")

    def response_format(self) -> ResponseFormat | None:
        """The chat API's equivalent."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        if self.json_schema is None:
            raise APIError("text.format of type json_schema needs a schema", param="text.format")
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat.model_validate(
            {"name": self.name, "description": self.description, "schema": self.json_schema}))

    def echo(self) -> dict[str, Any]:
        """The format as the response repeats it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True)

    format: TextFormat = TextFormat(type="text")


# `include`'s value that adds the output tokens' logprobs.
LOGPROBS = "message.output_text.logprobs"
# What OpenAI's `include` may name: the logprobs, and parts of items shoal never makes (searches,
# code runs, images in the input, reasoning).
Includable = Literal["message.output_text.logprobs", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content"]


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`: the fields shoal serves; others that change the reply are refused
    by name."""

    model_config = ConfigDict(strict=True)

    model: str | None = None
    input: Annotated[
        Annotated[str, Tag("text")]
        | Annotated[list[InputItem], Field(min_length=1), Tag("items")],
        Discriminator(lambda v: "text" if isinstance(v, str) else "items" if isinstance(v, list)
                      else None, custom_error_type="input_form",
                      custom_error_message="input must be a string or a list of items"),
    ]
    instructions: str | None = Field(default=None, description="a system message before the "
                                     "input")
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool = Field(default=True, description="keep the response and its input for "
                        "GET /v1/responses/{id} and previous_response_id (for the gateway's "
                        "--responses-ttl)")
    user: str | None = None
    include: list[Includable] | None = Field(
        default=None, description='"message.output_text.logprobs" adds each output token\'s '
        "logprob to the message's text (with top_logprobs alternatives); the others name items "
        "shoal never makes, and change nothing")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="the most likely tokens at each step, with "
                                     "include message.output_text.logprobs")
    # shoal's and vLLM's extensions, as on chat
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    priority: int = Field(default=0, ge=-100, le=100)
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(
        default=None, description="a stored response whose input and output come before this "
        "input (its instructions do not)")
    truncation: Literal["auto", "disabled"] = Field(
        default="disabled", description='"auto": a conversation too long for the context '
        "window loses its oldest items (after system and developer messages) until it fits; "
        '"disabled": it gets a 400')
    background: bool = Field(default=False, description="run the response whether or not the "
                             "client stays: the reply is the response, queued (poll GET "
                             "/v1/responses/{id}), or with stream its events, which GET "
                             "/v1/responses/{id}?stream=true&starting_after=N streams again; "
                             "cancel with POST /v1/responses/{id}/cancel (needs store)")

    def check_background(self) -> None:
        """Raises APIError (400) for a background request that is not stored: it could never
        be read."""
        if self.background and not self.store:
            raise APIError("a background response must be stored (store: true): it is read "
                           "with GET /v1/responses/{id}", param="background")

    @property
    def logprobs(self) -> bool:
        """Whether the reply's tokens come with their logprobs."""
        return LOGPROBS in (self.include or ())

    def items(self) -> list[InputMessage | FunctionCallItem | FunctionCallOutputItem]:
        """This request's input as items (text is one user message)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def to_chat(self, items: list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
                ) -> ChatRequest:
        """The chat request this response is the reply to: its instructions, then the
        conversation `items` (a previous response's history, `ResponseStore.history`, and this
        request's `items()`, or what `truncated` left of them)."""
        messages = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        messages += _chat_messages(items)
        fmt = self.text.format if self.text else None
        choice = self.tool_choice
        return ChatRequest(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            priority=self.priority, stream=self.stream, logprobs=self.logprobs,
            top_logprobs=self.top_logprobs if self.logprobs else None,
            response_format=fmt.response_format() if fmt else None,
            tools=[Tool(type="function", function=FunctionDefinition(**t.model_dump(
                exclude={"type"}))) for t in self.tools] if self.tools else None,
            tool_choice=NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
            if isinstance(choice, FunctionChoice) else choice,
            parallel_tool_calls=self.parallel_tool_calls)


def truncated(items: list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
              ) -> list[InputMessage | FunctionCallItem | FunctionCallOutputItem] | None:
    """`truncation: "auto"`'s next try: the conversation without its oldest item after the
    system and developer messages that lead it (and without the outputs of a function call so
    dropped, which would answer nothing); None when only the last item is left to drop."""
    lead = next((i for i, item in enumerate(items) if not (
        isinstance(item, InputMessage) and item.role in ("system", "developer"))), len(items))
    if lead >= len(items) - 1:
        return None
    rest = items[lead + 1:]
    while len(rest) > 1 and isinstance(rest[0], FunctionCallOutputItem):
        rest = rest[1:]
    return [*items[:lead], *rest]


def _chat_messages(items: list[Any]) -> list[ChatMessage]:
    """Input items as chat messages: consecutive function calls become one assistant message
    with those `tool_calls`, each call's output a `tool` message; reasoning is left out."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, ReasoningInputItem):
            continue
        if isinstance(item, InputMessage):
            out.append(item.for_chat())
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                  arguments=item.arguments))
            if out and out[-1].role == "assistant" and out[-1].tool_calls and not out[-1].content:
                out[-1] = out[-1].model_copy(update={"tool_calls": [*out[-1].tool_calls, call]})
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
    return out


# A chat request's parameters that a refusal may name, by their Responses API names.
_PARAMS = {"messages": "input", "response_format": "text.format",
           "max_completion_tokens": "max_output_tokens"}


def refusals() -> contextlib.AbstractContextManager[None]:
    """Refusals of the chat request a response request amounts to, naming its parameters."""
    return refusals_named(_PARAMS)


class ResponseShape:
    """One response's object and events: `body` for the whole reply, `events` to stream it.

    Args:
        req: the request.
        model: the name the reply is from.
        tools: how its text becomes function calls (None: it is a message).
        logprobs: the logprob entries of an event's tokens (`{"token", "logprob", "bytes",
            "top_logprobs"}` each), when the request includes them and the reply is a message.
    """

    def __init__(self, req: ResponsesRequest, model: str, tools: ToolCalls | None,
                 logprobs: Callable[[TokenEvent], list[dict[str, Any]]] | None = None,
                 reasoning: Reasoning | None = None) -> None:
        self.req, self.model, self.tools, self.reasoning = req, model, tools, reasoning
        self.logprobs = logprobs if req.logprobs and tools is None else None
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._call_items: dict[int, str] = {}  # call index -> its item's id
        self.created_at = int(time.time())

    def failed(self, message: str) -> dict[str, Any]:
        """The response object of a reply that failed for the gateway's sake (`message`)."""
        return _failed(self.body("", None, None), message)

    def call_item_id(self, k: int) -> str:
        """The id of the item of call `k` (the same in the stream and the final response)."""
        return self._call_items.setdefault(k, f"fc_{uuid.uuid4().hex}")

    def call_item(self, k: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        """The function_call item of call `k`."""
        assert self.tools is not None
        return {"type": "function_call", "id": self.call_item_id(k),
                "call_id": self.tools.call_id(0, k), "name": name, "arguments": arguments,
                "status": status}

    def body(self, text: str, last: TokenEvent | None, usage: dict[str, Any] | None,
             queued: bool = False, logprobs: list[dict[str, Any]] | None = None
             ) -> dict[str, Any]:
        """The response object: queued (`queued`: a background response not started), in
        progress (no `last` event yet), completed, incomplete (cut at `max_output_tokens` or
        the context window), cancelled (a background response's request cancelled: its output
        so far) or failed (an error event); `usage` as `gateway.app._usage` counts it;
        `logprobs`, the message's tokens' (`logprobs` entries; the thinking's are not the
        message's)."""
        status, incomplete, error = "queued" if queued else "in_progress", None, None
        if last is not None:
            if last.finish_reason == "cancelled":
                status = "cancelled"
            elif last.finish_reason == "error":
                status, error = "failed", {"code": "server_error" if (last.error_status or 503)
                                           >= 500 else "invalid_request", "message": last.error}
            elif last.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            else:
                status = "completed"
        output = self.output(text, status, logprobs or []) \
            if last is not None and status != "failed" else []
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_logprobs": req.top_logprobs,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel)
                            else req.tool_choice or ("auto" if req.tools else "none")),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": (req.text.format if req.text else TextFormat(type="text")).echo()},
            "metadata": req.metadata or {}, "user": req.user, "store": req.store,
            "truncation": req.truncation,
            "background": req.background, "previous_response_id": req.previous_response_id,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning.thinking_tokens(0)
                                          if self.reasoning is not None else 0},
                "total_tokens": usage["total_tokens"]},
        }

    def output(self, text: str, status: str, logprobs: list[dict[str, Any]] = ()
               ) -> list[dict[str, Any]]:
        """The output items of a finished reply: with a reasoning parser, the model's thinking
        first, as a reasoning item (when it thought); then `answer`'s items for the rest."""
        if self.reasoning is None:
            return self.answer(text, status, logprobs)
        thought, text = self.reasoning.split(text)
        answer = self.answer(text or "", status, logprobs)
        if not thought:
            return answer
        return [self.reasoning_item(thought, status if text is None else "completed"), *answer]

    def reasoning_item(self, thought: str, status: str) -> dict[str, Any]:
        """The reasoning item of a reply's thinking (status as `message`'s)."""
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": thought}],
                "status": self.message(thought, status)["status"]}

    def answer(self, text: str, status: str, logprobs: list[dict[str, Any]] = ()
               ) -> list[dict[str, Any]]:
        """The output items of a finished reply's answer: its function calls (each an item,
        after the message the model wrote before them, if any), or the assistant's message.
        The calls a stream opened, or that an unstreamed "required" reply cut short began, are
        items as far as they came (one cut short "incomplete"); other calls cut short are the
        message."""
        calls, content = self.tools.message(0, text) if self.tools else (None, text)
        if self.tools is not None and (self.tools.streamed(0) or
                                       not calls and self.tools.mode == "required"):
            begun = self.tools.begun(0, None if self.tools.streamed(0) else text)
            if begun:
                return ([self.message(content, "completed")] if content else []) + [
                    self.call_item(k, name, arguments, "completed" if closed else "incomplete")
                    for k, (name, arguments, closed) in enumerate(begun)]
        if not calls:
            return [self.message(content or "", status, logprobs)]
        return ([self.message(content, status)] if content else []) + [
            self.call_item(k, c["function"]["name"], c["function"]["arguments"], "completed")
            for k, c in enumerate(calls)]

    def message(self, text: str, status: str, logprobs: list[dict[str, Any]] = ()
                ) -> dict[str, Any]:
        """The output's one item: the assistant's message."""
        return {"type": "message", "id": self.item_id, "role": "assistant",
                "status": "in_progress" if status == "in_progress" else
                "incomplete" if status in ("incomplete", "cancelled") else "completed",
                "content": [self.part(text, logprobs)] if status != "in_progress" else []}

    @staticmethod
    def part(text: str, logprobs: list[dict[str, Any]] = ()) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": list(logprobs)}

    async def events(self, run: AsyncIterator[tuple[str, TokenEvent]], usage,
                     done: Callable[[dict[str, Any]], Awaitable[None]], queued: bool = False
                     ) -> AsyncIterator[tuple[list[dict[str, Any]], bool]]:
        """The stream's events, grouped by token as `gateway.sse.EventStream` writes them,
        from `gateway.app.Gateway.run`'s (text, event) pairs; `usage(last_event)` counts the
        tokens, and `done(response)` is awaited with the final response before its event is
        sent (it stores it). In order: created and in_progress (`queued`, a background
        response: created and queued at once, before `run` is started, and in_progress with the
        first token); then the message's events as its text
        comes (item and part added, a delta per piece, text, part and item done), or the
        events of the call a named tool_choice forces as its arguments come (item added, a
        delta per piece, arguments and item done). With "required" and "auto", each call's
        item opens once its name is written, its arguments stream, and it is done when they
        close; with "auto", the text before the calls streams first as the message, done when
        the first call opens (`ToolCalls.feed` holds back what could begin one). What cannot
        be read as it comes follows whole at the end: a "required" reply cut short before any
        call began, as a message; "auto" calls in a form that is not JSON (pythonic). Then
        completed (or incomplete). A failure ends the stream with `response.failed`."""
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            return {"type": kind, "sequence_number": next(seq), **fields}

        def opened(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
            """An item's opening events: it, in progress, and a message's or a reasoning item's
            empty text part. `index` counts from the answer's first item (`base`)."""
            index += base
            parts = item["type"] in ("message", "reasoning")
            out = [event("response.output_item.added", output_index=index,
                         item={**item, "status": "in_progress"} | (
                             {"content": []} if parts else {"arguments": ""}))]
            if parts:
                part = self.part("") if item["type"] == "message" else \
                    {"type": "reasoning_text", "text": ""}
                out.append(event("response.content_part.added", item_id=item["id"],
                                 output_index=index, content_index=0, part=part))
            return out

        def closed(index: int, item: dict[str, Any], delta: str | None) -> list[dict[str, Any]]:
            """A finished item's last events: its text or arguments (with their last `delta`,
            if any: the last piece of what streamed, or all of an item sent whole) and the item
            done. `index` counts from the answer's first item (`base`)."""
            index += base
            where = {"item_id": item["id"], "output_index": index}
            out = []
            if item["type"] == "reasoning":
                if delta:
                    out.append(event("response.reasoning_text.delta", **where, content_index=0,
                                     delta=delta))
                out += [event("response.reasoning_text.done", **where, content_index=0,
                              text=item["content"][0]["text"]),
                        event("response.content_part.done", **where, content_index=0,
                              part=item["content"][0])]
            elif item["type"] == "message":
                text = item["content"][0]["text"]
                if delta or pending:
                    out.append(event("response.output_text.delta", **where, content_index=0,
                                     delta=delta or "", logprobs=take()))
                out += [event("response.output_text.done", **where, content_index=0, text=text,
                              logprobs=item["content"][0]["logprobs"]),
                        event("response.content_part.done", **where, content_index=0,
                              part=item["content"][0])]
            else:
                if delta:
                    out.append(event("response.function_call_arguments.delta", **where,
                                     delta=delta))
                out.append(event("response.function_call_arguments.done", **where,
                                 name=item["name"], arguments=item["arguments"]))
            return [*out, event("response.output_item.done", output_index=index, item=item)]

        opening = self.body("", None, None)
        if queued:
            waiting = self.body("", None, None, queued=True)
            yield [event("response.created", response=waiting),
                   event("response.queued", response=waiting)], False
            group = [event("response.in_progress", response=opening)]
        else:
            group = [event("response.created", response=opening),
                     event("response.in_progress", response=opening)]
        # What streams as one item from the start: the message, or the call a named tool_choice
        # forces (its arguments piece by piece); "required" and "auto" replies' items open as
        # their text comes (below).
        streamed = None
        if self.tools is None:
            streamed = self.message("", "in_progress")
        elif self.tools.mode == "named":
            streamed = {"type": "function_call", "id": self.call_item_id(0),
                        "call_id": self.tools.call_id(0), "name": self.tools.name}
        # With a reasoning parser the thinking streams first, as a reasoning item at index 0,
        # and the answer's items follow it (`base` 1); the streamed item opens with the answer.
        base = 0
        thought = None  # the thinking streamed so far, while its item is open
        if streamed is not None and self.reasoning is None:
            group += opened(0, streamed)
        waiting = streamed if self.reasoning is not None else None  # to open with the answer
        # "required" and "auto" replies are read as they come (`ToolCalls.feed`): "auto" text
        # before the calls streams as the message, each call's item opens once its name is
        # written and is done when its arguments close.
        reading = self.tools is not None and self.tools.mode in ("required", "auto")
        names: dict[int, str] = {}  # the calls opened and not yet done, by index
        sent = ""  # with auto: the text streamed so far, in the message opened by its start
        first = 0  # the output index of call 0: 1 after a streamed message
        text = ""
        logprobs: list[dict[str, Any]] = []  # the message's tokens', when asked for
        pending: list[dict[str, Any]] = []  # those not sent yet (text the detokenizer held)

        def take() -> list[dict[str, Any]]:
            out = pending[:]
            pending.clear()
            return out

        def thinking(more: str, finished: bool) -> list[dict[str, Any]]:
            """The reasoning item's events for its next text `more`: it opens with its first
            text; it is done when the answer begins (or the reply ends)."""
            nonlocal thought, base
            out = []
            if more:
                if thought is None:
                    thought = ""
                    out += opened(0, self.reasoning_item("", "in_progress"))
                thought += more
                out.append(event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                 output_index=0, content_index=0, delta=more))
            if thought is not None and finished:
                out += closed(0, self.reasoning_item(thought, "completed"), None)
                thought, base = None, 1
            return out

        async with contextlib.aclosing(run) as stream:  # leaving early cancels the request
            async for piece, ev in stream:
                text += piece
                thought_tokens = 0  # the event's first tokens that were thinking (no logprobs)
                if self.reasoning is not None:  # the thinking, then the answer's `piece`
                    counted = self.reasoning.thinking_tokens(0)
                    more, piece = self.reasoning.feed(0, piece, ev.finish_reason is not None,
                                                      len(ev.token_ids))
                    thought_tokens = self.reasoning.thinking_tokens(0) - counted
                    group += thinking(more, bool(piece))
                    if waiting is not None and piece:
                        group += opened(0, waiting)
                        waiting = None
                if self.logprobs is not None and len(ev.token_ids) > thought_tokens:
                    entries = self.logprobs(ev)[thought_tokens:]
                    logprobs += entries
                    pending += entries
                if ev.finish_reason == "error":
                    failed = self.body(text, ev, None)
                    await done(failed)
                    yield [*group, event("response.failed", response=failed)], True
                    return
                for kind, k, value in self.tools.feed(0, piece) if reading else ():
                    if kind == "content":
                        if not sent:
                            group += opened(0, self.message("", "in_progress"))
                        sent += value
                        group.append(event("response.output_text.delta", item_id=self.item_id,
                                           output_index=base, content_index=0, delta=value,
                                           logprobs=[]))
                    elif kind == "open":
                        if sent and not first:  # the message ends where the calls begin
                            first = 1
                            group += closed(0, self.message(sent, "completed"), None)
                        names[k] = value
                        group += opened(k + first, self.call_item(k, value, "", "in_progress"))
                    elif kind == "arguments":
                        group.append(event("response.function_call_arguments.delta",
                                           item_id=self.call_item_id(k),
                                           output_index=base + k + first, delta=value))
                    else:
                        item = self.call_item(k, names.pop(k), self.tools.arguments(0, k),
                                              "completed")
                        group += closed(k + first, item, None)
                if ev.finish_reason is not None:
                    final = self.body(text, ev, usage(ev), logprobs=logprobs)
                    await done(final)
                    if thought is not None:  # the reply ended while the model thought
                        group += closed(0, final["output"][0], None)
                        thought, base = None, 1
                    answer = final["output"][base:]
                    if waiting is not None:  # no answer came: its item, empty
                        group += opened(0, waiting)
                    if streamed is not None:
                        group += closed(0, answer[0], piece)
                    elif self.tools.streamed(0):
                        for k in names:  # cut short: the calls still open end incomplete
                            group += closed(k + first, answer[k + first], None)
                    else:
                        if sent:  # the streamed message: the rest of its text, and its end
                            message = answer[0]
                            group += closed(0, message, message["content"][0]["text"][len(sent):])
                        for k, item in enumerate(answer[1 if sent else 0:], 1 if sent else 0):
                            whole = item["content"][0]["text"] if item["type"] == "message" \
                                else item["arguments"]
                            group += [*opened(k, item), *closed(k, item, whole)]
                    yield [*group, event(f"response.{final['status']}", response=final)], True
                    return
                if piece and streamed is not None:
                    group.append(
                        event("response.output_text.delta", item_id=self.item_id,
                              output_index=base, content_index=0, delta=piece, logprobs=take())
                        if streamed["type"] == "message" else
                        event("response.function_call_arguments.delta",
                              item_id=self.call_item_id(0), output_index=base, delta=piece))
                if group:
                    yield group, False
                    group = []


_ITEMS = TypeAdapter(list[InputItem])


def _failed(response: dict[str, Any], message: str) -> dict[str, Any]:
    """`response` (an object) failed for the fleet's sake, with no output."""
    return {**response, "status": "failed", "output": [],
            "error": {"code": "server_error", "message": message}}

# A response's statuses from which it never changes again.
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
# The events that end a response's stream: its final status, or an error of the stream itself.
FINAL_EVENTS = frozenset({*(f"response.{status}" for status in TERMINAL), "error"})
# How long a replay waits for a new event before it checks that the response is still being run,
# milliseconds.
REPLAY_POLL_MS = 1000
# Events a replay reads from Redis at a time (one write to its client).
REPLAY_BATCH = 512


class ResponseStore:
    """Responses kept in Redis (`Keys.response`) for `ttl_s` seconds, with the input items each
    answered (its previous response's history included), shared by every gateway of the fleet.

    Args:
        redis: the gateway's Redis client, when it has one (it is made at start-up).
        keys: the fleet's key names.
        ttl_s: how long a response is kept, in seconds.
    """

    def __init__(self, redis_of: Callable[[], aioredis.Redis | None], keys: Keys,
                 ttl_s: int) -> None:
        self.redis_of, self.keys, self.ttl_s = redis_of, keys, ttl_s

    @property
    def redis(self) -> aioredis.Redis:
        r = self.redis_of()
        assert r is not None, "the gateway has not started"
        return r

    async def save(self, response: dict[str, Any], items: list[Any], quiet: bool = False,
                   runner: dict[str, str] | None = None, logged: bool = False) -> None:
        """Keep `response` (a response object) and the input `items` it answered, each item
        with an id. `quiet`: a Redis failure is logged, not raised (a stream whose reply is
        sent already). `runner`, for a background response: the token channel of the gateway
        that runs it and its request's id in the fleet; `logged`, its events are logged
        (`log_events`) for `replay`."""
        data = []
        for item in items:
            d = item.model_dump(exclude_none=True)
            if isinstance(d.get("content"), str):  # as OpenAI lists a message: its parts
                d["content"] = [{"type": "output_text" if d["role"] == "assistant"
                                 else "input_text", "text": d["content"]}]
            prefix = {"message": "msg", "function_call": "fc"}.get(d["type"], "fco")
            data.append({"id": f"{prefix}_{uuid.uuid4().hex}", **d})
        try:
            record = {"response": response, "input": data}
            if runner is not None:
                record["runner"] = runner
            if logged:
                record["logged"] = True
            await self.redis.set(self.keys.response(response["id"]), json.dumps(record),
                                 ex=self.ttl_s)
        except redis.RedisError:
            if not quiet:
                raise
            log.warning("response %s not stored: Redis failed", response["id"], exc_info=True)

    async def load(self, response_id: str) -> dict[str, Any]:
        """The stored `{"response", "input"}` of a response.

        Raises:
            APIError: 404 when there is none (never stored, deleted, or expired).
        """
        raw = await self.redis.get(self.keys.response(response_id))
        if raw is None:
            raise APIError(f"no response {response_id!r} is stored (never stored, deleted, or "
                           f"older than the gateway's --responses-ttl)", status=404,
                           param="response_id")
        return json.loads(raw)

    async def history(self, response_id: str) -> list[Any]:
        """The conversation a continuation of a stored response starts with: its input items,
        then its output as input items (the assistant's message, its function calls; its
        reasoning, which no prompt shows, left out).

        Raises:
            APIError: 404 when the response is not stored (naming previous_response_id).
        """
        try:
            stored = await self.load(response_id)
        except APIError as e:
            e.param = "previous_response_id"
            raise
        output = [{"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": part["text"]}
                               for part in item["content"]]}
                  if item["type"] == "message" else
                  {k: item[k] for k in ("type", "call_id", "name", "arguments")}
                  for item in stored["response"]["output"] if item["type"] != "reasoning"]
        return _ITEMS.validate_python([*stored["input"], *output])

    async def settle(self, response: dict[str, Any], unless: tuple[str, ...] = TERMINAL
                     ) -> dict[str, Any] | None:
        """Replace a stored response's object by `response` (the same id) unless its stored
        status is one of `unless` (default: any final status), atomically (WATCH): a
        background response's finish, start, cancel and loss race. Returns the stored object
        after, or None when none is stored (deleted or expired: not brought back)."""
        key = self.keys.response(response["id"])
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        return None
                    record = json.loads(raw)
                    if record["response"]["status"] in unless:
                        return record["response"]
                    record["response"] = response
                    pipe.multi()
                    pipe.set(key, json.dumps(record), keepttl=True)
                    await pipe.execute()
                    return response
                except redis.WatchError:
                    continue  # changed meanwhile: read it again

    async def current(self, record: dict[str, Any], cancel: Callable[[str], None]
                      ) -> dict[str, Any]:
        """The object of a stored response (`record`, as `load` returns it), as it stands.
        While it is a background response not finished, the gateway running it must still
        listen on its token channel: one that is gone is settled as failed, and its request
        given to `cancel` (a request id)."""
        response, runner = record["response"], record.get("runner")
        if runner is None or response["status"] in TERMINAL or not await self._runner_gone(
                record):
            return response
        failed = _failed(response, "the gateway running this background response stopped "
                         "before it finished")
        stored = await self.settle(failed)
        if stored is failed:
            cancel(runner["request_id"])
        return stored or failed

    async def _runner_gone(self, record: dict[str, Any]) -> bool:
        """Whether the gateway running a background response (`record["runner"]`) is gone: no
        client listens on its token channel."""
        [(_, listeners)] = await self.redis.pubsub_numsub(record["runner"]["channel"])
        return not listeners

    async def log_events(self, response_id: str, events: list[dict[str, Any]],
                         create: bool = False) -> None:
        """Append a streamed background response's `events` (each with its `sequence_number`)
        to its log, in one round trip; the log expires with the response. Only the first
        events `create` it: once the response is deleted, nothing is logged.

        Raises:
            redis.ResponseError: an event's sequence number is already in the log (another
                writer ended it first).
        """
        key = self.keys.response_events(response_id)
        pipe = self.redis.pipeline(transaction=True)
        for e in events:
            # Entry ids follow the sequence numbers (0 is not a valid id), so a resumed stream
            # starts at an id, and two writers of one number cannot both succeed.
            pipe.xadd(key, {"event": json.dumps(e)}, id=f"0-{e['sequence_number'] + 1}",
                      nomkstream=not create)
        pipe.expire(key, self.ttl_s)
        await pipe.execute()

    async def replay(self, response_id: str, after: int | None,
                     cancel: Callable[[str], None]) -> AsyncIterator[tuple[list[Any], bool]]:
        """A streamed background response's events with sequence numbers above `after` (all
        when None), as `gateway.sse.TypedEventStream` writes them: what the log holds at once,
        then each group as its gateway logs it, until the final event. When nothing comes for
        `REPLAY_POLL_MS`, the response is checked: a log that ended before `after` ends the
        stream; a runner that is gone has its response settled (`current`: failed, its request
        given to `cancel`) and the log ended with that response's final event. A response
        deleted or expired meanwhile, or Redis failing, ends the stream with an `error`
        event."""
        streamed = -1 if after is None else after  # the last sequence number passed
        try:
            async for group, final in self._follow(response_id, streamed, cancel):
                streamed = group[-1]["sequence_number"] if group else streamed
                yield group, final
        except redis.RedisError as e:
            log.warning("streaming response %s: Redis failed: %s", response_id, e)
            yield [_error_event("server_error", f"the gateway lost Redis while streaming the "
                                f"response; stream it again from sequence number {streamed}: "
                                f"{e}", streamed + 1)], True

    async def _follow(self, response_id: str, after: int, cancel: Callable[[str], None]
                      ) -> AsyncIterator[tuple[list[Any], bool]]:
        """`replay`'s events, read from the log after sequence number `after` (-1: all)."""
        key = self.keys.response_events(response_id)
        last = f"0-{after + 1}"
        block: int | None = None  # the first read returns what is there without waiting
        while True:
            reply = await self.redis.xread({key: last}, count=REPLAY_BATCH, block=block)
            block = REPLAY_POLL_MS
            if reply:
                [(_, entries)] = reply
                last = entries[-1][0]
                group = [json.loads(fields[b"event"]) for _, fields in entries]
                final = group[-1]["type"] in FINAL_EVENTS
                yield group, final
                if final:
                    return
                continue
            top = await self.redis.xrevrange(key, count=1)
            if _ended(top):
                yield [], True  # it ended at or before `after`
                return
            try:
                record = await self.load(response_id)
            except APIError as e:
                yield [_error_event("not_found", str(e), _next_sequence(top))], True
                return
            if not await self._runner_gone(record):
                continue
            if await self.redis.xread({key: last}, count=1):
                continue  # its last events came before it went: stream those first
            response = await self.current(record, cancel)
            if not top:  # it went before it logged anything
                yield [final_event(response, 0)], True
                return
            await self.end_log(response_id, response)  # then read that end (or another's)

    async def end_log(self, response_id: str, response: dict[str, Any]) -> None:
        """End a streamed background response's log with the final event of `response` (its
        object as it ended), unless the log has ended already or does not exist (the response
        was not streamed, or was deleted)."""
        top = await self.redis.xrevrange(self.keys.response_events(response_id), count=1)
        if not top or _ended(top):
            return
        with contextlib.suppress(redis.ResponseError):  # another writer ended it first
            await self.log_events(response_id, [final_event(response, _next_sequence(top))])

    async def delete(self, response_id: str) -> bool:
        """Delete a stored response and its events; whether it was stored."""
        removed = await self.redis.delete(self.keys.response(response_id))
        await self.redis.delete(self.keys.response_events(response_id))
        return bool(removed)


def final_event(response: dict[str, Any], sequence_number: int) -> dict[str, Any]:
    """The stream event that ends a response as it stands (`response.completed`,
    `.incomplete`, `.failed` or `.cancelled`), for a log that ended without its own."""
    return {"type": f"response.{response['status']}", "sequence_number": sequence_number,
            "response": response}


def _error_event(code: str, message: str, sequence_number: int) -> dict[str, Any]:
    """The stream event of an error that ends a stream (OpenAI's `error` event)."""
    return {"type": "error", "code": code, "message": message, "param": None,
            "sequence_number": sequence_number}


def _ended(top: list[Any]) -> bool:
    """Whether a log's last entry (`XREVRANGE key + - COUNT 1`'s reply) is a final event."""
    return bool(top) and json.loads(top[0][1][b"event"])["type"] in FINAL_EVENTS


def _next_sequence(top: list[Any]) -> int:
    """The sequence number after a log's last entry (`XREVRANGE key + - COUNT 1`'s reply)."""
    return int(top[0][0].split(b"-")[1]) if top else 0
