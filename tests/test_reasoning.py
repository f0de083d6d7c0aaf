"""Reasoning outputs (`--reasoning-parser`): a reply's `<think>...</think>` becomes chat's
`reasoning`, a Responses reasoning item and a Messages thinking block, apart from the answer,
streamed or not; the split checked on texts cut at every place and, through a real fleet,
against the same greedy reply from a gateway without a parser."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from gateway.reasoning import Piece, Reasoning
from tests.conftest import extra_gateway
from tests.test_tools import _all, _pieces, _usage

REPLIES = [
    ("<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n", "\n\nIt is 4."),
    ("Two and two.</think>It is 4.", "Two and two.", "It is 4."),  # <think> was in the prompt
    ("  <think>a </thin b </think> c", "a </thin b ", " c"),
    ("<think></think>Only the answer.", None, "Only the answer."),
    ("<think>Cut short while thinking", "Cut short while thinking", None),
    ("No tags at all", "No tags at all", None),  # a model that does not think
    ("<thi", "<thi", None),
]


@pytest.mark.parametrize(("text", "thought", "answer"), REPLIES)
def test_a_reply_splits_into_thinking_and_answer_whole_or_in_pieces(text, thought, answer):
    """`split` and the streamed reader agree for pieces of every size: what could begin a tag
    is held back until the next piece tells, and the pieces join to the split's parts."""
    assert Reasoning.split(text) == (thought, answer)
    rng = random.Random(0)
    for size in (1, 2, 3, 5, None):
        reasoning, sent, end = Reasoning("deepseek_r1"), ["", ""], 0
        while end < len(text):
            piece = text[end:end + (size or rng.randint(1, 6))]
            end += len(piece)
            for k, part in enumerate(reasoning.feed(0, piece, end == len(text))):
                sent[k] += part
            if end < len(text):
                assert "<" not in sent[1] and not sent[0].endswith("<")  # tags held back
        assert (sent[0] or None, sent[1] or None) == (thought, answer)


def test_thinking_tokens_end_at_the_token_that_completes_the_tag_in_any_grouping():
    """Under `--stream-interval` > 1 one piece holds several tokens: the thinking counts up to
    the token whose text completes `</think>`, however the tokens are grouped; a plain `str`
    piece of several tokens counts whole (what the reader can know)."""
    tokens = ["<think>", "Two", " and", " two", ".</", "think", ">", "It", " is", " 4", "."]
    thinking = 7  # through ">"
    rng = random.Random(1)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(tokens)), rng.randint(0, 5)))
        reasoning, sent = Reasoning("deepseek_r1"), ["", ""]
        for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
            group = tokens[a:b]
            ends = [len("".join(group[:k + 1])) for k in range(len(group))]
            for k, part in enumerate(reasoning.feed(0, Piece.of("".join(group), ends),
                                                    b == len(tokens))):
                sent[k] += part
        assert reasoning.thinking_tokens(0) == thinking, cuts
        assert sent == ["Two and two.", "It is 4."]
    whole = Reasoning("deepseek_r1")
    whole.feed(0, "".join(tokens[:5]), False, 5)
    whole.feed(0, "".join(tokens[5:]), True, 6)
    assert whole.thinking_tokens(0) == len(tokens)


def test_qwen3_asked_not_to_think_answers_only():
    assert Reasoning.of("qwen3", {"enable_thinking": False}) is None
    assert Reasoning.of("qwen3", {"enable_thinking": True}) is not None
    assert Reasoning.of("deepseek_r1", {"enable_thinking": False}) is not None
    assert Reasoning.of(None, None) is None


