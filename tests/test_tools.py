"""Tool calls through a real fleet: a named function or `tool_choice: "required"` make the reply
calls whose arguments match the tools' schemas (structured outputs), streamed or not, in the
shapes OpenAI's client parses; "auto" is read from the reply by the hermes parser where the
gateway serves it (a 400 where not); misuse gets 400s that name the parameter."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from gateway.tools import ToolCalls, parse_hermes
from tests.conftest import extra_gateway

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "required": ["timezone"],
        "properties": {"timezone": {"type": "string", "maxLength": 30}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather "
                                           "in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _client(fleet):
    from openai import OpenAI

    return OpenAI(base_url=fleet["url"] + "/v1", api_key="none")


def _check(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_function_is_called_with_arguments_that_match_its_schema(fleet):
    client = _client(fleet)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, n=2,
                                           max_tokens=60, temperature=0.8, seed=1, tools=TOOLS,
                                           tool_choice=NAMED)
    ids = set()
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        _check("get_weather", call.function.arguments)
        ids.add(call.id)
    assert len(ids) == 2

    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                           max_tokens=60, temperature=0, tools=TOOLS,
                                           tool_choice=NAMED).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=60, temperature=0, tools=TOOLS,
        tool_choice=NAMED, stream=True) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1, "the arguments arrived in one piece, not streamed"
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert {d.id for d in deltas[1:]} == {None} and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_makes_one_or_more_calls_of_the_tools(fleet):
    """Each call matches its tool's schema; streamed, each opens with its id and name and its
    arguments follow piece by piece, adding up to the unstreamed reply's (greedy)."""
    client = _client(fleet)
    for parallel in (True, False):
        kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=120, temperature=0,
                  tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
        choice = client.chat.completions.create(**kw).choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.id.startswith("call_")
            _check(call.function.name, call.function.arguments)

        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert {c.choices[0].delta.content for c in chunks[1:]} == {None}
        assert len(deltas) > 2 * len(calls), "the arguments came whole, not streamed"
        for k, call in enumerate(calls):
            mine = [d for d in deltas if d.index == k]
            assert mine[0].id.startswith("call_") and mine[0].function.name == call.function.name
            assert {d.id for d in mine[1:]} == {None}
            assert "".join(d.function.arguments for d in mine) == call.function.arguments
        assert {d.index for d in deltas} == set(range(len(calls)))


