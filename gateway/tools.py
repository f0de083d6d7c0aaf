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
and 4); `mistral` a JSON array of calls after `[TOOL_CALLS]` (Mistral 7B v0.3, Nemo; their ids
nine letters and digits, as Mistral's template wants them). Without a parser the gateway
refuses "auto", as vLLM does: nothing could tell a call from an answer.
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


def _json_call(call: Any, keys: tuple[str, str] = ("arguments", "parameters")
               ) -> tuple[str, str] | None:
    """A parsed JSON call object as (name, arguments as JSON text): its arguments under the
    first of `keys` it has (an object, or a string that holds them), none meaning `{}`; None
    for what is no call."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get(keys[0], call.get(keys[1], {}))
    if not isinstance(args, dict | str):
        return None
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


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
            if (parsed := _json_call(call)) is None:
                return None, text
            calls.append(parsed)
    if not calls:
        return None, text
    content = text[:start]
    return calls, content if content.strip() else None


def _held_back(text: str, tag: str = _OPEN) -> int:
    """How many characters at the end of `text` could begin `tag`: a stream holds them back
    until the next piece tells."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _hermes_content_end(text: str) -> int:
    start = text.find(_OPEN)
    return start if start >= 0 else len(text) - _held_back(text)


def _hermes_spans(text: str) -> list[tuple[int, int, bool]]:
    """Where the calls' text lies in a hermes reply still coming: each block's body, as
    (start, end, whether the block has closed); an open block's end leaves out what could
    begin `</tool_call>`."""
    spans, at = [], 0
    while (start := text.find(_OPEN, at)) >= 0:
        start += len(_OPEN)
        end = text.find(_CLOSE, start)
        if end < 0:
            return [*spans, (start, len(text) - _held_back(text, _CLOSE), False)]
        spans.append((start, end, True))
        at = end + len(_CLOSE)
    return spans


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
        if (parsed := _json_call(call, ("parameters", "arguments"))) is None:
            return None, text
        calls.append(parsed)
        while at < len(body) and body[at] in "; \t\r\n":
            at += 1
    return calls, None


def _llama3_json_content_end(text: str) -> int:
    body = text.lstrip()
    if not body or body.startswith("{") or body.startswith(_PYTHON_TAG) \
            or _PYTHON_TAG.startswith(body):
        return 0  # a call, or what may still become one: held to the end
    return len(text)


def _llama3_json_spans(text: str) -> list[tuple[int, int, bool]]:
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    return [(len(text) - len(body), len(text), False)] if body.startswith("{") else []


_TOOL_CALLS = "[TOOL_CALLS]"


def _mistral_calls_start(text: str) -> tuple[int, int] | None:
    """Where a Mistral reply's calls begin: (where the content ends, where their JSON array
    begins), or None for a reply without calls (so far). The `[TOOL_CALLS]` marker is a
    special token, so a reply detokenized without special tokens holds only the array, first;
    a reply that opens with an array is read as one whatever follows, and one that may still
    open with the marker (`[TO`) is no call yet."""
    body = text.lstrip()
    lead = len(text) - len(body)
    if body.startswith(_TOOL_CALLS):
        rest = body[len(_TOOL_CALLS):]
        return lead, len(text) - len(rest.lstrip())
    if body.startswith("[") and not _TOOL_CALLS.startswith(body):
        return 0, lead
    at = text.find(_TOOL_CALLS)
    if at < 0 or not body or _TOOL_CALLS.startswith(body):
        return None
    rest = text[at + len(_TOOL_CALLS):]
    return at, len(text) - len(rest.lstrip())


def parse_mistral(text: str) -> tuple[list[tuple[str, str]] | None, str | None]:
    """A reply in Mistral's tool-call format (Mistral 7B v0.3, Nemo), as `parse_hermes`
    returns it: the text before `[TOOL_CALLS]` is content, the marker is followed by a JSON
    array of `{"name": ..., "arguments": {...}}` calls (the array alone, first, where the
    marker was left out as a special token). Anything else is all content."""
    where = _mistral_calls_start(text)
    if where is None:
        return None, text
    content, start = where
    try:
        body, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None, text
    if not isinstance(body, list) or not body or text[end:].strip():
        return None, text
    calls = [_json_call(call) for call in body]
    if None in calls:
        return None, text
    return calls, text[:content] if text[:content].strip() else None


def _mistral_content_end(text: str) -> int:
    where = _mistral_calls_start(text)
    if where is not None:
        return where[0]
    if _TOOL_CALLS.startswith(text.lstrip()):  # blank, or the marker may still be coming
        return 0
    return len(text) - _held_back(text, _TOOL_CALLS)


def _mistral_spans(text: str) -> list[tuple[int, int, bool]]:
    where = _mistral_calls_start(text)
    return [] if where is None else [(where[1], len(text), False)]


def _mistral_call_id() -> str:
    # Mistral's chat template takes only ids of nine letters and digits.
    return uuid.uuid4().hex[:9]


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
        spans: where the JSON text of the calls lies in a reply still coming, as (start, end,
            closed) spans that `CallReader` reads one after another, so that calls stream as
            they are written; None for a form that is not JSON (its calls come whole at the
            end).
        call_id: a new call's id (the form the model's chat template takes back).
    """

    parse: Callable[[str], tuple[list[tuple[str, str]] | None, str | None]]
    content_end: Callable[[str], int]
    spans: Callable[[str], list[tuple[int, int, bool]]] | None = None
    call_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}"


PARSERS = {"hermes": ToolCallParser(parse_hermes, _hermes_content_end, _hermes_spans),
           "llama3_json": ToolCallParser(parse_llama3_json, _llama3_json_content_end,
                                         _llama3_json_spans),
           "pythonic": ToolCallParser(parse_pythonic, _pythonic_content_end),
           "mistral": ToolCallParser(parse_mistral, _mistral_content_end, _mistral_spans,
                                     _mistral_call_id)}
TOOL_CALL_PARSERS = tuple(PARSERS)


@dataclass
class _Call:
    """One call of a reply as its text comes (`CallReader`)."""

    name: str | None = None
    start: int | None = None  # where its arguments' value begins in the text read
    end: int | None = None  # where that value ends, once it has
    done: bool = False  # its object has closed (or its block has ended)
    index: int | None = None  # its place among the calls handed on, once its name has been
    sent: int = 0  # characters of its arguments handed on
    closed: bool = False  # its end handed on

    @property
    def ended(self) -> bool:
        """Its arguments, or its object, have ended: nothing more of it will come."""
        return self.end is not None or self.done


_ARGUMENTS = ("arguments", "parameters")  # the keys a call's arguments may come under


def _string(literal: str) -> str:
    """A JSON string literal's value; one the model wrote wrong (a bad escape) as it stands."""
    try:
        return json.loads(literal, strict=False)
    except ValueError:
        return literal[1:-1]


