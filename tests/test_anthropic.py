"""Anthropic's Messages API (`/v1/messages`, gateway/anthropic.py) through the shared fleet, with
the official `anthropic` client: replies against the in-process engine's greedy tokens for the
chat the request becomes (a prefill included), streamed events in the API's order, stop
sequences named, tool use as chat makes it, token counts, and Anthropic's error bodies."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
# Greedy decoding. Recent Anthropic clients take no sampling parameters (`temperature`, `top_p`,
# `top_k`) as arguments; the API still does, so they go in the body.
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                      "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}


def _chat_ids(tokenizer, messages, prefill: bool = False) -> list[int]:
    return list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=not prefill, continue_final_message=prefill,
        tokenize=True, return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def client(fleet):
    from anthropic import Anthropic

    return Anthropic(base_url=fleet["url"], api_key="none", max_retries=0)


def _stop_reason(expected: list[int], max_tokens: int, tokenizer) -> str:
    """Why greedy decoding of `expected` ended: at the end of the turn, or cut at max_tokens."""
    ended = len(expected) < max_tokens or expected[-1] == tokenizer.eos_token_id
    return "end_turn" if ended else "max_tokens"


def _input_tokens(usage) -> int:
    """The prompt's tokens: those computed plus those read from the prefix cache."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_message_is_the_chat_reply_to_its_system_and_messages(client, oracle, tokenizer):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = _chat_ids(tokenizer, messages)
    expected = oracle(ids, 12)
    r = client.messages.create(model=MODEL, system=messages[0]["content"], max_tokens=12,
                               messages=[messages[1]], **GREEDY, metadata={"user_id": "u1"})
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == MODEL
    (block,) = r.content
    assert block.type == "text" and block.text == tokenizer.decode(expected,
                                                                   skip_special_tokens=True)
    assert _input_tokens(r.usage) == len(ids) and r.usage.output_tokens == len(expected)
    assert r.stop_reason == _stop_reason(expected, 12, tokenizer)
    assert r.stop_sequence is None

    # Content as blocks (system too), and a prefill: the reply continues the assistant's text.
    turns = [{"role": "user", "content": "Name a fruit."},
             {"role": "assistant", "content": "My favourite fruit is"}]
    ids = _chat_ids(tokenizer, [{"role": "system", "content": "Be brief."}, *turns],
                    prefill=True)
    expected = oracle(ids, 5)
    r = client.messages.create(
        model=MODEL, max_tokens=5, **GREEDY, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": turns[0]["content"]}]},
                  turns[1]])
    assert r.content[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert _input_tokens(r.usage) == len(ids)
    assert r.stop_reason == _stop_reason(expected, 5, tokenizer)


def test_a_streamed_message_sends_the_apis_events_in_order(client, oracle, tokenizer):
    question = "Name three colors."
    expected = tokenizer.decode(oracle(_chat_ids(tokenizer, [{"role": "user",
                                                              "content": question}]), 16),
                                skip_special_tokens=True)
    ask = {"model": MODEL, "max_tokens": 16, **GREEDY,
           "messages": [{"role": "user", "content": question}]}
    events = list(client.messages.create(**ask, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert "".join(deltas) == expected
    assert events[-2].delta.stop_reason in ("end_turn", "max_tokens")
    assert events[-2].usage.output_tokens > 0
    with client.messages.stream(**ask) as stream:  # the SDK's accumulator
        final = stream.get_final_message()
    whole = client.messages.create(**ask)
    assert final.content[0].text == whole.content[0].text == expected
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == \
        whole.usage.output_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(client, oracle, tokenizer):
    """The reply stops before the first stop sequence it writes and names it, streamed or not;
    a sequence it never writes changes nothing."""
    question = "Write a sentence about the sea."
    expected = tokenizer.decode(oracle(_chat_ids(tokenizer, [{"role": "user",
                                                              "content": question}]), 24),
                                skip_special_tokens=True)
    words = expected.split()
    assert len(words) > 4, expected
    stop = " " + words[3]  # a word in the middle of the greedy reply
    ask = {"model": MODEL, "max_tokens": 24, **GREEDY,
           "messages": [{"role": "user", "content": question}],
           "stop_sequences": ["never-written-7f3", stop]}
    r = client.messages.create(**ask)
    assert r.content[0].text == expected[:expected.find(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    events = list(client.messages.create(**ask, stream=True))
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == \
        r.content[0].text
    assert events[-2].delta.stop_reason == "stop_sequence"
    assert events[-2].delta.stop_sequence == stop
    r = client.messages.create(**{**ask, "stop_sequences": ["never-written-7f3"]})
    assert r.content[0].text == expected and r.stop_sequence is None


def test_tool_use_is_made_as_chat_makes_it(fleet, client):
    """`tool_choice` naming a tool makes the reply a tool_use block with the input chat's named
    call gives (the same constraint), stop_reason tool_use; streamed, its input comes as it is
    generated, in input_json_deltas; "any" calls one of the tools, streamed the same way."""
    question = "What is the weather like in Paris?"
    chat = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": 40, "tools": [{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).json()
    (chat_call,) = chat["choices"][0]["message"]["tool_calls"]
    ask = {"model": MODEL, "max_tokens": 40, **GREEDY, "tools": [WEATHER],
           "messages": [{"role": "user", "content": question}],
           "tool_choice": {"type": "tool", "name": "get_weather"}}
    r = client.messages.create(**ask)
    (block,) = r.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_") and r.stop_reason == "tool_use"
    assert block.input == json.loads(chat_call["function"]["arguments"])
    events = list(client.messages.create(**ask, stream=True))
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert [e.type for e in events] == ["message_start", "content_block_start",
                                        *["content_block_delta"] * len(deltas),
                                        "content_block_stop", "message_delta", "message_stop"]
    assert len(deltas) > 1  # piece by piece
    assert events[1].content_block.type == "tool_use" and events[1].content_block.input == {}
    assert events[1].content_block.name == "get_weather"
    assert json.loads("".join(deltas)) == block.input
    assert events[-2].delta.stop_reason == "tool_use"
    anyone = {**ask, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    r = client.messages.create(**anyone)
    assert [b.name for b in r.content] == ["get_weather"] and r.stop_reason == "tool_use"
    events = list(client.messages.create(**anyone, stream=True))
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert [e.type for e in events] == ["message_start", "content_block_start",
                                        *["content_block_delta"] * len(deltas),
                                        "content_block_stop", "message_delta", "message_stop"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == r.content[0].input
    assert events[1].content_block.name == "get_weather" and events[-2].delta.stop_reason == \
        "tool_use"


def test_output_config_format_makes_a_reply_of_the_schema(client):
    """`output_config.format` (json_schema): the reply is JSON matching the schema, enforced
    token by token as chat's response_format is."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "country": {"type": "string", "maxLength": 20}}}
    r = client.messages.create(
        model=MODEL, max_tokens=60, **GREEDY,
        messages=[{"role": "user", "content": "Name a big city and its country."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_count_tokens_counts_the_prompt_a_conversation_with_tools_makes(fleet, client):
    """A conversation with an earlier tool_use and its tool_result counts the tokens of the
    chat it becomes (an assistant message with tool_calls, a tool message), as /tokenize
    counts that chat; a message's usage agrees."""
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
            {"type": "text", "text": "And should I take a coat?"}]}]
    chat = [{"role": "system", "content": "You are terse."}, conversation[0],
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "toolu_1"},
            {"role": "user", "content": "And should I take a coat?"}]
    tokenized = httpx.post(fleet["url"] + "/tokenize", timeout=30,
                           json={"messages": chat}).json()
    count = client.messages.count_tokens(model=MODEL, system="You are terse.",
                                         messages=conversation)
    assert count.input_tokens == tokenized["count"] > 20
    r = client.messages.create(model=MODEL, system="You are terse.", messages=conversation,
                               max_tokens=2, **GREEDY)
    assert _input_tokens(r.usage) == count.input_tokens


def test_errors_have_anthropics_body(fleet, client):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert MODEL in e.value.body["error"]["message"]
    cases = [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),  # required
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}]}, "images"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content.0.text: Field required"),  # the unions' tags left out
        ({"max_tokens": 4, "system": [{"type": "text", "text": 1}],
          "messages": [{"role": "user", "content": "Hi"}]}, "system.0.text:"),
        ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "Hi"}]},
         "temperature"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "get_time"}}, "get_time"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
          "stop_sequences": "END"}, "stop_sequences"),
    ]
    for body, named in cases:
        r = httpx.post(fleet["url"] + "/v1/messages", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert named in error["error"]["message"], (named, error)
    r = httpx.post(fleet["url"] + "/v1/messages/count_tokens", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # Other paths keep OpenAI's body.
    r = httpx.post(fleet["url"] + "/v1/chat/completions", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and "type" not in r.json()