def test_the_responses_and_messages_streams_put_the_thinking_first():
    """On the Responses and Messages APIs' streams the thinking streams as its own item or
    block at index 0, done before the answer's opens at 1; the items and blocks that stream
    are the unstreamed reply's, "auto" tool calls included."""
    from gateway.anthropic import MessageShape, MessagesRequest
    from gateway.responses import ResponseShape, ResponsesRequest
    from gateway.tools import ToolCalls

    text = '<think>Paris, so get_time.</think>Checking.<tool_call>{"name": "get_time", ' \
           '"arguments": {"timezone": "CET"}}</tool_call>'
    tool = {"type": "object", "properties": {"timezone": {"type": "string"}}}

    async def stored(_response) -> None:
        pass
    for tools in (False, True):
        req = ResponsesRequest(model="m", input="x", **(
            {"tools": [{"type": "function", "name": "get_time", "parameters": tool}]}
            if tools else {}))
        calls = ToolCalls.of(req.to_chat(req.items()), "hermes") if tools else None
        shape = ResponseShape(req, "m", calls, reasoning=Reasoning("deepseek_r1"))
        events = asyncio.run(_all(shape.events(_pieces(text), _usage, stored)))
        final = events[-1]["response"]["output"]
        thought = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
        assert len(thought) > 1 and "".join(thought) == "Paris, so get_time."
        assert final[0] == {"type": "reasoning", "id": shape.reasoning_id, "summary": [],
                            "content": [{"type": "reasoning_text", "text": "".join(thought)}],
                            "status": "completed"}
        assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final
        added = [(e["output_index"], e["item"]["type"]) for e in events
                 if e["type"] == "response.output_item.added"]
        assert added == [(0, "reasoning"), (1, "message")] + ([(2, "function_call")] if tools
                                                              else [])
        order = [(e["type"], e.get("output_index")) for e in events]
        assert order.index(("response.output_item.done", 0)) < \
            order.index(("response.output_item.added", 1))
        answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert answer == final[1]["content"][0]["text"] == ("Checking." if tools else
                                                           text.split("</think>")[1])
        assert all(e["output_index"] == 1 for e in events
                   if e["type"] == "response.output_text.delta")

        ask = MessagesRequest(model="m", max_tokens=64, messages=[{"role": "user",
                                                                   "content": "x"}],
                              **({"tools": [{"name": "get_time", "input_schema": tool}]}
                                 if tools else {}))
        calls = ToolCalls.of(ask.to_chat(), "hermes") if tools else None
        shape = MessageShape(ask, "m", calls, 3, Reasoning("deepseek_r1"))
        events = asyncio.run(_all(shape.events(_pieces(text), _usage)))
        starts = [(e["index"], e["content_block"]["type"]) for e in events
                  if e["type"] == "content_block_start"]
        assert starts == [(0, "thinking"), (1, "text")] + ([(2, "tool_use")] if tools else [])
        kinds = [(e["type"], e.get("index")) for e in events]
        assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))
        thinking = [e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                    and e["index"] == 0]
        assert len(thinking) > 1 and "".join(thinking) == "Paris, so get_time."
        body = shape.body(text, _last_event(text), None)
        assert body["content"][0] == {"type": "thinking", "thinking": "Paris, so get_time.",
                                      "signature": ""}
        assert [b["type"] for b in body["content"]] == [t for _, t in starts]
        assert events[-2]["delta"]["stop_reason"] == ("tool_use" if tools else "end_turn")


def test_a_grouped_event_keeps_its_answer_tokens_logprobs_on_the_responses_api():
    """At `--stream-interval` > 1 an event may hold the end of the thinking and the start of
    the answer: the message's logprobs are the answer's tokens exactly, in any grouping."""
    from gateway.responses import ResponseShape, ResponsesRequest
    from shoal.messages import TokenEvent

    tokens = ["<think>", "Two", ".</", "think", ">", "It", " is", " 4", "."]
    answer = tokens[5:]

    async def stored(_response) -> None:
        pass

    def grouped(size: int):
        async def run():
            for a in range(0, len(tokens), size):
                group = tokens[a:a + size]
                ends = [len("".join(group[:k + 1])) for k in range(len(group))]
                last = a + size >= len(tokens)
                yield Piece.of("".join(group), ends), TokenEvent(
                    "r", a, list(range(a, a + len(group))), [-0.1] * len(group),
                    finish_reason="stop" if last else None, prompt_tokens=3,
                    completion_tokens=len(tokens))
        return run()

    for size in (1, 2, 3, 4, 9):
        req = ResponsesRequest(model="m", input="x", include=["message.output_text.logprobs"])
        shape = ResponseShape(req, "m", None, lambda ev: [
            {"token": tokens[t], "logprob": lp, "bytes": [], "top_logprobs": []}
            for t, lp in zip(ev.token_ids, ev.logprobs)], Reasoning("deepseek_r1"))
        events = asyncio.run(_all(shape.events(grouped(size), _usage, stored)))
        reasoning, message = events[-1]["response"]["output"]
        assert reasoning["content"][0]["text"] == "Two."
        (text,) = message["content"]
        assert text["text"] == "".join(answer)
        assert [e["token"] for e in text["logprobs"]] == answer, size