def test_a_conversation_goes_on_after_a_tool_answers(fleet):
    """An assistant message with tool_calls and no content, then the tool's answer, are taken as
    a conversation (rendered by the chat template) and answered."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    reply = _client(fleet).chat.completions.create(model="SmolLM2-135M-Instruct", tools=TOOLS,
                                                   tool_choice="none", messages=messages,
                                                   max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"tools": TOOLS}, "tool_choice", "auto"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "auto"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools", "wat"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
      "tool_choice": "required"}, "tools.0.function.name", "pattern"),
    ({"messages": [{"role": "user"}]}, "messages.0", "content is needed"),
])
def test_tool_misuse_gets_a_400_that_names_it(fleet, extra, param, message):
    body = {"messages": ASK, "max_tokens": 8, **extra}
    r = httpx.post(fleet["url"] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_the_openai_sdk_parses_pydantic_replies_and_tool_calls(fleet):
    """What OpenAI's SDK sends for a pydantic model (a strict json_schema with $defs) and for a
    pydantic function tool comes back as it parses: `message.parsed` and `parsed_arguments`."""
    from openai import pydantic_function_tool
    from pydantic import BaseModel

    class Address(BaseModel):
        city: str
        country: str

    class Person(BaseModel):
        name: str
        age: int
        address: Address

    class GetWeather(BaseModel):
        city: str

    client = _client(fleet)
    reply = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Make up a person."}],
        response_format=Person, max_tokens=120, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Person)
    reply = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=[pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, max_tokens=60,
        temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


HERMES_REPLIES = [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', [("f", '{"a": 1}')], None),
    ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>',
     [("f", "{}"), ("g", '{"b": 2}')], "Let me look.\n"),
    # SmolLM2's form: a list of calls in one block, `parameters` for `arguments`.
    ('<tool_call>[{"name": "f", "arguments": {"x": "é"}}, {"name": "g", "parameters": {}}]'
     '</tool_call>', [("f", '{"x": "é"}'), ("g", "{}")], None),
    ('<tool_call>{"name": "f", "arguments": {}}', [("f", "{}")], None),  # cut after its JSON
    ("Paris is sunny.", None, "Paris is sunny."),
    ('<tool_call>{"name": "f", "argum', None, '<tool_call>{"name": "f", "argum'),
    ('<tool_call>{"arguments": {}}</tool_call>', None, '<tool_call>{"arguments": {}}</tool_call>'),
    ("<tool_call></tool_call>", None, "<tool_call></tool_call>"),
]


@pytest.mark.parametrize(("text", "calls", "content"), HERMES_REPLIES)
def test_hermes_replies_are_calls_or_content(text, calls, content):
    assert parse_hermes(text) == (calls, content)


LLAMA3_JSON_REPLIES = [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", '{"a": 1}')]),
    ('<|python_tag|>{"name": "f", "arguments": {"x": "é"}}; {"name": "g", "parameters": {}}',
     [("f", '{"x": "é"}'), ("g", "{}")]),
    ('\n{"name": "f", "parameters": {"s": "a; b"}};{"name": "g", "parameters": {}}\n',
     [("f", '{"s": "a; b"}'), ("g", "{}")]),
    ("Paris is sunny.", None),
    ('{"name": "f", "param', None),  # cut short
    ('{"parameters": {}}', None),  # no name
    ('{"name": "f", "parameters": {}} and some words', None),
]


@pytest.mark.parametrize(("text", "calls"), LLAMA3_JSON_REPLIES)
def test_llama3_json_replies_are_calls_or_content(text, calls):
    from gateway.tools import parse_llama3_json

    assert parse_llama3_json(text) == (calls, None if calls else text)


MISTRAL_REPLIES = [
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', [("f", '{"a": 1}')], None),
    ('Let me look.[TOOL_CALLS][{"name": "f", "arguments": {"x": "é"}}, {"name": "g", '
     '"arguments": {}}]', [("f", '{"x": "é"}'), ("g", "{}")], "Let me look."),
    ('[{"name": "f", "arguments": {"a": [1]}}]', [("f", '{"a": [1]}')], None),  # marker skipped
    ("Paris is sunny [1].", None, "Paris is sunny [1]."),
    ("[1] is a citation.", None, "[1] is a citation."),
    ('[TOOL_CALLS][{"name": "f", "argum', None, '[TOOL_CALLS][{"name": "f", "argum'),
    ('[TOOL_CALLS][{"arguments": {}}]', None, '[TOOL_CALLS][{"arguments": {}}]'),
]


@pytest.mark.parametrize(("text", "calls", "content"), MISTRAL_REPLIES)
def test_mistral_replies_are_calls_or_content(text, calls, content):
    from gateway.tools import parse_mistral

    assert parse_mistral(text) == (calls, content)


def test_mistral_call_ids_are_the_nine_characters_its_template_takes():
    from gateway.schemas import ChatRequest

    tools = ToolCalls.of(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS),
                         "mistral")
    (call,), _ = tools.message(0, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')
    assert len(call["id"]) == 9 and call["id"].isalnum()
    assert len(ToolCalls.of(ChatRequest(messages=[{"role": "user", "content": "x"}],
                                        tools=TOOLS), "hermes").call_id(0)) == 29


@pytest.mark.parametrize(("text", "calls"), [
    ('[get_weather(city="Paris", days=2)]', [("get_weather", '{"city": "Paris", "days": 2}')]),
    (" [f(a=[1, 2], b={'k': None}), g()] ", [("f", '{"a": [1, 2], "b": {"k": null}}'),
                                             ("g", "{}")]),
    ("Paris is sunny.", None),
    ("[f(a=1", None),  # cut short
    ("[f(1)]", None),  # positional arguments
    ("[f(a=g())]", None),  # not a literal
    ("[x.f(a=1)]", None),  # not a plain name
    ("[]", None),
])
def test_pythonic_replies_are_calls_or_content(text, calls):
    from gateway.tools import parse_pythonic

    assert parse_pythonic(text) == (calls, None if calls else text)


def _stream(tools: ToolCalls, text: str, size: int | None = 1, seed: int = 0
            ) -> list[tuple[int, dict]]:
    """`text` through `tools.delta` as a stream of one choice, in pieces of `size` characters
    (None: 1-9 at random); the deltas sent, each with how much text had come."""
    import random

    rng, deltas, end = random.Random(seed), [], 0
    while end < len(text):
        piece = text[end:end + (size or rng.randint(1, 9))]
        end += len(piece)
        d = tools.delta(0, piece, text[:end], finished=end == len(text))
        if d:
            deltas.append((end, d))
    return deltas


def _joined(deltas: list[tuple[int, dict]]) -> tuple[str, list[dict]]:
    """A stream's content and its calls (id, name, arguments), each joined from its pieces."""
    pieces = [c for _, d in deltas for c in d.get("tool_calls", [])]
    opened = {c["index"]: c for c in pieces if "id" in c}
    assert all(c["index"] in opened for c in pieces)  # arguments after their call's opening
    return "".join(d.get("content", "") for _, d in deltas), [
        {"id": c["id"], "name": c["function"]["name"],
         "arguments": "".join(x["function"]["arguments"] for x in pieces
                              if x["index"] == k)} for k, c in sorted(opened.items())]


