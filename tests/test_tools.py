"""Tool calls through a real fleet: a named function or `tool_choice: "required"` make the reply
calls whose arguments match the tools' schemas (structured outputs), streamed or not, in the
shapes OpenAI's client parses; "auto" and misuse get 400s that name the parameter."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

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
    client = _client(fleet)
    for stream in (False, True):
        for parallel in (True, False):
            kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=120, temperature=0,
                      tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
            if stream:
                chunks = [c for c in client.chat.completions.create(**kw, stream=True)
                          if c.choices]
                calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
                reason = chunks[-1].choices[0].finish_reason
            else:
                choice = client.chat.completions.create(**kw).choices[0]
                calls, reason = choice.message.tool_calls, choice.finish_reason
                assert choice.message.content is None
            assert reason == "tool_calls" and calls and (parallel or len(calls) == 1)
            for call in calls:
                assert call.id.startswith("call_")
                _check(call.function.name, call.function.arguments)


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