class CallReader:
    """Reads tool calls written as JSON objects, `{"name": ..., "arguments": {...}}` (or
    `"parameters"`), as their text comes, so that each call streams as it is generated: its
    name once that string closes, then its arguments piece by piece, the text of their value
    as the model wrote it (so the pieces add up to the call's final `arguments`). The objects
    may stand one after another (Llama 3's calls, with `;` between them) or be the elements of
    one array (what "required" constrains a reply to; the hermes list form). A character
    scanner, not a partial-JSON parser: it has only to tell where each object's two values
    lie. The keys may come in either order; arguments wait for their call's name, and
    arguments written as a JSON string are handed on decoded, whole, once the string closes.
    An object without a name is no call.
    """

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[_Call] = []  # every object read, named or not
        self.opened: list[_Call] = []  # the calls handed on, by index
        self._stack: list[str] = []  # the brackets open outside strings
        self._level: int | None = None  # len(_stack) inside the current call's object
        self._string = self._escape = False
        self._token: int | None = None  # where a key or a name string begins
        self._key: str | None = None  # the object's key whose value comes or is read
        self._colon = False  # the key's colon is past: its value is next or under way

    def feed(self, piece: str) -> list[tuple[str, int, str]]:
        """Read `piece`, the next text; returns what it completes, in order: ("open", call
        index, name), ("arguments", call index, text), ("close", call index, "") when a
        call's arguments end."""
        begin = len(self.text)
        self.text += piece
        for i in range(begin, len(self.text)):
            self._read(i, self.text[i])
        return self._events()

    def end_block(self) -> list[tuple[str, int, str]]:
        """The text read so far ends what was open (a hermes `</tool_call>`): the next text
        starts afresh. Returns what that completes, as `feed`."""
        for call in self.calls:
            if call.start is not None and call.end is None:
                call.end = len(self.text)
            call.done = True
        self._stack.clear()
        self._level = self._token = self._key = None
        self._string = self._escape = self._colon = False
        return self._events()

    def arguments(self, k: int) -> str:
        """Call `k`'s arguments as written so far (all of them once it has closed; `{}` for
        a call whose object closed without any)."""
        call = self.opened[k]
        if call.start is None:
            return "{}" if call.done else ""
        if self.text[call.start] == '"':  # a string: its value, once whole
            return _string(self.text[call.start:call.end]) if call.end is not None else ""
        return self.text[call.start:call.end]

    def _events(self) -> list[tuple[str, int, str]]:
        events = []
        for call in self.calls:
            if call.name is None or call.closed:
                continue
            if call.index is None:
                call.index = len(self.opened)
                self.opened.append(call)
                events.append(("open", call.index, call.name))
            arguments = self.arguments(call.index)
            if len(arguments) > call.sent:
                events.append(("arguments", call.index, arguments[call.sent:]))
                call.sent = len(arguments)
            if not call.closed and call.ended:
                call.closed = True
                events.append(("close", call.index, ""))
        return events

    def _read(self, i: int, ch: str) -> None:
        call = self.calls[-1] if self._level is not None else None
        at_keys = call is not None and len(self._stack) == self._level  # the object's level
        if self._string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._string = False
                if self._token is not None:  # a key, or the name's value
                    value = _string(self.text[self._token:i + 1])
                    self._token = None
                    if self._key is None:
                        self._key, self._colon = value, False
                    elif call is not None and call.name is None:
                        call.name = value
                elif at_keys and self._key in _ARGUMENTS and call.end is None \
                        and call.start is not None:
                    call.end = i + 1  # the arguments were a string
            return
        in_value = at_keys and self._colon
        if ch == '"':
            self._string = True
            if at_keys and (self._key is None or in_value and self._key == "name"):
                self._token = i
            elif in_value and self._key in _ARGUMENTS and call.start is None:
                call.start = i
        elif ch in "{[":
            if ch == "{" and call is None and self._stack in ([], ["["]):  # a call begins
                self.calls.append(_Call())
                self._level, self._key, self._colon = len(self._stack) + 1, None, False
            elif in_value and self._key in _ARGUMENTS and call.start is None:
                call.start = i
            self._stack.append(ch)
        elif ch in "}]":
            if self._stack:
                self._stack.pop()
            if call is not None and len(self._stack) < self._level:  # the call's object closed
                call.done, self._level = True, None
            elif call is not None and len(self._stack) == self._level \
                    and self._key in _ARGUMENTS and call.start is not None and call.end is None:
                call.end = i + 1  # the arguments' object or array closed
        elif at_keys and ch == ":":
            self._colon = True
        elif at_keys and ch == ",":
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
    _readers: dict[int, CallReader | ReplyReader] = field(default_factory=dict)  # streamed
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
                           '--tool-call-parser (hermes, llama3_json, pythonic or mistral), or use '
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
        if (choice, k) not in self._ids:
            self._ids[choice, k] = PARSERS[self.parser].call_id() if self.parser \
                else f"call_{uuid.uuid4().hex[:24]}"
        return self._ids[choice, k]

    def called(self, choice: int) -> bool:
        """Whether a choice's stream has sent a tool call."""
        return choice in self._called

    def streamed(self, choice: int) -> bool:
        """Whether a choice's stream opened calls as their text came (`feed`)."""
        return choice in self._readers and bool(self._call_reader(choice).opened)

    def message(self, choice: int, text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """A finished choice's `tool_calls` and its `content`: the calls (with "auto", and the
        text before them), or (None, text) when the text is no call (an answer, or a call cut
        short by max_tokens). A choice whose stream opened calls as they came has those, as
        they were sent."""
        if self.mode == "named":
            return [self._call(self.call_id(choice), self.name, text)], None
        if self.streamed(choice):
            reader = self._readers[choice]
            content = text[:reader.sent] if isinstance(reader, ReplyReader) and reader.sent \
                else None
            return [self._call(self.call_id(choice, k), name, arguments)
                    for k, (name, arguments, _) in enumerate(self.begun(choice))], content
        if self.mode == "auto":
            calls, content = PARSERS[self.parser].parse(text)
            if calls is None:
                return None, text
            return [self._call(self.call_id(choice, k), name, args)
                    for k, (name, args) in enumerate(calls)], content
        try:
            json.loads(text)
        except ValueError:
            return None, text
        return [self._call(self.call_id(choice, k), name, arguments)
                for k, (name, arguments, _) in enumerate(self.begun(choice, text))], None

    def begun(self, choice: int, text: str | None = None) -> list[tuple[str, str, bool]]:
        """The calls a reply began, as (name, arguments as written so far, whether they
        closed): those its stream opened, or, given the whole `text` of an unstreamed
        "required" reply, those it holds."""
        if text is not None:
            reader = CallReader()
            reader.feed(text)
        else:
            reader = self._call_reader(choice)
        return [(c.name, reader.arguments(k), c.ended)
                for k, c in enumerate(reader.opened)]

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
        piece); "required" and "auto" calls open (index, id, name) once their names are
        written and their arguments follow piece by piece (`feed`), and "auto" text before
        them streams as content. What `feed` cannot read as it comes is sent when the choice
        finishes: a "required" reply cut short before any call opened, as content; an "auto"
        reply's calls in a form that is not JSON (pythonic), whole, or its held-back text.
        None when there is nothing to send yet."""
        if self.mode == "named":
            if not piece:
                return None
            if len(text_so_far) == len(piece):  # the call opens with its id and name
                return {"tool_calls": [{"index": 0, **self._call(self.call_id(choice), self.name,
                                                                 piece)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        out: dict[str, Any] = {}
        deltas: list[dict[str, Any]] = []
        for kind, k, value in self.feed(choice, piece):
            if kind == "content":
                out["content"] = value
            elif kind == "open":
                deltas.append({"index": k, **self._call(self.call_id(choice, k), value, "")})
            elif kind == "arguments":
                if deltas and deltas[-1]["index"] == k:
                    deltas[-1]["function"]["arguments"] += value
                else:
                    deltas.append({"index": k, "function": {"arguments": value}})
        if finished and not self.called(choice):
            if self.mode == "required":
                return {"content": text_so_far}  # no call: cut short before one opened
            calls, content = self.message(choice, text_so_far)
            rest = (text_so_far if calls is None else content or "")[self._readers[choice].sent:]
            if rest:
                out["content"] = out.get("content", "") + rest
            if calls:
                self._called.add(choice)
                deltas = [{"index": k, **c} for k, c in enumerate(calls)]
        if deltas:
            out["tool_calls"] = deltas
        return out or None

    def feed(self, choice: int, piece: str) -> list[tuple[str, int, str]]:
        """A streamed reply's next text `piece`, read by its choice's reader (a `CallReader`
        for "required", a `ReplyReader` for "auto"): what it completes, in order, as
        `ReplyReader.feed` gives it."""
        reader = self._readers.get(choice)
        if reader is None:
            reader = self._readers[choice] = CallReader() if self.mode == "required" \
                else ReplyReader(PARSERS[self.parser])
        events = reader.feed(piece)
        if any(kind == "open" for kind, _, _ in events):
            self._called.add(choice)
        return events

    def arguments(self, choice: int, k: int) -> str:
        """Call `k`'s arguments in a streamed reply, as far as they came."""
        return self._call_reader(choice).arguments(k)

    def _call_reader(self, choice: int) -> CallReader:
        reader = self._readers[choice]
        return reader.calls if isinstance(reader, ReplyReader) else reader