def _auto(parser: str) -> ToolCalls:
    from gateway.schemas import ChatRequest

    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    return ToolCalls.of(req, parser)


AUTO_CALLS = [("hermes", text, calls, content) for text, calls, content in HERMES_REPLIES
              if calls] + [("llama3_json", text, calls, None)
                           for text, calls in LLAMA3_JSON_REPLIES if calls] + \
    [("mistral", text, calls, content) for text, calls, content in MISTRAL_REPLIES if calls]


@pytest.mark.parametrize(("parser", "text", "calls", "content"), AUTO_CALLS)
def test_auto_streams_each_call_as_it_is_written(parser, text, calls, content):
    """Streamed "auto" with a JSON parser, in pieces of every size: the text before the calls
    streams as content, and each call opens once its name is written (whichever key comes
    first, in a list or in several blocks, its arguments an object or a JSON string), its
    arguments following as they come; joined, the stream is the unstreamed reply, ids and
    all, and ends with finish_reason "tool_calls"."""
    for size in (1, 2, 3, 7, None):
        tools = _auto(parser)
        deltas = _stream(tools, text, size)
        streamed, joined = _joined(deltas)
        message, unstreamed = tools.message(0, text)
        assert [(c["name"], c["arguments"]) for c in joined] == calls
        assert joined == [{"id": c["id"], **c["function"]} for c in message]
        assert streamed == (content or "") and unstreamed == content
        assert tools.finish_reason("stop", tools.called(0)) == "tool_calls"
        if size == 1:  # the first call opened long before the reply ended
            first = next(end for end, d in deltas if "tool_calls" in d)
            assert first < len(text) - len(calls[0][1])


def test_auto_holds_back_what_could_begin_a_call():
    """Streamed hermes "auto": content goes as it comes until a `<tool_call>` begins; a piece
    that could begin one is held back until the next tells, and goes as content at the end
    when no call came."""
    for text in ['Checking <tool_c', 'Sure.\n<tool_call>{"name": "get_time", "arguments": '
                 '{"timezone": "UTC"}}</tool_call>', "Plain <tool", "a < b and <tool_call"]:
        tools = _auto("hermes")
        deltas = _stream(tools, text)
        for end, _ in deltas[:-1]:
            assert "<tool" not in "".join(d.get("content", "") for e, d in deltas if e <= end)
        calls, content = tools.message(0, text)
        streamed, joined = _joined(deltas)
        assert streamed == (content or "")
        assert joined == [{"id": c["id"], **c["function"]} for c in calls or []]
        assert (calls is None) == (streamed == text)


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>'
               '<tool_call>{"name": "get_weather", "argum'),
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "UTC"}}; {"name": '
                    '"get_weather", "parameters": {"ci'),
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "UTC"}} and words'),
])
def test_a_stream_keeps_the_calls_it_opened(parser, text):
    """A call that opened stays a call to the stream's end, where the unstreamed reply, which
    does not parse, is content: cut short by max_tokens, the last call is what came of it
    (finish_reason stays "length"); the stream's finished message is what it sent."""
    tools = _auto(parser)
    deltas = _stream(tools, text)
    streamed, joined = _joined(deltas)
    assert streamed == "" and joined[0]["name"] == "get_time"
    assert json.loads(joined[0]["arguments"]) == {"timezone": "UTC"}
    assert [c["name"] for c in joined] == ["get_time", "get_weather"][:len(joined)]
    assert tools.finish_reason("length", tools.called(0)) == "length"
    calls, content = tools.message(0, text)
    assert [{"id": c["id"], **c["function"]} for c in calls] == joined and content is None
    assert _auto(parser).message(0, text) == (None, text)


