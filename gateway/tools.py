"""Tool calls of the chat API, made by structured outputs rather than parsed from free text.

With `tool_choice` naming a function, the reply is constrained to a JSON object matching that
function's `parameters` schema and becomes one call's `arguments`; with `"required"`, it is
constrained to a JSON array of `{"name", "parameters"}` objects, one of the tools each (one at
most without `parallel_tool_calls`), and becomes the calls in order (finish_reason
"tool_calls"). Both are how vLLM serves these two choices without a model-specific tool-call
parser; so does shoal, which has no parser, and so refuses `"auto"` (as vLLM does without one):
a model left free to answer or call would need one to tell which it did.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.schemas import APIError, ChatRequest
from shoal.structured_output import InvalidStructuredOutput, StructuredOutput

ANY_OBJECT = {"type": "object"}  # a function declared without parameters takes any object


@dataclass
class ToolCalls:
    """How one chat request's tools shape its reply: the constraint its requests carry and how
    each choice's text becomes `tool_calls` (None when the request calls no tool).

    Attributes:
        mode: "named" (one given function) or "required" (one or more of the tools).
        name: the function, when named.
        constraint: what every choice's text must match.
    """

    mode: str
    name: str | None
    constraint: StructuredOutput
    _ids: dict[int, str] = field(default_factory=dict)  # choice -> its named call's id

    @classmethod
    def of(cls, req: ChatRequest) -> ToolCalls | None:
        """The request's tool calls, or None when its reply is text (no tools, or
        `tool_choice` "none").

        Raises:
            APIError: `tool_choice` "auto" (or tools without a tool_choice, whose default it
                is), a named function that is not among the tools, a choice without tools,
                tools with `response_format` or `structured_outputs`, or a `parameters` schema
                that does not compile.
        """
        choice, tools = req.tool_choice, req.tools or []
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return None
        if not tools:
            raise APIError("tool_choice needs tools", param="tool_choice")
        if choice == "auto":
            raise APIError('tool_choice "auto" needs a tool-call parser, which shoal does not '
                           'have; use "required" or name a function (tool calls are then '
                           'structured outputs)', param="tool_choice")
        if req.structured_outputs is not None or (req.response_format is not None
                                                  and req.response_format.type != "text"):
            raise APIError("tool calls cannot be combined with response_format or "
                           "structured_outputs", param="tool_choice")
        schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in tools}
        if choice == "required":
            item = {"anyOf": [{"type": "object", "additionalProperties": False,
                               "required": ["name", "parameters"],
                               "properties": {"name": {"const": name}, "parameters": schema}}
                              for name, schema in schemas.items()]}
            array = {"type": "array", "minItems": 1, "items": item}
            if not req.parallel_tool_calls:
                array["maxItems"] = 1
            calls = cls("required", None, StructuredOutput("json", json.dumps(array)))
        else:
            name = choice.function.name
            if name not in schemas:
                raise APIError(f"tool_choice names {name!r}, which is not among the tools",
                               param="tool_choice")
            calls = cls("named", name, StructuredOutput("json", json.dumps(schemas[name])))
        try:
            calls.constraint.check()
        except InvalidStructuredOutput as e:
            raise APIError(f"tools: a function's parameters: {e}", param="tools") from e
        return calls

    def call_id(self, choice: int) -> str:
        """The id of a choice's named call (the same in every chunk of a stream)."""
        return self._ids.setdefault(choice, f"call_{uuid.uuid4().hex[:24]}")

    def message(self, choice: int, text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """A finished choice's `tool_calls` and its `content`: the calls, or (None, text) when
        the text is not a complete call (cut short by max_tokens)."""
        if self.mode == "named":
            return [self._call(self.call_id(choice), self.name, text)], None
        try:
            calls = json.loads(text)
        except ValueError:
            return None, text
        return [self._call(f"call_{uuid.uuid4().hex[:24]}", c["name"],
                           json.dumps(c["parameters"], ensure_ascii=False)) for c in calls], None

    def finish_reason(self, reason: str | None, calls: list | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call ("required"); a named call that
        was forced ends with "stop"."""
        return "tool_calls" if self.mode == "required" and calls and reason == "stop" else reason

    @staticmethod
    def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def delta(self, choice: int, piece: str, text_so_far: str, finished: bool
              ) -> dict[str, Any] | None:
        """A stream chunk's `delta` for new text `piece` of a choice (`text_so_far` includes
        it): a named call's arguments stream as they come (its id and name with the first
        piece); "required" calls are sent whole when the choice finishes, the array's text
        being no call until it closes. None when there is nothing to send yet."""
        if self.mode == "named":
            if not piece:
                return None
            if len(text_so_far) == len(piece):  # the call opens with its id and name
                return {"tool_calls": [{"index": 0, **self._call(self.call_id(choice), self.name,
                                                                 piece)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        if not finished:
            return None
        calls, content = self.message(choice, text_so_far)
        if calls is None:
            return {"content": content}
        return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
