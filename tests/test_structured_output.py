"""Structured outputs: constraints compiled and checked, masks applied on the real model, and the
API's `response_format` and `structured_outputs` through a real fleet."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import llguidance
import pytest
import torch

from shoal.messages import NewRequest, decode, encode
from shoal.sampling_params import InvalidSamplingParams, SamplingParams
from shoal.structured_output import (
    JSON_OBJECT,
    InvalidStructuredOutput,
    StructuredOutput,
)
from tests.conftest import make_engine
from worker import cpu_ops, ops
from worker.config import SpeculativeConfig
from worker.offline import generate

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
CITIES = ["Paris", "London", "Berlin", "New York"]
ANSWER = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'


def _chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def _matches(kind: str, text: str) -> bool:
    """The oracle of each case below, independent of llguidance."""
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(PHONE, text) is not None
    if kind == "choice":
        return text in CITIES
    return re.fullmatch(r"The answer is [0-9]{1,3}\.", text) is not None


CASES = [("json", StructuredOutput("json", json.dumps(PERSON)), "Make up a person."),
         ("regex", StructuredOutput("regex", PHONE), "Give me a phone number."),
         ("choice", StructuredOutput("choice", json.dumps(CITIES)), "Name a big city."),
         ("grammar", StructuredOutput("grammar", ANSWER), "What is 12 + 30?")]


# -- constraints --------------------------------------------------------------------------------

@pytest.mark.parametrize(("constraint", "complaint"), [
    (StructuredOutput("json", '{"type": "wat"}'), "wat"),
    (StructuredOutput("json", "[1, 2]"), "JSON Schema object"),
    (StructuredOutput("json", "{not json"), "not JSON"),
    (StructuredOutput("regex", "[a-"), "unclosed character class"),
    (StructuredOutput("choice", "[]"), "non-empty list"),
    (StructuredOutput("choice", '["a", 3]'), "non-empty list"),
    (StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_a_constraint_that_does_not_compile_is_refused_with_the_reason(constraint, complaint):
    with pytest.raises(InvalidStructuredOutput, match=complaint):
        constraint.check()


def test_constraints_that_compile_pass_and_kinds_are_checked():
    for _, constraint, _ in CASES:
        constraint.check()
    JSON_OBJECT.check()
    with pytest.raises(InvalidStructuredOutput, match="kind"):
        StructuredOutput("xml", "<a/>")


def test_a_constraint_crosses_the_wire_unchanged():
    params = SamplingParams(max_tokens=5, structured_output=StructuredOutput("regex", PHONE))
    back = decode(encode(NewRequest("r", [1, 2], params)))
    assert back.params == params and back.params.structured_output.spec == PHONE
    with pytest.raises(InvalidSamplingParams, match="structured_output"):
        SamplingParams.from_dict({**params.to_dict(), "structured_output": {"kind": "xml",
                                                                             "spec": ""}})


@pytest.mark.skipif(not cpu_ops.load(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize(("num_rows", "vocab", "words"), [(64, 49152, 1536), (5, 100, 3),
                                                          (3, 70, 3), (4, 49155, 1537)])
def test_the_bitmask_kernel_matches_its_reference_and_a_bit_by_bit_oracle(num_rows, vocab, words):
    g = torch.Generator().manual_seed(num_rows)
    logits = torch.randn(num_rows, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows - 1, words), dtype=torch.int32,
                            generator=g)
    bitmask[0, : words // 2] = -1  # words of all ones are skipped by the kernel
    bitmask[-1, words // 2:] = 0
    rows = torch.randperm(num_rows, generator=g)[: num_rows - 1]  # one row is not masked
    kernel, reference = logits.clone(), logits.clone()
    ops.apply_token_bitmask_(kernel, bitmask, rows, kernels=True)
    ops.apply_token_bitmask_(reference, bitmask, rows, kernels=False)
    assert torch.equal(kernel, reference)
    bits = [[(int(w) >> j) & 1 for w in row for j in range(32)] for row in bitmask.tolist()]
    oracle = logits.clone()
    for k, r in enumerate(rows.tolist()):
        keep = torch.tensor((bits[k] + [0] * vocab)[:vocab], dtype=torch.bool)
        oracle[r] = logits[r].masked_fill(~keep, float("-inf"))
    assert torch.equal(kernel, oracle)


# -- the engine on the real model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(fp32_model, model_path):
    return make_engine(fp32_model, model_path=model_path, keep_logits=True)


def _run(engine, ids, constraint, **params) -> tuple[list[int], str | None, str | None]:
    params = SamplingParams(**{"max_tokens": 48, "temperature": 0.0,
                               "structured_output": constraint, **params})
    out = generate(engine, [NewRequest("r", ids, params)])["r"]
    return out.token_ids, out.finish_reason, out.error


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_constraint_greedy_or_sampled(engine, tokenizer, case,
                                                               temperature):
    kind, constraint, question = case
    ids = _chat_ids(tokenizer, question)
    for seed in range(3 if temperature else 1):
        tokens, reason, error = _run(engine, ids, constraint, temperature=temperature, seed=seed,
                                     max_tokens=64)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert reason == "stop" and error is None, (reason, error, text)
        assert _matches(kind, text), text


def test_greedy_takes_the_most_likely_token_the_constraint_allows(engine, tokenizer):
    """At each step the greedy token is the first of the raw logits' order that llguidance
    accepts one token at a time (`validate_tokens`): the mask hides exactly what it should."""
    ids = _chat_ids(tokenizer, "Make up a person.")
    constraint = StructuredOutput("json", json.dumps(PERSON))
    engine.grammars._ready.wait()
    tokens: list[int] = []
    changed = 0  # steps whose raw argmax the constraint does not allow
    for step in range(12):
        params = SamplingParams(max_tokens=len(tokens) + 1, temperature=0.0,
                                structured_output=constraint)
        out = generate(engine, [NewRequest("r", ids, params, output_token_ids=tokens)])["r"]
        raw = engine.last_logits["r"]  # this one step's logits, before any mask
        matcher = llguidance.LLMatcher(engine.grammars._tokenizer, constraint.grammar())
        assert matcher.consume_tokens(tokens)
        for candidate in raw.argsort(descending=True).tolist():
            if matcher.validate_tokens([candidate]) == 1:
                break
        assert out.token_ids == [candidate], (step, tokenizer.decode(tokens))
        changed += raw.argmax().item() != candidate
        tokens.append(candidate)
        if out.finish_reason == "stop":
            break
    assert changed


def test_a_resumed_request_goes_on_as_if_never_moved(engine, tokenizer):
    ids = _chat_ids(tokenizer, "Make up a person.")
    constraint = StructuredOutput("json", json.dumps(PERSON))
    whole, reason, _ = _run(engine, ids, constraint)
    assert reason == "stop"
    params = SamplingParams(max_tokens=48, temperature=0.0, structured_output=constraint)
    rest = generate(engine, [NewRequest("r", ids, params, output_token_ids=whole[:7])])["r"]
    assert whole[:7] + rest.token_ids == whole
    broken = tokenizer.encode("hello", add_special_tokens=False)
    out = generate(engine, [NewRequest("r", ids, params, output_token_ids=broken)])["r"]
    assert out.finish_reason == "error" and "do not match" in out.error


# Two examples that make SmolLM2 think in `<think>` tags before a JSON answer.
THINKING = [
    {"role": "system", "content": "Think step by step inside <think></think>, then answer in "
                                  "JSON."},
    *[m for a, b in ((2, 3), (4, 4)) for m in (
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"<think>{a} plus {b} is {a + b}.</think>\n"
                                         f'{{"answer": {a + b}}}'})],
    {"role": "user", "content": "What is 6 plus 1?"},
]


def test_a_constraint_after_the_thinking_leaves_the_thinking_free(engine, tokenizer):
    """With `structured_output_after` the tokens up to the end of the thinking are the free
    run's, token for token, and what follows matches the constraint; forced from the first
    token, the same constraint leaves no room to think. A request resumed past the end of
    its thinking goes on as if never moved; one resumed before it, too."""
    from worker.structured_output import constrained_from

    assert constrained_from([5, 1, 2, 7], [1, 2]) == 3 and constrained_from([5, 1], [1, 2]) is None
    assert constrained_from([5], []) == 0
    ids = list(tokenizer.apply_chat_template(THINKING, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    free = generate(engine, [NewRequest("r", ids, SamplingParams(max_tokens=40,
                                                                 temperature=0.0))])["r"]
    thought_end = constrained_from(free.token_ids, end)
    assert thought_end is not None  # the model thought, and closed its thinking in those tokens
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=JSON_OBJECT,
                            structured_output_after=end)
    out = generate(engine, [NewRequest("r", ids, params)])["r"]
    assert out.finish_reason == "stop" and out.token_ids[:thought_end] == \
        free.token_ids[:thought_end]
    answer = tokenizer.decode(out.token_ids[thought_end:], skip_special_tokens=True)
    assert isinstance(json.loads(answer), dict)
    forced, _, _ = _run(engine, ids, JSON_OBJECT, max_tokens=40)
    assert "<think>" not in tokenizer.decode(forced)
    for k in (thought_end - 2, thought_end + 3):
        rest = generate(engine, [NewRequest("r", ids, params,
                                            output_token_ids=out.token_ids[:k])])["r"]
        assert out.token_ids[:k] + rest.token_ids == out.token_ids


def test_a_complete_constraint_ends_the_request_before_min_tokens(engine, tokenizer):
    ids = _chat_ids(tokenizer, "Name a big city.")
    tokens, reason, _ = _run(engine, ids, StructuredOutput("choice", json.dumps(CITIES)),
                             min_tokens=30)
    assert reason == "stop" and tokenizer.decode(tokens, skip_special_tokens=True) in CITIES


def test_constrained_requests_take_no_drafts_and_others_still_do(fp32_model, model_path,
                                                                 tokenizer):
    spec = SpeculativeConfig(num_speculative_tokens=4)
    engine = make_engine(fp32_model, model_path=model_path, speculative=spec)
    ids = tokenizer.encode("one two three four one two three four one two three",
                           add_special_tokens=False)
    constraint = StructuredOutput("regex", "( (one|two|three|four)){1,12}")
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_output=constraint)
    out = generate(engine, [NewRequest("r", ids, params)])["r"]
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert re.fullmatch("( (one|two|three|four)){1,12}", text) and engine.spec_draft_tokens == 0
    generate(engine, [NewRequest("p", ids, SamplingParams(max_tokens=12, temperature=0.0))])
    assert engine.spec_draft_tokens > 0


def test_an_engine_without_a_tokenizer_refuses_constrained_requests(fp32_model):
    engine = make_engine(fp32_model)
    out = generate(engine, [NewRequest("r", [1, 2, 3], SamplingParams(
        max_tokens=4, structured_output=JSON_OBJECT))])["r"]
    assert out.finish_reason == "error" and "no tokenizer" in out.error


# -- the API, through the fleet -----------------------------------------------------------------

def _sse_text(url: str, body: dict) -> tuple[str, str]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c.get("delta", {}).get("content") or c.get("text") or "" for c in choices)
    return text, choices[-1]["finish_reason"]


def test_response_format_and_structured_outputs_through_the_fleet(fleet):
    from openai import OpenAI

    client = OpenAI(base_url=fleet["url"] + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Make up a person."}],
        max_tokens=64, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": PERSON}})
    assert reply.choices[0].finish_reason == "stop"
    assert _matches("json", reply.choices[0].message.content)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Return a JSON object with one key, answer, "
                                              "holding the capital of France."}],
        response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)

    url = fleet["url"]
    body = {"prompt": "My phone number is", "max_tokens": 20, "temperature": 1.0, "seed": 5,
            "structured_outputs": {"regex": PHONE}, "n": 2}
    choices = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"]
    assert len(choices) == 2 and all(_matches("regex", c["text"]) for c in choices)
    body = {"messages": [{"role": "user", "content": "Name a big city."}], "max_tokens": 20,
            "structured_outputs": {"choice": CITIES}}
    text, reason = _sse_text(url + "/v1/chat/completions", body)
    assert reason == "stop" and text in CITIES
    body = {"prompt": "Question: what is 12 + 30?\n", "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"grammar": ANSWER}}
    text, reason = _sse_text(url + "/v1/completions", body)
    assert reason == "stop" and _matches("grammar", text)


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "unclosed character class"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "not permitted"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is given"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "wat"}}}},
     "response_format", "wat"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
])
def test_a_bad_constraint_gets_a_400_that_names_it(fleet, extra, param, message):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(fleet["url"] + path, json={**body, **extra}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error


def test_masks_built_during_a_short_forward_pass_are_waited_for(model_path, tokenizer):
    """With a forward pass far shorter than the masks (a small random model over SmolLM2's
    vocabulary, 48 requests of a letters-only regex), the engine waits for the mask thread
    before it reads a matcher (`min_tokens` asks whether each is complete): a matcher is lent to
    one caller at a time, and reading it mid-mask raised 'Already borrowed'."""
    from tests.conftest import random_weights, tiny_config
    from worker.config import EngineConfig
    from worker.engine import Engine

    cfg = tiny_config(vocab_size=49152, eos_token_id=tokenizer.eos_token_id)
    engine = Engine(cfg, random_weights(cfg), EngineConfig(dtype=torch.float32, block_size=4,
                                                           kv_cache_bytes=64 << 20),
                    model_path=model_path)
    constraint = StructuredOutput("regex", "[A-Za-z ,.]{1,400}")
    reqs = [NewRequest(f"r{i}", [10 + i, 20, 30], SamplingParams(
        max_tokens=6, min_tokens=3, temperature=1.0, seed=i, structured_output=constraint))
        for i in range(48)]
    for out in generate(engine, reqs).values():
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.error is None and re.fullmatch("[A-Za-z ,.]{1,400}", text), (out, text)