@pytest.mark.parametrize(("parser", "text"), [
    ("llama3_json", "The time is noon, {roughly}."),
    ("pythonic", '[get_time(timezone="UTC")]'),
    ("pythonic", "It is noon [UTC]."),
    ("pythonic", "[not a call]"),
])
def test_answers_stream_and_pythonic_calls_come_whole(parser, text):
    """Streamed "auto": an answer streams as it comes; a pythonic reply, which is not JSON, is
    held (no content) and its calls come whole at the end, or, when it turns out to be no
    call, the text does; joined, the same as unstreamed."""
    tools = _auto(parser)
    deltas = _stream(tools, text)
    calls, content = tools.message(0, text)
    streamed, joined = _joined(deltas)
    assert streamed == (content or "")
    assert joined == [{"id": c["id"], **c["function"]} for c in calls or []]
    if calls:
        assert [end for end, _ in deltas] == [len(text)]  # nothing before the end
        assert calls[0]["function"] == {"name": "get_time", "arguments": '{"timezone": "UTC"}'}
    elif not text.startswith("["):
        assert deltas[0][0] < len(text)  # an answer streams before it ends


REQUIRED_REPLIES = [
    '[{"name": "get_weather", "parameters": {"city": "Lyon, \\"the {city}\\"", '
    '"unit": "celsius"}}, {"parameters": {"timezone": "[UTC]"}, "name": "get_time"}]',
    '[ {"name":"get_time","parameters":{}} ]',
]


@pytest.mark.parametrize("text", REQUIRED_REPLIES)
def test_required_streams_each_call_as_its_text_comes(text):
    """Streamed "required", in pieces of every size: a call opens (index, id, name) as soon as
    its name is written and its arguments follow as written, whichever key comes first, with
    braces and quotes inside strings; joined, the calls equal the unstreamed reply's."""
    from gateway.schemas import ChatRequest

    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                      tool_choice="required")
    for size in (1, 2, 3, 7, None):
        tools = ToolCalls.of(req)
        deltas = _stream(tools, text, size)
        streamed, joined = _joined(deltas)
        calls, content = tools.message(0, text)
        assert streamed == "" and content is None
        assert tools.finish_reason("stop", tools.called(0)) == "tool_calls"
        assert joined == [{"id": c["id"], **c["function"]} for c in calls]
        unstreamed, _ = ToolCalls.of(req).message(0, text)
        assert [(c["name"], c["arguments"]) for c in joined] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in unstreamed]
        assert [json.loads(c["arguments"]) for c in joined] == \
            [c["parameters"] for c in json.loads(text)]


def test_required_cut_short_before_a_call_is_content():
    """A "required" reply that max_tokens cut before any call's name: content, sent when the
    choice finishes; after one, the call as far as it came (finish_reason stays "length")."""
    from gateway.schemas import ChatRequest

    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                      tool_choice="required")
    tools = ToolCalls.of(req)
    assert tools.delta(0, '[{"na', '[{"na', finished=False) is None
    assert tools.delta(0, "me", '[{"name', finished=True) == {"content": '[{"name'}
    assert tools.finish_reason("length", tools.called(0)) == "length"
    tools = ToolCalls.of(req)
    d = tools.delta(0, '[{"name": "get_time", "parameters": {"tz', '[{"name": "get_time", '
                    '"parameters": {"tz', finished=True)
    assert d == {"tool_calls": [{"index": 0, "id": tools.call_id(0), "type": "function",
                                 "function": {"name": "get_time", "arguments": '{"tz'}}]}


