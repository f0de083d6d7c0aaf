"""Tool calls of the chat API: made by structured outputs where the request forces a call, read
from free text where the model chooses.

With `tool_choice` naming a function, the reply is constrained to a JSON object matching that
function's `parameters` schema and becomes one call's `arguments`; with `"required"`, it is
constrained to a JSON array of `{"name", "parameters"}` objects, one of the tools each (one at
most without `parallel_tool_calls`), and becomes the calls in order (finish_reason
"tool_calls"). Both are how vLLM serves these two choices, with no model-specific parser.

With `"auto"` (the default with tools) the model may answer or call, and a tool-call parser
tells which it did, as vLLM's `--enable-auto-tool-choice --tool-call-parser` (`PARSERS`):
`hermes` reads calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes, Qwen and others; a JSON list inside one block, SmolLM2's form, is read too);
`llama3_json` a reply that is JSON calls, `{"name": ..., "parameters": {...}}`, several
separated by `;`, after Llama 3.1's optional `<|python_tag|>`; `pythonic` a reply that is a
Python list of calls with literal arguments, `[get_weather(city="Paris"), ...]` (Llama 3.2
and 4). Without a parser the gateway refuses "auto", as vLLM does: nothing could tell a call
from an answer.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.schemas import APIError, ChatRequest
from shoal.structured_output import InvalidStructuredOutput, StructuredOutput

ANY_OBJECT = {"type": "object"}  # a function declared without parameters takes any object
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# Each block's body: up to its closing tag, or to the end of a reply cut short.
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|\Z)", re.S)


def parse_hermes(text: str) -> tuple[list[tuple[str, str]] | None, str | None]:
    """A reply in the Hermes tool-call format, as (calls, content): each call a (name,
    arguments as JSON text) pair, in order; the content is the text before the first
    `<tool_call>` (None when blank). A block holds a JSON object with `name` and `arguments`
    (or `parameters`), or a list of them. A reply without blocks, or with one that does not
    parse, is all content: (None, text)."""
    start = text.find(_OPEN)
    if start < 0:
        return None, text
    calls = []
    for block in _BLOCK.finditer(text, start):
        try:
            body = json.loads(block.group(1))
        except ValueError:
            return None, text
        for call in body if isinstance(body, list) else [body]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None, text
            args = call.get("arguments", call.get("parameters", {}))
            calls.append((call["name"], args if isinstance(args, str)
                          else json.dumps(args, ensure_ascii=False)))
    if not calls:
        return None, text
    content = text[:start]
    return calls, content if content.strip() else None


def _held_back(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`: a stream holds them
    back until the next piece tells."""
    for n in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0


def _hermes_content_end(text: str) -> int:
    start = text.find(_OPEN)
    return start if start >= 0 else len(text) - _held_back(text)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[list[tuple[str, str]] | None, str | None]:
    """A reply in Llama 3.1's JSON tool-call format, as `parse_hermes` returns it: the whole
    reply (after an optional `<|python_tag|>`) is one or more `{"name": ..., "parameters":
    {...}}` objects (or `"arguments"`), separated by `;`. Anything else is all content."""
    body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return None, text
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        try:
            call, at = decoder.raw_decode(body, at)
        except ValueError:
            return None, text
        args = call.get("parameters", call.get("arguments", {})) if isinstance(call, dict) \
            else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                or not isinstance(args, dict | str):
            return None, text
        calls.append((call["name"], args if isinstance(args, str)
                       else json.dumps(args, ensure_ascii=False)))
        while at < len(body) and body[at] in "; \t\r\n":
            at += 1
    return calls, None


def _llama3_json_content_end(text: str) -> int:
    body = text.lstrip()
    if not body or body.startswith("{") or body.startswith(_PYTHON_TAG) \
            or _PYTHON_TAG.startswith(body):
        return 0  # a call, or what may still become one: held to the end
    return len(text)


