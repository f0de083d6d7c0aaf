"""OpenAI's Responses API (`/v1/responses`, gateway/responses.py) through the shared fleet, with
the official `openai` client: replies against the in-process engine's greedy tokens for the chat
the request becomes, streamed events in the API's order, structured replies, and refusals."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"


def _chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def client(fleet):
    from openai import OpenAI

    return OpenAI(base_url=fleet["url"] + "/v1", api_key="none")


def test_a_response_is_the_chat_reply_to_its_instructions_and_input(client, oracle, tokenizer):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = _chat_ids(tokenizer, messages)
    expected = oracle(ids, 12)
    r = client.responses.create(model=MODEL, instructions=messages[0]["content"],
                                input=messages[1]["content"], max_output_tokens=12, temperature=0,
                                metadata={"run": "test"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == tokenizer.decode(expected, skip_special_tokens=True)
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == len(expected)
    assert r.usage.total_tokens == len(ids) + len(expected)
    assert r.metadata == {"run": "test"} and r.instructions == messages[0]["content"]
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    if len(expected) == 12:  # cut by max_output_tokens
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None

    # A conversation as input items (content as parts or text), cut by max_output_tokens.
    turns = [{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Apple."}]},
             {"role": "user", "content": "Another one."}]
    ids = _chat_ids(tokenizer, [{"role": t["role"], "content": t["content"] if isinstance(
        t["content"], str) else t["content"][0]["text"]} for t in turns])
    expected = oracle(ids, 3, ignore_eos=True)
    r = client.responses.create(model=MODEL, input=turns, max_output_tokens=3, temperature=0)
    assert r.output_text == tokenizer.decode(expected, skip_special_tokens=True)
    assert r.status == "incomplete" and r.output[0].status == "incomplete"


def test_a_streamed_response_sends_the_apis_events_in_order(client, oracle, tokenizer):
    question = "Name three colors."
    expected = tokenizer.decode(oracle(_chat_ids(tokenizer, [{"role": "user",
                                                              "content": question}]), 16),
                                skip_special_tokens=True)
    events = list(client.responses.create(model=MODEL, input=question, max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(d.delta for d in deltas) == expected
    assert events[-4].text == expected and events[-1].response.output_text == expected
    assert events[-1].response.usage.output_tokens > 0
    assert len({d.item_id for d in deltas} | {events[-2].item.id}) == 1


def test_include_logprobs_gives_each_output_tokens_logprob_as_chat_does(client):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the message's text part
    lists each token with its logprob and alternatives, as chat's logprobs give them for the
    same conversation; streamed, each text delta carries its tokens', adding up to the final
    part's."""
    question = "Name three colors."
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2)
    want = chat.choices[0].logprobs.content
    asked = {"model": MODEL, "input": question, "max_output_tokens": 8, "temperature": 0,
             "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = client.responses.create(**asked)
    got = r.output[0].content[0].logprobs
    assert r.top_logprobs == 2 and r.output_text == chat.choices[0].message.content
    assert [x.token for x in got] == [x.token for x in want]
    assert "".join(x.token for x in got) == r.output_text
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-3) and g.bytes == w.bytes
        assert [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]
        assert g.top_logprobs[0].logprob == pytest.approx(w.top_logprobs[0].logprob, abs=1e-3)

    events = list(client.responses.create(**asked, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all("".join(x.token for x in d.logprobs) == d.delta for d in deltas)
    final = events[-1].response.output[0].content[0].logprobs
    assert [x.token for d in deltas for x in d.logprobs] == [x.token for x in final] == \
        [x.token for x in got]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [x.to_dict() for x in done.logprobs] == [x.to_dict() for x in final]
    # Not asked for: none.
    plain = client.responses.create(**{k: v for k, v in asked.items() if k != "include"})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


def test_truncation_auto_drops_the_oldest_items_that_do_not_fit(client):
    """A conversation longer than the context window: a 400 naming `input` by default; with
    `truncation: "auto"` the oldest items after the developer message are dropped until it
    fits, so the reply is the one to what is left, and the stored input stays whole."""
    import openai

    items = [{"role": "developer", "content": "Answer in a few words."},
             {"role": "user", "content": "hello " * 9000},  # past the 8,192-token window
             {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Name a fruit."}]
    asked = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}
    with pytest.raises(openai.BadRequestError, match="context window") as e:
        client.responses.create(input=items, **asked)
    assert e.value.body["param"] == "input"
    r = client.responses.create(input=items, truncation="auto", **asked)
    fits = client.responses.create(input=[items[0], *items[2:]], **asked)
    assert r.truncation == "auto" and r.output_text == fits.output_text
    assert r.usage.input_tokens == fits.usage.input_tokens < 100
    assert len(client.responses.input_items.list(r.id).data) == len(items)


def test_truncation_keeps_the_lead_and_the_last_item_and_drops_calls_with_their_outputs():
    from gateway.responses import _ITEMS, truncated

    def kinds(items):
        return None if items is None else [getattr(i, "role", i.type) for i in items]

    dev = {"role": "developer", "content": "Be brief."}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    user = {"role": "user", "content": "And now?"}
    items = _ITEMS.validate_python([dev, call, output, {**output, "call_id": "c2"}, user])
    assert kinds(truncated(items)) == ["developer", "user"]
    assert kinds(truncated(_ITEMS.validate_python([user, {**user, "role": "assistant"}, user]))) \
        == ["assistant", "user"]
    assert truncated(_ITEMS.validate_python([dev, user])) is None
    assert truncated(_ITEMS.validate_python([user])) is None


def test_text_format_makes_a_reply_of_the_schema(client):
    """`text.format` json_schema through the SDK's `responses.parse` (a pydantic model)."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    r = client.responses.parse(model=MODEL, input="Name a big city and its country.",
                               text_format=City, max_output_tokens=60, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    assert json.loads(r.output_text) == r.output_parsed.model_dump()
    r = client.responses.create(model=MODEL, input="Give a person's name and age as JSON.",
                                temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


def test_function_calls_are_made_as_chat_makes_them(fleet, client):
    """A named `tool_choice` or "required" makes the reply function calls, the same arguments
    chat's tool calls give (the same constraint); streamed, each call's arguments come as they
    are generated, and the completed response equals the unstreamed one."""
    question = "What is the weather like in Paris?"
    chat = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": 40, "tools": [{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).json()
    (chat_call,) = chat["choices"][0]["message"]["tool_calls"]
    r = client.responses.create(model=MODEL, input=question, tools=[WEATHER], temperature=0,
                                max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == chat_call["function"]["arguments"]
    assert isinstance(json.loads(call.arguments)["city"], str) and r.status == "completed"
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"
    # Streamed, the named call's arguments come piece by piece, in the item the response ends with.
    events = list(client.responses.create(
        model=MODEL, input=question, tools=[WEATHER], temperature=0, max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert len(deltas) > 1 and "".join(deltas) == events[-3].arguments == call.arguments
    (item,) = events[-1].response.output
    assert item.id == events[2].item.id == events[-2].item.id and item.arguments == call.arguments
    assert events[2].item.name == "get_weather" and events[2].item.arguments == ""
    assert events[2].item.call_id == item.call_id

    body = {"input": question, "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
            "max_output_tokens": 60, "parallel_tool_calls": False}
    whole = httpx.post(fleet["url"] + "/v1/responses", json=body, timeout=60).json()
    events = list(client.responses.create(model=MODEL, stream=True, **body))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    done = events[-1].response.model_dump()
    assert [(o["type"], o["name"], o["arguments"]) for o in done["output"]] == \
        [(o["type"], o["name"], o["arguments"]) for o in whole["output"]]
    assert len(deltas) > 1, "the arguments came whole, not as they were generated"
    assert "".join(deltas) == events[-3].arguments == whole["output"][0]["arguments"]
    assert events[2].item.id == events[-2].item.id == events[3].item_id == done["output"][0]["id"]
    assert events[2].item.name == "get_weather" and events[2].item.arguments == ""

    # The call and its output sent back as input items: the prompt chat would build.
    follow_up = [{"role": "user", "content": question},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name,
                  "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    r = client.responses.create(model=MODEL, input=follow_up, max_output_tokens=8, temperature=0)
    chat = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60, json={
        "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}]}).json()
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.output_text == chat["choices"][0]["message"]["content"]


def test_stored_responses_are_read_listed_deleted_and_continued(fleet, client, oracle,
                                                               tokenizer):
    """A response is stored with its input (every gateway reads it from Redis): retrieved as it
    was returned, its input items listed as OpenAI lists them, deleted; a response with
    `previous_response_id` answers that response's conversation followed by its own input,
    streamed or not, and is stored in turn; `store: false` keeps nothing."""
    import openai

    first = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8,
                                    temperature=0, instructions="Be brief.")
    assert first.store is True
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    import redis

    ttl = redis.Redis.from_url(fleet["redis"]).ttl(f"shoal:response:{first.id}")
    assert 86400 - 60 < ttl <= 86400  # the gateway's --responses-ttl, a day by default
    (item,) = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.role == "user"
    assert item.content[0].text == "Name a fruit."

    # The continuation: the first turn (without its instructions) and the new input.
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="Another one.", max_output_tokens=8, temperature=0)
    conversation = [{"role": "user", "content": "Name a fruit."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Another one."}]
    ids = _chat_ids(tokenizer, conversation)
    expected = oracle(ids, 8)
    assert second.output_text == tokenizer.decode(expected, skip_special_tokens=True)
    assert second.usage.input_tokens == len(ids)
    assert second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id)  # newest first, as OpenAI's
    assert [(i.role, i.content[0].text) for i in items.data] == \
        [(m["role"], m["content"]) for m in reversed(conversation)]
    assert not items.has_more and items.first_id == items.data[0].id
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in reversed(items.data)][:2]
    assert page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.last_id)
    assert [i.id for i in rest.data] == [items.data[0].id] and not rest.has_more

    # Streamed, the continuation of the continuation; what is stored is the final event's.
    events = list(client.responses.create(model=MODEL, previous_response_id=second.id,
                                          input="And a third?", max_output_tokens=8,
                                          temperature=0, stream=True))
    third = events[-1].response
    ids = _chat_ids(tokenizer, [*conversation, {"role": "assistant",
                                                "content": second.output_text},
                                {"role": "user", "content": "And a third?"}])
    assert third.output_text == tokenizer.decode(oracle(ids, 8), skip_special_tokens=True)
    assert client.responses.retrieve(third.id).model_dump() == third.model_dump()

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                       temperature=0, store=False)
    assert client.responses.delete(first.id) is None  # the SDK returns nothing on success
    for gone in (first.id, unstored.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        r = httpx.post(fleet["url"] + "/v1/responses", timeout=30,
                       json={"input": "Hi", "previous_response_id": gone})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert httpx.delete(fleet["url"] + f"/v1/responses/{first.id}", timeout=30).status_code == 404
    assert httpx.get(fleet["url"] + f"/v1/responses/{second.id}/input_items?limit=0",
                     timeout=30).status_code == 400


def test_a_function_calls_output_continues_its_stored_response(client, fleet):
    """The tool loop of OpenAI's guides: the reply's function call, then only its output sent
    with `previous_response_id`; the prompt is the one the whole conversation makes."""
    question = "What is the weather like in Paris?"
    r = client.responses.create(model=MODEL, input=question, tools=[WEATHER], temperature=0,
                                max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    follow_up = [{"role": "user", "content": question},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name,
                  "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    whole = client.responses.create(model=MODEL, input=follow_up, max_output_tokens=8,
                                    temperature=0)
    continued = client.responses.create(model=MODEL, previous_response_id=r.id,
                                        input=follow_up[2:], max_output_tokens=8, temperature=0)
    assert continued.usage.input_tokens == whole.usage.input_tokens
    assert continued.output_text == whole.output_text
    kinds = [i.type for i in client.responses.input_items.list(continued.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True, "store": False}, "background"),
    ({"input": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"include": ["everything"]}, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"model": "gpt-9"}, "model"),
])
def test_bad_response_requests_get_a_4xx_that_names_the_parameter(fleet, extra, param):
    r = httpx.post(fleet["url"] + "/v1/responses", json={"input": "Hi", **extra}, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def _until(check, timeout_s: float = 60.0, what: str = "the condition"):
    """Poll `check()` every 50 ms until it returns something truthy; return that."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.05)
    return value


# A greedy reply that runs for thousands of tokens, in bfloat16 and float32 alike: long enough to
# be cancelled or lost midway. ("Count from 1 to 2000" stops after 20 numbers, 122 tokens: a
# second or so, which a slow stop of a gateway outlasted.)
LONG_REPLY = {"input": "Repeat the word hello 3000 times.", "max_output_tokens": 3000,
              "temperature": 0}


def _scheduler_cancels(fleet) -> float:
    """Requests the fleet's scheduler has counted cancelled."""
    from tests.conftest import metric_sum

    return metric_sum(fleet["metrics"]["scheduler"], "shoal_requests_finished_total",
                      finish_reason="cancelled")


def test_a_background_response_is_queued_then_read_when_done(client, fleet, oracle, tokenizer):
    """`background`: the reply is the response, queued; GET reads it as it stands and finally
    returns what the same request gives in the foreground (the engine's greedy reply)."""
    import openai

    question = "Name a fruit."
    queued = client.responses.create(model=MODEL, input=question, max_output_tokens=8,
                                     temperature=0, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background is True
    assert queued.output == [] and queued.usage is None
    done = _until(lambda: (r := client.responses.retrieve(queued.id)).status not in
                  ("queued", "in_progress") and r, what="the background response finishing")
    ids = _chat_ids(tokenizer, [{"role": "user", "content": question}])
    expected = oracle(ids, 8)
    assert done.output_text == tokenizer.decode(expected, skip_special_tokens=True)
    assert done.status == ("incomplete" if len(expected) == 8 else "completed")
    assert done.usage.input_tokens == len(ids) and done.usage.output_tokens == len(expected)
    assert done.id == queued.id and done.background is True
    assert client.responses.input_items.list(done.id).data[0].content[0].text == question
    # A finished response, a foreground one and an unknown one cannot be cancelled.
    with pytest.raises(openai.BadRequestError, match="only a queued or in-progress"):
        client.responses.cancel(done.id)
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


def test_cancelling_a_background_response_stops_its_request(client):
    """A cancel stores the response cancelled at once and cancels its request in the fleet: the
    gateway running it then stores the output it had, far short of max_output_tokens, and the
    response stays cancelled."""
    queued = client.responses.create(model=MODEL, background=True, **LONG_REPLY)
    _until(lambda: client.responses.retrieve(queued.id).status == "in_progress",
           what="the response starting")
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.id == queued.id and cancelled.status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: the same
    # The run ended by the cancel stores its own object, with usage and the text so far.
    final = _until(lambda: (r := client.responses.retrieve(queued.id)).usage and r,
                   what="the cancelled run storing its output")
    assert final.status == "cancelled"
    assert 0 < final.usage.output_tokens < LONG_REPLY["max_output_tokens"]
    assert final.output_text.lower().startswith("hello")


def test_a_streamed_background_response_runs_on_without_its_client(client, oracle, tokenizer):
    """`background` with `stream`: the events come from the response's log, so a client that
    leaves midway loses nothing: the run goes on, and `GET /v1/responses/{id}?stream=true`
    streams the events after any sequence number (`starting_after`), or all of them, through
    the SDK's `responses.stream(response_id=...)`. The text they add up to is the engine's
    greedy reply."""
    question = "Name three colors."
    expected = tokenizer.decode(oracle(_chat_ids(tokenizer, [{"role": "user",
                                                              "content": question}]), 24),
                                skip_special_tokens=True)
    seen = []
    with client.responses.stream(model=MODEL, input=question, max_output_tokens=24,
                                 temperature=0, background=True) as stream:
        for event in stream:
            seen.append(event)
            if len([e for e in seen if e.type == "response.output_text.delta"]) == 3:
                break  # the client leaves
    assert [e.type for e in seen[:3]] == ["response.created", "response.queued",
                                          "response.in_progress"]
    assert seen[0].response.status == "queued" and seen[0].response.background is True
    rid, cut = seen[0].response.id, seen[-1].sequence_number
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=cut))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected and events[-1].response.output_text == expected
    assert client.responses.retrieve(rid).output_text == expected  # stored as it ended
    # The whole stream again, through the SDK's helper for an existing response.
    with client.responses.stream(response_id=rid) as again:
        assert [e.sequence_number for e in again] == list(range(len(events)))
    assert list(client.responses.retrieve(rid, stream=True,
                                          starting_after=len(events) + 5)) == []


def _stream_long_reply(client, act) -> list:
    """The events of `LONG_REPLY` streamed in the background, `act(response id)` done after
    its second text delta."""
    events = []
    with client.responses.create(model=MODEL, background=True, stream=True,
                                 **LONG_REPLY) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and sum(
                    e.type == "response.output_text.delta" for e in events) == 2:
                act(events[0].response.id)
    return events


def test_a_streamed_background_response_ends_cancelled(client):
    """A cancel, from any client, ends the stream of a background response with
    `response.cancelled` and the output it had."""
    events = _stream_long_reply(client, lambda rid: client.responses.cancel(rid))
    # The SDK has no class of its own for this event (it is also the webhook's name for a
    # cancel), so its fields are read as sent.
    assert events[-1].type == "response.cancelled", events[-1]
    final = events[-1].to_dict()["response"]
    assert final["status"] == "cancelled"
    assert 0 < final["usage"]["output_tokens"] < LONG_REPLY["max_output_tokens"]
    assert final["output"][0]["content"][0]["text"] == "".join(
        e.delta for e in events if e.type == "response.output_text.delta")


def test_deleting_a_running_background_response_cancels_it(fleet, client):
    """A background response deleted while it runs: its request is cancelled (nothing could
    read it), its log is gone and not made again, and a client streaming it gets an `error`
    event that ends the stream."""
    import openai

    before = _scheduler_cancels(fleet)
    events = _stream_long_reply(client, lambda rid: client.responses.delete(rid))
    assert events[-1].type == "error" and events[-1].code == "not_found", events[-1]
    rid = events[0].response.id
    _until(lambda: _scheduler_cancels(fleet) > before, what="its request being cancelled")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid, stream=True)


def test_a_cancel_that_reached_the_fleet_before_its_request_still_stops_it(fleet, client):
    """A cancel can reach the scheduler before the request it cancels, and find nothing to
    cancel there. The gateway running the response then finds it stored cancelled at its
    first token and cancels the request itself: the stream ends with `response.cancelled`
    and no text, instead of generating thousands of tokens for nobody."""
    import redis

    r = redis.Redis.from_url(fleet["redis"])
    before = _scheduler_cancels(fleet)
    events = []
    # A long prompt: its prefill leaves the test ample time to store the cancel first.
    with client.responses.create(model=MODEL, background=True, stream=True,
                                 **{**LONG_REPLY, "input": "hello " * 500 + LONG_REPLY["input"]}
                                 ) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.created":
                # As the cancel route stores it, but no cancel goes to the scheduler: as if
                # it had come and gone before the request.
                key = f"shoal:response:{event.response.id}"
                record = json.loads(r.get(key))
                record["response"]["status"] = "cancelled"
                r.set(key, json.dumps(record), keepttl=True)
    assert events[-1].type == "response.cancelled", events[-1]
    assert not [e for e in events if e.type == "response.output_text.delta"]
    _until(lambda: _scheduler_cancels(fleet) > before, what="its request being cancelled")


@pytest.mark.parametrize("query, param", [
    ({"stream": "true"}, "stream"),  # a foreground response has no log
    ({"starting_after": "3"}, "starting_after"),  # without stream
    ({"stream": "true", "starting_after": "-1"}, "starting_after"),
])
def test_streaming_a_response_again_needs_a_streamed_background_one(fleet, client, query,
                                                                   param):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    got = httpx.get(f"{fleet['url']}/v1/responses/{r.id}", params=query, timeout=30)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"].endswith(param), got.json()


def test_a_background_response_of_a_stopped_or_lost_gateway_fails(fleet, client):
    """A gateway that stops stores its background responses failed; one killed outright leaves
    them in progress, and the next read, by any gateway, finds its token channel without a
    listener, stores the response failed and cancels its request."""
    import signal

    from shoal.fleet import stop_all
    from tests.conftest import spawn_gateway

    for sig, message in ((signal.SIGTERM, "gateway stopped"), (signal.SIGKILL, "stopped before")):
        gateway, url = spawn_gateway(fleet)
        try:
            # Streamed: its client reads the first events and leaves; the run goes on.
            rid = None
            with httpx.stream("POST", url + "/v1/responses", timeout=30,
                              json={"background": True, "stream": True, **LONG_REPLY}) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        rid = rid or event["response"]["id"]
                        if event["type"] == "response.output_text.delta":
                            break
            assert client.responses.retrieve(rid).status == "in_progress"
            before = _scheduler_cancels(fleet)
            gateway.send_signal(sig)
            gateway.wait(timeout=30)
            failed = _until(lambda: (x := client.responses.retrieve(rid)).status != "in_progress"
                            and x, what="the response failing")
            assert failed.status == "failed" and message in failed.error.message, failed
            _until(lambda: _scheduler_cancels(fleet) > before, what="its request being cancelled")
            # Its events, streamed again by another gateway, end with the failure: logged by
            # the gateway that stopped, or by the reader that found it gone.
            events = list(client.responses.retrieve(rid, stream=True))
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert events[-1].type == "response.failed", events[-1]
            assert message in events[-1].response.error.message
        finally:
            stop_all([gateway])


def test_a_replay_that_loses_redis_ends_with_an_error_event():
    """Streaming a response again from a Redis that is gone ends the stream with an `error`
    event that says where to resume, not a broken connection."""
    import asyncio

    import redis.asyncio as aioredis

    from gateway.responses import ResponseStore
    from shoal.fleet import free_port
    from shoal.keys import Keys

    async def replay() -> list:
        client = aioredis.Redis(port=free_port())  # nothing listens there
        store = ResponseStore(lambda: client, Keys(), ttl_s=60)
        try:
            return [g async for g in store.replay("resp_1", 4, lambda request_id: None)]
        finally:
            await client.aclose()

    [(events, final)] = asyncio.run(replay())
    assert final and [e["type"] for e in events] == ["error"]
    assert events[0]["code"] == "server_error" and events[0]["sequence_number"] == 5
    assert "from sequence number 4" in events[0]["message"]