def _pieces(text: str, reason: str = "stop"):
    """A fake `Gateway.run`: the text one character a token, the last event ending it."""
    from shoal.messages import TokenEvent

    async def run():
        for k, ch in enumerate(text):
            end = k == len(text) - 1
            yield ch, TokenEvent("r", k, [k], finish_reason=reason if end else None,
                                 prompt_tokens=3, completion_tokens=len(text))
    return run()


def _usage(_last) -> dict:
    return {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0}}


async def _all(groups) -> list[dict]:
    return [e async for events, _ in groups for e in events]


def test_auto_streams_the_text_before_a_call_on_the_messages_and_responses_apis():
    """"auto" on the other APIs' streams: the text before a call streams in its own block or
    message as it comes, which ends where the call's block or item opens; the call's input or
    arguments then stream as they are written; the stream ends as the unstreamed reply."""
    import asyncio

    from gateway.anthropic import MessageShape, MessagesRequest
    from gateway.responses import ResponseShape, ResponsesRequest

    text = 'Let me check.<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}' \
           '</tool_call>'
    ask = MessagesRequest(model="m", max_tokens=64, messages=[{"role": "user", "content": "x"}],
                          tools=[{"name": "get_time", "input_schema": TIME}])
    shape = MessageShape(ask, "m", ToolCalls.of(ask.to_chat(), "hermes"), 3)
    events = asyncio.run(_all(shape.events(_pieces(text), _usage)))
    kinds = [(e["type"], e.get("index")) for e in events]
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
              and e["index"] == 0]
    assert len(deltas) > 1 and "".join(deltas) == "Let me check."
    assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))
    (call,) = [e["content_block"] for e in events if e["type"] == "content_block_start"
               and e["index"] == 1]
    assert call["type"] == "tool_use" and call["name"] == "get_time" and call["input"] == {}
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
              and e["index"] == 1]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"timezone": "UTC"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert shape.body(text, _last(text, "stop"), None)["content"] == [
        {"type": "text", "text": "Let me check."}, {**call, "input": {"timezone": "UTC"}}]

    req = ResponsesRequest(model="m", input="x", tools=[{"type": "function", "name": "get_time",
                                                         "parameters": TIME}])
    shape = ResponseShape(req, "m", ToolCalls.of(req.to_chat(req.items()), "hermes"))

    async def stored(_response) -> None:
        pass
    events = asyncio.run(_all(shape.events(_pieces(text), _usage, stored)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "Let me check."
    final = events[-1]["response"]["output"]
    message, fc = final
    assert message["content"][0]["text"] == "Let me check." and fc["type"] == "function_call"
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1]
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == fc["arguments"] == '{"timezone": "UTC"}'
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final
    order = [(e["type"], e.get("output_index")) for e in events]
    assert order.index(("response.output_item.done", 0)) < \
        order.index(("response.output_item.added", 1))


# A conversation that makes the real model call a tool in the hermes form, from two examples.
FEW_SHOT = [
    {"role": "system", "content": 'You call functions. To call one, reply with <tool_call>'
                                  '{"name": ..., "arguments": {...}}</tool_call>.'},
    *[m for city in ("Rome", "Berlin") for m in (
        {"role": "user", "content": f"What is the weather like in {city}?"},
        {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": '
                                         f'{{"city": "{city}"}}}}</tool_call>'})],
]


@pytest.fixture(scope="module")
def auto_gateway(fleet):
    """A gateway on the shared fleet that serves tool_choice "auto" with the hermes parser."""
    with extra_gateway(fleet, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield url


def test_auto_reads_the_calls_the_model_chose_to_make(fleet, auto_gateway):
    """With the parser, "auto" (the default with tools) gives the model's own reply: a call
    when it wrote one (finish_reason "tool_calls", no content), streamed as it is written or
    not, through
    chat, the Responses API and Anthropic's Messages API; its answer when it did not, the same reply chat gives
    without tools (SmolLM2's template shows no tools)."""
    from openai import OpenAI

    client = OpenAI(base_url=auto_gateway + "/v1", api_key="none")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    asked = [*FEW_SHOT, {"role": "user", "content": "What is the weather like in Paris?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=asked,
                                           tools=tools, max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == \
        {"city": "Paris"}
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=asked, tools=tools, max_tokens=40,
        temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [t for d in deltas for t in d.tool_calls or []]  # the call as it was written
    assert len(pieces) > 2 and {t.index for t in pieces} == {0}
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert "".join(t.function.arguments or "" for t in pieces) == call.function.arguments
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    response = client.responses.create(
        model="SmolLM2-135M-Instruct", input=asked[1:], instructions=asked[0]["content"],
        tools=[{"type": "function", **tools[0]["function"]}], max_output_tokens=40,
        temperature=0)
    (item,) = response.output
    assert item.type == "function_call" and json.loads(item.arguments) == {"city": "Paris"}

    from anthropic import Anthropic

    anthropic = Anthropic(base_url=auto_gateway, api_key="none", max_retries=0)
    ask = {"model": "SmolLM2-135M-Instruct", "system": asked[0]["content"], "messages": asked[1:],
           "max_tokens": 40, "extra_body": {"temperature": 0},
           "tools": [{"name": "get_weather", "input_schema": tools[0]["function"]["parameters"]}]}
    message = anthropic.messages.create(**ask)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris"} and message.stop_reason == "tool_use"
    with anthropic.messages.stream(**ask) as stream:  # the SDK joins the input_json_deltas
        streamed_message = stream.get_final_message()
    assert [(b.type, b.input) for b in streamed_message.content] == [("tool_use", block.input)]

    plain = [{"role": "user", "content": "Name three colors."}]
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=plain,
                                            tools=tools, max_tokens=16, temperature=0)
    without = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60, json={
        "messages": plain, "max_tokens": 16, "temperature": 0}).json()["choices"][0]
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == without["message"]["content"]
    assert answer.choices[0].finish_reason == without["finish_reason"]

    # An answer streams as it comes on the Responses and Messages APIs too, not whole at the
    # end.
    asking = {"model": "SmolLM2-135M-Instruct", "input": plain, "max_output_tokens": 16,
              "tools": [{"type": "function", **tools[0]["function"]}], "temperature": 0}
    (whole,) = client.responses.create(**asking).output
    events = list(client.responses.create(**asking, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.content[0].text
    (item,) = events[-1].response.output
    assert item.type == "message" and item.content[0].text == whole.content[0].text

    asking = {**ask, "messages": plain, "max_tokens": 16}
    (whole,) = anthropic.messages.create(**asking).content
    with anthropic.messages.stream(**asking) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert whole.type == "text" and len(deltas) > 1 and "".join(deltas) == whole.text
    assert [(b.type, b.text) for b in final.content] == [("text", whole.text)]


@pytest.mark.parametrize(("parser", "form", "call"), [
    ("pythonic", "a Python list of calls: [name(arg=value)]", '[get_weather(city="{}")]'),
    ("mistral", '[TOOL_CALLS] and a JSON list of calls: [{{"name": ..., "arguments": {{...}}}}]',
     '[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "{}"}}}}]'),
])
def test_the_reply_level_parsers_read_the_calls_the_model_chose_to_make(fleet, parser, form,
                                                                         call):
    """A gateway with `--tool-call-parser pythonic` or `mistral`: taught the form by two
    examples, the real model answers a weather question with a call, which comes back as a
    call, streamed or not (a mistral call as it is written, a pythonic one whole); a
    question no tool serves gets its answer as content."""
    from openai import OpenAI

    few = [{"role": "system", "content": "You call functions. To call one, reply with "
                                         + form.format() + "."}]
    for city in ("Rome", "Berlin"):
        few += [{"role": "user", "content": f"What is the weather like in {city}?"},
                {"role": "assistant", "content": call.format(city)}]
    asked = [*few, {"role": "user", "content": "What is the weather like in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with extra_gateway(fleet, "--enable-auto-tool-choice", "--tool-call-parser",
                       parser) as url:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        ask = dict(model="SmolLM2-135M-Instruct", tools=tools, max_tokens=30, temperature=0)
        choice = client.chat.completions.create(messages=asked, **ask).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (made,) = choice.message.tool_calls
        assert made.function.name == "get_weather"
        assert json.loads(made.function.arguments) == {"city": "Paris"}
        chunks = [c for c in client.chat.completions.create(messages=asked, stream=True, **ask)
                  if c.choices]
        pieces = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert {t.index for t in pieces} == {0} and (len(pieces) > 1) == (parser == "mistral")
        assert "".join(t.function.arguments or "" for t in pieces) == made.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        answer = client.chat.completions.create(
            messages=[{"role": "user", "content": "Name three colors."}], **ask).choices[0]
        assert answer.message.tool_calls is None and answer.message.content


def test_the_cli_lists_the_parsers_the_gateway_has():
    from gateway import tools
    from shoal import cli

    assert cli.TOOL_CALL_PARSERS == list(tools.TOOL_CALL_PARSERS)


def test_required_streams_each_call_on_the_messages_and_responses_apis():
    """"any" / "required" on the other APIs' streams: each call's block or item opens once its
    name is written, its input or arguments stream, and it closes when they do, before the
    next call's text; the stream ends as the unstreamed reply does (ids included). Cut short
    mid-call, the open block stops (stop_reason "max_tokens") and the response's open item
    ends "incomplete" with the arguments that came."""
    import asyncio

    from gateway.anthropic import MessageShape, MessagesRequest
    from gateway.responses import ResponseShape, ResponsesRequest

    text = REQUIRED_REPLIES[0]
    calls = json.loads(text)
    ask = MessagesRequest(model="m", max_tokens=64, messages=[{"role": "user", "content": "x"}],
                          tools=[{"name": "get_weather", "input_schema": WEATHER},
                                 {"name": "get_time", "input_schema": TIME}],
                          tool_choice={"type": "any"})
    shape = MessageShape(ask, "m", ToolCalls.of(ask.to_chat()), 3)
    events = asyncio.run(_all(shape.events(_pieces(text), _usage)))
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))
    for k, call in enumerate(calls):
        (start,) = [e["content_block"] for e in events if e["type"] == "content_block_start"
                    and e["index"] == k]
        assert start["type"] == "tool_use" and start["name"] == call["name"]
        assert start["id"].startswith("toolu_") and start["input"] == {}
        pieces = [e["delta"]["partial_json"] for e in events
                  if e["type"] == "content_block_delta" and e["index"] == k]
        # The second call's parameters come before its name: they wait for it, then go whole.
        assert (len(pieces) > 1) == (k == 0) and json.loads("".join(pieces)) == call["parameters"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    body = shape.body(text, _last(text, "stop"), None)
    assert [b["input"] for b in body["content"]] == [c["parameters"] for c in calls]
    assert [b["id"] for b in body["content"]] == [e["content_block"]["id"] for e in events
                                                  if e["type"] == "content_block_start"]

    req = ResponsesRequest(model="m", input="x", tool_choice="required", tools=[
        {"type": "function", "name": "get_weather", "parameters": WEATHER},
        {"type": "function", "name": "get_time", "parameters": TIME}])

    async def stored(_response) -> None:
        pass
    shape = ResponseShape(req, "m", ToolCalls.of(req.to_chat(req.items())))
    events = asyncio.run(_all(shape.events(_pieces(text), _usage, stored)))
    final = events[-1]["response"]["output"]
    assert events[-1]["type"] == "response.completed"
    assert [(o["name"], json.loads(o["arguments"]), o["status"]) for o in final] == \
        [(c["name"], c["parameters"], "completed") for c in calls]
    for k, item in enumerate(final):
        (added,) = [e for e in events if e["type"] == "response.output_item.added"
                    and e["output_index"] == k]
        assert added["item"]["id"] == item["id"] and added["item"]["call_id"] == item["call_id"]
        assert added["item"]["name"] == item["name"] and added["item"]["arguments"] == ""
        pieces = [e["delta"] for e in events if e["type"] ==
                  "response.function_call_arguments.delta" and e["output_index"] == k]
        assert (len(pieces) > 1) == (k == 0) and "".join(pieces) == item["arguments"]
        (done,) = [e for e in events if e["type"] == "response.output_item.done"
                   and e["output_index"] == k]
        assert done["item"] == item
    order = [(e["type"], e.get("output_index")) for e in events]
    assert order.index(("response.output_item.done", 0)) < \
        order.index(("response.output_item.added", 1))

    cut = '[{"name": "get_time", "parameters": {"timezone": "UTC"}}, {"name": "get_weather", ' \
        '"parameters": {"ci'
    shape = MessageShape(ask, "m", ToolCalls.of(ask.to_chat()), 3)
    events = asyncio.run(_all(shape.events(_pieces(cut, "length"), _usage)))
    assert [e["content_block"]["name"] for e in events if e["type"] == "content_block_start"] \
        == ["get_time", "get_weather"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"  # though calls had begun
    shape = ResponseShape(req, "m", ToolCalls.of(req.to_chat(req.items())))
    events = asyncio.run(_all(shape.events(_pieces(cut, "length"), _usage, stored)))
    assert events[-1]["type"] == "response.incomplete"
    first, second = events[-1]["response"]["output"]
    assert first["status"] == "completed" and second["status"] == "incomplete"
    assert second["name"] == "get_weather" and second["arguments"] == '{"ci'
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == \
        [first, second]


def _last(text: str, reason: str):
    from shoal.messages import TokenEvent

    return TokenEvent("r", 0, [], finish_reason=reason, prompt_tokens=3,
                      completion_tokens=len(text))


# Pieces of replies, well formed or not, that random replies are made of.
FRAGMENTS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]",
             '{"name": "get_time"',
             ', "arguments": ', '{"timezone": "UTC"}', "}", "{", "[", "]", '"', "\\", ":", ",",
             ";", " ", "\n", "hello", "<", "</", "<tool", '"name"', '"parameters"',
             '{"a": [1, {"b": "}"}]}', "<|python_tag|>", '"x\\"y"']


@pytest.mark.parametrize("seed", range(4))
def test_any_reply_streams_as_the_finished_reply_has_it(seed):
    """Random replies, calls and broken calls alike, in random pieces, through every "auto"
    parser, with and without a reasoning parser and cut short or not: no stream breaks; chat's
    deltas join to its finished message; the Responses API's items are added in order and
    each is done as the final response has it; the Messages API's blocks start in order and
    each stops."""
    import asyncio
    import random

    from gateway.anthropic import MessageShape, MessagesRequest
    from gateway.reasoning import Reasoning
    from gateway.responses import ResponseShape, ResponsesRequest
    from gateway.schemas import ChatRequest

    rng = random.Random(seed)
    chat = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    responses = ResponsesRequest(model="m", input="x", tools=[
        {"type": "function", "name": "get_time", "parameters": TIME}])
    messages = MessagesRequest(model="m", max_tokens=64, messages=[{"role": "user",
                                                                    "content": "x"}],
                               tools=[{"name": "get_time", "input_schema": TIME}])

    async def stored(_response) -> None:
        pass
    for _ in range(100):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        parser = rng.choice(["hermes", "llama3_json", "pythonic", "mistral"])
        tools = ToolCalls.of(chat, parser)
        streamed, joined = _joined(_stream(tools, text, None, rng.randrange(1 << 30)))
        calls, content = tools.message(0, text)
        assert streamed == (content or "")
        assert joined == [{"id": c["id"], **c["function"]} for c in calls or []]

        thinking = Reasoning("deepseek_r1") if rng.random() < 0.5 else None
        reason = rng.choice(["stop", "length"])
        shape = ResponseShape(responses, "m", ToolCalls.of(responses.to_chat(responses.items()),
                                                           parser), reasoning=thinking)
        events = asyncio.run(_all(shape.events(_pieces(text, reason), _usage, stored)))
        final = events[-1]["response"]["output"]
        assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final
        assert [e["output_index"] for e in events if e["type"] ==
                "response.output_item.added"] == list(range(len(final)))

        shape = MessageShape(messages, "m", ToolCalls.of(messages.to_chat(), parser), 3,
                             thinking and Reasoning("deepseek_r1"))
        events = asyncio.run(_all(shape.events(_pieces(text, reason), _usage)))
        starts = [e["index"] for e in events if e["type"] == "content_block_start"]
        assert starts == list(range(len(starts)))
        assert sorted(e["index"] for e in events if e["type"] == "content_block_stop") == starts
        assert [b["type"] for b in shape.body(text, _last(text, reason), None)["content"]] == \
            [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