class ReplyReader:
    """Reads one streamed "auto" reply as its text comes: the text that is surely content (the
    parser's `content_end`) and the calls in it, read by a `CallReader` over the parser's
    `spans`, so that each call streams as it is written, as vLLM's streaming tool parsers do.

    Args:
        parser: the reply's form.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of content handed on
        self.calls = CallReader()
        self._read: list[int] = []  # how far each span has been read
        self._ended = 0  # spans whose end has been read

    def feed(self, piece: str) -> list[tuple[str, int, str]]:
        """Read `piece`, the reply's next text; returns what it completes, in order:
        ("content", 0, text) for text that is surely content, then `CallReader.feed`'s
        events."""
        self.text += piece
        events = []
        cut = self.parser.content_end(self.text)
        if cut > self.sent and self.text[:cut].strip():  # blank text before a call is none
            events.append(("content", 0, self.text[self.sent:cut]))
            self.sent = cut
        for i, (start, end, closed) in enumerate(self.parser.spans(self.text)
                                                 if self.parser.spans else ()):
            if i == len(self._read):
                self._read.append(start)
            if end > self._read[i]:
                events += self.calls.feed(self.text[self._read[i]:end])
                self._read[i] = end
            if closed and i == self._ended:
                events += self.calls.end_block()
                self._ended += 1
        return events