def parse_pythonic(text: str) -> tuple[list[tuple[str, str]] | None, str | None]:
    """A reply in the pythonic tool-call format (Llama 3.2 and 4), as `parse_hermes` returns
    it: the whole reply is a Python list of calls whose arguments are keywords with literal
    values, `[get_weather(city="Paris", days=2), get_time()]`. Anything else is all content."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None, text
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None, text
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args and all(k.arg for k in node.keywords)):
                return None, text
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None, text
    return calls, None


def _pythonic_content_end(text: str) -> int:
    body = text.lstrip()
    return 0 if not body or body.startswith("[") else len(text)


@dataclass(frozen=True)
class ToolCallParser:
    """How replies of one model family hold the calls the model chose to make ("auto").

    Attributes:
        parse: a finished reply's calls, as (name, arguments as JSON text) pairs in order, and
            the content before them (None when blank); (None, reply) when it holds no call.
        content_end: how much of a reply still coming is surely content, in characters: up to
            where a call begins, less what could still begin one; a stream sends that much.
    """

    parse: Callable[[str], tuple[list[tuple[str, str]] | None, str | None]]
    content_end: Callable[[str], int]


PARSERS = {"hermes": ToolCallParser(parse_hermes, _hermes_content_end),
           "llama3_json": ToolCallParser(parse_llama3_json, _llama3_json_content_end),
           "pythonic": ToolCallParser(parse_pythonic, _pythonic_content_end)}
TOOL_CALL_PARSERS = tuple(PARSERS)


@dataclass
class _Call:
    """One call of a "required" reply as its text comes (`CallArrayReader`)."""

    name: str | None = None
    start: int | None = None  # where its parameters' value begins in the reply
    end: int | None = None  # where it ends, once it has
    sent: int = 0  # characters of its arguments handed on
    opened: bool = False  # its name handed on
    closed: bool = False  # its end handed on


class CallArrayReader:
    """Reads the JSON array a "required" tool_choice constrains a reply to, `[{"name": ...,
    "parameters": {...}}, ...]`, as its text comes, so that each call streams as it is
    generated: its name once that string closes, then its arguments piece by piece, the text of
    its `parameters` value as the model wrote it (so the pieces add up to the call's final
    `arguments`). A character scanner, not a partial-JSON parser: it has only to tell where each
    element's two values lie, and the constraint has already made the text valid JSON so far.
    The keys may come in either order; arguments wait for their call's name.
    """

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[_Call] = []
        self._depth = 0  # brackets open outside strings: the array 1, an element 2
        self._string = self._escape = False
        self._token: int | None = None  # where a key or a name string begins, at depth 2
        self._key: str | None = None  # the element's key whose value comes or is read
        self._colon = False  # the key's colon is past: its value is next or under way

    def feed(self, piece: str) -> list[tuple[str, int, str]]:
        """Read `piece`, the reply's next text; returns what it completes, in order: ("open",
        call index, name), ("arguments", call index, text), ("close", call index, "") when a
        call's parameters end."""
        begin = len(self.text)
        self.text += piece
        for i in range(begin, len(self.text)):
            self._read(i, self.text[i])
        events = []
        for k, call in enumerate(self.calls):
            if call.name is None:
                continue
            if not call.opened:
                call.opened = True
                events.append(("open", k, call.name))
            if call.start is not None:
                upto = call.end if call.end is not None else len(self.text)
                if upto > call.start + call.sent:
                    events.append(("arguments", k, self.text[call.start + call.sent:upto]))
                    call.sent = upto - call.start
                if call.end is not None and not call.closed:
                    call.closed = True
                    events.append(("close", k, ""))
        return events

    def arguments(self, k: int) -> str:
        """Call `k`'s arguments as written so far (all of them once it has closed)."""
        call = self.calls[k]
        return "" if call.start is None else self.text[call.start:call.end]

    def _read(self, i: int, ch: str) -> None:
        call = self.calls[-1] if self.calls else None
        if self._string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._string = False
                if self._token is not None:  # a key, or the name's value, at the element's level
                    value = json.loads(self.text[self._token:i + 1])
                    self._token = None
                    if self._key is None:
                        self._key, self._colon = value, False
                    elif call is not None and self._key == "name":
                        call.name = value
                elif self._depth == 2 and self._key == "parameters" and call is not None:
                    call.end = i + 1  # a string value (no schema here asks for one)
            return
        in_value = self._depth == 2 and self._colon
        if ch == '"':
            self._string = True
            if self._depth == 2 and (self._key is None or in_value and self._key == "name"):
                self._token = i
            elif in_value and self._key == "parameters" and call is not None and call.start is None:
                call.start = i
        elif ch in "{[":
            if self._depth == 1 and ch == "{":
                self.calls.append(_Call())
                self._key, self._colon = None, False
            elif in_value and self._key == "parameters" and call is not None and call.start is None:
                call.start = i
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 2 and self._key == "parameters" and call is not None \
                    and call.end is None:
                call.end = i + 1
        elif self._depth == 2 and ch == ":":
            self._colon = True
        elif self._depth == 2 and ch == ",":
            self._key, self._colon = None, False


