"""OpenAI's Responses API (`POST /v1/responses`) on top of chat: a request's `instructions` and
`input` become a chat request's messages and its `text.format` a structured output; the reply
becomes a response object with one assistant message, or, streamed, the API's typed events
(`response.created` ... `response.output_text.delta` ... `response.completed`), as vLLM serves
the API for models without tools or reasoning.

Stateless: nothing is stored, so `previous_response_id` is refused (send the conversation in
`input`), and so are `tools` and `background`, which shoal does not serve.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.schemas import (
    INT32_MAX,
    APIError,
    ChatMessage,
    ChatRequest,
    JSONSchemaFormat,
    ResponseFormat,
    unsupported,
)
from shoal.messages import TokenEvent


class InputText(BaseModel):
    """A text part of an input message (an earlier assistant turn's is `output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """One message of `input` (other item types, such as function calls or images, are not
    served)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def for_chat(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else \
            "\n".join(p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

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
    format: TextFormat = TextFormat(type="text")


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`: the fields shoal serves; others that change the reply are refused
    by name."""

    model_config = ConfigDict(strict=True)

    model: str | None = None
    input: str | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = Field(default=None, description="a system message before the "
                                     "input")
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool = Field(default=True, description="accepted; nothing is stored")
    user: str | None = None
    # shoal's and vLLM's extensions, as on chat
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    priority: int = Field(default=0, ge=-100, le=100)
    previous_response_id: Annotated[
        str | None, unsupported((None,), "previous_response_id (responses are not stored: "
                                "send the conversation in input)")] = None
    tools: Annotated[list[Any] | None, unsupported((None, []), "tools")] = None
    background: Annotated[bool | None, unsupported((None, False), "background")] = None

    def to_chat(self) -> ChatRequest:
        """The chat request this response is the reply to."""
        messages = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            messages += [m.for_chat() for m in self.input]
        fmt = self.text.format if self.text else None
        return ChatRequest(model=self.model, messages=messages,
                           max_completion_tokens=self.max_output_tokens,
                           temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                           seed=self.seed, priority=self.priority, stream=self.stream,
                           response_format=fmt.response_format() if fmt else None)


# A chat request's parameters that a refusal may name, by their Responses API names.
_PARAMS = {"messages": "input", "response_format": "text.format",
           "max_completion_tokens": "max_output_tokens"}


def renamed(e: APIError) -> APIError:
    """A chat request's refusal naming the response request's parameter instead."""
    e.param = _PARAMS.get(e.param or "", e.param)
    return e


class ResponseShape:
    """One response's object and events: `body` for the whole reply, `events` to stream it.

    Args:
        req: the request.
        model: the name the reply is from.
    """

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def body(self, text: str, last: TokenEvent | None, usage: dict[str, Any] | None
             ) -> dict[str, Any]:
        """The response object: in progress (no `last` event yet), completed, incomplete (cut
        at `max_output_tokens` or the context window) or failed (an error event); `usage` as
        `gateway.app._usage` counts it."""
        status, incomplete, error = "in_progress", None, None
        if last is not None:
            if last.finish_reason == "error":
                status, error = "failed", {"code": "server_error" if (last.error_status or 503)
                                           >= 500 else "invalid_request", "message": last.error}
            elif last.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            else:
                status = "completed"
        output = [self.message(text, status)] if last is not None and status != "failed" else []
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "text": {"format": (req.text.format if req.text else TextFormat(type="text")).echo()},
            "metadata": req.metadata or {}, "user": req.user,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]},
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The output's one item: the assistant's message."""
        return {"type": "message", "id": self.item_id, "role": "assistant",
                "status": "in_progress" if status == "in_progress" else
                "incomplete" if status == "incomplete" else "completed",
                "content": [self.part(text)] if status != "in_progress" else []}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    async def events(self, run: AsyncIterator[tuple[str, TokenEvent]], usage
                     ) -> AsyncIterator[tuple[list[dict[str, Any]], bool]]:
        """The stream's events, grouped by token as `gateway.sse.EventStream` writes them,
        from `gateway.app.Gateway.run`'s (text, event) pairs; `usage(last_event)` counts the
        tokens. In order: created, in_progress, the message and its text part added, a delta
        per piece of text, the text, part and message done, then completed (or incomplete);
        a failure ends the stream with `response.failed`."""
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            return {"type": kind, "sequence_number": next(seq), **fields}

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        opening = self.body("", None, None)
        yield [event("response.created", response=opening),
               event("response.in_progress", response=opening),
               event("response.output_item.added", output_index=0,
                     item=self.message("", "in_progress")),
               event("response.content_part.added", **where, part=self.part(""))], False
        text = ""
        async with contextlib.aclosing(run) as stream:  # leaving early cancels the request
            async for piece, ev in stream:
                group = []
                if piece:
                    text += piece
                    group.append(event("response.output_text.delta", **where, delta=piece,
                                       logprobs=[]))
                if ev.finish_reason == "error":
                    yield [*group, event("response.failed",
                                         response=self.body(text, ev, None))], True
                    return
                if ev.finish_reason is not None:
                    done = self.body(text, ev, usage(ev))
                    yield [*group,
                           event("response.output_text.done", **where, text=text, logprobs=[]),
                           event("response.content_part.done", **where, part=self.part(text)),
                           event("response.output_item.done", output_index=0,
                                 item=done["output"][0]),
                           event(f"response.{done['status']}", response=done)], True
                    return
                if group:
                    yield group, False