def _last_event(text: str):
    from shoal.messages import TokenEvent

    return TokenEvent("r", len(text) - 1, [0], finish_reason="stop", prompt_tokens=3,
                      completion_tokens=len(text))


# A conversation that makes the real model think aloud in `<think>` tags, from two examples.
THINK = "Think step by step inside <think></think>, then answer."
ASKED = [
    *[m for a, b in ((2, 3), (4, 4)) for m in (
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"<think>{a} plus {b} is {a + b}.</think>"
                                         f"The answer is {a + b}."})],
    {"role": "user", "content": "What is 6 plus 1?"},
]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def thinking_gateway(fleet):
    """A gateway on the shared fleet with the deepseek_r1 reasoning parser."""
    with extra_gateway(fleet, "--reasoning-parser", "deepseek_r1") as url:
        yield url


def test_the_model_s_thinking_comes_apart_from_its_answer(fleet, thinking_gateway,
                                                          tokenizer):
    """Through the fleet, greedy: the reply a gateway without a parser returns whole comes
    from the parser's gateway as `reasoning` (and `reasoning_content`) and `content`, the two
    parts of that same text, streamed or not, with usage's `reasoning_tokens` the tokens up
    to the one that ends `</think>`; through the Responses API as a reasoning item and the
    message, which go back as input; through the Messages API as a thinking block and the
    text."""
    from anthropic import Anthropic
    from openai import OpenAI

    messages = [{"role": "system", "content": THINK}, *ASKED]
    ask = {"messages": messages, "max_tokens": 40, "temperature": 0}
    plain = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=120, json={
        **ask, "logprobs": True, "return_tokens_as_token_ids": True}).json()["choices"][0]
    raw = plain["message"]["content"]
    thought, answer = Reasoning.split(raw)
    assert raw.startswith("<think>") and thought and answer  # the model did think aloud
    ids = [int(t["token"].removeprefix("token_id:")) for t in plain["logprobs"]["content"]]
    thinking = next(m for m in range(len(ids) + 1) if "</think>" in tokenizer.decode(ids[:m]))

    client = OpenAI(base_url=thinking_gateway + "/v1", api_key="none")
    reply = client.chat.completions.create(model=MODEL, **ask)
    message = reply.choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == \
        (thought, thought, answer)
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **ask,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    assert streamed == thought and "".join(d.content or "" for d in deltas) == answer
    assert len([d for d in deltas if getattr(d, "reasoning", None)]) > 1
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking

    asked = {"model": MODEL, "instructions": THINK, "max_output_tokens": 40, "temperature": 0}
    response = client.responses.create(input=ASKED, **asked)
    item, _ = response.output
    assert item.type == "reasoning" and item.content[0].text == thought
    assert response.output_text == answer
    assert response.usage.output_tokens_details.reasoning_tokens == thinking
    for stream in (False, True):  # the message's logprobs are its answer's tokens, EOS too
        scored = client.responses.create(input=ASKED, **asked, stream=stream,
                                         include=["message.output_text.logprobs"])
        if stream:
            scored = list(scored)[-1].response
        (text,) = scored.output[1].content
        assert "".join(e.token for e in text.logprobs) == answer + tokenizer.eos_token
    events = list(client.responses.create(input=ASKED, stream=True, **asked))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        thought
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == thinking
    # The output goes back as input, its reasoning left out of the prompt, or by its id.
    more = [*ASKED, *[o.model_dump(exclude_none=True) for o in response.output],
            {"role": "user", "content": "And 2 plus 2?"}]
    again = client.responses.create(input=more, **asked)
    after = client.responses.create(previous_response_id=response.id,
                                    input="And 2 plus 2?", **asked)
    assert again.output_text == after.output_text

    anthropic = Anthropic(base_url=thinking_gateway, api_key="none", max_retries=0)
    said = {"model": MODEL, "system": THINK, "messages": ASKED, "max_tokens": 40,
            "extra_body": {"temperature": 0}}
    blocks = anthropic.messages.create(**said).content
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in blocks] == [("thinking", thought), ("text", answer)]
    with anthropic.messages.stream(**said) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in blocks]