@dataclass
class ToolCalls:
    """How one chat request's tools shape its reply: the constraint its requests carry and how
    each choice's text becomes `tool_calls` (None when the request calls no tool).

    Attributes:
        mode: "named" (one given function), "required" (one or more of the tools) or "auto"
            (the model's choice, read by `parser`).
        name: the function, when named.
        constraint: what every choice's text must match (None with "auto").
        parser: the tool-call parser of "auto" (`TOOL_CALL_PARSERS`).
    """

    mode: str
    name: str | None
    constraint: StructuredOutput | None
    parser: str | None = None
    _ids: dict[tuple[int, int], str] = field(default_factory=dict)  # (choice, call) -> id
    _sent: dict[int, int] = field(default_factory=dict)  # choice -> characters of content sent
    _readers: dict[int, CallArrayReader] = field(default_factory=dict)  # "required", streamed
    _called: set[int] = field(default_factory=set)  # choices whose stream has sent a call

    @classmethod
    def of(cls, req: ChatRequest, parser: str | None = None) -> ToolCalls | None:
        """The request's tool calls, or None when its reply is text (no tools, or
        `tool_choice` "none"); `parser` reads "auto" replies (None: "auto" is refused).

        Raises:
            APIError: `tool_choice` "auto" (or tools without a tool_choice, whose default it
                is) without a parser, a named function that is not among the tools, a choice
                without tools, tools with `response_format` or `structured_outputs`, or a
                `parameters` schema that does not compile.
        """
        choice, tools = req.tool_choice, req.tools or []
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return None
        if not tools:
            raise APIError("tool_choice needs tools", param="tool_choice")
        if choice == "auto" and parser is None:
            raise APIError('tool_choice "auto" (the default with tools) needs a tool-call '
                           'parser: start the gateway with --enable-auto-tool-choice '
                           '--tool-call-parser (hermes, llama3_json or pythonic), or use '
                           '"required" or name a function '
                           '(tool calls are then structured outputs)', param="tool_choice")
        if req.structured_outputs is not None or (req.response_format is not None
                                                  and req.response_format.type != "text"):
            raise APIError("tool calls cannot be combined with response_format or "
                           "structured_outputs", param="tool_choice")
        if choice == "auto":
            return cls("auto", None, None, parser)
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

    def call_id(self, choice: int, k: int = 0) -> str:
        """The id of a choice's call `k` (the same in every chunk of a stream and in the
        finished reply)."""
        return self._ids.setdefault((choice, k), f"call_{uuid.uuid4().hex[:24]}")

    def called(self, choice: int) -> bool:
        """Whether a choice's stream has sent a tool call."""
        return choice in self._called

    def message(self, choice: int, text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """A finished choice's `tool_calls` and its `content`: the calls (with "auto", and the
        text before them), or (None, text) when the text is no call (an answer, or a call cut
        short by max_tokens)."""
        if self.mode == "named":
            return [self._call(self.call_id(choice), self.name, text)], None
        if self.mode == "auto":
            calls, content = PARSERS[self.parser].parse(text)
            if calls is None:
                return None, text
            return [self._call(self.call_id(choice, k), name, args)
                    for k, (name, args) in enumerate(calls)], content
        try:
            calls = json.loads(text)
        except ValueError:
            return None, text
        reader = CallArrayReader()  # each call's arguments as written, as they were streamed
        reader.feed(text)
        return [self._call(self.call_id(choice, k), c["name"], reader.arguments(k)
                           or json.dumps(c["parameters"], ensure_ascii=False))
                for k, c in enumerate(calls)], None

    def finish_reason(self, reason: str | None, calls: list | bool | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call ("required", "auto"; `calls`:
        the calls, or whether a stream sent one); a named call that was forced ends with
        "stop"."""
        return "tool_calls" if self.mode != "named" and calls and reason == "stop" else reason

    @staticmethod
    def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def delta(self, choice: int, piece: str, text_so_far: str, finished: bool
              ) -> dict[str, Any] | None:
        """A stream chunk's `delta` for new text `piece` of a choice (`text_so_far` includes
        it): a named call's arguments stream as they come (its id and name with the first
        piece); so do "required" calls, each opening (index, id, name) once its name is
        written and its arguments following piece by piece (`CallArrayReader`); a reply cut
        short before any call opened comes as content when it finishes. With "auto", the text
        streams as content until a `<tool_call>` begins (what could begin one is held back),
        and the calls are sent whole when the choice finishes. None when there is nothing to
        send yet."""
        if self.mode == "auto":
            return self._auto_delta(choice, text_so_far, finished)
        if self.mode == "named":
            if not piece:
                return None
            if len(text_so_far) == len(piece):  # the call opens with its id and name
                return {"tool_calls": [{"index": 0, **self._call(self.call_id(choice), self.name,
                                                                 piece)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        deltas: list[dict[str, Any]] = []
        for kind, k, value in self.feed(choice, piece):
            if kind == "open":
                deltas.append({"index": k, **self._call(self.call_id(choice, k), value, "")})
            elif kind == "arguments":
                if deltas and deltas[-1]["index"] == k:
                    deltas[-1]["function"]["arguments"] += value
                else:
                    deltas.append({"index": k, "function": {"arguments": value}})
        if deltas:
            return {"tool_calls": deltas}
        if finished and not self.called(choice):
            return {"content": text_so_far}  # no call: cut short before one opened
        return None

    def feed(self, choice: int, piece: str) -> list[tuple[str, int, str]]:
        """A "required" reply's next text `piece`, read by its choice's `CallArrayReader`:
        what it completes (calls opened, arguments, calls closed), as `CallArrayReader.feed`."""
        reader = self._readers.setdefault(choice, CallArrayReader())
        events = reader.feed(piece)
        if reader.calls and reader.calls[0].opened:
            self._called.add(choice)
        return events

    def arguments(self, choice: int, k: int) -> str:
        """Call `k`'s arguments in a streamed "required" reply, as far as they came."""
        return self._readers[choice].arguments(k)

    def _auto_delta(self, choice: int, text: str, finished: bool) -> dict[str, Any] | None:
        sent = self._sent.get(choice, 0)
        if finished:
            calls, content = self.message(choice, text)
            if calls is None:
                return {"content": text[sent:]} if len(text) > sent else None
            out: dict[str, Any] = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
            self._called.add(choice)
            if content is not None and len(content) > sent:  # the text before the calls
                out["content"] = content[sent:]
            return out
        cut = PARSERS[self.parser].content_end(text)
        if cut <= sent or not text[:cut].strip():  # blank text before a call is no content
            return None
        self._sent[choice] = cut
        return {"content": text[sent:cut]}