def test_a_constrained_reply_thinks_first(fleet, thinking_gateway):
    """With a reasoning parser a constraint holds from the end of the thinking, as vLLM's:
    taught to think before a JSON answer, the model thinks as it does unconstrained and its
    answer is the JSON it writes unconstrained, through `response_format` and a named tool
    on chat and a JSON schema on the Responses API. Forced from the first token (no parser),
    the same constraint leaves no room to think."""
    from openai import OpenAI

    from tests.test_structured_output import THINKING

    ask = {"messages": THINKING, "max_tokens": 40, "temperature": 0}
    raw = httpx.post(fleet["url"] + "/v1/chat/completions", json=ask,
                     timeout=120).json()["choices"][0]["message"]["content"]
    thought, answer = Reasoning.split(raw)
    assert thought and isinstance(json.loads(answer), dict)
    forced = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=120, json={
        **ask, "response_format": {"type": "json_object"}}).json()["choices"][0]["message"]
    assert "<think>" not in forced["content"]

    client = OpenAI(base_url=thinking_gateway + "/v1", api_key="none")
    shaped = client.chat.completions.create(model=MODEL, response_format={
        "type": "json_object"}, **ask).choices[0].message
    assert shaped.reasoning == thought and json.loads(shaped.content) == json.loads(answer)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"]}
    called = client.chat.completions.create(model=MODEL, **ask, tools=[
        {"type": "function", "function": {"name": "give_answer", "parameters": schema}}],
        tool_choice={"type": "function", "function": {"name": "give_answer"}}).choices[0]
    (call,) = called.message.tool_calls
    assert called.message.reasoning == thought and called.message.content is None
    assert json.loads(call.function.arguments) == json.loads(answer)
    response = client.responses.create(
        model=MODEL, input=THINKING[1:], instructions=THINKING[0]["content"],
        max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert json.loads(response.output_text) == json.loads(answer)


def test_shoal_chat_shows_the_thinking_apart(fleet, thinking_gateway):
    """`shoal chat` writes the thinking a reasoning parser splits off to stderr and the answer
    to stdout: SmolLM2, asked plainly, never writes `</think>`, so deepseek_r1 reads its whole
    reply as thinking (a reply cut short mid-thought is all reasoning too)."""
    import subprocess

    from shoal.fleet import shoal_command

    ask = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16,
           "temperature": 0}
    raw = httpx.post(fleet["url"] + "/v1/chat/completions", json=ask,
                     timeout=120).json()["choices"][0]["message"]["content"]
    out = subprocess.run([*shoal_command(), "chat", "--url", thinking_gateway, "--max-tokens",
                          "16", "Name three colors."], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "</think>" not in raw
    assert out.stdout == "\n" and out.stderr == raw + "\n"


def test_the_cli_lists_the_parsers_the_gateway_has():
    from gateway import reasoning
    from shoal import cli

    assert cli.REASONING_PARSERS == list(reasoning.REASONING_PARSERS)
    args = cli.build_parser().parse_args(["up", "--reasoning-parser", "qwen3"])
    assert args.reasoning_parser == "qwen3"
